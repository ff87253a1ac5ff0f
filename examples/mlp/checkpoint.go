package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/checkpoint"
	"github.com/goddp/goddp/procgroup"
)

// ckpt is the run's --checkpoint_dir: the parameters, the optimizer's whole state (none
// for plain SGD; at --zero 1 and 2 gathered from the ranks' shards before each save, so
// that any --zero and world size resumes it), the data position (the next sample of
// the run, counted over the global batch) and, with --comm_hook powersgd, each rank's
// state of the hook (ddp/checkpoint's PerRank) in a ddp/checkpoint. A nil *ckpt checkpoints
// nothing.
type ckpt struct {
	c     *checkpoint.Checkpointer
	opt   *stepper
	every int
	steps int
}

// afterStep, when set (by the tests), runs on every rank after each step and its
// checkpoint.
var afterStep func(rank, step int)

// restoreCkpt registers m and *next with a checkpoint in --checkpoint_dir and resumes from
// its newest file (with --resume, or on a launcher's restart). It returns the step to start
// from; every rank of pg must call it.
func restoreCkpt(ctx context.Context, f flags, pg procgroup.ProcessGroup, m *mlp, opt *stepper, next *int64, stdout io.Writer) (*ckpt, int, error) {
	if f.checkpointDir == "" {
		return nil, 0, nil
	}
	// A skipped (corrupt) checkpoint is a warning on stderr.
	log := zap.New(zapcore.NewCore(zapcore.NewConsoleEncoder(zap.NewDevelopmentEncoderConfig()), zapcore.Lock(os.Stderr), zap.WarnLevel))
	c, err := checkpoint.New(pg, checkpoint.Options{Dir: f.checkpointDir, Resume: f.resume, Logger: log})
	if err != nil {
		return nil, 0, err
	}
	shapes := m.shapes()
	for i, p := range m.params {
		c.Float32(m.names[i], p, shapes[i]...)
	}
	c.Int64("data.next_sample", next)
	if len(opt.full.Vectors) > 0 {
		for _, v := range opt.full.Vectors {
			c.Float32("opt."+v.Name, v.Data)
		}
		c.Int64("opt.steps", opt.full.Steps)
	}
	if opt.d != nil { // PowerSGD's error feedback, each rank's own (Note [PowerSGD checkpoints])
		if s, ok := opt.d.CommHook().(checkpoint.RankState); ok {
			c.PerRank("comm_hook", ddp.DescribeHook(opt.d.CommHook()), s)
		}
	}
	c.Config("--seed", strconv.FormatUint(f.seed, 10))
	if f.shards() > 0 {
		// The data of a step and the sum of its shards do not depend on the world size.
		c.Config("--global_batch_size", strconv.Itoa(f.global))
		c.Config("--micro_batch_size", strconv.Itoa(f.micro))
	} else {
		world := 1
		if pg != nil {
			world = pg.Size()
		}
		c.Config("--batch_size", strconv.Itoa(f.batch))
		c.Config("--accum_steps", strconv.Itoa(f.accum))
		c.Config("world size", strconv.Itoa(world))
	}
	start, err := c.Restore(ctx)
	if err != nil {
		return nil, 0, fmt.Errorf("--checkpoint_dir: %w", err)
	}
	if start > 0 {
		if err := opt.afterRestore(); err != nil {
			return nil, 0, fmt.Errorf("--checkpoint_dir: the optimizer's state: %w", err)
		}
	}
	if start > 0 && (pg == nil || pg.Rank() == 0) {
		fmt.Fprintf(stdout, "resumed from step %d\n", start)
	}
	return &ckpt{c: c, opt: opt, every: f.ckptEvery, steps: f.steps}, int(start), nil
}

// after saves the checkpoint after step if one is due (every --checkpoint_every steps and
// after the last).
func (k *ckpt) after(ctx context.Context, rank, step int) error {
	if k != nil && ((step+1)%k.every == 0 || step+1 == k.steps) {
		if err := k.opt.beforeSave(ctx); err != nil { // every rank
			return err
		}
		if err := k.c.SaveContext(ctx, int64(step+1)); err != nil { // every rank: a comm hook's state is gathered
			return err
		}
	}
	if afterStep != nil {
		afterStep(rank, step)
	}
	return nil
}
