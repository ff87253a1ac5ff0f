package model

import (
	"math"
	"math/rand/v2"
	"testing"

	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"
)

// opCase builds one fused op on float64 inputs for the finite-difference check.
type opCase struct {
	name   string
	shapes [][]int // input shapes
	masks  []bool  // input i is a dropout mask (values 0 or 1/(1−p), not differentiated)
	build  func(in []*G.Node) (*G.Node, error)
}

func opCases() []opCase {
	const B, S, H, h = 2, 3, 2, 4
	N := B * S
	return []opCase{
		{"linear", [][]int{{N, 3}, {3, 5}, {1, 5}}, nil, func(in []*G.Node) (*G.Node, error) {
			return fusedLinear(in[0], in[1], in[2], false, nil, true)
		}},
		{"linear-relu", [][]int{{N, 3}, {3, 5}, {1, 5}}, nil, func(in []*G.Node) (*G.Node, error) {
			return fusedLinear(in[0], in[1], in[2], true, nil, true)
		}},
		{"linear-relu-dropout", [][]int{{N, 3}, {3, 5}, {1, 5}, {N, 5}}, []bool{false, false, false, true}, func(in []*G.Node) (*G.Node, error) {
			return fusedLinear(in[0], in[1], in[2], true, in[3], true)
		}},
		{"linear-dropout", [][]int{{N, 3}, {3, 5}, {1, 5}, {N, 5}}, []bool{false, false, false, true}, func(in []*G.Node) (*G.Node, error) {
			return fusedLinear(in[0], in[1], in[2], false, in[3], true)
		}},
		{"attention", [][]int{{N, 3 * h}}, nil, func(in []*G.Node) (*G.Node, error) {
			return fusedAttention(in[0], B, S, H, nil)
		}},
		{"attention-dropout", [][]int{{N, 3 * h}, {B * H, S, S}}, []bool{false, true}, func(in []*G.Node) (*G.Node, error) {
			return fusedAttention(in[0], B, S, H, in[1])
		}},
		{"add-layernorm", [][]int{{N, h}, {N, h}, {1, h}, {1, h}}, nil, func(in []*G.Node) (*G.Node, error) {
			return fusedAddLayerNorm(in[0], in[1], in[2], in[3], nil)
		}},
		{"add-layernorm-dropout", [][]int{{N, h}, {N, h}, {1, h}, {1, h}, {N, h}}, []bool{false, false, false, false, true}, func(in []*G.Node) (*G.Node, error) {
			return fusedAddLayerNorm(in[0], in[1], in[2], in[3], in[4])
		}},
	}
}

// TestFusedOpGradients checks every differentiable input of every fused op against
// float64 central differences of L = Σ op(inputs)⊙R (R random), all elements.
func TestFusedOpGradients(t *testing.T) {
	for _, tc := range opCases() {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(1, uint64(len(tc.name))))
			g := G.NewGraph()
			var nodes []*G.Node
			var vals [][]float64
			var wrt []*G.Node
			var wrtVals [][]float64
			for i, s := range tc.shapes {
				n := tensor.Shape(s).TotalSize()
				v := make([]float64, n)
				isMask := i < len(tc.masks) && tc.masks[i]
				for k := range v {
					if isMask {
						if r.Float64() < 0.3 {
							v[k] = 0
						} else {
							v[k] = 1 / 0.7
						}
					} else {
						v[k] = r.NormFloat64()
					}
				}
				d := tensor.New(tensor.WithShape(s...), tensor.WithBacking(v))
				node := G.NewTensor(g, tensor.Float64, len(s), G.WithShape(s...), G.WithValue(d), G.WithName(string(rune('a'+i))))
				nodes = append(nodes, node)
				vals = append(vals, v)
				if !isMask {
					wrt = append(wrt, node)
					wrtVals = append(wrtVals, v)
				}
			}
			y, err := tc.build(nodes)
			if err != nil {
				t.Fatal(err)
			}
			rv := make([]float64, y.Shape().TotalSize())
			for k := range rv {
				rv[k] = r.NormFloat64()
			}
			R := G.NewTensor(g, tensor.Float64, y.Dims(), G.WithShape(y.Shape()...), G.WithValue(tensor.New(tensor.WithShape(y.Shape()...), tensor.WithBacking(rv))), G.WithName("R"))
			loss := G.Must(G.Sum(G.Must(G.HadamardProd(y, R))))
			grads, err := G.Grad(loss, wrt...)
			if err != nil {
				t.Fatal(err)
			}
			vm := G.NewTapeMachine(g)
			defer vm.Close()
			run := func() float64 {
				vm.Reset()
				if err := vm.RunAll(); err != nil {
					t.Fatal(err)
				}
				return loss.Value().Data().(float64)
			}
			run()
			var got [][]float64
			for _, gn := range grads {
				got = append(got, append([]float64(nil), gn.Value().Data().([]float64)...))
			}
			const eps = 1e-6
			for i, v := range wrtVals {
				for k := range v {
					orig := v[k]
					v[k] = orig + eps
					lp := run()
					v[k] = orig - eps
					lm := run()
					v[k] = orig
					fd := (lp - lm) / (2 * eps)
					if math.Abs(fd-got[i][k]) > 1e-6+1e-5*math.Abs(fd) {
						t.Fatalf("input %s[%d]: gradient %.9g, finite difference %.9g", wrt[i].Name(), k, got[i][k], fd)
					}
				}
			}
		})
	}
}

// TestFusedKernelsAgainstNaive compares the forward kernels with straightforward
// float64 formulas, element by element, on random data.
func TestFusedKernelsAgainstNaive(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 5))
	rnd := func(n int) []float64 {
		v := make([]float64, n)
		for i := range v {
			v[i] = r.NormFloat64()
		}
		return v
	}
	mask := func(n int) []float64 {
		v := make([]float64, n)
		for i := range v {
			if r.IntN(4) > 0 {
				v[i] = 4.0 / 3
			}
		}
		return v
	}
	close := func(what string, got, want []float64) {
		t.Helper()
		for i := range want {
			if math.Abs(got[i]-want[i]) > 1e-12*math.Max(1, math.Abs(want[i])) {
				t.Fatalf("%s[%d] = %v, want %v", what, i, got[i], want[i])
			}
		}
	}

	// Attention: B=2, S=5, H=3, dh=4.
	d := attnDims{B: 2, S: 5, H: 3, dh: 4, alpha: 0.5}
	h := d.H * d.dh
	qkv, m := rnd(d.B*d.S*3*h), mask(d.B*d.H*d.S*d.S)
	p, pd, ctx := make([]float64, len(m)), make([]float64, len(m)), make([]float64, d.B*d.S*h)
	attnFwd(d, qkv, m, p, pd, ctx)
	want := make([]float64, len(ctx))
	for b := 0; b < d.B; b++ {
		for hd := 0; hd < d.H; hd++ {
			at := func(row, blk, j int) float64 { return qkv[(b*d.S+row)*3*h+blk*h+hd*d.dh+j] }
			for i := 0; i < d.S; i++ {
				sc := make([]float64, d.S)
				var mx = math.Inf(-1)
				for j := range sc {
					for c := 0; c < d.dh; c++ {
						sc[j] += at(i, 0, c) * at(j, 1, c)
					}
					sc[j] *= d.alpha
					mx = math.Max(mx, sc[j])
				}
				var z float64
				for j := range sc {
					sc[j] = math.Exp(sc[j] - mx)
					z += sc[j]
				}
				for c := 0; c < d.dh; c++ {
					var acc float64
					for j := range sc {
						acc += sc[j] / z * m[((b*d.H+hd)*d.S+i)*d.S+j] * at(j, 2, c)
					}
					want[(b*d.S+i)*h+hd*d.dh+c] = acc
				}
			}
		}
	}
	close("attention", ctx, want)

	// Residual + LayerNorm with dropout.
	rows, n := 6, 7
	x, s, gamma, beta, mk := rnd(rows*n), rnd(rows*n), rnd(n), rnd(n), mask(rows*n)
	y, xhat, rstd := make([]float64, rows*n), make([]float64, rows*n), make([]float64, rows)
	addLNFwd(x, s, mk, gamma, beta, rows, n, y, xhat, rstd)
	for i := 0; i < rows; i++ {
		z := make([]float64, n)
		var mean, v float64
		for j := range z {
			z[j] = x[i*n+j] + s[i*n+j]*mk[i*n+j]
			mean += z[j] / float64(n)
		}
		for j := range z {
			v += (z[j] - mean) * (z[j] - mean) / float64(n)
		}
		for j := range z {
			want := (z[j]-mean)/math.Sqrt(v+1e-5)*gamma[j] + beta[j]
			close("layernorm", y[i*n+j:i*n+j+1], []float64{want})
		}
	}

	// Linear + relu + dropout.
	in, out := 5, 3
	xl, w, bl, ml := rnd(rows*in), rnd(in*out), rnd(out), mask(rows*out)
	yl := make([]float64, rows*out)
	linearFwd(xl, w, bl, rows, in, out, true, ml, yl)
	for i := 0; i < rows; i++ {
		for j := 0; j < out; j++ {
			acc := bl[j]
			for k := 0; k < in; k++ {
				acc += xl[i*in+k] * w[k*out+j]
			}
			close("linear", yl[i*out+j:i*out+j+1], []float64{math.Max(acc, 0) * ml[i*out+j]})
		}
	}
}

// TestFloat32MatchesFloat64 runs the whole default-shaped model (dropout on) in float32
// and float64 from the same parameters and data: the float32 kernels (branch-free
// relu, math32 softmax) must agree with the float64 ones to float32 accuracy, and two
// float32 runs must agree bit for bit.
func TestFloat32MatchesFloat64(t *testing.T) {
	cfg := Config{NumLayers: 2, Hidden: 32, Heads: 4, Dropout: 0.1, Seed: 3}
	m32, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfg.DType = tensor.Float64
	m64, _ := New(cfg)
	for i, v := range m64.flat64 {
		m32.Data32()[i] = float32(v) // the same values in both
	}
	for i, v := range m32.Data32() {
		m64.flat64[i] = float64(v)
	}
	o := GraphOptions{Batch: 3, SeqLen: 8, Train: true, DataSeed: 4}
	g32, err := m32.NewGraph(o)
	if err != nil {
		t.Fatal(err)
	}
	defer g32.Close()
	g64, _ := m64.NewGraph(o)
	defer g64.Close()
	grads := func(g *Graph) ([][]float64, float64) {
		if err := g.Load(2, 0); err != nil {
			t.Fatal(err)
		}
		loss, err := g.Run()
		if err != nil {
			t.Fatal(err)
		}
		var out [][]float64
		for i := range m32.Params() {
			d, err := g.Grad(i)
			if err != nil {
				t.Fatal(err)
			}
			var v []float64
			switch s := d.Data().(type) {
			case []float32:
				for _, x := range s {
					v = append(v, float64(x))
				}
			case []float64:
				v = append(v, s...)
			}
			out = append(out, v)
		}
		return out, loss
	}
	a, la := grads(g32)
	b, lb := grads(g32)
	c, lc := grads(g64)
	if la != lb || math.Abs(la-lc) > 1e-5*lc {
		t.Fatalf("loss: float32 %v then %v, float64 %v", la, lb, lc)
	}
	for i, p := range m32.Params() {
		var scale float64
		for _, v := range c[i] {
			scale = math.Max(scale, math.Abs(v))
		}
		for k := range c[i] {
			if math.Float64bits(a[i][k]) != math.Float64bits(b[i][k]) {
				t.Fatalf("%s[%d]: float32 runs differ: %v, %v", p.Name, k, a[i][k], b[i][k])
			}
			if math.Abs(a[i][k]-c[i][k]) > 2e-3*scale+1e-7 {
				t.Fatalf("%s[%d]: float32 %v, float64 %v (scale %v)", p.Name, k, a[i][k], c[i][k], scale)
			}
		}
	}
}

// TestFusedOpErrors: mismatched shapes are build errors, bad values are run errors,
// never panics.
func TestFusedOpErrors(t *testing.T) {
	g := G.NewGraph()
	mk := func(dt tensor.Dtype, s ...int) *G.Node {
		return G.NewTensor(g, dt, len(s), G.WithShape(s...), G.WithInit(G.Zeroes()))
	}
	x, w, b := mk(tensor.Float32, 4, 3), mk(tensor.Float32, 2, 5), mk(tensor.Float32, 1, 5)
	if _, err := fusedLinear(x, w, b, false, nil, true); err == nil {
		t.Error("linear with x [4 3], w [2 5]: no error")
	}
	if _, err := fusedLinear(x, mk(tensor.Float32, 3, 5), b, true, mk(tensor.Float32, 4, 4), true); err == nil {
		t.Error("linear with a [4 4] mask for a [4 5] output: no error")
	}
	if _, err := fusedAttention(mk(tensor.Float32, 6, 12), 2, 4, 2, nil); err == nil {
		t.Error("attention with 6 rows for batch 2 × seq 4: no error")
	}
	if _, err := fusedAttention(mk(tensor.Float32, 6, 12), 2, 3, 2, mk(tensor.Float32, 4, 3, 2)); err == nil {
		t.Error("attention with a short mask: no error")
	}
	if _, err := fusedAddLayerNorm(x, mk(tensor.Float32, 4, 2), mk(tensor.Float32, 1, 3), mk(tensor.Float32, 1, 3), nil); err == nil {
		t.Error("add_layernorm with s [4 2] for x [4 3]: no error")
	}
	if _, err := matMul(x, w, false, false); err == nil {
		t.Error("matMul [4 3]·[2 5]: no error")
	}
	// Run-time checks: wrong dtype, wrong size, wrong arity.
	op := &linearOp{opBase: newBase("fusedLinear", tensor.Float32, tensor.Shape{4, 5}, x, w, b), rows: 4, in: 3, out: 5}
	good := []G.Value{tensor.New(tensor.Of(tensor.Float32), tensor.WithShape(4, 3)), tensor.New(tensor.Of(tensor.Float32), tensor.WithShape(3, 5)), tensor.New(tensor.Of(tensor.Float32), tensor.WithShape(1, 5))}
	if _, err := op.Do(good...); err != nil {
		t.Fatalf("good inputs: %v", err)
	}
	for name, in := range map[string][]G.Value{
		"float64": {tensor.New(tensor.Of(tensor.Float64), tensor.WithShape(4, 3)), good[1], good[2]},
		"short":   {tensor.New(tensor.Of(tensor.Float32), tensor.WithShape(2, 3)), good[1], good[2]},
		"arity":   good[:2],
		"scalar":  {G.NewF32(1), good[1], good[2]},
	} {
		if _, err := op.Do(in...); err == nil {
			t.Errorf("%s inputs: no error", name)
		}
	}
	grad := &attnGradOp{opBase: newBase("fusedAttentionGrad", tensor.Float32, tensor.Shape{6, 12}), fwd: &attnOp{d: attnDims{B: 2, S: 3, H: 2, dh: 2}}}
	_, err := grad.Do(tensor.New(tensor.Of(tensor.Float32), tensor.WithShape(6, 12)), tensor.New(tensor.Of(tensor.Float32), tensor.WithShape(6, 4)))
	if err == nil {
		t.Error("attention backward before its forward: no error")
	}
}

// TestFusedOpsDistinct: two ops with the same inputs stay two nodes (gorgonia merges
// nodes whose op hashes and children are equal).
func TestFusedOpsDistinct(t *testing.T) {
	g := G.NewGraph()
	a := G.NewTensor(g, tensor.Float32, 2, G.WithShape(3, 4), G.WithInit(G.Zeroes()))
	b := G.NewTensor(g, tensor.Float32, 2, G.WithShape(4, 2), G.WithInit(G.Zeroes()))
	x, _ := matMul(a, b, false, false)
	y, _ := matMul(a, b, false, false)
	if x == y {
		t.Fatal("two matMul ops on the same inputs were merged into one node")
	}
}

// TestExpNeg32 compares the softmax exponential with math.Exp over its domain.
func TestExpNeg32(t *testing.T) {
	r := rand.New(rand.NewPCG(2, 2))
	for i := 0; i < 200000; i++ {
		x := -float32(r.Float64() * 90)
		if i < 1000 {
			x = -float32(r.Float64()) // near 0, where softmax mass is
		}
		got, want := float64(expNeg32(x)), math.Exp(float64(x))
		if x < -87 {
			want = 0
		}
		if math.Abs(got-want) > 5e-7*want {
			t.Fatalf("expNeg32(%v) = %v, want %v (rel. error %.2g)", x, got, want, math.Abs(got-want)/want)
		}
	}
	for _, x := range []float32{0, -1e-30, float32(math.Inf(-1)), float32(math.NaN()), -87, -87.5} {
		got, want := float64(expNeg32(x)), math.Exp(float64(x))
		if !(x >= -87) {
			want = 0
		}
		if math.Abs(got-want) > 5e-7*want {
			t.Errorf("expNeg32(%v) = %v, want %v", x, got, want)
		}
	}
}
