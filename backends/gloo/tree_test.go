package gloo

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/goddp/goddp/procgroup"
)

// treeRef combines xs (in ring-position order) as Note [One association] says, written
// out recursively: fold the first 2e in pairs, then halve the list pairwise.
func treeRef(xs [][]float32, comb func(a, b float32) float32) []float32 {
	n := len(xs)
	p := 1
	for p*2 <= n {
		p *= 2
	}
	e := n - p
	pair := func(a, b []float32) []float32 {
		out := make([]float32, len(a))
		for i := range a {
			out[i] = comb(a[i], b[i])
		}
		return out
	}
	var level [][]float32
	for v := range p {
		if v < e {
			level = append(level, pair(xs[2*v], xs[2*v+1]))
		} else {
			level = append(level, xs[v+e])
		}
	}
	for len(level) > 1 {
		var next [][]float32
		for i := 0; i < len(level); i += 2 {
			next = append(next, pair(level[i], level[i+1]))
		}
		level = next
	}
	return level[0]
}

// wideFloats are float32 values over many binades, so that the association of a sum
// shows in its bits.
func wideFloats(rng *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64() * math.Pow(2, float64(rng.IntN(40)-20)))
	}
	return x
}

// TestOneAssociation: direct (over sockets and over shared memory) and recursive doubling
// give bit for bit the sum that Note [One association]'s tree gives, for world sizes 2 to
// 7, with the ranks in rank order and placed round-robin on two simulated hosts (where the
// ring order, and so the tree's leaves, differ from rank order); Max and Avg agree between
// the algorithms too.
func TestOneAssociation(t *testing.T) {
	for n := 2; n <= 7; n++ {
		for _, place := range []string{"one host", "round-robin"} {
			hosts := make([]string, n)
			for r := range hosts {
				hosts[r] = "a"
				if place == "round-robin" {
					hosts[r] = string(rune('a' + r%2))
				}
			}
			t.Run(fmt.Sprintf("n%d/%s", n, place), func(t *testing.T) {
				results := map[string][][]float32{} // algorithm → op → rank 0's result
				var ring []int
				rng := rand.New(rand.NewPCG(uint64(n), 7))
				const count = 3001
				xs := make([][]float32, n)
				for r := range xs {
					xs[r] = wideFloats(rng, count)
				}
				algos := []struct{ name, algo, transport string }{
					{"direct over sockets", AlgoDirect, TransportTCP},
					{"recursive doubling", AlgoRD, TransportTCP},
				}
				if place == "one host" {
					algos = append(algos, struct{ name, algo, transport string }{"direct over shared memory", AlgoDirect, TransportUnix})
				}
				for _, a := range algos {
					cfg := Config{Algorithm: a.algo, Transport: a.transport, Tune: TuneOff, SegmentSize: 4096, InlineMaxBytes: 1024}
					if a.transport == TransportTCP {
						cfg.SharedMemory = ShmOff
					}
					groups := startGroupsHosts(t, hosts, cfg)
					ring = groups[0].(*group).ring
					for _, op := range []procgroup.ReduceOp{procgroup.Sum, procgroup.Max, procgroup.Avg} {
						bufs := make([][]float32, n)
						each(t, groups, func(r int, g procgroup.ProcessGroup) error {
							bufs[r] = append([]float32(nil), xs[r]...)
							return wait(g.AllReduce(ctx, bufs[r], op))
						})
						for r, g := range groups {
							want := map[string]string{AlgoRD: "rd", AlgoDirect: "direct"}[a.algo]
							if a.transport == TransportUnix {
								want = "shm-direct"
							}
							if p := g.(*group).lastPath; p != want {
								t.Fatalf("%s: rank %d took %q, want %q", a.name, r, p, want)
							}
							for i := range bufs[r] {
								if math.Float32bits(bufs[r][i]) != math.Float32bits(bufs[0][i]) {
									t.Fatalf("%s %v: rank %d element %d is %v, rank 0 has %v", a.name, op, r, i, bufs[r][i], bufs[0][i])
								}
							}
						}
						results[a.name] = append(results[a.name], bufs[0])
					}
				}
				ordered := make([][]float32, n)
				for q, r := range ring {
					ordered[q] = xs[r]
				}
				sum := treeRef(ordered, func(a, b float32) float32 { return a + b })
				differs := false
				for _, a := range algos {
					got := results[a.name][0]
					for i := range got {
						if math.Float32bits(got[i]) != math.Float32bits(sum[i]) {
							t.Fatalf("%s: sum element %d is %v, the tree gives %v", a.name, i, got[i], sum[i])
						}
					}
					for k := range results[a.name] {
						for i, v := range results[a.name][k] {
							if w := results[algos[0].name][k][i]; math.Float32bits(v) != math.Float32bits(w) {
								t.Fatalf("%s op %d: element %d is %v, %s gives %v", a.name, k, i, v, algos[0].name, w)
							}
						}
					}
				}
				// The test data must be able to tell associations apart.
				left := append([]float32(nil), ordered[0]...)
				for _, x := range ordered[1:] {
					for i := range left {
						left[i] += x[i]
					}
				}
				for i := range left {
					differs = differs || math.Float32bits(left[i]) != math.Float32bits(sum[i])
				}
				if n >= 4 && !differs { // for n = 3 the tree is the rank order
					t.Fatal("the data sum to the same bits in rank order and in the tree: a weak test")
				}
			})
		}
	}
}

// TestFitLine: the calibration's least squares recover a line, and a falling one is
// clamped to a constant.
func TestFitLine(t *testing.T) {
	xs := []int{4 << 10, 16 << 10, 64 << 10, 256 << 10}
	ts := make([]float64, len(xs))
	for i, x := range xs {
		ts[i] = 30e-6 + 2e-9*float64(x)
	}
	if a, b := fitLine(xs, ts); math.Abs(a-30e-6) > 1e-12 || math.Abs(b-2e-9) > 1e-15 {
		t.Errorf("fitLine = %g, %g; want 3e-05, 2e-09", a, b)
	}
	if a, b := fitLine(xs, []float64{4e-3, 3e-3, 2e-3, 1e-3}); b != 0 || a <= 1e-3 || a >= 4e-3 {
		t.Errorf("falling times: fitLine = %g, %g; want a constant between them, 0", a, b)
	}
	// One slow outlier at the smallest size moves α, not β much; relative weighting keeps
	// the small sizes from being swamped by the large ones.
	ts[0] *= 1.5
	if a, b := fitLine(xs, ts); a <= 30e-6 || math.Abs(b-2e-9) > 0.2e-9 {
		t.Errorf("with an outlier: fitLine = %g, %g; want α above 3e-05, β near 2e-09", a, b)
	}
	m := &costModel{algos: []algoCost{{"direct", 10e-6, 4e-9}, {"rd", 30e-6, 2e-9}, {"ring", 200e-6, 0.5e-9}}, ring: "hier", limit: 4 << 20}
	for _, c := range []struct {
		n    int
		want string
	}{{1 << 10, "direct"}, {20 << 10, "rd"}, {1 << 20, "ring"}, {8 << 20, "hier"}} {
		if got := m.choose(c.n); got != c.want {
			t.Errorf("choose(%d) = %q, want %q (%s)", c.n, got, c.want, m)
		}
	}
}

// TestCalibratedChoice: a group across (simulated) hosts calibrates Note [Algorithm
// choice]'s model at New; every rank holds the same table, reports and takes its choice at
// every size, and gets the right sums. An explicit algorithm or Tune off keeps the rules.
func TestCalibratedChoice(t *testing.T) {
	hosts := []string{"a", "a", "b", "b"}
	groups := startGroupsHosts(t, hosts, Config{})
	m0 := groups[0].(*group).model
	if m0 == nil {
		t.Fatal("a group across hosts did not calibrate")
	}
	var paths []string
	for _, a := range m0.algos {
		paths = append(paths, a.path)
	}
	if got := strings.Join(paths, ","); got != "direct,rd,hierarchical" {
		t.Errorf("candidates %s, want direct,rd,hierarchical", got)
	}
	for r, g := range groups {
		if m := g.(*group).model; m == nil || m.String() != m0.String() {
			t.Fatalf("rank %d's model %v differs from rank 0's %v", r, m, m0)
		}
	}
	t.Logf("model: %s (calibrated in %v)", m0, m0.took)
	for _, count := range []int{1, 1000, 16 << 10, 256 << 10, 1 << 20} {
		want := m0.choose(4 * count)
		xs := inputs(uint64(count), len(hosts), count, procgroup.Sum)
		bufs := make([]any, len(hosts))
		each(t, groups, func(r int, g procgroup.ProcessGroup) error {
			if name, _, _ := procgroup.AllReduceAlgorithm(g, make([]float32, count)); name != want {
				return fmt.Errorf("%d floats: reported %q, the model chooses %q", count, name, want)
			}
			bufs[r] = toBuf(procgroup.Float32, xs[r])
			return wait(g.AllReduce(ctx, bufs[r], procgroup.Sum))
		})
		for r, g := range groups {
			if p := g.(*group).lastPath; p != want {
				t.Errorf("%d floats: rank %d took %q, the model chooses %q", count, r, p, want)
			}
			checkClose(t, fmt.Sprintf("%d floats rank %d", count, r), procgroup.Float32, procgroup.Sum, fromBuf(bufs[r]), reduceRef(xs, procgroup.Sum))
		}
	}
	for _, cfg := range []Config{{Tune: TuneOff}, {Algorithm: AlgoHier}} {
		gs := startGroupsHosts(t, hosts, cfg)
		for r, g := range gs {
			if m := g.(*group).model; m != nil {
				t.Errorf("%+v: rank %d calibrated %v", cfg, r, m)
			}
		}
	}
	// One rank with Tune off: the ranks agree, and none calibrates (a rank that skipped the
	// calibration's collectives would match them against its first ones of the user's).
	mixed := startGroupsCfg(t, len(hosts), func(r int) *Config {
		c := &Config{HostID: hosts[r]}
		if r == 3 {
			c.Tune = TuneOff
		}
		return c
	}, nil, 0)
	t.Cleanup(func() {
		for _, g := range mixed {
			g.Close()
		}
	})
	xs := inputs(5, len(hosts), 3000, procgroup.Sum)
	bufs := make([]any, len(hosts))
	each(t, mixed, func(r int, g procgroup.ProcessGroup) error {
		if m := g.(*group).model; m != nil {
			return fmt.Errorf("calibrated %v though rank 3 has Tune off", m)
		}
		bufs[r] = toBuf(procgroup.Float32, xs[r])
		return wait(g.AllReduce(ctx, bufs[r], procgroup.Sum))
	})
	for r := range mixed {
		checkClose(t, fmt.Sprintf("mixed Tune rank %d", r), procgroup.Float32, procgroup.Sum, fromBuf(bufs[r]), reduceRef(xs, procgroup.Sum))
	}
	one := startGroupsHosts(t, []string{"a", "a", "a"}, Config{})
	if m := one[0].(*group).model; m != nil {
		t.Errorf("a group on one host calibrated %v", m)
	}
}
