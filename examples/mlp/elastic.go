package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/elastic"
	"github.com/goddp/goddp/procgroup"
)

// runElastic is run under an elastic launcher (ddprun --nnodes MIN:MAX): the step's batch
// is --global_batch_size in shards of --micro_batch_size, so that the sum, and so the
// run, has the same bits whatever the world size of each epoch, and the state that a
// survivor hands over is the parameters and the data position (SGD has no state).
func runElastic(ctx context.Context, f flags, stdout io.Writer) error {
	switch {
	case f.shards() == 0:
		return errors.New("an elastic job (ddprun --nnodes MIN:MAX) needs --global_batch_size and --micro_batch_size: the batch of a step is fixed, not the batch of a rank")
	case f.commHook == "powersgd":
		return errors.New("an elastic job (ddprun --nnodes MIN:MAX) does not take --comm_hook powersgd yet: its error feedback is not handed over, so a change would alter the run")
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
		f.psgd.Seed = f.seed
		hook, err := ddp.CommHookNamed(f.commHook, f.psgd)
		if err != nil {
			return err
		}
		d, err := ddp.New(ctx, pg, params, ddp.Options{BucketCapMB: f.bucketMB, FirstBucketCapMB: f.firstMB, Shards: f.shards(), CommHook: hook})
		if err != nil {
			return err
		}
		defer d.Close()
		return trainShards(ctx, f, pg, d, m, int(start), &next, stdout, func(step int) error {
			return job.Commit(ctx, int64(step+1))
		})
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
