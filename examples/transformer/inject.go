package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"gorgonia.org/tensor"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/gorgoniaddp"
	"github.com/goddp/goddp/examples/transformer/model"
)

// injection is --inject_nan RANK:STEP:PARAM: rank RANK's gradient of parameter PARAM (an
// index, or a name, resolved once the model exists) holds a NaN in step STEP. on is false
// without the flag.
type injection struct {
	on         bool
	rank, step int
	param      string
}

func (in *injection) String() string {
	if !in.on {
		return ""
	}
	return fmt.Sprintf("%d:%d:%s", in.rank, in.step, in.param)
}

func (in *injection) Set(s string) error {
	parts := strings.SplitN(s, ":", 3)
	if len(parts) == 3 && parts[2] != "" {
		rank, err1 := strconv.Atoi(parts[0])
		step, err2 := strconv.Atoi(parts[1])
		if err1 == nil && err2 == nil && rank >= 0 && step >= 0 {
			*in = injection{on: true, rank: rank, step: step, param: parts[2]}
			return nil
		}
	}
	return errors.New("want RANK:STEP:PARAM, PARAM a parameter's index or name, e.g. 1:5:6 or 1:5:1.layers.0.linear1.weight")
}

// index resolves the parameter among the model's.
func (in injection) index(params []model.Param) (int, error) {
	if i, err := strconv.Atoi(in.param); err == nil {
		if i < 0 || i >= len(params) {
			return 0, fmt.Errorf("--inject_nan %s: parameter index %d outside [0, %d)", in.String(), i, len(params))
		}
		return i, nil
	}
	names := make([]string, len(params))
	for i, p := range params {
		if p.Name == in.param {
			return i, nil
		}
		names[i] = p.Name
	}
	return 0, fmt.Errorf("--inject_nan %s: the model has no parameter %q; it has %s", in.String(), in.param, strings.Join(names, ", "))
}

// injectHook returns hook, or with --inject_nan for this rank a hook that first puts a NaN
// into the middle of the chosen parameter's gradient in the chosen step (*step is the
// running step).
func injectHook(f flags, rank int, params []model.Param, step *int, hook gorgoniaddp.GradHook) (gorgoniaddp.GradHook, error) {
	if !f.inject.on {
		return hook, nil
	}
	p, err := f.inject.index(params)
	if err != nil || f.inject.rank != rank {
		return hook, err
	}
	return func(i int, grad *tensor.Dense) {
		if i == p && *step == f.inject.step {
			g := grad.Data().([]float32)
			g[len(g)/2] = float32(math.NaN())
		}
		hook(i, grad)
	}, nil
}

// saidError is an error that the rank has printed already (see nonFinite).
type saidError struct{ error }

func (e saidError) Unwrap() error { return e.error }

// nonFinite is step's error for err, Finalize's. A non-finite gradient (a
// *ddp.NonFiniteError) is the same on every rank, with the group intact, and the optimizer
// has not stepped on it: its step becomes the trainer's (a resumed run counts from the
// checkpoint), each rank prints it, and the ranks leave together (a barrier), so that none
// exits, and makes the launcher stop the others, before every rank has said it.
func (t *trainer) nonFinite(ctx context.Context, step int, err error) error {
	var nf *ddp.NonFiniteError
	if !errors.As(err, &nf) || t.pg == nil {
		return fmt.Errorf("step %d: %w", step, err)
	}
	nf.Step = step
	fmt.Fprintln(t.f.stderr, "transformer:", err)
	if berr := t.pg.Barrier(ctx).Wait(ctx); berr != nil {
		return fmt.Errorf("rank %d: the barrier to leave together after a non-finite gradient: %w", t.w.rank, berr)
	}
	return saidError{err}
}
