package sgemm

import (
	"math/rand/v2"
	"syscall"
	"testing"
	"unsafe"

	"gonum.org/v1/gonum/blas/gonum"
)

// guarded returns n float32s that end right before an inaccessible page (atEnd) or start
// right after one, so that any read or write past the slice, by Go or by the assembly,
// faults. The mapping is removed at the end of the test.
func guarded(t *testing.T, n int, atEnd bool) []float32 {
	const page = 4096
	pages := (4*n+page-1)/page + 2
	mem, err := syscall.Mmap(-1, 0, pages*page, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Munmap(mem) })
	if err := syscall.Mprotect(mem[:page], syscall.PROT_NONE); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mprotect(mem[(pages-1)*page:], syscall.PROT_NONE); err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		return nil
	}
	off := page
	if atEnd {
		off = (pages-1)*page - 4*n
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&mem[off])), n)
}

// TestGuardPages: every kernel, on operands of exactly the length BLAS requires, fenced by
// inaccessible pages, stays inside them; small integers make the results exact, so they
// must equal gonum's bit for bit.
func TestGuardPages(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	dims := []int{1, 2, 3, 5, 7, 11, 12, 13, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 97, 257}
	for _, kern := range kernels() {
		t.Run(kern.name, func(t *testing.T) {
			for it := 0; it < 400; it++ {
				tA, tB := rng.IntN(2) == 1, rng.IntN(2) == 1
				m, n, k := dims[rng.IntN(len(dims))], dims[rng.IntN(len(dims))], dims[rng.IntN(len(dims))]
				if it%7 == 0 {
					k = 0
				}
				ra, ca, rb, cb := m, k, k, n
				if tA {
					ra, ca = k, m
				}
				if tB {
					rb, cb = n, k
				}
				lda, ldb, ldc := max(1, ca+rng.IntN(3)), max(1, cb+rng.IntN(3)), max(1, n+rng.IntN(3))
				minLen := func(r, c, ld int) int { return max(0, (r-1)*ld+c) }
				atEnd := it%2 == 0
				a, b, c := guarded(t, minLen(ra, ca, lda), atEnd), guarded(t, minLen(rb, cb, ldb), atEnd), guarded(t, minLen(m, n, ldc), atEnd)
				for _, s := range [][]float32{a, b, c} {
					for i := range s {
						s[i] = float32(rng.IntN(9) - 4)
					}
				}
				want := append([]float32(nil), c...)
				alpha, beta := []float32{1, 2, 0}[rng.IntN(3)], []float32{0, 1, -1}[rng.IntN(3)]
				gonum.Implementation{}.Sgemm(tr(tA), tr(tB), m, n, k, alpha, a, lda, b, ldb, beta, want, ldc)
				gemm(kern, tA, tB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
				for i := range c {
					if c[i] != want[i] {
						t.Fatalf("tA=%t tB=%t m=%d n=%d k=%d ld=%d,%d,%d: c[%d] = %g, gonum %g", tA, tB, m, n, k, lda, ldb, ldc, i, c[i], want[i])
					}
				}
			}
		})
	}
}
