package optim

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

func randVec(r *rand.Rand, n int, scale float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.NormFloat64() * scale)
	}
	return v
}

// refAdamW is torch.optim.AdamW written out in float64, element by element.
func refAdamW(p, m, v []float64, g []float32, t int, o AdamWOptions) {
	for i := range p {
		gi := float64(g[i])
		p[i] *= 1 - o.LR*o.WeightDecay
		m[i] = o.Beta1*m[i] + (1-o.Beta1)*gi
		v[i] = o.Beta2*v[i] + (1-o.Beta2)*gi*gi
		mhat := m[i] / (1 - math.Pow(o.Beta1, float64(t)))
		vhat := v[i] / (1 - math.Pow(o.Beta2, float64(t)))
		p[i] -= o.LR * mhat / (math.Sqrt(vhat) + o.Eps)
	}
}

// refSGD is torch.optim.SGD written out in float64.
func refSGD(p, b []float64, g []float32, t int, o SGDOptions) {
	for i := range p {
		gi := float64(g[i]) + o.WeightDecay*p[i]
		if o.Momentum != 0 {
			if t == 1 {
				b[i] = gi
			} else {
				b[i] = o.Momentum*b[i] + (1-o.Dampening)*gi
			}
			if o.Nesterov {
				gi += o.Momentum * b[i]
			} else {
				gi = b[i]
			}
		}
		p[i] -= o.LR * gi
	}
}

func widen(v []float32) []float64 {
	w := make([]float64, len(v))
	for i, x := range v {
		w[i] = float64(x)
	}
	return w
}

// closeTo fails unless |got − want| ≤ tol·max(1, |want|) element by element.
func closeTo(t *testing.T, what string, got []float32, want []float64, tol float64) {
	t.Helper()
	for i := range want {
		if d := math.Abs(float64(got[i]) - want[i]); !(d <= tol*math.Max(1, math.Abs(want[i]))) {
			t.Fatalf("%s: element %d = %v, want %v (|Δ| %g)", what, i, got[i], want[i], d)
		}
	}
}

func TestAdamWAgainstReference(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	const n, steps = 1000, 10
	o := AdamWOptions{LR: 1e-3, WeightDecay: 0.1}
	opt, err := NewAdamW(n, o)
	if err != nil {
		t.Fatal(err)
	}
	o = opt.Options()
	p := randVec(r, n, 1)
	rp, rm, rv := widen(p), make([]float64, n), make([]float64, n)
	for s := 1; s <= steps; s++ {
		g := randVec(r, n, 0.1)
		if err := opt.Step(p, g); err != nil {
			t.Fatal(err)
		}
		refAdamW(rp, rm, rv, g, s, o)
		closeTo(t, "AdamW params", p, rp, 1e-5)
		closeTo(t, "AdamW m", opt.m, rm, 1e-6)
	}
	st := opt.State()
	if *st.Steps != steps || len(st.Vectors) != 2 || st.Vectors[0].Name != "adamw.m" || st.Bytes() != 8*n {
		t.Fatalf("state: steps %d, vectors %d, %d bytes", *st.Steps, len(st.Vectors), st.Bytes())
	}
}

func TestSGDAgainstReference(t *testing.T) {
	for _, o := range []SGDOptions{
		{LR: 0.1},
		{LR: 0.1, Momentum: 0.9},
		{LR: 0.05, Momentum: 0.9, Dampening: 0.1, WeightDecay: 1e-2},
		{LR: 0.05, Momentum: 0.8, Nesterov: true, WeightDecay: 1e-3},
	} {
		r := rand.New(rand.NewPCG(3, 4))
		const n = 500
		opt, err := NewSGD(n, o)
		if err != nil {
			t.Fatal(err)
		}
		p := randVec(r, n, 1)
		rp, rb := widen(p), make([]float64, n)
		for s := 1; s <= 10; s++ {
			g := randVec(r, n, 1)
			if err := opt.Step(p, g); err != nil {
				t.Fatal(err)
			}
			refSGD(rp, rb, g, s, o)
			closeTo(t, "SGD params", p, rp, 1e-5)
		}
		if st := opt.State(); (o.Momentum == 0) != (len(st.Vectors) == 0) {
			t.Fatalf("%+v: %d state vectors", o, len(st.Vectors))
		}
	}
}

// TestPlainSGDBits: without momentum SGD is p ← p − lr·g in float32, the bits of the
// examples' own loop.
func TestPlainSGDBits(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	p, g := randVec(r, 300, 1), randVec(r, 300, 1)
	want := slices.Clone(p)
	lr := float32(0.3)
	for k := range want {
		want[k] -= lr * g[k]
	}
	opt, _ := NewSGD(len(p), SGDOptions{LR: 0.3})
	if err := opt.Step(p, g); err != nil {
		t.Fatal(err)
	}
	for k := range p {
		if math.Float32bits(p[k]) != math.Float32bits(want[k]) {
			t.Fatalf("element %d: %v, want %v", k, p[k], want[k])
		}
	}
}

// TestShardedBits: optimizers over the pieces of a vector step it to the same bits as
// one optimizer over the whole, which ddp's ZeRO relies on.
func TestShardedBits(t *testing.T) {
	mk := map[string]Factory{
		"adamw":    func(n int) (Optimizer, error) { return NewAdamW(n, AdamWOptions{LR: 1e-2}) },
		"momentum": func(n int) (Optimizer, error) { return NewSGD(n, SGDOptions{LR: 0.1, Momentum: 0.9}) },
	}
	for name, f := range mk {
		r := rand.New(rand.NewPCG(7, 8))
		const n = 1001
		cuts := []int{0, 17, 400, 999, n}
		whole, _ := f(n)
		var parts []Optimizer
		for k := 1; k < len(cuts); k++ {
			o, _ := f(cuts[k] - cuts[k-1])
			parts = append(parts, o)
		}
		p := randVec(r, n, 1)
		q := slices.Clone(p)
		for s := 0; s < 5; s++ {
			g := randVec(r, n, 0.5)
			if err := whole.Step(p, g); err != nil {
				t.Fatal(err)
			}
			for k, o := range parts {
				if err := o.Step(q[cuts[k]:cuts[k+1]], g[cuts[k]:cuts[k+1]]); err != nil {
					t.Fatal(err)
				}
			}
		}
		for k := range p {
			if math.Float32bits(p[k]) != math.Float32bits(q[k]) {
				t.Fatalf("%s: element %d: whole %v, pieces %v", name, k, p[k], q[k])
			}
		}
	}
}

// TestStateRestores: writing a saved State into a fresh optimizer continues the run with
// the same bits.
func TestStateRestores(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	const n = 64
	a, _ := NewAdamW(n, AdamWOptions{LR: 1e-2})
	p := randVec(r, n, 1)
	for s := 0; s < 3; s++ {
		_ = a.Step(p, randVec(r, n, 1))
	}
	b, _ := NewAdamW(n, AdamWOptions{LR: 1e-2})
	sa, sb := a.State(), b.State()
	*sb.Steps = *sa.Steps
	for k := range sa.Vectors {
		copy(sb.Vectors[k].Data, sa.Vectors[k].Data)
	}
	q := slices.Clone(p)
	g := randVec(r, n, 1)
	_ = a.Step(p, g)
	_ = b.Step(q, g)
	if !slices.Equal(p, q) {
		t.Fatal("restored optimizer stepped to other values")
	}
}

func TestErrors(t *testing.T) {
	a, _ := NewAdamW(3, AdamWOptions{})
	if err := a.Step(make([]float32, 3), make([]float32, 2)); !errors.Is(err, ErrSize) {
		t.Fatalf("short grads: %v", err)
	}
	s, _ := NewSGD(3, SGDOptions{LR: 1})
	if err := s.Step(make([]float32, 4), make([]float32, 3)); !errors.Is(err, ErrSize) {
		t.Fatalf("long params: %v", err)
	}
	for _, o := range []SGDOptions{{}, {LR: 1, Momentum: 1}, {LR: 1, Nesterov: true}, {LR: 1, WeightDecay: -1}} {
		if _, err := NewSGD(3, o); err == nil {
			t.Errorf("NewSGD(%+v) accepted", o)
		}
	}
	for _, o := range []AdamWOptions{{LR: -1}, {Beta1: 1}, {Eps: -1}} {
		if _, err := NewAdamW(3, o); err == nil {
			t.Errorf("NewAdamW(%+v) accepted", o)
		}
	}
	if _, err := NewAdamW(-1, AdamWOptions{}); err == nil {
		t.Error("NewAdamW(-1) accepted")
	}
}
