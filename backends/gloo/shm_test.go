//go:build linux

package gloo

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// TestShmAllReduce checks the shared-memory ring against a float64 reference, for world
// sizes 1-5, every element type and op, with slots far smaller than the buffers (so that
// segments wrap around the slots, a single slot stalls the sender, and chunks are empty
// when count < size), and many works in flight at once.
func TestShmAllReduce(t *testing.T) {
	counts := []int{0, 1, 2, 7, 13, 64, 101, 1000}
	for _, v := range []variant{
		{"slot64x1", &Config{Transport: TransportUnix, Algorithm: AlgoRing, ShmSlotSize: 64, ShmSlots: 1}},
		{"slot128x3", &Config{Transport: TransportUnix, Algorithm: AlgoRing, ShmSlotSize: 128, ShmSlots: 3}},
		{"direct-slot256x2", &Config{Transport: TransportUnix, Algorithm: AlgoDirect, ShmSlotSize: 256, ShmSlots: 2}},
	} {
		for size := 1; size <= 5; size++ {
			t.Run(fmt.Sprintf("%s/n%d", v.name, size), func(t *testing.T) {
				groups := startGroups(t, size, v.cfg)
				for _, g := range groups {
					if size > 1 && !g.(*group).useShmRing() {
						t.Fatalf("rank %d does not use shared memory", g.Rank())
					}
				}
				seed := uint64(0)
				for _, dt := range procgroup.DTypes {
					for _, op := range procgroup.ReduceOps {
						// All counts in flight at once, issued in the same order everywhere.
						xs := make([][][]float64, len(counts))
						bufs := make([][]any, len(counts))
						for i, count := range counts {
							seed++
							xs[i] = inputs(seed, size, count, op)
							bufs[i] = make([]any, size)
						}
						each(t, groups, func(r int, g procgroup.ProcessGroup) error {
							works := make([]procgroup.Work, len(counts))
							for i := range counts {
								bufs[i][r] = toBuf(dt, xs[i][r])
								works[i] = g.AllReduce(ctx, bufs[i][r], op)
							}
							for _, w := range works {
								if err := wait(w); err != nil {
									return err
								}
							}
							return nil
						})
						for i, count := range counts {
							want := reduceRef(xs[i], op)
							for r := range size {
								checkClose(t, fmt.Sprintf("allreduce %v %v count %d rank %d", dt, op, count, r), dt, op, fromBuf(bufs[i][r]), want)
							}
						}
					}
				}
			})
		}
	}
}

// TestShmLarge: default slots, a buffer of several segments per chunk, identical bits on
// every rank, mixed with socket collectives between the shared-memory ones.
func TestShmLarge(t *testing.T) {
	for _, size := range []int{2, 3} {
		groups := startGroups(t, size, &Config{})
		const count = 300_001
		x := inputs(uint64(size), size, count, procgroup.Sum)
		want := reduceRef(x, procgroup.Sum)
		bufs := make([][]float32, size)
		small := make([][]float64, size)
		each(t, groups, func(r int, g procgroup.ProcessGroup) error {
			bufs[r] = toBuf(procgroup.Float32, x[r]).([]float32)
			small[r] = []float64{float64(r), 1}
			w1 := g.AllReduce(ctx, bufs[r], procgroup.Sum)
			w2 := g.AllReduce(ctx, small[r], procgroup.Sum)
			w3 := g.Barrier(ctx)
			return errors.Join(wait(w1), wait(w2), wait(w3))
		})
		if !groups[0].(*group).useShmRing() {
			t.Fatal("no shared memory")
		}
		for r := range size {
			checkClose(t, fmt.Sprintf("n=%d rank %d", size, r), procgroup.Float32, procgroup.Sum, fromBuf(bufs[r]), want)
			for i := range bufs[r] {
				if bufs[r][i] != bufs[0][i] {
					t.Fatalf("n=%d: rank %d [%d] = %v, rank 0 has %v", size, r, i, bufs[r][i], bufs[0][i])
				}
			}
			if small[r][0] != float64(size*(size-1)/2) || small[r][1] != float64(size) {
				t.Fatalf("rank %d: small all-reduce %v", r, small[r])
			}
		}
	}
}

// TestShmOff: SharedMemory "off" (or GODDP_GLOO_SHM=off) keeps the data on the sockets;
// TCP never shares memory.
func TestShmOff(t *testing.T) {
	for _, c := range []struct {
		cfg *Config
		env string
	}{
		{&Config{Transport: TransportUnix, SharedMemory: ShmOff}, ""},
		{&Config{Transport: TransportUnix}, "off"},
		{&Config{Transport: TransportTCP}, ""},
	} {
		t.Setenv("GODDP_GLOO_SHM", c.env)
		groups := startGroups(t, 2, c.cfg)
		if groups[0].(*group).shm != nil || groups[1].(*group).shm != nil {
			t.Errorf("%+v env %q: shared memory in use", *c.cfg, c.env)
		}
		checkAllReduce(t, groups, 100_000)
	}
	t.Setenv("GODDP_GLOO_SHM", "sometimes")
	if _, err := procgroup.New(ctx, "gloo", procgroup.Options{Rank: 0, Size: 1, Store: procgroup.NewMemStore()}); !errors.Is(err, procgroup.ErrInvalidArgument) {
		t.Errorf("bad GODDP_GLOO_SHM: %v", err)
	}
}

// TestShmAbort: a rank that aborts while its peers wait on shared memory fails them at
// once with an error naming it and its reason.
func TestShmAbort(t *testing.T) {
	groups := startGroupsNoCleanup(t, 3, &Config{Transport: TransportUnix, PollInterval: time.Minute})
	works := []procgroup.Work{
		groups[0].AllReduce(ctx, make([]float32, 1<<18), procgroup.Sum),
		groups[1].AllReduce(ctx, make([]float32, 1<<18), procgroup.Sum),
	}
	time.Sleep(20 * time.Millisecond)
	groups[2].Abort(errors.New("operator pulled the plug"))
	for r, w := range works {
		// PollInterval is a minute: only the shared-memory abort can end this in time.
		c, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := w.Wait(c)
		cancel()
		if !errors.Is(err, procgroup.ErrAborted) || !strings.Contains(err.Error(), "operator pulled the plug") {
			t.Errorf("rank %d: %v; want ErrAborted with rank 2's reason", r, err)
		}
	}
	for _, g := range groups {
		g.Abort(nil)
	}
}

// TestAllReduceAlgorithm: the algorithm and traffic the group reports for each path
// (procgroup.AlgorithmReporter, allreduce-perf --ceiling).
func TestAllReduceAlgorithm(t *testing.T) {
	type want struct {
		bytes   int
		dt      procgroup.DType
		name    string
		traffic float64
	}
	for _, tc := range []struct {
		name  string
		size  int
		cfg   *Config
		wants []want
	}{
		{"unix/n2", 2, &Config{Transport: TransportUnix}, []want{
			{4 << 10, procgroup.Float32, "shm-direct", 3}, {1 << 20, procgroup.Float32, "shm-ring", 2.5},
			{1 << 20, procgroup.BFloat16, "widened", 0}, {0, procgroup.Float32, "none", 0},
		}},
		{"unix/n2/ring", 2, &Config{Transport: TransportUnix, Algorithm: AlgoRing}, []want{
			{1 << 20, procgroup.Float32, "shm-ring", 2.5}, // Note [Single copy]'s all-reduce is off by default
		}},
		{"tcp/n2", 2, &Config{Transport: TransportTCP}, []want{
			{4 << 10, procgroup.Float32, "direct", 3}, {1 << 20, procgroup.Int64, "pair", 2.5},
		}},
		{"tcp/n3", 3, &Config{Transport: TransportTCP}, []want{
			{1 << 20, procgroup.Float64, "ring", 5 * 2.0 / 3},
		}},
		{"unix/n1", 1, &Config{Transport: TransportUnix}, []want{{1 << 20, procgroup.Float32, "none", 0}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			groups := startGroups(t, tc.size, tc.cfg)
			for _, w := range tc.wants {
				name, traffic, ok := procgroup.AllReduceAlgorithm(groups[0], procgroup.NewBuffer(w.dt, w.bytes/w.dt.Size()))
				if !ok || name != w.name || math.Abs(traffic-w.traffic) > 1e-12 {
					t.Errorf("%d bytes of %v: %q, %g (reported %t); want %q, %g", w.bytes, w.dt, name, traffic, ok, w.name, w.traffic)
				}
			}
		})
	}
	t.Run("unix/n3/single-copy", func(t *testing.T) { // Note [Single copy], where it applies
		cmaEverySize(t)
		groups := startGroups(t, 3, &Config{Transport: TransportUnix, AdoptBuffers: AdoptOff})
		if name, traffic, _ := procgroup.AllReduceAlgorithm(groups[0], make([]float32, 1<<18)); name != "shm-vm" || math.Abs(traffic-8.0/3) > 1e-12 {
			t.Errorf("a private buffer: %q, %g; want shm-vm, 8/3", name, traffic)
		}
	})
	t.Run("unix/n3/shared", func(t *testing.T) { // Note [One pass]: 2 bytes per byte, whatever n
		groups := startGroups(t, 3, &Config{Transport: TransportUnix})
		g := groups[0].(*group)
		buf, err := g.AllocBuffer(procgroup.Float32, 1<<18)
		if err != nil {
			t.Fatal(err)
		}
		defer g.FreeBuffer(buf)
		if name, traffic, _ := procgroup.AllReduceAlgorithm(g, buf); name != "shm-inplace" || traffic != 2 {
			t.Errorf("a buffer from AllocBuffer: %q, %g; want shm-inplace, 2", name, traffic)
		}
		if name, traffic, _ := procgroup.AllReduceAlgorithm(g, make([]float32, 1<<18)); name != "shm-ring" || math.Abs(traffic-10.0/3) > 1e-12 {
			t.Errorf("a private buffer: %q, %g; want shm-ring, 10/3", name, traffic)
		}
	})
}
