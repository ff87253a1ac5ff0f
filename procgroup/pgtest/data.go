package pgtest

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"

	"github.com/goddp/goddp/procgroup"
)

// This file holds the suite's reference: buffers are read back as float64 (floating types)
// or int64 (integer types) and reduced there, independently of any backend's arithmetic.

func isInt(dt procgroup.DType) bool { return dt == procgroup.Int32 || dt == procgroup.Int64 }

// setF stores v (rounded to the buffer's type) at b[i].
func setF(b any, i int, v float64) {
	switch b := b.(type) {
	case []float32:
		b[i] = float32(v)
	case []float64:
		b[i] = v
	case []procgroup.BF16:
		b[i] = procgroup.BF16FromFloat32(float32(v))
	case []procgroup.F16:
		b[i] = procgroup.F16FromFloat32(float32(v))
	default:
		panic(fmt.Sprintf("pgtest: setF on %T", b))
	}
}

func setI(b any, i int, v int64) {
	switch b := b.(type) {
	case []int32:
		b[i] = int32(v)
	case []int64:
		b[i] = v
	default:
		panic(fmt.Sprintf("pgtest: setI on %T", b))
	}
}

// floats reads a floating buffer exactly as float64s.
func floats(b any) []float64 {
	f := make([]float64, 0, bufLen(b))
	switch b := b.(type) {
	case []float32:
		for _, v := range b {
			f = append(f, float64(v))
		}
	case []float64:
		f = append(f, b...)
	case []procgroup.BF16:
		for _, v := range b {
			f = append(f, float64(v.Float32()))
		}
	case []procgroup.F16:
		for _, v := range b {
			f = append(f, float64(v.Float32()))
		}
	default:
		panic(fmt.Sprintf("pgtest: floats of %T", b))
	}
	return f
}

// ints reads an integer buffer as int64s.
func ints(b any) []int64 {
	r := make([]int64, 0, bufLen(b))
	switch b := b.(type) {
	case []int32:
		for _, v := range b {
			r = append(r, int64(v))
		}
	case []int64:
		r = append(r, b...)
	default:
		panic(fmt.Sprintf("pgtest: ints of %T", b))
	}
	return r
}

// bits reads any buffer as its elements' raw bits, for exact comparison of moved data.
func bits(b any) []uint64 {
	r := make([]uint64, 0, bufLen(b))
	switch b := b.(type) {
	case []float32:
		for _, v := range b {
			r = append(r, uint64(math.Float32bits(v)))
		}
	case []float64:
		for _, v := range b {
			r = append(r, math.Float64bits(v))
		}
	case []int32:
		for _, v := range b {
			r = append(r, uint64(uint32(v)))
		}
	case []int64:
		for _, v := range b {
			r = append(r, uint64(v))
		}
	case []procgroup.BF16:
		for _, v := range b {
			r = append(r, uint64(v))
		}
	case []procgroup.F16:
		for _, v := range b {
			r = append(r, uint64(v))
		}
	default:
		panic(fmt.Sprintf("pgtest: bits of %T", b))
	}
	return r
}

// fill returns a buffer of n random elements of type dt suited to op (0: data that is only
// moved). Values keep every reduction exact or well conditioned: Prod gets factors near 1
// (or small integers), Sum and Avg values of one sign-mixed magnitude, Min and Max a wide
// range. The buffer is never all zero.
func fill(rng *rand.Rand, dt procgroup.DType, op procgroup.ReduceOp, n int) any {
	b := procgroup.NewBuffer(dt, n)
	nonZero := false
	for i := range n {
		if isInt(dt) {
			var v int64
			switch op {
			case procgroup.Sum, procgroup.Avg:
				v = rng.Int64N(2001) - 1000
			case procgroup.Prod:
				v = []int64{-3, -2, -1, 1, 2, 3}[rng.IntN(6)]
			default: // Min, Max, moved data: the type's whole range
				v = int64(rng.Uint64())
				if dt == procgroup.Int32 {
					v = int64(int32(v))
				}
			}
			setI(b, i, v)
			nonZero = nonZero || v != 0
			continue
		}
		var v float64
		switch op {
		case procgroup.Sum, procgroup.Avg:
			v = 2*rng.Float64() - 1
		case procgroup.Prod:
			v = 0.5 + 1.5*rng.Float64()
			if rng.IntN(2) == 0 {
				v = -v
			}
		default:
			v = 200*rng.Float64() - 100
		}
		setF(b, i, v)
		nonZero = nonZero || v != 0
	}
	if n > 0 && !nonZero {
		if isInt(dt) {
			setI(b, 0, 1)
		} else {
			setF(b, 0, 1)
		}
	}
	return b
}

// bufLen is the length of a host buffer.
func bufLen(b any) int {
	_, n, err := procgroup.DTypeOf(b)
	if err != nil {
		panic(err)
	}
	return n
}

// garbage returns a buffer of n elements of type dt, all set to one non-zero pattern, for
// outputs that a collective must overwrite.
func garbage(dt procgroup.DType, n int) any {
	b := procgroup.NewBuffer(dt, n)
	switch b := b.(type) {
	case []float32:
		for i := range b {
			b[i] = -12345.5
		}
	case []float64:
		for i := range b {
			b[i] = -12345.5
		}
	case []int32:
		for i := range b {
			b[i] = -12345
		}
	case []int64:
		for i := range b {
			b[i] = -12345
		}
	case []procgroup.BF16:
		for i := range b {
			b[i] = 0xc640 // -12288
		}
	case []procgroup.F16:
		for i := range b {
			b[i] = 0xf1c2 // about -12304
		}
	}
	return b
}

// roundoff returns the unit roundoff of the arithmetic a backend reduces dt in (float32 for
// the 16-bit types) and of dt's final rounding (zero when dt is reduced in its own type),
// and the absolute error allowed near zero (half-precision subnormals).
func roundoff(dt procgroup.DType) (acc, final, floor float64) {
	switch dt {
	case procgroup.Float32:
		return 0x1p-24, 0, 0
	case procgroup.Float64:
		return 0x1p-53, 0, 0
	case procgroup.BFloat16:
		return 0x1p-24, 0x1p-8, 0
	case procgroup.Float16:
		return 0x1p-24, 0x1p-11, 0x1p-24
	}
	return 0, 0, 0
}

// refFloat reduces ins element-wise in float64 and gives each element's tolerance. A
// backend may combine the ranks in any order: each step of the reduction may round, in the
// arithmetic of the reduction (u = 2⁻²⁴ for float32, bfloat16 and float16, 2⁻⁵³ for float64),
// which allows 2(n+1)·u·Σ|x| for Sum (divided by n for Avg) and 2(n+1)·u·|result| for Prod.
// BFloat16 and Float16 are reduced in float32 and rounded once to their type at the end,
// which adds one unit in the last place: 2·u₁₆·|result|. Min and Max are exact.
func refFloat(dt procgroup.DType, op procgroup.ReduceOp, ins [][]float64) (want, tol []float64) {
	n := float64(len(ins))
	uAcc, uFin, floor := roundoff(dt)
	want = make([]float64, len(ins[0]))
	tol = make([]float64, len(ins[0]))
	for i := range want {
		acc, abs := ins[0][i], math.Abs(ins[0][i])
		for _, in := range ins[1:] {
			v := in[i]
			switch op {
			case procgroup.Sum, procgroup.Avg:
				acc += v
			case procgroup.Prod:
				acc *= v
			case procgroup.Min:
				acc = min(acc, v)
			case procgroup.Max:
				acc = max(acc, v)
			}
			abs += math.Abs(v)
		}
		switch op {
		case procgroup.Sum:
			tol[i] = 2*(n+1)*uAcc*abs + 2*uFin*math.Abs(acc) + floor
		case procgroup.Avg:
			acc /= n
			tol[i] = 2*(n+1)*uAcc*abs/n + 2*uFin*math.Abs(acc) + floor
		case procgroup.Prod:
			tol[i] = (2*(n+1)*uAcc+2*uFin)*math.Abs(acc) + floor
		}
		want[i] = acc
	}
	return want, tol
}

// refInt reduces ins element-wise in int64; the suite's data keep Sum and Prod far from
// overflow, and Avg truncates toward zero.
func refInt(op procgroup.ReduceOp, ins [][]int64) []int64 {
	want := make([]int64, len(ins[0]))
	for i := range want {
		acc := ins[0][i]
		for _, in := range ins[1:] {
			switch op {
			case procgroup.Sum, procgroup.Avg:
				acc += in[i]
			case procgroup.Prod:
				acc *= in[i]
			case procgroup.Min:
				acc = min(acc, in[i])
			case procgroup.Max:
				acc = max(acc, in[i])
			}
		}
		if op == procgroup.Avg {
			acc /= int64(len(ins))
		}
		want[i] = acc
	}
	return want
}

// diffs collects the first few element mismatches of a comparison.
type diffs struct {
	n     int
	lines []string
}

func (d *diffs) add(format string, args ...any) {
	d.n++
	if len(d.lines) < 4 {
		d.lines = append(d.lines, fmt.Sprintf(format, args...))
	}
}

func (d *diffs) err() error {
	if d.n == 0 {
		return nil
	}
	return fmt.Errorf("%d wrong elements: %s", d.n, strings.Join(d.lines, "; "))
}

// checkReduced compares got, a reduced buffer, with the reference of the same elements.
func checkReduced(d *diffs, rank int, got any, wantF, tolF []float64, wantI []int64, off int) {
	if wantI != nil {
		for i, g := range ints(got) {
			if w := wantI[off+i]; g != w {
				d.add("rank %d [%d]: got %d, want %d", rank, i, g, w)
			}
		}
		return
	}
	for i, g := range floats(got) {
		w, tol := wantF[off+i], tolF[off+i]
		if !(math.Abs(g-w) <= tol) {
			d.add("rank %d [%d]: got %g, want %g ± %.3g", rank, i, g, w, tol)
		}
	}
}

// checkBits compares got with want exactly.
func checkBits(d *diffs, rank int, got any, want []uint64) {
	for i, g := range bits(got) {
		if g != want[i] {
			d.add("rank %d [%d]: got bits %#x, want %#x", rank, i, g, want[i])
		}
	}
}
