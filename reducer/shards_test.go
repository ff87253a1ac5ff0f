package reducer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// shardGrads are random per-shard gradients, keyed by (step, shard, parameter) only:
// g[step][shard][param] is a []float32 or []float64.
type shardGrads [][][]any

func newShardGrads(seed uint64, steps, shards int, lens []int, f64 []bool) shardGrads {
	g := make(shardGrads, steps)
	for t := range g {
		g[t] = make([][]any, shards)
		for s := range g[t] {
			g[t][s] = make([]any, len(lens))
			for p, n := range lens {
				rng := rand.New(rand.NewPCG(seed, uint64((t*shards+s)*len(lens)+p)))
				if f64[p] {
					v := make([]float64, n)
					for k := range v {
						v[k] = rng.NormFloat64() * math.Pow(10, float64(rng.IntN(7)-3))
					}
					g[t][s][p] = v
				} else {
					v := make([]float32, n)
					for k := range v {
						v[k] = float32(rng.NormFloat64() * math.Pow(10, float64(rng.IntN(7)-3)))
					}
					g[t][s][p] = v
				}
			}
		}
	}
	return g
}

// refFold is the reference of Note [Shards], computed here on the per-shard gradients
// directly: for every element, ((g0 + g1) + … + g(L−1)) · (1/L) in the element type.
func refFold(g [][]any, p int) any {
	L := len(g)
	switch v := g[0][p].(type) {
	case []float32:
		out := make([]float32, len(v))
		for k := range out {
			acc := v[k]
			for s := 1; s < L; s++ {
				acc += g[s][p].([]float32)[k]
			}
			out[k] = acc * (1 / float32(L))
		}
		return out
	default:
		v64 := v.([]float64)
		out := make([]float64, len(v64))
		for k := range out {
			acc := v64[k]
			for s := 1; s < L; s++ {
				acc += g[s][p].([]float64)[k]
			}
			out[k] = acc * (1 / float64(L))
		}
		return out
	}
}

// sameBits reports the first element where a and b differ in bits, or -1.
func sameBits(a, b any) int {
	switch x := a.(type) {
	case []float32:
		y := b.([]float32)
		for k := range x {
			if math.Float32bits(x[k]) != math.Float32bits(y[k]) {
				return k
			}
		}
	case []float64:
		y := b.([]float64)
		for k := range x {
			if math.Float64bits(x[k]) != math.Float64bits(y[k]) {
				return k
			}
		}
	}
	return -1
}

func report(r *Reducer, p int, g any) error {
	if v, ok := g.([]float32); ok {
		return r.GradReady(p, v)
	}
	return r.GradReady64(p, g.([]float64))
}

func newGrad(n int, f64 bool) any {
	if f64 {
		return make([]float64, n)
	}
	return make([]float32, n)
}

func cloneGrad(g any) any {
	switch v := g.(type) {
	case []float32:
		return append([]float32(nil), v...)
	default:
		return append([]float64(nil), v.([]float64)...)
	}
}

// runShards runs steps of g on a world of n ranks (pgtest), each rank its shards in a
// random order and its gradients in a random order, with Options.Shards = len(g[0]) (or,
// with shards false, today's all-reduce of each rank's shards summed locally under
// Accumulate: the reduction whose order depends on the world size). It returns rank 0's
// Param.Grad after each step (GradView with view) and checks every rank got the same.
func runShards(t *testing.T, n int, g shardGrads, lens []int, f64 []bool, opts Options, shards, view bool) [][]any {
	t.Helper()
	L := len(g[0])
	if shards {
		opts.Shards = L
	}
	opts.GradientAsBucketView = view
	c := pgtest.NewCluster(n)
	defer c.Close()
	ctx := testCtx(t)
	out := make([][][]any, n) // [rank][step][param]
	errs := runRanks(n, func(rank int) error {
		params := make([]Param, len(lens))
		for p, l := range lens {
			params[p] = Param{Name: fmt.Sprintf("p%d", p), Grad: newGrad(l, f64[p])}
			if view {
				params[p] = Param{Name: params[p].Name, DType: procgroup.Float32, Len: l}
				if f64[p] {
					params[p].DType = procgroup.Float64
				}
			}
		}
		r, err := New(c.Group(rank), params, opts)
		if err != nil {
			return err
		}
		defer r.Close()
		rng := rand.New(rand.NewPCG(uint64(rank), uint64(n)))
		k := L / n
		for step := range g {
			mine := rng.Perm(k)
			for j, sj := range mine {
				s := rank*k + sj
				if shards {
					sync, err := r.BeginShard(s)
					if err != nil {
						return err
					}
					if sync != (j == k-1) {
						return fmt.Errorf("step %d: BeginShard(%d) (%d-th of %d) says sync=%v", step, s, j+1, k, sync)
					}
				} else {
					mode := Accumulate
					if j == k-1 {
						mode = Sync
					}
					if err := r.BeginBackward(mode); err != nil {
						return err
					}
				}
				for _, p := range rng.Perm(len(lens)) {
					gr := g[step][s][p]
					if !shards { // today's: each rank's shards scaled by 1/k, pre-divided by n
						gr = scaled(gr, 1/float64(k))
					}
					if err := report(r, p, gr); err != nil {
						return err
					}
				}
			}
			if err := r.Finalize(ctx); err != nil {
				return err
			}
			res := make([]any, len(lens))
			for p := range lens {
				if view {
					v, err := r.GradView(p)
					if err != nil {
						return err
					}
					res[p] = cloneGrad(v)
				} else {
					res[p] = cloneGrad(params[p].Grad)
				}
			}
			out[rank] = append(out[rank], res)
		}
		return nil
	})
	for rank, err := range errs {
		if err != nil {
			t.Fatalf("world %d: rank %d: %v", n, rank, err)
		}
	}
	for rank := 1; rank < n; rank++ {
		if !reflect.DeepEqual(out[rank], out[0]) {
			t.Fatalf("world %d: rank %d's gradients differ from rank 0's", n, rank)
		}
	}
	return out[0]
}

func scaled(g any, f float64) any {
	switch v := g.(type) {
	case []float32:
		o := make([]float32, len(v))
		for k := range v {
			o[k] = v[k] * float32(f)
		}
		return o
	default:
		v64 := v.([]float64)
		o := make([]float64, len(v64))
		for k := range v64 {
			o[k] = v64[k] * f
		}
		return o
	}
}

// TestShardsSameBitsAtEveryWorldSize: with Options.Shards = 6, worlds of 1, 2, 3 and 6
// ranks (shards begun in a random order on each rank, gradients reported in a random
// order, several buckets of float32 and float64 parameters, three steps so that the
// steps after the rebuild count too, with and without GradientAsBucketView) leave, bit for
// bit, the reference fold computed from the per-shard gradients in refFold. Today's
// reduction of the same shards (local sums under Accumulate, then the all-reduce) differs
// from it in bits at some world size, so this comparison can fail.
func TestShardsSameBitsAtEveryWorldSize(t *testing.T) {
	const L, steps = 6, 3
	lens := []int{37, 5, 64, 1, 130, 17}
	f64 := []bool{false, false, true, false, false, true}
	g := newShardGrads(45, steps, L, lens, f64)
	opts := Options{FirstBucketCapMB: 100.0 / (1 << 20), BucketCapMB: 300.0 / (1 << 20)}
	for _, view := range []bool{false, true} {
		for _, n := range []int{1, 2, 3, 6} {
			got := runShards(t, n, g, lens, f64, opts, true, view)
			for step := range got {
				for p := range lens {
					if k := sameBits(got[step][p], refFold(g[step], p)); k >= 0 {
						t.Fatalf("view %v, world %d, step %d, parameter %d: element %d is %v, the shard-order fold %v",
							view, n, step, p, k, reflect.ValueOf(got[step][p]).Index(k), reflect.ValueOf(refFold(g[step], p)).Index(k))
					}
				}
			}
		}
	}
	differ := 0
	for _, n := range []int{2, 3, 6} {
		got := runShards(t, n, g, lens, f64, opts, false, false)
		for step := range got {
			for p := range lens {
				if sameBits(got[step][p], refFold(g[step], p)) >= 0 {
					differ++
				}
			}
		}
	}
	if differ == 0 {
		t.Fatal("today's all-reduce gave the shard-order fold's bits at every world size: the comparison above cannot tell")
	}
	t.Logf("today's all-reduce differs in bits from the fold in %d of %d (world, step, parameter)", differ, 3*steps*len(lens))
}

// TestShardsErrors: misuse with Options.Shards is refused with an error that names it.
func TestShardsErrors(t *testing.T) {
	ctx := testCtx(t)
	lens := []int{3, 4}
	newR := func(t *testing.T, opts Options) *Reducer {
		t.Helper()
		c := pgtest.NewCluster(1)
		t.Cleanup(c.Close)
		params := []Param{{Name: "a", Grad: make([]float32, 3)}, {Name: "b", Grad: make([]float32, 4)}}
		r, err := New(c.Group(0), params, opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Close() })
		return r
	}
	all := func(t *testing.T, r *Reducer) {
		t.Helper()
		for p, n := range lens {
			if err := r.GradReady(p, make([]float32, n)); err != nil {
				t.Fatal(err)
			}
		}
	}
	wantErr := func(t *testing.T, err error, is error, sub string) {
		t.Helper()
		if err == nil || !errors.Is(err, is) || !strings.Contains(err.Error(), sub) {
			t.Fatalf("error %v, want one wrapping %v that says %q", err, is, sub)
		}
	}

	t.Run("world size", func(t *testing.T) {
		err := CheckShards(6, 4)
		var se *ShardsError
		if !errors.As(err, &se) || !reflect.DeepEqual(se.Fit, []int{1, 2, 3, 6}) || se.Shards != 6 || se.WorldSize != 4 {
			t.Fatalf("CheckShards(6, 4) = %v", err)
		}
		wantErr(t, err, ErrInvalidArgument, "world sizes that work: 1, 2, 3, 6")
		for _, n := range []int{1, 2, 3, 6} {
			if err := CheckShards(6, n); err != nil {
				t.Errorf("CheckShards(6, %d) = %v", n, err)
			}
		}
		_, err = New(newNopGroup(4), []Param{{Name: "a", Grad: make([]float32, 3)}}, Options{Shards: 6})
		if !errors.As(err, &se) {
			t.Fatalf("New over 4 ranks with Shards 6: %v", err)
		}
		wantErr(t, err, ErrInvalidArgument, "6 shards cannot be spread over a world of 4 ranks")
	})
	t.Run("options", func(t *testing.T) {
		for _, c := range []struct {
			opts Options
			sub  string
		}{
			{Options{Shards: -1}, "Shards -1"},
			{Options{Shards: 2, CommHook: FP16CompressHook()}, "CommHook"},
			{Options{Shards: 2, BucketCapMB: AutoBucketCap}, "AutoBucketCap"},
			{Options{Shards: 2, FindUnusedParameters: true}, "FindUnusedParameters"},
		} {
			_, err := New(newNopGroup(2), []Param{{Name: "a", Grad: make([]float32, 3)}}, c.opts)
			wantErr(t, err, ErrInvalidArgument, c.sub)
		}
	})
	t.Run("BeginBackward", func(t *testing.T) {
		r := newR(t, Options{Shards: 3})
		wantErr(t, r.BeginBackward(Sync), ErrInvalidArgument, "BeginShard")
		if _, err := r.BeginShard(0); err != nil { // not sticky
			t.Fatal(err)
		}
	})
	t.Run("without shards", func(t *testing.T) {
		r := newR(t, Options{})
		_, err := r.BeginShard(0)
		wantErr(t, err, ErrInvalidArgument, "without Options.Shards")
	})
	t.Run("not this rank's", func(t *testing.T) {
		r := newR(t, Options{Shards: 3})
		_, err := r.BeginShard(3)
		wantErr(t, err, ErrInvalidArgument, "runs shards [0, 3) of 3")
		wantErr(t, r.Finalize(ctx), ErrInvalidArgument, "BeginShard(3)") // sticky
	})
	t.Run("twice", func(t *testing.T) {
		r := newR(t, Options{Shards: 3})
		r.BeginShard(1)
		all(t, r)
		_, err := r.BeginShard(1)
		wantErr(t, err, ErrInvalidArgument, "shard 1 was already run in this step")
	})
	t.Run("incomplete pass", func(t *testing.T) {
		r := newR(t, Options{Shards: 3})
		r.BeginShard(0)
		if err := r.GradReady(1, make([]float32, 4)); err != nil {
			t.Fatal(err)
		}
		_, err := r.BeginShard(1)
		wantErr(t, err, ErrUnusedParameters, "shard 0: every shard's pass must report every parameter")
		if !strings.Contains(err.Error(), "0 (a)") {
			t.Errorf("error %v does not name parameter 0 (a)", err)
		}
	})
	t.Run("missing shards", func(t *testing.T) {
		r := newR(t, Options{Shards: 3})
		r.BeginShard(1)
		all(t, r)
		wantErr(t, r.Finalize(ctx), ErrPhase, "shards 0, 2 of [0, 3) were not begun")
	})
	t.Run("steps", func(t *testing.T) { // a good loop, twice, for contrast with the above
		r := newR(t, Options{Shards: 3})
		for range 2 {
			for s := range 3 {
				if _, err := r.BeginShard(2 - s); err != nil {
					t.Fatal(err)
				}
				all(t, r)
			}
			if err := r.Finalize(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if lo, hi := r.LocalShards(); lo != 0 || hi != 3 {
			t.Errorf("LocalShards = %d, %d", lo, hi)
		}
	})
}

// TestShardsSteadyStateAllocs: with Options.Shards, a step (every shard's pass, Finalize,
// Stats) allocates nothing once the buckets are rebuilt.
func TestShardsSteadyStateAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are not meaningful under the race detector")
	}
	for _, world := range []int{1, 2} {
		params := make([]Param, 32)
		grads := make([][]float32, 32)
		for i := range params {
			params[i] = Param{Name: fmt.Sprint(i), Grad: make([]float32, 1000)}
			grads[i] = make([]float32, 1000)
			for k := range grads[i] {
				grads[i][k] = float32(k%7) + 0.5
			}
		}
		r, err := New(newNopGroup(world), params, Options{FirstBucketCapMB: 1.0 / 64, BucketCapMB: 1.0 / 16, Shards: 4})
		if err != nil {
			t.Fatal(err)
		}
		s := &stepper{r: r, grads: grads}
		step := func() {
			lo, hi := s.r.LocalShards()
			for sh := lo; sh < hi; sh++ {
				if _, err := s.r.BeginShard(sh); err != nil {
					t.Fatal(err)
				}
				for i := len(s.grads) - 1; i >= 0; i-- {
					if err := s.r.GradReady(i, s.grads[i]); err != nil {
						t.Fatal(err)
					}
				}
			}
			if err := s.r.Finalize(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		step()
		step()
		if a := testing.AllocsPerRun(20, func() {
			step()
			_ = s.r.Stats()
		}); a != 0 {
			t.Errorf("world %d: %v allocations per step", world, a)
		}
		s.r.Close()
	}
}
