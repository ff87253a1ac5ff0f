package gloo

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// TestPairExchange runs the two-rank socket all-reduce (Note [Inline exchange]) on random
// float data over TCP and over Unix sockets without shared memory, with frames from 8 bytes
// (every header boundary, a staging ring of 16 bytes) to the default, on counts that are
// and are not multiples of a frame, with several works in flight. Results must match a
// float64 reference and be bit-identical on both ranks.
func TestPairExchange(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  *Config
	}{
		{"tcp-seg8", &Config{Transport: TransportTCP, Algorithm: AlgoRing, SegmentSize: 8}},
		{"tcp-seg4104", &Config{Transport: TransportTCP, Algorithm: AlgoRing, SegmentSize: 4104}},
		{"tcp-default", &Config{Transport: TransportTCP}},
		{"unix-noshm-seg1000", &Config{Transport: TransportUnix, SharedMemory: ShmOff, Algorithm: AlgoRing, SegmentSize: 1000}},
	} {
		t.Run(c.name, func(t *testing.T) {
			groups := startGroups(t, 2, c.cfg)
			rng := rand.New(rand.NewPCG(7, uint64(len(c.name))))
			counts := []int{1, 3, 250, 1001, 4096, 70001}
			if c.name == "tcp-seg8" {
				counts = []int{1, 2, 3, 17, 300}
			}
			if c.name == "tcp-default" {
				counts = append(counts, 1<<18+5) // frames of 1 MiB, a partial one, ring wraps
			}
			for _, count := range counts {
				for _, op := range []procgroup.ReduceOp{procgroup.Sum, procgroup.Avg, procgroup.Max, procgroup.Prod} {
					var x [2][]float32
					var y [2][]float64
					for r := range 2 {
						x[r], y[r] = make([]float32, count), make([]float64, count)
						for i := range x[r] {
							x[r][i] = float32(rng.NormFloat64())
							y[r][i] = float64(x[r][i]) + rng.NormFloat64()
						}
					}
					want32, want64 := make([]float64, count), make([]float64, count)
					for i := range count {
						want32[i] = pairRef(op, float64(x[0][i]), float64(x[1][i]))
						want64[i] = pairRef(op, y[0][i], y[1][i])
					}
					// Two works in flight per rank, of different types.
					each(t, groups, func(r int, g procgroup.ProcessGroup) error {
						w1 := g.AllReduce(ctx, x[r], op)
						w2 := g.AllReduce(ctx, y[r], op)
						return errors.Join(wait(w1), wait(w2))
					})
					what := fmt.Sprintf("count %d %v", count, op)
					for i := range count {
						if math.Float32bits(x[0][i]) != math.Float32bits(x[1][i]) || math.Float64bits(y[0][i]) != math.Float64bits(y[1][i]) {
							t.Fatalf("%s: [%d] differs between ranks: %v %v, %v %v", what, i, x[0][i], x[1][i], y[0][i], y[1][i])
						}
						if d := math.Abs(float64(x[0][i]) - want32[i]); d > 1e-6*(1+math.Abs(want32[i])) {
							t.Fatalf("%s: float32 [%d] = %v, want %v", what, i, x[0][i], want32[i])
						}
						if d := math.Abs(y[0][i] - want64[i]); d > 1e-12*(1+math.Abs(want64[i])) {
							t.Fatalf("%s: float64 [%d] = %v, want %v", what, i, y[0][i], want64[i])
						}
					}
				}
			}
		})
	}
}

func pairRef(op procgroup.ReduceOp, a, b float64) float64 {
	switch op {
	case procgroup.Avg:
		return (a + b) / 2
	case procgroup.Max:
		return math.Max(a, b)
	case procgroup.Prod:
		return a * b
	}
	return a + b
}

// TestPairExchangeAbort: a rank that aborts while its peer is inside the exchange tells it
// why (an abort frame in place of a data frame's header), and the peer's work fails with
// ErrAborted carrying the reason, promptly.
func TestPairExchangeAbort(t *testing.T) {
	for _, tr := range []string{TransportTCP, TransportUnix} {
		t.Run(tr, func(t *testing.T) {
			groups := startGroupsNoCleanup(t, 2, &Config{Transport: tr, SharedMemory: ShmOff})
			w := groups[1].AllReduce(ctx, make([]float32, 4<<20), procgroup.Sum)
			time.Sleep(50 * time.Millisecond)
			start := time.Now()
			groups[0].Abort(errors.New("operator pressed stop"))
			err := wait(w)
			if !errors.Is(err, procgroup.ErrAborted) || !strings.Contains(err.Error(), "operator pressed stop") {
				t.Errorf("got %v; want ErrAborted with the reason", err)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("failed after %v", d)
			}
			groups[1].Abort(nil)
		})
	}
}

// TestPairExchangeMismatch: ranks that issue all-reduces of different lengths get a clear
// error, not a hang or a crash.
func TestPairExchangeMismatch(t *testing.T) {
	groups := startGroupsNoCleanup(t, 2, &Config{Transport: TransportTCP, PollInterval: 50 * time.Millisecond})
	defer func() {
		for _, g := range groups {
			g.Abort(nil)
		}
	}()
	w0 := groups[0].AllReduce(ctx, make([]float32, 1<<18), procgroup.Sum)
	w1 := groups[1].AllReduce(ctx, make([]float32, 1<<18+2), procgroup.Sum)
	err0, err1 := wait(w0), wait(w1)
	if !errors.Is(err0, procgroup.ErrInvalidArgument) && !errors.Is(err1, procgroup.ErrInvalidArgument) {
		t.Fatalf("got %v and %v; want ErrInvalidArgument on at least one rank", err0, err1)
	}
	if err0 == nil || err1 == nil {
		t.Fatalf("got %v and %v; want both to fail", err0, err1)
	}
}

// TestRingSockets runs the socket ring all-reduce of three to five ranks on random float
// data over TCP and over Unix sockets without shared
// memory, with frames from 8 bytes to the default and counts with empty, odd and
// multi-frame chunks, two works in flight. Results match a float64 reference and are
// bit-identical on every rank.
func TestRingSockets(t *testing.T) {
	for _, c := range []struct {
		name string
		size int
		cfg  *Config
	}{
		{"tcp-n3-seg8", 3, &Config{Transport: TransportTCP, Algorithm: AlgoRing, SegmentSize: 8}},
		{"tcp-n4-seg1000", 4, &Config{Transport: TransportTCP, Algorithm: AlgoRing, SegmentSize: 1000}},
		{"unix-noshm-n5-seg4104", 5, &Config{Transport: TransportUnix, SharedMemory: ShmOff, Algorithm: AlgoRing, SegmentSize: 4104}},
		{"tcp-n3-default", 3, &Config{Transport: TransportTCP}},
	} {
		t.Run(c.name, func(t *testing.T) {
			n := c.size
			groups := startGroups(t, n, c.cfg)
			rng := rand.New(rand.NewPCG(11, uint64(n)))
			counts := []int{1, 2, 5, 7, 250, 1001, 30001}
			if c.name == "tcp-n3-seg8" {
				counts = counts[:5]
			}
			if c.name == "tcp-n3-default" {
				counts = append(counts, 1<<19+3) // float64 chunks of two frames
			}
			for _, count := range counts {
				for _, op := range []procgroup.ReduceOp{procgroup.Sum, procgroup.Avg, procgroup.Min, procgroup.Prod} {
					x := make([][]float32, n)
					y := make([][]float64, n)
					for r := range n {
						x[r], y[r] = make([]float32, count), make([]float64, count)
						for i := range count {
							x[r][i] = float32(1 + rng.Float64())
							y[r][i] = rng.NormFloat64()
						}
					}
					want32, want64 := make([]float64, count), make([]float64, count)
					for i := range count {
						a, b := float64(x[0][i]), y[0][i]
						for r := 1; r < n; r++ {
							switch op {
							case procgroup.Sum, procgroup.Avg:
								a, b = a+float64(x[r][i]), b+y[r][i]
							case procgroup.Min:
								a, b = math.Min(a, float64(x[r][i])), math.Min(b, y[r][i])
							case procgroup.Prod:
								a, b = a*float64(x[r][i]), b*y[r][i]
							}
						}
						if op == procgroup.Avg {
							a, b = a/float64(n), b/float64(n)
						}
						want32[i], want64[i] = a, b
					}
					each(t, groups, func(r int, g procgroup.ProcessGroup) error {
						w1 := g.AllReduce(ctx, x[r], op)
						w2 := g.AllReduce(ctx, y[r], op)
						return errors.Join(wait(w1), wait(w2))
					})
					what := fmt.Sprintf("count %d %v", count, op)
					for i := range count {
						for r := 1; r < n; r++ {
							if math.Float32bits(x[r][i]) != math.Float32bits(x[0][i]) || math.Float64bits(y[r][i]) != math.Float64bits(y[0][i]) {
								t.Fatalf("%s: [%d] differs between ranks 0 and %d", what, i, r)
							}
						}
						if d := math.Abs(float64(x[0][i]) - want32[i]); d > 1e-5*(1+math.Abs(want32[i])) {
							t.Fatalf("%s: float32 [%d] = %v, want %v", what, i, x[0][i], want32[i])
						}
						if d := math.Abs(y[0][i] - want64[i]); d > 1e-12*(1+math.Abs(want64[i])) {
							t.Fatalf("%s: float64 [%d] = %v, want %v", what, i, y[0][i], want64[i])
						}
					}
				}
			}
		})
	}
}
