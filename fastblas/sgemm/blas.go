package sgemm

import (
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

// Implementation is gonum's BLAS with Sgemm replaced by this package's: what
// gorgonia.Use takes.
//
//	gorgonia.Use(sgemm.Implementation{})
type Implementation struct{ gonum.Implementation }

// Sgemm is BLAS's SGEMM on row-major matrices. Arguments that gonum rejects are handed
// to gonum, which panics with its usual message.
func (Implementation) Sgemm(tA, tB blas.Transpose, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	if !validGemm(tA, tB, m, n, k, len(a), lda, len(b), ldb, len(c), ldc) {
		gonum.Implementation{}.Sgemm(tA, tB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
		return
	}
	Sgemm(tA != blas.NoTrans, tB != blas.NoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
}

// validGemm reports whether SGEMM's arguments describe matrices that the slices hold.
func validGemm(tA, tB blas.Transpose, m, n, k, na, lda, nb, ldb, nc, ldc int) bool {
	okT := func(t blas.Transpose) bool { return t == blas.NoTrans || t == blas.Trans || t == blas.ConjTrans }
	if !okT(tA) || !okT(tB) || m < 0 || n < 0 || k < 0 {
		return false
	}
	ra, ca := m, k
	if tA != blas.NoTrans {
		ra, ca = k, m
	}
	rb, cb := k, n
	if tB != blas.NoTrans {
		rb, cb = n, k
	}
	if lda < max(1, ca) || ldb < max(1, cb) || ldc < max(1, n) {
		return false
	}
	if m == 0 || n == 0 {
		return true // gonum checks no lengths then
	}
	// holds: a slice of length l has the r×c matrix with leading dimension ld (gonum's
	// formula, which also covers r = 0 or c = 0 when k is 0).
	holds := func(l, r, c, ld int) bool { return l >= (r-1)*ld+c }
	return holds(na, ra, ca, lda) && holds(nb, rb, cb, ldb) && holds(nc, m, n, ldc)
}
