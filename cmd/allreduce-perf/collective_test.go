//go:build !allreduceperf_nogloo

package main

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/goddp/goddp/procgroup"
)

// newGlooGroups makes a world of gloo groups whose ranks are goroutines (one host: shared
// memory, and Note [Single copy] where the kernel allows it).
func newGlooGroups(t *testing.T, n int) []procgroup.ProcessGroup {
	t.Helper()
	st := procgroup.NewMemStore()
	pgs := make([]procgroup.ProcessGroup, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Go(func() {
			pgs[r], errs[r] = procgroup.New(context.Background(), "gloo", procgroup.Options{Rank: r, Size: n, Store: st, Token: "t"})
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, pg := range pgs {
			pg.Close()
		}
		st.Close()
	})
	return pgs
}

// TestCollectiveRows: every --collective, out of place and in place (--inplace: nccl-tests'
// in-place AllGather and ReduceScatter), checked against the reference, with nccl-tests'
// sizes (AllGather's output and ReduceScatter's input, a multiple of the world size) and
// busbw factors, at sizes on both sides of the single-copy thresholds.
func TestCollectiveRows(t *testing.T) {
	for _, world := range []int{2, 3} {
		pgs := newGlooGroups(t, world)
		for _, coll := range slices.Concat(collectives, []string{collAllGather + " --inplace", collReduceScatter + " --inplace"}) {
			coll, inPlace := strings.CutSuffix(coll, " --inplace")
			for _, c := range []struct {
				dt procgroup.DType
				op procgroup.ReduceOp
			}{{procgroup.Float32, procgroup.Sum}, {procgroup.Int64, procgroup.Max}, {procgroup.BFloat16, procgroup.Avg}, {procgroup.Float64, procgroup.Prod}} {
				cfg := config{minBytes: 1000, maxBytes: 1 << 20, factor: 32, iters: 2, warmup: 1, check: true, dtype: c.dt, op: c.op, collective: coll, inPlace: inPlace}
				rows := benchAll(t, pgs, cfg)
				what := fmt.Sprintf("world %d %s in place %t %v %v", world, coll, inPlace, c.dt, c.op)
				if len(rows) != 3 { // 1000, 32000, 1024000 bytes
					t.Fatalf("%s: %d rows, want 3", what, len(rows))
				}
				for i, r := range rows {
					count := int(1000*math.Pow(32, float64(i))) / c.dt.Size()
					if coll == collAllGather || coll == collReduceScatter {
						count = count / world * world
					}
					want := map[string]float64{collAllReduce: 2 * float64(world-1) / float64(world),
						collAllGather: float64(world-1) / float64(world), collReduceScatter: float64(world-1) / float64(world), collBroadcast: 1}[coll]
					if r.Collective != coll || r.Count != count || r.SizeBytes != int64(count*c.dt.Size()) {
						t.Errorf("%s row %d: %+v; want count %d", what, i, r, count)
					}
					if r.InPlace != (inPlace || coll == collAllReduce || coll == collBroadcast) {
						t.Errorf("%s row %d: in_place %t", what, i, r.InPlace)
					}
					if r.Wrong != 0 || r.OK == nil || !*r.OK {
						t.Errorf("%s row %d: %d wrong elements", what, i, r.Wrong)
					}
					if r.AlgBW <= 0 || math.Abs(r.BusBW-r.AlgBW*want) > 1e-12*r.BusBW {
						t.Errorf("%s row %d: busbw %g, algbw %g; want busbw = algbw × %g", what, i, r.BusBW, r.AlgBW, want)
					}
				}
			}
		}
	}
}

// corrupting changes one element of rank 1's result after every collective but the
// all-reduces that agree on counts and times.
type corrupting struct{ procgroup.ProcessGroup }

func (c corrupting) spoil(out any) {
	if c.Rank() == 1 {
		out.([]float32)[0] += 0.5
	}
}

func (c corrupting) AllGather(ctx context.Context, out, in any) procgroup.Work {
	return then(ctx, c.ProcessGroup.AllGather(ctx, out, in), func() { c.spoil(out) })
}

func (c corrupting) ReduceScatter(ctx context.Context, out, in any, op procgroup.ReduceOp) procgroup.Work {
	return then(ctx, c.ProcessGroup.ReduceScatter(ctx, out, in, op), func() { c.spoil(out) })
}

func (c corrupting) Broadcast(ctx context.Context, buf any, root int) procgroup.Work {
	return then(ctx, c.ProcessGroup.Broadcast(ctx, buf, root), func() { c.spoil(buf) })
}

func then(ctx context.Context, w procgroup.Work, f func()) procgroup.Work {
	err := w.Wait(ctx)
	if err == nil {
		f()
	}
	return procgroup.Completed(err)
}

// TestCollectiveCheckFails: a wrong element in the result of each collective is counted.
func TestCollectiveCheckFails(t *testing.T) {
	pgs := newGlooGroups(t, 2)
	wrapped := []procgroup.ProcessGroup{corrupting{pgs[0]}, corrupting{pgs[1]}}
	for _, coll := range collectives[1:] {
		cfg := config{minBytes: 1 << 20, maxBytes: 1 << 20, factor: 2, iters: 1, warmup: 0, check: true, dtype: procgroup.Float32, op: procgroup.Sum, collective: coll}
		rows := benchAll(t, wrapped, cfg)
		if len(rows) != 1 || rows[0].Wrong != 1 || rows[0].OK == nil || *rows[0].OK {
			t.Errorf("%s: rows %+v; want one wrong element found", coll, rows)
		}
	}
}

// stale runs each rank's first AllGather and ReduceScatter, then completes the later ones
// without writing out: right results left over from the warm-up.
type stale struct {
	procgroup.ProcessGroup
	calls *int
}

func (s stale) AllGather(ctx context.Context, out, in any) procgroup.Work {
	if *s.calls++; *s.calls > 1 {
		return procgroup.Completed(nil)
	}
	return s.ProcessGroup.AllGather(ctx, out, in)
}

func (s stale) ReduceScatter(ctx context.Context, out, in any, op procgroup.ReduceOp) procgroup.Work {
	if *s.calls++; *s.calls > 1 {
		return procgroup.Completed(nil)
	}
	return s.ProcessGroup.ReduceScatter(ctx, out, in, op)
}

// TestCollectiveCheckSeesStaleOutput: the checked run clears out first, so a collective that
// writes nothing after the warm-up is counted wrong, in place and out of place.
func TestCollectiveCheckSeesStaleOutput(t *testing.T) {
	pgs := newGlooGroups(t, 2)
	for _, coll := range []string{collAllGather, collReduceScatter} {
		for _, inPlace := range []bool{false, true} {
			wrapped := []procgroup.ProcessGroup{stale{pgs[0], new(int)}, stale{pgs[1], new(int)}}
			cfg := config{minBytes: 1 << 16, maxBytes: 1 << 16, factor: 2, iters: 1, warmup: 1, check: true, dtype: procgroup.Float32, op: procgroup.Sum, collective: coll, inPlace: inPlace}
			rows := benchAll(t, wrapped, cfg)
			// Every element but this rank's own input slot (AllGather in place) is stale.
			if len(rows) != 1 || rows[0].Wrong == 0 || rows[0].OK == nil || *rows[0].OK {
				t.Errorf("%s in place %t: rows %+v; want wrong elements found", coll, inPlace, rows)
			}
		}
	}
}
