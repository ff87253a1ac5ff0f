package kernels

import (
	"bytes"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/goddp/goddp/procgroup"
)

func ref(op procgroup.ReduceOp, a, b float64) float64 {
	switch op {
	case procgroup.Sum, procgroup.Avg:
		return a + b
	case procgroup.Prod:
		return a * b
	case procgroup.Min:
		return math.Min(a, b)
	}
	return math.Max(a, b)
}

func TestReduceMatchesFloat64Reference(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const n = 37
	for _, op := range procgroup.ReduceOps {
		a32, b32 := make([]float32, n), make([]float32, n)
		a64, b64 := make([]float64, n), make([]float64, n)
		ai, bi := make([]int32, n), make([]int32, n)
		al, bl := make([]int64, n), make([]int64, n)
		ab, bb := make([]procgroup.BF16, n), make([]procgroup.BF16, n)
		ah, bh := make([]procgroup.F16, n), make([]procgroup.F16, n)
		want := make([]float64, n)
		for i := range n {
			x, y := float64(rng.IntN(19)-9), float64(rng.IntN(19)-9)
			a32[i], b32[i], a64[i], b64[i] = float32(x), float32(y), x, y
			ai[i], bi[i], al[i], bl[i] = int32(x), int32(y), int64(x), int64(y)
			ab[i], bb[i] = procgroup.BF16FromFloat32(float32(x)), procgroup.BF16FromFloat32(float32(y))
			ah[i], bh[i] = procgroup.F16FromFloat32(float32(x)), procgroup.F16FromFloat32(float32(y))
			want[i] = ref(op, x, y)
		}
		for _, c := range []struct {
			dst, src any
			get      func(i int) float64
		}{
			{a32, b32, func(i int) float64 { return float64(a32[i]) }},
			{a64, b64, func(i int) float64 { return a64[i] }},
			{ai, bi, func(i int) float64 { return float64(ai[i]) }},
			{al, bl, func(i int) float64 { return float64(al[i]) }},
			{ab, bb, func(i int) float64 { return float64(ab[i].Float32()) }},
			{ah, bh, func(i int) float64 { return float64(ah[i].Float32()) }},
		} {
			d, dt, _, err := Bytes(c.dst)
			if err != nil {
				t.Fatal(err)
			}
			s, _, _, _ := Bytes(c.src)
			Reduce(dt, op, d, s)
			for i := range n {
				if got := c.get(i); got != want[i] {
					t.Fatalf("%v %v [%d]: got %v, want %v", dt, op, i, got, want[i])
				}
			}
		}
	}
}

func TestDivide(t *testing.T) {
	f := []float32{3, -6, 9}
	b, dt, _, _ := Bytes(f)
	Divide(dt, b, 3)
	if f[0] != 1 || f[1] != -2 || f[2] != 3 {
		t.Fatalf("float32 divide: %v", f)
	}
	i := []int64{7, -7}
	b, dt, _, _ = Bytes(i)
	Divide(dt, b, 2)
	if i[0] != 3 || i[1] != -3 {
		t.Fatalf("int64 divide: %v", i)
	}
	h := []procgroup.F16{procgroup.F16FromFloat32(5)}
	b, dt, _, _ = Bytes(h)
	Divide(dt, b, 2)
	if h[0].Float32() != 2.5 {
		t.Fatalf("f16 divide: %v", h[0].Float32())
	}
}

func TestBytesRejects(t *testing.T) {
	if _, _, _, err := Bytes([]uint8{1}); err == nil {
		t.Fatal("[]uint8 accepted")
	}
	if _, _, _, err := Bytes(nil); err == nil {
		t.Fatal("nil accepted")
	}
	if b, _, n, err := Bytes([]float32{}); err != nil || len(b) != 0 || n != 0 {
		t.Fatalf("empty: %v %d %v", b, n, err)
	}
}

func TestReduceAllocatesNothing(t *testing.T) {
	a, b := make([]float32, 1024), make([]float32, 1024)
	d, _, _, _ := Bytes(a)
	s, _, _, _ := Bytes(b)
	x, y := make([]procgroup.BF16, 1024), make([]procgroup.BF16, 1024)
	dx, _, _, _ := Bytes(x)
	sx, _, _, _ := Bytes(y)
	if n := testing.AllocsPerRun(50, func() {
		Reduce(procgroup.Float32, procgroup.Sum, d, s)
		Reduce(procgroup.BFloat16, procgroup.Max, dx, sx)
		Divide(procgroup.Float32, d, 3)
	}); n != 0 {
		t.Fatalf("%v allocs per run, want 0", n)
	}
}

func BenchmarkReduceFloat32Sum1MiB(b *testing.B) {
	x, y := make([]float32, 1<<18), make([]float32, 1<<18)
	d, _, _, _ := Bytes(x)
	s, _, _, _ := Bytes(y)
	b.SetBytes(int64(len(d)))
	for b.Loop() {
		Reduce(procgroup.Float32, procgroup.Sum, d, s)
	}
}

func TestWidenNarrow(t *testing.T) {
	for _, dt := range []procgroup.DType{procgroup.BFloat16, procgroup.Float16} {
		vals := []float32{0, 1, -2.5, 0.15625, 1024}
		var src []byte
		if dt == procgroup.BFloat16 {
			b := make([]procgroup.BF16, len(vals))
			for i, v := range vals {
				b[i] = procgroup.BF16FromFloat32(v)
			}
			src, _, _, _ = Bytes(b)
		} else {
			b := make([]procgroup.F16, len(vals))
			for i, v := range vals {
				b[i] = procgroup.F16FromFloat32(v)
			}
			src, _, _, _ = Bytes(b)
		}
		wide := make([]float32, len(vals))
		w, _, _, _ := Bytes(wide)
		Widen(dt, w, src)
		for i, v := range vals {
			if wide[i] != v {
				t.Fatalf("%v widen [%d] = %v, want %v", dt, i, wide[i], v)
			}
		}
		back := Aligned(len(src))
		Narrow(dt, back, w)
		if string(back) != string(src) {
			t.Fatalf("%v narrow: %x, want %x", dt, back, src)
		}
	}
}

// TestSumSIMDMatchesScalar: the AVX2 sums (when the CPU has them) give the same bits as
// the scalar loop, on random data, for lengths around every unroll boundary and with
// unaligned starts; the float32 result is also checked against float64 arithmetic.
func TestSumSIMDMatchesScalar(t *testing.T) {
	if !useAVX2 {
		t.Skip("no AVX2 on this CPU")
	}
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 1000, 4099} {
		for _, off := range []int{0, 1, 3} {
			x32, y32 := make([]float32, n+off), make([]float32, n+off)
			x64, y64 := make([]float64, n+off), make([]float64, n+off)
			for i := range x32 {
				x32[i], y32[i] = rng.Float32()*200-100, rng.Float32()*200-100
				x64[i], y64[i] = rng.NormFloat64()*1e3, rng.NormFloat64()
			}
			s32, s64 := append([]float32(nil), x32...), append([]float64(nil), x64...)
			o32 := append([]float32(nil), x32...)
			Reduce(procgroup.Float32, procgroup.Sum, view(x32[off:]), view(y32[off:]))
			Reduce(procgroup.Float64, procgroup.Sum, view(x64[off:]), view(y64[off:]))
			useAVX2 = false
			Reduce(procgroup.Float32, procgroup.Sum, view(s32[off:]), view(y32[off:]))
			Reduce(procgroup.Float64, procgroup.Sum, view(s64[off:]), view(y64[off:]))
			useAVX2 = true
			for i := range x32 {
				if math.Float32bits(x32[i]) != math.Float32bits(s32[i]) || math.Float64bits(x64[i]) != math.Float64bits(s64[i]) {
					t.Fatalf("n=%d off=%d [%d]: simd %v %v, scalar %v %v", n, off, i, x32[i], x64[i], s32[i], s64[i])
				}
				if want := float32(float64(o32[i]) + float64(y32[i])); i >= off && x32[i] != want {
					t.Fatalf("n=%d [%d]: %v, want %v", n, i, x32[i], want)
				}
			}
		}
	}
}

// TestReduceInto: dst = a op b matches Reduce(a, b) then copy bit for bit, for every type
// and op, on random data salted with NaNs of distinct payloads and signed zeros (where the
// operand order shows), for lengths around the SIMD blocks, with dst aliasing b (the
// exchange's use), aliasing a, or separate.
func TestReduceInto(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	special32 := []float32{float32(math.Copysign(0, -1)), 0, math.Float32frombits(0x7fc00001), math.Float32frombits(0xffc00abc), float32(math.Inf(1))}
	special64 := []float64{math.Copysign(0, -1), 0, math.Float64frombits(0x7ff8000000000001), math.Float64frombits(0xfff8000000000abc), math.Inf(-1)}
	for _, dt := range procgroup.DTypes {
		es := dt.Size()
		for _, op := range procgroup.ReduceOps {
			for _, n := range []int{0, 1, 15, 16, 17, 31, 32, 33, 95, 100, 1000} {
				for _, alias := range []string{"b", "a", "none"} {
					a, b := Aligned(n*es), Aligned(n*es)
					fillRandom(rng, dt, a, special32, special64)
					fillRandom(rng, dt, b, special32, special64)
					want := append([]byte(nil), a...)
					Reduce(dt, op, want, b)
					b0 := append([]byte(nil), b...)
					var dst []byte
					switch alias {
					case "b":
						dst = b
					case "a":
						dst = a
					default:
						dst = Aligned(n * es)
					}
					ReduceInto(dt, op, dst, a, b)
					if !bytes.Equal(dst, want) {
						t.Fatalf("%v %v n=%d dst=%s: differs from Reduce+copy", dt, op, n, alias)
					}
					if alias == "none" && !bytes.Equal(b, b0) {
						t.Fatalf("%v %v n=%d: b modified", dt, op, n)
					}
				}
			}
		}
	}
}

func fillRandom(rng *rand.Rand, dt procgroup.DType, b []byte, s32 []float32, s64 []float64) {
	switch dt {
	case procgroup.Float32:
		for i := range as[float32](b) {
			v := float32(rng.NormFloat64())
			if rng.IntN(8) == 0 {
				v = s32[rng.IntN(len(s32))]
			}
			as[float32](b)[i] = v
		}
	case procgroup.Float64:
		for i := range as[float64](b) {
			v := rng.NormFloat64()
			if rng.IntN(8) == 0 {
				v = s64[rng.IntN(len(s64))]
			}
			as[float64](b)[i] = v
		}
	default:
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
	}
}
