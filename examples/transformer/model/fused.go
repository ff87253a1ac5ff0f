package model

import (
	"fmt"
	"math"
	"sync/atomic"

	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"
)

// The fused ops of Note [Fused ops]. Forward ops implement gorgonia.SDOp; their
// backward ops are plain Ops created by SymDiff.

// scratch returns *p as a []T of n elements, allocating it the first time.
func scratch[T float32 | float64](p *any, n int) []T {
	if s, ok := (*p).([]T); ok && len(s) == n {
		return s
	}
	s := make([]T, n)
	*p = s
	return s
}

func apply(op G.Op, in ...*G.Node) (*G.Node, error) {
	n, err := G.ApplyOp(op, in...)
	if err != nil {
		return nil, fmt.Errorf("%v: %w", op, err)
	}
	return n, nil
}

func shapeOf(n *G.Node) tensor.Shape { return n.Shape() }

func want2D(name string, n *G.Node) (rows, cols int, err error) {
	s := shapeOf(n)
	if len(s) != 2 {
		return 0, 0, fmt.Errorf("model: %s: input %s has shape %v, want 2-D", name, n.Name(), s)
	}
	return s[0], s[1], nil
}

// ---- linear: y = act(x·W + b) ⊙ mask ----

type linearOp struct {
	opBase
	rows, in, out int
	relu, mask    bool
}

// fusedLinear is y = x·w + b, then relu when relu, then ⊙mask when mask is not nil;
// x [rows, in], w [in, out], b [1, out], mask [rows, out]. needDX false skips the
// gradient with respect to x (x is a data input).
func fusedLinear(x, w, b *G.Node, relu bool, mask *G.Node, needDX bool) (*G.Node, error) {
	rows, in, err := want2D("linear", x)
	if err != nil {
		return nil, err
	}
	ws := shapeOf(w)
	if len(ws) != 2 || ws[0] != in || !shapeOf(b).Eq(tensor.Shape{1, ws[1]}) {
		return nil, fmt.Errorf("model: linear: x %v, w %v, b %v do not fit", shapeOf(x), ws, shapeOf(b))
	}
	out := ws[1]
	ins := []*G.Node{x, w, b}
	if mask != nil {
		if !shapeOf(mask).Eq(tensor.Shape{rows, out}) {
			return nil, fmt.Errorf("model: linear: mask %v, want %v", shapeOf(mask), tensor.Shape{rows, out})
		}
		ins = append(ins, mask)
	}
	op := &linearOp{opBase: newBase("fusedLinear", x.Dtype(), tensor.Shape{rows, out}, ins...), rows: rows, in: in, out: out, relu: relu, mask: mask != nil}
	op.diff = []bool{needDX, true, true, false}[:len(ins)]
	return apply(op, ins...)
}

func (o *linearOp) Do(vs ...G.Value) (G.Value, error) {
	if isF64(o.dt) {
		return doLinear[float64](o, vs)
	}
	return doLinear[float32](o, vs)
}

func doLinear[T float32 | float64](o *linearOp, vs []G.Value) (G.Value, error) {
	want := []int{o.rows * o.in, o.in * o.out, o.out, o.rows * o.out}[:3+btoi(o.mask)]
	in, err := inputs[T](o.name, vs, want...)
	if err != nil {
		return nil, err
	}
	var mask []T
	if o.mask {
		mask = in[3]
	}
	y := o.output()
	linearFwd(in[0], in[1], in[2], o.rows, o.in, o.out, o.relu, mask, y.Data().([]T))
	return y, nil
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (o *linearOp) SymDiff(in G.Nodes, output, grad *G.Node) (G.Nodes, error) {
	dpre := grad
	if o.relu || o.mask {
		ins := []*G.Node{output, grad}
		if o.mask {
			ins = append(ins, in[3])
		}
		op := &actGradOp{opBase: newBase("fusedLinearActGrad", o.dt, tensor.Shape{o.rows, o.out}, ins...), relu: o.relu, mask: o.mask}
		var err error
		if dpre, err = apply(op, ins...); err != nil {
			return nil, err
		}
	}
	ret := make(G.Nodes, len(in))
	var err error
	// Bias, weight, then input: the parameters' gradients come first on the tape.
	if ret[2], err = apply(newColSum(o.dt, dpre, o.rows, o.out), dpre); err != nil {
		return nil, err
	}
	if ret[1], err = matMul(in[0], dpre, true, false); err != nil {
		return nil, err
	}
	if o.diff[0] {
		if ret[0], err = matMul(dpre, in[1], false, true); err != nil {
			return nil, err
		}
	}
	return ret, nil
}

type actGradOp struct {
	opBase
	relu, mask bool
}

func (o *actGradOp) Do(vs ...G.Value) (G.Value, error) {
	if isF64(o.dt) {
		return doActGrad[float64](o, vs)
	}
	return doActGrad[float32](o, vs)
}

func doActGrad[T float32 | float64](o *actGradOp, vs []G.Value) (G.Value, error) {
	n := o.out.TotalSize()
	want := []int{n, n, n}[:2+btoi(o.mask)]
	in, err := inputs[T](o.name, vs, want...)
	if err != nil {
		return nil, err
	}
	var mask []T
	if o.mask {
		mask = in[2]
	}
	out := o.output()
	actGrad(in[0], in[1], mask, o.relu, out.Data().([]T))
	return out, nil
}

// ---- matMul: op(a)·op(b) on BLAS ----

type matMulOp struct {
	opBase
	tA, tB  bool
	m, n, k int
	ar, ac  int // a's rows and columns as stored
	br, bc  int
}

func matMul(a, b *G.Node, tA, tB bool) (*G.Node, error) {
	ar, ac, err := want2D("matMul", a)
	if err != nil {
		return nil, err
	}
	br, bc, err := want2D("matMul", b)
	if err != nil {
		return nil, err
	}
	m, k := ar, ac
	if tA {
		m, k = ac, ar
	}
	k2, n := br, bc
	if tB {
		k2, n = bc, br
	}
	if k != k2 {
		return nil, fmt.Errorf("model: matMul: %v·%v (transposed %t, %t): inner dimensions differ", shapeOf(a), shapeOf(b), tA, tB)
	}
	op := &matMulOp{opBase: newBase("matMul", a.Dtype(), tensor.Shape{m, n}, a, b), tA: tA, tB: tB, m: m, n: n, k: k, ar: ar, ac: ac, br: br, bc: bc}
	return apply(op, a, b)
}

func (o *matMulOp) Do(vs ...G.Value) (G.Value, error) {
	if isF64(o.dt) {
		return doMatMul[float64](o, vs)
	}
	return doMatMul[float32](o, vs)
}

// matMulRuns counts matMulOp runs (test instrumentation: where on the tape the
// grad-ready hooks fire relative to the backward's matrix products).
var matMulRuns atomic.Int64

func doMatMul[T float32 | float64](o *matMulOp, vs []G.Value) (G.Value, error) {
	matMulRuns.Add(1)
	in, err := inputs[T](o.name, vs, o.ar*o.ac, o.br*o.bc)
	if err != nil {
		return nil, err
	}
	out := o.output()
	gemm(o.tA, o.tB, o.m, o.n, o.k, 1, in[0], o.ac, in[1], o.bc, 0, out.Data().([]T), o.n)
	return out, nil
}

// ---- colSum: [rows, n] → [1, n] ----

type colSumOp struct {
	opBase
	rows, n int
	ones    any // []T of rows ones
}

func newColSum(dt tensor.Dtype, a *G.Node, rows, n int) *colSumOp {
	return &colSumOp{opBase: newBase("colSum", dt, tensor.Shape{1, n}, a), rows: rows, n: n}
}

func (o *colSumOp) Do(vs ...G.Value) (G.Value, error) {
	if isF64(o.dt) {
		return doColSum[float64](o, vs)
	}
	return doColSum[float32](o, vs)
}

func doColSum[T float32 | float64](o *colSumOp, vs []G.Value) (G.Value, error) {
	in, err := inputs[T](o.name, vs, o.rows*o.n)
	if err != nil {
		return nil, err
	}
	ones, ok := o.ones.([]T)
	if !ok {
		ones = scratch[T](&o.ones, o.rows)
		for i := range ones {
			ones[i] = 1
		}
	}
	out := o.output()
	colSum(in[0], o.rows, o.n, ones, out.Data().([]T))
	return out, nil
}

// ---- mulMask: a ⊙ mask (gradient through a dropout) ----

type mulOp struct{ opBase }

func (o *mulOp) Do(vs ...G.Value) (G.Value, error) {
	n := o.out.TotalSize()
	out := o.output()
	if isF64(o.dt) {
		in, err := inputs[float64](o.name, vs, n, n)
		if err != nil {
			return nil, err
		}
		mul(in[0], in[1], out.Data().([]float64))
		return out, nil
	}
	in, err := inputs[float32](o.name, vs, n, n)
	if err != nil {
		return nil, err
	}
	mul(in[0], in[1], out.Data().([]float32))
	return out, nil
}

// ---- attention: qkv [B·S, 3h] → softmax(QKᵀ/√dh)⊙mask · V, heads merged [B·S, h] ----

type attnOp struct {
	opBase
	d     attnDims
	mask  bool
	p, pd any // []T of B·H·S·S: softmax and masked softmax, kept for the backward
}

// fusedAttention is multi-head scaled dot-product self-attention over the packed
// projections qkv [B·S, 3h] (PyTorch's in_proj layout: q, k, v column blocks, heads
// contiguous within each), with dropout mask [B·H·S, S] on the probabilities.
func fusedAttention(qkv *G.Node, B, S, H int, mask *G.Node) (*G.Node, error) {
	rows, cols, err := want2D("attention", qkv)
	if err != nil {
		return nil, err
	}
	if rows != B*S || cols%(3*H) != 0 {
		return nil, fmt.Errorf("model: attention: qkv %v for batch %d, seq %d, heads %d", shapeOf(qkv), B, S, H)
	}
	h := cols / 3
	d := attnDims{B: B, S: S, H: H, dh: h / H, alpha: 1 / math.Sqrt(float64(h/H))}
	ins := []*G.Node{qkv}
	if mask != nil {
		if mask.Shape().TotalSize() != B*H*S*S {
			return nil, fmt.Errorf("model: attention: mask %v, want %d elements", shapeOf(mask), B*H*S*S)
		}
		ins = append(ins, mask)
	}
	op := &attnOp{opBase: newBase("fusedAttention", qkv.Dtype(), tensor.Shape{rows, h}, ins...), d: d, mask: mask != nil}
	op.diff = []bool{true, false}[:len(ins)]
	return apply(op, ins...)
}

func (o *attnOp) Do(vs ...G.Value) (G.Value, error) {
	if isF64(o.dt) {
		return doAttn[float64](o, vs)
	}
	return doAttn[float32](o, vs)
}

func (o *attnOp) sizes() (qkv, probs int) {
	d := o.d
	return d.B * d.S * 3 * d.H * d.dh, d.B * d.H * d.S * d.S
}

func doAttn[T float32 | float64](o *attnOp, vs []G.Value) (G.Value, error) {
	nq, np := o.sizes()
	in, err := inputs[T](o.name, vs, []int{nq, np}[:1+btoi(o.mask)]...)
	if err != nil {
		return nil, err
	}
	p := scratch[T](&o.p, np)
	var mask, pd []T
	if o.mask {
		mask, pd = in[1], scratch[T](&o.pd, np)
	}
	out := o.output()
	attnFwd(o.d, in[0], mask, p, pd, out.Data().([]T))
	return out, nil
}

func (o *attnOp) SymDiff(in G.Nodes, output, grad *G.Node) (G.Nodes, error) {
	ins := []*G.Node{in[0], grad}
	if o.mask {
		ins = append(ins, in[1])
	}
	op := &attnGradOp{opBase: newBase("fusedAttentionGrad", o.dt, shapeOf(in[0]), ins...), fwd: o}
	dqkv, err := apply(op, ins...)
	if err != nil {
		return nil, err
	}
	ret := make(G.Nodes, len(in))
	ret[0] = dqkv
	return ret, nil
}

type attnGradOp struct {
	opBase
	fwd *attnOp
	ds  any
}

func (o *attnGradOp) Do(vs ...G.Value) (G.Value, error) {
	if isF64(o.dt) {
		return doAttnGrad[float64](o, vs)
	}
	return doAttnGrad[float32](o, vs)
}

func doAttnGrad[T float32 | float64](o *attnGradOp, vs []G.Value) (G.Value, error) {
	f := o.fwd
	nq, np := f.sizes()
	in, err := inputs[T](o.name, vs, []int{nq, nq / 3, np}[:2+btoi(f.mask)]...)
	if err != nil {
		return nil, err
	}
	p, ok := f.p.([]T)
	if !ok {
		return nil, fmt.Errorf("model: %s: the forward has not run", o.name)
	}
	var mask, pd []T
	if f.mask {
		mask, pd = in[2], f.pd.([]T)
	}
	out := o.output()
	attnBwd(f.d, in[0], mask, p, pd, in[1], scratch[T](&o.ds, f.d.S*f.d.S), out.Data().([]T))
	return out, nil
}

// ---- residual + LayerNorm: y = LN(x + s⊙mask)·gamma + beta ----

type addLNOp struct {
	opBase
	rows, n    int
	mask       bool
	xhat, rstd any // []T kept for the backward
}

// fusedAddLayerNorm is PyTorch's post-norm residual: LayerNorm(x + dropout(s)) with
// x, s [rows, n], gamma, beta [1, n] and an optional dropout mask [rows, n].
func fusedAddLayerNorm(x, s, gamma, beta, mask *G.Node) (*G.Node, error) {
	rows, n, err := want2D("add_layernorm", x)
	if err != nil {
		return nil, err
	}
	ins := []*G.Node{x, s, gamma, beta}
	if mask != nil {
		ins = append(ins, mask)
	}
	for _, in := range ins[1:] {
		if want := (tensor.Shape{rows, n}); in == gamma || in == beta {
			if !shapeOf(in).Eq(tensor.Shape{1, n}) {
				return nil, fmt.Errorf("model: add_layernorm: %s is %v, want [1 %d]", in.Name(), shapeOf(in), n)
			}
		} else if !shapeOf(in).Eq(want) {
			return nil, fmt.Errorf("model: add_layernorm: %s is %v, want %v", in.Name(), shapeOf(in), want)
		}
	}
	op := &addLNOp{opBase: newBase("fusedAddLayerNorm", x.Dtype(), tensor.Shape{rows, n}, ins...), rows: rows, n: n, mask: mask != nil}
	op.diff = []bool{true, true, true, true, false}[:len(ins)]
	return apply(op, ins...)
}

func (o *addLNOp) Do(vs ...G.Value) (G.Value, error) {
	if isF64(o.dt) {
		return doAddLN[float64](o, vs)
	}
	return doAddLN[float32](o, vs)
}

func doAddLN[T float32 | float64](o *addLNOp, vs []G.Value) (G.Value, error) {
	rn := o.rows * o.n
	in, err := inputs[T](o.name, vs, []int{rn, rn, o.n, o.n, rn}[:4+btoi(o.mask)]...)
	if err != nil {
		return nil, err
	}
	var mask []T
	if o.mask {
		mask = in[4]
	}
	out := o.output()
	addLNFwd(in[0], in[1], mask, in[2], in[3], o.rows, o.n, out.Data().([]T), scratch[T](&o.xhat, rn), scratch[T](&o.rstd, o.rows))
	return out, nil
}

func (o *addLNOp) SymDiff(in G.Nodes, output, grad *G.Node) (G.Nodes, error) {
	ret := make(G.Nodes, len(in))
	var err error
	// beta, gamma (parameters first on the tape), then the inputs.
	if ret[3], err = apply(newColSum(o.dt, grad, o.rows, o.n), grad); err != nil {
		return nil, err
	}
	gg := &lnGradOp{opBase: newBase("fusedLayerNormGammaGrad", o.dt, tensor.Shape{1, o.n}, grad), fwd: o, gamma: true}
	if ret[2], err = apply(gg, grad); err != nil {
		return nil, err
	}
	dz := &lnGradOp{opBase: newBase("fusedLayerNormGrad", o.dt, tensor.Shape{o.rows, o.n}, grad, in[2]), fwd: o}
	if ret[0], err = apply(dz, grad, in[2]); err != nil {
		return nil, err
	}
	ret[1] = ret[0]
	if o.mask {
		mop := &mulOp{newBase("dropoutGrad", o.dt, tensor.Shape{o.rows, o.n}, ret[0], in[4])}
		if ret[1], err = apply(mop, ret[0], in[4]); err != nil {
			return nil, err
		}
	}
	return ret, nil
}

// lnGradOp is addLNOp's backward: with gamma, Σ_rows dy⊙xhat (gamma's gradient) from
// dy; otherwise the gradient of the normalised sum from dy and gamma.
type lnGradOp struct {
	opBase
	fwd   *addLNOp
	gamma bool
}

func (o *lnGradOp) Do(vs ...G.Value) (G.Value, error) {
	if isF64(o.dt) {
		return doLNGrad[float64](o, vs)
	}
	return doLNGrad[float32](o, vs)
}

func doLNGrad[T float32 | float64](o *lnGradOp, vs []G.Value) (G.Value, error) {
	f := o.fwd
	rn := f.rows * f.n
	in, err := inputs[T](o.name, vs, []int{rn, f.n}[:2-btoi(o.gamma)]...)
	if err != nil {
		return nil, err
	}
	xhat, ok1 := f.xhat.([]T)
	rstd, ok2 := f.rstd.([]T)
	if !ok1 || !ok2 {
		return nil, fmt.Errorf("model: %s: the forward has not run", o.name)
	}
	out := o.output()
	if o.gamma {
		colDot(in[0], xhat, f.rows, f.n, out.Data().([]T))
	} else {
		lnBwd(in[0], in[1], xhat, rstd, f.rows, f.n, out.Data().([]T))
	}
	return out, nil
}
