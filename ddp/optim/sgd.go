package optim

import "fmt"

// SGDOptions are torch.optim.SGD's hyper-parameters. Momentum 0 keeps no state.
type SGDOptions struct {
	LR          float64 // required
	Momentum    float64 // 0: plain SGD
	Dampening   float64
	WeightDecay float64
	Nesterov    bool
}

// SGD is stochastic gradient descent with momentum, as torch.optim.SGD computes it. Not
// safe for concurrent use.
type SGD struct {
	o   SGDOptions
	n   int
	t   int64
	buf []float32 // the momentum buffer; nil without momentum
}

// NewSGD returns an SGD optimizer for n parameters.
func NewSGD(n int, o SGDOptions) (*SGD, error) {
	if err := checkLen(n); err != nil {
		return nil, err
	}
	switch {
	case !(o.LR > 0):
		return nil, fmt.Errorf("optim: SGD lr %v must be positive", o.LR)
	case !(o.Momentum >= 0 && o.Momentum < 1) || !(o.Dampening >= 0 && o.Dampening <= 1) || !(o.WeightDecay >= 0):
		return nil, fmt.Errorf("optim: SGD momentum %v, dampening %v, weight decay %v: want momentum in [0, 1), dampening in [0, 1], decay not negative",
			o.Momentum, o.Dampening, o.WeightDecay)
	case o.Nesterov && (o.Momentum == 0 || o.Dampening != 0):
		return nil, fmt.Errorf("optim: SGD Nesterov momentum needs a momentum and no dampening (momentum %v, dampening %v)", o.Momentum, o.Dampening)
	}
	s := &SGD{o: o, n: n}
	if o.Momentum != 0 {
		s.buf = make([]float32, n)
	}
	return s, nil
}

// Len is the number of parameters.
func (s *SGD) Len() int { return s.n }

// Step updates params in place from grads (torch.optim.SGD):
//
//	g ← g + wd·p;  b ← g at the first step, else μ·b + (1−τ)·g
//	g ← g + μ·b with Nesterov, else b;  p ← p − lr·g
//
// Without momentum and decay it is p ← p − lr·g.
func (s *SGD) Step(params, grads []float32) error {
	if err := checkStep(params, grads, s.n); err != nil {
		return err
	}
	lr, wd := float32(s.o.LR), float32(s.o.WeightDecay)
	mu, damp := float32(s.o.Momentum), 1-float32(s.o.Dampening)
	first := s.t == 0
	s.t++
	n := s.n
	params, grads = params[:n], grads[:n]
	if s.buf == nil {
		for i, g := range grads {
			if wd != 0 {
				g += wd * params[i]
			}
			params[i] -= lr * g
		}
		return nil
	}
	b := s.buf[:n]
	for i, g := range grads {
		if wd != 0 {
			g += wd * params[i]
		}
		if first {
			b[i] = g
		} else {
			b[i] = mu*b[i] + damp*g
		}
		if s.o.Nesterov {
			g += mu * b[i]
		} else {
			g = b[i]
		}
		params[i] -= lr * g
	}
	return nil
}

// State is the step count and, with momentum, the buffer "sgd.momentum".
func (s *SGD) State() State {
	st := State{Steps: &s.t}
	if s.buf != nil {
		st.Vectors = []Vector{{"sgd.momentum", s.buf}}
	}
	return st
}
