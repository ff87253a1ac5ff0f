// Package lowrank holds the loops of PowerSGD's host path (reducer Note [PowerSGD
// kernels]): products of a gradient row with two columns of a float64 factor, and the
// rank-two updates that subtract or rebuild an approximation. Each works on float32 or
// float64 rows, with products and sums in float64.
//
// On amd64 with AVX2, float32 rows run assembly loops (lowrank_amd64.s) for the longest
// prefix that is a multiple of 8 elements. Their results are bit for bit those of the Go
// loops here, whatever the CPU, NaN payloads aside (where both operands are NaN, which
// one's payload survives depends on operand order, which neither Go nor the hardware fixes
// for a commutative operation; a NaN stays a NaN): the same products and sums, rounded
// the same way, in the same order (a dot product keeps eight partial sums, one per element index modulo 8, as
// the vector loop does, and adds them up in one fixed order), with no fused multiply-add
// (the explicit float64 conversions keep the compiler from fusing). The ranks of a job
// must compute the same bits from the same all-reduced factors, whatever machines they
// run on. Build tag purego turns the assembly off.
package lowrank

import "unsafe"

// Float is the element type of a row.
type Float interface{ float32 | float64 }

// f32 views x as a []float32 when T is float32 (ok), for the assembly loops.
func f32[T Float](x []T) (v []float32, ok bool) {
	var z T
	if unsafe.Sizeof(z) != 4 || len(x) == 0 {
		return nil, false
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(x))), len(x)), true
}

// Dot2 returns x·y0 and x·y1. y0 and y1 are at least as long as x.
func Dot2[T Float](x []T, y0, y1 []float64) (float64, float64) {
	var s0, s1 [8]float64
	k := 0
	if v, ok := f32(x); ok {
		k = dot2F32(v, y0, y1, &s0, &s1)
	}
	y0, y1 = y0[:len(x)], y1[:len(x)]
	for j := k; j < len(x); j++ {
		u := float64(x[j])
		s0[j&7] += float64(u * y0[j])
		s1[j&7] += float64(u * y1[j])
	}
	return sum8(&s0), sum8(&s1)
}

// sum8 adds up a dot product's partial sums in the one order both loops use.
func sum8(s *[8]float64) float64 {
	return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]))
}

// Axpy2 sets x += a0·y0 + a1·y1, in float64, rounded to x's type once. y0 and y1 are at
// least as long as x.
func Axpy2[T, Y Float](x []T, a0 float64, y0 []Y, a1 float64, y1 []Y) {
	k := 0
	if v, ok := f32(x); ok {
		k = axpy2F32(v, a0, y0, a1, y1)
	}
	y0, y1 = y0[:len(x)], y1[:len(x)]
	for j := k; j < len(x); j++ {
		t := float64(a0*float64(y0[j])) + float64(a1*float64(y1[j]))
		x[j] = T(float64(x[j]) + t)
	}
}

// AxpyTo2 sets s0 += a0·x and s1 += a1·x. s0 and s1 are at least as long as x; they may
// be the same slice (with a1 = 0, a one-column update).
func AxpyTo2[T Float](s0 []float64, a0 float64, s1 []float64, a1 float64, x []T) {
	k := 0
	if v, ok := f32(x); ok {
		k = axpyTo2F32(s0, a0, s1, a1, v)
	}
	s0, s1 = s0[:len(x)], s1[:len(x)]
	for j := k; j < len(x); j++ {
		u := float64(x[j])
		s0[j] += float64(a0 * u)
		s1[j] += float64(a1 * u)
	}
}
