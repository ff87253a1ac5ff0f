package main

import (
	"context"
	"fmt"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/optim"
)

// stepper is the run's optimizer (--optimizer, --zero). Plain --optimizer sgd at --zero 0
// is the model's own loop (mlp.sgd); momentum and adamw at --zero 0 step one optimizer
// over every parameter, flattened in registration order; at --zero 1 and 2 the DDP steps
// this rank's shard (ddp.Options.Zero). full is the whole state, in that flattened order,
// that a checkpoint holds: the flat optimizer's own, or at --zero 1 and 2 a copy gathered
// before each save (ddp.DDP.GatherOptimizerState).
type stepper struct {
	zero    int
	factory optim.Factory
	flat    optim.Optimizer // --zero 0 with momentum or adamw
	fp, fg  []float32
	full    optim.State
	d       *ddp.DDP
}

// optimizerFactory is --optimizer's factory with --lr and --momentum.
func optimizerFactory(f flags) (optim.Factory, error) {
	switch f.optimizer {
	case "sgd":
		return func(n int) (optim.Optimizer, error) { return optim.NewSGD(n, optim.SGDOptions{LR: f.lr}) }, nil
	case "momentum":
		return func(n int) (optim.Optimizer, error) {
			return optim.NewSGD(n, optim.SGDOptions{LR: f.lr, Momentum: f.momentum})
		}, nil
	case "adamw":
		return func(n int) (optim.Optimizer, error) { return optim.NewAdamW(n, optim.AdamWOptions{LR: f.lr}) }, nil
	}
	return nil, fmt.Errorf("--optimizer %q: want sgd, momentum or adamw", f.optimizer)
}

// newStepper makes the run's optimizer for m; with --zero it goes into opts.
func newStepper(f flags, m *mlp, opts *ddp.Options) (*stepper, error) {
	fac, err := optimizerFactory(f)
	if err != nil {
		return nil, err
	}
	s := &stepper{zero: f.zero, factory: fac}
	total := len(m.flat())
	probe, err := fac(0)
	if err != nil {
		return nil, err
	}
	if f.zero > 0 {
		opts.Zero, opts.Optimizer = f.zero, fac
		s.full = optim.State{Steps: new(int64)}
		for _, v := range probe.State().Vectors {
			s.full.Vectors = append(s.full.Vectors, optim.Vector{Name: v.Name, Data: make([]float32, total)})
		}
		return s, nil
	}
	if f.optimizer == "sgd" {
		s.full = probe.State() // no vectors
		return s, nil
	}
	if s.flat, err = fac(total); err != nil {
		return nil, err
	}
	s.fp, s.fg = make([]float32, total), make([]float32, total)
	s.full = s.flat.State()
	return s, nil
}

// step steps the parameters against the step's averaged gradients.
func (s *stepper) step(ctx context.Context, m *mlp, lr float32) error {
	switch {
	case s.zero > 0:
		return s.d.Step(ctx)
	case s.flat == nil:
		m.sgd(lr)
		return nil
	}
	at := 0
	for i, p := range m.params {
		copy(s.fp[at:], p)
		at += copy(s.fg[at:], m.grads[i])
	}
	if err := s.flat.Step(s.fp, s.fg); err != nil {
		return err
	}
	at = 0
	for _, p := range m.params {
		at += copy(p, s.fp[at:])
	}
	return nil
}

// stateBytes is this rank's optimizer state in bytes.
func (s *stepper) stateBytes() int64 {
	if s.zero > 0 {
		return s.d.OptimizerStateBytes()
	}
	return s.full.Bytes()
}

// beforeSave brings full up to date for a checkpoint (a collective at --zero 1 and 2).
func (s *stepper) beforeSave(ctx context.Context) error {
	if s.zero == 0 {
		return nil
	}
	return s.d.GatherOptimizerState(ctx, s.full)
}

// afterRestore gives the DDP's shard its part of a restored full state.
func (s *stepper) afterRestore() error {
	if s.zero == 0 {
		return nil
	}
	return s.d.SetOptimizerState(s.full)
}
