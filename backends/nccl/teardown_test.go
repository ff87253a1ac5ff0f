//go:build cgo

package nccl

import (
	"context"
	"errors"
	"runtime"
	"strings"
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

// waitKnob polls the fake's knob until it reads want, or fails the test after hangBound
// (calling unblock first).
func waitKnob(t *testing.T, l *lib, knob string, want int64, unblock func()) {
	t.Helper()
	for deadline := time.Now().Add(hangBound); l.knob(knob, 0) != want; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			unblock()
			t.Fatalf("the fake's %s never reached %d", knob, want)
		}
	}
}

// recvWork receives the work of an issuing goroutine, or fails the test after hangBound.
func recvWork(t *testing.T, got <-chan procgroup.Work, what string, unblock func()) procgroup.Work {
	t.Helper()
	select {
	case w := <-got:
		return w
	case <-time.After(hangBound):
		unblock()
		t.Fatalf("%s did not return", what)
		return nil
	}
}

// TestAbortSparesSlowIssuer: an issuer is slow before its NCCL call (here the fake driver
// holds it in cuMemcpyHtoDAsync: a large staging copy, a descheduled thread) while Abort
// runs, well past the abort's grace. The communicator may be aborted (which frees it), but the
// issuer must then make no NCCL call on it: the fake counts calls on a freed communicator.
func TestAbortSparesSlowIssuer(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	before := l.knob("nccl_use_after_free", 0)
	release := func() { l.knob("h2d_hold", 0) }
	defer release()
	l.knob("h2d_hold", 1)
	got := make(chan procgroup.Work, 1)
	go func() { got <- gs[0].AllReduce(context.Background(), []float32{1, 2, 3}, procgroup.Sum) }()
	waitKnob(t, l, "h2d_held", 1, release)
	aborted := make(chan struct{})
	go func() {
		defer close(aborted)
		gs[0].Abort(errors.New("shutting down"))
	}()
	time.Sleep(4 * defaultAbortGrace)
	release()
	w := recvWork(t, got, "AllReduce", release)
	select {
	case <-aborted:
	case <-time.After(hangBound):
		t.Fatal("Abort did not return once the issuer went on")
	}
	wantErr(t, waitT(t, w), procgroup.ErrAborted, "allreduce #1", "shutting down")
	if n := l.knob("nccl_use_after_free", 0) - before; n != 0 {
		t.Fatalf("%d NCCL calls on the communicator after ncclCommAbort freed it", n)
	}
	gs[1].Abort(nil)
}

// TestIssuerBehindStuckOneFailsOnAbort: with one issuer stuck (outside NCCL, where the
// abort cannot reach it), a later collective of the aborted group fails at once with the
// abort's error instead of queueing behind it forever.
func TestIssuerBehindStuckOneFailsOnAbort(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	g := gs[0]
	setTeardownTimeouts(g, time.Second, 200*time.Millisecond)
	release := func() { l.knob("h2d_hold", 0) }
	defer release()
	l.knob("h2d_hold", 1)
	got := make(chan procgroup.Work, 1)
	go func() { got <- g.AllReduce(context.Background(), []float32{1}, procgroup.Sum) }()
	waitKnob(t, l, "h2d_held", 1, release)
	cause := errors.New("a peer died")
	within(t, hangBound, "Abort with an issuer stuck outside NCCL", release, func() { g.Abort(cause) })
	var w2 procgroup.Work
	within(t, 2*time.Second, "AllReduce behind a stuck issuer, the group aborted", release, func() {
		w2 = g.AllReduce(context.Background(), []float32{2}, procgroup.Sum)
	})
	wantErr(t, waitT(t, w2), procgroup.ErrAborted, "allreduce", "a peer died")
	release()
	w := recvWork(t, got, "the stuck AllReduce", release)
	wantErr(t, waitT(t, w), procgroup.ErrAborted, "allreduce #1")
	gs[1].Abort(nil)
}

// TestIssuerBehindStuckOneHonoursCtx: a collective queued behind a stuck issuer gives up
// when its ctx ends, aborting the group (its collectives would no longer match its
// peers'), and the stuck one fails too once it goes on.
func TestIssuerBehindStuckOneHonoursCtx(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	g := gs[0]
	release := func() { l.knob("h2d_hold", 0) }
	defer release()
	l.knob("h2d_hold", 1)
	got := make(chan procgroup.Work, 1)
	go func() { got <- g.AllReduce(context.Background(), []float32{1}, procgroup.Sum) }()
	waitKnob(t, l, "h2d_held", 1, release)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	var w2 procgroup.Work
	within(t, 2*time.Second, "AllReduce behind a stuck issuer, its ctx ended", release, func() {
		w2 = g.AllReduce(ctx, []float32{2}, procgroup.Sum)
	})
	wantErr(t, waitT(t, w2), context.DeadlineExceeded, "allreduce", "waiting for the collective before it")
	wantErr(t, w2.Err(), procgroup.ErrAborted)
	release()
	w := recvWork(t, got, "the stuck AllReduce", release)
	wantErr(t, waitT(t, w), procgroup.ErrAborted, "allreduce #1", "waiting for the collective before it")
	gs[1].Abort(nil)
}

// TestCloseKeepsDeviceWhileFinalizeRuns: a finalize that even ncclCommAbort does not
// unblock is still inside NCCL when Close gives up on it. Close must return, bounded, with
// an error, and leave the device resources (the comm stream among them) allocated rather
// than free them under the call.
func TestCloseKeepsDeviceWhileFinalizeRuns(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	each(t, gs, func(r int, g *Group) error {
		return waitT(t, g.AllReduce(context.Background(), []float32{float32(r)}, procgroup.Sum))
	})
	for _, g := range gs {
		setTeardownTimeouts(g, 200*time.Millisecond, 300*time.Millisecond)
	}
	release := func() { l.knob("nccl_finalize_hang", 0) }
	defer release()
	l.knob("nccl_finalize_hang", 2)
	var err error
	within(t, hangBound, "Close with a finalize that the abort does not unblock", release, func() { err = gs[0].Close() })
	wantErr(t, err, procgroup.ErrTimeout, "rank 0", "ncclCommFinalize did not complete within 200ms", "left allocated")
	if l.knob("stream_live", int64(gs[0].streamHandle())) != 1 {
		t.Error("Close destroyed the comm stream while ncclCommFinalize was still running")
	}
	release()
	waitStuck(gs[0])
	if err := gs[1].Close(); err != nil {
		t.Fatalf("rank 1's Close, the peer finalizing normally again: %v", err)
	}
}

// TestAbortBoundedWhenAbortHangs: ncclCommAbort itself does not return (NVIDIA/nccl#829).
// Abort must still return within its bound, failing the pending work, and Close then says
// which call is stuck.
func TestAbortBoundedWhenAbortHangs(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	g := gs[0]
	setTeardownTimeouts(g, time.Second, 200*time.Millisecond)
	release := func() { l.knob("nccl_abort_hang", 0) }
	defer release()
	w := g.AllReduce(context.Background(), []float32{1}, procgroup.Sum) // the peer never comes
	l.knob("nccl_abort_hang", 1)
	within(t, 3*time.Second, "Abort with an ncclCommAbort that does not return", release, func() { g.Abort(nil) })
	wantErr(t, waitT(t, w), procgroup.ErrAborted, "allreduce #1")
	wantErr(t, g.Close(), procgroup.ErrTimeout, "rank 0", "ncclCommAbort did not return within 200ms")
	release()
	waitStuck(g)
	gs[1].Abort(nil)
}

// TestCloseBoundedWhenAbortHangs: Close past its finalize deadline aborts the
// communicator; an ncclCommAbort that does not return must not hold Close either.
func TestCloseBoundedWhenAbortHangs(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	each(t, gs, func(r int, g *Group) error {
		return waitT(t, g.AllReduce(context.Background(), []float32{float32(r)}, procgroup.Sum))
	})
	g := gs[0]
	setTeardownTimeouts(g, 200*time.Millisecond, 200*time.Millisecond)
	release := func() {
		l.knob("nccl_abort_hang", 0)
		l.knob("nccl_finalize_hang", 0)
	}
	defer release()
	l.knob("nccl_finalize_hang", 1)
	l.knob("nccl_abort_hang", 1)
	var err error
	within(t, 3*time.Second, "Close with a finalize and an ncclCommAbort that do not return", release, func() { err = g.Close() })
	wantErr(t, err, procgroup.ErrTimeout, "rank 0", "ncclCommAbort did not return within 200ms")
	release()
	waitStuck(g)
	gs[1].Abort(nil)
}

// TestAbortWaitsForCallInProgress: Abort while an issuer is inside an NCCL call that is
// not waiting for peers (slow host work in the call): the watchdog must let it return
// before ncclCommAbort, since only one thread may operate a communicator at a time (the
// fake counts an abort during a running call). The grace is set well above the call's
// length, itself several times the default grace, so that the check does not depend on
// how fast the call runs under load.
func TestAbortWaitsForCallInProgress(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	setAbortGrace(gs[0], hangBound)
	const call = 4 * defaultAbortGrace
	before := l.knob("nccl_use_after_free", 0)
	defer l.knob("nccl_enqueue_delay_us", l.knob("nccl_enqueue_delay_us", int64(call/time.Microsecond)))
	got := make(chan procgroup.Work, 1)
	go func() { got <- gs[0].AllReduce(context.Background(), []float32{1, 2}, procgroup.Sum) }()
	for deadline := time.Now().Add(hangBound); l.knob("nccl_in_call", 0) != 1; runtime.Gosched() {
		if time.Now().After(deadline) {
			t.Fatal("the all-reduce never entered ncclAllReduce")
		}
	}
	within(t, hangBound, "Abort while a collective's call runs", func() {}, func() { gs[0].Abort(nil) })
	w := recvWork(t, got, "AllReduce", func() {})
	wantErr(t, waitT(t, w), procgroup.ErrAborted, "allreduce #1")
	if n := l.knob("nccl_use_after_free", 0) - before; n != 0 {
		t.Fatalf("ncclCommAbort ran while the collective's NCCL call did (%d)", n)
	}
	gs[1].Abort(nil)
}

// TestCloseAfterAbortWithStuckIssuer: an issuer held before its NCCL call (a large host
// copy, a descheduled thread) has not let go of the issue lock when Abort's bound passes,
// so the device resources stay allocated: Close's error must say so, wrapping ErrTimeout.
func TestCloseAfterAbortWithStuckIssuer(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	g := gs[0]
	setTeardownTimeouts(g, time.Second, 200*time.Millisecond)
	release := func() { l.knob("h2d_hold", 0) }
	defer release()
	l.knob("h2d_hold", 1)
	got := make(chan procgroup.Work, 1)
	go func() { got <- g.AllReduce(context.Background(), []float32{1}, procgroup.Sum) }()
	waitKnob(t, l, "h2d_held", 1, release)
	within(t, hangBound, "Abort with an issuer stuck outside NCCL", release, func() { g.Abort(nil) })
	wantErr(t, g.Close(), procgroup.ErrTimeout, "rank 0", "a collective being issued", "within 200ms", "left allocated")
	release()
	w := recvWork(t, got, "the stuck AllReduce", release)
	wantErr(t, waitT(t, w), procgroup.ErrAborted, "allreduce #1")
	gs[1].Abort(nil)
}

// TestCloseAfterAbortWithUndrainedStream: after ncclCommAbort the comm stream does not
// drain (a kernel that never ends), so the device resources stay allocated: Close's error
// must say so, wrapping ErrTimeout.
func TestCloseAfterAbortWithUndrainedStream(t *testing.T) {
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
	wantErr(t, g.Close(), procgroup.ErrTimeout, "rank 0", "comm stream did not drain within 200ms", "left allocated")
	// The resources stay allocated, but the device operations are closed: no new cuBLAS
	// handle, no kernel module loaded into a context the group has let go of.
	handles := l.knob("blas_handles", 0)
	wantErr(t, g.PrepareBLAS(), procgroup.ErrClosed, "rank 0")
	if n := l.knob("blas_handles", 0) - handles; n != 0 {
		t.Errorf("PrepareBLAS after the abort created %d cuBLAS handles", n)
	}
	d := procgroup.DeviceBuffer{Ptr: 1, Type: procgroup.Float32, Count: 1}
	wantErr(t, g.ScaleAsync(0, d, d, 2, true), procgroup.ErrClosed, "rank 0")
	gs[1].Abort(nil)
}

// TestCloseWithUndrainedStream: the communicator closes cleanly but the comm stream does
// not drain by Close's deadline: the device resources stay allocated, and Close's error
// must say so, wrapping ErrTimeout.
func TestCloseWithUndrainedStream(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	each(t, gs, func(r int, g *Group) error {
		return waitT(t, g.AllReduce(context.Background(), []float32{float32(r)}, procgroup.Sum))
	})
	g := gs[0]
	setTeardownTimeouts(g, time.Second, 200*time.Millisecond)
	l.knob("gate_close", int64(uintptr(g.streamHandle())))
	defer l.knob("gate_open", 0)
	var err error
	within(t, hangBound, "Close with a comm stream that does not drain", func() { l.knob("gate_open", 0) },
		func() { err = g.Close() })
	wantErr(t, err, procgroup.ErrTimeout, "rank 0", "comm stream did not drain", "left allocated")
	if l.knob("stream_live", int64(g.streamHandle())) != 1 {
		t.Error("Close destroyed the comm stream that had not drained")
	}
	l.knob("gate_open", 0)
	if err := gs[1].Close(); err != nil {
		t.Fatalf("rank 1's Close: %v", err)
	}
}

// TestCloseNamesFailedFinalizeAndHungAbort: ncclCommFinalize fails at once, and the
// ncclCommAbort that follows does not return (NVIDIA/nccl#829). Close must return within
// its bound with an error that names both, not a destroy that was never called.
func TestCloseNamesFailedFinalizeAndHungAbort(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	each(t, gs, func(r int, g *Group) error {
		return waitT(t, g.AllReduce(context.Background(), []float32{float32(r)}, procgroup.Sum))
	})
	g := gs[0]
	setTeardownTimeouts(g, 200*time.Millisecond, 200*time.Millisecond)
	release := func() { l.knob("nccl_abort_hang", 0) }
	defer release()
	defer l.knob("nccl_finalize_fail", l.knob("nccl_finalize_fail", 6)) // ncclRemoteError
	l.knob("nccl_abort_hang", 1)
	var err error
	within(t, 3*time.Second, "Close with a failing finalize and an ncclCommAbort that does not return", release,
		func() { err = g.Close() })
	wantErr(t, err, procgroup.ErrTimeout, "rank 0", "ncclCommFinalize: remote process exited", "ncclCommAbort did not return within 200ms", "left allocated")
	if strings.Contains(err.Error(), "ncclCommDestroy") {
		t.Errorf("Close's error names ncclCommDestroy, which was never called: %v", err)
	}
	release()
	waitStuck(g)
	l.knob("nccl_finalize_fail", 0)
	gs[1].Abort(nil)
}

// TestAbortDuringCloseKeepsFinalizeError: ncclCommFinalize fails, and Abort comes while
// Close is handling that: Close must still report the failure.
func TestAbortDuringCloseKeepsFinalizeError(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	each(t, gs, func(r int, g *Group) error {
		return waitT(t, g.AllReduce(context.Background(), []float32{float32(r)}, procgroup.Sum))
	})
	g := gs[0]
	release := func() { l.knob("nccl_abort_hang", 0) }
	defer release()
	defer l.knob("nccl_finalize_fail", l.knob("nccl_finalize_fail", 6)) // ncclRemoteError
	// ncclCommAbort, which follows the failed finalize, holds until released.
	l.knob("nccl_abort_hang", 1)
	closed := make(chan error, 1)
	go func() { closed <- g.Close() }()
	waitKnob(t, l, "nccl_aborting", 1, release)
	aborted := make(chan struct{})
	go func() {
		defer close(aborted)
		g.Abort(errors.New("shutting down"))
	}()
	time.Sleep(50 * time.Millisecond) // the watchdog has seen the abort
	release()
	var err error
	select {
	case err = <-closed:
	case <-time.After(hangBound):
		t.Fatal("Close did not return")
	}
	<-aborted
	wantErr(t, err, nil, "rank 0", "ncclCommFinalize: remote process exited")
	l.knob("nccl_finalize_fail", 0)
	gs[1].Abort(nil)
}

// TestCloseBoundedInTotal: Close returns within finalizeTimeout + drainTimeout (Note
// [Bounded teardown]) even when the abort after the finalize deadline takes most of the
// drain bound and the comm stream then does not drain.
func TestCloseBoundedInTotal(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	each(t, gs, func(r int, g *Group) error {
		return waitT(t, g.AllReduce(context.Background(), []float32{float32(r)}, procgroup.Sum))
	})
	g := gs[0]
	const finalize, drain = 200 * time.Millisecond, 2 * time.Second
	setTeardownTimeouts(g, finalize, drain)
	release := func() {
		l.knob("nccl_abort_hang", 0)
		l.knob("nccl_finalize_hang", 0)
		l.knob("gate_open", 0)
	}
	defer release()
	l.knob("nccl_finalize_hang", 1) // until the abort
	l.knob("nccl_abort_hang", 1)
	l.knob("gate_close", int64(uintptr(g.streamHandle())))
	start := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- g.Close() }()
	waitKnob(t, l, "nccl_aborting", 1, release)
	time.Sleep(drain * 3 / 4)
	l.knob("nccl_abort_hang", 0)
	var err error
	select {
	case err = <-closed:
	case <-time.After(hangBound):
		release()
		t.Fatal("Close did not return")
	}
	d := time.Since(start)
	wantErr(t, err, procgroup.ErrTimeout, "rank 0", "ncclCommFinalize did not complete within 200ms", "comm stream did not drain")
	if limit := finalize + drain + drain/4; d > limit {
		t.Errorf("Close took %v, want at most finalizeTimeout + drainTimeout = %v (limit %v)", d, finalize+drain, limit)
	}
	release()
	gs[1].Abort(nil)
}
