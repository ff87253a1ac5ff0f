package optim

import (
	"fmt"
	"math"
)

// AdamWOptions are torch.optim.AdamW's hyper-parameters; zero fields take its defaults
// except LR, whose default here is 1e-4. Set WeightDecay < 0 for none.
type AdamWOptions struct {
	LR          float64 // 1e-4
	Beta1       float64 // 0.9
	Beta2       float64 // 0.999
	Eps         float64 // 1e-8
	WeightDecay float64 // 0.01 (negative: 0)
}

func (o *AdamWOptions) validate() error {
	def := func(v *float64, d float64) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.LR, 1e-4)
	def(&o.Beta1, 0.9)
	def(&o.Beta2, 0.999)
	def(&o.Eps, 1e-8)
	def(&o.WeightDecay, 0.01)
	if o.WeightDecay < 0 {
		o.WeightDecay = 0
	}
	switch {
	case !(o.LR > 0):
		return fmt.Errorf("optim: AdamW lr %v must be positive", o.LR)
	case !(o.Beta1 > 0 && o.Beta1 < 1 && o.Beta2 > 0 && o.Beta2 < 1):
		return fmt.Errorf("optim: AdamW betas (%v, %v) must lie in (0, 1)", o.Beta1, o.Beta2)
	case !(o.Eps > 0):
		return fmt.Errorf("optim: AdamW eps %v must be positive", o.Eps)
	}
	return nil
}

// AdamW keeps the first and second moments of n parameters. Not safe for concurrent use.
type AdamW struct {
	o    AdamWOptions
	t    int64 // steps taken
	m, v []float32
}

// NewAdamW returns an AdamW optimizer for n parameters.
func NewAdamW(n int, o AdamWOptions) (*AdamW, error) {
	if err := checkLen(n); err != nil {
		return nil, err
	}
	if err := o.validate(); err != nil {
		return nil, err
	}
	return &AdamW{o: o, m: make([]float32, n), v: make([]float32, n)}, nil
}

// Options returns the options in use (defaults filled in).
func (a *AdamW) Options() AdamWOptions { return a.o }

// Len is the number of parameters.
func (a *AdamW) Len() int { return len(a.m) }

// Step updates params in place from grads (torch.optim.AdamW, amsgrad off), in float32
// but for the bias corrections, which are float64:
//
//	p ← p·(1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
//	p ← p − (lr / (1−β1ᵗ)) · m / (√v / √(1−β2ᵗ) + ε)
func (a *AdamW) Step(params, grads []float32) error {
	if err := checkStep(params, grads, len(a.m)); err != nil {
		return err
	}
	a.t++
	o := a.o
	bc1 := 1 - math.Pow(o.Beta1, float64(a.t))
	bc2 := 1 - math.Pow(o.Beta2, float64(a.t))
	decay := float32(1 - o.LR*o.WeightDecay)
	step := float32(o.LR / bc1)
	invSqrtBC2 := float32(1 / math.Sqrt(bc2))
	b1, b2 := float32(o.Beta1), float32(o.Beta2)
	c1, c2 := 1-b1, 1-b2
	eps := float32(o.Eps)
	n := len(params) // equal lengths let the compiler drop the bounds checks
	m, v, grads := a.m[:n], a.v[:n], grads[:n]
	for i, g := range grads {
		mi := b1*m[i] + c1*g
		vi := b2*v[i] + c2*g*g
		m[i], v[i] = mi, vi
		denom := float32(math.Sqrt(float64(vi)))*invSqrtBC2 + eps
		params[i] = params[i]*decay - step*mi/denom
	}
	return nil
}

// State is the step count and the moments, "adamw.m" and "adamw.v".
func (a *AdamW) State() State {
	return State{Steps: &a.t, Vectors: []Vector{{"adamw.m", a.m}, {"adamw.v", a.v}}}
}
