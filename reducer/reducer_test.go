package reducer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"reflect"
	"sync"
	"testing"
	"time"
	"unsafe"

	"go.uber.org/goleak"

	"github.com/goddp/goddp/internal/gpufake"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// gpuMode: GODDP_GPU=1 runs the device tests against the libraries the environment names
// (a real GPU, at world size 1: scripts/gpu_check.sh runs TestPowerSGDDevice so);
// otherwise TestMain builds the fakes.
var gpuMode = os.Getenv("GODDP_GPU") == "1"

// TestMain builds the fake CUDA driver, NCCL and cuBLAS of the device tests
// (device_test.go) and points the nccl backend at them, then runs the tests with goleak.
func TestMain(m *testing.M) {
	if gpuMode {
		goleak.VerifyTestMain(m)
		return
	}
	dir, err := os.MkdirTemp("", "goddp-reducer-fakes-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	libs, err := gpufake.Build(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	libs.Setenv()
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) {
		os.RemoveAll(dir)
		os.Exit(code)
	}))
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// model is a small linear model whose per-sample gradients are real: parameter p is a
// vector w_p of length lens[p], and a sample (x, y) has loss ½ Σ_p (w_p·φ_p(x) − y)², with
// φ_p(x)[k] = x[(7k+p) mod D]. So ∂loss/∂w_p = (w_p·φ_p(x) − y) φ_p(x).
type model struct {
	lens []int
	w    [][]float64
}

const featDim = 5

type sample struct {
	x [featDim]float64
	y float64
}

func newModel(rng *rand.Rand, nParams int) *model {
	m := &model{lens: make([]int, nParams), w: make([][]float64, nParams)}
	for p := range m.lens {
		m.lens[p] = 1 + rng.IntN(60)
		m.w[p] = make([]float64, m.lens[p])
		for k := range m.w[p] {
			m.w[p][k] = rng.NormFloat64()
		}
	}
	return m
}

func randomBatch(rng *rand.Rand, n int) []sample {
	b := make([]sample, n)
	for s := range b {
		for k := range b[s].x {
			b[s].x[k] = rng.NormFloat64()
		}
		b[s].y = rng.NormFloat64()
	}
	return b
}

// meanGrad is the gradient of the mean loss over batch, parameter p, in float64.
func (m *model) meanGrad(p int, batch []sample) []float64 {
	g := make([]float64, m.lens[p])
	for _, s := range batch {
		pred := 0.0
		for k, w := range m.w[p] {
			pred += w * s.x[(7*k+p)%featDim]
		}
		r := pred - s.y
		for k := range g {
			g[k] += r * s.x[(7*k+p)%featDim] / float64(len(batch))
		}
	}
	return g
}

func to32(g []float64) []float32 {
	out := make([]float32, len(g))
	for k, v := range g {
		out[k] = float32(v)
	}
	return out
}

// runRanks runs f for every rank on its own goroutine and returns the errors.
func runRanks(n int, f func(rank int) error) []error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := 0; r < n; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = f(r)
		}()
	}
	wg.Wait()
	return errs
}

// TestEquivalence: N ranks, each with its shard of a batch, produce after Finalize the
// gradient one process computes over the whole batch (float64 reference; float32 results
// within 1e-5·(1+|ref|)), for random bucket caps, random grad-ready orders (different on
// every rank and every step), with and without GradientAsBucketView and a no-sync micro-step
// first, and with and without buckets from the group's allocator (allocGroup). Three steps each, so the steps after the rebuild are checked too. Every rank issues
// the same collectives in the same order.
func TestEquivalence(t *testing.T) {
	rng := rand.New(rand.NewPCG(2024, 3))
	const batch = 12 // divisible by 1..4
	configs := 0
	for n := 1; n <= 4; n++ {
		for _, view := range []bool{false, true} {
			for _, noSync := range []bool{false, true} {
				for trial := 0; trial < 12; trial++ {
					configs++
					seed := rng.Uint64()
					alloc := trial%2 == 1
					name := fmt.Sprintf("n=%d/view=%v/nosync=%v/alloc=%v/seed=%d", n, view, noSync, alloc, seed)
					t.Run(name, func(t *testing.T) { checkEquivalence(t, n, view, noSync, false, alloc, seed, batch) })
				}
			}
		}
	}
}

// checkEquivalence is TestEquivalence's check of one configuration; with auto, the bucket
// caps are AutoBucketCap and six steps run, so that three follow its three rebuilds; with
// alloc, the group allocates the buckets (allocGroup), and every one must be given back.
func checkEquivalence(t *testing.T, n int, view, noSync, auto, alloc bool, seed uint64, batch int) {
	ctx := testCtx(t)
	rng := rand.New(rand.NewPCG(seed, 1))
	m := newModel(rng, 1+rng.IntN(12))
	capBytes := int64(4 * (1 + rng.IntN(120)))
	firstBytes := int64(4 * (1 + rng.IntN(120)))
	steps, maxGen := 3, 1
	capMB := float64(capBytes) / (1 << 20)
	if auto {
		steps, capMB = 6, AutoBucketCap
		if n > 1 {
			maxGen = autoPasses
		}
	}
	micro := 1
	if noSync {
		micro = 2
	}
	// batches[step][micro] is the global batch; rank r takes its contiguous shard.
	batches := make([][][]sample, steps)
	orders := make([][][][]int, steps) // [step][micro][rank]
	for s := range batches {
		batches[s] = make([][]sample, micro)
		orders[s] = make([][][]int, micro)
		for u := range batches[s] {
			batches[s][u] = randomBatch(rng, batch)
			orders[s][u] = make([][]int, n)
			for r := range orders[s][u] {
				orders[s][u][r] = rng.Perm(len(m.lens))
			}
		}
	}

	c := pgtest.NewCluster(n)
	defer c.Close()
	allocs := make([]*allocGroup, n)
	got := make([][][][]float32, n) // [rank][step][param]
	errs := runRanks(n, func(rank int) error {
		var pg procgroup.ProcessGroup = c.Group(rank)
		if alloc {
			allocs[rank] = &allocGroup{ProcessGroup: pg, live: map[*byte]int{}}
			pg = allocs[rank]
		}
		params := make([]Param, len(m.lens))
		for p := range params {
			params[p] = Param{Name: fmt.Sprintf("w%d", p), Grad: make([]float32, m.lens[p])}
			if view {
				params[p].Grad = nil
				params[p].DType, params[p].Len = procgroup.Float32, m.lens[p]
			}
		}
		red, err := New(pg, params, Options{
			BucketCapMB: capMB, FirstBucketCapMB: float64(firstBytes) / (1 << 20),
			GradientAsBucketView: view,
		})
		if err != nil {
			return err
		}
		defer red.Close()
		shard := batch / n
		for s := 0; s < steps; s++ {
			for u := 0; u < micro; u++ {
				mode := Sync
				if u < micro-1 {
					mode = Accumulate
				}
				if err := red.BeginBackward(mode); err != nil {
					return err
				}
				local := batches[s][u][rank*shard : (rank+1)*shard]
				for _, p := range orders[s][u][rank] {
					if err := red.GradReady(p, to32(m.meanGrad(p, local))); err != nil {
						return err
					}
				}
				if err := red.Finalize(ctx); err != nil {
					return err
				}
			}
			out := make([][]float32, len(params))
			for p := range params {
				if view {
					v, err := red.GradView(p)
					if err != nil {
						return err
					}
					out[p] = append([]float32(nil), v.([]float32)...)
				} else {
					out[p] = append([]float32(nil), params[p].Grad.([]float32)...)
				}
			}
			got[rank] = append(got[rank], out)
		}
		if red.Generation() > maxGen {
			return fmt.Errorf("generation %d: rebuilt more than %d times", red.Generation(), maxGen)
		}
		if auto && n > 1 {
			return checkAutoPlan(red)
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	for r, a := range allocs {
		if a != nil && (a.allocs == 0 || len(a.live) != 0) {
			t.Fatalf("rank %d: %d buffers allocated from the group, %d not given back after Close", r, a.allocs, len(a.live))
		}
	}
	for s := 0; s < steps; s++ {
		for p := range m.lens {
			ref := make([]float64, m.lens[p])
			for u := 0; u < micro; u++ {
				for k, v := range m.meanGrad(p, batches[s][u]) {
					ref[k] += v
				}
			}
			for r := 0; r < n; r++ {
				for k, want := range ref {
					if g := float64(got[r][s][p][k]); math.Abs(g-want) > 1e-5*(1+math.Abs(want)) {
						t.Fatalf("step %d rank %d param %d [%d]: got %v, want %v", s, r, p, k, g, want)
					}
				}
			}
		}
	}
	for r := 1; r < n; r++ {
		if !reflect.DeepEqual(c.Issued(r), c.Issued(0)) {
			t.Fatalf("rank %d issued\n%v\nrank 0 issued\n%v", r, c.Issued(r), c.Issued(0))
		}
	}
}

// TestOverlap: with one rank's events recorded in order (its grad-ready calls, and the
// collectives it issues, through the cluster's OnIssue), the first bucket's all-reduce is
// issued before the last gradient becomes ready, for every layout with more than one
// bucket: in the first step with gradients in reverse registration order, and in the step
// after the rebuild with the (random) order the first step observed.
func TestOverlap(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 5))
	checked := 0
	for trial := 0; trial < 60; trial++ {
		n := 1 + rng.IntN(3)
		nParams := 2 + rng.IntN(10)
		lens := make([]int, nParams)
		for i := range lens {
			lens[i] = 1 + rng.IntN(50)
		}
		capBytes := int64(4 * (1 + rng.IntN(100)))
		random := trial%2 == 1
		var orders [][]int
		for r := 0; r < n; r++ {
			o := rng.Perm(nParams)
			if !random {
				for k := range o {
					o[k] = nParams - 1 - k
				}
			}
			orders = append(orders, o)
		}

		c := pgtest.NewCluster(n)
		var mu sync.Mutex
		events := make([][]string, n)
		c.OnIssue = func(rank int, rec pgtest.Record) {
			mu.Lock()
			events[rank] = append(events[rank], rec.Op.String())
			mu.Unlock()
		}
		buckets := make([]int, n)
		errs := runRanks(n, func(rank int) error {
			params := make([]Param, nParams)
			for i := range params {
				params[i] = Param{Name: fmt.Sprint(i), Grad: make([]float32, lens[i])}
			}
			red, err := New(c.Group(rank), params, Options{
				BucketCapMB: float64(capBytes) / (1 << 20), FirstBucketCapMB: float64(capBytes) / (1 << 20),
			})
			if err != nil {
				return err
			}
			defer red.Close()
			for step := 0; step < 2; step++ {
				if step == 1 {
					buckets[rank] = len(red.Buckets())
				}
				mu.Lock()
				events[rank] = append(events[rank], "begin")
				mu.Unlock()
				if err := red.BeginBackward(Sync); err != nil {
					return err
				}
				for _, i := range orders[0] { // rank 0's order everywhere: the rebuild follows it
					mu.Lock()
					events[rank] = append(events[rank], "grad")
					mu.Unlock()
					if err := red.GradReady(i, make([]float32, lens[i])); err != nil {
						return err
					}
				}
				if err := red.Finalize(testCtx(t)); err != nil {
					return err
				}
			}
			return nil
		})
		c.Close()
		for r, err := range errs {
			if err != nil {
				t.Fatalf("trial %d rank %d: %v", trial, r, err)
			}
		}
		for r := 0; r < n; r++ {
			// split the log into steps at "begin"
			var stepsLog [][]string
			for _, e := range events[r] {
				if e == "begin" {
					stepsLog = append(stepsLog, nil)
					continue
				}
				stepsLog[len(stepsLog)-1] = append(stepsLog[len(stepsLog)-1], e)
			}
			for step, log := range stepsLog {
				if step == 0 && random {
					continue // the initial layout does not follow a random order
				}
				nb := 0
				firstAR, lastGrad := -1, -1
				for k, e := range log {
					switch e {
					case procgroup.OpAllReduce.String():
						nb++
						if firstAR < 0 {
							firstAR = k
						}
					case "grad":
						lastGrad = k
					}
				}
				if nb < 2 {
					continue
				}
				checked++
				if firstAR > lastGrad {
					t.Fatalf("trial %d rank %d step %d: no overlap: %v", trial, r, step, log)
				}
			}
		}
	}
	if checked < 30 {
		t.Fatalf("only %d multi-bucket layouts checked", checked)
	}
}

func newSingle(t *testing.T, lens []int, opts Options) (*pgtest.Cluster, *Reducer, []Param) {
	t.Helper()
	c := pgtest.NewCluster(1)
	t.Cleanup(c.Close)
	params := make([]Param, len(lens))
	for i, n := range lens {
		params[i] = Param{Name: fmt.Sprintf("layer%d.w", i), Grad: make([]float32, n)}
	}
	r, err := New(c.Group(0), params, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return c, r, params
}

func TestUnusedParametersError(t *testing.T) {
	const want = "reducer: backward 1 finished with 2 parameter(s) that received no gradient, so their buckets were never reduced: 0 (layer0.w), 2 (layer2.w); if some parameters take no part in the loss, set Options.FindUnusedParameters"
	ctx := testCtx(t)
	_, r, _ := newSingle(t, []int{3, 3, 3}, Options{})
	_ = r.BeginBackward(Sync)
	_ = r.GradReady(1, []float32{1, 2, 3})
	err := r.Finalize(ctx) // returns at once: no hang
	if err == nil || err.Error() != want {
		t.Fatalf("Finalize: %v\nwant %s", err, want)
	}
	if err := r.BeginBackward(Sync); err == nil || err.Error() != want {
		t.Fatalf("next BeginBackward: %v\nwant %s", err, want)
	}
}

// TestUnusedParametersNoHangAcrossRanks: rank 1 skips a parameter rank 0 uses; rank 1's
// Finalize fails and aborts its group, so rank 0's Finalize fails too instead of hanging.
func TestUnusedParametersNoHangAcrossRanks(t *testing.T) {
	ctx := testCtx(t)
	c := pgtest.NewCluster(2)
	defer c.Close()
	errs := runRanks(2, func(rank int) error {
		params := []Param{{Name: "a", Grad: make([]float32, 2)}, {Name: "b", Grad: make([]float32, 2)}}
		r, err := New(c.Group(rank), params, Options{FirstBucketCapMB: 8.0 / (1 << 20), BucketCapMB: 8.0 / (1 << 20)})
		if err != nil {
			return err
		}
		defer r.Close()
		_ = r.BeginBackward(Sync)
		_ = r.GradReady(1, []float32{1, 1})
		if rank == 0 {
			_ = r.GradReady(0, []float32{1, 1})
		}
		return r.Finalize(ctx)
	})
	if !errors.Is(errs[1], ErrUnusedParameters) {
		t.Errorf("rank 1: %v", errs[1])
	}
	if !errors.Is(errs[0], procgroup.ErrAborted) {
		t.Errorf("rank 0: %v, want an abort", errs[0])
	}
}

func TestMarkedTwiceError(t *testing.T) {
	const want = "reducer: gradient marked ready twice: backward 1: parameter 1 (layer1.w) was reported ready twice; report a shared parameter once, after all its contributions are summed"
	_, r, _ := newSingle(t, []int{3, 3}, Options{})
	_ = r.BeginBackward(Sync)
	_ = r.GradReady(1, []float32{1, 2, 3})
	err := r.GradReady(1, []float32{1, 2, 3})
	if err == nil || err.Error() != want {
		t.Fatalf("GradReady: %v\nwant %s", err, want)
	}
	if err := r.Finalize(testCtx(t)); err == nil || err.Error() != want {
		t.Fatalf("Finalize: %v", err)
	}
}

func TestFindUnusedParameters(t *testing.T) {
	ctx := testCtx(t)
	c := pgtest.NewCluster(2)
	defer c.Close()
	grads := make([][]Param, 2)
	stats := make([]*IterStats, 2)
	errs := runRanks(2, func(rank int) error {
		grads[rank] = []Param{{Name: "a", Grad: []float32{9, 9}}, {Name: "b", Grad: []float32{9, 9}}, {Name: "c", Grad: []float32{9}}}
		r, err := New(c.Group(rank), grads[rank], Options{FindUnusedParameters: true, FirstBucketCapMB: 8.0 / (1 << 20), BucketCapMB: 8.0 / (1 << 20)})
		if err != nil {
			return err
		}
		defer r.Close()
		for step := 0; step < 2; step++ {
			_ = r.BeginBackward(Sync)
			_ = r.GradReady(2, []float32{float32(rank + 1)})
			if rank == 0 { // b is used on rank 0 only; a on no rank
				_ = r.GradReady(1, []float32{4, 6})
			}
			if err := r.Finalize(ctx); err != nil {
				return err
			}
		}
		stats[rank] = r.Stats().Clone()
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	for rank := range 2 {
		g := grads[rank]
		if fmt.Sprint(g[0].Grad, g[1].Grad, g[2].Grad) != "[0 0] [2 3] [1.5]" {
			t.Errorf("rank %d: %v %v %v", rank, g[0].Grad, g[1].Grad, g[2].Grad)
		}
	}
	if fmt.Sprint(stats[0].Unused) != "[0]" || fmt.Sprint(stats[1].Unused) != "[0 1]" {
		t.Errorf("unused: rank 0 %v, rank 1 %v", stats[0].Unused, stats[1].Unused)
	}
}

func TestCompressionHooks(t *testing.T) {
	for _, tc := range []struct {
		name string
		hook CommHook
		tol  float64
	}{{"fp16", FP16CompressHook(), 2e-3}, {"bf16", BF16CompressHook(), 1.6e-2}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testCtx(t)
			const n = 3
			rng := rand.New(rand.NewPCG(1, 9))
			lens := []int{17, 40, 5}
			in := make([][][]float32, n)
			for r := range in {
				for _, l := range lens {
					g := make([]float32, l)
					for k := range g {
						g[k] = float32(rng.NormFloat64())
					}
					in[r] = append(in[r], g)
				}
			}
			c := pgtest.NewCluster(n)
			defer c.Close()
			out := make([][]Param, n)
			errs := runRanks(n, func(rank int) error {
				for _, l := range lens {
					out[rank] = append(out[rank], Param{Name: "p", Grad: make([]float32, l)})
				}
				r, err := New(c.Group(rank), out[rank], Options{CommHook: tc.hook, FirstBucketCapMB: 100.0 / (1 << 20)})
				if err != nil {
					return err
				}
				defer r.Close()
				for step := 0; step < 2; step++ {
					_ = r.BeginBackward(Sync)
					for i := len(lens) - 1; i >= 0; i-- {
						if err := r.GradReady(i, in[rank][i]); err != nil {
							return err
						}
					}
					if err := r.Finalize(ctx); err != nil {
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
			for rank := range n {
				for p, l := range lens {
					for k := 0; k < l; k++ {
						want := 0.0
						for r := range n {
							want += float64(in[r][p][k]) / n
						}
						got := float64(out[rank][p].Grad.([]float32)[k])
						if math.Abs(got-want) > tc.tol*(1+math.Abs(want)) {
							t.Fatalf("rank %d param %d [%d]: %v, want %v (inputs %v %v %v)", rank, p, k, got, want, in[0][p][k], in[1][p][k], in[2][p][k])
						}
					}
				}
			}
			for _, rec := range c.Issued(0) {
				if rec.Op == procgroup.OpAllReduce && rec.DType != map[string]procgroup.DType{"fp16": procgroup.Float16, "bf16": procgroup.BFloat16}[tc.name] {
					t.Fatalf("issued %v", rec)
				}
			}
		})
	}
}

// TestMixedDTypes: float64 and float32 parameters (separate buckets) on 3 ranks, with an
// Accumulate pass first, compared with a float64 reference.
func TestMixedDTypes(t *testing.T) {
	ctx := testCtx(t)
	const n = 3
	rng := rand.New(rand.NewPCG(3, 4))
	a := make([][2][]float64, n) // [rank][pass] gradient of the float64 parameter
	b := make([][2][]float32, n)
	for r := range n {
		for u := range 2 {
			a[r][u] = make([]float64, 7)
			b[r][u] = make([]float32, 3)
			for k := range a[r][u] {
				a[r][u][k] = rng.NormFloat64()
			}
			for k := range b[r][u] {
				b[r][u][k] = float32(rng.NormFloat64())
			}
		}
	}
	c := pgtest.NewCluster(n)
	defer c.Close()
	outA := make([][]float64, n)
	outB := make([][]float32, n)
	errs := runRanks(n, func(rank int) error {
		outA[rank], outB[rank] = make([]float64, 7), make([]float32, 3)
		r, err := New(c.Group(rank), []Param{{Name: "a", Grad: outA[rank]}, {Name: "b", Grad: outB[rank]}}, Options{})
		if err != nil {
			return err
		}
		defer r.Close()
		if len(r.Buckets()) != 2 {
			return fmt.Errorf("%d buckets, want one per dtype", len(r.Buckets()))
		}
		for u, mode := range []Mode{Accumulate, Sync} {
			_ = r.BeginBackward(mode)
			if err := r.GradReady(1, b[rank][u]); err != nil {
				return err
			}
			if err := r.GradReady64(0, a[rank][u]); err != nil {
				return err
			}
			if err := r.Finalize(ctx); err != nil {
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
	for rank := range n {
		for k := range 7 {
			want := 0.0
			for r := range n {
				want += (a[r][0][k] + a[r][1][k]) / n
			}
			if math.Abs(outA[rank][k]-want) > 1e-12 {
				t.Fatalf("rank %d a[%d] = %v, want %v", rank, k, outA[rank][k], want)
			}
		}
		for k := range 3 {
			want := 0.0
			for r := range n {
				want += float64(b[r][0][k]+b[r][1][k]) / n
			}
			if math.Abs(float64(outB[rank][k])-want) > 1e-5*(1+math.Abs(want)) {
				t.Fatalf("rank %d b[%d] = %v, want %v", rank, k, outB[rank][k], want)
			}
		}
	}
}

func TestBadInput(t *testing.T) {
	c := pgtest.NewCluster(1)
	defer c.Close()
	pg := c.Group(0)
	for name, tc := range map[string]struct {
		params []Param
		opts   Options
		want   string
	}{
		"nil grad":  {[]Param{{Name: "a"}}, Options{}, "reducer: invalid argument: parameter 0 (a): nil Grad (allowed only with GradientAsBucketView)"},
		"int grad":  {[]Param{{Name: "a", Grad: []int32{1}}}, Options{}, "reducer: invalid argument: parameter 0 (a): element type int32, want float32 or float64"},
		"bad type":  {[]Param{{Name: "a", Grad: "x"}}, Options{}, "reducer: invalid argument: parameter 0 (a): procgroup: invalid argument: unsupported buffer type string"},
		"negative":  {nil, Options{BucketCapMB: -1}, "reducer: invalid argument: bucket caps -1 MiB and first 1 MiB, want both positive (or the cap AutoBucketCap)"},
		"mismatch":  {[]Param{{Name: "a", Grad: []float32{1}, Len: 2}}, Options{}, "reducer: invalid argument: parameter 0 (a): Grad is float32×1 but DType, Len say DType(0)×2"},
		"view nlen": {[]Param{{Name: "a", DType: procgroup.Float32, Len: -1}}, Options{GradientAsBucketView: true}, "reducer: invalid argument: parameter 0 (a): negative length -1"},
	} {
		if _, err := New(pg, tc.params, tc.opts); err == nil || err.Error() != tc.want {
			t.Errorf("%s: %v\nwant %s", name, err, tc.want)
		}
	}
	if _, err := New(nil, nil, Options{}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("nil group: %v", err)
	}

	_, r, _ := newSingle(t, []int{3}, Options{})
	if err := r.GradReady(0, []float32{1, 2, 3}); !errors.Is(err, ErrPhase) {
		t.Fatalf("GradReady before BeginBackward: %v", err)
	}
	_ = r.BeginBackward(Sync)
	err := r.GradReady(0, []float32{1})
	if err == nil || err.Error() != "reducer: invalid argument: GradReady(0): gradient of parameter layer0.w is float32×1, want float32×3" {
		t.Fatalf("short gradient: %v", err)
	}
	if err2 := r.Finalize(testCtx(t)); err2 != err {
		t.Fatalf("Finalize after failure: %v", err2)
	}
	if err2 := r.GradReady64(0, []float64{1, 2, 3}); err2 != err {
		t.Fatalf("GradReady64 after failure: %v", err2)
	}
}

// TestPeerDeath: a rank dies mid-step; the survivor's Finalize fails with ErrPeerLost.
func TestPeerDeath(t *testing.T) {
	ctx := testCtx(t)
	c := pgtest.NewCluster(2)
	defer c.Close()
	r, err := New(c.Group(0), []Param{{Name: "a", Grad: make([]float32, 4)}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	_ = r.BeginBackward(Sync)
	_ = r.GradReady(0, []float32{1, 2, 3, 4})
	c.Kill(1)
	if err := r.Finalize(ctx); !errors.Is(err, procgroup.ErrPeerLost) {
		t.Fatalf("Finalize: %v", err)
	}
}

// TestFinalizeCtx: Finalize's ctx ending aborts the wait and the group.
func TestFinalizeCtx(t *testing.T) {
	c := pgtest.NewCluster(2)
	defer c.Close()
	r, err := New(c.Group(0), []Param{{Name: "a", Grad: make([]float32, 4)}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	_ = r.BeginBackward(Sync)
	_ = r.GradReady(0, []float32{1, 2, 3, 4}) // rank 1 never joins
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := r.Finalize(ctx); !errors.Is(err, context.Canceled) || err.Error() != "reducer: backward 1: Finalize: waiting for bucket 0: context canceled" {
		t.Fatalf("Finalize: %v", err)
	}
	if w := c.Group(1).Barrier(context.Background()); !errors.Is(w.Wait(context.Background()), procgroup.ErrAborted) {
		t.Fatal("peer not aborted")
	}
	r.Close()
}

func TestStats(t *testing.T) {
	ctx := testCtx(t)
	_, r, _ := newSingle(t, []int{8, 8, 8, 8}, Options{FirstBucketCapMB: 64.0 / (1 << 20), BucketCapMB: 64.0 / (1 << 20)})
	if r.Stats() != nil {
		t.Fatal("stats before any pass")
	}
	for step := 1; step <= 3; step++ {
		mode := Sync
		if step == 2 {
			mode = Accumulate
		}
		_ = r.BeginBackward(mode)
		for i := 3; i >= 0; i-- {
			_ = r.GradReady(i, make([]float32, 8))
		}
		if err := r.Finalize(ctx); err != nil {
			t.Fatal(err)
		}
		s := r.Stats()
		if s.Iter != step || s.Mode != mode {
			t.Fatalf("step %d: stats of %d (%v)", step, s.Iter, s.Mode)
		}
		for i, d := range s.GradReady {
			if d < 0 || d > s.BackwardEnd {
				t.Fatalf("grad %d ready at %v, backward end %v", i, d, s.BackwardEnd)
			}
		}
		if s.CopyTime > s.HookTime || s.HookTime > s.BackwardEnd || s.FinalizeEnd < s.BackwardEnd {
			t.Fatalf("copy %v hook %v backward %v finalize %v", s.CopyTime, s.HookTime, s.BackwardEnd, s.FinalizeEnd)
		}
		if len(s.BucketReady) != 2 || s.BucketBytes[0] != 64 {
			t.Fatalf("buckets %v bytes %v", s.BucketReady, s.BucketBytes)
		}
		for b := range s.BucketReady {
			launched := s.BucketLaunched[b] >= 0
			if launched != (mode == Sync) {
				t.Fatalf("step %d bucket %d launched at %v", step, b, s.BucketLaunched[b])
			}
			if launched && !(s.BucketReady[b] <= s.BucketLaunched[b] && s.BucketLaunched[b] <= s.BucketFinished[b] && s.BucketFinished[b] <= s.FinalizeEnd) {
				t.Fatalf("bucket %d: ready %v launched %v finished %v", b, s.BucketReady[b], s.BucketLaunched[b], s.BucketFinished[b])
			}
		}
		if s.Overlap() > s.Comm() || s.Exposed() < 0 || s.Compute() < 0 {
			t.Fatalf("overlap %v comm %v", s.Overlap(), s.Comm())
		}
	}
}

func TestCommIntervals(t *testing.T) {
	s := &IterStats{
		BucketLaunched: []time.Duration{10, 20, 60, -1},
		BucketFinished: []time.Duration{30, 40, 70, -1},
		BackwardEnd:    35,
	}
	if s.Comm() != 40 || s.Overlap() != 25 || s.Exposed() != 15 {
		t.Fatalf("comm %v overlap %v exposed %v", s.Comm(), s.Overlap(), s.Exposed())
	}
}

// TestCloseMidPass: closing a reducer in the middle of a synced pass aborts its group, so
// the peer waiting for the bucket fails instead of hanging.
func TestCloseMidPass(t *testing.T) {
	ctx := testCtx(t)
	c := pgtest.NewCluster(2)
	defer c.Close()
	rs := make([]*Reducer, 2)
	for rank := range rs {
		r, err := New(c.Group(rank), []Param{{Name: "a", Grad: make([]float32, 2)}, {Name: "b", Grad: make([]float32, 2)}}, Options{})
		if err != nil {
			t.Fatal(err)
		}
		rs[rank] = r
		_ = r.BeginBackward(Sync)
	}
	_ = rs[0].GradReady(1, []float32{1, 2})
	_ = rs[1].GradReady(1, []float32{1, 2})
	_ = rs[1].GradReady(0, []float32{1, 2}) // rank 1 launches; rank 0 never will
	rs[0].Close()
	if err := rs[1].Finalize(ctx); !errors.Is(err, procgroup.ErrPeerLost) {
		t.Fatalf("Finalize: %v", err)
	}
	if err := rs[0].BeginBackward(Sync); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: %v", err)
	}
	rs[1].Close()
}

// TestOptionsWithDefaults: the zero fields get their defaults, the set ones are kept.
func TestOptionsWithDefaults(t *testing.T) {
	o := Options{}.WithDefaults()
	if o.BucketCapMB != 25 || o.FirstBucketCapMB != 1 || o.CommHook == nil || o.Logger == nil {
		t.Errorf("defaults: %+v", o)
	}
	if _, ok := o.CommHook.(allReduceHook); !ok {
		t.Errorf("default hook %T, want the all-reduce", o.CommHook)
	}
	set := Options{BucketCapMB: 5, FirstBucketCapMB: -1, CommHook: FP16CompressHook()}.WithDefaults()
	if set.BucketCapMB != 5 || set.FirstBucketCapMB != -1 {
		t.Errorf("set fields changed: %+v", set)
	}
	if _, ok := set.CommHook.(allReduceHook); ok {
		t.Error("a set hook was replaced")
	}
}

// allocGroup is a group with a procgroup.BufferAllocator: its buffers are ordinary slices,
// counted, and poisoned with NaNs when given back, so a reducer that used a bucket after
// freeing it would produce NaN gradients.
type allocGroup struct {
	procgroup.ProcessGroup
	mu     sync.Mutex
	live   map[*byte]int
	allocs int
}

func (a *allocGroup) AllocBuffer(dt procgroup.DType, count int) (any, error) {
	buf := procgroup.NewBuffer(dt, count)
	if count == 0 {
		return buf, nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.live[firstByte(buf)] = count
	a.allocs++
	return buf, nil
}

func (a *allocGroup) FreeBuffer(buf any) {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch b := buf.(type) {
	case []float32:
		for i := range b {
			b[i] = float32(math.NaN())
		}
	case []float64:
		for i := range b {
			b[i] = math.NaN()
		}
	}
	delete(a.live, firstByte(buf))
}

func firstByte(buf any) *byte {
	switch b := buf.(type) {
	case []float32:
		return (*byte)(unsafe.Pointer(&b[0]))
	case []float64:
		return (*byte)(unsafe.Pointer(&b[0]))
	}
	return nil
}
