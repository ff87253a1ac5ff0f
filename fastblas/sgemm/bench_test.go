package sgemm_test

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"

	"github.com/goddp/goddp/fastblas/sgemm"
)

// benchImpls are the SGEMMs BenchmarkSgemm compares; bench_openblas_test.go adds
// OpenBLAS under -tags openblas.
var benchImpls = []struct {
	name string
	impl blas.Float32Level3
}{
	{"goddp", sgemm.Implementation{}},
	{"gonum", gonum.Implementation{}},
}

// benchShape is one product: op(A) m×k, op(B) k×n, and each leading dimension's excess
// over its minimum (the attention products work inside the packed q, k, v projections).
type benchShape struct {
	tA, tB           bool
	m, n, k          int
	padA, padB, padC int
}

// benchShapes are the seed model's products (L=2, h=256, 8 heads, batch 8 × seq 64 =
// 512 rows), forward and backward, and a square one.
var benchShapes = []benchShape{
	{m: 512, n: 768, k: 256},                              // qkv projection
	{m: 512, n: 1024, k: 256},                             // feed-forward up
	{m: 512, n: 256, k: 1024},                             // feed-forward down
	{tB: true, m: 512, n: 1024, k: 256},                   // its input gradient
	{tA: true, m: 256, n: 1024, k: 512},                   // a weight gradient
	{tB: true, m: 64, n: 64, k: 32, padA: 736, padB: 736}, // attention scores, per head
	{m: 64, n: 32, k: 64, padB: 736, padC: 224},           // probabilities · V
	{tA: true, m: 64, n: 32, k: 64, padB: 224, padC: 736}, // dV
	{m: 1024, n: 1024, k: 1024},
}

func tr(t bool) blas.Transpose {
	if t {
		return blas.Trans
	}
	return blas.NoTrans
}

// BenchmarkSgemm reports GFLOPS per implementation and shape. Single-threaded, as the
// ranks run: gonum's SGEMM spreads over GOMAXPROCS, hence -cpu 1.
//
//	go test -run '^$' -bench Sgemm -cpu 1 ./fastblas/sgemm
//	OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE=SkylakeX go test -tags openblas ... (adds openblas)
//	GODDP_SGEMM_KERNEL=avx2 ... (goddp's AVX2 kernel on an AVX-512 CPU)
func BenchmarkSgemm(b *testing.B) {
	rng := rand.New(rand.NewPCG(5, 6))
	fill := func(n int) []float32 {
		s := make([]float32, n)
		for i := range s {
			s[i] = float32(rng.NormFloat64())
		}
		return s
	}
	for _, g := range benchShapes {
		ra, ca, rb, cb := g.m, g.k, g.k, g.n
		if g.tA {
			ra, ca = ca, ra
		}
		if g.tB {
			rb, cb = cb, rb
		}
		lda, ldb, ldc := ca+g.padA, cb+g.padB, g.n+g.padC
		a, bm, c := fill(ra*lda), fill(rb*ldb), fill(g.m*ldc)
		for _, im := range benchImpls {
			name := fmt.Sprintf("%s/%s%s_%dx%dx%d", im.name, map[bool]string{false: "N", true: "T"}[g.tA], map[bool]string{false: "N", true: "T"}[g.tB], g.m, g.n, g.k)
			b.Run(name, func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					im.impl.Sgemm(tr(g.tA), tr(g.tB), g.m, g.n, g.k, 1, a, lda, bm, ldb, 0, c, ldc)
				}
				b.ReportMetric(2*float64(g.m*g.n*g.k)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOPS")
			})
		}
	}
}
