package sgemm

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

// gemmCase is one SGEMM call: shapes, transposes, the padding of each leading
// dimension beyond its minimum, and the scalars.
type gemmCase struct {
	tA, tB      bool
	m, n, k     int
	padA, padB  int
	padC        int
	alpha, beta float32
}

func (g gemmCase) String() string {
	return fmt.Sprintf("tA=%t tB=%t m=%d n=%d k=%d pads=%d,%d,%d alpha=%g beta=%g", g.tA, g.tB, g.m, g.n, g.k, g.padA, g.padB, g.padC, g.alpha, g.beta)
}

// operands makes random A, B and C for g (C's padding filled with a sentinel).
func (g gemmCase) operands(rng *rand.Rand) (a []float32, lda int, b []float32, ldb int, c []float32, ldc int) {
	ra, ca := g.m, g.k
	if g.tA {
		ra, ca = g.k, g.m
	}
	rb, cb := g.k, g.n
	if g.tB {
		rb, cb = g.n, g.k
	}
	lda, ldb, ldc = max(1, ca+g.padA), max(1, cb+g.padB), max(1, g.n+g.padC)
	fill := func(n int) []float32 {
		s := make([]float32, n)
		for i := range s {
			s[i] = float32(rng.NormFloat64())
		}
		return s
	}
	a, b, c = fill(max(0, ra*lda)), fill(max(0, rb*ldb)), fill(max(0, g.m*ldc))
	for i := 0; i < g.m; i++ {
		for j := g.n; j < ldc; j++ {
			c[i*ldc+j] = 12345
		}
	}
	return a, lda, b, ldb, c, ldc
}

func tr(t bool) blas.Transpose {
	if t {
		return blas.Trans
	}
	return blas.NoTrans
}

// check runs g on kernel kern and compares every element of C with gonum's SGEMM on
// the same operands, within a bound from a float64 sum of |terms|; C's padding must
// stay untouched.
func check(t testing.TB, kern microKernel, g gemmCase, rng *rand.Rand) {
	t.Helper()
	a, lda, b, ldb, c, ldc := g.operands(rng)
	want := append([]float32(nil), c...)
	gonum.Implementation{}.Sgemm(tr(g.tA), tr(g.tB), g.m, g.n, g.k, g.alpha, a, lda, b, ldb, g.beta, want, ldc)
	c0 := append([]float32(nil), c...)
	gemm(kern, g.tA, g.tB, g.m, g.n, g.k, g.alpha, a, lda, b, ldb, g.beta, c, ldc)
	at := func(i, p int) float32 {
		if g.tA {
			return a[p*lda+i]
		}
		return a[i*lda+p]
	}
	bt := func(p, j int) float32 {
		if g.tB {
			return b[j*ldb+p]
		}
		return b[p*ldb+j]
	}
	for i := 0; i < g.m; i++ {
		for j := 0; j < ldc; j++ {
			got := c[i*ldc+j]
			if j >= g.n {
				if got != 12345 {
					t.Fatalf("%v [%s]: C[%d,%d] past n was written: %g", g, kern.name, i, j, got)
				}
				continue
			}
			bound := math.Abs(float64(g.beta) * float64(c0[i*ldc+j]))
			for p := 0; p < g.k; p++ {
				bound += math.Abs(float64(g.alpha) * float64(at(i, p)) * float64(bt(p, j)))
			}
			tol := 4 * float64(g.k+2) * 6e-8 * bound
			if d := math.Abs(float64(got) - float64(want[i*ldc+j])); d > tol || math.IsNaN(float64(got)) {
				t.Fatalf("%v [%s]: C[%d,%d] = %g, gonum %g (|diff| %g > %g)", g, kern.name, i, j, got, want[i*ldc+j], d, tol)
			}
		}
	}
}

// TestAgainstGonum covers every kernel on shapes around the tile and block edges, both
// transposes, padded leading dimensions and the special alphas and betas.
func TestAgainstGonum(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	dims := []int{1, 2, 5, 7, 11, 12, 13, 31, 32, 33, 64, 191, 192, 193, 257}
	scalars := [][2]float32{{1, 0}, {1, 1}, {-0.5, 2}, {0, 0.5}, {1.5, 0}}
	for _, kern := range kernels() {
		t.Run(kern.name, func(t *testing.T) {
			for i := 0; i < 200; i++ {
				s := scalars[rng.IntN(len(scalars))]
				g := gemmCase{
					tA: rng.IntN(2) == 1, tB: rng.IntN(2) == 1,
					m: dims[rng.IntN(len(dims))], n: dims[rng.IntN(len(dims))], k: dims[rng.IntN(len(dims))],
					padA: rng.IntN(3) * 3, padB: rng.IntN(3) * 5, padC: rng.IntN(3) * 2,
					alpha: s[0], beta: s[1],
				}
				check(t, kern, g, rng)
			}
			// Every kernel height (the last m mod mr rows), both layouts of A and B.
			for m := 1; m <= 2*kern.mr; m++ {
				for f := 0; f < 4; f++ {
					check(t, kern, gemmCase{tA: f&1 != 0, tB: f&2 != 0, m: m, n: 2*kern.nr + 3, k: 37, padA: 1, padB: 2, alpha: 0.5, beta: 1}, rng)
				}
			}
			// Past every block bound at once (k > kcMax, n > ncMax).
			check(t, kern, gemmCase{m: 29, n: 1030, k: 300, padA: 1, alpha: 1, beta: 1}, rng)
			check(t, kern, gemmCase{tA: true, tB: true, m: 14, n: 1100, k: 520, alpha: 0.25, beta: -1}, rng)
		})
	}
	// The model's shapes, on the kernel in use: a linear layer, its weight gradient, and
	// per-head attention (strided, inside the packed q, k, v projections).
	rng2 := rand.New(rand.NewPCG(9, 10))
	for _, g := range []gemmCase{
		{m: 512, n: 768, k: 256, alpha: 1},
		{tA: true, m: 256, n: 96, k: 512, alpha: 1},
		{tB: true, m: 100, n: 256, k: 1024, alpha: 1},
		{tB: true, m: 64, n: 64, k: 32, padA: 736, padB: 736, alpha: 0.17},
		{tA: true, m: 64, n: 32, k: 64, padB: 224, padC: 736, alpha: 1},
	} {
		check(t, kern, g, rng2)
	}
}

// TestBetaZeroClearsNaN: beta = 0 overwrites C, so NaNs in it do not survive (BLAS).
func TestBetaZeroClearsNaN(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, kern := range kernels() {
		g := gemmCase{m: 13, n: 35, k: 7, alpha: 1}
		a, lda, b, ldb, c, ldc := g.operands(rng)
		for i := range c {
			c[i] = float32(math.NaN())
		}
		gemm(kern, false, false, g.m, g.n, g.k, 1, a, lda, b, ldb, 0, c, ldc)
		for i, v := range c {
			if math.IsNaN(float64(v)) {
				t.Fatalf("[%s] C[%d] is NaN after beta = 0", kern.name, i)
			}
		}
	}
}

// TestImplementationChecks: arguments gonum rejects panic as they do in gonum.
func TestImplementationChecks(t *testing.T) {
	a := make([]float32, 6)
	for _, tc := range []struct {
		name string
		call func()
	}{
		{"short a", func() { Implementation{}.Sgemm(blas.NoTrans, blas.NoTrans, 3, 2, 2, 1, a[:5], 2, a, 2, 0, a, 2) }},
		{"small lda", func() { Implementation{}.Sgemm(blas.NoTrans, blas.NoTrans, 3, 2, 2, 1, a, 1, a, 2, 0, a, 2) }},
		{"bad transpose", func() { Implementation{}.Sgemm('x', blas.NoTrans, 3, 2, 2, 1, a, 2, a, 2, 0, a, 2) }},
		{"negative m", func() { Implementation{}.Sgemm(blas.NoTrans, blas.NoTrans, -1, 2, 2, 1, a, 2, a, 2, 0, a, 2) }},
		{"short a with k = 0", func() { Implementation{}.Sgemm(blas.NoTrans, blas.NoTrans, 3, 2, 0, 1, nil, 1, a, 2, 0, a, 2) }},
		{"short b with k = 0", func() { Implementation{}.Sgemm(blas.NoTrans, blas.Trans, 3, 2, 0, 1, a, 1, nil, 1, 0, a, 2) }},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", tc.name)
				}
			}()
			tc.call()
		}()
	}
}

// FuzzSgemm draws shapes, transposes, paddings and scalars and checks the result
// against gonum on every kernel this CPU runs.
func FuzzSgemm(f *testing.F) {
	f.Add(uint64(1), uint8(13), uint8(35), uint8(7), uint8(0), uint8(0))
	f.Add(uint64(2), uint8(200), uint8(40), uint8(255), uint8(3), uint8(9))
	f.Fuzz(func(t *testing.T, seed uint64, m, n, k, flags, pad uint8) {
		rng := rand.New(rand.NewPCG(seed, 7))
		g := gemmCase{
			tA: flags&1 != 0, tB: flags&2 != 0,
			m: int(m), n: int(n), k: int(k),
			padA: int(pad & 3), padB: int(pad >> 2 & 3), padC: int(pad >> 4 & 3),
			alpha: []float32{1, 0, -2, 0.5}[flags>>2&3], beta: []float32{0, 1, -1, 0.25}[flags>>4&3],
		}
		for _, k := range kernels() {
			check(t, k, g, rng)
		}
	})
}

// TestPickKernel: GODDP_SGEMM_KERNEL picks a kernel by its first word; anything else
// leaves the widest.
func TestPickKernel(t *testing.T) {
	ks := kernels()
	widest := ks[len(ks)-1].name
	for _, k := range ks {
		want := strings.Fields(k.name)[0]
		if got := pickKernel(want).name; got != k.name {
			t.Errorf("pickKernel(%q) = %s, want %s", want, got, k.name)
		}
	}
	for _, want := range []string{"", "avx", "sse", "go 4x8"} {
		if got := pickKernel(want).name; got != widest {
			t.Errorf("pickKernel(%q) = %s, want the widest, %s", want, got, widest)
		}
	}
}
