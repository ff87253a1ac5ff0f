//go:build amd64 && !purego

package kernels

import "golang.org/x/sys/cpu"

// useAVX2 selects the AVX2 loops for float32 and float64 sums (the hot loop of every
// gradient all-reduce). vaddps/vaddpd round exactly like the scalar adds, so results are
// bit-identical either way. Tests switch it off to compare.
var useAVX2 = cpu.X86.HasAVX2

//go:noescape
func addF32AVX2(dst, src *float32, n int)

//go:noescape
func addF64AVX2(dst, src *float64, n int)

// addF32 adds a prefix of s into d with AVX2 and returns its length (0 without AVX2).
// len(s) ≥ len(d).
func addF32(d, s []float32) int {
	n := len(d) &^ 31
	if !useAVX2 || n == 0 {
		return 0
	}
	_ = s[n-1]
	addF32AVX2(&d[0], &s[0], n)
	return n
}

func addF64(d, s []float64) int {
	n := len(d) &^ 15
	if !useAVX2 || n == 0 {
		return 0
	}
	_ = s[n-1]
	addF64AVX2(&d[0], &s[0], n)
	return n
}

//go:noescape
func addF32AVX2To(dst, a, b *float32, n int)

//go:noescape
func addF64AVX2To(dst, a, b *float64, n int)

// addF32To sets a prefix of d to a + b with AVX2 and returns its length (0 without AVX2).
func addF32To(d, a, b []float32) int {
	n := len(d) &^ 31
	if !useAVX2 || n == 0 {
		return 0
	}
	_, _ = a[n-1], b[n-1]
	addF32AVX2To(&d[0], &a[0], &b[0], n)
	return n
}

func addF64To(d, a, b []float64) int {
	n := len(d) &^ 15
	if !useAVX2 || n == 0 {
		return 0
	}
	_, _ = a[n-1], b[n-1]
	addF64AVX2To(&d[0], &a[0], &b[0], n)
	return n
}
