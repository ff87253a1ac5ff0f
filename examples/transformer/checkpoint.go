package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"go.uber.org/zap"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/checkpoint"
	"github.com/goddp/goddp/ddp/optim"
	"github.com/goddp/goddp/examples/transformer/model"
	"github.com/goddp/goddp/procgroup"
)

// Note [Checkpoints]: with --checkpoint_dir the trainer's state is a ddp/checkpoint
// (see its package doc): rank 0 writes step<S>.ckpt every --checkpoint_every steps and after
// the last one, keeping the two newest, and every rank resumes from the newest readable
// one, on a launcher's restart (TORCHELASTIC_RESTART_COUNT > 0) or with --resume. The
// state is the parameters (one tensor each, with its shape), AdamW's moments and step
// count, and the step. The step is also the data and RNG position: the model draws the data
// and the dropout masks from (seed, global sample index, step). The global sample index
// depends on the world size here (micro-batch mb of rank r holds samples (mb·world + r)·B …),
// through world × accum only: a step's samples are 0 … world·accum·B−1 whatever the split. So
// --seed, --batch_size and world size × --accum_steps are registered settings, and a
// checkpoint written with others is refused, naming them; 2 ranks resume 1 rank's file
// with --accum_steps 2, or the reverse. With --global_batch_size shard s
// holds the samples s·micro … at every world size and the shards are summed in shard
// order, so --seed, --global_batch_size and --micro_batch_size are the settings, not the
// world size: the file resumes at any world size that divides the shards.

// ckpt is a rank's registered state, in the checkpointer c.
type ckpt struct {
	c *checkpoint.Checkpointer
}

// newCkpt registers m's parameters and opt's state with a checkpoint in --checkpoint_dir.
func newCkpt(f flags, w world, pg procgroup.ProcessGroup, m *model.Model, opt *optim.AdamW, log *zap.Logger) (*ckpt, error) {
	c, err := checkpoint.New(pg, checkpoint.Options{Dir: f.checkpointDir, Resume: f.resume, Getenv: f.getenv, Logger: log})
	if err != nil {
		return nil, err
	}
	data := m.Data32()
	for _, p := range m.Params() {
		c.Float32(p.Name, data[p.Offset:p.Offset+p.Size], p.Shape...)
	}
	k := &ckpt{c: c}
	if opt != nil {
		st := opt.State() // AdamW's own buffers and step count: Restore overwrites them in place
		for _, v := range st.Vectors {
			c.Float32(v.Name, v.Data)
		}
		c.Int64("adamw.step", st.Steps)
	}
	c.Config("--seed", strconv.FormatUint(f.seed, 10))
	if f.shards() > 0 {
		// Shard s of a step holds the same samples at every world size, and their sum does
		// not depend on it either: the file resumes at any world size that divides L.
		c.Config("--global_batch_size", strconv.Itoa(f.global))
		c.Config("--micro_batch_size", strconv.Itoa(f.micro))
	} else {
		c.Config("world size × --accum_steps", strconv.Itoa(w.size*f.accum))
		c.Config("--batch_size", strconv.Itoa(f.batch))
	}
	return k, nil
}

// restore loads the newest checkpoint (Note [Checkpoints]) and returns the step to start
// from (0: a fresh start). With ddp every rank must call it.
func (k *ckpt) restore(ctx context.Context, f flags, w world) (int, error) {
	start, err := k.c.Restore(ctx)
	if errors.Is(err, checkpoint.ErrExists) {
		return 0, fmt.Errorf("rank %d: %w: pass --resume to continue from them, or use an empty --checkpoint_dir", w.rank, err)
	}
	if err != nil {
		return 0, err
	}
	return int(start), nil
}

// commHook registers d's comm hook's state, if it keeps one (--comm_hook powersgd: each
// rank's error feedback and the shared factors, Note [PowerSGD checkpoints] in package
// reducer), before restore. A nil d (alone, without ddp) has none.
func (k *ckpt) commHook(d *ddp.DDP) {
	if d == nil {
		return
	}
	if s, ok := d.CommHook().(checkpoint.RankState); ok {
		k.c.PerRank("comm_hook", ddp.DescribeHook(d.CommHook()), s)
	}
}

// save writes the checkpoint of step (the step to continue from) on rank 0. With a comm
// hook's state every rank calls it: the ranks' states are gathered into rank 0's file.
func (k *ckpt) save(ctx context.Context, step int) error {
	return k.c.SaveContext(ctx, int64(step))
}
