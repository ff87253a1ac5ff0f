package reducer

import (
	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/internal/lowrank"
)

// Note [PowerSGD kernels]: the host path walks a compressed matrix row by row, and does
// all of a row's work while the row is in the first-level cache: the gradient's addition
// to the error, the products with the factor, the subtraction of the approximation. The
// error and the gradient are read from memory once per step, and the error written once.
// The factors' columns go two at a time (a last odd column is paired with itself, with a
// coefficient of zero); products and sums are float64, as the factors are, and an element
// written to the bucket's type is rounded once per pair of columns. The loops are package
// lowrank's: AVX2 on float32 rows where the CPU has it, the same bits everywhere.

// leftStep is an even step's local part, with Q̂ in mt.q: row by row, e = grad + e (M'),
// out = M'·Q̂ (column-major, as P), then e = M' − out·Q̂ᵀ, with out as sent (rounded to
// T). It returns len(out).
func leftStep[T float32 | float64](mt *psgdMat, grad, e, out []T) int {
	n, m, r, q := mt.n, mt.m, mt.r, mt.q
	col := func(c int) []float64 { return q[min(c, r-1)*m : min(c, r-1)*m+m] }
	for i := 0; i < n; i++ {
		row := e[i*m : i*m+m]
		kernels.Add(row, grad[i*m:i*m+m])
		for c := 0; c < r; c += 2 {
			s0, s1 := lowrank.Dot2(row, col(c), col(c+1))
			out[c*n+i] = T(s0)
			if c+1 < r {
				out[(c+1)*n+i] = T(s1)
			}
		}
		for c := 0; c < r; c += 2 {
			lowrank.Axpy2(row, -float64(out[c*n+i]), col(c), -coef(out, (c+1)*n+i, c+1 < r), col(c+1))
		}
	}
	return n * r
}

// rightStep is an odd step's local part, with P̂ in mt.p: row by row, e = grad + e (M')
// and its share of out = M'ᵀ·P̂ (column-major, as Q, summed in mt.acc); then
// e = M' − P̂·outᵀ, with out as sent. It returns len(out).
func rightStep[T float32 | float64](mt *psgdMat, grad, e, out []T) int {
	n, m, r, p, acc := mt.n, mt.m, mt.r, mt.p, mt.acc
	sum := func(c int) []float64 { return acc[min(c, r-1)*m : min(c, r-1)*m+m] }
	col := func(c int) []T { return out[min(c, r-1)*m : min(c, r-1)*m+m] }
	clear(acc)
	for i := 0; i < n; i++ {
		row := e[i*m : i*m+m]
		kernels.Add(row, grad[i*m:i*m+m])
		for c := 0; c < r; c += 2 {
			lowrank.AxpyTo2(sum(c), p[c*n+i], sum(c+1), coef(p, (c+1)*n+i, c+1 < r), row)
		}
	}
	for j, v := range acc {
		out[j] = T(v)
	}
	for i := 0; i < n; i++ {
		row := e[i*m : i*m+m]
		for c := 0; c < r; c += 2 {
			lowrank.Axpy2(row, -p[c*n+i], col(c), -coef(p, (c+1)*n+i, c+1 < r), col(c+1))
		}
	}
	return m * r
}

// reconstruct writes the result P·Qᵀ (n×m, row-major) into out.
func reconstruct[T float32 | float64](out []T, p, q []float64, n, m, r int) {
	col := func(c int) []float64 { return q[min(c, r-1)*m : min(c, r-1)*m+m] }
	for i := 0; i < n; i++ {
		row := out[i*m : i*m+m]
		clear(row)
		for c := 0; c < r; c += 2 {
			lowrank.Axpy2(row, p[c*n+i], col(c), coef(p, (c+1)*n+i, c+1 < r), col(c+1))
		}
	}
}

// coef is the coefficient of a pair's second column: f[k], or 0 where the pair has one
// column (ok is false).
func coef[T float32 | float64](f []T, k int, ok bool) float64 {
	if !ok {
		return 0
	}
	return float64(f[k])
}

// dot and axpy1 are orthonormalize's loops, on float64 columns: x·y, and x += a·y.

func dot(x, y []float64) float64 {
	y = y[:len(x)]
	var s0, s1, s2, s3 float64
	j := 0
	for ; j+4 <= len(x); j += 4 {
		s0 += float64(x[j] * y[j])
		s1 += float64(x[j+1] * y[j+1])
		s2 += float64(x[j+2] * y[j+2])
		s3 += float64(x[j+3] * y[j+3])
	}
	for ; j < len(x); j++ {
		s0 += float64(x[j] * y[j])
	}
	return (s0 + s1) + (s2 + s3)
}

func axpy1(x []float64, a float64, y []float64) {
	y = y[:len(x)]
	for j := range x {
		x[j] += float64(a * y[j])
	}
}
