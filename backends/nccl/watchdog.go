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

// Note [Bounded teardown]: no wait on the way out of a group is unbounded, since a peer
// may be dead. Close finalizes the communicator (ncclCommFinalize, NCCL 2.14 or later,
// which waits for the peers to finish their operations) and then destroys it; past
// finalizeTimeout, or when ncclCommFinalize fails, the watchdog aborts it instead
// (ncclCommAbort, from another thread, unblocks a finalize or destroy that waits for a
// peer) and Close returns an error naming the call, wrapping procgroup.ErrTimeout for a
// deadline. ncclCommAbort itself may not return (NVIDIA/nccl#829): it runs on a goroutine
// of its own, waited for drainTimeout at most. After ncclCommAbort, or before the device
// resources are freed, the comm stream is drained by polling an event recorded at its end
// (never cuStreamSynchronize, which an abort cannot interrupt). The abort, the wait for
// the calls it unblocks and the drain share one drainTimeout, so Close returns within
// finalizeTimeout + drainTimeout + releaseGrace in all, and Abort within drainTimeout +
// releaseGrace. If by then ncclCommAbort, an issuer's NCCL call, ncclCommFinalize or
// ncclCommDestroy has not returned, or the stream has not drained, the group's device
// memory, events and stream are left allocated rather than freed under a call or a kernel
// that may still use them, a warning says so, and Close's error too (wrapping
// procgroup.ErrTimeout); the goroutines given up on are counted in g.stuck. The device
// resources are freed under the same deadline: cublasDestroy, which synchronises the whole
// device and so waits for the trainer's streams too, runs on such a goroutine, and a
// kernel launch in progress holds g.modUse, which releaseDevice waits for to unload the
// module; past the deadline (which the release stretches to releaseGrace at least, where
// the drain has spent it) the resources are left allocated as above. Either way the device
// operations fail with ErrClosed from the start of the teardown (markDeviceClosed), so
// that nothing creates a cuBLAS handle or loads a module into a context the group lets go
// of. Without ncclCommFinalize (NCCL before 2.14) Close calls ncclCommDestroy alone, and a
// destroy that hangs cannot be aborted (it is freeing the communicator): Close then
// returns past its deadline, leaving the resources allocated.
//
// One hazard remains, on the blocking communicators that the group creates: an abort (a
// timeout, an async error, Abort, a ctx that ends) while an issuer is inside a
// collective's NCCL call that is slow but live. The lazy connection of
// NCCL_RUNTIME_CONNECT (on by default since NCCL 2.22) to peers that are late but alive is
// such a call, and so is slow host work inside the call. finishAbort cannot tell it from a
// call blocked on a dead peer: past g.abortGrace it runs ncclCommAbort under the call,
// although NCCL lets only one thread at a time operate a blocking communicator, so the call
// may go on to use the communicator that the abort frees (with nccl_enqueue_delay_us at
// three graces the fake counts two such calls). The grace narrows that window; it does not
// close it. Closing it needs non-blocking communicators (NCCL 2.14 or later:
// ncclCommInitRankConfig with config.blocking = 0, whose calls return ncclInProgress
// instead of blocking, completed by polling ncclCommGetAsyncError), for which the abort
// could wait for the gate without a time limit, the grace left as the fallback for older
// NCCL.
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
				g.markDeviceClosed()
				quiet, deadline, err := g.finalize()
				if quiet {
					if why := g.release(deadline); why != "" {
						what := fmt.Sprintf("%s by Close's deadline (at most %v after Close)", why, g.finalizeTimeout+g.drainTimeout)
						if err == nil {
							err = fmt.Errorf("nccl: rank %d (%s): closing: %s; the group's device resources are left allocated: %w",
								g.rank, g.host, what, procgroup.ErrTimeout)
						} else {
							err = fmt.Errorf("%w; %s, so the group's device resources are left allocated: %w", err, what, procgroup.ErrTimeout)
						}
					}
				}
				g.closeErr = err
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

// defaultAbortGrace is g.abortGrace, how long the watchdog lets an issuer that is inside
// its NCCL call finish it before it aborts the communicator under it (Note [Communicator
// gate] in shim.h).
const defaultAbortGrace = 50 * time.Millisecond

// finishAbort aborts the communicator, waits (bounded) for an issuer inside NCCL to return
// and for the comm stream to drain, fails every pending work and releases the group.
//
// ncclCommAbort frees the communicator, so no NCCL call may start on it after the abort,
// nor be running during it unless the abort is what unblocks it. The watchdog first closes
// the gate (Note [Communicator gate]): an issuer that has not yet entered its NCCL call
// then makes none, however long it takes to get there (a large host copy, a descheduled
// thread). An issuer found inside its call gets g.abortGrace to return; one still inside
// after it is blocked there (waiting for peers), and the abort is what unblocks it.
func (g *Group) finishAbort() {
	g.markDeviceClosed()
	deadline := time.Now().Add(g.drainTimeout)
	aborted := true
	if g.comm != nil && !g.commGone {
		g.commGone = true
		if C.goddp_gate_close(g.gate)&C.GODDP_GATE_IN_CALL != 0 {
			grace := time.Now().Add(g.abortGrace)
			for d := 10 * time.Microsecond; C.goddp_gate_load(g.gate)&C.GODDP_GATE_IN_CALL != 0 && time.Now().Before(grace); d = min(2*d, time.Millisecond) {
				time.Sleep(d)
			}
		}
		aborted = g.abortComm(deadline)
	}
	quiet := aborted && g.lockIssuer(deadline)
	if quiet {
		g.unlockIssue() // later issuers see the group aborted and make no call
	}
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
	case !aborted:
		g.closeErr = fmt.Errorf("nccl: rank %d (%s): ncclCommAbort did not return within %v; the group's device resources are left allocated: %w",
			g.rank, g.host, g.drainTimeout, procgroup.ErrTimeout)
		g.log.Warn("nccl: ncclCommAbort did not return; the group's device resources are left allocated",
			zap.Int("rank", g.rank), zap.Duration("waited", g.drainTimeout))
	case !quiet:
		g.closeErr = fmt.Errorf("nccl: rank %d (%s): a collective being issued (inside its NCCL call or before it) had not returned within %v of ncclCommAbort; the group's device resources are left allocated: %w",
			g.rank, g.host, g.drainTimeout, procgroup.ErrTimeout)
		g.log.Warn("nccl: a collective being issued did not return after ncclCommAbort; the group's device resources are left allocated",
			zap.Int("rank", g.rank), zap.Duration("waited", g.drainTimeout))
	case !drained:
		g.closeErr = fmt.Errorf("nccl: rank %d (%s): the comm stream did not drain within %v of ncclCommAbort; the group's device resources are left allocated: %w",
			g.rank, g.host, g.drainTimeout, procgroup.ErrTimeout)
		g.log.Warn("nccl: the comm stream did not drain after ncclCommAbort; the group's device resources are left allocated",
			zap.Int("rank", g.rank), zap.Duration("waited", g.drainTimeout))
	default:
		if what := g.releaseDevice(deadline); what != "" {
			g.closeErr = fmt.Errorf("nccl: rank %d (%s): %s within %v of ncclCommAbort; the group's device resources are left allocated: %w",
				g.rank, g.host, what, g.drainTimeout, procgroup.ErrTimeout)
			g.log.Warn("nccl: the group's device resources are left allocated", zap.String("why", what),
				zap.Int("rank", g.rank), zap.Duration("waited", g.drainTimeout))
		}
	}
}

// abortComm calls ncclCommAbort, which some NCCL versions may not return from
// (NVIDIA/nccl#829), on a goroutine of its own (counted in g.stuck) and waits for it until
// deadline; it reports whether the call returned. The gate must be closed.
func (g *Group) abortComm(deadline time.Time) bool {
	return g.bounded(deadline, func() { C.goddp_comm_abort(g.lib.p, g.cuCtx, g.comm) })
}

// bounded runs call, a library call that may never return, on a goroutine of its own
// (counted in g.stuck) and waits for it until deadline; it reports whether it returned.
func (g *Group) bounded(deadline time.Time, call func()) bool {
	done := make(chan struct{})
	g.stuck.Add(1)
	go func() {
		defer g.stuck.Done()
		defer close(done)
		call()
	}()
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	select {
	case <-done:
		return true
	case <-timer.C:
		return false
	}
}

// lockBy takes l, polling until deadline; it reports whether it holds it.
func lockBy(l interface{ TryLock() bool }, deadline time.Time) bool {
	for d := 10 * time.Microsecond; !l.TryLock(); d = min(2*d, time.Millisecond) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(d)
	}
	return true
}

// lockIssuer takes g.issueSem, which an issuer holds across its NCCL call, polling until
// deadline; it reports whether it holds it.
func (g *Group) lockIssuer(deadline time.Time) bool {
	for d := 10 * time.Microsecond; ; d = min(2*d, time.Millisecond) {
		select {
		case g.issueSem <- struct{}{}:
			return true
		default:
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
// teardown]); past it, or if ncclCommFinalize fails, the watchdog aborts the communicator
// (abortComm, bounded). It returns whether the communicator's calls have all returned
// (else the device resources must stay allocated), the deadline by which the comm stream
// must then drain (so that Close is bounded by finalizeTimeout + drainTimeout in all), and
// Close's error.
func (g *Group) finalize() (quiet bool, deadline time.Time, err error) {
	if g.comm == nil || g.commGone {
		return true, time.Now().Add(g.drainTimeout), nil
	}
	g.commGone = true
	C.goddp_gate_close(g.gate) // no collective now (the group is closing): none ever again
	type result struct {
		step string
		r    C.goddp_ncclResult_t
	}
	done := make(chan result, 1)
	var claim atomic.Int32
	g.stuck.Add(1)
	go func() {
		defer g.stuck.Done()
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if r := C.goddp_comm_finalize(g.lib.p, g.cuCtx, g.comm); r != 0 {
			done <- result{"ncclCommFinalize", r} // the watchdog aborts the communicator
			return
		}
		if !claim.CompareAndSwap(freeUnclaimed, freeByDestroy) {
			done <- result{"ncclCommFinalize", 0} // the watchdog aborted it
			return
		}
		done <- result{"ncclCommDestroy", C.goddp_comm_destroy(g.lib.p, g.cuCtx, g.comm)}
	}()
	closing := func(format string, a ...any) error {
		return fmt.Errorf("nccl: rank %d (%s): closing: "+format, append([]any{g.rank, g.host}, a...)...)
	}
	timer := time.NewTimer(g.finalizeTimeout)
	defer timer.Stop()
	var res result
	got, timedOut := false, false
	select {
	case res = <-done:
		got = true
	case <-g.stop: // Abort during Close
	case <-timer.C:
		timedOut = true
	}
	if !got { // a result that came meanwhile counts (select picks a ready case at random)
		select {
		case res = <-done:
			got = true
		default:
		}
	}
	deadline = time.Now().Add(g.drainTimeout)
	if got && res.step == "ncclCommDestroy" { // the communicator is gone
		if res.r != 0 {
			return true, deadline, closing("%w", g.lib.ncclErr(res.step, res.r))
		}
		return true, deadline, nil
	}
	// ncclCommFinalize failed (got), or the finalize or destroy is still running: abort
	// the communicator, unless the destroy has begun (it cannot be aborted).
	aborted := claim.CompareAndSwap(freeUnclaimed, freeByAbort) // got implies aborted
	step := "ncclCommFinalize"
	if !aborted {
		step = "ncclCommDestroy"
	}
	var first error // what went wrong before the abort
	switch {
	case got:
		first = g.lib.ncclErr(res.step, res.r)
	case timedOut:
		first = fmt.Errorf("%s did not complete within %v (a peer that does not close?): %w", step, g.finalizeTimeout, procgroup.ErrTimeout)
	}
	if aborted && !g.abortComm(deadline) { // the abort unblocks the finalize
		g.log.Warn("nccl: ncclCommAbort did not return at Close; the group's device resources are left allocated",
			zap.Int("rank", g.rank), zap.Duration("waited", g.drainTimeout))
		if first == nil {
			return false, deadline, closing("ncclCommAbort did not return within %v; the group's device resources are left allocated: %w",
				g.drainTimeout, procgroup.ErrTimeout)
		}
		return false, deadline, closing("%w; then ncclCommAbort did not return within %v, so the group's device resources are left allocated: %w",
			first, g.drainTimeout, procgroup.ErrTimeout)
	}
	switch {
	case first != nil && aborted:
		err = closing("%w; the communicator was aborted", first)
	case first != nil:
		err = closing("%w", first)
	}
	if got {
		return true, deadline, err
	}
	timer.Reset(time.Until(deadline))
	select {
	case res = <-done:
		// The finalize or destroy returned; a failure is Close's error too, even where
		// an Abort during Close caused it.
		switch {
		case res.r == 0:
		case err == nil:
			err = closing("%w", g.lib.ncclErr(res.step, res.r))
		default:
			err = fmt.Errorf("%w; %w", err, g.lib.ncclErr(res.step, res.r))
		}
		return true, deadline, err
	case <-timer.C:
	}
	// Still inside ncclCommFinalize (one that the abort did not unblock) or
	// ncclCommDestroy (which nothing can interrupt): the stream, events and memory it may
	// still use stay allocated.
	g.log.Warn("nccl: the communicator's finalize or destroy did not return; the group's device resources are left allocated",
		zap.String("call", step), zap.Int("rank", g.rank), zap.Duration("waited", g.drainTimeout))
	if err == nil {
		return false, deadline, closing("%s did not return within %v; the group's device resources are left allocated: %w",
			step, g.drainTimeout, procgroup.ErrTimeout)
	}
	return false, deadline, fmt.Errorf("%w; %s did not return after %v more, so the group's device resources are left allocated", err, step, g.drainTimeout)
}

// release frees the device resources once the comm stream has drained by deadline; it
// returns "" once it has, or what did not finish.
func (g *Group) release(deadline time.Time) string {
	what := "the comm stream did not drain"
	if g.drain(deadline) {
		if what = g.releaseDevice(deadline); what == "" {
			return ""
		}
	}
	g.log.Warn("nccl: the group's device resources are left allocated at Close", zap.String("why", what),
		zap.Int("rank", g.rank), zap.Duration("waited", g.drainTimeout))
	return what
}
