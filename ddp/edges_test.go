package ddp

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	_ "github.com/goddp/goddp/backends/gloo" // registers the "gloo" backend

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// stepGrads returns rank's gradients of one micro-step, in float64: random, and a function
// of (seed, step, micro, rank) only, so that the reference can compute them again.
func stepGrads(seed uint64, step, micro, rank int, lens []int) [][]float64 {
	r := rand.New(rand.NewPCG(seed, uint64(step*1000+micro*100+rank)))
	g := make([][]float64, len(lens))
	for p, n := range lens {
		g[p] = randF64(r, n)
	}
	return g
}

// edgeModel is a model of random lengths whose parameter p is float64 where f64[p] is set.
type edgeModel struct {
	lens []int
	f64  []bool
}

func (m edgeModel) params() []Param {
	ps := make([]Param, len(m.lens))
	for p, n := range m.lens {
		ps[p] = Param{Name: fmt.Sprintf("w%d", p), Data: make([]float32, n), Grad: make([]float32, n)}
		if m.f64[p] {
			ps[p].Data, ps[p].Grad = make([]float64, n), make([]float64, n)
		}
	}
	return ps
}

// report reports rank's gradients g of one micro-step, in reverse parameter order, each
// converted to the parameter's type.
func (m edgeModel) report(d *DDP, g [][]float64) error {
	for p := len(g) - 1; p >= 0; p-- {
		var err error
		if m.f64[p] {
			err = d.GradReady64(p, g[p])
		} else {
			err = d.GradReady(p, to32(g[p]))
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// want is the reference for synced step s, computed apart from the DDP in float64: factor
// × the sum over its micro micro-steps of the mean over the R ranks of their gradients
// (stepGrads; a float32 parameter's rounded to float32 first, as the ranks reported them).
func (m edgeModel) want(seed uint64, s, micro, R int, factor float64) [][]float64 {
	w := make([][]float64, len(m.lens))
	for p, n := range m.lens {
		w[p] = make([]float64, n)
	}
	for u := range micro {
		for q := range R {
			for p, g := range stepGrads(seed, s, u, q, m.lens) {
				for k, v := range g {
					if !m.f64[p] {
						v = float64(float32(v))
					}
					w[p][k] += factor * v / float64(R)
				}
			}
		}
	}
	return w
}

// grads copies d's averaged gradients out, in float64.
func (m edgeModel) grads(d *DDP) [][]float64 {
	out := make([][]float64, len(m.lens))
	for p := range m.lens {
		if m.f64[p] {
			out[p] = append([]float64(nil), d.Grad64(p)...)
			continue
		}
		for _, v := range d.Grad32(p) {
			out[p] = append(out[p], float64(v))
		}
	}
	return out
}

// pgtestWorld runs f for each of n ranks of an in-process pgtest cluster, concurrently.
func pgtestWorld(n int, f func(rank int, pg procgroup.ProcessGroup) error) error {
	c := pgtest.NewCluster(n)
	defer c.Close()
	return c.Each(f)
}

var glooPrefix atomic.Int64

// glooWorld runs f for each of n ranks of a gloo group over loopback (goroutines of this
// process, as the example does), concurrently, and closes the groups.
func glooWorld(n int, f func(rank int, pg procgroup.ProcessGroup) error) error {
	store := procgroup.NewMemStore()
	defer store.Close()
	prefix := fmt.Sprintf("edges%d", glooPrefix.Add(1))
	errs := make([]error, n)
	var wg sync.WaitGroup
	for rank := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			pg, err := procgroup.New(ctx, "gloo", procgroup.Options{Rank: rank, Size: n, Store: store, Prefix: prefix, Token: "edges-token"})
			if err != nil {
				errs[rank] = err
				return
			}
			errs[rank] = errors.Join(f(rank, pg), pg.Close())
		}()
	}
	wg.Wait()
	for rank, err := range errs {
		if err != nil {
			return fmt.Errorf("rank %d: %w", rank, err)
		}
	}
	return nil
}

// TestAutoBucketCapDTypes: BucketCapMB = AutoBucketCap at world size 2 through New (on
// pgtest, and on gloo over loopback for float64 only and a mix), with
// float32 parameters only, float64 only, and mixes of the two (the only element types a
// Param may have), for eight synced steps (the three that Note [Auto buckets] measures,
// its probe after the first, then the chosen layout), some with a NoSync micro-step before
// them. After every synced step, every gradient equals, element by element, the sum over
// the step's micro-steps of the mean over ranks of the random gradients, computed in
// float64 apart from the DDP (float32 within 1e-5 relative, float64 within 1e-12; with the
// fp16 and bf16 compression hooks, on float64 and mixed models, 2e-3 and 2e-2). With
// float64 parameters only, every rank used to panic in its first synced Finalize
// (runProbe sliced the float32 bucket memory, which is empty then).
func TestAutoBucketCapDTypes(t *testing.T) {
	const R, steps = 2, 8
	type run struct {
		mix, hook string
		gloo      bool
	}
	var runs []run
	for _, mix := range []string{"f32", "f64", "f32+f64", "f64+f32", "random"} {
		runs = append(runs, run{mix, "allreduce", false})
	}
	// The half-precision compression hooks on float64 buckets and on mixed ones.
	for _, hook := range []string{"fp16", "bf16"} {
		runs = append(runs, run{"f64", hook, false}, run{"random", hook, false})
	}
	// The gloo backend over loopback, whose shared arena gives the buckets and the probe
	// their memory (procgroup.BufferAllocator).
	runs = append(runs, run{"f64", "allreduce", true}, run{"random", "allreduce", true})
	for _, tr := range runs {
		mix := tr.mix
		name := mix + "/" + tr.hook
		if tr.gloo {
			name += "/gloo"
		}
		t.Run(name, func(t *testing.T) {
			seed := uint64(len(mix)) * 7919
			hook, rel := AllReduceHook(), 0.0
			switch tr.hook {
			case "fp16":
				hook, rel = FP16CompressHook(), 2e-3
			case "bf16":
				hook, rel = BF16CompressHook(), 2e-2
			}
			rng := rand.New(rand.NewPCG(seed, 3))
			nParams := 6 + rng.IntN(6)
			m := edgeModel{lens: make([]int, nParams), f64: make([]bool, nParams)}
			for p := range m.lens {
				m.lens[p] = 25000 + rng.IntN(40000) // over 512 KiB in all: the layouts differ
				switch mix {
				case "f64":
					m.f64[p] = true
				case "f32+f64":
					m.f64[p] = p >= nParams/2
				case "f64+f32":
					m.f64[p] = p < nParams/2
				case "random":
					m.f64[p] = rng.IntN(2) == 0
				}
			}
			if mix == "random" { // both types, whatever the draw
				m.f64[0], m.f64[1] = true, false
			}
			micro := make([]int, steps) // micro-steps per synced step (the last one synced)
			for s := range micro {
				micro[s] = 1 + rng.IntN(2)
			}
			each := pgtestWorld
			if tr.gloo {
				each = glooWorld
			}
			got := make([][][][]float64, R) // [rank][step][param]
			gens := make([]int, R)
			err := each(R, func(rank int, pg procgroup.ProcessGroup) error {
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				defer cancel()
				d, err := New(ctx, pg, m.params(), Options{BucketCapMB: AutoBucketCap, CommHook: hook})
				if err != nil {
					return err
				}
				defer d.Close()
				for s := range steps {
					for u := range micro[s] {
						mode := Sync
						if u < micro[s]-1 {
							mode = Accumulate
						}
						d.BeginBackward(mode)
						if err := m.report(d, stepGrads(seed, s, u, rank, m.lens)); err != nil {
							return fmt.Errorf("step %d: %w", s, err)
						}
						if err := d.Finalize(ctx); err != nil {
							return fmt.Errorf("step %d: %w", s, err)
						}
					}
					got[rank] = append(got[rank], m.grads(d))
				}
				gens[rank] = d.Generation()
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			for rank, g := range gens {
				// The eight-bucket pass at least differs from the one-bucket layout before
				// it; the chosen layout may be the same as either.
				if g < 1 {
					t.Fatalf("rank %d: generation %d after %d synced steps: the layout never changed", rank, g, steps)
				}
			}
			for s := range steps {
				ref := m.want(seed, s, micro[s], R, 1)
				for p, want := range ref {
					tol := 1e-5
					switch {
					case rel > 0:
						tol = rel
					case m.f64[p]:
						tol = 1e-12
					}
					for rank := range R {
						for k, w := range want {
							if g := got[rank][s][p][k]; math.Abs(g-w) > tol*(1+math.Abs(w)) {
								t.Fatalf("step %d rank %d param %d (float64 %v, %s) [%d]: got %v, want %v", s, rank, p, m.f64[p], tr.hook, k, g, w)
							}
						}
					}
				}
			}
		})
	}
}

// TestOverlappingParams: New refuses parameters whose Data or Grad share memory (with each
// other, or a Data with a Grad), naming both; a tied weight registered twice used to be
// accepted, and with gradients 1 and 10 reported its Grad ended at 10, not 11. Parameters
// carved from one buffer without overlapping are accepted. Random layouts in one buffer
// are judged as a comparison of every pair would.
func TestOverlappingParams(t *testing.T) {
	c := pgtest.NewCluster(1)
	defer c.Close()
	ctx := context.Background()
	w, g := make([]float32, 8), make([]float32, 8)
	buf := make([]float32, 64)
	f64 := make([]float64, 16)
	for _, tc := range []struct {
		name   string
		params []Param
		want   string
	}{
		{"tied weight", []Param{{Name: "embed", Data: w, Grad: g}, {Name: "head", Data: w, Grad: g}},
			"ddp: invalid argument: parameter 0 (embed)'s Data and parameter 1 (head)'s Data share memory; a tensor used twice (a tied weight) must be one Param, its gradient summed and reported once"},
		{"same Data", []Param{{Name: "a", Data: w, Grad: g}, {Name: "b", Data: w[2:6], Grad: make([]float32, 4)}},
			"ddp: invalid argument: parameter 0 (a)'s Data and parameter 1 (b)'s Data share memory; a tensor used twice (a tied weight) must be one Param, its gradient summed and reported once"},
		{"overlapping Grad", []Param{{Name: "a", Data: buf[:8], Grad: buf[16:24]}, {Name: "b", Data: buf[8:16], Grad: buf[20:28]}},
			"ddp: invalid argument: parameter 0 (a)'s Grad and parameter 1 (b)'s Grad share memory; a tensor used twice (a tied weight) must be one Param, its gradient summed and reported once"},
		{"Grad on another's Data", []Param{{Name: "a", Data: buf[:8], Grad: buf[8:16]}, {Name: "b", Data: buf[16:24], Grad: buf[4:12]}},
			"ddp: invalid argument: parameter 0 (a)'s Data and parameter 1 (b)'s Grad share memory; a tensor used twice (a tied weight) must be one Param, its gradient summed and reported once"},
		{"own Data and Grad", []Param{{Name: "a", Data: buf[:8], Grad: buf[8:16]}, {Name: "b", Data: buf[16:24], Grad: buf[16:24]}},
			"ddp: invalid argument: parameter 1 (b): its Data and Grad share memory; Grad must be a buffer of its own"},
		{"float64", []Param{{Name: "a", Data: f64[:4], Grad: f64[4:8]}, {Name: "b", Data: f64[7:11], Grad: f64[12:16]}},
			"ddp: invalid argument: parameter 0 (a)'s Grad and parameter 1 (b)'s Data share memory; a tensor used twice (a tied weight) must be one Param, its gradient summed and reported once"},
	} {
		d, err := New(ctx, c.Group(0), tc.params, Options{})
		if err == nil {
			d.Close()
		}
		if err == nil || err.Error() != tc.want || !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s:\n got %v\nwant %s", tc.name, err, tc.want)
		}
	}
	// Disjoint pieces of one buffer, float32 next to float64 memory, empty slices.
	d, err := New(ctx, c.Group(0), []Param{{Name: "a", Data: buf[:8], Grad: buf[8:16]}, {Name: "b", Data: buf[16:24], Grad: buf[24:32]},
		{Name: "e", Data: buf[32:32], Grad: buf[32:32]}, {Name: "c", Data: f64[:8], Grad: f64[8:16]}}, Options{})
	if err != nil {
		t.Fatalf("disjoint pieces of one buffer: %v", err)
	}
	d.Close()

	rng := rand.New(rand.NewPCG(53, 7))
	refused := 0
	for trial := range 300 {
		n := 2 + rng.IntN(6)
		mem := make([]float32, 40*n)
		params := make([]Param, n)
		type piece struct{ lo, hi int }
		var pieces []piece
		cut := func(l int) []float32 { // l elements of mem at a random offset
			lo := rng.IntN(len(mem) - l + 1)
			pieces = append(pieces, piece{lo, lo + l})
			return mem[lo : lo+l : lo+l]
		}
		for i := range params {
			data := cut(1 + rng.IntN(12))
			grad := make([]float32, len(data)) // a Grad of its own, or one in mem
			if rng.IntN(3) == 0 {
				grad = cut(len(data))
			}
			params[i] = Param{Name: fmt.Sprintf("p%d", i), Data: data, Grad: grad}
		}
		// The reference: every pair of pieces, by index arithmetic.
		overlap := false
		for a := range pieces {
			for b := range a {
				pa, pb := pieces[a], pieces[b]
				if pa.lo < pb.hi && pb.lo < pa.hi {
					overlap = true
				}
			}
		}
		d, err := New(ctx, c.Group(0), params, Options{})
		if err == nil {
			d.Close()
		}
		if (err != nil) != overlap {
			t.Fatalf("trial %d: New: %v, but the pieces overlap: %v (%v)", trial, err, overlap, pieces)
		}
		if err != nil {
			refused++
		}
	}
	if refused == 0 || refused == 300 {
		t.Fatalf("%d of 300 random layouts refused: the draw does not test both outcomes", refused)
	}
}

// torchHook is PyTorch's allreduce_hook ported as it is: it divides the bucket by the world
// size, then all-reduces the sum.
type torchHook struct{}

func (torchHook) Launch(ctx context.Context, pg procgroup.ProcessGroup, b *BucketView) procgroup.Work {
	switch buf := b.Buffer.(type) {
	case []float32:
		for k := range buf {
			buf[k] /= float32(pg.Size())
		}
	case []float64:
		for k := range buf {
			buf[k] /= float64(pg.Size())
		}
	}
	return pg.AllReduce(ctx, b.Buffer, procgroup.Sum)
}

func (torchHook) Finish(*BucketView) error { return nil }

// sumHook all-reduces the sum and divides nothing.
type sumHook struct{}

func (sumHook) Launch(ctx context.Context, pg procgroup.ProcessGroup, b *BucketView) procgroup.Work {
	return pg.AllReduce(ctx, b.Buffer, procgroup.Sum)
}

func (sumHook) Finish(*BucketView) error { return nil }

// dividing makes a hook a DividingHook that reports divides.
type dividing struct {
	CommHook
	divides bool
}

func (h dividing) DividesByWorldSize() bool { return h.divides }

var _ DividingHook = dividing{}

// TestHookDivision: a custom hook's buckets hold the gradients divided by the world size,
// unless the hook is a DividingHook that asks for them undivided. At world size 3, with a
// NoSync micro-step before some synced steps and float32 and float64 parameters, every
// gradient after every synced step equals, element by element, factor × the sum over the
// window of the mean over ranks of the random gradients (computed apart, in float64):
// factor 1 for PyTorch's allreduce_hook as a DividingHook and for a hook that only sums
// without one, 1/3 for allreduce_hook without it (the documented default: it divides
// twice), 3 for the summing hook that asks for undivided buckets, and the default for a
// DividingHook that reports false.
func TestHookDivision(t *testing.T) {
	const R, steps = 3, 4
	for _, tc := range []struct {
		name   string
		hook   CommHook
		factor float64
	}{
		{"torch dividing", dividing{torchHook{}, true}, 1},
		{"sum", sumHook{}, 1},
		{"torch", torchHook{}, 1.0 / R},
		{"torch reporting false", dividing{torchHook{}, false}, 1.0 / R},
		{"sum dividing", dividing{sumHook{}, true}, R},
	} {
		t.Run(tc.name, func(t *testing.T) {
			seed := uint64(len(tc.name))
			rng := rand.New(rand.NewPCG(seed, 9))
			m := edgeModel{lens: make([]int, 5), f64: []bool{false, true, false, true, false}}
			for p := range m.lens {
				m.lens[p] = 1 + rng.IntN(500)
			}
			micro := []int{1, 2, 1, 2}
			c := pgtest.NewCluster(R)
			defer c.Close()
			got := make([][][][]float64, R)
			err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				d, err := New(ctx, pg, m.params(), Options{CommHook: tc.hook, BucketCapMB: 1e-3, FirstBucketCapMB: 1e-3})
				if err != nil {
					return err
				}
				defer d.Close()
				for s := range steps {
					for u := range micro[s] {
						mode := Sync
						if u < micro[s]-1 {
							mode = Accumulate
						}
						d.BeginBackward(mode)
						if err := m.report(d, stepGrads(seed, s, u, rank, m.lens)); err != nil {
							return err
						}
						if err := d.Finalize(ctx); err != nil {
							return err
						}
					}
					got[rank] = append(got[rank], m.grads(d))
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			for s := range steps {
				ref := m.want(seed, s, micro[s], R, tc.factor)
				for p, want := range ref {
					tol := 1e-5
					if m.f64[p] {
						tol = 1e-12
					}
					for rank := range R {
						for k, w := range want {
							if g := got[rank][s][p][k]; math.Abs(g-w) > tol*(1+math.Abs(w)) {
								t.Fatalf("step %d rank %d param %d [%d]: got %v, want %v (%v × the average)", s, rank, p, k, g, w, tc.factor)
							}
						}
					}
				}
			}
		})
	}
}
