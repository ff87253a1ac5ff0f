package lowrank

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// The lengths cover no vector block, one, several, and every tail length; the offsets
// start rows off the vector alignment.
var lengths = []int{0, 1, 7, 8, 9, 15, 16, 17, 31, 63, 64, 65, 512 + 5, 2048}

func randF32(g *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(g.NormFloat64())
	}
	return x
}

func randF64(g *rand.Rand, n int) []float64 {
	x := make([]float64, n)
	for i := range x {
		x[i] = g.NormFloat64()
	}
	return x
}

// both runs f with the assembly loops off and, where the CPU has them, on.
func both(t *testing.T, f func(asm bool)) {
	saved := useAVX2
	defer func() { useAVX2 = saved }()
	useAVX2 = false
	f(false)
	if saved {
		useAVX2 = true
		f(true)
	}
}

func sameBits32(t *testing.T, what string, got, want []float32) {
	t.Helper()
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("%s: element %d is %v, the Go loop's %v", what, i, got[i], want[i])
		}
	}
}

// axpy2Both runs Axpy2 on two copies of x: with the float64 factors y0, y1 and with the
// float32 ones y0s, y1s.
func axpy2Both(x []float32, a0, a1 float64, y0, y1 []float64, y0s, y1s []float32) (got, gots []float32) {
	got = append([]float32(nil), x...)
	Axpy2(got, a0, y0, a1, y1)
	gots = append([]float32(nil), x...)
	Axpy2(gots, a0, y0s, a1, y1s)
	return got, gots
}

// goOrSame keeps the Go loop's results (asm false) in ref and refs, and checks the
// assembly's (asm true) against them bit for bit.
func goOrSame(t *testing.T, asm bool, what string, got, gots []float32, ref, refs *[]float32) {
	t.Helper()
	if !asm {
		*ref, *refs = got, gots
		return
	}
	sameBits32(t, what+" (AVX2)", got, *ref)
	sameBits32(t, what+", float32 y (AVX2)", gots, *refs)
}

func sameBits64(t *testing.T, what string, got, want []float64) {
	t.Helper()
	for i := range want {
		if math.Float64bits(got[i]) != math.Float64bits(want[i]) {
			t.Fatalf("%s: element %d is %v, the Go loop's %v", what, i, got[i], want[i])
		}
	}
}

// near checks got against a reference summed another way (in order, with no partial
// sums): within rounding of the terms' magnitude.
func near(t *testing.T, what string, got, want, scale float64) {
	t.Helper()
	if d := math.Abs(got - want); d > 1e-12*(1+scale) {
		t.Fatalf("%s: %v, the reference %v (off by %g)", what, got, want, d)
	}
}

func TestDot2(t *testing.T) {
	g := rand.New(rand.NewPCG(1, 2))
	for _, n := range lengths {
		for _, off := range []int{0, 1, 3} {
			x, y0, y1 := randF32(g, n+off)[off:], randF64(g, n+off)[off:], randF64(g, n+off)[off:]
			var r0, r1, scale float64
			for j := range x {
				r0 += float64(x[j]) * y0[j]
				r1 += float64(x[j]) * y1[j]
				scale += math.Abs(float64(x[j])) * (math.Abs(y0[j]) + math.Abs(y1[j]))
			}
			var ref [2]float64
			both(t, func(asm bool) {
				a, b := Dot2(x, y0, y1)
				near(t, "Dot2", a, r0, scale)
				near(t, "Dot2", b, r1, scale)
				if !asm {
					ref = [2]float64{a, b}
				} else {
					sameBits64(t, "Dot2 (AVX2)", []float64{a, b}, ref[:])
				}
			})
			// float64 rows take the Go loop only, and agree with the reference too.
			x64 := make([]float64, n)
			for j := range x64 {
				x64[j] = float64(x[j])
			}
			a, b := Dot2(x64, y0, y1)
			near(t, "Dot2 float64", a, r0, scale)
			near(t, "Dot2 float64", b, r1, scale)
		}
	}
}

func TestAxpy2(t *testing.T) {
	g := rand.New(rand.NewPCG(3, 4))
	for _, n := range lengths {
		for _, off := range []int{0, 1, 3} {
			x := randF32(g, n+off)[off:]
			y0, y1 := randF64(g, n+off)[off:], randF64(g, n+off)[off:]
			y0s, y1s := randF32(g, n+off)[off:], randF32(g, n+off)[off:]
			a0, a1 := g.NormFloat64(), g.NormFloat64()
			var ref, refs []float32
			both(t, func(asm bool) {
				got, gots := axpy2Both(x, a0, a1, y0, y1, y0s, y1s)
				for j := range x {
					want := float64(x[j]) + a0*y0[j] + a1*y1[j]
					if d := math.Abs(float64(got[j]) - want); d > 1e-6*(1+math.Abs(want)) {
						t.Fatalf("Axpy2 element %d: %v, want %v", j, got[j], want)
					}
					want = float64(x[j]) + a0*float64(y0s[j]) + a1*float64(y1s[j])
					if d := math.Abs(float64(gots[j]) - want); d > 1e-6*(1+math.Abs(want)) {
						t.Fatalf("Axpy2 (float32 y) element %d: %v, want %v", j, gots[j], want)
					}
				}
				goOrSame(t, asm, "Axpy2", got, gots, &ref, &refs)
			})
		}
	}
}

// TestAxpy2Cancelling: where a1·y1 nearly cancels a0·y0, the float64 sum keeps bits that a
// float32 rounding of each product, another order of the sums, or a fused multiply-add
// would change: the assembly must give the Go loop's bits here too, for float64 and float32
// factors.
func TestAxpy2Cancelling(t *testing.T) {
	g := rand.New(rand.NewPCG(9, 10))
	const n = 64 + 5
	for _, tiny := range []bool{false, true} {
		x := make([]float32, n)
		y0, y1 := randF64(g, n), make([]float64, n)
		y0s, y1s := randF32(g, n), make([]float32, n)
		for j := range x {
			if tiny {
				x[j] = float32(math.Ldexp(g.NormFloat64(), -60))
			}
			y1[j] = 3 * y0[j] * (1 + math.Ldexp(g.NormFloat64(), -40))
			y1s[j] = 3 * y0s[j]
		}
		a0, a1 := 1.0+math.Ldexp(1, -40), -1.0/3
		var ref, refs []float32
		both(t, func(asm bool) {
			got, gots := axpy2Both(x, a0, a1, y0, y1, y0s, y1s)
			goOrSame(t, asm, "Axpy2 cancelling", got, gots, &ref, &refs)
		})
	}
}

// TestNonFinite: a NaN or an infinity in a row or a factor comes out as NaN or infinity
// from both loops alike (their payloads may differ: package doc).
func TestNonFinite(t *testing.T) {
	const n = 24
	for _, bad := range []float64{math.NaN(), math.Inf(1)} {
		for _, at := range []int{0, 9, n - 1} {
			x, y := make([]float32, n), make([]float64, n)
			for j := range x {
				x[j], y[j] = 1, 1
			}
			x[at] = float32(bad)
			both(t, func(asm bool) {
				a, b := Dot2(x, y, y)
				s := slices.Clone(y)
				AxpyTo2(s, 1, s, 0, x)
				z := slices.Clone(x)
				Axpy2(z, 1, y, 1, y)
				for what, v := range map[string]float64{"Dot2": a, "Dot2 second": b, "AxpyTo2": s[at], "Axpy2": float64(z[at])} {
					if !math.IsNaN(v) && !math.IsInf(v, 0) {
						t.Errorf("asm %v, %v at %d: %s gives %v", asm, bad, at, what, v)
					}
				}
			})
		}
	}
}

func TestAxpyTo2(t *testing.T) {
	g := rand.New(rand.NewPCG(5, 6))
	for _, n := range lengths {
		for _, off := range []int{0, 1, 3} {
			x := randF32(g, n+off)[off:]
			s0, s1 := randF64(g, n+off)[off:], randF64(g, n+off)[off:]
			a0, a1 := g.NormFloat64(), g.NormFloat64()
			var ref0, ref1, refSame []float64
			both(t, func(asm bool) {
				got0, got1 := append([]float64(nil), s0...), append([]float64(nil), s1...)
				AxpyTo2(got0, a0, got1, a1, x)
				same := append([]float64(nil), s0...)
				AxpyTo2(same, a0, same, 0, x) // one column: the same slice twice
				for j := range x {
					for _, c := range []struct {
						what      string
						got, want float64
					}{
						{"s0", got0[j], s0[j] + float64(a0*float64(x[j]))},
						{"s1", got1[j], s1[j] + float64(a1*float64(x[j]))},
						{"one column", same[j], s0[j] + float64(a0*float64(x[j]))},
					} {
						if math.Float64bits(c.got) != math.Float64bits(c.want) {
							t.Fatalf("AxpyTo2 %s element %d: %v, want %v", c.what, j, c.got, c.want)
						}
					}
				}
				if !asm {
					ref0, ref1, refSame = got0, got1, same
				} else {
					sameBits64(t, "AxpyTo2 s0 (AVX2)", got0, ref0)
					sameBits64(t, "AxpyTo2 s1 (AVX2)", got1, ref1)
					sameBits64(t, "AxpyTo2 one column (AVX2)", same, refSame)
				}
			})
		}
	}
}

func TestAllocs(t *testing.T) {
	x, y0, y1 := make([]float32, 100), make([]float64, 100), make([]float64, 100)
	if a := testing.AllocsPerRun(10, func() {
		Dot2(x, y0, y1)
		Axpy2(x, 1, y0, 2, y1)
		AxpyTo2(y0, 1, y1, 2, x)
	}); a != 0 {
		t.Fatalf("%v allocations", a)
	}
}

func BenchmarkKernels(b *testing.B) {
	const n = 512
	g := rand.New(rand.NewPCG(7, 8))
	x, y0, y1, xs := randF32(g, n), randF64(g, n), randF64(g, n), randF32(g, n)
	for _, asm := range []bool{false, true} {
		if asm && !useAVX2 {
			continue
		}
		saved := useAVX2
		useAVX2 = asm
		name := map[bool]string{false: "go", true: "avx2"}[asm]
		b.Run("Dot2/"+name, func(b *testing.B) {
			for b.Loop() {
				Dot2(x, y0, y1)
			}
		})
		b.Run("Axpy2/"+name, func(b *testing.B) {
			for b.Loop() {
				Axpy2(x, 1e-9, y0, -1e-9, y1)
			}
		})
		b.Run("Axpy2F32/"+name, func(b *testing.B) {
			for b.Loop() {
				Axpy2(x, 1e-9, xs, -1e-9, xs)
			}
		})
		b.Run("AxpyTo2/"+name, func(b *testing.B) {
			for b.Loop() {
				AxpyTo2(y0, 1e-9, y1, -1e-9, x)
			}
		})
		useAVX2 = saved
	}
}
