package gorgoniaddp

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"gorgonia.org/gorgonia"
	"gorgonia.org/tensor"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/internal/numtest"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// mlp is loss = scale · Σ (tanh(x·W1 + b1)·W2 − t)² in float32.
type mlp struct {
	g          *gorgonia.ExprGraph
	learnables gorgonia.Nodes // W1, b1, W2
	x, t       *tensor.Dense
	vm         gorgonia.VM
}

var mlpShapes = [][]int{{3, 5}, {1, 5}, {5, 2}}

func newLearnables(g *gorgonia.ExprGraph, seed uint64) gorgonia.Nodes {
	r := rand.New(rand.NewPCG(seed, 5))
	var ns gorgonia.Nodes
	for i, s := range mlpShapes {
		v := tensor.New(tensor.WithShape(s...), tensor.WithBacking(numtest.RandF32(r, s[0]*s[1])))
		ns = append(ns, gorgonia.NewTensor(g, tensor.Float32, 2, gorgonia.WithShape(s...), gorgonia.WithValue(v), gorgonia.WithName(fmt.Sprintf("p%d", i))))
	}
	return ns
}

// build finishes the graph over learnables (use: the nodes the model reads, tapped or not).
func (m *mlp) build(t *testing.T, use func(i int) *gorgonia.Node, batch int, scale float32) {
	t.Helper()
	m.x = tensor.New(tensor.Of(tensor.Float32), tensor.WithShape(batch, 3))
	m.t = tensor.New(tensor.Of(tensor.Float32), tensor.WithShape(batch, 2))
	x := gorgonia.NewTensor(m.g, tensor.Float32, 2, gorgonia.WithShape(batch, 3), gorgonia.WithValue(m.x), gorgonia.WithName("x"))
	tg := gorgonia.NewTensor(m.g, tensor.Float32, 2, gorgonia.WithShape(batch, 2), gorgonia.WithValue(m.t), gorgonia.WithName("t"))
	h := gorgonia.Must(gorgonia.Mul(x, use(0)))
	h = gorgonia.Must(gorgonia.BroadcastAdd(h, use(1), nil, []byte{0}))
	h = gorgonia.Must(gorgonia.Tanh(h))
	o := gorgonia.Must(gorgonia.Mul(h, use(2)))
	d := gorgonia.Must(gorgonia.Sub(o, tg))
	loss := gorgonia.Must(gorgonia.Sum(gorgonia.Must(gorgonia.Square(d))))
	loss = gorgonia.Must(gorgonia.Mul(loss, gorgonia.NewConstant(scale)))
	if _, err := gorgonia.Grad(loss, m.learnables...); err != nil {
		t.Fatal(err)
	}
	m.vm = gorgonia.NewTapeMachine(m.g)
}

func (m *mlp) run(xs, ts []float32) error {
	copy(m.x.Float32s(), xs)
	copy(m.t.Float32s(), ts)
	m.vm.Reset()
	return m.vm.RunAll()
}

func sgd(ns gorgonia.Nodes, grads func(i int) []float32, lr float32) {
	for i, n := range ns {
		w, g := n.Value().(*tensor.Dense).Float32s(), grads(i)
		for k := range w {
			w[k] -= lr * g[k]
		}
	}
}

// TestWrapNodesEndToEnd: a small gorgonia MLP wrapped with WrapNodes on 2 ranks (which start
// from different random parameters), each step 2 micro-batches of 2 samples per rank (the
// first under NoSync), ends every step with the gradient one plain (untapped) graph computes
// over the 8 samples, from rank 0's initial parameters, in Grad32 and in the learnables'
// gradients; after SGD the replicas stay bitwise equal. Tolerance 1e-5 relative.
func TestWrapNodesEndToEnd(t *testing.T) {
	const (
		R, A, M = 2, 2, 2
		N       = R * A * M
		steps   = 3
		lr      = 0.1
	)
	r := rand.New(rand.NewPCG(21, 22))
	xs, ts := numtest.RandF32(r, steps*N*3), numtest.RandF32(r, steps*N*2)

	ref := &mlp{g: gorgonia.NewGraph()}
	ref.learnables = newLearnables(ref.g, 0)
	ref.build(t, func(i int) *gorgonia.Node { return ref.learnables[i] }, N, 1.0/N)
	defer ref.vm.Close()
	refG := make([][][]float64, steps)
	for s := 0; s < steps; s++ {
		if err := ref.run(xs[s*N*3:(s+1)*N*3], ts[s*N*2:(s+1)*N*2]); err != nil {
			t.Fatal(err)
		}
		for _, n := range ref.learnables {
			g, _ := n.Grad()
			refG[s] = append(refG[s], numtest.ToF64(g.(*tensor.Dense).Float32s()))
		}
		sgd(ref.learnables, func(i int) []float32 { g, _ := ref.learnables[i].Grad(); return g.(*tensor.Dense).Float32s() }, lr)
	}

	c := pgtest.NewCluster(R)
	defer c.Close()
	var buildMu sync.Mutex // gorgonia's graph construction is not known to be goroutine-safe
	finals := make([][]float32, R)
	err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		m := &mlp{g: gorgonia.NewGraph()}
		m.learnables = newLearnables(m.g, uint64(rank))
		afterSyncs := 0 // the caller's AfterSync runs after WrapNodes has written the nodes
		then := func(d *ddp.DDP) error {
			afterSyncs++
			g, err := m.learnables[0].Grad()
			if err != nil || !slices.Equal(g.(*tensor.Dense).Float32s(), d.Grad32(0)) {
				return fmt.Errorf("AfterSync %d: the node's gradient is not the average yet (%v)", afterSyncs, err)
			}
			return nil
		}
		d, taps, err := WrapNodes(context.Background(), pg, m.learnables, ddp.Options{BucketCapMB: 50.0 / (1 << 20), FirstBucketCapMB: 50.0 / (1 << 20), AfterSync: then})
		if err != nil {
			return err
		}
		defer d.Close()
		buildMu.Lock()
		m.build(t, func(i int) *gorgonia.Node { return gorgonia.Must(taps.Use(i)) }, M, 1.0/(A*M))
		buildMu.Unlock()
		defer m.vm.Close()
		for s := 0; s < steps; s++ {
			for a := 0; a < A; a++ {
				first := s*N + (a*R+rank)*M
				backward := func() error { return m.run(xs[first*3:(first+M)*3], ts[first*2:(first+M)*2]) }
				if a < A-1 {
					err = d.NoSync(backward)
				} else {
					err = d.Backward(context.Background(), backward)
				}
				if err != nil {
					return fmt.Errorf("step %d micro-batch %d: %w", s, a, err)
				}
			}
			for i, n := range m.learnables {
				if err := numtest.CloseTo(d.Grad32(i), refG[s][i], 1e-5); err != nil {
					return fmt.Errorf("step %d: Grad32(%d): %w", s, i, err)
				}
				g, err := n.Grad()
				if err != nil {
					return err
				}
				if !slices.Equal(g.(*tensor.Dense).Float32s(), d.Grad32(i)) {
					return fmt.Errorf("step %d: %s.Grad() is not the averaged gradient", s, n.Name())
				}
			}
			sgd(m.learnables, d.Grad32, lr)
		}
		for _, n := range m.learnables {
			finals[rank] = append(finals[rank], n.Value().(*tensor.Dense).Float32s()...)
		}
		if afterSyncs != steps {
			return fmt.Errorf("the caller's AfterSync ran %d times in %d steps", afterSyncs, steps)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(finals[0], finals[1]) {
		t.Errorf("replicas differ after %d steps", steps)
	}
}

// The hook reports a gorgonia gradient without allocating (in a NoSync pass, which
// communicates nothing).
func TestHookAllocs(t *testing.T) {
	c := pgtest.NewCluster(1)
	defer c.Close()
	g := tensor.New(tensor.WithShape(4, 8), tensor.WithBacking(numtest.RandF32(rand.New(rand.NewPCG(1, 1)), 32)))
	d, err := ddp.New(context.Background(), c.Group(0), []ddp.Param{{Name: "w", Data: make([]float32, 32), Grad: make([]float32, 32)}}, ddp.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	hook := Hook(d)
	if n := testing.AllocsPerRun(100, func() {
		d.BeginBackward(ddp.Accumulate)
		hook(0, g)
	}); n != 0 {
		t.Errorf("BeginBackward+Hook: %v allocations, want 0", n)
	}
	if err := d.Err(); err != nil {
		t.Fatal(err)
	}
	// A float64 tensor for a float32 parameter fails the step with a clear error.
	hook(0, tensor.New(tensor.WithShape(32), tensor.WithBacking(make([]float64, 32))))
	if err := d.Finalize(context.Background()); err == nil {
		t.Fatal("wrong gradient type accepted")
	}
}

// Taps.Use creates a tap once, at first use, and rejects an index out of range.
func TestTapsUse(t *testing.T) {
	g := gorgonia.NewGraph()
	ls := newLearnables(g, 0)
	taps := NewTaps(ls, func(int, *tensor.Dense) {})
	a, err := taps.Use(1)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := taps.Use(1); err != nil || b != a {
		t.Fatalf("second Use(1) = %v, %v; want the same node as the first", b, err)
	}
	if a == ls[1] {
		t.Fatal("Use(1) returned the learnable itself, not its tap")
	}
	for _, i := range []int{-1, len(ls)} {
		if _, err := taps.Use(i); !errors.Is(err, ddp.ErrInvalidArgument) {
			t.Errorf("Use(%d) = %v, want ErrInvalidArgument", i, err)
		}
	}
}
