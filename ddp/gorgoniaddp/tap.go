package gorgoniaddp

import (
	"errors"
	"fmt"
	"hash"
	"hash/fnv"

	"github.com/chewxy/hm"
	"gorgonia.org/gorgonia"
	"gorgonia.org/tensor"
)

// GradHook receives the final gradient of learnable param (its index in registration
// order) during backward.
//
// Note [Grad-ready hooks]: gorgonia has no per-instruction callback, so Tap inserts a
// copy op p' = tap(p) in front of every use of a learnable. The tap's symbolic
// derivative wraps the incoming gradient in an identity gradReady op whose Do calls
// the hook. gorgonia puts nodes on the tape in creation order and the gradReady node is
// created right after the gradient it wraps, so the hook runs as soon as that
// parameter's gradient is complete: in reverse layer order, once per step, after every
// contribution (tied weights included) has been summed.
//
// Where the tap is created matters for overlap: see Note [Tap placement] (Taps).
//
// The hook runs on the tape machine's goroutine in the middle of backward: it must not
// block. grad is the gradient value gorgonia keeps for the parameter (p.Grad() returns
// the same tensor); the hook may read it and must not keep it past the step, since the
// machine reuses it.
type GradHook func(param int, grad *tensor.Dense)

// ErrBadTap is returned by Tap for a nil node, a nil hook or a negative index.
var ErrBadTap = errors.New("gorgoniaddp: bad tap")

// Tap returns p' = tap(p), a copy of learnable p whose gradient, once complete, is
// passed to hook with the given index. Every use of p in the graph must go through
// the returned node (call Tap once per parameter and reuse its result); a use of p
// itself would add a gradient contribution after the hook has fired.
//
// gorgonia.Grad(cost, p) still yields p's gradient: the tap is transparent to values
// and gradients (bit for bit).
func Tap(p *gorgonia.Node, index int, hook GradHook) (*gorgonia.Node, error) {
	return TapWait(p, index, hook, nil)
}

// ParamWait returns once parameter param's value is in place, or with the error that
// stopped it: Wait(d) is DDP.WaitParams. A tap calls it in forward, right before it copies
// its parameter.
type ParamWait func(param int) error

// TapWait is Tap whose forward first calls wait(index) (when wait is not nil), so that a
// parameter whose value is still arriving (ddp.Options.ZeroForwardOverlap) is read only
// once it is in place: the tap runs right before the op that consumes the parameter (Note
// [Tap placement]), so forward waits for each parameter where it first needs it. An error
// of wait fails the tap's op, and so the machine's run.
func TapWait(p *gorgonia.Node, index int, hook GradHook, wait ParamWait) (*gorgonia.Node, error) {
	switch {
	case p == nil:
		return nil, fmt.Errorf("%w: nil node (param %d)", ErrBadTap, index)
	case hook == nil:
		return nil, fmt.Errorf("%w: nil hook (param %d)", ErrBadTap, index)
	case index < 0:
		return nil, fmt.Errorf("%w: negative index %d", ErrBadTap, index)
	case p.Shape() == nil || p.Shape().IsScalar():
		return nil, fmt.Errorf("%w: param %d (%s) is not a tensor", ErrBadTap, index, p.Name())
	}
	n, err := gorgonia.ApplyOp(&tapOp{index: index, hook: hook, wait: wait}, p)
	if err != nil {
		return nil, fmt.Errorf("gorgoniaddp: tap param %d (%s): %w", index, p.Name(), err)
	}
	return n, nil
}

// identity holds what tapOp and gradReadyOp share: a shape-preserving copy of one
// tensor input, into the output it keeps across steps (Note [Tap outputs]).
type identity struct {
	out *tensor.Dense
}

func (identity) Arity() int { return 1 }

func (identity) Type() hm.Type {
	a := hm.TypeVariable('a')
	return hm.NewFnType(a, a)
}

func (identity) InferShape(in ...gorgonia.DimSizer) (tensor.Shape, error) {
	if len(in) != 1 {
		return nil, fmt.Errorf("gorgoniaddp: tap: want 1 input, got %d", len(in))
	}
	s, ok := in[0].(tensor.Shape)
	if !ok {
		return nil, fmt.Errorf("gorgoniaddp: tap: input shape is %T", in[0])
	}
	return s.Clone(), nil
}

func (identity) ReturnsPtr() bool     { return false }
func (identity) CallsExtern() bool    { return false }
func (identity) OverwritesInput() int { return -1 }

// copyInto copies the single dense input into prealloc, or else into id.out, the op's
// output of the previous step, and returns it (allocated, and kept in id.out, when neither
// fits).
//
// Note [Tap outputs]: a tap and a grad-ready op each copy a whole parameter every step.
// With a fresh tensor each time that was the trainer's main garbage (the seed transformer:
// 73% of all bytes allocated over 40 steps, about 100 MB a step at L=4 h=512), so the heap
// kept growing for several steps, each new page a fault, and the first steps ran up to
// twice as slow. The op now reuses its own output: the step that produced it is over when
// the op runs again (the hook must not keep the gradient past its step, and neither may
// anything else, as with every value the tape machine reuses). A later op may have
// reshaped it in place, so its shape is restored. The op now holds state: one graph's
// taps must not run in two machines at once.
func (id *identity) copyInto(prealloc gorgonia.Value, in []gorgonia.Value) (*tensor.Dense, error) {
	if len(in) != 1 {
		return nil, fmt.Errorf("want 1 input, got %d", len(in))
	}
	src, ok := in[0].(*tensor.Dense)
	if !ok {
		return nil, fmt.Errorf("input is %T, want *tensor.Dense", in[0])
	}
	pre, _ := prealloc.(*tensor.Dense)
	var dst *tensor.Dense
	for _, c := range []*tensor.Dense{pre, id.out} {
		if fits(c, src) {
			dst = c
			break
		}
	}
	if dst != nil && !dst.Shape().Eq(src.Shape()) && dst.Reshape(src.Shape().Clone()...) != nil {
		dst = nil
	}
	if dst == nil {
		dst = tensor.New(tensor.Of(src.Dtype()), tensor.WithShape(src.Shape().Clone()...))
		id.out = dst
	}
	if err := tensor.Copy(dst, src); err != nil {
		return nil, err
	}
	return dst, nil
}

// fits reports whether dst can take src's values: a dense tensor of src's type and element
// count, laid out plainly, whose memory does not overlap src's (a reshape's shallow clone
// shares its input's).
func fits(dst, src *tensor.Dense) bool {
	if dst == nil || dst.Dtype() != src.Dtype() || dst.Shape().TotalSize() != src.Shape().TotalSize() ||
		dst.IsMaterializable() || !dst.DataOrder().IsRowMajor() {
		return false
	}
	a, b := dst.Uintptr(), src.Uintptr()
	return a+dst.MemSize() <= b || b+src.MemSize() <= a
}

// tapOp is the forward tap: a copy of the parameter.
type tapOp struct {
	identity
	index int
	hook  GradHook
	wait  ParamWait // nil: the value is always in place
}

var (
	_ gorgonia.SDOp            = (*tapOp)(nil)
	_ gorgonia.UsePreallocDoer = (*tapOp)(nil)
	_ gorgonia.UsePreallocDoer = (*gradReadyOp)(nil)
)

func (op *tapOp) Do(in ...gorgonia.Value) (gorgonia.Value, error) {
	return op.UsePreallocDo(nil, in...)
}

func (op *tapOp) UsePreallocDo(prealloc gorgonia.Value, in ...gorgonia.Value) (gorgonia.Value, error) {
	if op.wait != nil {
		if err := op.wait(op.index); err != nil {
			return nil, fmt.Errorf("gorgoniaddp: tap param %d: waiting for its value: %w", op.index, err)
		}
	}
	v, err := op.copyInto(prealloc, in)
	if err != nil {
		return nil, fmt.Errorf("gorgoniaddp: tap param %d: %w", op.index, err)
	}
	return v, nil
}

func (op *tapOp) DiffWRT(n int) []bool { return []bool{true} }

func (op *tapOp) SymDiff(inputs gorgonia.Nodes, output, grad *gorgonia.Node) (gorgonia.Nodes, error) {
	g, err := gorgonia.ApplyOp(&gradReadyOp{index: op.index, hook: op.hook}, grad)
	if err != nil {
		return nil, fmt.Errorf("gorgoniaddp: grad-ready param %d: %w", op.index, err)
	}
	return gorgonia.Nodes{g}, nil
}

// The hash includes the index so that two taps never collapse into one node, and the
// op's address so that taps of different graphs/hooks never do either.
func (op *tapOp) WriteHash(h hash.Hash) { fmt.Fprintf(h, "ddp.tap{%d,%p}", op.index, op) }
func (op *tapOp) Hashcode() uint32      { return hashOf(op) }
func (op *tapOp) String() string        { return fmt.Sprintf("tap%d", op.index) }

// gradReadyOp passes the gradient through (a copy) and fires the hook.
type gradReadyOp struct {
	identity
	index int
	hook  GradHook
}

func (op *gradReadyOp) Do(in ...gorgonia.Value) (gorgonia.Value, error) {
	return op.UsePreallocDo(nil, in...)
}

func (op *gradReadyOp) UsePreallocDo(prealloc gorgonia.Value, in ...gorgonia.Value) (gorgonia.Value, error) {
	v, err := op.copyInto(prealloc, in)
	if err != nil {
		return nil, fmt.Errorf("gorgoniaddp: grad-ready param %d: %w", op.index, err)
	}
	op.hook(op.index, v)
	return v, nil
}

func (op *gradReadyOp) WriteHash(h hash.Hash) { fmt.Fprintf(h, "ddp.gradReady{%d,%p}", op.index, op) }
func (op *gradReadyOp) Hashcode() uint32      { return hashOf(op) }
func (op *gradReadyOp) String() string        { return fmt.Sprintf("gradReady%d", op.index) }

func hashOf(op interface{ WriteHash(hash.Hash) }) uint32 {
	h := fnv.New32a()
	op.WriteHash(h)
	return h.Sum32()
}
