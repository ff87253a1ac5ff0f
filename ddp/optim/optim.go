// Package optim is ddp's optimizer interface and two optimizers, AdamW and SGD with
// momentum, over flat float32 slices.
//
// An Optimizer owns the state of exactly the elements it was made for (its Len): AdamW's
// two moments, SGD's momentum buffer, each a vector of that length, and a step count. It
// updates element k of params from element k of grads and of its state alone, so that the
// parameters can be cut into shards, each stepped by an optimizer of its own, with the
// same bits as one optimizer over all of them: ddp's ZeRO (Options.Zero) relies on it, and
// an optimizer that reads across elements (a per-tensor norm, as LAMB's) cannot be sharded
// this way. A trainer's own optimizer plugs in by implementing the interface.
//
// # Usage
//
//	opt, err := optim.NewAdamW(len(params), optim.AdamWOptions{LR: 1e-3})
//	...
//	err = opt.Step(params, grads) // after the step's gradients are final
//
// With ddp's ZeRO the DDP makes the optimizer of this rank's shard from a Factory:
//
//	d, err := ddp.New(ctx, pg, params, ddp.Options{Zero: 1,
//		Optimizer: func(n int) (optim.Optimizer, error) { return optim.NewAdamW(n, o) }})
package optim

import (
	"errors"
	"fmt"
)

// ErrSize is returned by Step when a buffer's length differs from the optimizer's.
var ErrSize = errors.New("optim: buffer size mismatch")

// Optimizer updates Len parameters from their gradients, element by element.
type Optimizer interface {
	// Len is the number of elements the optimizer steps (and the length of each state
	// vector).
	Len() int
	// Step updates params in place from grads; both must be Len long (else ErrSize).
	Step(params, grads []float32) error
	// State returns the optimizer's own state, for checkpoints: Steps and the vectors
	// are the ones it keeps using, so writing them restores a saved state.
	State() State
}

// Factory makes an optimizer for n elements (ddp calls it for the elements of this rank's
// shard, with Options.Zero).
type Factory func(n int) (Optimizer, error)

// State is an optimizer's state.
type State struct {
	// Steps points at the optimizer's step count.
	Steps *int64
	// Vectors are its per-element state, each Len long, in a fixed order.
	Vectors []Vector
}

// Vector is one named per-element state vector ("adamw.m", "sgd.momentum").
type Vector struct {
	Name string
	Data []float32
}

// Bytes is the size of s's vectors in bytes.
func (s State) Bytes() int64 {
	var n int64
	for _, v := range s.Vectors {
		n += 4 * int64(len(v.Data))
	}
	return n
}

func checkLen(n int) error {
	if n < 0 {
		return fmt.Errorf("optim: %d parameters", n)
	}
	return nil
}

func checkStep(params, grads []float32, n int) error {
	if len(params) != n || len(grads) != n {
		return fmt.Errorf("%w: params %d, grads %d, optimizer %d", ErrSize, len(params), len(grads), n)
	}
	return nil
}
