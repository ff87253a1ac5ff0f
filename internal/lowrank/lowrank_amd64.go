//go:build amd64 && !purego

package lowrank

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

// useAVX2 selects the assembly loops; tests switch it off to compare.
var useAVX2 = cpu.X86.HasAVX2

//go:noescape
func dot2AVX2(x *float32, y0, y1 *float64, n int, s0, s1 *[8]float64)

//go:noescape
func axpy2AVX2(x *float32, a0 float64, y0 *float64, a1 float64, y1 *float64, n int)

//go:noescape
func axpy2F32AVX2(x *float32, a0 float64, y0 *float32, a1 float64, y1 *float32, n int)

//go:noescape
func axpyTo2AVX2(s0 *float64, a0 float64, s1 *float64, a1 float64, x *float32, n int)

// Each returns how many leading elements it did: a multiple of 8, 0 without AVX2.

func dot2F32(x []float32, y0, y1 []float64, s0, s1 *[8]float64) int {
	n := len(x) &^ 7
	if !useAVX2 || n == 0 {
		return 0
	}
	_, _ = y0[n-1], y1[n-1]
	dot2AVX2(&x[0], &y0[0], &y1[0], n, s0, s1)
	return n
}

func axpy2F32[Y Float](x []float32, a0 float64, y0 []Y, a1 float64, y1 []Y) int {
	n := len(x) &^ 7
	if !useAVX2 || n == 0 {
		return 0
	}
	_, _ = y0[n-1], y1[n-1]
	var z Y
	if unsafe.Sizeof(z) == 4 {
		axpy2F32AVX2(&x[0], a0, (*float32)(unsafe.Pointer(&y0[0])), a1, (*float32)(unsafe.Pointer(&y1[0])), n)
	} else {
		axpy2AVX2(&x[0], a0, (*float64)(unsafe.Pointer(&y0[0])), a1, (*float64)(unsafe.Pointer(&y1[0])), n)
	}
	return n
}

func axpyTo2F32(s0 []float64, a0 float64, s1 []float64, a1 float64, x []float32) int {
	n := len(x) &^ 7
	if !useAVX2 || n == 0 {
		return 0
	}
	_, _ = s0[n-1], s1[n-1]
	axpyTo2AVX2(&s0[0], a0, &s1[0], a1, &x[0], n)
	return n
}
