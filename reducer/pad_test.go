package reducer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// padHook all-reduces, and records each bucket it launches whose buffer's length is not a
// multiple of k.
type padHook struct {
	k   int
	mu  sync.Mutex
	bad []string
	n   int // buckets launched
}

func (h *padHook) Launch(ctx context.Context, pg procgroup.ProcessGroup, b *BucketView) procgroup.Work {
	buf := b.Buffer.([]float32)
	h.mu.Lock()
	h.n++
	if len(buf)%h.k != 0 {
		h.bad = append(h.bad, fmt.Sprintf("bucket %d: %d elements", b.Index, len(buf)))
	}
	h.mu.Unlock()
	return pg.AllReduce(ctx, buf, procgroup.Sum)
}

func (h *padHook) Finish(*BucketView) error { return nil }

// TestPadBuckets: with PadBuckets 3 on 3 ranks every bucket's buffer is a multiple of 3
// elements, its padding reads zero after each step, and the gradients are the average
// computed in float64.
func TestPadBuckets(t *testing.T) {
	ctx := testCtx(t)
	const n, steps = 3, 3
	lens := []int{5, 1, 7, 4, 11, 2}
	rng := rand.New(rand.NewPCG(11, 12))
	grads := make([][][][]float32, n) // [rank][step][param]
	for r := range grads {
		grads[r] = make([][][]float32, steps)
		for s := range grads[r] {
			for _, l := range lens {
				g := make([]float32, l)
				for k := range g {
					g[k] = float32(rng.NormFloat64())
				}
				grads[r][s] = append(grads[r][s], g)
			}
		}
	}
	c := pgtest.NewCluster(n)
	defer c.Close()
	out := make([][]Param, n)
	hooks := make([]*padHook, n)
	var padErr [n]error
	errs := runRanks(n, func(rank int) error {
		hooks[rank] = &padHook{k: n}
		params := make([]Param, len(lens))
		for p, l := range lens {
			params[p] = Param{Name: fmt.Sprintf("w%d", p), Grad: make([]float32, l)}
		}
		out[rank] = params
		r, err := New(c.Group(rank), params, Options{BucketCapMB: 20.0 / (1 << 20), FirstBucketCapMB: 8.0 / (1 << 20), CommHook: hooks[rank], PadBuckets: n})
		if err != nil {
			return err
		}
		defer r.Close()
		for s := range steps {
			_ = r.BeginBackward(Sync)
			for p := len(lens) - 1; p >= 0; p-- {
				if err := r.GradReady(p, grads[rank][s][p]); err != nil {
					return err
				}
			}
			if err := r.Finalize(ctx); err != nil {
				return err
			}
			for b, bk := range r.Buckets() {
				buf := r.slots[b].f32
				for k := bk.Len; k < len(buf); k++ {
					if buf[k] != 0 && padErr[rank] == nil {
						padErr[rank] = fmt.Errorf("step %d bucket %d: padding element %d of %d is %v", s, b, k, len(buf), buf[k])
					}
				}
			}
			if s < steps-1 {
				continue
			}
			for p, l := range lens {
				for k := range l {
					want := 0.0
					for q := range n {
						want += float64(grads[q][s][p][k]) / n
					}
					if got := params[p].Grad.([]float32)[k]; math.Abs(float64(got)-want) > 1e-6*(1+math.Abs(want)) {
						return fmt.Errorf("param %d[%d] = %v, want %v", p, k, got, want)
					}
				}
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
		if padErr[r] != nil {
			t.Fatalf("rank %d: %v", r, padErr[r])
		}
		if h := hooks[r]; len(h.bad) > 0 || h.n < 2*steps {
			t.Fatalf("rank %d: %d buckets launched; not padded to %d: %v", r, h.n, n, h.bad)
		}
	}
	if _, err := New(c.Group(0), []Param{{Name: "a", Grad: make([]float32, 3)}}, Options{PadBuckets: -1}); err == nil {
		t.Fatal("PadBuckets -1 accepted")
	}
}

// TestScratchBucket: a padded host bucket is lent between passes only (not in a backward,
// not while an Accumulate pass's gradients wait in the buckets), and what the borrower
// writes there is never reduced: with every lent bucket filled with 1e9 but its padding,
// the next synced pass (alone, or after an Accumulate pass) averages its own gradients.
func TestScratchBucket(t *testing.T) {
	ctx := testCtx(t)
	const n = 2
	lens := []int{5, 1, 7, 4, 11, 2}
	grad := func(rank, s, p, k int) float32 { return float32(rank+1)*0.5 + float32(s*100+p*10+k)*0.25 }
	c := pgtest.NewCluster(n)
	defer c.Close()
	errs := runRanks(n, func(rank int) error {
		params := make([]Param, len(lens))
		for p, l := range lens {
			params[p] = Param{Name: fmt.Sprintf("w%d", p), Grad: make([]float32, l)}
		}
		r, err := New(c.Group(rank), params, Options{BucketCapMB: 20.0 / (1 << 20), FirstBucketCapMB: 8.0 / (1 << 20), PadBuckets: n})
		if err != nil {
			return err
		}
		defer r.Close()
		pass := func(mode Mode, s int) error {
			if err := r.BeginBackward(mode); err != nil {
				return err
			}
			if _, ok := r.ScratchBucket(0); ok {
				return fmt.Errorf("step %d: a bucket lent during a backward", s)
			}
			for p := len(lens) - 1; p >= 0; p-- {
				g := make([]float32, lens[p])
				for k := range g {
					g[k] = grad(rank, s, p, k)
				}
				if err := r.GradReady(p, g); err != nil {
					return err
				}
			}
			return r.Finalize(ctx)
		}
		lend := func(s int) error {
			for b, bk := range r.Buckets() {
				buf, ok := r.ScratchBucket(b)
				if !ok || len(buf)%n != 0 || len(buf) < bk.Len {
					return fmt.Errorf("step %d: bucket %d: lent %t, %d elements for %d", s, b, ok, len(buf), bk.Len)
				}
				for k := range buf[:bk.Len] {
					buf[k] = 1e9
				}
			}
			return nil
		}
		for s := range 4 {
			accum := s == 3 // step 3 begins with an Accumulate pass (as step 30)
			if accum {
				if err := pass(Accumulate, 30); err != nil {
					return err
				}
				if _, ok := r.ScratchBucket(0); ok {
					return errors.New("a bucket lent while an Accumulate pass's gradients wait in it")
				}
			}
			if err := pass(Sync, s); err != nil {
				return err
			}
			for p, l := range lens {
				for k := range l {
					want := 0.0
					for q := range n {
						want += float64(grad(q, s, p, k)) / n
						if accum {
							want += float64(grad(q, 30, p, k)) / n
						}
					}
					if got := params[p].Grad.([]float32)[k]; math.Abs(float64(got)-want) > 1e-5*(1+math.Abs(want)) {
						return fmt.Errorf("step %d: param %d[%d] = %v, want %v", s, p, k, got, want)
					}
				}
			}
			if err := lend(s); err != nil {
				return err
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
}
