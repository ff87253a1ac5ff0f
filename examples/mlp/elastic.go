package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/elastic"
	"github.com/goddp/goddp/internal/hookshards"
	"github.com/goddp/goddp/procgroup"
)

// runElastic is run under an elastic launcher (ddprun --nnodes MIN:MAX): the step's batch
// is --global_batch_size in shards of --micro_batch_size, so that the sum, and so the
// run, has the same bits whatever the world size of each epoch, and the state that a
// survivor hands over is the parameters and the data position (SGD has no state). With a
// --comm_hook the hook reduces the shards (hooked.go), the bits depend on the world size,
// and a stateful hook's state (powersgd's) is each member's own, restored in each epoch
// (elastic's Attach: Note [Elastic per-rank state]).
func runElastic(ctx context.Context, f flags, stdout io.Writer) error {
	switch {
	case f.shards() == 0:
		return errors.New("an elastic job (ddprun --nnodes MIN:MAX) needs --global_batch_size and --micro_batch_size: the batch of a step is fixed, not the batch of a rank")
	case f.noDDP || f.checkpointDir != "" || f.stepsPerRank != nil || f.zero > 0 || f.optimizer != "sgd":
		return errors.New("an elastic job (ddprun --nnodes MIN:MAX) takes neither --no_ddp, --checkpoint_dir, --steps_per_rank, --zero nor an --optimizer other than sgd")
	}
	job, err := elastic.Start(ctx, elastic.Options{Backend: f.backend, Shards: f.shards(), Report: stdout}) // the changes among the steps
	if err != nil {
		return fmt.Errorf("--global_batch_size %d / --micro_batch_size %d: %w", f.global, f.micro, err)
	}
	defer job.Close()
	m := newMLP(f.hidden, f.task.in, f.task.out, f.seed)
	var next int64 // the data position, in global samples
	st := job.State()
	shapes := m.shapes()
	for i, p := range m.params {
		st.Float32(m.names[i], p, shapes[i]...)
	}
	st.Int64("data.next_sample", &next)
	f.psgd.Seed = f.seed
	probe, err := ddp.CommHookNamed(f.commHook, f.psgd)
	if err != nil {
		return err
	}
	_, stateful := probe.(elastic.RankState)
	if stateful {
		st.PerRank("comm_hook", ddp.DescribeHook(probe))
	}
	for _, c := range [][2]string{
		{"--seed", strconv.FormatUint(f.seed, 10)}, {"--global_batch_size", strconv.Itoa(f.global)},
		{"--micro_batch_size", strconv.Itoa(f.micro)}, {"--lr", strconv.FormatFloat(f.lr, 'g', -1, 64)},
		{"--steps", strconv.Itoa(f.steps)}, {"--comm_hook", f.commHook},
	} {
		st.Config(c[0], c[1])
	}
	err = job.Run(ctx, func(ctx context.Context, pg procgroup.ProcessGroup, start int64) error {
		params := make([]ddp.Param, nParams)
		for i := range params {
			params[i] = ddp.Param{Name: m.names[i], Data: m.params[i], Grad: m.grads[i]}
		}
		params[w1].Shape = []int{f.hidden, m.in}
		if m.out > 1 {
			params[w2].Shape = m.shapes()[w2]
		}
		hook, err := ddp.CommHookNamed(f.commHook, f.psgd) // a hook serves one DDP: one per epoch
		if err != nil {
			return err
		}
		d, err := ddp.New(ctx, pg, params, ddp.Options{BucketCapMB: f.bucketMB, FirstBucketCapMB: f.firstMB, Shards: hookshards.Options(f.commHook, f.shards()), CommHook: hook})
		if err != nil {
			return err
		}
		defer d.Close()
		if stateful {
			kept, err := job.Attach(ctx, "comm_hook", hook.(elastic.RankState))
			if err != nil {
				return err
			}
			if pg.Rank() == 0 {
				fmt.Fprintf(stdout, "mlp: --comm_hook %s: its state restored from %d of the %d members' copies\n", f.commHook, kept, pg.Size())
			}
		}
		err = trainShards(ctx, f, pg, d, m, int(start), &next, stdout, func(step int) error {
			return job.Commit(ctx, int64(step+1))
		})
		if plan := d.AutoPlan(); err == nil && plan != nil && pg.Rank() == 0 { // --comm_hook auto
			fmt.Fprintln(stdout, plan.String())
		}
		return err
	})
	if errors.Is(err, elastic.ErrFinished) {
		fmt.Fprintln(stdout, "mlp: the job finished while this process waited to join it")
		return nil
	}
	if err != nil {
		return err
	}
	return report(f, m, job.Rank() == 0, stdout)
}
