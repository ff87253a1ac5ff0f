package model

import (
	"fmt"
	"math"
	"math/rand/v2"

	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"

	"github.com/goddp/goddp/ddp/gorgoniaddp"
)

// GraphOptions configure one forward/backward graph over a Model.
type GraphOptions struct {
	Batch  int // samples per run (per rank)
	SeqLen int // tokens per sample

	// Hook, when set, taps every learnable (gorgoniaddp.Tap) so that Hook(i, grad) runs during
	// backward as soon as parameter i's gradient is complete (reverse layer order).
	Hook gorgoniaddp.GradHook

	// Wait, with Hook, is called by each tap before it reads its parameter
	// (gorgoniaddp.TapWait): the DDP's WaitParams with ddp.Options.ZeroForwardOverlap.
	Wait gorgoniaddp.ParamWait

	// Train enables dropout (Config.Dropout) with masks drawn by Load.
	Train bool

	// LossScale multiplies the loss (and so every gradient); 0 means 1. Gradient
	// accumulation over k micro-batches uses 1/k.
	LossScale float64

	// DataSeed seeds the synthetic data and the dropout masks.
	DataSeed uint64
}

// DataPeriod is the number of distinct MSE batches cycled through (ddp_bench.py's
// --nbatches): the data at step t is that of step t mod DataPeriod.
const DataPeriod = 4

// Graph is a compiled forward/backward pass over a Model's parameters. It reads the
// parameters from the model's flat buffer at every Run. Not safe for concurrent use.
type Graph struct {
	m     *Model
	o     GraphOptions
	g     *G.ExprGraph
	vm    G.VM
	loss  *G.Node
	grads G.Nodes

	x, target *tensor.Dense   // inputs: MSE features/target, or copy one-hot tokens (x only)
	masks     []*tensor.Dense // dropout masks, 4 per layer: attn, attn_out, ff_act, ff_out
	cache     map[[2]int][2]any
}

// NewGraph builds the forward pass, its symbolic gradient and a tape machine.
func (m *Model) NewGraph(o GraphOptions) (*Graph, error) {
	if o.Batch <= 0 || o.SeqLen <= 0 {
		return nil, fmt.Errorf("%w: batch %d, seq_len %d", ErrConfig, o.Batch, o.SeqLen)
	}
	if o.LossScale == 0 {
		o.LossScale = 1
	}
	gr := &Graph{m: m, o: o, g: G.NewGraph(), cache: map[[2]int][2]any{}}
	if err := gr.build(); err != nil {
		return nil, fmt.Errorf("model: build graph: %w", err)
	}
	gr.vm = G.NewTapeMachine(gr.g)
	return gr, nil
}

// b is a tiny builder that turns the first gorgonia error into the result.
type b struct {
	dt  tensor.Dtype
	err error
}

func (c *b) do(n *G.Node, err error) *G.Node {
	if c.err == nil && err != nil {
		c.err = err
	}
	return n
}

func (c *b) scalar(v float64) *G.Node {
	if c.dt == tensor.Float64 {
		return G.NewConstant(v)
	}
	return G.NewConstant(float32(v))
}

func (c *b) newDense(shape ...int) *tensor.Dense {
	return tensor.New(tensor.Of(c.dt), tensor.WithShape(shape...))
}

func (gr *Graph) build() error {
	m, o, g := gr.m, gr.o, gr.g
	cfg := m.cfg
	c := &b{dt: cfg.DType}
	B, S, h, H := o.Batch, o.SeqLen, cfg.Hidden, cfg.Heads
	N := B * S
	train := o.Train && cfg.Dropout > 0

	params := make(G.Nodes, len(m.params))
	for i, p := range m.params {
		params[i] = G.NewTensor(g, cfg.DType, len(p.Shape), G.WithShape(p.Shape...), G.WithName(p.Name), G.WithValue(m.dense(i)))
	}
	// param returns the node through which parameter i is used: the parameter itself,
	// or with a Hook its grad-ready tap, created right before the op that uses it.
	// Note [Tap placement]: the tape runs nodes in creation order where dependencies
	// allow, and backprop visits nodes in reverse creation order, so a tap created
	// just before its consumer gets its grad-ready node created, and run, right
	// after the consumer's backward: each hook fires as soon as its gradient is
	// complete. Taps created up front (all before the first layer) would be visited
	// last and every hook would fire after the whole backward, leaving nothing for
	// DDP to overlap.
	param := func(i int) *G.Node {
		if o.Hook == nil || c.err != nil {
			return params[i]
		}
		return c.do(gorgoniaddp.TapWait(params[i], i, o.Hook, o.Wait))
	}
	next := 0
	take := func() *G.Node { next++; return param(next - 1) }
	input := func(name string, t *tensor.Dense) *G.Node {
		return G.NewTensor(g, cfg.DType, t.Dims(), G.WithShape(t.Shape()...), G.WithName(name), G.WithValue(t))
	}
	var data *G.Node // the MSE input, which needs no gradient
	// maskNode is a dropout mask input refilled by Load (nil when not training).
	maskNode := func(name string, shape ...int) *G.Node {
		if !train {
			return nil
		}
		t := c.newDense(shape...)
		gr.masks = append(gr.masks, t)
		return input(name, t)
	}
	// The layers are fused ops (Note [Fused ops]).
	linear := func(x, w, bias *G.Node, relu bool, mask *G.Node) *G.Node {
		if c.err != nil {
			return nil
		}
		return c.do(fusedLinear(x, w, bias, relu, mask, x != data))
	}

	var x *G.Node
	if cfg.Task == TaskCopy {
		gr.x = c.newDense(N, cfg.Vocab)
		x = c.do(G.Mul(input("tokens", gr.x), take())) // one-hot · embedding
	} else {
		gr.x = c.newDense(N, h)
		gr.target = c.newDense(N, h)
		data = input("x", gr.x)
		x = linear(data, take(), take(), false, nil)
	}
	for l := 0; l < cfg.NumLayers; l++ {
		if c.err != nil {
			break
		}
		// Registration order (PyTorch's): in_proj w/b, out_proj w/b, linear1 w/b,
		// linear2 w/b, norm1 w/b, norm2 w/b.
		base := next
		next += 12
		lp := func(k int) *G.Node { return param(base + k) }
		// Dropout masks, in Load's order: attention probabilities, attention output,
		// feed-forward activation, feed-forward output. Each sample's rows are
		// contiguous in every mask (Load relies on it).
		mAttn := maskNode(fmt.Sprintf("drop%d.attn", l), B*H, S, S)
		mSA := maskNode(fmt.Sprintf("drop%d.sa", l), N, h)
		mFF := maskNode(fmt.Sprintf("drop%d.ff", l), N, cfg.FF)
		mOut := maskNode(fmt.Sprintf("drop%d.ffout", l), N, h)
		// Self-attention on the packed projection qkv [N, 3h]; post-norm residuals as
		// PyTorch's TransformerEncoderLayer (norm_first=False).
		qkv := linear(x, lp(0), lp(1), false, nil)
		if c.err != nil {
			break
		}
		ctx := c.do(fusedAttention(qkv, B, S, H, mAttn))
		if c.err != nil {
			break
		}
		sa := linear(ctx, lp(2), lp(3), false, nil)
		if c.err != nil {
			break
		}
		x = c.do(fusedAddLayerNorm(x, sa, lp(8), lp(9), mSA))
		if c.err != nil {
			break
		}
		f := linear(x, lp(4), lp(5), true, mFF)
		f = linear(f, lp(6), lp(7), false, nil)
		if c.err != nil {
			break
		}
		x = c.do(fusedAddLayerNorm(x, f, lp(10), lp(11), mOut))
	}
	if c.err != nil {
		return c.err
	}
	out := linear(x, take(), take(), false, nil)
	var loss *G.Node
	if cfg.Task == TaskCopy {
		logp := c.do(G.LogSoftMax(out))
		ll := c.do(G.Sum(c.do(G.HadamardProd(logp, input("onehot", gr.x)))))
		loss = c.do(G.Mul(ll, c.scalar(-o.LossScale/float64(N))))
	} else {
		d := c.do(G.Sub(out, input("target", gr.target)))
		loss = c.do(G.Mean(c.do(G.Square(d))))
		if o.LossScale != 1 {
			loss = c.do(G.Mul(loss, c.scalar(o.LossScale)))
		}
	}
	if c.err != nil {
		return c.err
	}
	if next != len(params) {
		return fmt.Errorf("used %d of %d parameters", next, len(params))
	}
	gr.loss = loss
	grads, err := G.Grad(loss, params...)
	if err != nil {
		return err
	}
	gr.grads = grads
	return nil
}

// mix derives a stream id from a domain, a sample and a step.
func mix(domain, sample, step uint64) uint64 {
	z := domain*0x9e3779b97f4a7c15 ^ sample*0xbf58476d1ce4e5b9 ^ step*0x94d049bb133111eb
	z ^= z >> 31
	z *= 0xd6e8feb86cb4e5c5
	return z ^ z>>29
}

// Load fills the inputs for one run: the samples firstSample … firstSample+Batch−1 of
// the global batch of the given step, and their dropout masks. Data and masks depend
// only on (DataSeed, global sample index, step), so R ranks with batch B starting at
// rank·B see exactly what one process with batch R·B sees.
func (gr *Graph) Load(step, firstSample int) error {
	if step < 0 || firstSample < 0 {
		return fmt.Errorf("model: load step %d, first sample %d: negative", step, firstSample)
	}
	if gr.m.cfg.DType == tensor.Float64 {
		return load[float64](gr, step, firstSample)
	}
	return load[float32](gr, step, firstSample)
}

func load[T float32 | float64](gr *Graph, step, first int) error {
	cfg, o := gr.m.cfg, gr.o
	B, S, h := o.Batch, o.SeqLen, cfg.Hidden
	seed := o.DataSeed
	if cfg.Task == TaskCopy {
		x := gr.x.Data().([]T)
		clear(x)
		V := cfg.Vocab
		for j := 0; j < B; j++ {
			r := rand.New(rand.NewPCG(seed, mix(3, uint64(first+j), uint64(step))))
			for s := 0; s < S; s++ {
				x[(j*S+s)*V+r.IntN(V)] = 1
			}
		}
	} else {
		slot := step % DataPeriod
		key := [2]int{slot, first}
		if cached, ok := gr.cache[key]; ok {
			copy(gr.x.Data().([]T), cached[0].([]T))
			copy(gr.target.Data().([]T), cached[1].([]T))
		} else {
			x, t := gr.x.Data().([]T), gr.target.Data().([]T)
			n := S * h
			for j := 0; j < B; j++ {
				r := rand.New(rand.NewPCG(seed, mix(1, uint64(first+j), uint64(slot))))
				for k := 0; k < n; k++ {
					x[j*n+k] = T(r.NormFloat64())
				}
				for k := 0; k < n; k++ {
					t[j*n+k] = T(r.NormFloat64())
				}
			}
			if len(gr.cache) >= 2*DataPeriod {
				clear(gr.cache)
			}
			gr.cache[key] = [2]any{append([]T(nil), x...), append([]T(nil), t...)}
		}
	}
	if len(gr.masks) == 0 {
		return nil
	}
	p := cfg.Dropout
	keep := T(1 / (1 - p))
	thresh := uint32(math.Min(p*(1<<32), math.MaxUint32))
	// Each 64-bit draw gives two 32-bit uniforms, low half first; a half left over at
	// the end of one mask starts the next. Branch-free: tbl[u >= thresh].
	tbl := [2]T{0, keep}
	for j := 0; j < B; j++ {
		r := rand.NewPCG(seed, mix(2, uint64(first+j), uint64(step)))
		var spare uint32
		var haveSpare bool
		for _, mk := range gr.masks {
			d := mk.Data().([]T)
			per := len(d) / B // each sample's rows are contiguous
			seg := d[j*per : (j+1)*per]
			if haveSpare && len(seg) > 0 {
				seg[0] = tbl[b2i(spare >= thresh)]
				seg, haveSpare = seg[1:], false
			}
			k := 0
			for ; k+1 < len(seg); k += 2 {
				x := r.Uint64()
				seg[k] = tbl[b2i(uint32(x) >= thresh)]
				seg[k+1] = tbl[b2i(uint32(x>>32) >= thresh)]
			}
			if k < len(seg) {
				x := r.Uint64()
				seg[k] = tbl[b2i(uint32(x) >= thresh)]
				spare, haveSpare = uint32(x>>32), true
			}
		}
	}
	return nil
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// Run executes forward and backward (the hooks fire during it) and returns the loss.
func (gr *Graph) Run() (float64, error) {
	gr.vm.Reset() // required: without it RunAll silently does nothing
	if err := gr.vm.RunAll(); err != nil {
		return 0, fmt.Errorf("model: run: %w", err)
	}
	switch v := gr.loss.Value().Data().(type) {
	case float32:
		return float64(v), nil
	case float64:
		return v, nil
	default:
		return 0, fmt.Errorf("model: loss is %T", v)
	}
}

// Grad returns parameter i's gradient from the last Run (valid until the next Run).
func (gr *Graph) Grad(i int) (*tensor.Dense, error) {
	if i < 0 || i >= len(gr.grads) {
		return nil, fmt.Errorf("model: grad %d of %d", i, len(gr.grads))
	}
	d, ok := gr.grads[i].Value().(*tensor.Dense)
	if !ok {
		return nil, fmt.Errorf("model: grad %d (%s) has no value (Run first)", i, gr.m.params[i].Name)
	}
	return d, nil
}

// Close releases the tape machine.
func (gr *Graph) Close() error { return gr.vm.Close() }
