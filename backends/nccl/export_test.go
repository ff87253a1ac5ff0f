//go:build cgo

package nccl

import (
	"errors"
	"time"
	"unsafe"
)

// setTeardownTimeouts sets g's bounds of Note [Bounded teardown].
func setTeardownTimeouts(g *Group, finalize, drain time.Duration) {
	g.finalizeTimeout, g.drainTimeout = finalize, drain
}

// setAbortGrace sets how long g's abort waits for an NCCL call in progress (finishAbort).
func setAbortGrace(g *Group, d time.Duration) { g.abortGrace = d }

// streamHandle is g's comm stream.
func (g *Group) streamHandle() Stream { return Stream(uintptr(unsafe.Pointer(g.stream))) }

func errorsIs(err, target error) bool { return errors.Is(err, target) }

// waitStuck waits for g's teardown goroutines that were given up on inside NCCL (Note
// [Bounded teardown]) to return, once the test has unblocked the fake.
func waitStuck(g *Group) { g.stuck.Wait() }
