package procgroup_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

func TestDebugConformance(t *testing.T) {
	pgtest.Run(t, func(t testing.TB, n int) []procgroup.ProcessGroup {
		w := newWorld(t, "cluster", n)
		gs := make([]procgroup.ProcessGroup, n)
		for r := range gs {
			gs[r] = mustDebug(t, w.inner[r], procgroup.DebugOptions{})
		}
		return gs
	}, pgtest.SuiteOptions{Short: true, Sizes: []int{1, 2, 3, 4}})
}

// stacked wraps a world's groups the way ddp.InitProcessGroup does with GODDP_DEBUG=detail.
func stacked(t testing.TB, w *world, timeout time.Duration) []procgroup.ProcessGroup {
	gs := make([]procgroup.ProcessGroup, len(w.inner))
	for r := range gs {
		gs[r] = mustWatchdog(t, mustDebug(t, w.inner[r], procgroup.DebugOptions{}), w.wdStore(),
			procgroup.WatchdogOptions{Timeout: timeout, Interval: 10 * time.Millisecond, LookupEnv: noEnv})
	}
	return gs
}

func TestStackedConformance(t *testing.T) {
	for _, backend := range []string{"cluster", "gloo"} {
		t.Run(backend, func(t *testing.T) {
			sizes := []int{1, 2, 3, 4}
			if backend == "gloo" {
				sizes = []int{2, 3}
			}
			pgtest.Run(t, func(t testing.TB, n int) []procgroup.ProcessGroup {
				return stacked(t, newWorld(t, backend, n), time.Minute)
			}, pgtest.SuiteOptions{Short: true, Sizes: sizes, Large: 1 << 12})
		})
	}
}

// TestDebugDesync makes a desync on purpose: rank 0 runs an all-reduce while rank 1 runs a
// broadcast. Both fail with an error that names both sides; nothing else is issued.
func TestDebugDesync(t *testing.T) {
	for _, backend := range []string{"cluster", "gloo"} {
		t.Run(backend, func(t *testing.T) { testDesync(t, backend) })
	}
}

func testDesync(t *testing.T, backend string) {
	const n, count = 2, 333
	w := newWorld(t, backend, n)
	gs := stacked(t, w, time.Minute)
	defer closeAll(gs)
	ctx := testCtx(t)
	ins, sum := randomInputs(11, n, count)
	errs := make([]error, n)
	later := make([]error, n)
	runRanks(gs, func(r int, pg procgroup.ProcessGroup) {
		buf := append([]float64(nil), ins[r]...)
		if err := pg.AllReduce(ctx, buf, procgroup.Sum).Wait(ctx); err != nil {
			errs[r] = fmt.Errorf("allreduce #1: %w", err)
			return
		}
		if err := checkSum(buf, sum); err != nil {
			errs[r] = fmt.Errorf("allreduce #1: %w", err)
			return
		}
		var wk procgroup.Work
		if r == 0 {
			wk = pg.AllReduce(ctx, make([]float32, 1<<20), procgroup.Sum)
		} else {
			wk = pg.Broadcast(ctx, make([]float32, 1024), 0)
		}
		errs[r] = wk.Wait(ctx)
		later[r] = pg.Barrier(ctx).Wait(ctx)
	})
	for r, err := range errs {
		t.Logf("rank %d: %v", r, err)
		want := fmt.Sprintf("procgroup: rank %d: collectives out of step at #2: "+
			"rank 0 runs AllReduce(float32, 1048576, sum) while rank 1 runs Broadcast(float32, 1024, root 0)", r)
		var de *procgroup.DesyncError
		if !errors.As(err, &de) || err.Error() != want {
			t.Errorf("rank %d: err = %v, want %q", r, err, want)
			continue
		}
		if de.Seq != 2 || de.Rank != r || len(de.Fingerprints) != n ||
			de.Fingerprints[0].Op != procgroup.OpAllReduce || de.Fingerprints[1].Op != procgroup.OpBroadcast {
			t.Errorf("rank %d: %+v", r, de)
		}
		var de2 *procgroup.DesyncError
		if !errors.Is(later[r], procgroup.ErrAborted) || !errors.As(later[r], &de2) {
			t.Errorf("rank %d: barrier after the desync: err = %v, want ErrAborted wrapping the *DesyncError", r, later[r])
		}
	}
}

// TestDebugDesyncNotIssued checks on the cluster's records that the real collective of a
// desync is not issued: each rank issued allgather (fingerprint), allreduce, allgather.
func TestDebugDesyncNotIssued(t *testing.T) {
	c := pgtest.NewCluster(2)
	defer c.Close()
	gs := []procgroup.ProcessGroup{mustDebug(t, c.Group(0), procgroup.DebugOptions{}), mustDebug(t, c.Group(1), procgroup.DebugOptions{})}
	defer closeAll(gs)
	ctx := testCtx(t)
	runRanks(gs, func(r int, pg procgroup.ProcessGroup) {
		pg.AllReduce(ctx, []int64{int64(r) + 5}, procgroup.Max).Wait(ctx)
		pg.AllReduce(ctx, make([]int32, 4+r), procgroup.Sum).Wait(ctx) // counts differ
	})
	for r := range 2 {
		var ops []string
		for _, rec := range c.Issued(r) {
			ops = append(ops, rec.Op.String())
		}
		if got := strings.Join(ops, " "); got != "allgather allreduce allgather" {
			t.Errorf("rank %d issued %s, want allgather allreduce allgather", r, got)
		}
	}
}

func TestDesyncErrorText(t *testing.T) {
	ar := procgroup.Fingerprint{Seq: 9, Op: procgroup.OpAllReduce, DType: procgroup.BFloat16, Count: 8, ReduceOp: procgroup.Avg}
	rs := procgroup.Fingerprint{Seq: 9, Op: procgroup.OpReduceScatter, DType: procgroup.Int64, Count: 2, ReduceOp: procgroup.Max}
	ag := procgroup.Fingerprint{Seq: 9, Op: procgroup.OpAllGather, DType: procgroup.Float64, Count: 3}
	ba := procgroup.Fingerprint{Seq: 9, Op: procgroup.OpBarrier}
	for _, tc := range []struct {
		fps  []procgroup.Fingerprint
		want string
	}{
		{[]procgroup.Fingerprint{ar, ar, rs, ar}, "procgroup: rank 1: collectives out of step at #9: " +
			"ranks 0, 1, 3 run AllReduce(bfloat16, 8, avg) while rank 2 runs ReduceScatter(int64, 2, max)"},
		{[]procgroup.Fingerprint{ag, ba, ag}, "procgroup: rank 1: collectives out of step at #9: " +
			"ranks 0, 2 run AllGather(float64, 3) while rank 1 runs Barrier()"},
	} {
		err := &procgroup.DesyncError{Rank: 1, Seq: 9, Fingerprints: tc.fps}
		if err.Error() != tc.want {
			t.Errorf("got  %s\nwant %s", err, tc.want)
		}
	}
}

func TestDebugFromEnv(t *testing.T) {
	for v, want := range map[string]bool{"": false, "off": false, "INFO": false, "detail": true, "DETAIL": true, " Detail ": true} {
		got, err := procgroup.DebugFromEnv(func(string) (string, bool) { return v, v != "" })
		if err != nil || got != want {
			t.Errorf("GODDP_DEBUG=%q: %v, %v; want %v", v, got, err, want)
		}
	}
	if _, err := procgroup.DebugFromEnv(func(string) (string, bool) { return "verbose", true }); !errors.Is(err, procgroup.ErrInvalidArgument) {
		t.Errorf("GODDP_DEBUG=verbose: err = %v, want ErrInvalidArgument", err)
	}
}

// BenchmarkDebugOverhead measures a 2-rank gloo all-reduce of float32 with and without the
// debug wrapper (its fingerprint exchange), at 4 KiB, 1 MiB and 16 MiB:
//
//	go test ./procgroup -run '^$' -bench DebugOverhead -benchtime 2s
func BenchmarkDebugOverhead(b *testing.B) {
	for _, size := range []int{4 << 10, 1 << 20, 16 << 20} {
		for _, debug := range []bool{false, true} {
			b.Run(fmt.Sprintf("size=%dKiB/debug=%v", size>>10, debug), func(b *testing.B) {
				w := newWorld(b, "gloo", 2)
				gs := w.inner
				if debug {
					gs = []procgroup.ProcessGroup{mustDebug(b, gs[0], procgroup.DebugOptions{}), mustDebug(b, gs[1], procgroup.DebugOptions{})}
				}
				defer closeAll(gs)
				bufs := [2][]float32{make([]float32, size/4), make([]float32, size/4)}
				for i := range bufs[0] {
					bufs[0][i], bufs[1][i] = float32(i%7), float32(i%5)
				}
				ctx := context.Background()
				b.SetBytes(int64(size))
				b.ResetTimer()
				var wg sync.WaitGroup
				errs := make([]error, 2)
				for r := range 2 {
					wg.Go(func() {
						for range b.N {
							if err := gs[r].AllReduce(ctx, bufs[r], procgroup.Avg).Wait(ctx); err != nil {
								errs[r] = err
								return
							}
						}
					})
				}
				wg.Wait()
				b.StopTimer()
				if err := errors.Join(errs...); err != nil {
					b.Fatal(err)
				}
			})
		}
	}
}
