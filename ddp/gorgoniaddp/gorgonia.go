package gorgoniaddp

import (
	"context"
	"fmt"

	"gorgonia.org/gorgonia"
	"gorgonia.org/tensor"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/procgroup"
)

// denseFloat32s returns the elements of a contiguous float32 tensor without allocating
// (Dense.Data boxes a new slice header on every call).
func denseFloat32s(t *tensor.Dense) ([]float32, error) {
	if err := contiguous(t); err != nil {
		return nil, err
	}
	return t.Float32s()[:t.Shape().TotalSize()], nil
}

// denseFloat64s is denseFloat32s for float64.
func denseFloat64s(t *tensor.Dense) ([]float64, error) {
	if err := contiguous(t); err != nil {
		return nil, err
	}
	return t.Float64s()[:t.Shape().TotalSize()], nil
}

func contiguous(t *tensor.Dense) error {
	if t.RequiresIterator() {
		return fmt.Errorf("%w: gradient tensor of shape %v is a non-contiguous view", ddp.ErrInvalidArgument, t.Shape())
	}
	return nil
}

// ParamsFromNodes describes gorgonia learnables as ddp.Params: Name is the node's name, Shape
// its shape, Data its value's elements (shared: ddp.New's broadcast writes into the node's
// value), Grad a new slice (nil when gradientAsBucketView). Each node must hold a
// contiguous float32 or float64 *tensor.Dense value (create it WithValue or WithInit).
func ParamsFromNodes(nodes []*gorgonia.Node, gradientAsBucketView bool) ([]ddp.Param, error) {
	ps := make([]ddp.Param, len(nodes))
	for i, n := range nodes {
		if n == nil {
			return nil, fmt.Errorf("%w: parameter %d: nil node", ddp.ErrInvalidArgument, i)
		}
		t, ok := n.Value().(*tensor.Dense)
		if !ok {
			return nil, fmt.Errorf("%w: parameter %d (%s): value is %T, want a *tensor.Dense (create the node WithValue or WithInit)",
				ddp.ErrInvalidArgument, i, n.Name(), n.Value())
		}
		p := ddp.Param{Name: n.Name(), Shape: append([]int(nil), t.Shape()...)}
		switch t.Dtype() {
		case tensor.Float32:
			data, err := denseFloat32s(t)
			if err != nil {
				return nil, fmt.Errorf("parameter %d (%s): %w", i, n.Name(), err)
			}
			p.Data = data
			if !gradientAsBucketView {
				p.Grad = make([]float32, len(data))
			}
		case tensor.Float64:
			data, err := denseFloat64s(t)
			if err != nil {
				return nil, fmt.Errorf("parameter %d (%s): %w", i, n.Name(), err)
			}
			p.Data = data
			if !gradientAsBucketView {
				p.Grad = make([]float64, len(data))
			}
		default:
			return nil, fmt.Errorf("%w: parameter %d (%s): element type %v, want float32 or float64", ddp.ErrInvalidArgument, i, n.Name(), t.Dtype())
		}
		ps[i] = p
	}
	return ps, nil
}

// Taps hands out each learnable's tapped node, creating the tap at the first Use.
//
// Note [Tap placement]: gorgonia puts nodes on the tape in creation order and backprop
// creates the gradient nodes in reverse creation order, so a tap created right before the
// op that consumes it gets its grad-ready node created, and run, right after that op's
// backward: the hook fires as soon as the gradient is complete and the bucket can be
// all-reduced while backward goes on. Taps created up front, before the first layer, are
// visited last, and every hook fires after the whole backward. So call Use(i) where
// parameter i is consumed, not all at the start.
type Taps struct {
	nodes  []*gorgonia.Node
	hook   GradHook
	wait   ParamWait // nil, or what every tap waits for in forward (TapWait)
	tapped []*gorgonia.Node
}

// NewTaps returns the taps of nodes, none created yet; hook receives gradient i as
// parameter i.
func NewTaps(nodes []*gorgonia.Node, hook GradHook) *Taps {
	return &Taps{nodes: nodes, hook: hook, tapped: make([]*gorgonia.Node, len(nodes))}
}

// Use returns parameter i's tapped node, creating the tap on the first call; later calls
// return the same node, so a parameter used twice (tied weights) is tapped once.
func (t *Taps) Use(i int) (*gorgonia.Node, error) {
	if i < 0 || i >= len(t.nodes) {
		return nil, fmt.Errorf("%w: parameter %d of %d", ddp.ErrInvalidArgument, i, len(t.nodes))
	}
	if t.tapped[i] == nil {
		n, err := TapWait(t.nodes[i], i, t.hook, t.wait)
		if err != nil {
			return nil, err
		}
		t.tapped[i] = n
	}
	return t.tapped[i], nil
}

// WrapNodes wraps the learnables of a gorgonia graph: ddp.New over ParamsFromNodes (so every
// node's value becomes rank 0's), and the Taps that feed the DDP through Hook. Build the
// model with taps.Use(i) at each place learnable i is consumed, call gorgonia.Grad with
// respect to learnables, and run backward between BeginBackward and Finalize. After a synced
// Finalize the averaged gradient is in Grad32/Grad64(i) and also in learnables[i].Grad(), so
// gorgonia's solvers see it (opts.AfterSync, if set, runs after that copy).
func WrapNodes(ctx context.Context, pg procgroup.ProcessGroup, learnables []*gorgonia.Node, opts ddp.Options) (*ddp.DDP, *Taps, error) {
	params, err := ParamsFromNodes(learnables, opts.GradientAsBucketView)
	if err != nil {
		return nil, nil, err
	}
	nodes := append([]*gorgonia.Node(nil), learnables...)
	then := opts.AfterSync
	opts.AfterSync = func(d *ddp.DDP) error {
		if err := writeNodeGrads(d, nodes); err != nil {
			return err
		}
		if then != nil {
			return then(d)
		}
		return nil
	}
	d, err := ddp.New(ctx, pg, params, opts)
	if err != nil {
		return nil, nil, err
	}
	taps := NewTaps(learnables, Hook(d))
	taps.wait = Wait(d)
	return d, taps, nil
}

// Wait returns the ParamWait (for TapWait, or a model's option) that waits for parameter
// i's value with d.WaitParams, or nil where d never leaves one in flight (without
// ddp.Options.ZeroForwardOverlap). A gorgonia run takes no context, so the wait is bounded
// by the process group's timeout, and by d.Close from another goroutine during a synced
// pass (which aborts the group); its errors have failed d.
func Wait(d *ddp.DDP) ParamWait {
	if !d.ForwardOverlap() {
		return nil
	}
	return func(i int) error { return d.WaitParams(context.Background(), i) }
}

// Hook returns the GradHook (for Tap, or a model's hook option) that reports a gorgonia
// gradient to d with GradReady (or GradReady64), without allocating. A hook cannot return
// an error: its errors fail d (DDP.Fail) and are returned by the next Finalize.
func Hook(d *ddp.DDP) GradHook {
	return func(i int, grad *tensor.Dense) {
		var err error
		switch grad.Dtype() {
		case tensor.Float32:
			var g []float32
			if g, err = denseFloat32s(grad); err == nil {
				d.GradReady(i, g) // its error has failed d already
			}
		case tensor.Float64:
			var g []float64
			if g, err = denseFloat64s(grad); err == nil {
				d.GradReady64(i, g)
			}
		default:
			err = fmt.Errorf("%w: gradient of parameter %d is %v, want float32 or float64", ddp.ErrInvalidArgument, i, grad.Dtype())
		}
		if err != nil {
			d.Fail(err)
		}
	}
}

// writeNodeGrads copies d's averaged gradients into the nodes' gradient values (the tensors
// the hooks received): the DDP's AfterSync under WrapNodes. A node without a gradient value
// (unused this step) is skipped.
func writeNodeGrads(d *ddp.DDP, nodes []*gorgonia.Node) error {
	for i, n := range nodes {
		v, err := n.Grad()
		if err != nil {
			continue
		}
		t, ok := v.(*tensor.Dense)
		if !ok {
			continue
		}
		switch t.Dtype() {
		case tensor.Float32:
			dst, err := denseFloat32s(t)
			if err != nil {
				return fmt.Errorf("parameter %d (%s): %w", i, n.Name(), err)
			}
			copy(dst, d.Grad32(i))
		case tensor.Float64:
			dst, err := denseFloat64s(t)
			if err != nil {
				return fmt.Errorf("parameter %d (%s): %w", i, n.Name(), err)
			}
			copy(dst, d.Grad64(i))
		}
	}
	return nil
}
