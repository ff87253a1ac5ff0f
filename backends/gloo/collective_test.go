package gloo

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/goddp/goddp/procgroup"
)

var ctx = context.Background()

// inputs returns size random float64 vectors of count small integers (exact in every
// element type, products stay small).
func inputs(seed uint64, size, count int, op procgroup.ReduceOp) [][]float64 {
	rng := rand.New(rand.NewPCG(seed, uint64(size*1000+count)))
	x := make([][]float64, size)
	for r := range x {
		x[r] = make([]float64, count)
		for i := range x[r] {
			if op == procgroup.Prod {
				x[r][i] = float64(rng.IntN(3) + 1)
			} else {
				x[r][i] = float64(rng.IntN(41) - 20)
			}
		}
	}
	return x
}

func reduceRef(x [][]float64, op procgroup.ReduceOp) []float64 {
	out := append([]float64(nil), x[0]...)
	for _, v := range x[1:] {
		for i := range out {
			switch op {
			case procgroup.Sum, procgroup.Avg:
				out[i] += v[i]
			case procgroup.Prod:
				out[i] *= v[i]
			case procgroup.Min:
				out[i] = math.Min(out[i], v[i])
			case procgroup.Max:
				out[i] = math.Max(out[i], v[i])
			}
		}
	}
	if op == procgroup.Avg {
		for i := range out {
			out[i] /= float64(len(x))
		}
	}
	return out
}

func toBuf(dt procgroup.DType, v []float64) any {
	switch dt {
	case procgroup.Float32:
		b := make([]float32, len(v))
		for i, x := range v {
			b[i] = float32(x)
		}
		return b
	case procgroup.Float64:
		return append([]float64(nil), v...)
	case procgroup.Int32:
		b := make([]int32, len(v))
		for i, x := range v {
			b[i] = int32(x)
		}
		return b
	case procgroup.Int64:
		b := make([]int64, len(v))
		for i, x := range v {
			b[i] = int64(x)
		}
		return b
	case procgroup.BFloat16:
		b := make([]procgroup.BF16, len(v))
		for i, x := range v {
			b[i] = procgroup.BF16FromFloat32(float32(x))
		}
		return b
	case procgroup.Float16:
		b := make([]procgroup.F16, len(v))
		for i, x := range v {
			b[i] = procgroup.F16FromFloat32(float32(x))
		}
		return b
	}
	panic(dt)
}

func fromBuf(buf any) []float64 {
	var out []float64
	switch b := buf.(type) {
	case []float32:
		for _, x := range b {
			out = append(out, float64(x))
		}
	case []float64:
		out = append(out, b...)
	case []int32:
		for _, x := range b {
			out = append(out, float64(x))
		}
	case []int64:
		for _, x := range b {
			out = append(out, float64(x))
		}
	case []procgroup.BF16:
		for _, x := range b {
			out = append(out, float64(x.Float32()))
		}
	case []procgroup.F16:
		for _, x := range b {
			out = append(out, float64(x.Float32()))
		}
	}
	return out
}

func checkClose(t *testing.T, what string, dt procgroup.DType, op procgroup.ReduceOp, got, want []float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d elements, want %d", what, len(got), len(want))
	}
	for i := range want {
		w := want[i]
		if op == procgroup.Avg && (dt == procgroup.Int32 || dt == procgroup.Int64) {
			w = math.Trunc(w)
		}
		tol := 1e-9 * math.Abs(w)
		switch dt {
		case procgroup.BFloat16:
			tol = 1.0/64*math.Abs(w) + 1e-6
		case procgroup.Float16:
			tol = 1.0/512*math.Abs(w) + 1e-6
		case procgroup.Float32:
			tol = 1e-6*math.Abs(w) + 1e-6
		}
		if math.Abs(got[i]-w) > tol {
			t.Fatalf("%s: [%d] = %v, want %v", what, i, got[i], w)
		}
	}
}

type variant struct {
	name string
	cfg  *Config
}

var variants = []variant{
	{"unix-auto", &Config{Transport: TransportUnix, SegmentSize: 64}},
	{"tcp-ring", &Config{Transport: TransportTCP, Algorithm: AlgoRing, SegmentSize: 40}},
	{"unix-direct", &Config{Transport: TransportUnix, Algorithm: AlgoDirect, SegmentSize: 48, InlineMaxBytes: 16}},
	{"tcp-direct", &Config{Transport: TransportTCP, Algorithm: AlgoDirect}},
}

// TestCollectives checks every collective against a float64 reference, for world sizes
// 1-5, both transports and both algorithms, with tiny segments so that pipelining, empty
// chunks and segment boundaries are exercised on small buffers.
func TestCollectives(t *testing.T) {
	counts := []int{0, 1, 2, 7, 13, 64, 101}
	for _, v := range variants {
		for size := 1; size <= 5; size++ {
			t.Run(fmt.Sprintf("%s/n%d", v.name, size), func(t *testing.T) {
				groups := startGroups(t, size, v.cfg)
				checkCollectives(t, groups, counts)
			})
		}
	}
}

// checkCollectives runs every collective on groups (all ranks of one group) for every
// element type, op and count, against a float64 reference, and ends with a barrier.
func checkCollectives(t *testing.T, groups []procgroup.ProcessGroup, counts []int) {
	size := len(groups)
	seed := uint64(0)
	for _, dt := range procgroup.DTypes {
		for _, op := range procgroup.ReduceOps {
			for _, count := range counts {
				seed++
				x := inputs(seed, size, count, op)
				want := reduceRef(x, op)
				bufs := make([]any, size)
				each(t, groups, func(r int, g procgroup.ProcessGroup) error {
					bufs[r] = toBuf(dt, x[r])
					return wait(g.AllReduce(ctx, bufs[r], op))
				})
				for r := range size {
					checkClose(t, fmt.Sprintf("allreduce %v %v count %d rank %d", dt, op, count, r), dt, op, fromBuf(bufs[r]), want)
				}
			}
		}
		for _, count := range counts {
			seed++
			x := inputs(seed, size, count*size, procgroup.Sum)
			// ReduceScatter with Sum and Max.
			for _, op := range []procgroup.ReduceOp{procgroup.Sum, procgroup.Max, procgroup.Avg} {
				want := reduceRef(x, op)
				outs := make([]any, size)
				each(t, groups, func(r int, g procgroup.ProcessGroup) error {
					outs[r] = toBuf(dt, make([]float64, count))
					return wait(g.ReduceScatter(ctx, outs[r], toBuf(dt, x[r]), op))
				})
				for r := range size {
					checkClose(t, fmt.Sprintf("reducescatter %v %v count %d rank %d", dt, op, count, r), dt, op, fromBuf(outs[r]), want[r*count:(r+1)*count])
				}
				// In place: out is rank r's own block of in.
				each(t, groups, func(r int, g procgroup.ProcessGroup) error {
					in := toBuf(dt, x[r])
					outs[r] = procgroup.SliceBuffer(in, r*count, (r+1)*count)
					return wait(g.ReduceScatter(ctx, outs[r], in, op))
				})
				for r := range size {
					checkClose(t, fmt.Sprintf("reducescatter in place %v %v count %d rank %d", dt, op, count, r), dt, op, fromBuf(outs[r]), want[r*count:(r+1)*count])
				}
			}
			// AllGather.
			y := inputs(seed+1000, size, count, procgroup.Sum)
			var wantAG []float64
			for r := range size {
				wantAG = append(wantAG, y[r]...)
			}
			outs := make([]any, size)
			each(t, groups, func(r int, g procgroup.ProcessGroup) error {
				outs[r] = toBuf(dt, make([]float64, count*size))
				return wait(g.AllGather(ctx, outs[r], toBuf(dt, y[r])))
			})
			for r := range size {
				checkClose(t, fmt.Sprintf("allgather %v count %d rank %d", dt, count, r), dt, procgroup.Sum, fromBuf(outs[r]), wantAG)
			}
			// In place: in is rank r's own slot of out, whose other slots start as 99s.
			each(t, groups, func(r int, g procgroup.ProcessGroup) error {
				o := slices.Repeat([]float64{99}, count*size)
				copy(o[r*count:], y[r])
				outs[r] = toBuf(dt, o)
				return wait(g.AllGather(ctx, outs[r], procgroup.SliceBuffer(outs[r], r*count, (r+1)*count)))
			})
			for r := range size {
				checkClose(t, fmt.Sprintf("allgather in place %v count %d rank %d", dt, count, r), dt, procgroup.Sum, fromBuf(outs[r]), wantAG)
			}
			// Broadcast from every root.
			for root := range size {
				bufs := make([]any, size)
				each(t, groups, func(r int, g procgroup.ProcessGroup) error {
					bufs[r] = toBuf(dt, y[r])
					return wait(g.Broadcast(ctx, bufs[r], root))
				})
				for r := range size {
					checkClose(t, fmt.Sprintf("broadcast %v count %d root %d rank %d", dt, count, root, r), dt, procgroup.Sum, fromBuf(bufs[r]), y[root])
				}
			}
		}
	}
	each(t, groups, func(r int, g procgroup.ProcessGroup) error { return wait(g.Barrier(ctx)) })
}

// TestRingOrder: hosts in the order of their lowest rank, each host's ranks together and
// ascending (Note [Ring order]).
func TestRingOrder(t *testing.T) {
	for _, tc := range []struct {
		hosts []string
		want  []int
	}{
		{[]string{"a", "a", "b", "b"}, []int{0, 1, 2, 3}},
		{[]string{"a", "b", "a", "b"}, []int{0, 2, 1, 3}},
		{[]string{"a", "b", "b", "a", "c"}, []int{0, 3, 1, 2, 4}},
		{[]string{"x", "y", "z"}, []int{0, 1, 2}},
		{[]string{"h"}, []int{0}},
	} {
		if got := ringOrder(tc.hosts); !slices.Equal(got, tc.want) {
			t.Errorf("ringOrder(%v) = %v, want %v", tc.hosts, got, tc.want)
		}
	}
}

// TestHostPlacements: every collective is right however the ranks sit on (simulated)
// hosts: contiguous with three ranks a host (whose middle rank has both ring neighbours on
// its host while the others do not), round-robin, and mixed; with the flat ring, with Note
// [Hierarchical]'s rings where the placement allows them (in tiny segments, and with the
// defaults). The ring visits each host's ranks together, and the group reports the
// transports and the algorithm the placement implies.
func TestHostPlacements(t *testing.T) {
	for _, hosts := range [][]string{
		{"a", "a", "a", "b", "b", "b"},
		{"a", "b", "a", "b"},
		{"a", "b", "b", "a", "c"},
	} {
		uniform := len(hosts) != 5 // two hosts with the same number of ranks each
		for _, cfg := range []Config{
			{Algorithm: AlgoRing, SegmentSize: 64, ShmSlotSize: 64, ShmSlots: 2},
			// The fixed rules (TestCalibratedChoice covers the calibrated model): the rings
			// for almost every count, in tiny segments; and the rules' defaults.
			{DirectMaxBytes: 8, SegmentSize: 64, Tune: TuneOff},
			// and with Note [Hierarchical pipeline] in pieces of 256 bytes.
			{DirectMaxBytes: 8, SegmentSize: 64, Tune: TuneOff, HierPieceSize: 256, ShmSlotSize: 64},
			{Tune: TuneOff},
		} {
			t.Run(fmt.Sprintf("%v/%s/direct%d", hosts, cfg.Algorithm, cfg.DirectMaxBytes), func(t *testing.T) {
				groups := startGroupsHosts(t, hosts, cfg)
				want := ringOrder(hosts)
				wantAlgo := "ring"
				if uniform && cfg.Algorithm != AlgoRing {
					wantAlgo = "hierarchical"
				}
				for r, g := range groups {
					if got := g.(*group).ring; !slices.Equal(got, want) {
						t.Fatalf("rank %d: ring %v, want %v", r, got, want)
					}
					if name, _, _ := procgroup.AllReduceAlgorithm(g, make([]float32, 1<<18)); name != wantAlgo {
						t.Errorf("rank %d: a 1 MiB all-reduce takes %q, want %q", r, name, wantAlgo)
					}
					for j, tr := range procgroup.Transports(g) {
						same := hosts[j] == hosts[r]
						if j != r && same == strings.HasPrefix(tr, "tcp") {
							t.Errorf("rank %d reaches rank %d (host %s, its own %s) over %q", r, j, hosts[j], hosts[r], tr)
						}
					}
				}
				// In 64-byte segments, 5000 elements already take every ring through tens
				// of segments per chunk (and the 256-byte pieces through tens of pieces);
				// 20000 is for the default segment and pieces, where it is the one count
				// that leaves the direct exchange for the rings.
				counts := []int{0, 1, 7, 101, 5000, 20000}
				if cfg.SegmentSize == 64 {
					counts = counts[:5]
				}
				checkCollectives(t, groups, counts)
				// The path the worker took, not only the one reported.
				each(t, groups, func(r int, g procgroup.ProcessGroup) error {
					return wait(g.AllReduce(ctx, make([]float32, 1<<18), procgroup.Sum))
				})
				for r, g := range groups {
					if p := g.(*group).lastPath; p != wantAlgo {
						t.Errorf("rank %d: a 1 MiB all-reduce ran %q, want %q", r, p, wantAlgo)
					}
				}
				// Reduce-scatter and all-gather take Note [Hierarchical blocks]'s rings on
				// the same placements, and the flat ring elsewhere ("" for it), out of place
				// and in place, with right results.
				wantBlocks := ""
				if wantAlgo == "hierarchical" {
					wantBlocks = wantAlgo
				}
				n, count := len(hosts), 1<<16
				x := inputs(uint64(n), n, n*count, procgroup.Sum)
				sum := reduceRef(x, procgroup.Sum)
				for _, k := range []string{"reduce-scatter", "all-gather"} {
					for _, inPlace := range []bool{false, true} {
						outs := make([]any, n)
						each(t, groups, func(r int, g procgroup.ProcessGroup) error {
							if k == "reduce-scatter" {
								in := toBuf(procgroup.Float32, x[r])
								outs[r] = make([]float32, count)
								if inPlace {
									outs[r] = procgroup.SliceBuffer(in, r*count, (r+1)*count)
								}
								return wait(g.ReduceScatter(ctx, outs[r], in, procgroup.Sum))
							}
							o := toBuf(procgroup.Float32, x[r])
							in := procgroup.SliceBuffer(o, r*count, (r+1)*count)
							if !inPlace {
								in, o = toBuf(procgroup.Float32, x[r][r*count:(r+1)*count]), make([]float32, n*count)
							}
							outs[r] = o
							return wait(g.AllGather(ctx, o, in))
						})
						for r, g := range groups {
							if p := g.(*group).lastPath; p != wantBlocks {
								t.Errorf("rank %d: a %d KiB %s (in place %t) ran %q, want %q", r, n<<8, k, inPlace, p, wantBlocks)
							}
							what := fmt.Sprintf("%s in place %t rank %d", k, inPlace, r)
							if k == "reduce-scatter" {
								checkClose(t, what, procgroup.Float32, procgroup.Sum, fromBuf(outs[r]), sum[r*count:(r+1)*count])
								continue
							}
							var want []float64
							for j := range n {
								want = append(want, x[j][j*count:(j+1)*count]...)
							}
							checkClose(t, what, procgroup.Float32, procgroup.Sum, fromBuf(outs[r]), want)
						}
					}
				}
			})
		}
	}
}
