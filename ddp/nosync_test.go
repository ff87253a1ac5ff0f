package ddp

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestNoSyncSemantics checks what the package doc says of NoSync, on 2 ranks with 3
// parameters in buckets of one parameter each (so that the order matters):
//   - Param.Grad is not written by GradReady, by a NoSync pass, by its Finalize, or by a
//     synced pass before its Finalize;
//   - the synced Finalize leaves there the micro-batches' gradients summed (not averaged)
//     over the micro-batches and averaged over the ranks;
//   - the trainer may pass Param.Grad itself to GradReady and overwrite it in the next
//     micro-batch;
//   - GradReady orders that differ from registration order, between ranks and between
//     steps (before and after the rebuild) give the same result, and both ranks issue the
//     same collectives.
func TestNoSyncSemantics(t *testing.T) {
	const size, accum, steps, n = 2, 3, 3, 4
	const sentinel = 1234
	c := pgtest.NewCluster(size)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// grad(rank, step, micro, param) is one micro-batch's gradient: small integers, so that
	// every sum below is exact in float32.
	grad := func(rank, step, micro, p int) []float32 {
		g := make([]float32, n)
		for k := range g {
			g[k] = float32((rank+1)*(k+1) + 10*micro + 100*p + step)
		}
		return g
	}
	// The GradReady order of each rank, step and micro-batch.
	orders := [][]int{{2, 1, 0}, {0, 1, 2}, {1, 2, 0}, {2, 0, 1}}
	order := func(rank, step, micro int) []int { return orders[(rank+2*step+micro)%len(orders)] }

	err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		params := make([]Param, 3)
		for p := range params {
			params[p] = Param{Name: fmt.Sprint("p", p), Data: make([]float32, n), Grad: make([]float32, n)}
		}
		d, err := New(ctx, pg, params, Options{BucketCapMB: 4 * n / float64(1<<20), FirstBucketCapMB: 4 * n / float64(1<<20)})
		if err != nil {
			return err
		}
		defer d.Close()
		if nb := len(d.r.Buckets()); nb != 3 {
			return fmt.Errorf("%d buckets, want 3 (one per parameter)", nb)
		}
		untouched := func(when string) error {
			for p := range params {
				if p == 0 { // p0's Grad is the trainer's scratch space
					continue
				}
				g := params[p].Grad.([]float32)
				for _, v := range g {
					if v != sentinel {
						return fmt.Errorf("rank %d %s: Param.Grad of p%d is %v, want it untouched (%v)", rank, when, p, g, float32(sentinel))
					}
				}
			}
			return nil
		}
		for step := range steps {
			for p := range params {
				for k := range n {
					params[p].Grad.([]float32)[k] = sentinel
				}
			}
			for micro := range accum {
				mode := Accumulate
				if micro == accum-1 {
					mode = Sync
				}
				d.BeginBackward(mode)
				for _, p := range order(rank, step, micro) {
					if p == 0 { // the trainer computes into Param.Grad itself and reports it
						copy(params[0].Grad.([]float32), grad(rank, step, micro, 0))
						if err := d.GradReady(0, params[0].Grad.([]float32)); err != nil {
							return err
						}
						continue
					}
					if err := d.GradReady(p, grad(rank, step, micro, p)); err != nil {
						return err
					}
				}
				if err := untouched(fmt.Sprintf("step %d micro-batch %d, before Finalize", step, micro)); err != nil {
					return err
				}
				if micro < accum-1 && micro%2 == 0 { // Finalize after NoSync is optional
					if err := d.Finalize(ctx); err != nil {
						return err
					}
					if err := untouched(fmt.Sprintf("step %d micro-batch %d, after its NoSync Finalize", step, micro)); err != nil {
						return err
					}
				}
			}
			if err := d.Finalize(ctx); err != nil {
				return err
			}
			for p := range params {
				want := make([]float32, n)
				for r := range size {
					for micro := range accum {
						for k, v := range grad(r, step, micro, p) {
							want[k] += v / size
						}
					}
				}
				if got := params[p].Grad.([]float32); !slices.Equal(got, want) {
					return fmt.Errorf("rank %d step %d: Param.Grad of p%d after the synced Finalize is %v, want %v (sum over micro-batches, mean over ranks)", rank, step, p, got, want)
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.EqualFunc(c.Issued(0), c.Issued(1), func(a, b pgtest.Record) bool { return fmt.Sprint(a) == fmt.Sprint(b) }) {
		t.Fatalf("ranks issued different collectives:\n%v\n%v", c.Issued(0), c.Issued(1))
	}
}
