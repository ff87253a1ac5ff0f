package pgtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goddp/goddp/procgroup"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// testCtx bounds a test's waits so that a bug shows as a failure, not a hang.
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// eachRank runs f on every rank's group concurrently and waits for all of them.
func eachRank(c *Cluster, f func(rank int, pg procgroup.ProcessGroup)) {
	var wg sync.WaitGroup
	for r, pg := range c.Groups() {
		wg.Go(func() { f(r, pg) })
	}
	wg.Wait()
}

func TestClusterAllReduceAndRecords(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(3)
	defer c.Close()
	var hookMu sync.Mutex
	var hooked []string
	c.OnIssue = func(rank int, r Record) {
		hookMu.Lock()
		hooked = append(hooked, fmt.Sprintf("%d:%d:%s", rank, r.Seq, r.Op))
		hookMu.Unlock()
	}
	eachRank(c, func(rank int, pg procgroup.ProcessGroup) {
		buf := []int64{int64(rank), int64(10 * rank), 7}
		bc := []float32{float32(rank), 1}
		w1 := pg.AllReduce(ctx, buf, procgroup.Sum)
		w2 := pg.Broadcast(ctx, bc, 2)
		w3 := pg.Barrier(ctx)
		for _, w := range []procgroup.Work{w3, w2, w1} {
			if err := w.Wait(ctx); err != nil {
				t.Errorf("rank %d: %v", rank, err)
			}
		}
		if want := []int64{3, 30, 21}; fmt.Sprint(buf) != fmt.Sprint(want) {
			t.Errorf("rank %d: allreduce = %v, want %v", rank, buf, want)
		}
		if want := []float32{2, 1}; fmt.Sprint(bc) != fmt.Sprint(want) {
			t.Errorf("rank %d: broadcast = %v, want %v", rank, bc, want)
		}
	})
	want := []Record{
		{Seq: 1, Op: procgroup.OpAllReduce, DType: procgroup.Int64, Count: 3, ReduceOp: procgroup.Sum},
		{Seq: 2, Op: procgroup.OpBroadcast, DType: procgroup.Float32, Count: 2, Root: 2},
		{Seq: 3, Op: procgroup.OpBarrier},
	}
	for r := range 3 {
		if got := c.Issued(r); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("Issued(%d) = %v, want %v", r, got, want)
		}
	}
	if len(hooked) != 9 {
		t.Errorf("OnIssue called %d times, want 9: %v", len(hooked), hooked)
	}
}

func TestClusterCompletesInIssueOrder(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(2)
	defer c.Close()
	c.SetDelay(1, 50*time.Microsecond)
	eachRank(c, func(rank int, pg procgroup.ProcessGroup) {
		var works []procgroup.Work
		for i := range 40 {
			works = append(works, pg.AllReduce(ctx, []float64{float64(i)}, procgroup.Max))
		}
		for i := len(works) - 1; i >= 0; i-- {
			if err := works[i].Wait(ctx); err != nil {
				t.Errorf("rank %d work %d: %v", rank, i, err)
			}
			for j := range i { // every earlier work is already complete
				select {
				case <-works[j].Done():
				default:
					t.Fatalf("rank %d: work %d done before work %d", rank, i, j)
				}
			}
		}
	})
}

func TestClusterKill(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(3)
	defer c.Close()
	// Ranks 0 and 1 issue; rank 2 never does, so their works stay pending until it dies.
	w0 := c.Group(0).AllReduce(ctx, []float32{1}, procgroup.Sum)
	w1 := c.Group(1).AllReduce(ctx, []float32{1}, procgroup.Sum)
	select {
	case <-w0.Done():
		t.Fatal("work completed without rank 2")
	default:
	}
	c.Kill(2)
	for r, w := range []procgroup.Work{w0, w1} {
		err := w.Wait(ctx)
		if !errors.Is(err, procgroup.ErrPeerLost) || !strings.Contains(err.Error(), "rank 2") {
			t.Errorf("rank %d: err = %v, want ErrPeerLost naming rank 2", r, err)
		}
	}
	err := c.Group(2).Barrier(ctx).Err()
	if !errors.Is(err, procgroup.ErrAborted) {
		t.Errorf("dead rank's later work: err = %v, want ErrAborted", err)
	}
	if err := c.Group(0).Barrier(ctx).Err(); !errors.Is(err, procgroup.ErrPeerLost) {
		t.Errorf("peer's later work: err = %v, want ErrPeerLost", err)
	}
}

func TestClusterMismatch(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(2)
	defer c.Close()
	w0 := c.Group(0).AllReduce(ctx, make([]float32, 4), procgroup.Sum)
	w1 := c.Group(1).AllReduce(ctx, make([]float32, 5), procgroup.Sum)
	for r, w := range []procgroup.Work{w0, w1} {
		var mm *MismatchError
		if err := w.Wait(ctx); !errors.As(err, &mm) || mm.Seq != 1 {
			t.Errorf("rank %d: err = %v, want a MismatchError at seq 1", r, err)
		}
	}
	if err := c.Group(0).Barrier(ctx).Err(); !errors.Is(err, procgroup.ErrAborted) {
		t.Errorf("after a mismatch: err = %v, want ErrAborted", err)
	}
}

func TestClusterCtxEndAborts(t *testing.T) {
	c := NewCluster(2)
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	w := c.Group(0).AllReduce(ctx, []int32{1}, procgroup.Sum)
	cancel()
	if err := w.Wait(testCtx(t)); !errors.Is(err, context.Canceled) {
		t.Errorf("err = %v, want context.Canceled", err)
	}
	if err := c.Group(1).Barrier(testCtx(t)).Err(); !errors.Is(err, procgroup.ErrPeerLost) {
		t.Errorf("peer after ctx end: err = %v, want ErrPeerLost", err)
	}
}

func TestClusterCompletedCtxDoesNotAbort(t *testing.T) {
	c := NewCluster(2)
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	eachRank(c, func(rank int, pg procgroup.ProcessGroup) {
		if err := pg.AllReduce(ctx, []int32{1}, procgroup.Sum).Wait(ctx); err != nil {
			t.Error(err)
		}
	})
	cancel()
	eachRank(c, func(rank int, pg procgroup.ProcessGroup) {
		if err := pg.Barrier(testCtx(t)).Wait(testCtx(t)); err != nil {
			t.Errorf("rank %d: barrier after an earlier ctx ended: %v", rank, err)
		}
	})
}

func TestClusterClosePendingFailsWithErrClosed(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(2)
	defer c.Close()
	w := c.Group(0).AllReduce(ctx, []float64{1, 2}, procgroup.Avg)
	if err := c.Group(0).Close(); err != nil {
		t.Fatal(err)
	}
	if err := w.Wait(ctx); !errors.Is(err, procgroup.ErrClosed) {
		t.Errorf("pending work: err = %v, want ErrClosed", err)
	}
	if err := c.Group(0).Barrier(ctx).Err(); !errors.Is(err, procgroup.ErrClosed) {
		t.Errorf("work after Close: err = %v, want ErrClosed", err)
	}
	err := c.Group(1).AllReduce(ctx, []float64{1, 2}, procgroup.Avg).Err()
	if !errors.Is(err, procgroup.ErrPeerLost) || !strings.Contains(err.Error(), "rank 0 closed") {
		t.Errorf("peer's work after rank 0 closed: err = %v, want ErrPeerLost naming rank 0", err)
	}
	if err := c.Group(1).Close(); err != nil {
		t.Errorf("second rank's Close: %v", err)
	}
	if err := c.Group(0).Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestClusterAbortWrapsCause(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(3)
	defer c.Close()
	cause := errors.New("watchdog fired")
	w := c.Group(1).Broadcast(ctx, []int32{5}, 0)
	c.Group(1).Abort(cause)
	if err := w.Wait(ctx); !errors.Is(err, procgroup.ErrAborted) || !errors.Is(err, cause) {
		t.Errorf("err = %v, want ErrAborted wrapping the cause", err)
	}
	c.Group(1).Abort(nil) // idempotent
}

func TestClusterPauseHoldsWorks(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(2)
	defer c.Close()
	c.Pause(1)
	bufs := [][]int32{{1, 2}, {10, 20}}
	w0 := c.Group(0).AllReduce(ctx, bufs[0], procgroup.Sum)
	w1 := c.Group(1).AllReduce(ctx, bufs[1], procgroup.Sum)
	// Rank 0 may already be waiting in the collective; rank 1 has not started it, so
	// neither can complete.
	for r, w := range []procgroup.Work{w0, w1} {
		select {
		case <-w.Done():
			t.Fatalf("rank %d: work completed while rank 1 was paused", r)
		default:
		}
	}
	c.Resume(1)
	for r, w := range []procgroup.Work{w0, w1} {
		if err := w.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(bufs[r]) != "[11 22]" {
			t.Errorf("rank %d: %v, want [11 22]", r, bufs[r])
		}
	}
}

func TestClusterDelayKeepsResults(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(3)
	defer c.Close()
	c.SetDelay(2, 100*time.Microsecond)
	eachRank(c, func(rank int, pg procgroup.ProcessGroup) {
		out := make([]procgroup.BF16, 6)
		in := []procgroup.BF16{procgroup.BF16FromFloat32(float32(rank)), procgroup.BF16FromFloat32(0.5)}
		if err := pg.AllGather(ctx, out, in).Wait(ctx); err != nil {
			t.Error(err)
			return
		}
		var got []float32
		for _, v := range out {
			got = append(got, v.Float32())
		}
		if fmt.Sprint(got) != "[0 0.5 1 0.5 2 0.5]" {
			t.Errorf("rank %d: allgather = %v", rank, got)
		}
	})
}

func TestClusterInvalidUsesNoSequenceNumber(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(2)
	defer c.Close()
	pg := c.Group(0)
	var nilCtx context.Context
	for _, w := range []procgroup.Work{
		pg.AllReduce(ctx, []float32{1}, procgroup.ReduceOp(7)),
		pg.Broadcast(ctx, []float32{1}, 2),
		pg.AllGather(ctx, []float32{1}, []float32{1}),
		pg.ReduceScatter(ctx, []float32{1}, []float32{1}, procgroup.Sum),
		pg.AllReduce(ctx, []uint16{1}, procgroup.Sum),
		pg.AllReduce(nilCtx, []float32{1}, procgroup.Sum), // must not crash
	} {
		if err := w.Err(); !errors.Is(err, procgroup.ErrInvalidArgument) {
			t.Errorf("err = %v, want ErrInvalidArgument", err)
		}
	}
	if got := c.Issued(0); len(got) != 0 {
		t.Errorf("Issued(0) = %v, want none", got)
	}
}

// The integer average truncates toward zero and integer Sum wraps, as in the buffer's type.
func TestClusterIntegerArithmetic(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(2)
	defer c.Close()
	bufs := [][]int32{{-3, 3, 2147483647}, {0, 0, 1}}
	eachRank(c, func(rank int, pg procgroup.ProcessGroup) {
		if err := pg.AllReduce(ctx, bufs[rank], procgroup.Avg).Wait(ctx); err != nil {
			t.Error(err)
		}
	})
	if fmt.Sprint(bufs[0]) != "[-1 1 -1073741824]" || fmt.Sprint(bufs[1]) != fmt.Sprint(bufs[0]) {
		t.Errorf("avg = %v, %v", bufs[0], bufs[1])
	}
}

func TestClusterMismatchReachesLateRanks(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(3)
	defer c.Close()
	c.Pause(2)
	w2 := c.Group(2).Broadcast(ctx, []float32{1}, 0)
	w0 := c.Group(0).Broadcast(ctx, []float32{1}, 0)
	w1 := c.Group(1).Broadcast(ctx, []float32{1}, 1) // a different root
	for r, w := range []procgroup.Work{w0, w1, w2} {
		var mm *MismatchError
		err := w.Wait(ctx)
		if !errors.As(err, &mm) || !errors.Is(err, procgroup.ErrAborted) {
			t.Errorf("rank %d: err = %v, want ErrAborted wrapping a MismatchError", r, err)
		}
	}
}

func TestClusterEachJoinsErrors(t *testing.T) {
	c := NewCluster(3)
	defer c.Close()
	boom := errors.New("boom")
	err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		if rank == 1 {
			return boom
		}
		return nil
	})
	if !errors.Is(err, boom) || !strings.Contains(err.Error(), "rank 1") {
		t.Errorf("err = %v, want boom naming rank 1", err)
	}
}

// TestClusterLink: over a link of 1 MB/s, two all-reduces of 25,000 float32s (100 KB) and
// 1,000 bfloat16s (2 KB) one after the other take at least 102 ms; the sum is still right.
func TestClusterLink(t *testing.T) {
	ctx := testCtx(t)
	c := NewCluster(2)
	defer c.Close()
	c.SetLink(1e6)
	t0 := time.Now()
	eachRank(c, func(rank int, pg procgroup.ProcessGroup) {
		a, b := make([]float32, 25000), make([]procgroup.BF16, 1000)
		for k := range a {
			a[k] = float32(rank + k)
		}
		wa, wb := pg.AllReduce(ctx, a, procgroup.Sum), pg.AllReduce(ctx, b, procgroup.Sum)
		if err := errors.Join(wa.Wait(ctx), wb.Wait(ctx)); err != nil {
			t.Errorf("rank %d: %v", rank, err)
		}
		for k, v := range a {
			if v != float32(1+2*k) {
				t.Fatalf("rank %d: element %d is %v, want %d", rank, k, v, 1+2*k)
			}
		}
	})
	if d := time.Since(t0); d < 102*time.Millisecond {
		t.Errorf("the two all-reduces took %v over a 1 MB/s link, want at least 102 ms", d)
	}
}
