package reducer

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/bucket/sim"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// hookRun is what runHook saw on each rank: the averaged gradients after each step, the
// collectives issued, the final layout, the auto plan, and the hook's state at the end
// (MarshalBinary's, where it has one).
type hookRun struct {
	out     [][][][]float32 // rank, step, param
	issued  [][]pgtest.Record
	buckets [][]bucket.Bucket
	plans   []*AutoPlan
	saved   [][]byte
}

// autoShapes: two matrices and a bias.
var autoShapes = [][]int{{64, 128}, {64}, {128, 64}}

// runHook trains autoShapes on two ranks for steps synced steps with random gradients (the
// same for a given seed whatever the hook), each gradient reported after sleep of
// "backward", over a link of link bytes per second (0: none), with the hook mk makes.
func runHook(t *testing.T, mk func() CommHook, opts Options, link float64, sleep time.Duration, steps int, seed uint64) hookRun {
	t.Helper()
	return runHookFrom(t, mk, opts, link, sleep, 0, steps, seed, nil)
}

// runHookFrom is runHook for the steps [from, steps) of the same gradients, on new
// Reducers, with restore (if not nil) given each rank's hook after New: the resumed half of
// a run.
func runHookFrom(t *testing.T, mk func() CommHook, opts Options, link float64, sleep time.Duration, from, steps int, seed uint64, restore func(rank int, h CommHook) error) hookRun {
	t.Helper()
	const n = 2
	ctx := testCtx(t)
	grads := make([][][][]float32, n) // rank, step, param
	for w := range grads {
		rng := rand.New(rand.NewPCG(seed, 5+uint64(w))) // a rank's steps, whatever their number
		grads[w] = make([][][]float32, steps)
		for s := range grads[w] {
			for _, sh := range autoShapes {
				g := make([]float32, lenOf(sh))
				for k := range g {
					g[k] = float32(rng.NormFloat64())
				}
				grads[w][s] = append(grads[w][s], g)
			}
		}
	}
	c := pgtest.NewCluster(n)
	defer c.Close()
	c.SetLink(link)
	run := hookRun{out: make([][][][]float32, n), issued: make([][]pgtest.Record, n), buckets: make([][]bucket.Bucket, n), plans: make([]*AutoPlan, n), saved: make([][]byte, n)}
	errs := runRanks(n, func(rank int) error {
		params := make([]Param, len(autoShapes))
		for i, sh := range autoShapes {
			params[i] = Param{Name: fmt.Sprintf("p%d", i), Shape: sh, Grad: make([]float32, lenOf(sh))}
		}
		o := opts
		o.CommHook = mk()
		r, err := New(c.Group(rank), params, o)
		if err != nil {
			return err
		}
		defer r.Close()
		if restore != nil {
			if err := restore(rank, o.CommHook); err != nil {
				return err
			}
		}
		for s := from; s < steps; s++ {
			if err := r.BeginBackward(Sync); err != nil {
				return err
			}
			for i := len(params) - 1; i >= 0; i-- {
				time.Sleep(sleep)
				if err := r.GradReady(i, grads[rank][s][i]); err != nil {
					return err
				}
			}
			if err := r.Finalize(ctx); err != nil {
				return fmt.Errorf("step %d: %w", s, err)
			}
			var got [][]float32
			for _, p := range params {
				got = append(got, slices.Clone(p.Grad.([]float32)))
			}
			run.out[rank] = append(run.out[rank], got)
		}
		run.buckets[rank] = slices.Clone(r.Buckets())
		run.plans[rank] = r.AutoPlan()
		if m, ok := o.CommHook.(interface{ MarshalBinary() ([]byte, error) }); ok {
			if run.saved[rank], err = m.MarshalBinary(); err != nil {
				return err
			}
		}
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for w := range n {
		run.issued[w] = c.Issued(w)
	}
	return run
}

// allReduces returns the counts of the all-reduces in recs.
func allReduces(recs []pgtest.Record) []int {
	var out []int
	for _, r := range recs {
		if r.Op == procgroup.OpAllReduce {
			out = append(out, r.Count)
		}
	}
	return out
}

// TestAutoHookSlowLink: over a link of 2 MB/s the bucket's 66 KB take 33 ms, twice
// backward's 15 ms, and AutoHook chooses PowerSGD (Note [Auto hook]). From the decision
// on, every rank's gradients are bit for bit those of PowerSGDHook with StartIter 3 (the
// three measured steps all-reduce as they are), and the messages are PowerSGD's.
func TestAutoHookSlowLink(t *testing.T) {
	const steps = 8
	auto := runHook(t, func() CommHook { return AutoHook(AutoHookOptions{Ranks: []int{2}}) }, Options{}, 2e6, 5*time.Millisecond, steps, 11)
	ref := runHook(t, func() CommHook { return PowerSGDHook(PowerSGDOptions{Rank: 2, StartIter: autoPasses}) }, Options{}, 0, 0, steps, 11)
	for w := range auto.out {
		p := auto.plans[w]
		if p == nil || p.Hooks == nil {
			t.Fatalf("rank %d: no auto plan: %+v", w, p)
		}
		if !p.Fixed || len(p.Hooks.Hooks) != 1 || p.Hooks.Hooks[0] != (sim.Hook{Kind: "powersgd", Rank: 2}) {
			t.Errorf("rank %d: plan %v, want powersgd(r=2) on the one bucket with the caps as set", w, p)
		}
		if !strings.Contains(p.String(), "hooks powersgd(r=2) ×1") {
			t.Errorf("rank %d: the plan's line %q does not name the hook", w, p)
		}
		for s := range steps {
			for i := range autoShapes {
				if !slices.Equal(auto.out[w][s][i], ref.out[w][s][i]) {
					t.Fatalf("rank %d, step %d, parameter %d: the auto hook's average differs from PowerSGD's", w, s, i)
				}
			}
		}
		// The last four steps' messages: PowerSGD's, the bias and the factors at rank 2.
		a, r := allReduces(auto.issued[w]), allReduces(ref.issued[w])
		want := []int{64 + 2*64 + 2*128, 64 + 2*128 + 2*64}
		if tail := a[len(a)-4:]; !slices.Equal(tail, r[len(r)-4:]) || tail[0] != want[0] || tail[1] != want[0] {
			t.Errorf("rank %d: last all-reduces %v, PowerSGD's %v; want messages of %d elements", w, tail, r[len(r)-4:], want[0])
		}
	}
}

// TestAutoHookMixed: whatever rank 0 chooses for each bucket (forced here, to cover the
// mixes the model picks on other links), every parameter of a bucket ends each step after
// the decision with the bits its own hook gives it alone: the plain all-reduce, bf16, or
// PowerSGD at its rank started at the decision (StartIter 3), although several PowerSGD
// states and the plain buckets share one model.
func TestAutoHookMixed(t *testing.T) {
	const steps = 7
	opts := Options{BucketCapMB: 0.04, FirstBucketCapMB: 0.01} // two buckets: a matrix each
	refs := map[sim.Hook]hookRun{}
	ref := func(h sim.Hook) hookRun {
		if r, ok := refs[h]; ok {
			return r
		}
		mk := map[string]func() CommHook{"none": AllReduceHook, "bf16": BF16CompressHook,
			"powersgd": func() CommHook { return PowerSGDHook(PowerSGDOptions{Rank: h.Rank, StartIter: autoPasses}) }}[h.Kind]
		refs[h] = runHook(t, mk, opts, 0, 0, steps, 14)
		return refs[h]
	}
	r1, r2, r4 := sim.Hook{Kind: "powersgd", Rank: 1}, sim.Hook{Kind: "powersgd", Rank: 2}, sim.Hook{Kind: "powersgd", Rank: 4}
	none, bf := sim.Hook{Kind: "none"}, sim.Hook{Kind: "bf16"}
	for _, force := range [][]sim.Hook{{r1, r2}, {r2, r1}, {bf, r2}, {r1, none}, {none, r4}} {
		auto := runHook(t, func() CommHook {
			h := AutoHook(AutoHookOptions{Ranks: []int{1, 2, 4}}).(*autoHook) // 1 is not a default
			h.force = force
			return h
		}, opts, 0, 0, steps, 14)
		for w := range auto.out {
			if p := auto.plans[w]; p == nil || p.Hooks == nil || !slices.Equal(p.Hooks.Hooks, force) {
				t.Fatalf("%v: rank %d's plan %v", force, w, p)
			}
			if len(auto.buckets[w]) != len(force) {
				t.Fatalf("%v: %d buckets", force, len(auto.buckets[w]))
			}
			for b, h := range force {
				want := ref(h)
				for s := autoPasses; s < steps; s++ {
					for _, i := range auto.buckets[w][b].Params {
						if !slices.Equal(auto.out[w][s][i], want.out[w][s][i]) {
							t.Errorf("%v: rank %d, step %d, parameter %d (bucket %d, %v): differs from the hook alone", force, w, s, i, b, h)
						}
					}
				}
			}
		}
	}
}

// TestAutoHookFastLink: with no link to cross, the all-reduce is nearly free beside
// backward, and AutoHook keeps the plain all-reduce: the averages are the plain ones, and
// every all-reduce after the decision carries the whole bucket. Backward takes 20 ms a
// gradient: with 5 ms, under the race detector on a busy machine, the last bucket's
// exposed all-reduce (1.7 ms) was 6% of the step, and PowerSGD at rank 4, whose loops the
// detector does not slow, was predicted past the 5% margin.
func TestAutoHookFastLink(t *testing.T) {
	const steps = 6
	auto := runHook(t, func() CommHook { return AutoHook(AutoHookOptions{}) }, Options{}, 0, 20*time.Millisecond, steps, 12)
	ref := runHook(t, AllReduceHook, Options{}, 0, 0, steps, 12)
	total := 0
	for _, sh := range autoShapes {
		total += lenOf(sh)
	}
	for w := range auto.out {
		p := auto.plans[w]
		if p == nil || p.Hooks == nil {
			t.Fatalf("rank %d: no auto plan", w)
		}
		for b, h := range p.Hooks.Hooks {
			if h.Kind != "none" {
				t.Errorf("rank %d: bucket %d gets %v on a link this fast (%v)", w, b, h, p)
			}
		}
		for s := range steps {
			for i := range autoShapes {
				if !slices.Equal(auto.out[w][s][i], ref.out[w][s][i]) {
					t.Fatalf("rank %d, step %d, parameter %d: differs from the plain all-reduce", w, s, i)
				}
			}
		}
		a := allReduces(auto.issued[w])
		if a[len(a)-1] != total {
			t.Errorf("rank %d: the last all-reduce has %d elements, want the bucket's %d", w, a[len(a)-1], total)
		}
	}
}

// TestAutoHookFixedCaps: with BucketCapMB set, the auto hook keeps those caps after its
// measured passes: the final layout is the one a plain reducer with those caps builds.
func TestAutoHookFixedCaps(t *testing.T) {
	opts := Options{BucketCapMB: 0.04, FirstBucketCapMB: 0.01}
	auto := runHook(t, func() CommHook { return AutoHook(AutoHookOptions{}) }, opts, 0, 0, 5, 13)
	ref := runHook(t, AllReduceHook, opts, 0, 0, 5, 13)
	for w := range auto.buckets {
		if !sameBuckets(auto.buckets[w], ref.buckets[w]) || len(ref.buckets[w]) < 2 {
			t.Errorf("rank %d: layout %v, want the caps' %v", w, auto.buckets[w], ref.buckets[w])
		}
		if p := auto.plans[w]; p == nil || !p.Fixed || p.Kept || p.Hooks == nil || len(p.Hooks.Hooks) != len(ref.buckets[w]) {
			t.Errorf("rank %d: plan %+v", w, p)
		}
	}
}

// TestAutoHookRefused: device buckets, a rank below 1, margins out of range, and one
// hook given to two reducers are refused at New, naming the hook.
func TestAutoHookRefused(t *testing.T) {
	c := pgtest.NewCluster(1)
	defer c.Close()
	params := func() []Param {
		return []Param{{Name: "w", Shape: []int{8, 8}, Grad: make([]float32, 64)}}
	}
	for _, tc := range []struct {
		name string
		o    AutoHookOptions
		want string
	}{
		{"rank 0", AutoHookOptions{Ranks: []int{0, 2}}, "PowerSGD rank 0"},
		{"margin", AutoHookOptions{MinGain: 1.5}, "margins"},
		{"rate", AutoHookOptions{PowerSGD: PowerSGDOptions{MinCompressionRate: 0.5}}, "MinCompressionRate"},
		{"start", AutoHookOptions{PowerSGD: PowerSGDOptions{StartIter: -1}}, "StartIter -1"},
	} {
		_, err := New(c.Group(0), params(), Options{CommHook: AutoHook(tc.o)})
		if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "auto(") {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
	h := AutoHook(AutoHookOptions{})
	r, err := New(c.Group(0), params(), Options{CommHook: h})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := New(c.Group(0), params(), Options{CommHook: h}); err == nil || !strings.Contains(err.Error(), "another Reducer") {
		t.Errorf("one hook, two reducers: %v", err)
	}
	if err := h.(*autoHook).Setup(HookSetup{Device: true}); err == nil {
		t.Error("a second Setup, with device buckets, was taken")
	}
	d := AutoHook(AutoHookOptions{}).(*autoHook)
	if err := d.Setup(HookSetup{Device: true}); err == nil || !strings.Contains(err.Error(), "device") {
		t.Errorf("device buckets: %v", err)
	}
}

// TestMeasureCompression: the costs are positive for every rank that compresses the
// model's largest matrix, and no PowerSGD cost is measured where no matrix is compressed.
func TestMeasureCompression(t *testing.T) {
	ps := []HookParam{{Name: "w", DType: procgroup.Float32, Shape: []int{256, 512}}, {Name: "b", DType: procgroup.Float32, Shape: []int{256}}}
	c, err := measureCompression(ps, []int{1, 4}, 2)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.PowerSGD) != 2 || !(c.Cast16Pre > 0) || !(c.Cast16Post > 0) || c.Shapes[1] != nil || len(c.Shapes[0]) != 2 {
		t.Fatalf("%+v", c)
	}
	for _, rc := range c.PowerSGD {
		if !(rc.Pre > 0) || !(rc.Post > 0) {
			t.Errorf("rank %d: %+v", rc.Rank, rc)
		}
	}
	// A matrix wider than the measured elements keeps five rows, which rank 4 compresses.
	wide, err := measureCompression([]HookParam{{Name: "w", DType: procgroup.Float32, Shape: []int{64, 600000}}}, []int{1, 2, 4}, 2)
	if err != nil || len(wide.PowerSGD) != 3 {
		t.Errorf("64×600000: %+v, %v: want the three ranks measured", wide, err)
	}
	vec, err := measureCompression(ps[1:], []int{1}, 2)
	if err != nil || len(vec.PowerSGD) != 0 {
		t.Errorf("no matrix: %+v, %v", vec, err)
	}
}
