//go:build cgo

package nccl

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// These tests run on the fakes only: they make NCCL's host calls block as with a late or
// dead peer (fakenccl.c: nccl_connect_block, nccl_finalize_hang), and bound every wait, so
// that a hang shows as a failure and the test then unblocks the fake to unwind.

const hangBound = 10 * time.Second

// within runs f and reports whether it returned within d; if not, unblock is called (to
// let f unwind) and the test fails.
func within(t *testing.T, d time.Duration, what string, unblock func(), f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
		return
	case <-time.After(d):
	}
	unblock()
	<-done
	t.Fatalf("%s did not return within %v (it returned once the fake was unblocked)", what, d)
}

// TestTimeoutWhileEnqueueBlocks: rank 0's first all-reduce blocks inside ncclAllReduce,
// connecting to a peer that never comes (NCCL_RUNTIME_CONNECT=1). The watchdog must still
// enforce the timeout, abort the communicator (which unblocks the call) and fail the work
// with an error that names the collective; Abort afterwards returns at once.
func TestTimeoutWhileEnqueueBlocks(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 200*time.Millisecond)
	defer l.knob("nccl_connect_block", l.knob("nccl_connect_block", 1))
	unblock := func() { l.knob("nccl_unblock", 0) }
	var w procgroup.Work
	within(t, hangBound, "AllReduce blocked in ncclAllReduce", unblock, func() {
		w = gs[0].AllReduce(context.Background(), []float32{1, 2, 3}, procgroup.Sum)
	})
	select {
	case <-w.Done():
	case <-time.After(hangBound):
		unblock()
		t.Fatal("the work of a timed-out collective is still pending")
	}
	wantErr(t, w.Err(), procgroup.ErrTimeout, "rank 0", "allreduce #1", "did not complete within 200ms", "its NCCL call has not returned")
	wantErr(t, w.Err(), procgroup.ErrAborted)
	within(t, hangBound, "Abort after the timeout", unblock, func() { gs[0].Abort(nil) })
	within(t, hangBound, "Abort of the peer", unblock, func() { gs[1].Abort(nil) })
}

// TestAbortWhileEnqueueBlocks: no timeout; Abort, from another goroutine, must return
// promptly while a collective is blocked inside ncclAllReduce, and the collective fails with
// the abort's cause.
func TestAbortWhileEnqueueBlocks(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	defer l.knob("nccl_connect_block", l.knob("nccl_connect_block", 1))
	unblock := func() { l.knob("nccl_unblock", 0) }
	got := make(chan procgroup.Work, 1)
	go func() { got <- gs[0].Broadcast(context.Background(), []int64{1, 2}, 0) }()
	// Wait until the broadcast is blocked inside its NCCL call.
	for deadline := time.Now().Add(hangBound); l.knob("nccl_connecting", 0) != 1; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			unblock()
			t.Fatal("the broadcast never reached ncclBroadcast")
		}
	}
	cause := errors.New("the job is shutting down")
	within(t, hangBound, "Abort while ncclBroadcast blocks", unblock, func() { gs[0].Abort(cause) })
	var w procgroup.Work
	select {
	case w = <-got:
	case <-time.After(hangBound):
		unblock()
		t.Fatal("Broadcast did not return after Abort")
	}
	wantErr(t, waitT(t, w), procgroup.ErrAborted, "broadcast #1")
	wantErr(t, w.Err(), cause)
	within(t, hangBound, "Abort of the peer", unblock, func() { gs[1].Abort(nil) })
}

// TestCloseFinalizes: Close finalizes the communicator (ncclCommFinalize) before destroying
// it, and returns nil when the peers do too.
func TestCloseFinalizes(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	each(t, gs, func(r int, g *Group) error {
		return waitT(t, g.AllReduce(context.Background(), []float64{float64(r)}, procgroup.Sum))
	})
	before := l.knob("nccl_finalizes", 0)
	each(t, gs, func(r int, g *Group) error { return g.Close() })
	if n := l.knob("nccl_finalizes", 0) - before; n != 2 {
		t.Fatalf("ncclCommFinalize called %d times by 2 ranks' Close, want 2", n)
	}
}

// TestCloseBoundedWhenPeerDoesNotFinalize: a peer that never finalizes (or is dead) keeps
// ncclCommFinalize, and ncclCommDestroy, waiting. Close must return by its deadline with an
// error that names the step and wraps ErrTimeout, having aborted the communicator.
func TestCloseBoundedWhenPeerDoesNotFinalize(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	each(t, gs, func(r int, g *Group) error {
		return waitT(t, g.AllReduce(context.Background(), []float32{float32(r)}, procgroup.Sum))
	})
	for _, g := range gs {
		setTeardownTimeouts(g, 200*time.Millisecond, time.Second)
	}
	defer l.knob("nccl_finalize_hang", l.knob("nccl_finalize_hang", 1))
	var err error
	start := time.Now()
	within(t, hangBound, "Close with a peer that does not finalize", func() { l.knob("nccl_finalize_hang", 0) },
		func() { err = gs[0].Close() })
	wantErr(t, err, procgroup.ErrTimeout, "rank 0", "ncclCommFinalize did not complete within 200ms", "aborted")
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Close took %v, want about its 200ms deadline", d)
	}
	l.knob("nccl_finalize_hang", 0)
	if err := gs[1].Close(); err != nil {
		t.Fatalf("rank 1's Close, the peer finalizing normally again: %v", err)
	}
}

// TestAbortBoundedWhenStreamDoesNotDrain: after ncclCommAbort a kernel that never ends
// keeps the comm stream busy (the fake: a gate on the comm stream). Abort must still return
// within its drain bound, failing the pending work, instead of waiting in
// cuStreamSynchronize.
func TestAbortBoundedWhenStreamDoesNotDrain(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	g := gs[0]
	setTeardownTimeouts(g, time.Second, 200*time.Millisecond)
	l.knob("gate_close", int64(uintptr(g.streamHandle())))
	defer l.knob("gate_open", 0)
	w := g.AllReduce(context.Background(), []float32{1}, procgroup.Sum)
	within(t, hangBound, "Abort with a comm stream that does not drain", func() { l.knob("gate_open", 0) },
		func() { g.Abort(nil) })
	wantErr(t, waitT(t, w), procgroup.ErrAborted, "allreduce #1")
	gs[1].Abort(nil)
}
