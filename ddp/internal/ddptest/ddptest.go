// Package ddptest runs small DDP trainings for the tests of the packages that observe one
// (observe, metrics). The numeric helpers of the tests around ddp are in package numtest.
package ddptest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/internal/numtest"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// Run trains a small model (five float32 parameters, small buckets) for steps synced passes
// on a pgtest cluster of size ranks. Before each pass, rank slow sleeps lag (no rank when
// slow < 0). setup (if set) is called on every rank after New; each is called on every rank
// after every Finalize, with the pass's stats. An error fails t.
func Run(t testing.TB, size, steps, slow int, lag time.Duration, opts ddp.Options,
	setup func(rank int, d *ddp.DDP) error, each func(rank, step int, d *ddp.DDP, st *ddp.IterStats) error) {
	t.Helper()
	sizes := []int{40, 24, 64, 8, 32}
	c := pgtest.NewCluster(size)
	defer c.Close()
	if opts.BucketCapMB == 0 {
		opts.BucketCapMB, opts.FirstBucketCapMB = 200.0/(1<<20), 100.0/(1<<20) // several buckets
	}
	err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		r := rand.New(rand.NewPCG(uint64(rank), 5))
		ps := make([]ddp.Param, len(sizes))
		for i, n := range sizes {
			ps[i] = ddp.Param{Name: fmt.Sprintf("layer%d.w", i), Data: numtest.RandF32(r, n), Grad: make([]float32, n)}
		}
		d, err := ddp.New(context.Background(), pg, ps, opts)
		if err != nil {
			return err
		}
		defer d.Close()
		if setup != nil {
			if err := setup(rank, d); err != nil {
				return err
			}
		}
		for s := 0; s < steps; s++ {
			if rank == slow {
				time.Sleep(lag)
			}
			d.BeginBackward(ddp.Sync)
			for i := len(sizes) - 1; i >= 0; i-- { // reverse order, as backward does
				if opts.FindUnusedParameters && i == 1 {
					continue
				}
				if err := d.GradReady(i, numtest.RandF32(r, sizes[i])); err != nil {
					return err
				}
			}
			if err := d.Finalize(context.Background()); err != nil {
				return fmt.Errorf("step %d: %w", s, err)
			}
			if err := each(rank, s, d, d.Stats()); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
