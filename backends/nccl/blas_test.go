//go:build cgo

package nccl

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/goddp/goddp/procgroup"
)

// devMat is a float32 device matrix of the BLAS tests, on stream s.
func devMat(t *testing.T, g *Group, s Stream, v []float32) DeviceBuffer {
	t.Helper()
	d, err := g.Alloc(procgroup.Float32, len(v))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.Free(d) })
	d.Stream = s
	if err := g.CopyIn(d, v); err != nil {
		t.Fatal(err)
	}
	return d
}

func randVec(rng *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(rng.NormFloat64())
	}
	return v
}

// TestGPUGemm: GemmAsync against a float64 product on the host, for every pair of
// transposes, leading dimensions larger than the rows, beta 0 (C not read: it starts as
// NaN) and beta ≠ 0, within 1e-5·(1+Σ|terms|) (float32 products of k terms).
func TestGPUGemm(t *testing.T) {
	g, s := streamGroup(t)
	rng := rand.New(rand.NewPCG(4, 6))
	for _, tc := range []struct {
		m, n, k, pad int
		alpha, beta  float32
	}{{7, 3, 40, 0, 1, 0}, {40, 2, 7, 3, -1, 1}, {1, 1, 1, 1, 2, 0.5}, {33, 5, 64, 2, 1, 0}} {
		for _, ta := range []bool{false, true} {
			for _, tb := range []bool{false, true} {
				ar, ac := tc.m, tc.k
				if ta {
					ar, ac = tc.k, tc.m
				}
				br, bc := tc.k, tc.n
				if tb {
					br, bc = tc.n, tc.k
				}
				lda, ldb, ldc := ar+tc.pad, br+tc.pad, tc.m+tc.pad
				a, b, c := randVec(rng, lda*ac), randVec(rng, ldb*bc), randVec(rng, ldc*tc.n)
				if tc.beta == 0 {
					for i := range c {
						c[i] = float32(math.NaN())
					}
				}
				da, db, dc := devMat(t, g, s, a), devMat(t, g, s, b), devMat(t, g, s, c)
				if err := g.GemmAsync(s, ta, tb, tc.m, tc.n, tc.k, tc.alpha, da, lda, db, ldb, tc.beta, dc, ldc); err != nil {
					t.Fatal(err)
				}
				got := make([]float32, len(c))
				if err := g.CopyOut(got, dc); err != nil {
					t.Fatal(err)
				}
				at := func(i, l int) float64 { // op(A)[i][l]
					if ta {
						return float64(a[l+i*lda])
					}
					return float64(a[i+l*lda])
				}
				bt := func(l, j int) float64 {
					if tb {
						return float64(b[j+l*ldb])
					}
					return float64(b[l+j*ldb])
				}
				for j := 0; j < tc.n; j++ {
					for i := 0; i < ldc; i++ {
						k := i + j*ldc
						if i >= tc.m { // padding: untouched
							if math.Float32bits(got[k]) != math.Float32bits(c[k]) {
								t.Fatalf("%+v ta=%v tb=%v: C[%d] outside the matrix changed: %v, was %v", tc, ta, tb, k, got[k], c[k])
							}
							continue
						}
						want, mag := 0.0, 0.0
						for l := 0; l < tc.k; l++ {
							want += at(i, l) * bt(l, j)
							mag += math.Abs(at(i, l) * bt(l, j))
						}
						want *= float64(tc.alpha)
						if tc.beta != 0 {
							want += float64(tc.beta) * float64(c[k])
							mag += math.Abs(float64(c[k]))
						}
						if math.Abs(float64(got[k])-want) > 1e-5*(1+mag) {
							t.Fatalf("%+v ta=%v tb=%v: C[%d,%d] = %v, want %v", tc, ta, tb, i, j, got[k], want)
						}
					}
				}
			}
		}
	}
	// Shapes the buffers cannot hold fail before anything is enqueued.
	small := devMat(t, g, s, make([]float32, 6))
	if err := g.GemmAsync(s, false, false, 3, 3, 2, 1, small, 3, small, 2, 0, small, 3); !errors.Is(err, procgroup.ErrInvalidArgument) {
		t.Errorf("C too short: %v", err)
	}
	if err := g.GemmAsync(s, false, false, 3, 2, 2, 1, small, 2, small, 2, 0, small, 3); !errors.Is(err, procgroup.ErrInvalidArgument) {
		t.Errorf("lda < m: %v", err)
	}
	f64, err := g.Alloc(procgroup.Float64, 6)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Free(f64)
	if err := g.GemmAsync(s, false, false, 2, 2, 2, 1, f64, 2, small, 2, 0, small, 2); !errors.Is(err, procgroup.ErrInvalidArgument) {
		t.Errorf("float64 A: %v", err)
	}
	if err := g.SyncStream(s); err != nil {
		t.Fatal(err)
	}
}

// orthRef is procgroup.DeviceBLAS.OrthonormalizeAsync's specification on the host, in
// the kernel's order of operations.
func orthRef(a []float32, rows, cols int, seed uint64) {
	dot := func(x, y []float32) float64 {
		s := 0.0
		for i := range x {
			s += float64(x[i]) * float64(y[i])
		}
		return s
	}
	for c := 0; c < cols; c++ {
		col := a[c*rows : (c+1)*rows]
		for try := uint64(0); ; try++ {
			before := math.Sqrt(dot(col, col))
			for pass := 0; pass < 2; pass++ {
				for k := 0; k < c; k++ {
					prev := a[k*rows : (k+1)*rows]
					d := dot(col, prev)
					for i := range col {
						col[i] = float32(float64(col[i]) - d*float64(prev[i]))
					}
				}
			}
			norm := math.Sqrt(dot(col, col))
			good := norm > 1e-5*before && norm > 0 && norm < math.Inf(1)
			if good || try == 3 {
				inv := 0.0
				if good {
					inv = 1 / norm
				}
				for i := range col {
					col[i] = float32(float64(col[i]) * inv)
				}
				break
			}
			st := seed ^ (uint64(c) + 1 + try<<32)
			for i := range col {
				st += 0x9e3779b97f4a7c15
				z := st
				z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
				z = (z ^ z>>27) * 0x94d049bb133111eb
				z ^= z >> 31
				col[i] = float32(float64(z>>11)/(1<<52) - 1)
			}
		}
	}
}

// TestGPUOrthonormalize: OrthonormalizeAsync gives the bits of its specification (orthRef:
// no fused multiply-adds, correctly rounded square root and division), on random matrices
// and on degenerate ones (a zero column, a repeated column, all zeros), whose columns it
// replaces; the result's columns are orthonormal within 1e-5.
func TestGPUOrthonormalize(t *testing.T) {
	g, s := streamGroup(t)
	rng := rand.New(rand.NewPCG(5, 8))
	for _, tc := range []struct {
		name       string
		rows, cols int
		fill       func(a []float32, rows int)
	}{
		{"random", 50, 4, nil},
		{"tall", 3000, 8, nil},
		{"one", 9, 1, nil},
		{"zero column", 20, 3, func(a []float32, rows int) { clear(a[rows : 2*rows]) }},
		{"repeated", 20, 3, func(a []float32, rows int) { copy(a[2*rows:], a[:rows]) }},
		{"zeros", 16, 2, func(a []float32, rows int) { clear(a) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := randVec(rng, tc.rows*tc.cols)
			if tc.fill != nil {
				tc.fill(a, tc.rows)
			}
			seed := rng.Uint64()
			d := devMat(t, g, s, a)
			if err := g.OrthonormalizeAsync(s, d, tc.rows, tc.cols, seed); err != nil {
				t.Fatal(err)
			}
			got := make([]float32, len(a))
			if err := g.CopyOut(got, d); err != nil {
				t.Fatal(err)
			}
			orthRef(a, tc.rows, tc.cols, seed)
			for i := range a {
				if math.Float32bits(got[i]) != math.Float32bits(a[i]) {
					t.Fatalf("[%d] = %v, the specification's %v", i, got[i], a[i])
				}
			}
			for c := 0; c < tc.cols; c++ {
				for k := 0; k <= c; k++ {
					dot := 0.0
					for i := 0; i < tc.rows; i++ {
						dot += float64(got[c*tc.rows+i]) * float64(got[k*tc.rows+i])
					}
					want := 0.0
					if c == k {
						want = 1
					}
					if math.Abs(dot-want) > 1e-5 {
						t.Fatalf("columns %d·%d = %v, want %v", c, k, dot, want)
					}
				}
			}
		})
	}
	d := devMat(t, g, s, make([]float32, 10))
	if err := g.OrthonormalizeAsync(s, d, 4, 3, 0); !errors.Is(err, procgroup.ErrInvalidArgument) {
		t.Errorf("4×3 in 10 elements: %v", err)
	}
}
