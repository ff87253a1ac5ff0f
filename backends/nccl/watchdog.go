package nccl

/*
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"time"
	"unsafe"

	"github.com/goddp/goddp/procgroup"
)

// Polling intervals of the watchdog while a work is pending: it starts at minPoll after
// each completion and backs off to maxPoll (Note [Completion polling]).
const (
	minPoll = 20 * time.Microsecond
	maxPoll = time.Millisecond
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
		if len(g.pending) > 0 {
			head = g.pending[0]
		}
		g.mu.Unlock()
		if state == stateAborted {
			g.finishAbort()
			return
		}
		if head == nil {
			if state == stateClosing {
				g.release()
				return
			}
			select {
			case <-g.kick:
			case <-g.stop:
			}
			poll = minPoll
			continue
		}
		r := C.goddp_event_query(g.lib.p, g.cuCtx, head.endEv)
		switch r {
		case C.GODDP_CUDA_SUCCESS:
			// A collective that NCCL failed still ends its stream's work: its end event
			// completes too, so the async error is checked before the result is trusted.
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
		if err := g.check(head); err != nil {
			g.abort(err, true)
			continue
		}
		timer.Reset(poll)
		select {
		case <-timer.C:
		case <-g.stop:
		}
		poll = min(2*poll, maxPoll)
	}
}

// check is the watchdog's test of a pending group: NCCL's async error, the timeout of the
// oldest work, the contexts of all pending works.
func (g *Group) check(head *Work) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.state == stateAborted {
		return nil
	}
	if err := g.asyncErrorLocked(head); err != nil {
		return err
	}
	last := head.seq - 1
	if now := time.Now(); now.After(head.deadline) {
		return fmt.Errorf("nccl: rank %d (%s): %s #%d (last completed #%d) did not complete within %v: %w",
			g.rank, g.host, head.op, head.seq, last, g.opts.Timeout, procgroup.ErrTimeout)
	}
	for _, w := range g.pending {
		if err := w.ctx.Err(); err != nil {
			return fmt.Errorf("nccl: rank %d (%s): %s #%d: %w", g.rank, g.host, w.op, w.seq, err)
		}
	}
	return nil
}

// asyncError polls ncclCommGetAsyncError; the error names head, the oldest pending work.
func (g *Group) asyncError(head *Work) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.state == stateAborted {
		return nil
	}
	return g.asyncErrorLocked(head)
}

func (g *Group) asyncErrorLocked(head *Work) error {
	var res C.goddp_ncclResult_t
	if r := C.goddp_ncclCommGetAsyncError(g.lib.p, g.comm, &res); r != 0 {
		res = r
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
	g.pending[0] = nil
	g.pending = g.pending[1:]
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

// finishAbort drains the comm stream after ncclCommAbort, fails every pending work and
// releases the group.
func (g *Group) finishAbort() {
	C.goddp_stream_sync(g.lib.p, g.cuCtx, g.stream) // error ignored: the comm is gone anyway
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
	g.release()
}

// release destroys the communicator (unless aborted) and frees the device resources.
func (g *Group) release() {
	C.goddp_stream_sync(g.lib.p, g.cuCtx, g.stream)
	g.mu.Lock()
	if g.comm != nil && !g.commGone {
		g.commGone = true
		C.goddp_comm_destroy(g.lib.p, g.cuCtx, g.comm)
	}
	g.mu.Unlock()
	g.releaseDevice()
}
