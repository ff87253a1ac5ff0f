package gorgoniaddp

import (
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"go.uber.org/goleak"
	"gorgonia.org/gorgonia"
	"gorgonia.org/tensor"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// tapNet is a small net with a tied weight E (used first and last):
//
//	a = x·E; h = tanh(a·W1 + b1); o = h·W2; out = o·E; loss = Σ(out − t)²
type tapNet struct {
	g      *gorgonia.ExprGraph
	params gorgonia.Nodes // E, W1, b1, W2
	loss   *gorgonia.Node
	vm     gorgonia.VM
}

var tapShapes = []tensor.Shape{{3, 3}, {3, 5}, {1, 5}, {5, 3}}

func newTapNet(t *testing.T, vals []*tensor.Dense, x, target *tensor.Dense, hook GradHook) *tapNet {
	t.Helper()
	g := gorgonia.NewGraph()
	n := &tapNet{g: g}
	use := make(gorgonia.Nodes, len(vals))
	for i, v := range vals {
		p := gorgonia.NewTensor(g, tensor.Float64, 2, gorgonia.WithShape(v.Shape()...), gorgonia.WithValue(v.Clone()))
		n.params = append(n.params, p)
		use[i] = p
		if hook != nil {
			tp, err := Tap(p, i, hook)
			if err != nil {
				t.Fatal(err)
			}
			use[i] = tp
		}
	}
	xn := gorgonia.NewTensor(g, tensor.Float64, 2, gorgonia.WithShape(x.Shape()...), gorgonia.WithValue(x))
	tn := gorgonia.NewTensor(g, tensor.Float64, 2, gorgonia.WithShape(target.Shape()...), gorgonia.WithValue(target))
	a := gorgonia.Must(gorgonia.Mul(xn, use[0]))
	z := gorgonia.Must(gorgonia.Mul(a, use[1]))
	z = gorgonia.Must(gorgonia.BroadcastAdd(z, use[2], nil, []byte{0}))
	h := gorgonia.Must(gorgonia.Tanh(z))
	o := gorgonia.Must(gorgonia.Mul(h, use[3]))
	out := gorgonia.Must(gorgonia.Mul(o, use[0]))
	d := gorgonia.Must(gorgonia.Sub(out, tn))
	n.loss = gorgonia.Must(gorgonia.Sum(gorgonia.Must(gorgonia.Square(d))))
	if _, err := gorgonia.Grad(n.loss, n.params...); err != nil {
		t.Fatal(err)
	}
	n.vm = gorgonia.NewTapeMachine(g)
	return n
}

func randDense(r *rand.Rand, s tensor.Shape) *tensor.Dense {
	d := make([]float64, s.TotalSize())
	for i := range d {
		d[i] = r.NormFloat64()
	}
	return tensor.New(tensor.WithShape(s...), tensor.WithBacking(d))
}

func grads(t *testing.T, n *tapNet) [][]float64 {
	t.Helper()
	var out [][]float64
	for _, p := range n.params {
		g, err := p.Grad()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, append([]float64(nil), g.Data().([]float64)...))
	}
	return out
}

func TestTapHooksAndGradients(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	var vals []*tensor.Dense
	for _, s := range tapShapes {
		vals = append(vals, randDense(r, s))
	}
	x, target := randDense(r, tensor.Shape{4, 3}), randDense(r, tensor.Shape{4, 3})

	type event struct {
		param int
		grad  []float64
	}
	var events []event
	seen := map[int]*tensor.Dense{} // Note [Tap outputs]: one gradient tensor per op, reused
	reused := true
	hook := func(i int, g *tensor.Dense) {
		events = append(events, event{i, append([]float64(nil), g.Data().([]float64)...)})
		if first, ok := seen[i]; ok && first != g {
			reused = false
		}
		seen[i] = g
	}
	plain := newTapNet(t, vals, x, target, nil)
	tapped := newTapNet(t, vals, x, target, hook)
	defer plain.vm.Close()
	defer tapped.vm.Close()

	for step := 0; step < 3; step++ {
		events = events[:0]
		for _, n := range []*tapNet{plain, tapped} {
			n.vm.Reset()
			if err := n.vm.RunAll(); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
		}
		if a, b := plain.loss.Value().Data().(float64), tapped.loss.Value().Data().(float64); math.Float64bits(a) != math.Float64bits(b) {
			t.Fatalf("step %d: loss %v (plain) != %v (tapped)", step, a, b)
		}
		want, got := grads(t, plain), grads(t, tapped)

		// Once per parameter per step; the output layer first, the tied weight last
		// (after both of its contributions).
		order := make([]int, len(events))
		for i, e := range events {
			order[i] = e.param
		}
		if len(order) != 4 || order[0] != 3 || order[3] != 0 || order[1]+order[2] != 3 {
			t.Fatalf("step %d: hook order %v, want [3 {1,2} 0]", step, order)
		}
		for _, e := range events {
			for k := range want[e.param] {
				w := want[e.param][k]
				if math.Float64bits(w) != math.Float64bits(got[e.param][k]) || math.Float64bits(w) != math.Float64bits(e.grad[k]) {
					t.Fatalf("step %d param %d [%d]: plain %v, tapped %v, hook %v", step, e.param, k, w, got[e.param][k], e.grad[k])
				}
			}
		}
		// The tied weight's gradient really has two contributions: check it against
		// finite differences to be sure the hook did not see a partial sum.
		if step == 0 {
			checkFD(t, vals, x, target, want[0])
		}
		if !reused {
			t.Fatalf("step %d: a grad-ready op handed the hook a new tensor (want its output of step 0 reused)", step)
		}
		// Change the parameters between steps, as an optimizer would.
		for i, p := range append(plain.params, tapped.params...) {
			d := p.Value().Data().([]float64)
			for k := range d {
				d[k] -= 0.01 * want[i%4][k]
			}
		}
	}
}

// checkFD compares dLoss/dE against central differences computed on a plain net.
func checkFD(t *testing.T, vals []*tensor.Dense, x, target *tensor.Dense, gotE []float64) {
	t.Helper()
	loss := func() float64 {
		n := newTapNet(t, vals, x, target, nil)
		defer n.vm.Close()
		if err := n.vm.RunAll(); err != nil {
			t.Fatal(err)
		}
		return n.loss.Value().Data().(float64)
	}
	e := vals[0].Data().([]float64)
	const h = 1e-6
	for k := range e {
		orig := e[k]
		e[k] = orig + h
		lp := loss()
		e[k] = orig - h
		lm := loss()
		e[k] = orig
		fd := (lp - lm) / (2 * h)
		if math.Abs(fd-gotE[k]) > 1e-5*math.Max(1, math.Abs(fd)) {
			t.Fatalf("dL/dE[%d]: autodiff %v, finite difference %v", k, gotE[k], fd)
		}
	}
}

func TestTapChainOrder(t *testing.T) {
	// Four stacked layers: hooks must fire from the last layer to the first.
	r := rand.New(rand.NewPCG(3, 4))
	g := gorgonia.NewGraph()
	var params gorgonia.Nodes
	var fired []int
	hook := func(i int, _ *tensor.Dense) { fired = append(fired, i) }
	xn := gorgonia.NewTensor(g, tensor.Float64, 2, gorgonia.WithShape(2, 4), gorgonia.WithValue(randDense(r, tensor.Shape{2, 4})))
	h := xn
	for l := 0; l < 4; l++ {
		w := gorgonia.NewTensor(g, tensor.Float64, 2, gorgonia.WithShape(4, 4), gorgonia.WithValue(randDense(r, tensor.Shape{4, 4})))
		params = append(params, w)
		tw, err := Tap(w, l, hook)
		if err != nil {
			t.Fatal(err)
		}
		h = gorgonia.Must(gorgonia.Tanh(gorgonia.Must(gorgonia.Mul(h, tw))))
	}
	loss := gorgonia.Must(gorgonia.Sum(h))
	if _, err := gorgonia.Grad(loss, params...); err != nil {
		t.Fatal(err)
	}
	vm := gorgonia.NewTapeMachine(g)
	defer vm.Close()
	for step := 0; step < 2; step++ {
		fired = fired[:0]
		vm.Reset()
		if err := vm.RunAll(); err != nil {
			t.Fatal(err)
		}
		if len(fired) != 4 || fired[0] != 3 || fired[1] != 2 || fired[2] != 1 || fired[3] != 0 {
			t.Fatalf("step %d: hooks fired %v, want [3 2 1 0]", step, fired)
		}
	}
}

func TestTapBadInput(t *testing.T) {
	g := gorgonia.NewGraph()
	w := gorgonia.NewMatrix(g, tensor.Float32, gorgonia.WithShape(2, 2))
	s := gorgonia.NewScalar(g, tensor.Float32)
	hook := func(int, *tensor.Dense) {}
	for name, f := range map[string]func() error{
		"nil node":  func() error { _, err := Tap(nil, 0, hook); return err },
		"nil hook":  func() error { _, err := Tap(w, 0, nil); return err },
		"neg index": func() error { _, err := Tap(w, -1, hook); return err },
		"scalar":    func() error { _, err := Tap(s, 0, hook); return err },
	} {
		if err := f(); !errors.Is(err, ErrBadTap) {
			t.Errorf("%s: err = %v, want ErrBadTap", name, err)
		}
	}
}

// TestTapWait: a chain x·W0·W1·W2 whose taps are created where each weight is consumed
// calls the wait of each parameter in forward order, once per run, before the tap reads
// it: a wait that writes the parameter's new value into its tensor (as an all-gather
// landing in Param.Data would) gives the loss of the new values, not of the old. A wait's
// error fails the run, wrapped.
func TestTapWait(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	old := []*tensor.Dense{randDense(r, tensor.Shape{3, 3}), randDense(r, tensor.Shape{3, 3}), randDense(r, tensor.Shape{3, 3})}
	fresh := []*tensor.Dense{randDense(r, tensor.Shape{3, 3}), randDense(r, tensor.Shape{3, 3}), randDense(r, tensor.Shape{3, 3})}
	x := randDense(r, tensor.Shape{2, 3})
	build := func(vals []*tensor.Dense, wait ParamWait) (*gorgonia.Node, []*tensor.Dense, gorgonia.VM) {
		g := gorgonia.NewGraph()
		h := gorgonia.NewTensor(g, tensor.Float64, 2, gorgonia.WithShape(2, 3), gorgonia.WithValue(x))
		var params gorgonia.Nodes
		var held []*tensor.Dense
		for i, v := range vals {
			v = v.Clone().(*tensor.Dense)
			held = append(held, v)
			p := gorgonia.NewTensor(g, tensor.Float64, 2, gorgonia.WithShape(3, 3), gorgonia.WithValue(v))
			params = append(params, p)
			tp, err := TapWait(p, i, func(int, *tensor.Dense) {}, wait)
			if err != nil {
				t.Fatal(err)
			}
			h = gorgonia.Must(gorgonia.Mul(h, tp))
		}
		loss := gorgonia.Must(gorgonia.Sum(gorgonia.Must(gorgonia.Square(h))))
		if _, err := gorgonia.Grad(loss, params...); err != nil {
			t.Fatal(err)
		}
		return loss, held, gorgonia.NewTapeMachine(g)
	}
	lossOf := func(n *gorgonia.Node) float64 { return n.Value().Data().(float64) }

	wantLoss, _, vm := build(fresh, nil)
	if err := vm.RunAll(); err != nil {
		t.Fatal(err)
	}
	want := lossOf(wantLoss)
	vm.Close()

	var order []int
	var held []*tensor.Dense
	loss, held, vm := build(old, func(i int) error {
		order = append(order, i)
		copy(held[i].Data().([]float64), fresh[i].Data().([]float64)) // the value arrives
		return nil
	})
	defer vm.Close()
	if err := vm.RunAll(); err != nil {
		t.Fatal(err)
	}
	if got := lossOf(loss); got != want || len(order) != 3 || order[0] != 0 || order[1] != 1 || order[2] != 2 {
		t.Errorf("loss %v with the waits (order %v), want %v (the new values') in order [0 1 2]", got, order, want)
	}

	boom := errors.New("boom") // returned by the wait of parameter 1
	_, _, vm2 := build(old, func(i int) error {
		if i == 1 {
			return boom
		}
		return nil
	})
	defer vm2.Close()
	// gorgonia's machine keeps the message, not the error chain.
	if err := vm2.RunAll(); err == nil || !strings.Contains(err.Error(), "tap param 1: waiting for its value: boom") {
		t.Errorf("a failing wait: RunAll %v, want its error", err)
	}
}
