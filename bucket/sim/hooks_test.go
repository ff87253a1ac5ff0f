package sim

import (
	"errors"
	"math"
	"testing"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/procgroup/dtype"
)

// hookModel is a transformer-like model: four 256×1024 matrices and their 1-D biases, with
// their gradients ready one after another over 40 ms of backward, on a link of the given
// speed (bytes per second each way) between two ranks.
func hookModel(bytesPerSec float64) *Profile {
	p := &Profile{Backward: 0.040, Other: 0.020, CopyPerByte: 1e-10, UnpackPerByte: 1e-10, Launch: 1e-5,
		Comm: Ring(2, 50e-6, bytesPerSec), World: 2}
	var shapes [][]int
	for range 4 {
		p.Params = append(p.Params, bucket.Param{Name: "w", DType: dtype.Float32, Len: 256 * 1024}, bucket.Param{Name: "b", DType: dtype.Float32, Len: 256})
		shapes = append(shapes, []int{256, 1024}, nil)
	}
	n := len(p.Params)
	p.Ready = make([]float64, n)
	for k := range n {
		i := n - 1 - k
		p.Order = append(p.Order, i)
		p.Ready[i] = 0.040 * float64(k+1) / float64(n)
	}
	p.Compression = &Compression{Shapes: shapes, MinCompressionRate: 2, Cast16Pre: 0.5e-9, Cast16Post: 0.5e-9,
		PowerSGD: []RankCost{{Rank: 1, Pre: 1e-9, Post: 0.3e-9}, {Rank: 2, Pre: 1.1e-9, Post: 0.35e-9}, {Rank: 4, Pre: 1.3e-9, Post: 0.4e-9}}}
	return p
}

// TestHookCost checks the bytes and compute each hook is priced at, against the rule
// written out by hand (Note [Hooks in the model]).
func TestHookCost(t *testing.T) {
	p := hookModel(125e6)
	c := p.Compression
	b := bucket.Bucket{Params: []int{0, 1}} // a 256×1024 matrix and its 256 biases
	near := func(what string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 1e-12*math.Max(1, math.Abs(want)) {
			t.Errorf("%s = %v, want %v", what, got, want)
		}
	}
	none, err := c.Cost(p, b, Hook{Kind: "none"})
	if err != nil || none.Wire != 4*(256*1024+256) || none.Pre != 0 || none.Post != 0 {
		t.Errorf("none: %+v, %v", none, err)
	}
	bf, _ := c.Cost(p, b, Hook{Kind: "bf16"})
	if bf.Wire != 2*(256*1024+256) {
		t.Errorf("bf16 wire %d", bf.Wire)
	}
	near("bf16 pre", bf.Pre, 0.5e-9*(256*1024+256))
	near("bf16 post", bf.Post, 0.5e-9*(256*1024+256))
	ps, _ := c.Cost(p, b, Hook{Kind: "powersgd", Rank: 2})
	// The biases as they are (1 KiB), and the matrix as the mean of 256·2 and 1024·2
	// float32s: (512+2048)/2·4 bytes.
	if want := int64(1024 + (512+2048)/2*4); ps.Wire != want || ps.Compressed != 1 {
		t.Errorf("powersgd(r=2): wire %d, compressed %d; want %d and 1", ps.Wire, ps.Compressed, want)
	}
	near("powersgd pre", ps.Pre, 1.1e-9*256*1024+1e-10*1024)
	near("powersgd post", ps.Post, 0.35e-9*256*1024+1e-10*1024)
	// A matrix that rank r does not compress goes as it is: 8×8 at rank 4 saves nothing.
	small := &Profile{Params: []bucket.Param{{Name: "s", DType: dtype.Float64, Len: 64}}, CopyPerByte: 1e-10,
		Compression: &Compression{Shapes: [][]int{{8, 8}}, MinCompressionRate: 1, PowerSGD: []RankCost{{Rank: 4, Pre: 1, Post: 1}}}}
	sc, _ := small.Compression.Cost(small, bucket.Bucket{Params: []int{0}}, Hook{Kind: "powersgd", Rank: 4})
	if sc.Wire != 512 || sc.Compressed != 0 {
		t.Errorf("8×8 at rank 4: %+v, want 512 bytes uncompressed", sc)
	}
	if _, err := c.Cost(p, b, Hook{Kind: "powersgd", Rank: 3}); !errors.Is(err, ErrInvalid) {
		t.Errorf("an unmeasured rank: %v", err)
	}
}

// TestSimulateHooksPlain: the plain all-reduce's costs give Simulate's result; a hook that
// moves fewer bytes over a slow link shortens the step by about the bytes' time it saves
// beyond backward, and its compute lengthens it.
func TestSimulateHooksPlain(t *testing.T) {
	p := hookModel(125e6)
	bs, err := p.Layout(1<<20, 25<<20)
	if err != nil {
		t.Fatal(err)
	}
	plain, _ := p.Simulate(bs)
	costs := make([]HookCost, len(bs))
	for b := range bs {
		costs[b], _ = p.Compression.Cost(p, bs[b], Hook{Kind: "none"})
	}
	same, _ := p.SimulateHooks(bs, costs)
	if same != plain {
		t.Errorf("none's costs: %+v, want Simulate's %+v", same, plain)
	}
	for b := range costs {
		costs[b].Wire /= 2
	}
	half, _ := p.SimulateHooks(bs, costs)
	if !(half.Step < plain.Step) || !(half.Exposed < plain.Exposed) {
		t.Errorf("half the bytes: %+v, not shorter than %+v", half, plain)
	}
	for b := range costs {
		costs[b].Post = 0.010
	}
	// Finalize finishes a bucket while the next is still reducing: the last bucket's 10 ms
	// add in full, the others' at most in full.
	slow, _ := p.SimulateHooks(bs, costs)
	if d := slow.Step - half.Step; d < 0.010-1e-9 || d > 0.010*float64(len(bs))+1e-9 {
		t.Errorf("10 ms of Finalize compute per bucket added %v s over %d buckets", d, len(bs))
	}
	if _, err := p.SimulateHooks(bs, costs[:1]); !errors.Is(err, ErrInvalid) && len(bs) > 1 {
		t.Errorf("too few costs: %v", err)
	}
}

// TestBestHooks: over 1 Gbit/s the 4.2 MB of gradients take 34 ms each way, as long as
// backward, and compression wins; PowerSGD at rank 4 is chosen, the most accurate within 2%
// of the fastest. On a link a hundred times faster, compression saves less than its
// compute costs and the plain all-reduce is kept. Where rank 4's compute is dear, a lower
// rank is chosen.
func TestBestHooks(t *testing.T) {
	slow := hookModel(125e6)
	bs, _ := slow.Layout(64<<20, 64<<20) // one bucket: its collective all exposed
	plan, err := slow.BestHooks(bs, HookOptions{MinGain: DefaultMinGain, Accuracy: DefaultHookAccuracy, MinSaving: DefaultHookMinSaving})
	if err != nil {
		t.Fatal(err)
	}
	if plan.Kept || !(plan.Gain >= DefaultMinGain) || plan.Predicted.Step > plan.Fastest.Step*(1+DefaultHookAccuracy) {
		t.Fatalf("slow link: %+v", plan)
	}
	for b, h := range plan.Hooks {
		if h != (Hook{Kind: "powersgd", Rank: 4}) {
			t.Errorf("slow link: bucket %d gets %v, want powersgd(r=4) (plan %s)", b, h, plan.Summary())
		}
	}
	// The plan's prediction is what SimulateHooks gives for its hooks.
	costs := make([]HookCost, len(bs))
	for b, h := range plan.Hooks {
		costs[b], _ = slow.Compression.Cost(slow, bs[b], h)
	}
	if r, _ := slow.SimulateHooks(bs, costs); r != plan.Predicted {
		t.Errorf("plan predicted %+v, SimulateHooks %+v", plan.Predicted, r)
	}

	fast := hookModel(12.5e9)
	plan, err = fast.BestHooks(bs, HookOptions{MinGain: DefaultMinGain, Accuracy: DefaultHookAccuracy, MinSaving: DefaultHookMinSaving})
	if err != nil {
		t.Fatal(err)
	}
	if !plan.Kept || plan.Gain != 0 || plan.Predicted != plan.None {
		t.Errorf("fast link: %+v, want the plain all-reduce kept", plan)
	}
	for b, h := range plan.Hooks {
		if h.Kind != "none" {
			t.Errorf("fast link: bucket %d gets %v", b, h)
		}
	}

	// Rank 4 dear, and the default caps: the first bucket, reduced under backward, gains
	// nothing from compression and stays plain; the last is compressed at a lower rank.
	dear := hookModel(125e6)
	dear.Compression.PowerSGD[2].Pre = 20e-9 // rank 4: 5 ms per matrix
	bs, _ = dear.Layout(1<<20, 25<<20)
	plan, _ = dear.BestHooks(bs, HookOptions{MinGain: DefaultMinGain, Accuracy: DefaultHookAccuracy, MinSaving: DefaultHookMinSaving})
	if len(bs) < 2 || plan.Hooks[len(bs)-1].Kind != "powersgd" {
		t.Errorf("rank 4 dear: %d buckets, plan %s: want the last compressed", len(bs), plan.Summary())
	}
	for b, h := range plan.Hooks {
		if h.Rank == 4 {
			t.Errorf("rank 4 dear: bucket %d gets %v (plan %s)", b, h, plan.Summary())
		}
	}
	if _, err := dear.BestHooks(bs, HookOptions{MinGain: 1}); !errors.Is(err, ErrInvalid) {
		t.Errorf("a margin of 1: %v", err)
	}
	dear.Compression = nil
	if _, err := dear.BestHooks(bs, HookOptions{}); !errors.Is(err, ErrInvalid) {
		t.Errorf("no compression costs: %v", err)
	}
}
