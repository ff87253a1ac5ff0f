package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"

	"go.uber.org/zap"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/elastic"
	"github.com/goddp/goddp/ddp/optim"
	"github.com/goddp/goddp/examples/transformer/model"
	"github.com/goddp/goddp/procgroup"
)

// elasticRun is what the epochs of an elastic job share: the job, the optimizer whose
// state it hands over, the first step of the epoch that runs, and whether the comm hook
// keeps a state of its own (--comm_hook powersgd), which each epoch's hook takes over.
type elasticRun struct {
	job      *elastic.Job
	opt      *optim.AdamW
	start    int64
	stateful bool
}

// trainElastic trains m under an elastic launcher (ddprun --nnodes MIN:MAX): with
// --global_batch_size in shards of --micro_batch_size, the data and dropout keyed by shard
// and step, the run has the same bits whatever the world size of each epoch; the state a
// survivor hands over is the parameters and AdamW's moments and step. With a --comm_hook
// the hook reduces the shards (internal/hookshards) and the bits depend on the world size;
// a hook's own state (powersgd's) is each member's, and goes with the job too.
func trainElastic(ctx context.Context, f flags, m *model.Model, log *zap.Logger, stdout io.Writer) error {
	switch {
	case f.shards() == 0:
		return errors.New("an elastic job (ddprun --nnodes MIN:MAX) needs --global_batch_size and --micro_batch_size: the batch of a step is fixed, not the batch of a rank")
	case f.checkpointDir != "":
		return errors.New("an elastic job (ddprun --nnodes MIN:MAX) keeps its state in memory: drop --checkpoint_dir")
	case f.zero > 0:
		return errors.New("an elastic job (ddprun --nnodes MIN:MAX) does not take --zero yet: its optimizer state is handed over whole")
	}
	job, err := elastic.Start(ctx, elastic.Options{Backend: f.backend, Shards: f.shards(), Logger: log})
	if err != nil {
		return fmt.Errorf("--global_batch_size %d / --micro_batch_size %d: %w", f.global, f.micro, err)
	}
	defer job.Close()
	opt, err := optim.NewAdamW(m.NumParams(), optim.AdamWOptions{LR: f.lr})
	if err != nil {
		return err
	}
	el := &elasticRun{job: job, opt: opt}
	st := job.State()
	ps := f.psgd
	ps.Seed = f.seed
	probe, err := ddp.CommHookNamed(f.commHook, ps)
	if err != nil {
		return err
	}
	if _, el.stateful = probe.(elastic.RankState); el.stateful {
		st.PerRank("comm_hook", ddp.DescribeHook(probe))
	}
	data := m.Data32()
	for _, p := range m.Params() {
		st.Float32(p.Name, data[p.Offset:p.Offset+p.Size], p.Shape...)
	}
	os := opt.State() // AdamW's own buffers and step count: a restore overwrites them in place
	for _, v := range os.Vectors {
		st.Float32(v.Name, v.Data)
	}
	st.Int64("adamw.step", os.Steps)
	for _, c := range [][2]string{
		{"--seed", strconv.FormatUint(f.seed, 10)}, {"--global_batch_size", strconv.Itoa(f.global)},
		{"--micro_batch_size", strconv.Itoa(f.micro)}, {"--lr", strconv.FormatFloat(f.lr, 'g', -1, 64)},
		{"--task", f.task}, {"--dropout", strconv.FormatFloat(f.dropout, 'g', -1, 64)},
		{"--seq_len", strconv.Itoa(f.seqLen)}, {"--comm_hook", f.commHook},
		{"steps", strconv.Itoa(f.warmup + f.bench)},
	} {
		st.Config(c[0], c[1])
	}
	err = job.Run(ctx, func(ctx context.Context, pg procgroup.ProcessGroup, start int64) error {
		el.start = start
		return trainEpoch(ctx, f, m, pg, log, stdout, el)
	})
	if errors.Is(err, elastic.ErrFinished) {
		fmt.Fprintln(stdout, "transformer: the job finished while this process waited to join it")
		return nil
	}
	return err
}

// attach gives the epoch's comm hook (d's, made with the epoch's DDP) the state of the
// hook it replaces, if it keeps one (Note [Elastic per-rank state]).
func (el *elasticRun) attach(ctx context.Context, d *ddp.DDP) error {
	if !el.stateful || d == nil {
		return nil
	}
	_, err := el.job.Attach(ctx, "comm_hook", d.CommHook().(elastic.RankState))
	return err
}

// begin gives an epoch its optimizer (the state restored in place) and its first step.
func (el *elasticRun) begin() (*optim.AdamW, int, error) { return el.opt, int(el.start), nil }

// commit records the state after a synced step.
func (el *elasticRun) commit(ctx context.Context, steps int) error {
	return el.job.Commit(ctx, int64(steps))
}
