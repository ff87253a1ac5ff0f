package optim

import (
	"errors"
	"math"
	"testing"
)

func TestAdamWHandComputed(t *testing.T) {
	opt, err := NewAdamW(3, AdamWOptions{LR: 1e-3})
	if err != nil {
		t.Fatal(err)
	}
	p := []float32{1, -2, 0.5}
	g1 := []float32{0.1, -0.3, 2}
	if err := opt.Step(p, g1); err != nil {
		t.Fatal(err)
	}
	// Step 1: m̂ = g, v̂ = g², so p ← p·(1 − lr·wd) − lr·g/(|g| + ε) ≈ p(1−1e-5) − 1e-3·sign(g).
	want1 := []float64{
		1*(1-1e-5) - 1e-3*0.1/(0.1+1e-8),
		-2*(1-1e-5) + 1e-3*0.3/(0.3+1e-8),
		0.5*(1-1e-5) - 1e-3*2/(2+1e-8),
	}
	check(t, "step 1", p, want1)

	// Step 2 with g2, by the formula written out in float64.
	g2 := []float64{-0.2, 0.1, 1}
	var want2 []float64
	for i := range want1 {
		m := 0.9*(0.1*float64(g1[i])) + 0.1*g2[i]
		v := 0.999*(0.001*float64(g1[i])*float64(g1[i])) + 0.001*g2[i]*g2[i]
		mhat := m / (1 - 0.9*0.9)
		vhat := v / (1 - 0.999*0.999)
		want2 = append(want2, want1[i]*(1-1e-5)-1e-3*mhat/(math.Sqrt(vhat)+1e-8))
	}
	if err := opt.Step(p, []float32{-0.2, 0.1, 1}); err != nil {
		t.Fatal(err)
	}
	check(t, "step 2", p, want2)
	if opt.t != 2 {
		t.Fatalf("steps taken = %d", opt.t)
	}
}

func check(t *testing.T, what string, got []float32, want []float64) {
	t.Helper()
	for i := range want {
		if math.Abs(float64(got[i])-want[i]) > 2e-7*math.Max(1, math.Abs(want[i])) {
			t.Fatalf("%s: p[%d] = %v, want %v", what, i, got[i], want[i])
		}
	}
}

func TestAdamWDefaultsAndErrors(t *testing.T) {
	opt, err := NewAdamW(2, AdamWOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if o := opt.Options(); o.LR != 1e-4 || o.Beta1 != 0.9 || o.Beta2 != 0.999 || o.Eps != 1e-8 || o.WeightDecay != 0.01 {
		t.Fatalf("defaults %+v", o)
	}
	if err := opt.Step(make([]float32, 3), make([]float32, 2)); !errors.Is(err, ErrSize) {
		t.Fatalf("size mismatch: %v", err)
	}
	for _, o := range []AdamWOptions{{LR: -1}, {Beta1: 1}, {Beta2: 2}, {Eps: -1}} {
		if _, err := NewAdamW(1, o); err == nil {
			t.Fatalf("%+v accepted", o)
		}
	}
	// State round trip.
	p, g := []float32{1, 2}, []float32{0.5, -0.5}
	_ = opt.Step(p, g)
	s, m, v := opt.State()
	opt2, _ := NewAdamW(2, AdamWOptions{})
	if err := opt2.SetState(s, m, v); err != nil {
		t.Fatal(err)
	}
	p2 := append([]float32(nil), p...)
	_ = opt.Step(p, g)
	_ = opt2.Step(p2, g)
	if p[0] != p2[0] || p[1] != p2[1] {
		t.Fatalf("restored optimizer diverged: %v vs %v", p, p2)
	}
}

// BenchmarkAdamW steps the seed model's 1,711,104 parameters.
func BenchmarkAdamW(b *testing.B) {
	const n = 1711104
	opt, _ := NewAdamW(n, AdamWOptions{})
	p, g := make([]float32, n), make([]float32, n)
	for i := range g {
		p[i], g[i] = float32(i%97)/97, float32(i%89)/89-0.5
	}
	b.ReportAllocs()
	for b.Loop() {
		if err := opt.Step(p, g); err != nil {
			b.Fatal(err)
		}
	}
}
