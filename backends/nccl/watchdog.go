package nccl

/*
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/goddp/goddp/procgroup"
)

// Polling intervals of the watchdog while a work is pending: it starts at minPoll after
// each completion and backs off to maxPoll (Note [Completion polling]).
const (
	minPoll = 20 * time.Microsecond
	maxPoll = time.Millisecond
)

// Note [Bounded teardown]: no wait on the way out of a group is unbounded, since a peer may
// be dead. Close finalizes the communicator (ncclCommFinalize, NCCL 2.14 or later, which
// waits for the peers to finish their operations) and then destroys it; past
// finalizeTimeout the watchdog aborts it instead (ncclCommAbort, from another thread,
// unblocks a finalize or destroy that waits for a peer) and Close returns an error wrapping
// procgroup.ErrTimeout. After ncclCommAbort, or before the device resources are freed,
// the comm stream is drained by polling an event recorded at its end, for at most
// drainTimeout (never cuStreamSynchronize, which an abort cannot interrupt). If an issuer
// is still inside NCCL, or the stream has not drained, by then, the group's device memory,
// events and stream are left allocated rather than freed under a kernel that may still use
// them, and a warning says so.
const (
	defaultFinalizeTimeout = 30 * time.Second
	defaultDrainTimeout    = 10 * time.Second
)

// watchdog is the group's one goroutine. It completes works in issue order, and while the
// oldest is pending it polls ncclCommGetAsyncError, the collective timeout and the works'
// contexts; on any of them it aborts the group. It exits, after releasing the group's
// resources, when the group is aborted or closed and drained.
//
// Note [Completion polling]: the end event of the oldest work is polled with cuEventQuery
// (a host-blocking cuEventSynchronize could not be interrupted by an abort). Polls start
// 20 µs apart and back off to 1 ms, so a bucket's all-reduce is seen within ~1 ms of its
// end while an idle group costs nothing (it sleeps on kick).
func (g *Group) watchdog() {
	defer close(g.loopDone)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	poll := minPoll
	for {
		g.mu.Lock()
		state := g.state
		var head *Work
		issued := false
		if len(g.pending) > 0 {
			head = g.pending[0]
			issued = head.issued
		}
		g.mu.Unlock()
		if state == stateAborted {
			g.finishAbort()
			return
		}
		if head == nil {
			if state == stateClosing {
				g.closeErr = g.finalize()
				g.release(time.Now().Add(g.drainTimeout))
				return
			}
			select {
			case <-g.kick:
			case <-g.stop:
			}
			poll = minPoll
			continue
		}
		if issued { // else its NCCL call has not returned yet: only its timeout and ctx count
			r := C.goddp_event_query(g.lib.p, g.cuCtx, head.endEv)
			switch r {
			case C.GODDP_CUDA_SUCCESS:
				// A collective that NCCL failed still ends its stream's work: its end
				// event completes too, so the async error is checked before the result
				// is trusted.
				if err := g.asyncError(head); err != nil {
					g.abort(err, true)
					continue
				}
				g.complete(head)
				poll = minPoll
				continue
			case C.GODDP_CUDA_ERROR_NOT_READY:
			default:
				g.abort(fmt.Errorf("nccl: rank %d (%s): %s #%d: %w", g.rank, g.host, head.op, head.seq, g.lib.cuErr("cuEventQuery", r)), true)
				continue
			}
		}
		if err := g.check(head, issued); err != nil {
			g.abort(err, true)
			continue
		}
		var issuedC chan struct{}
		if !issued {
			issuedC = g.kick // the issuer kicks once the call has returned
		}
		timer.Reset(poll)
		select {
		case <-timer.C:
			poll = min(2*poll, maxPoll)
		case <-g.stop:
		case <-issuedC:
			timer.Stop() // Go 1.23 timers: no stale tick after Stop or Reset
			poll = minPoll
		}
	}
}

// check is the watchdog's test of a pending group: NCCL's async error, the timeout of the
// oldest work, the contexts of all pending works. issued says whether head's NCCL call
// has returned.
func (g *Group) check(head *Work, issued bool) error {
	if err := g.asyncError(head); err != nil {
		return err
	}
	last := head.seq - 1
	if now := time.Now(); now.After(head.deadline) {
		where := ""
		if !issued {
			where = " (its NCCL call has not returned: peers late or dead?)"
		}
		return fmt.Errorf("nccl: rank %d (%s): %s #%d (last completed #%d) did not complete within %v%s: %w",
			g.rank, g.host, head.op, head.seq, last, g.opts.Timeout, where, procgroup.ErrTimeout)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, w := range g.pending {
		if err := w.ctx.Err(); err != nil {
			return fmt.Errorf("nccl: rank %d (%s): %s #%d: %w", g.rank, g.host, w.op, w.seq, err)
		}
	}
	return nil
}

// asyncError polls ncclCommGetAsyncError; the error names head, the oldest pending work.
// Only the watchdog calls it, while the communicator lives.
func (g *Group) asyncError(head *Work) error {
	res := C.goddp_ncclCommGetAsyncError(g.lib.p, g.comm, g.asyncR)
	if res == 0 {
		res = *g.asyncR
	}
	if res == C.GODDP_NCCL_SUCCESS || res == C.GODDP_NCCL_IN_PROGRESS {
		return nil
	}
	detail := C.GoString(C.goddp_nccl_last_error(g.lib.p, g.comm))
	if detail != "" {
		detail = " (" + detail + ")"
	}
	return fmt.Errorf("nccl: rank %d (%s): %s #%d (last completed #%d): %w%s",
		g.rank, g.host, head.op, head.seq, head.seq-1, g.lib.ncclErr("ncclCommGetAsyncError", res), detail)
}

// complete finishes the oldest work, whose end event has completed.
func (g *Group) complete(w *Work) {
	g.mu.Lock()
	if len(g.pending) == 0 || g.pending[0] != w || g.state == stateAborted {
		g.mu.Unlock()
		return
	}
	n := copy(g.pending, g.pending[1:]) // in place: the next append reuses the array
	g.pending[n] = nil
	g.pending = g.pending[:n]
	g.mu.Unlock()
	// The work is ours now: Abort fails only works still pending.
	if w.out != nil && w.outBytes > 0 {
		copy(rawBytes(w.out), unsafe.Slice((*byte)(unsafe.Add(w.st.host, w.outOff)), w.outBytes))
	}
	g.mu.Lock()
	g.recycleLocked(w)
	g.mu.Unlock()
	w.Complete(nil)
}

// abortGrace is how long the watchdog lets an issuer finish its NCCL call before it aborts
// the communicator under it (Note [No NCCL call under the lock]).
const abortGrace = 50 * time.Millisecond

// finishAbort aborts the communicator, waits (bounded) for an issuer inside NCCL to return
// and for the comm stream to drain, fails every pending work and releases the group.
//
// ncclCommAbort frees the communicator, so it must not come just before an issuer's call
// (which may have checked the state before the abort): the watchdog first takes g.issueMu,
// waiting up to abortGrace, and aborts holding it, so that no call can start meanwhile.
// An issuer still inside NCCL after abortGrace is blocked there (a call that does not wait
// for peers returns within microseconds), and the abort is what unblocks it.
func (g *Group) finishAbort() {
	deadline := time.Now().Add(g.drainTimeout)
	held := g.lockIssuer(time.Now().Add(abortGrace))
	if g.comm != nil && !g.commGone {
		g.commGone = true
		C.goddp_comm_abort(g.lib.p, g.cuCtx, g.comm)
	}
	if !held {
		held = g.lockIssuer(deadline)
	}
	if held {
		g.issueMu.Unlock() // later issuers see the group aborted and make no call
	}
	quiet := held
	drained := quiet && g.drain(deadline)
	g.mu.Lock()
	pend := g.pending
	g.pending = nil
	err := g.abortErr
	for _, w := range pend {
		g.recycleLocked(w)
	}
	g.mu.Unlock()
	for _, w := range pend {
		w.Complete(fmt.Errorf("nccl: rank %d: %s #%d: %w", g.rank, w.op, w.seq, err))
	}
	switch {
	case !quiet:
		g.log.Warn("nccl: a collective's NCCL call did not return after ncclCommAbort; the group's device resources are left allocated",
			zap.Int("rank", g.rank), zap.Duration("waited", g.drainTimeout))
	case !drained:
		g.log.Warn("nccl: the comm stream did not drain after ncclCommAbort; the group's device resources are left allocated",
			zap.Int("rank", g.rank), zap.Duration("waited", g.drainTimeout))
	default:
		g.releaseDevice()
	}
}

// lockIssuer takes g.issueMu, which an issuer holds across its NCCL call, polling until
// deadline; it reports whether it holds it.
func (g *Group) lockIssuer(deadline time.Time) bool {
	for d := 10 * time.Microsecond; ; d = min(2*d, time.Millisecond) {
		if g.issueMu.TryLock() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(d)
	}
}

// drain records g.drainEv at the end of the comm stream and polls it until it completes
// or deadline passes; it reports whether the stream drained.
func (g *Group) drain(deadline time.Time) bool {
	if g.stream == nil || g.drainEv == nil {
		return true
	}
	ev, s := C.uintptr_t(uintptr(unsafe.Pointer(g.drainEv))), C.uintptr_t(uintptr(unsafe.Pointer(g.stream)))
	if C.goddp_event_record(g.lib.p, g.cuCtx, ev, s) != 0 {
		return false
	}
	for d := 10 * time.Microsecond; ; d = min(2*d, time.Millisecond) {
		switch C.goddp_event_query(g.lib.p, g.cuCtx, g.drainEv) {
		case C.GODDP_CUDA_SUCCESS:
			return true
		case C.GODDP_CUDA_ERROR_NOT_READY:
		default:
			return false
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(d)
	}
}

// Who frees the communicator at Close: the finalizing goroutine (destroy) or the
// watchdog (abort, past the deadline).
const (
	freeUnclaimed = iota
	freeByDestroy
	freeByAbort
)

// finalize finalizes and destroys the communicator under g.finalizeTimeout (Note [Bounded
// teardown]); past it, or if ncclCommFinalize fails, the communicator is aborted. It
// returns Close's error.
func (g *Group) finalize() error {
	if g.comm == nil || g.commGone {
		return nil
	}
	g.commGone = true
	type result struct {
		step string
		r    C.goddp_ncclResult_t
	}
	done := make(chan result, 1)
	var claim atomic.Int32
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if r := C.goddp_comm_finalize(g.lib.p, g.cuCtx, g.comm); r != 0 {
			if claim.CompareAndSwap(freeUnclaimed, freeByAbort) {
				C.goddp_comm_abort(g.lib.p, g.cuCtx, g.comm)
			}
			done <- result{"ncclCommFinalize", r}
			return
		}
		if !claim.CompareAndSwap(freeUnclaimed, freeByDestroy) {
			done <- result{} // the watchdog aborted it
			return
		}
		done <- result{"ncclCommDestroy", C.goddp_comm_destroy(g.lib.p, g.cuCtx, g.comm)}
	}()
	timer := time.NewTimer(g.finalizeTimeout)
	defer timer.Stop()
	step := "ncclCommDestroy"
	if C.goddp_has_finalize(g.lib.p) != 0 {
		step = "ncclCommFinalize"
	}
	var err error
	select {
	case res := <-done:
		if res.r != 0 {
			return fmt.Errorf("nccl: rank %d (%s): closing: %w", g.rank, g.host, g.lib.ncclErr(res.step, res.r))
		}
		return nil
	case <-g.stop: // Abort during Close: no error of Close's own
	case <-timer.C:
		err = fmt.Errorf("nccl: rank %d (%s): closing: %s did not complete within %v (a peer that does not close?); the communicator was aborted: %w",
			g.rank, g.host, step, g.finalizeTimeout, procgroup.ErrTimeout)
	}
	if claim.CompareAndSwap(freeUnclaimed, freeByAbort) {
		C.goddp_comm_abort(g.lib.p, g.cuCtx, g.comm) // unblocks the finalize
	}
	timer.Reset(g.drainTimeout)
	select {
	case <-done:
	case <-timer.C:
		g.log.Warn("nccl: the communicator's finalize or destroy did not return after ncclCommAbort", zap.Int("rank", g.rank))
	}
	return err
}

// release frees the device resources once the comm stream has drained by deadline.
func (g *Group) release(deadline time.Time) {
	if !g.drain(deadline) {
		g.log.Warn("nccl: the comm stream did not drain at Close; the group's device resources are left allocated",
			zap.Int("rank", g.rank), zap.Duration("waited", g.drainTimeout))
		return
	}
	g.releaseDevice()
}
