// Package ddptest runs small DDP trainings for the tests of the packages that observe one
// (observe, metrics), and holds the numeric helpers of the tests around ddp (package ddp's
// own tests cannot import it, since it imports ddp, and keep their copies).
package ddptest

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// ToF64 widens v to float64.
func ToF64[T float32 | float64](v []T) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

// CloseTo reports the first index where got and want differ by more than tol·(1+|want|).
func CloseTo[T float32 | float64](got []T, want []float64, tol float64) error {
	if len(got) != len(want) {
		return fmt.Errorf("length %d, want %d", len(got), len(want))
	}
	for i := range want {
		if math.Abs(float64(got[i])-want[i]) > tol*(1+math.Abs(want[i])) {
			return fmt.Errorf("[%d] = %v, want %v", i, got[i], want[i])
		}
	}
	return nil
}

// RandF32 returns n normal deviates.
func RandF32(r *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.NormFloat64())
	}
	return v
}

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
			ps[i] = ddp.Param{Name: fmt.Sprintf("layer%d.w", i), Data: RandF32(r, n), Grad: make([]float32, n)}
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
				if err := d.GradReady(i, RandF32(r, sizes[i])); err != nil {
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
