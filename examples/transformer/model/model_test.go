package model

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"go.uber.org/goleak"
	"gorgonia.org/tensor"

	"github.com/goddp/goddp/ddp/optim"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestParamCountMatchesPyTorch(t *testing.T) {
	for _, tc := range []struct{ layers, hidden, want int }{
		{2, 256, 1711104},  // ddp_bench.py default
		{4, 512, 13134848}, // its larger config (13.13 M): 4·(12h²+13h) + 2·(h²+h)
	} {
		cfg := DefaultConfig()
		cfg.NumLayers, cfg.Hidden = tc.layers, tc.hidden
		m, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if got := m.NumParams(); got != tc.want {
			t.Errorf("L=%d h=%d: %d params, PyTorch has %d", tc.layers, tc.hidden, got, tc.want)
		}
		ps := m.Params()
		if len(ps) != 4+12*tc.layers || ps[0].Name != "0.weight" || ps[2].Name != "1.layers.0.self_attn.in_proj_weight" || ps[len(ps)-1].Name != "2.bias" {
			t.Errorf("param names: %d params, first %q, third %q", len(ps), ps[0].Name, ps[2].Name)
		}
	}
}

func TestConfigErrors(t *testing.T) {
	for _, c := range []Config{
		{Task: "nope", NumLayers: 1, Hidden: 8, Heads: 2},
		{NumLayers: 1, Hidden: 10, Heads: 3},
		{NumLayers: 1, Hidden: 8, Heads: 2, Dropout: 1},
		{NumLayers: -1, Hidden: 8, Heads: 2},
		{NumLayers: 1, Hidden: 8, Heads: 2, DType: tensor.Int32},
	} {
		if _, err := New(c); !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: err = %v, want ErrConfig", c, err)
		}
	}
	m, _ := New(Config{NumLayers: 1, Hidden: 8, Heads: 2})
	if _, err := m.NewGraph(GraphOptions{Batch: 0, SeqLen: 3}); !errors.Is(err, ErrConfig) {
		t.Errorf("batch 0: %v", err)
	}
}

func tiny(task string, dt tensor.Dtype, dropout float64) Config {
	return Config{Task: task, NumLayers: 2, Hidden: 8, Heads: 2, FF: 12, Vocab: 5, Dropout: dropout, Seed: 7, DType: dt}
}

// TestGradCheck compares every parameter's gradient (a sample of elements of each)
// with float64 central differences through the same graph code, with dropout off and
// on (fixed masks), for both tasks.
func TestGradCheck(t *testing.T) {
	for _, tc := range []struct {
		name    string
		task    string
		dropout float64
	}{{"mse", TaskMSE, 0}, {"mse-dropout", TaskMSE, 0.3}, {"copy", TaskCopy, 0}} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := New(tiny(tc.task, tensor.Float64, tc.dropout))
			if err != nil {
				t.Fatal(err)
			}
			g, err := m.NewGraph(GraphOptions{Batch: 2, SeqLen: 3, Train: tc.dropout > 0, DataSeed: 3})
			if err != nil {
				t.Fatal(err)
			}
			defer g.Close()
			if err := g.Load(1, 0); err != nil {
				t.Fatal(err)
			}
			if _, err := g.Run(); err != nil {
				t.Fatal(err)
			}
			var grads [][]float64
			for i := range m.Params() {
				d, err := g.Grad(i)
				if err != nil {
					t.Fatal(err)
				}
				grads = append(grads, append([]float64(nil), d.Data().([]float64)...))
			}
			flat := m.flat64
			r := rand.New(rand.NewPCG(9, 9))
			const h = 1e-6
			checked := 0
			for i, p := range m.Params() {
				var nonzero bool
				for k := 0; k < 6; k++ {
					e := r.IntN(p.Size)
					orig := flat[p.Offset+e]
					flat[p.Offset+e] = orig + h
					lp, err := g.Run()
					if err != nil {
						t.Fatal(err)
					}
					flat[p.Offset+e] = orig - h
					lm, _ := g.Run()
					flat[p.Offset+e] = orig
					fd := (lp - lm) / (2 * h)
					got := grads[i][e]
					if math.Abs(fd-got) > 1e-6+1e-4*math.Abs(fd) {
						t.Fatalf("%s[%d]: autodiff %.9g, finite difference %.9g", p.Name, e, got, fd)
					}
					nonzero = nonzero || got != 0
					checked++
				}
				if !nonzero && tc.dropout == 0 {
					t.Errorf("%s: all sampled gradients are zero", p.Name)
				}
			}
			t.Logf("%d elements checked", checked)
		})
	}
}

// TestTapsAndRankSplit checks, in float64, that (a) a tapped graph gives the same
// gradients as an untapped one and fires each hook once per run, the output layer
// first; (b) the mean of the gradients of two half batches (samples 0..B−1 and
// B..2B−1, as two ranks would see) equals the gradient of the full batch, dropout on.
func TestTapsAndRankSplit(t *testing.T) {
	m, err := New(tiny(TaskMSE, tensor.Float64, 0.2))
	if err != nil {
		t.Fatal(err)
	}
	n := len(m.Params())
	const B, S, step = 2, 3, 5
	var fired []int
	hooked := make([][]float64, n)
	hook := func(i int, d *tensor.Dense) {
		fired = append(fired, i)
		hooked[i] = append([]float64(nil), d.Data().([]float64)...)
	}
	full, _ := m.NewGraph(GraphOptions{Batch: 2 * B, SeqLen: S, Train: true, DataSeed: 1})
	half, _ := m.NewGraph(GraphOptions{Batch: B, SeqLen: S, Train: true, DataSeed: 1, Hook: hook})
	defer full.Close()
	defer half.Close()

	run := func(g *Graph, first int) [][]float64 {
		if err := g.Load(step, first); err != nil {
			t.Fatal(err)
		}
		if _, err := g.Run(); err != nil {
			t.Fatal(err)
		}
		out := make([][]float64, n)
		for i := range out {
			d, err := g.Grad(i)
			if err != nil {
				t.Fatal(err)
			}
			out[i] = append([]float64(nil), d.Data().([]float64)...)
		}
		return out
	}
	want := run(full, 0)
	var sum [][]float64
	for rank := 0; rank < 2; rank++ {
		fired = fired[:0]
		got := run(half, rank*B)
		if len(fired) != n {
			t.Fatalf("rank %d: hooks fired %v, want each of %d once", rank, fired, n)
		}
		if fired[0] != n-1 || fired[1] != n-2 {
			t.Fatalf("rank %d: hooks fired %v, want the output layer's bias and weight first", rank, fired)
		}
		for k := 1; k < n; k++ {
			if a, b := stage(m.Params()[fired[k-1]].Name), stage(m.Params()[fired[k]].Name); b > a {
				t.Fatalf("rank %d: hooks fired %v: not in reverse layer order", rank, fired)
			}
		}
		seen := map[int]bool{}
		for _, i := range fired {
			if seen[i] {
				t.Fatalf("hook %d fired twice", i)
			}
			seen[i] = true
			for k := range got[i] {
				if math.Float64bits(got[i][k]) != math.Float64bits(hooked[i][k]) {
					t.Fatalf("param %d: hook saw %v, Grad is %v", i, hooked[i][k], got[i][k])
				}
			}
		}
		if sum == nil {
			sum = got
			continue
		}
		for i := range sum {
			for k := range sum[i] {
				sum[i][k] += got[i][k]
			}
		}
	}
	for i := range want {
		for k := range want[i] {
			if avg := sum[i][k] / 2; math.Abs(avg-want[i][k]) > 1e-12*math.Max(1, math.Abs(want[i][k])) {
				t.Fatalf("%s[%d]: mean of halves %v, full batch %v", m.Params()[i].Name, k, avg, want[i][k])
			}
		}
	}
}

func TestCopyTaskLearns(t *testing.T) {
	cfg := tiny(TaskCopy, tensor.Float32, 0.1)
	cfg.Hidden, cfg.FF, cfg.Vocab = 16, 32, 8
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	grad := make([]float32, m.NumParams())
	params := m.Params()
	hook := func(i int, d *tensor.Dense) { copy(grad[params[i].Offset:], d.Data().([]float32)) }
	g, err := m.NewGraph(GraphOptions{Batch: 4, SeqLen: 8, Train: true, Hook: hook})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	opt, _ := optim.NewAdamW(m.NumParams(), optim.AdamWOptions{LR: 1e-2})
	var first, last float64
	for step := 0; step < 40; step++ {
		if err := g.Load(step, 0); err != nil {
			t.Fatal(err)
		}
		loss, err := g.Run()
		if err != nil {
			t.Fatal(err)
		}
		if err := opt.Step(m.Data32(), grad); err != nil {
			t.Fatal(err)
		}
		if step == 0 {
			first = loss
		}
		last = loss
	}
	// Chance is ln 8 ≈ 2.08; copying is easy, the loss must fall well below it.
	if !(last < first/3) {
		t.Fatalf("copy task: loss %v → %v, did not fall", first, last)
	}
	t.Logf("copy loss %.3f → %.3f", first, last)
}

func TestDeterministicInit(t *testing.T) {
	a, _ := New(DefaultConfig())
	b, _ := New(DefaultConfig())
	cfg := DefaultConfig()
	cfg.Seed = 1
	c, _ := New(cfg)
	da, db, dc := a.Data32(), b.Data32(), c.Data32()
	same := 0
	for i := range da {
		if da[i] != db[i] {
			t.Fatalf("same seed, element %d differs", i)
		}
		if da[i] == dc[i] {
			same++
		}
	}
	// LayerNorm ones and zero biases coincide; random weights must not.
	if same > m0(a) {
		t.Fatalf("different seeds share %d elements", same)
	}
}

// m0 counts the deterministic (non-random) elements: zero biases and LayerNorm.
func m0(m *Model) int {
	n := 0
	for _, p := range m.Params() {
		if strings.Contains(p.Name, "norm") || strings.Contains(p.Name, "in_proj_bias") || strings.Contains(p.Name, "out_proj.bias") {
			n += p.Size
		}
	}
	return n
}

// stage is a parameter's position in the forward: 0 for the input layer, l+1 for
// encoder layer l, a large number for the output layer.
func stage(name string) int {
	var l int
	switch {
	case strings.HasPrefix(name, "0."):
		return 0
	case strings.HasPrefix(name, "2."):
		return 1 << 20
	default:
		if _, err := fmt.Sscanf(name, "1.layers.%d.", &l); err != nil {
			panic(name)
		}
		return l + 1
	}
}

// TestHooksOverlapBackward: each grad-ready hook fires as soon as its gradient is
// complete (Note [Tap placement]), not after the whole backward: the output layer's
// hooks run after the backward's first two matrix products (its weight and input
// gradients), every layer's hooks run before the next lower layer's, and the input
// layer's after the last product.
func TestHooksOverlapBackward(t *testing.T) {
	m, err := New(tiny(TaskMSE, tensor.Float32, 0.1))
	if err != nil {
		t.Fatal(err)
	}
	n := len(m.Params())
	at := make([]int64, n) // matrix products run before hook i fired
	var start int64
	g, err := m.NewGraph(GraphOptions{Batch: 2, SeqLen: 3, Train: true, Hook: func(i int, _ *tensor.Dense) {
		at[i] = matMulRuns.Load() - start
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := g.Load(0, 0); err != nil {
		t.Fatal(err)
	}
	start = matMulRuns.Load()
	if _, err := g.Run(); err != nil {
		t.Fatal(err)
	}
	total := matMulRuns.Load() - start
	if at[n-1] != 2 || at[n-2] != 2 {
		t.Errorf("output layer hooks after %d and %d of %d matrix products, want 2", at[n-1], at[n-2], total)
	}
	if at[0] != total || at[1] != total {
		t.Errorf("input layer hooks after %d and %d of %d matrix products", at[0], at[1], total)
	}
	ps := m.Params()
	for i := range ps {
		for j := range ps {
			if stage(ps[i].Name) > stage(ps[j].Name) && at[i] > at[j] {
				t.Errorf("%s's hook after %d products, %s's after %d", ps[i].Name, at[i], ps[j].Name, at[j])
			}
		}
	}
	t.Logf("matrix products before each hook: %v (of %d)", at, total)
}
