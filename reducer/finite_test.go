package reducer

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// poison puts value at element k of rank's gradient of parameter param, in one pass.
type poison struct {
	rank, param, k int
	value          float64
}

// nfPass is one backward pass of a finite-check scenario: its mode and what it poisons.
type nfPass struct {
	mode   Mode
	poison []poison
}

// nfRun is what one scenario saw: per rank, per synced step, Finalize's error and the
// parameters' gradients after it.
type nfRun struct {
	errs  [][]error       // [rank][step]
	grads [][][][]float64 // [rank][step][param]
	ref   [][][]float64   // [step][param]: the average over the ranks, in float64, unpoisoned
	bad   []map[[2]int]bool
	gath  []int // per rank: the int64 AllGathers it issued (the flags' collective)
}

var nfInf = math.Inf(1)

// runFinite runs passes on n ranks over parameters of lens (float64 where f64[p]), with
// random gradients (drawn from seed), random grad-ready orders and opts, and returns what
// every rank saw. With view, the gradients are read from GradView.
func runFinite(t *testing.T, n int, lens []int, f64 []bool, opts Options, passes []nfPass, seed uint64) *nfRun {
	t.Helper()
	ctx := testCtx(t)
	rng := rand.New(rand.NewPCG(seed, 7))
	// in[pass][rank][param]
	in := make([][][][]float64, len(passes))
	orders := make([][][]int, len(passes))
	for u, ps := range passes {
		in[u] = make([][][]float64, n)
		orders[u] = make([][]int, n)
		for r := range n {
			orders[u][r] = rng.Perm(len(lens))
			for _, l := range lens {
				g := make([]float64, l)
				for k := range g {
					g[k] = rng.NormFloat64()
				}
				in[u][r] = append(in[u][r], g)
			}
		}
		for _, p := range ps.poison {
			in[u][p.rank][p.param][p.k] = p.value
		}
	}
	out := &nfRun{errs: make([][]error, n), grads: make([][][][]float64, n), gath: make([]int, n)}
	// The reference: per synced step, the window's sum of the unpoisoned mean over ranks.
	win := make([][]float64, len(lens))
	bad := map[[2]int]bool{}
	for p, l := range lens {
		win[p] = make([]float64, l)
	}
	for u, ps := range passes {
		for p := range lens {
			for k := range win[p] {
				for r := range n {
					win[p][k] += in[u][r][p][k] / float64(n)
				}
			}
		}
		for _, q := range ps.poison {
			bad[[2]int{q.param, q.k}] = true
		}
		if ps.mode == Sync {
			step := make([][]float64, len(lens))
			for p := range win {
				step[p] = append([]float64(nil), win[p]...)
				clear(win[p])
			}
			out.ref = append(out.ref, step)
			out.bad = append(out.bad, bad)
			bad = map[[2]int]bool{}
		}
	}
	c := pgtest.NewCluster(n)
	defer c.Close()
	errs := runRanks(n, func(rank int) error {
		params := make([]Param, len(lens))
		for p, l := range lens {
			params[p].Name = fmt.Sprintf("layer%d.w", p)
			switch {
			case opts.GradientAsBucketView:
				params[p].DType, params[p].Len = procgroup.Float32, l
				if f64[p] {
					params[p].DType = procgroup.Float64
				}
			case f64[p]:
				params[p].Grad = make([]float64, l)
			default:
				params[p].Grad = make([]float32, l)
			}
		}
		r, err := New(c.Group(rank), params, opts)
		if err != nil {
			return err
		}
		defer r.Close()
		for u, ps := range passes {
			if err := r.BeginBackward(ps.mode); err != nil {
				return fmt.Errorf("pass %d: %w", u, err)
			}
			for _, p := range orders[u][rank] {
				g := in[u][rank][p]
				if f64[p] {
					err = r.GradReady64(p, g)
				} else {
					err = r.GradReady(p, to32(g))
				}
				if err != nil {
					return fmt.Errorf("pass %d: %w", u, err)
				}
			}
			if ps.mode != Sync {
				continue
			}
			ferr := r.Finalize(ctx)
			if ferr != nil && !errors.Is(ferr, ErrNonFinite) {
				return fmt.Errorf("pass %d: %w", u, ferr)
			}
			out.errs[rank] = append(out.errs[rank], ferr)
			got := make([][]float64, len(lens))
			for p := range lens {
				v := params[p].Grad
				if opts.GradientAsBucketView {
					if v, err = r.GradView(p); err != nil {
						return err
					}
				}
				switch g := v.(type) {
				case []float32:
					for _, x := range g {
						got[p] = append(got[p], float64(x))
					}
				case []float64:
					got[p] = append(got[p], g...)
				}
			}
			out.grads[rank] = append(out.grads[rank], got)
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	for rank := range n {
		for _, rec := range c.Issued(rank) {
			if rec.Op == procgroup.OpAllGather && rec.DType == procgroup.Int64 {
				out.gath[rank]++
			}
		}
	}
	return out
}

// check compares every rank's result with want, the error message of each synced step
// ("" for none): the same error on every rank (a *NonFiniteError wrapping ErrNonFinite),
// one AllGather of the flags per error and none otherwise, and gradients equal to the
// reference within tol everywhere but at the poisoned elements, which are not finite.
func (o *nfRun) check(t *testing.T, want []string, tol float64) {
	t.Helper()
	nErr := 0
	for _, w := range want {
		if w != "" {
			nErr++
		}
	}
	for rank := range o.errs {
		if len(o.errs[rank]) != len(want) {
			t.Fatalf("rank %d: %d synced steps, want %d", rank, len(o.errs[rank]), len(want))
		}
		for s, err := range o.errs[rank] {
			got := ""
			if err != nil {
				got = err.Error()
				var nf *NonFiniteError
				if !errors.As(err, &nf) || !errors.Is(err, ErrNonFinite) || nf.Step != s {
					t.Errorf("rank %d step %d: %T %v: want a *NonFiniteError of step %d wrapping ErrNonFinite", rank, s, err, err, s)
				}
			}
			if got != want[s] {
				t.Errorf("rank %d step %d: Finalize: %q\nwant %q", rank, s, got, want[s])
			}
			for p, g := range o.grads[rank][s] {
				for k, x := range g {
					if o.bad[s][[2]int{p, k}] {
						if !math.IsNaN(x) && !math.IsInf(x, 0) {
							t.Errorf("rank %d step %d param %d [%d]: %v, want the poison's non-finite value", rank, s, p, k, x)
						}
						continue
					}
					if ref := o.ref[s][p][k]; !(math.Abs(x-ref) <= tol*(1+math.Abs(ref))) {
						t.Fatalf("rank %d step %d param %d [%d]: %v, want %v", rank, s, p, k, x, ref)
					}
				}
			}
		}
		if o.gath[rank] != nErr {
			t.Errorf("rank %d issued %d AllGathers of flags, want %d (one per step with a non-finite gradient)", rank, o.gath[rank], nErr)
		}
	}
}

// TestNonFiniteNamed: a NaN, +Inf or -Inf at a random element of one rank's gradient of one
// parameter fails that step's Finalize on every rank with the same error naming the rank,
// the step and the parameter; the steps before and after are unaffected (the Reducer stays
// usable) and issue no extra collective. Random ranks, parameters, lengths (tails of the
// unrolled loops included), bucket caps, float32 and float64, with and without
// GradientAsBucketView, one rank and several.
func TestNonFiniteNamed(t *testing.T) {
	rng := rand.New(rand.NewPCG(49, 1))
	for trial := range 24 {
		n := 1 + rng.IntN(4)
		nParams := 1 + rng.IntN(6)
		lens, f64 := make([]int, nParams), make([]bool, nParams)
		for p := range lens {
			lens[p] = 1 + rng.IntN(23)
			f64[p] = rng.IntN(3) == 0
		}
		opts := Options{
			FirstBucketCapMB:     float64(4*(1+rng.IntN(30))) / (1 << 20),
			BucketCapMB:          float64(4*(1+rng.IntN(60))) / (1 << 20),
			GradientAsBucketView: trial%3 == 1,
		}
		value := []float64{math.NaN(), nfInf, -nfInf}[trial%3]
		q := poison{rank: rng.IntN(n), param: rng.IntN(nParams)}
		q.k = rng.IntN(lens[q.param])
		q.value = value
		name := fmt.Sprintf("%d/ranks=%d/params=%v/f64=%v/view=%v/%v", trial, n, lens, f64, opts.GradientAsBucketView, value)
		t.Run(name, func(t *testing.T) {
			passes := []nfPass{{mode: Sync}, {mode: Sync, poison: []poison{q}}, {mode: Sync}, {mode: Sync}}
			o := runFinite(t, n, lens, f64, opts, passes, uint64(trial))
			msg := fmt.Sprintf("reducer: step 1: non-finite local gradient: rank %d: parameter %d (layer%d.w)", q.rank, q.param, q.param)
			o.check(t, []string{"", msg, "", ""}, 1e-5)
		})
	}
}

// TestNonFiniteTwoRanks: non-finite values on two ranks at once, in several parameters,
// are all named, by rank and then parameter.
func TestNonFiniteTwoRanks(t *testing.T) {
	lens := []int{9, 4, 13, 1, 6}
	f64 := []bool{false, true, false, false, true}
	passes := []nfPass{{mode: Sync, poison: []poison{
		{rank: 2, param: 3, k: 0, value: nfInf},
		{rank: 0, param: 1, k: 2, value: math.NaN()},
		{rank: 2, param: 1, k: 3, value: -nfInf},
		{rank: 2, param: 0, k: 8, value: math.NaN()},
	}}, {mode: Sync}}
	o := runFinite(t, 3, lens, f64, Options{FirstBucketCapMB: 40.0 / (1 << 20), BucketCapMB: 40.0 / (1 << 20)}, passes, 3)
	o.check(t, []string{
		"reducer: step 0: non-finite local gradient: rank 0: parameter 1 (layer1.w); rank 2: parameters 0 (layer0.w), 1 (layer1.w), 3 (layer3.w)",
		"",
	}, 1e-5)
}

// TestNonFiniteNoSync: a non-finite value in a NoSync pass is named at the window's synced
// Finalize (the flags accumulate over the window), and the next window, finite, is
// unaffected (they are reset).
func TestNonFiniteNoSync(t *testing.T) {
	lens := []int{7, 30, 5}
	f64 := []bool{false, false, true}
	for _, view := range []bool{false, true} {
		t.Run(fmt.Sprintf("view=%v", view), func(t *testing.T) {
			passes := []nfPass{
				{mode: Accumulate, poison: []poison{{rank: 1, param: 1, k: 29, value: math.NaN()}}},
				{mode: Accumulate},
				{mode: Sync},
				{mode: Accumulate},
				{mode: Sync},
				{mode: Accumulate},
				{mode: Sync, poison: []poison{{rank: 0, param: 2, k: 4, value: -nfInf}}},
			}
			opts := Options{FirstBucketCapMB: 20.0 / (1 << 20), BucketCapMB: 60.0 / (1 << 20), GradientAsBucketView: view}
			o := runFinite(t, 2, lens, f64, opts, passes, 11)
			o.check(t, []string{
				"reducer: step 0: non-finite local gradient: rank 1: parameter 1 (layer1.w)",
				"",
				"reducer: step 2: non-finite local gradient: rank 0: parameter 2 (layer2.w)",
			}, 1e-5)
		})
	}
}

// TestNonFiniteCompressionOverflow: with the fp16 hook, a finite gradient beyond fp16's
// range overflows in the compression; the error says so and names no rank. The default
// hook reduces the same gradients without error, and a NaN beside the overflow is named
// with its rank.
func TestNonFiniteCompressionOverflow(t *testing.T) {
	lens := []int{5, 11}
	f64 := []bool{false, false}
	big := []poison{{rank: 1, param: 1, k: 6, value: 3e5}} // 1e5 after the division by 3 > 65504
	passes := []nfPass{{mode: Sync}, {mode: Sync, poison: big}, {mode: Sync}}
	o := runFinite(t, 3, lens, f64, Options{CommHook: FP16CompressHook()}, passes, 5)
	if got, want := errString(o.errs[0][1]), "reducer: step 1: non-finite reduced gradient although every rank's local gradient was finite (an overflow in the comm hook's compression or in the sum): parameter 1 (layer1.w)"; got != want {
		t.Errorf("fp16 overflow: %q\nwant %q", got, want)
	}
	for rank := range 3 {
		if errString(o.errs[rank][1]) != errString(o.errs[0][1]) || o.errs[rank][0] != nil || o.errs[rank][2] != nil {
			t.Errorf("rank %d: %v, want the errors of rank 0: %v", rank, o.errs[rank], o.errs[0])
		}
		if x := o.grads[rank][1][1][6]; !math.IsInf(x, 1) {
			t.Errorf("rank %d: overflowed element %v, want +Inf", rank, x)
		}
	}
	// The same gradients in float32 throughout: no error.
	plain := runFinite(t, 3, lens, f64, Options{}, []nfPass{{mode: Sync}, {mode: Sync, poison: []poison{{rank: 1, param: 1, k: 6, value: 3e5}}}, {mode: Sync}}, 5)
	plain.bad = []map[[2]int]bool{{}, {}, {}}
	plain.check(t, []string{"", "", ""}, 1e-5)
	// A NaN on rank 2 beside the overflow.
	both := append(big, poison{rank: 2, param: 0, k: 0, value: math.NaN()})
	o = runFinite(t, 3, lens, f64, Options{CommHook: BF16CompressHook()}, []nfPass{{mode: Sync, poison: both}}, 5)
	// bf16 has float32's range: 1e5 does not overflow, so only the NaN is named.
	if got, want := errString(o.errs[1][0]), "reducer: step 0: non-finite local gradient: rank 2: parameter 0 (layer0.w)"; got != want {
		t.Errorf("bf16: %q\nwant %q", got, want)
	}
	o = runFinite(t, 3, lens, f64, Options{CommHook: FP16CompressHook()}, []nfPass{{mode: Sync, poison: both}}, 5)
	if got, want := errString(o.errs[1][0]), "reducer: step 0: non-finite local gradient: rank 2: parameter 0 (layer0.w); and non-finite reduced gradient although every rank's local gradient was finite (an overflow in the comm hook's compression or in the sum): parameter 1 (layer1.w)"; got != want {
		t.Errorf("fp16, NaN and overflow: %q\nwant %q", got, want)
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// TestNonFiniteShards: with Options.Shards, a NaN in one shard's pass on one rank is named
// at the step's Finalize.
func TestNonFiniteShards(t *testing.T) {
	ctx := testCtx(t)
	const n, L = 2, 4
	lens := []int{6, 3}
	c := pgtest.NewCluster(n)
	defer c.Close()
	msgs := make([]string, n)
	errs := runRanks(n, func(rank int) error {
		params := []Param{{Name: "a", Grad: make([]float32, lens[0])}, {Name: "b", Grad: make([]float32, lens[1])}}
		r, err := New(c.Group(rank), params, Options{Shards: L})
		if err != nil {
			return err
		}
		defer r.Close()
		rng := rand.New(rand.NewPCG(uint64(rank), 2))
		lo, hi := r.LocalShards()
		for step := range 3 {
			for s := lo; s < hi; s++ {
				if _, err := r.BeginShard(s); err != nil {
					return err
				}
				for i := len(lens) - 1; i >= 0; i-- {
					g := make([]float32, lens[i])
					for k := range g {
						g[k] = float32(rng.NormFloat64())
					}
					if step == 1 && rank == 1 && s == hi-2 && i == 0 {
						g[5] = float32(math.Inf(-1))
					}
					if err := r.GradReady(i, g); err != nil {
						return err
					}
				}
			}
			err := r.Finalize(ctx)
			switch {
			case step == 1:
				msgs[rank] = errString(err)
			case err != nil:
				return fmt.Errorf("step %d: %w", step, err)
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	for rank, m := range msgs {
		if want := "reducer: step 1: non-finite local gradient: rank 1: parameter 0 (a)"; m != want {
			t.Errorf("rank %d: %q, want %q", rank, m, want)
		}
	}
}

// TestNoFiniteCheck: with Options.NoFiniteCheck a NaN reaches the average silently.
func TestNoFiniteCheck(t *testing.T) {
	o := runFinite(t, 2, []int{4, 4}, []bool{false, false}, Options{NoFiniteCheck: true},
		[]nfPass{{mode: Sync, poison: []poison{{rank: 1, param: 0, k: 2, value: math.NaN()}}}}, 1)
	o.check(t, []string{""}, 1e-5)
}

// TestNonFiniteMessage: the message's form for many parameters: at most maxNamed named.
func TestNonFiniteMessage(t *testing.T) {
	e := &NonFiniteError{Step: 3}
	for i := range 25 {
		e.Local = append(e.Local, NonFiniteGrad{Rank: i / 12, Param: i % 12, Name: fmt.Sprint("p", i%12)})
	}
	got := e.Error()
	want := "reducer: step 3: non-finite local gradient: rank 0: parameters 0 (p0), 1 (p1), 2 (p2), 3 (p3), 4 (p4), 5 (p5), 6 (p6), 7 (p7), 8 (p8), 9 (p9), 10 (p10), 11 (p11); " +
		"rank 1: parameters 0 (p0), 1 (p1), 2 (p2), 3 (p3), 4 (p4), 5 (p5), 6 (p6), 7 (p7), ... and 5 more"
	if got != want {
		t.Errorf("%q\nwant %q", got, want)
	}
}

// TestScaleCheck: scaleCheck writes the bits scaleInto writes, for every length around the
// unrolling and every mode, and reports a NaN, +Inf or -Inf at any position (the tails
// included), in what it writes: with add, in the sum.
func TestScaleCheck(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 9))
	for n := range 19 {
		for _, inv := range []float32{1, 0.5, 1.0 / 3} {
			for _, add := range []bool{false, true} {
				src, base := make([]float32, n), make([]float32, n)
				for k := range src {
					src[k], base[k] = float32(rng.NormFloat64()), float32(rng.NormFloat64())
				}
				want, got := append([]float32(nil), base...), append([]float32(nil), base...)
				scaleInto(want, src, inv, add)
				if !scaleCheck(got, src, inv, add) {
					t.Errorf("n=%d inv=%v add=%v: finite data reported non-finite", n, inv, add)
				}
				for k := range want {
					if math.Float32bits(got[k]) != math.Float32bits(want[k]) {
						t.Fatalf("n=%d inv=%v add=%v [%d]: %v, scaleInto writes %v", n, inv, add, k, got[k], want[k])
					}
				}
				for k := range n {
					for _, v := range []float64{math.NaN(), nfInf, -nfInf} {
						s := append([]float32(nil), src...)
						s[k] = float32(v)
						d := append([]float32(nil), base...)
						if scaleCheck(d, s, inv, add) {
							t.Errorf("n=%d inv=%v add=%v: %v at %d not seen", n, inv, add, v, k)
						}
						if add { // a non-finite value already in the slot (an earlier NoSync pass)
							d := append([]float32(nil), base...)
							d[k] = float32(v)
							if scaleCheck(d, src, inv, add) {
								t.Errorf("n=%d inv=%v: %v already at %d not seen", n, inv, v, k)
							}
						}
						s64 := make([]float64, n)
						for j := range s64 {
							s64[j] = float64(s[j])
						}
						if allFinite(s64) || allFinite(s) {
							t.Errorf("n=%d: allFinite misses %v at %d", n, v, k)
						}
					}
				}
			}
		}
	}
	if !allFinite([]float64{math.MaxFloat64, -math.MaxFloat64, math.SmallestNonzeroFloat64}) || !allFinite([]float32{math.MaxFloat32, -math.MaxFloat32}) {
		t.Errorf("allFinite refuses the largest finite values")
	}
}

// TestNonFiniteNoCollective: a finite step issues only the buckets' all-reduces (and the
// rebuild's broadcast): the check adds no collective.
func TestNonFiniteNoCollective(t *testing.T) {
	o := runFinite(t, 2, []int{3, 8, 2}, []bool{false, false, false}, Options{FirstBucketCapMB: 12.0 / (1 << 20)},
		[]nfPass{{mode: Sync}, {mode: Sync}, {mode: Accumulate}, {mode: Sync}}, 8)
	o.check(t, []string{"", "", ""}, 1e-5) // it counts the AllGathers of flags: none
}

// BenchmarkFiniteCheck is BenchmarkHookPath with the check for non-finite gradients on and
// off (Options.NoFiniteCheck), with the copy back and with bucket views (a read pass).
func BenchmarkFiniteCheck(b *testing.B) {
	for _, c := range []struct{ params, n int }{{64, 4096}, {16, 65536}} {
		for _, view := range []bool{false, true} {
			for _, off := range []bool{true, false} {
				b.Run(fmt.Sprintf("params=%d/len=%d/view=%v/check=%v", c.params, c.n, view, !off), func(b *testing.B) {
					s := newStepper(b, c.params, c.n, Options{FirstBucketCapMB: 0.25, BucketCapMB: 1, GradientAsBucketView: view, NoFiniteCheck: off})
					s.step(b, Sync)
					s.step(b, Sync)
					b.SetBytes(int64(c.params * c.n * 4))
					b.ReportAllocs()
					b.ResetTimer()
					for b.Loop() {
						s.step(b, Sync)
					}
				})
			}
		}
	}
}

// BenchmarkFiniteCheckSeedShape is one synced step's hook path (every GradReady, Finalize's
// unpack) for the parameters of examples/transformer at its defaults (the seed's model:
// hidden 256, 2 layers, 1,711,104 float32 parameters, default caps), with the check on and
// off, against a group whose collectives cost nothing: the difference is the check's cost
// per step at the seed shape.
func BenchmarkFiniteCheckSeedShape(b *testing.B) {
	const h = 256
	lens := []int{h * h, h}
	for range 2 {
		lens = append(lens, 3*h*h, 3*h, h*h, h, 4*h*h, 4*h, 4*h*h, h, h, h, h, h)
	}
	lens = append(lens, h*h, h)
	for _, off := range []bool{true, false} {
		b.Run(fmt.Sprintf("check=%v", !off), func(b *testing.B) {
			s := &stepper{}
			params := make([]Param, len(lens))
			total := 0
			for i, n := range lens {
				params[i] = Param{Name: fmt.Sprint(i), Grad: make([]float32, n)}
				g := make([]float32, n)
				for k := range g {
					g[k] = float32(k%7) + 0.5
				}
				s.grads = append(s.grads, g)
				total += n
			}
			if total != 1711104 {
				b.Fatalf("%d parameters, want the seed model's 1711104", total)
			}
			r, err := New(newNopGroup(2), params, Options{NoFiniteCheck: off})
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			s.r = r
			s.step(b, Sync)
			s.step(b, Sync)
			b.SetBytes(int64(4 * total))
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				s.step(b, Sync)
			}
		})
	}
}
