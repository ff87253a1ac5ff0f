package reducer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"gonum.org/v1/gonum/mat"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// refPSGD is the test's PowerSGD, from the algorithm's definition in float64 with gonum
// (Householder QR for the orthonormalisation, where the hook runs Gram-Schmidt): one
// parameter's state and its step.
type refPSGD struct {
	n, m, r    int
	compressed bool
	e          []*mat.Dense // per rank
	p, q       *mat.Dense
}

// orthQR returns an orthonormal basis of a's columns (thin Q of its QR factorisation).
func orthQR(a *mat.Dense) *mat.Dense {
	rows, r := a.Dims()
	var qr mat.QR
	qr.Factorize(a)
	var q mat.Dense
	qr.QTo(&q)
	return mat.DenseCopyOf(q.Slice(0, rows, 0, r))
}

// step takes the ranks' matrices (already divided by the world size) at compressed step k
// (k < 0: a plain step) and returns the result every rank should get.
func (f *refPSGD) step(k int, ms []*mat.Dense) *mat.Dense {
	sum := mat.NewDense(f.n, f.m, nil)
	if !f.compressed || k < 0 {
		for _, m := range ms {
			sum.Add(sum, m)
		}
		return sum
	}
	if k%2 == 0 {
		qh := orthQR(f.q)
		p := mat.NewDense(f.n, f.r, nil)
		for w, m := range ms {
			var mp, pw, approx mat.Dense
			mp.Add(m, f.e[w])
			pw.Mul(&mp, qh)
			approx.Mul(&pw, qh.T())
			f.e[w].Sub(&mp, &approx)
			p.Add(p, &pw)
		}
		f.p = p
		sum.Mul(p, qh.T())
		return sum
	}
	ph := orthQR(f.p)
	q := mat.NewDense(f.m, f.r, nil)
	for w, m := range ms {
		var mp, qw, approx mat.Dense
		mp.Add(m, f.e[w])
		qw.Mul(mp.T(), ph)
		approx.Mul(ph, qw.T())
		f.e[w].Sub(&mp, &approx)
		q.Add(q, &qw)
	}
	f.q = q
	sum.Mul(ph, q.T())
	return sum
}

type psgdCase struct {
	name   string
	shapes [][]int
	dtype  procgroup.DType
	opts   PowerSGDOptions
	capMB  float64 // both caps; 0: the defaults
	ranks  int
	steps  int  // synced steps
	accum  bool // every other synced step is preceded by a NoSync (Accumulate) pass
	random bool // gradients drawn afresh at every pass (else the same every step)
}

// psgdRun is what runPSGD saw: each rank's gradients after each synced step, the hooks,
// and the all-reduces rank 0 issued.
type psgdRun struct {
	out    [][][][]float64 // rank, step, param
	in     [][][][]float64 // rank, synced step, param: the gradient the hook saw, ×world
	hooks  []*powerSGD
	issued []pgtest.Record
	// layouts[step] are the buckets each step ran with (their parameters).
	layouts [][][]int
}

func psgdSize(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

// runPSGD trains tc's parameters with random gradients on tc.ranks ranks, reporting them
// in reverse order (so the first synced Finalize rebuilds the buckets).
func runPSGD(t *testing.T, tc psgdCase) psgdRun {
	t.Helper()
	ctx := testCtx(t)
	np := len(tc.shapes)
	grads := psgdGrads(tc)
	run := psgdRun{out: make([][][][]float64, tc.ranks), in: make([][][][]float64, tc.ranks), hooks: make([]*powerSGD, tc.ranks)}
	c := pgtest.NewCluster(tc.ranks)
	defer c.Close()
	layouts := make([][][]int, tc.steps)
	errs := runRanks(tc.ranks, func(rank int) error {
		params := make([]Param, np)
		for p, sh := range tc.shapes {
			params[p] = Param{Name: fmt.Sprintf("p%d", p), Shape: sh}
			if tc.dtype == procgroup.Float32 {
				params[p].Grad = make([]float32, psgdSize(sh))
			} else {
				params[p].Grad = make([]float64, psgdSize(sh))
			}
		}
		hook := PowerSGDHook(tc.opts).(*powerSGD)
		run.hooks[rank] = hook
		r, err := New(c.Group(rank), params, Options{CommHook: hook, BucketCapMB: tc.capMB, FirstBucketCapMB: tc.capMB})
		if err != nil {
			return err
		}
		defer r.Close()
		pass := 0
		backward := func(mode Mode) error {
			if err := r.BeginBackward(mode); err != nil {
				return err
			}
			for p := range np {
				g := grads[rank][pass][p]
				if tc.dtype == procgroup.Float32 {
					err = r.GradReady(p, to32(g))
				} else {
					err = r.GradReady64(p, g)
				}
				if err != nil {
					return err
				}
			}
			pass++
			return nil
		}
		for s := 0; s < tc.steps; s++ {
			seen := make([][]float64, np) // what the hook is given, ×world
			for p := range seen {
				seen[p] = make([]float64, len(grads[rank][pass][p]))
			}
			if tc.accum && s%2 == 1 {
				for p := range seen {
					for k, v := range grads[rank][pass][p] {
						seen[p][k] += v
					}
				}
				if err := backward(Accumulate); err != nil {
					return err
				}
			}
			for p := range seen {
				for k, v := range grads[rank][pass][p] {
					seen[p][k] += v
				}
			}
			if rank == 0 {
				for _, b := range r.Buckets() {
					layouts[s] = append(layouts[s], b.Params)
				}
			}
			if err := backward(Sync); err != nil {
				return err
			}
			if err := r.Finalize(ctx); err != nil {
				return err
			}
			got := make([][]float64, np)
			for p, prm := range params {
				switch g := prm.Grad.(type) {
				case []float32:
					got[p] = make([]float64, len(g))
					for k, v := range g {
						got[p][k] = float64(v)
					}
				case []float64:
					got[p] = append([]float64(nil), g...)
				}
			}
			run.out[rank] = append(run.out[rank], got)
			run.in[rank] = append(run.in[rank], seen)
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	run.issued = c.Issued(0)
	run.layouts = layouts
	return run
}

// psgdGrads draws tc's gradients, grads[rank][pass][param] (a pass: a synced step, or a
// NoSync pass before one), from tc.name.
func psgdGrads(tc psgdCase) [][][][]float64 {
	rng := rand.New(rand.NewPCG(7, uint64(len(tc.name))))
	passes := tc.steps
	if tc.accum {
		passes += tc.steps / 2
	}
	grads := make([][][][]float64, tc.ranks)
	for w := range grads {
		grads[w] = make([][][]float64, passes)
		for s := range grads[w] {
			grads[w][s] = make([][]float64, len(tc.shapes))
			for p, sh := range tc.shapes {
				if !tc.random && s > 0 {
					grads[w][s][p] = grads[w][0][p]
					continue
				}
				g := make([]float64, psgdSize(sh))
				for k := range g {
					g[k] = rng.NormFloat64()
					if tc.dtype == procgroup.Float32 {
						g[k] = float64(float32(g[k]))
					}
				}
				grads[w][s][p] = g
			}
		}
	}
	return grads
}

// reference replays run's inputs through refPSGD, starting from the hooks' initial Q
// (which the test takes from Setup's draw: initQ), and returns each step's results.
func reference(tc psgdCase, run psgdRun, initQ [][]float64) [][][]float64 {
	refs := make([]*refPSGD, len(tc.shapes))
	for p, sh := range tc.shapes {
		n, m := 1, 1
		if len(sh) > 0 {
			n = sh[0]
			for _, d := range sh[1:] {
				m *= d
			}
		}
		f := &refPSGD{n: n, m: m, r: tc.opts.Rank, compressed: initQ[p] != nil}
		if f.compressed {
			f.q = mat.NewDense(m, f.r, nil) // initQ is column-major
			for c := range f.r {
				for j := range m {
					f.q.Set(j, c, initQ[p][c*m+j])
				}
			}
			for range tc.ranks {
				f.e = append(f.e, mat.NewDense(n, m, nil))
			}
		}
		refs[p] = f
	}
	var want [][][]float64
	for s := 0; s < tc.steps; s++ {
		var step [][]float64
		for p, f := range refs {
			if f.n*f.m == 0 {
				step = append(step, nil)
				continue
			}
			ms := make([]*mat.Dense, tc.ranks)
			for w := range ms {
				d := make([]float64, f.n*f.m)
				for k, v := range run.in[w][s][p] {
					d[k] = v / float64(tc.ranks)
				}
				ms[w] = mat.NewDense(f.n, f.m, d)
			}
			res := f.step(s-tc.opts.StartIter, ms)
			step = append(step, append([]float64(nil), res.RawMatrix().Data...))
		}
		want = append(want, step)
	}
	return want
}

// initialQ draws the hooks' initial Q factors (column-major) by setting up a fresh hook
// alike.
func initialQ(t *testing.T, tc psgdCase) [][]float64 {
	h := PowerSGDHook(tc.opts).(*powerSGD)
	hp := make([]HookParam, len(tc.shapes))
	for p, sh := range tc.shapes {
		hp[p] = HookParam{Name: fmt.Sprint(p), DType: tc.dtype, Shape: sh}
	}
	if err := h.Setup(HookSetup{Params: hp, WorldSize: tc.ranks}); err != nil {
		t.Fatal(err)
	}
	q := make([][]float64, len(tc.shapes))
	for p, mt := range h.mats {
		if mt != nil {
			q[p] = append([]float64(nil), mt.q...)
		}
	}
	return q
}

// TestPowerSGDMatchesReference: on 3 ranks with random gradients, every rank's averaged
// gradient after each synced step is, element by element, the result of the test's own
// float64 PowerSGD (refPSGD: QR by Householder, full matrices); across the rebuild of the
// first synced Finalize, NoSync passes, StartIter, several buckets or one parameter per
// bucket, float32 and float64; and each step's all-reduces carry exactly the compressed
// message, one all-reduce per bucket (none for a bucket of zero-length parameters).
func TestPowerSGDMatchesReference(t *testing.T) {
	shapes := [][]int{
		{12, 9},    // compressed at rank 2: (12+9)·2·2 < 108
		{7},        // a bias: as it is
		{6, 4, 5},  // a 3-D tensor, a 6×20 matrix: compressed
		{3, 4},     // too small to gain
		{2, 40},    // the rank is the smaller side: as it is
		{0, 5},     // empty
		{16, 10},   // compressed
		{1, 1, 30}, // a 1×30 matrix: as it is
	}
	for _, tc := range []psgdCase{
		{name: "f64 buckets", shapes: shapes, dtype: procgroup.Float64, opts: PowerSGDOptions{Rank: 2, Seed: 3}, capMB: 1200.0 / (1 << 20), ranks: 3, steps: 9, accum: true, random: true},
		{name: "f32 buckets", shapes: shapes, dtype: procgroup.Float32, opts: PowerSGDOptions{Rank: 2, Seed: 4}, capMB: 600.0 / (1 << 20), ranks: 3, steps: 9, accum: true, random: true},
		{name: "one param a bucket", shapes: shapes, dtype: procgroup.Float64, opts: PowerSGDOptions{Rank: 1, Seed: 5, MinCompressionRate: 1}, capMB: 1.0 / (1 << 20), ranks: 2, steps: 6, random: true},
		{name: "one bucket start iter", shapes: shapes, dtype: procgroup.Float64, opts: PowerSGDOptions{Rank: 3, Seed: 6, StartIter: 2, MinCompressionRate: 1}, ranks: 2, steps: 7, accum: true, random: true},
		// Odd ranks on float32 rows: the AVX2 loops with a column paired with itself
		// (Note [PowerSGD kernels]), on rows long enough for them (37 columns).
		{name: "f32 rank 1", shapes: append(slices.Clone(shapes), []int{40, 37}), dtype: procgroup.Float32, opts: PowerSGDOptions{Rank: 1, Seed: 7, MinCompressionRate: 1}, ranks: 2, steps: 6, random: true},
		{name: "f32 rank 3", shapes: append(slices.Clone(shapes), []int{40, 37}), dtype: procgroup.Float32, opts: PowerSGDOptions{Rank: 3, Seed: 8, MinCompressionRate: 1}, capMB: 2000.0 / (1 << 20), ranks: 3, steps: 7, accum: true, random: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run := runPSGD(t, tc)
			q0 := initialQ(t, tc)
			compressed := 0
			for p, q := range q0 {
				if q != nil {
					compressed++
				}
				// Compressed exactly where (n+m)·r·rate < n·m for the matrix (n, rest).
				sh, rate := tc.shapes[p], tc.opts.MinCompressionRate
				if rate == 0 {
					rate = 2
				}
				n := sh[0]
				m := psgdSize(sh) / max(n, 1)
				if n == 0 {
					m = sh[1]
				}
				if want := len(sh) >= 2 && float64((n+m)*tc.opts.Rank)*rate < float64(n*m); want != (q != nil) {
					t.Fatalf("param %d %v: compressed %v, want %v", p, sh, q != nil, want)
				}
			}
			if compressed == 0 {
				t.Fatal("no parameter is compressed: the case tests nothing")
			}
			want := reference(tc, run, q0)
			tol := 1e-10
			if tc.dtype == procgroup.Float32 {
				tol = 2e-5
			}
			for w := range tc.ranks {
				for s := range tc.steps {
					for p := range tc.shapes {
						for k, g := range run.out[w][s][p] {
							ref := want[s][p][k]
							if math.Abs(g-ref) > tol*(1+math.Abs(ref)) {
								t.Fatalf("rank %d step %d param %d %v [%d]: %v, want %v", w, s, p, tc.shapes[p], k, g, ref)
							}
						}
					}
				}
			}
			// The wire: per synced step, one all-reduce per bucket of the compressed
			// message: the uncompressed elements and P (n×r, even steps) or Q (m×r).
			var wantCounts []int
			for s := range tc.steps {
				for _, ps := range run.layouts[s] {
					n := 0
					for _, p := range ps {
						q := q0[p]
						sh := tc.shapes[p]
						switch {
						case s < tc.opts.StartIter || q == nil:
							n += psgdSize(sh)
						case (s-tc.opts.StartIter)%2 == 0:
							n += sh[0] * tc.opts.Rank
						default:
							n += psgdSize(sh) / sh[0] * tc.opts.Rank
						}
					}
					if n > 0 {
						wantCounts = append(wantCounts, n)
					}
				}
			}
			var got []int
			for _, rec := range run.issued {
				if rec.Op == procgroup.OpAllReduce {
					if rec.DType != tc.dtype {
						t.Fatalf("issued %v", rec)
					}
					got = append(got, rec.Count)
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(wantCounts) {
				t.Fatalf("all-reduce counts %v, want %v", got, wantCounts)
			}
			if len(run.layouts[0]) > 1 && fmt.Sprint(run.layouts[0]) == fmt.Sprint(run.layouts[1]) {
				t.Fatalf("no rebuild: layouts %v then %v", run.layouts[0], run.layouts[1])
			}
		})
	}
}

// TestPowerSGDLowRank: the mean gradient has rank r (the ranks' gradients are U·C_w·Vᵀ
// with U, V shared, the same every step). The first step's result is a projection of the
// mean; the second, through error feedback, makes up for it exactly (their sum is twice
// the mean); after that the results approach the mean, step after step. (The error of a
// P step re-enters the next Q factor, so with alternation the row space is found only
// gradually: about 14% from the mean at step 2, 9.6% at step 29, 3.6% at step 360.)
// After each step the factor just orthonormalised has orthonormal columns (PᵀP = I or
// QᵀQ = I), and every rank gets the same results.
func TestPowerSGDLowRank(t *testing.T) {
	for _, dt := range []procgroup.DType{procgroup.Float64, procgroup.Float32} {
		t.Run(dt.String(), func(t *testing.T) {
			const n, m, r, ranks, steps = 20, 15, 2, 3, 40
			rng := rand.New(rand.NewPCG(11, 12))
			u, v := mat.NewDense(n, r, nil), mat.NewDense(m, r, nil)
			for _, a := range []*mat.Dense{u, v} {
				raw := a.RawMatrix().Data
				for k := range raw {
					raw[k] = rng.NormFloat64()
				}
			}
			grads := make([][]float64, ranks)
			mean := make([]float64, n*m)
			for w := range grads {
				cw := mat.NewDense(r, r, nil)
				for k := range cw.RawMatrix().Data {
					cw.RawMatrix().Data[k] = rng.NormFloat64()
				}
				var uc, g mat.Dense
				uc.Mul(u, cw)
				g.Mul(&uc, v.T())
				grads[w] = g.RawMatrix().Data
				if dt == procgroup.Float32 {
					for k := range grads[w] {
						grads[w][k] = float64(float32(grads[w][k]))
					}
				}
				for k, x := range grads[w] {
					mean[k] += x / ranks
				}
			}
			tol := 1e-12
			if dt == procgroup.Float32 {
				tol = 1e-5
			}
			ctx := testCtx(t)
			c := pgtest.NewCluster(ranks)
			defer c.Close()
			dist := make([][]float64, ranks) // per rank, per step: ‖result − mean‖ / ‖mean‖
			errs := runRanks(ranks, func(rank int) error {
				h := PowerSGDHook(PowerSGDOptions{Rank: r, Seed: 9}).(*powerSGD)
				p := Param{Name: "w", Shape: []int{n, m}, Grad: make([]float64, n*m)}
				g := any(grads[rank])
				if dt == procgroup.Float32 {
					p.Grad = make([]float32, n*m)
					g = to32(grads[rank])
				}
				red, err := New(c.Group(rank), []Param{p}, Options{CommHook: h})
				if err != nil {
					return err
				}
				defer red.Close()
				first := make([]float64, n*m)
				for s := 0; s < steps; s++ {
					_ = red.BeginBackward(Sync)
					if dt == procgroup.Float32 {
						err = red.GradReady(0, g.([]float32))
					} else {
						err = red.GradReady64(0, g.([]float64))
					}
					if err != nil {
						return err
					}
					if err := red.Finalize(ctx); err != nil {
						return err
					}
					out := make([]float64, n*m)
					switch gr := p.Grad.(type) {
					case []float32:
						for k, x := range gr {
							out[k] = float64(x)
						}
					case []float64:
						copy(out, gr)
					}
					mt := h.mats[0]
					basis, rows := mt.q, m // orthonormalised at this (even) step
					if s%2 == 1 {
						basis, rows = mt.p, n
					}
					if err := checkOrthonormal(basis, rows, r); err != nil {
						return fmt.Errorf("step %d: %w", s, err)
					}
					var d2, n2 float64
					for k := range out {
						d2 += (out[k] - mean[k]) * (out[k] - mean[k])
						n2 += mean[k] * mean[k]
					}
					dist[rank] = append(dist[rank], math.Sqrt(d2/n2))
					switch s {
					case 0:
						copy(first, out)
					case 1:
						for k := range out {
							if d := first[k] + out[k] - 2*mean[k]; math.Abs(d) > tol*(1+math.Abs(mean[k])) {
								return fmt.Errorf("steps 0+1 [%d]: %v + %v, want 2×%v", k, first[k], out[k], mean[k])
							}
						}
					}
					if s == 0 {
						exact := true // the first step's result is a projection, not yet the mean
						for k := range out {
							exact = exact && math.Abs(out[k]-mean[k]) <= tol*(1+math.Abs(mean[k]))
						}
						if exact {
							return errors.New("step 0 already returned the mean: the test cannot see warm start")
						}
					}
				}
				return nil
			})
			for w, err := range errs {
				if err != nil {
					t.Fatalf("rank %d: %v", w, err)
				}
			}
			// From step 2 on, the distance to the mean shrinks, step pair by step pair
			// (an odd step's result is the mean plus the mean error of the step before,
			// so it is as far as that step's).
			d := dist[0]
			for s := 3; s < steps; s += 2 {
				if !(d[s] <= d[s-1]*(1+100*tol)) || (s >= 4 && !(d[s-1] <= d[s-2]*(1+100*tol))) {
					t.Fatalf("distance to the mean grows: %v", d)
				}
			}
			if !(d[steps-1] < 0.75*d[2]) || !(d[2] < 0.5*d[0]) {
				t.Fatalf("distance to the mean: %v at step 0, %v at 2, %v at %d", d[0], d[2], d[steps-1], steps-1)
			}
			for w := 1; w < ranks; w++ {
				if fmt.Sprint(dist[w]) != fmt.Sprint(d) {
					t.Fatalf("rank %d's results differ from rank 0's", w)
				}
			}
		})
	}
}

// checkOrthonormal checks that the r columns of a (rows×r, column-major) are
// orthonormal: AᵀA = I.
func checkOrthonormal(a []float64, rows, r int) error {
	for i := 0; i < r; i++ {
		for j := 0; j < r; j++ {
			var dot float64
			for k := 0; k < rows; k++ {
				dot += a[i*rows+k] * a[j*rows+k]
			}
			want := 0.0
			if i == j {
				want = 1
			}
			if math.Abs(dot-want) > 1e-12 {
				return fmt.Errorf("columns %d·%d = %v, want %v", i, j, dot, want)
			}
		}
	}
	return nil
}

// TestPowerSGDErrorFeedback: with full-rank gradients, the same every step, rank 1 sends
// a small part of each; yet with error feedback the sum of the results over T steps plus
// the ranks' mean error (the sum of their errors, which hold divided gradients) is exactly
// the sum of the mean gradients, and the sum of the
// results approaches T × the mean: its relative distance shrinks as T grows.
func TestPowerSGDErrorFeedback(t *testing.T) {
	tc := psgdCase{name: "ef", shapes: [][]int{{10, 8}}, dtype: procgroup.Float64, opts: PowerSGDOptions{Rank: 1, Seed: 2}, ranks: 2, steps: 200}
	run := runPSGD(t, tc)
	var sum, mean []float64
	mean = make([]float64, 80)
	for w := range tc.ranks {
		for k, v := range run.in[w][0][0] {
			mean[k] += v / float64(tc.ranks)
		}
	}
	dist := func(T int) float64 {
		var d, nrm float64
		for k := range sum {
			d += (sum[k] - float64(T)*mean[k]) * (sum[k] - float64(T)*mean[k])
			nrm += float64(T) * mean[k] * float64(T) * mean[k]
		}
		return math.Sqrt(d / nrm)
	}
	sum = make([]float64, 80)
	var at []float64
	for s := range tc.steps {
		for k, v := range run.out[0][s][0] {
			sum[k] += v
		}
		if s+1 == 10 || s+1 == tc.steps {
			at = append(at, dist(s+1))
		}
	}
	if !(at[1] < at[0]/4) || !(at[1] < 0.05) {
		t.Fatalf("relative distance of Σ results from T×mean: %v at T=10, %v at T=%d", at[0], at[1], tc.steps)
	}
	// The invariant, element by element: Σ_t results + mean_w E_w = T × mean.
	for k := range sum {
		ef := 0.0
		for _, h := range run.hooks {
			ef += h.mats[0].e.([]float64)[k] // in the bucket's units: already divided by the world size
		}
		want := float64(tc.steps) * mean[k]
		if math.Abs(sum[k]+ef-want) > 1e-9*(1+math.Abs(want)) {
			t.Fatalf("[%d]: Σ results %v + mean error %v = %v, want %v", k, sum[k], ef, sum[k]+ef, want)
		}
	}
}

// TestPowerSGDBadInput: bad options and shapes are refused at New, naming the option; a
// hook given to a second Reducer is refused; device buckets are refused at Setup.
func TestPowerSGDBadInput(t *testing.T) {
	c := pgtest.NewCluster(1)
	defer c.Close()
	p := func() []Param { return []Param{{Name: "w", Grad: make([]float32, 12), Shape: []int{3, 4}}} }
	for _, tc := range []struct {
		opts   PowerSGDOptions
		params []Param
		want   string
	}{
		{PowerSGDOptions{}, p(), "Rank 0, want at least 1"},
		{PowerSGDOptions{Rank: -2}, p(), "Rank -2, want at least 1"},
		{PowerSGDOptions{Rank: 1, MinCompressionRate: 0.5}, p(), "MinCompressionRate 0.5, want at least 1"},
		{PowerSGDOptions{Rank: 1, MinCompressionRate: math.NaN()}, p(), "MinCompressionRate NaN"},
		{PowerSGDOptions{Rank: 1, StartIter: -1}, p(), "StartIter -1"},
		{PowerSGDOptions{Rank: 1}, []Param{{Name: "w", Grad: make([]float32, 12), Shape: []int{5, 4}}}, "parameter 0 (w): shape [5 4] holds 20 elements but the parameter has 12"},
	} {
		_, err := New(c.Group(0), tc.params, Options{CommHook: PowerSGDHook(tc.opts)})
		if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want ErrInvalidArgument and %q", tc.opts, err, tc.want)
		}
	}
	h := PowerSGDHook(PowerSGDOptions{Rank: 1})
	r, err := New(c.Group(0), p(), Options{CommHook: h})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := New(c.Group(0), p(), Options{CommHook: h}); err == nil || !strings.Contains(err.Error(), "give each DDP its own hook") {
		t.Errorf("second Reducer: %v", err)
	}
	// Device buckets need device linear algebra: refused without it (a group whose
	// Device is no DeviceBLAS, or none).
	for _, ops := range []procgroup.Device{nil, deviceOnly{}} {
		err = PowerSGDHook(PowerSGDOptions{Rank: 1}).(ShapedHook).Setup(HookSetup{Device: true, DeviceOps: ops})
		if err == nil || !strings.Contains(err.Error(), "need device linear algebra (procgroup.DeviceBLAS") {
			t.Errorf("device without BLAS (%T): %v", ops, err)
		}
	}
	want := "powersgd(rank 2, min_compression_rate 2, start_iter 0, seed 7)"
	if got := DescribeHook(PowerSGDHook(PowerSGDOptions{Rank: 2, Seed: 7})); got != want {
		t.Errorf("DescribeHook: %q, want %q", got, want)
	}
}

// deviceOnly is a procgroup.Device without procgroup.DeviceBLAS (its methods are never
// called).
type deviceOnly struct{ procgroup.Device }

// psgdNopGroup is a ProcessGroup whose AllReduce completes at once, leaving the buffer as it
// is (the sum over one rank), without allocating.
type psgdNopGroup struct {
	procgroup.ProcessGroup
	done procgroup.Work
}

func (g psgdNopGroup) AllReduce(context.Context, any, procgroup.ReduceOp) procgroup.Work {
	return g.done
}

// TestPowerSGDNoAllocs: after a bucket's first launch, a step (Launch and Finish, even and
// odd) allocates nothing.
func TestPowerSGDNoAllocs(t *testing.T) {
	for _, dt := range []procgroup.DType{procgroup.Float32, procgroup.Float64} {
		h := PowerSGDHook(PowerSGDOptions{Rank: 2}).(*powerSGD)
		shapes := [][]int{{30, 20}, {7}, {4, 5, 6}}
		hp := make([]HookParam, len(shapes))
		total := 0
		b := &BucketView{DType: dt}
		for p, sh := range shapes {
			hp[p] = HookParam{Name: fmt.Sprint(p), DType: dt, Shape: sh}
			b.Params, b.Offsets = append(b.Params, p), append(b.Offsets, total)
			total += psgdSize(sh)
		}
		if err := h.Setup(HookSetup{Params: hp, WorldSize: 1}); err != nil {
			t.Fatal(err)
		}
		if dt == procgroup.Float32 {
			b.Buffer = make([]float32, total)
		} else {
			b.Buffer = make([]float64, total)
		}
		var g procgroup.ProcessGroup = psgdNopGroup{done: procgroup.Completed(nil)} // boxed once
		step := func() {
			if err := h.Launch(context.Background(), g, b).Wait(context.Background()); err != nil {
				t.Fatal(err)
			}
			if err := h.Finish(b); err != nil {
				t.Fatal(err)
			}
		}
		step()
		if n := testing.AllocsPerRun(10, step); n != 0 {
			t.Errorf("%v: %v allocations per step", dt, n)
		}
	}
}

// TestPowerSGDState: a run stopped after 3 steps, its hooks' states saved and restored into
// new Reducers with new hooks, ends steps 3 to 5 with the bits of the run that never
// stopped, on every rank; a state is refused by a hook of another rank, over other
// parameters, truncated, or before New.
func TestPowerSGDState(t *testing.T) {
	const ranks = 2
	shapes := [][]int{{12, 9}, {7}, {5, 8}}
	opts := PowerSGDOptions{Rank: 2, Seed: 8, MinCompressionRate: 1}
	rng := rand.New(rand.NewPCG(5, 6))
	grads := make([][][]float32, ranks) // rank, step: the gradients, flattened by parameter
	for w := range grads {
		for range 6 {
			var g []float32
			for _, sh := range shapes {
				for range psgdSize(sh) {
					g = append(g, float32(rng.NormFloat64()))
				}
			}
			grads[w] = append(grads[w], g)
		}
	}
	// run trains steps [from, to) on fresh Reducers, restoring states first if given, and
	// returns each rank's results per step and its hook's state at the end.
	run := func(from, to int, states [][]byte) (out [][][]float32, saved [][]byte) {
		steps := make([][][]float32, ranks)
		for w := range ranks {
			steps[w] = grads[w][from:to]
		}
		var restore func(int, *powerSGD) error
		if states != nil {
			restore = func(rank int, h *powerSGD) error { return h.UnmarshalBinary(states[rank]) }
		}
		out, hooks := psgdSteps(t, shapes, opts, steps, restore)
		saved = make([][]byte, ranks)
		for w, h := range hooks {
			var err error
			if saved[w], err = h.MarshalBinary(); err != nil {
				t.Fatal(err)
			}
		}
		return out, saved
	}
	whole, _ := run(0, 6, nil)
	_, saved := run(0, 3, nil)
	if slices.Equal(saved[0], saved[1]) {
		t.Fatal("the ranks' states are the same bytes: the errors should differ")
	}
	rest, _ := run(3, 6, saved)
	for w := range ranks {
		for s := range 3 {
			if !slices.Equal(rest[w][s], whole[w][3+s]) {
				t.Fatalf("rank %d step %d after the restore: %v, want %v", w, 3+s, rest[w][s], whole[w][3+s])
			}
		}
	}
	// Refusals.
	setup := func(o PowerSGDOptions, shapes [][]int) CommHook {
		h := PowerSGDHook(o)
		hp := make([]HookParam, len(shapes))
		for p, sh := range shapes {
			hp[p] = HookParam{DType: procgroup.Float32, Shape: sh}
		}
		if err := h.(ShapedHook).Setup(HookSetup{Params: hp}); err != nil {
			t.Fatal(err)
		}
		return h
	}
	type um = interface{ UnmarshalBinary([]byte) error }
	for _, tc := range []struct {
		h    CommHook
		data []byte
		want string
	}{
		{PowerSGDHook(opts), saved[0], "restore its state after New"},
		{setup(PowerSGDOptions{Rank: 1, MinCompressionRate: 1}, shapes), saved[0], "rank 2, but this hook's is 1"},
		{setup(opts, shapes[:2]), saved[0], "3 parameters, but this hook has 2"},
		{setup(opts, [][]int{{12, 9}, {7}, {8, 5}}), saved[0], "parameter 2 is a 5×8 matrix, but this hook's is 8×5"},
		{setup(opts, [][]int{{12, 9}, {7}, {40}}), saved[0], "parameter 2 is compressed, but not by this hook"},
		{setup(opts, shapes), saved[0][:len(saved[0])-1], "truncated at parameter 2"},
		{setup(opts, shapes), append(slices.Clone(saved[0]), 0), "1 bytes after the last parameter"},
		{setup(opts, shapes), []byte("nope"), "not a PowerSGD state"},
	} {
		if err := tc.h.(um).UnmarshalBinary(tc.data); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("UnmarshalBinary: %v, want %q", err, tc.want)
		}
	}
}
