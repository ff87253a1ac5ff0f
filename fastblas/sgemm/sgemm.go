// Package sgemm is a float32 matrix product in Go assembly, without cgo:
// C = alpha·op(A)·op(B) + beta·C on row-major matrices, as BLAS's SGEMM.
//
// It is built the Goto/BLIS way. op(B) is packed, kc rows by nc columns at a time,
// into micro-panels nr columns wide, k-major. A micro-kernel then computes each mr×nr
// tile of C from registers, as a rank-kc update, and stores or adds it. op(A) is read
// in place by the kernels, in either layout (A or Aᵀ), so it is never packed; the last
// rows, when m is not a multiple of mr, go to a kernel of their height. The kernels and
// the AVX-512 packing routines (kernel_amd64.s) are generated with avo by _gen (go
// generate). The widest this CPU runs is chosen at start-up: AVX-512 (12×32 tiles),
// else AVX2 with FMA (6×16), else a plain Go kernel (4×8; build tag purego forces it).
//
// Implementation plugs it into gorgonia as its BLAS; every routine but Sgemm is
// gonum's. A gorgonia trainer adds one line, before it builds its graphs:
//
//	gorgonia.Use(sgemm.Implementation{})
//
// Sgemm can also be called directly, on row-major float32 slices. It runs on the
// calling goroutine, one thread, as a data-parallel rank wants it. Package fastblas
// makes the same call at init, or picks OpenBLAS with -tags openblas.
package sgemm

import (
	"os"
	"strings"
	"sync"
	"unsafe"
)

// kernelFunc stores alpha times the h×nr product of A and the packed micro-panel b
// (b[p*nr+j]), k steps, into the tile of row-major c whose rows are ldc apart, or adds
// it to what is there when add. A[r,p] is at a[p*lda+r] for a kernel's colA form and
// at a[r*lda+p] for its rowA form. h is the kernel's height.
type kernelFunc func(k int, a *float32, lda int, b, c *float32, ldc int, alpha float32, add bool)

type microKernel struct {
	name       string
	mr, nr     int
	colA, rowA []kernelFunc // by height - 1: colA[mr-1] is the full tile
	// Optional packing routines for nr = 32 (nil: packB's Go loops):
	copy32      func(k int, src *float32, lds int, dst *float32)
	transpose16 func(src *float32, lds, cols int, dst *float32, ldd int)
}

// Blocking. The kernel walks the packed B block (kc×nc, 1 MiB at most) in L2 with one
// A micro-panel (mr×kc) in L1. nc covers the model's widest product (1024).
const (
	kcMax   = 256
	ncMax   = 1024
	tileMax = 12 * 32 // the largest mr×nr
)

// kern is the widest kernel this CPU runs, or the one GODDP_SGEMM_KERNEL names.
var kern = pickKernel(os.Getenv("GODDP_SGEMM_KERNEL"))

// pickKernel returns the kernel whose name starts with want ("avx512", "avx2", "go")
// among those this CPU runs, or the widest one when want is empty or names none of
// them (Kernel then says which runs).
func pickKernel(want string) microKernel {
	ks := kernels()
	for _, k := range ks {
		if want != "" && strings.HasPrefix(k.name, want+" ") {
			return k
		}
	}
	return ks[len(ks)-1]
}

// Kernel names the micro-kernel in use: "avx512 12x32", "avx2 6x16" or "go 4x8".
// GODDP_SGEMM_KERNEL=avx2 (or go) picks a narrower one than the CPU allows, for
// comparisons.
func Kernel() string { return kern.name }

type workspace struct {
	b   []float32 // the packed block of B, 64-byte aligned
	tmp []float32 // one mr×nr tile, for the last columns
}

var pool = sync.Pool{New: func() any {
	return &workspace{b: aligned(ncMax * kcMax), tmp: aligned(tileMax)}
}}

// aligned returns n float32s starting on a 64-byte boundary.
func aligned(n int) []float32 {
	s := make([]float32, n+16)
	off := int(uintptr(unsafe.Pointer(&s[0]))%64) / 4
	if off != 0 {
		off = 16 - off
	}
	return s[off : off+n]
}

// Sgemm computes C = alpha·op(A)·op(B) + beta·C, with op(X) = Xᵀ when tX. C is m×n,
// op(A) m×k and op(B) k×n, all row-major with leading dimensions lda, ldb and ldc.
// The arguments must be valid (Implementation.Sgemm checks them as gonum does).
// As in BLAS, beta = 0 overwrites C, NaNs included, and alpha = 0 or k = 0 only
// scales C.
func Sgemm(tA, tB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	gemm(kern, tA, tB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
}

// gemm is Sgemm on micro-kernel kern.
func gemm(kern microKernel, tA, tB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	if m == 0 || n == 0 {
		return
	}
	// With beta = 0 the first k block stores its tiles over C (NaNs in C gone, as
	// BLAS wants) and the rest add; otherwise C is scaled first and every block adds.
	overwrite := beta == 0 && alpha != 0 && k != 0
	if beta != 1 && !overwrite {
		for i := 0; i < m; i++ {
			row := c[i*ldc : i*ldc+n]
			if beta == 0 {
				clear(row)
				continue
			}
			for j := range row {
				row[j] *= beta
			}
		}
	}
	if alpha == 0 || k == 0 {
		return
	}
	w := pool.Get().(*workspace)
	defer pool.Put(w)
	mr, nr := kern.mr, kern.nr
	for jc := 0; jc < n; jc += ncMax {
		nc := min(ncMax, n-jc)
		for pc := 0; pc < k; pc += kcMax {
			kc := min(kcMax, k-pc)
			add := !overwrite || pc > 0
			packB(kern, w.b, tB, b, ldb, pc, kc, jc, nc)
			for ir := 0; ir < m; ir += mr {
				rows := min(mr, m-ir)
				// This micro-panel of A, in place, and the kernel of its height.
				var fn kernelFunc
				var ap *float32
				if tA {
					fn, ap = kern.colA[rows-1], &a[pc*lda+ir]
				} else {
					fn, ap = kern.rowA[rows-1], &a[ir*lda+pc]
				}
				for jr := 0; jr < nc; jr += nr {
					cols := min(nr, nc-jr)
					bp := &w.b[jr*kc]
					off := ir*ldc + jc + jr
					if cols == nr {
						fn(kc, ap, lda, bp, &c[off], ldc, alpha, add)
						continue
					}
					fn(kc, ap, lda, bp, &w.tmp[0], nr, alpha, false)
					for r := 0; r < rows; r++ {
						dst := c[off+r*ldc : off+r*ldc+cols]
						src := w.tmp[r*nr : r*nr+cols]
						if !add {
							copy(dst, src)
							continue
						}
						for j, v := range src {
							dst[j] += v
						}
					}
				}
			}
		}
	}
}

// packB packs op(B)[pc:pc+kc, jc:jc+nc] into dst as micro-panels of kern.nr columns,
// each k-major (dst[panel*nr*kc + p*nr + j]), columns past nc zero.
func packB(kern microKernel, dst []float32, tB bool, b []float32, ldb, pc, kc, jc, nc int) {
	nr := kern.nr
	for jr := 0; jr < nc; jr += nr {
		cols := min(nr, nc-jr)
		panel := dst[jr*kc : jr*kc+nr*kc]
		switch {
		case cols == 32 && !tB && kern.copy32 != nil:
			kern.copy32(kc, &b[pc*ldb+jc+jr], ldb, &panel[0])
			continue
		case cols == 32 && tB && kern.transpose16 != nil:
			for p := 0; p < kc; p += 16 {
				for h := 0; h < 32; h += 16 {
					kern.transpose16(&b[(jc+jr+h)*ldb+pc+p], ldb, min(16, kc-p), &panel[p*nr+h], nr)
				}
			}
			continue
		}
		if !tB {
			for p := 0; p < kc; p++ {
				out := panel[p*nr : p*nr+nr]
				copy(out, b[(pc+p)*ldb+jc+jr:][:cols])
				clear(out[cols:])
			}
			continue
		}
		for j := 0; j < cols; j++ {
			src := b[(jc+jr+j)*ldb+pc:][:kc]
			for p, v := range src {
				panel[p*nr+j] = v
			}
		}
		if cols < nr {
			for p := 0; p < kc; p++ {
				clear(panel[p*nr+cols : p*nr+nr])
			}
		}
	}
}
