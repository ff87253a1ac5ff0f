package main

import (
	"math"
	"math/rand/v2"
)

// The parameters, in registration order (their indices in ddp.New and GradReady).
const (
	w1 = iota // hidden×in, row-major
	b1        // hidden
	w2        // hidden (one output)
	b2        // 1
	nParams
)

// sineInputs is the input width of the default task, --task sine.
const sineInputs = 4

// paramNames are the parameters' names, in registration order.
var paramNames = [nParams]string{"w1", "b1", "w2", "b2"}

// mlp is x → tanh(W1·x + b1) → W2·h + b2, with the buffers of one micro-batch.
type mlp struct {
	hidden int
	in     int // the input width: W1 is hidden×in
	out    int // the output width: W2 is out×hidden (a vector at 1)
	names  [nParams]string
	params [nParams][]float32 // the weights
	grads  [nParams][]float32 // the step's gradients (with ddp, where Finalize leaves them)
	micro  [nParams][]float32 // one micro-batch's gradients, reported to ddp
	h      []float32          // the micro-batch's hidden activations, batch×hidden
	dy     []float32          // ∂loss/∂output per sample, batch×out
}

func newMLP(hidden, in, out int, seed uint64) *mlp {
	m := &mlp{hidden: hidden, in: in, out: out, names: paramNames}
	sizes := [nParams]int{hidden * in, hidden, out * hidden, out}
	rng := rand.New(rand.NewPCG(seed, 1))
	for i, n := range sizes {
		m.params[i], m.grads[i], m.micro[i] = make([]float32, n), make([]float32, n), make([]float32, n)
	}
	for k := range m.params[w1] {
		m.params[w1][k] = float32(rng.NormFloat64() / math.Sqrt(float64(in)))
	}
	for k := range m.params[w2] {
		m.params[w2][k] = float32(rng.NormFloat64() / math.Sqrt(float64(hidden)))
	}
	return m
}

// shapes are the parameters' shapes, in registration order: W2 is a vector with one
// output, as it always was, and a matrix with more.
func (m *mlp) shapes() [nParams][]int {
	if m.out == 1 {
		return [nParams][]int{{m.hidden, m.in}, {m.hidden}, {m.hidden}, {1}}
	}
	return [nParams][]int{{m.hidden, m.in}, {m.hidden}, {m.out, m.hidden}, {m.out}}
}

// forwardBackward runs the micro-batch (xs: batch×inputs, ys: batch×outputs) forward, then
// backward into m.micro, scaled by scale: the gradient of scale × the mean loss, the loss
// of a sample being half its squared error summed over the outputs. It calls ready(i) as
// soon as parameter i's gradient is complete (layer 2's first) and returns scale × the
// mean loss.
func (m *mlp) forwardBackward(xs, ys []float32, scale float32, ready func(i int)) float32 {
	hid, inputs, outs := m.hidden, m.in, m.out
	n := len(ys) / outs
	if len(m.h) < n*hid || len(m.dy) < n*outs {
		m.h, m.dy = make([]float32, n*hid), make([]float32, n*outs)
	}
	W1, B1, W2, B2 := m.params[w1], m.params[b1], m.params[w2], m.params[b2]
	var loss float32
	for s := range n { // forward
		x, h := xs[s*inputs:(s+1)*inputs], m.h[s*hid:(s+1)*hid]
		for j := range hid {
			z := B1[j]
			for k, v := range x {
				z += W1[j*inputs+k] * v
			}
			h[j] = float32(math.Tanh(float64(z)))
		}
		for o := range outs {
			out := B2[o]
			for j, v := range h {
				out += W2[o*hid+j] * v
			}
			r := out - ys[s*outs+o]
			loss += scale * r * r / (2 * float32(n))
			m.dy[s*outs+o] = scale * r / float32(n)
		}
	}
	// Backward, layer 2: its gradients are complete before layer 1's are started.
	gW2, gB2 := m.micro[w2], m.micro[b2]
	clear(gW2)
	clear(gB2)
	for s := range n {
		for o, d := range m.dy[s*outs : (s+1)*outs] {
			gB2[o] += d
			for j, v := range m.h[s*hid : (s+1)*hid] {
				gW2[o*hid+j] += d * v
			}
		}
	}
	ready(b2)
	ready(w2)
	// Layer 1.
	gW1, gB1 := m.micro[w1], m.micro[b1]
	clear(gW1)
	clear(gB1)
	for s := range n {
		x, h, dy := xs[s*inputs:(s+1)*inputs], m.h[s*hid:(s+1)*hid], m.dy[s*outs:(s+1)*outs]
		for j := range hid {
			var g float32 // ∂loss/∂h[j]; with one output, exactly dy·W2[j]
			for o, d := range dy {
				g += d * W2[o*hid+j]
			}
			dz := g * (1 - h[j]*h[j])
			gB1[j] += dz
			for k, v := range x {
				gW1[j*inputs+k] += dz * v
			}
		}
	}
	ready(b1)
	ready(w1)
	return loss
}

// sgd steps every parameter against its gradient in m.grads.
func (m *mlp) sgd(lr float32) {
	for i, p := range m.params {
		for k, g := range m.grads[i] {
			p[k] -= lr * g
		}
	}
}

// flat is the parameters in registration order.
func (m *mlp) flat() []float32 {
	var out []float32
	for _, p := range m.params {
		out = append(out, p...)
	}
	return out
}

// sineSamples fills xs and ys with the n samples of --task sine from index first on: each
// depends on (seed, its index) only.
func sineSamples(seed uint64, first, n int, xs, ys []float32) {
	for s := range n {
		rng := rand.New(rand.NewPCG(seed, uint64(first+s)))
		x := xs[s*sineInputs : (s+1)*sineInputs]
		for k := range x {
			x[k] = float32(2*rng.Float64() - 1)
		}
		ys[s] = float32(math.Sin(2*float64(x[0]))) + x[1]*x[2] - x[3]/2
	}
}
