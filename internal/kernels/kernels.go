// Package kernels holds the typed element-wise loops the CPU backends run on raw byte views
// of host buffers: reductions (dst = dst op src), division for Avg, and the unsafe views that
// turn a typed slice into bytes and back.
//
// Every function switches once on the element type and the op, then runs a plain typed loop:
// no per-element interface call and no allocation. bfloat16 and float16 are widened to
// float32, combined, and rounded back. On amd64 with AVX2, float32 and float64 sums run an
// assembly loop (add_amd64.s) that rounds exactly like the scalar one; build tag purego
// turns it off.
//
// Byte slices handed to the typed views must be aligned for the element type; views of
// typed slices and of buffers from Aligned are.
package kernels

import (
	"fmt"
	"unsafe"

	"github.com/goddp/goddp/procgroup"
)

// Bytes returns the bytes behind a host buffer ([]float32, []float64, []int32, []int64,
// []procgroup.BF16 or []procgroup.F16), its element type and its length in elements. The
// byte slice aliases buf.
func Bytes(buf any) ([]byte, procgroup.DType, int, error) {
	switch b := buf.(type) {
	case []float32:
		return view(b), procgroup.Float32, len(b), nil
	case []float64:
		return view(b), procgroup.Float64, len(b), nil
	case []int32:
		return view(b), procgroup.Int32, len(b), nil
	case []int64:
		return view(b), procgroup.Int64, len(b), nil
	case []procgroup.BF16:
		return view(b), procgroup.BFloat16, len(b), nil
	case []procgroup.F16:
		return view(b), procgroup.Float16, len(b), nil
	case nil:
		return nil, 0, 0, fmt.Errorf("%w: nil buffer", procgroup.ErrInvalidArgument)
	}
	return nil, 0, 0, fmt.Errorf("%w: unsupported buffer type %T", procgroup.ErrInvalidArgument, buf)
}

func view[T any](s []T) []byte {
	if len(s) == 0 {
		return []byte{}
	}
	var z T
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), len(s)*int(unsafe.Sizeof(z)))
}

// CheckSlot is procgroup.CheckSlot for the byte views of two host buffers: nil where they
// are apart or part is rank's slot of whole, ErrInvalidArgument for any other overlap.
func CheckSlot(whole, part []byte, rank int) error {
	return procgroup.CheckSlot(addr(whole), len(whole), addr(part), len(part), rank)
}

func addr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// as views b as a []T; len(b) must be a multiple of T's size and b aligned for T.
func as[T any](b []byte) []T {
	var z T
	n := len(b) / int(unsafe.Sizeof(z))
	if n == 0 {
		return nil
	}
	return unsafe.Slice((*T)(unsafe.Pointer(&b[0])), n)
}

// Typed returns b viewed as a host buffer of dt ([]float32, ..., []procgroup.F16): the
// inverse of Bytes. b must be aligned for dt and a multiple of its size. It panics on an
// unknown dt (the caller validated it).
func Typed(dt procgroup.DType, b []byte) any {
	switch dt {
	case procgroup.Float32:
		return as[float32](b)
	case procgroup.Float64:
		return as[float64](b)
	case procgroup.Int32:
		return as[int32](b)
	case procgroup.Int64:
		return as[int64](b)
	case procgroup.BFloat16:
		return as[procgroup.BF16](b)
	case procgroup.Float16:
		return as[procgroup.F16](b)
	}
	panic(fmt.Sprintf("kernels: Typed of unknown %v", dt))
}

// Aligned returns a zeroed byte slice of length n whose start is 8-byte aligned, so that it
// can be viewed as any element type.
func Aligned(n int) []byte {
	if n == 0 {
		return []byte{}
	}
	w := make([]uint64, (n+7)/8)
	return unsafe.Slice((*byte)(unsafe.Pointer(&w[0])), n)
}

// Reduce sets dst[i] = dst[i] op src[i] for every element. Avg reduces like Sum (the caller
// divides once at the end with Divide). len(src) must equal len(dst). It panics on an
// unknown element type or op (the caller validated both).
func Reduce(dt procgroup.DType, op procgroup.ReduceOp, dst, src []byte) {
	if len(dst) != len(src) {
		panic(fmt.Sprintf("kernels: Reduce of %d bytes with %d", len(dst), len(src)))
	}
	if op == procgroup.Avg {
		op = procgroup.Sum
	}
	switch dt {
	case procgroup.Float32:
		d, s := as[float32](dst), as[float32](src)
		if op == procgroup.Sum {
			k := addF32(d, s)
			d, s = d[k:], s[k:]
		}
		reduceNum(op, d, s)
	case procgroup.Float64:
		d, s := as[float64](dst), as[float64](src)
		if op == procgroup.Sum {
			k := addF64(d, s)
			d, s = d[k:], s[k:]
		}
		reduceNum(op, d, s)
	case procgroup.Int32:
		reduceNum(op, as[int32](dst), as[int32](src))
	case procgroup.Int64:
		reduceNum(op, as[int64](dst), as[int64](src))
	case procgroup.BFloat16:
		reduceBF16(op, as[procgroup.BF16](dst), as[procgroup.BF16](src))
	case procgroup.Float16:
		reduceF16(op, as[procgroup.F16](dst), as[procgroup.F16](src))
	default:
		panic(fmt.Sprintf("kernels: Reduce of %v", dt))
	}
}

// Add sets d[i] += s[i] for every element of d, as Reduce's sum does (the AVX2 loop where
// there is one): for callers that hold typed slices. len(s) ≥ len(d).
func Add[T float32 | float64](d, s []T) {
	s = s[:len(d)]
	k := 0
	switch d := any(d).(type) {
	case []float32:
		k = addF32(d, any(s).([]float32))
	case []float64:
		k = addF64(d, any(s).([]float64))
	}
	reduceNum(procgroup.Sum, d[k:], s[k:])
}

// ReduceInto sets dst = a op b for every element, a's operand first: bit for bit what
// Reduce(dt, op, a, b) followed by copy(dst, a) gives (NaN payloads included), which is
// also how it works where no faster loop applies, so a may be overwritten. dst may alias
// a or b; the three lengths must be equal. It saves the copy for float32 and float64 sums
// on AVX2 (the two-rank exchange's second rank, whose own values are the right operand).
func ReduceInto(dt procgroup.DType, op procgroup.ReduceOp, dst, a, b []byte) {
	if len(dst) != len(a) || len(a) != len(b) {
		panic(fmt.Sprintf("kernels: ReduceInto of %d bytes with %d and %d", len(dst), len(a), len(b)))
	}
	k := 0 // bytes done
	if op == procgroup.Sum || op == procgroup.Avg {
		switch dt {
		case procgroup.Float32:
			k = 4 * addF32To(as[float32](dst), as[float32](a), as[float32](b))
		case procgroup.Float64:
			k = 8 * addF64To(as[float64](dst), as[float64](a), as[float64](b))
		}
	}
	if k < len(dst) {
		Reduce(dt, op, a[k:], b[k:])
		copy(dst[k:], a[k:])
	}
}

type number interface {
	~float32 | ~float64 | ~int32 | ~int64
}

// reduceNum is instantiated per element type (GC shape stenciling gives each of these
// distinct shapes its own machine code), one loop per op.
func reduceNum[T number](op procgroup.ReduceOp, d, s []T) {
	s = s[:len(d)]
	switch op {
	case procgroup.Sum:
		// Unrolled by 8: the compiler does not vectorize, and this halves the loop
		// overhead of the hottest loop of all-reduce.
		i := 0
		for ; i+8 <= len(d); i += 8 {
			dd, ss := d[i:i+8:i+8], s[i:i+8:i+8]
			dd[0] += ss[0]
			dd[1] += ss[1]
			dd[2] += ss[2]
			dd[3] += ss[3]
			dd[4] += ss[4]
			dd[5] += ss[5]
			dd[6] += ss[6]
			dd[7] += ss[7]
		}
		for ; i < len(d); i++ {
			d[i] += s[i]
		}
	case procgroup.Prod:
		for i := range d {
			d[i] *= s[i]
		}
	case procgroup.Min:
		for i := range d {
			if s[i] < d[i] {
				d[i] = s[i]
			}
		}
	case procgroup.Max:
		for i := range d {
			if s[i] > d[i] {
				d[i] = s[i]
			}
		}
	default:
		panic(fmt.Sprintf("kernels: Reduce with %v", op))
	}
}

func combine32(op procgroup.ReduceOp, a, b float32) float32 {
	switch op {
	case procgroup.Sum:
		return a + b
	case procgroup.Prod:
		return a * b
	case procgroup.Min:
		if b < a {
			return b
		}
		return a
	default: // Max
		if b > a {
			return b
		}
		return a
	}
}

func checkOp(op procgroup.ReduceOp) {
	switch op {
	case procgroup.Sum, procgroup.Prod, procgroup.Min, procgroup.Max:
	default:
		panic(fmt.Sprintf("kernels: Reduce with %v", op))
	}
}

func reduceBF16(op procgroup.ReduceOp, d, s []procgroup.BF16) {
	checkOp(op)
	s = s[:len(d)]
	if op == procgroup.Sum {
		for i := range d {
			d[i] = procgroup.BF16FromFloat32(d[i].Float32() + s[i].Float32())
		}
		return
	}
	for i := range d {
		d[i] = procgroup.BF16FromFloat32(combine32(op, d[i].Float32(), s[i].Float32()))
	}
}

func reduceF16(op procgroup.ReduceOp, d, s []procgroup.F16) {
	checkOp(op)
	s = s[:len(d)]
	if op == procgroup.Sum {
		for i := range d {
			d[i] = procgroup.F16FromFloat32(d[i].Float32() + s[i].Float32())
		}
		return
	}
	for i := range d {
		d[i] = procgroup.F16FromFloat32(combine32(op, d[i].Float32(), s[i].Float32()))
	}
}

// Divide divides every element of buf by n (integers truncate toward zero), for Avg.
func Divide(dt procgroup.DType, buf []byte, n int) {
	if n == 1 {
		return
	}
	switch dt {
	case procgroup.Float32:
		d, f := as[float32](buf), float32(n)
		for i := range d {
			d[i] /= f
		}
	case procgroup.Float64:
		d, f := as[float64](buf), float64(n)
		for i := range d {
			d[i] /= f
		}
	case procgroup.Int32:
		d, k := as[int32](buf), int32(n)
		for i := range d {
			d[i] /= k
		}
	case procgroup.Int64:
		d, k := as[int64](buf), int64(n)
		for i := range d {
			d[i] /= k
		}
	case procgroup.BFloat16:
		d, f := as[procgroup.BF16](buf), float32(n)
		for i := range d {
			d[i] = procgroup.BF16FromFloat32(d[i].Float32() / f)
		}
	case procgroup.Float16:
		d, f := as[procgroup.F16](buf), float32(n)
		for i := range d {
			d[i] = procgroup.F16FromFloat32(d[i].Float32() / f)
		}
	default:
		panic(fmt.Sprintf("kernels: Divide of %v", dt))
	}
}

// Widen converts the bfloat16 or float16 elements of src into the float32 elements of dst
// (len(dst) = 2·len(src) bytes).
func Widen(dt procgroup.DType, dst, src []byte) {
	d := as[float32](dst)
	switch dt {
	case procgroup.BFloat16:
		s := as[procgroup.BF16](src)
		d = d[:len(s)]
		for i := range s {
			d[i] = s[i].Float32()
		}
	case procgroup.Float16:
		s := as[procgroup.F16](src)
		d = d[:len(s)]
		for i := range s {
			d[i] = s[i].Float32()
		}
	default:
		panic(fmt.Sprintf("kernels: Widen of %v", dt))
	}
}

// Narrow rounds the float32 elements of src into the bfloat16 or float16 elements of dst
// (len(src) = 2·len(dst) bytes).
func Narrow(dt procgroup.DType, dst, src []byte) {
	s := as[float32](src)
	switch dt {
	case procgroup.BFloat16:
		d := as[procgroup.BF16](dst)
		s = s[:len(d)]
		for i := range d {
			d[i] = procgroup.BF16FromFloat32(s[i])
		}
	case procgroup.Float16:
		d := as[procgroup.F16](dst)
		s = s[:len(d)]
		for i := range d {
			d[i] = procgroup.F16FromFloat32(s[i])
		}
	default:
		panic(fmt.Sprintf("kernels: Narrow of %v", dt))
	}
}
