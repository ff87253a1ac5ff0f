//go:build cgo

package nccl

import (
	"runtime"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// TestFakeLegacyStream checks the fake driver's legacy default stream against the real
// one's semantics: work on it waits for the context's blocking streams, work on a blocking
// stream waits for it, and a non-blocking stream waits for neither.
func TestFakeLegacyStream(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 1, 0)
	g := gs[0]
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	defer l.knob("ctx_set", l.knob("ctx_set", int64(uintptr(g.cuCtx))))
	defer l.knob("gate_open", 0)
	blocking := Stream(l.knob("stream_create", 0))
	nonBlocking, err := g.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer g.DestroyStream(nonBlocking)
	defer g.DestroyStream(blocking)
	evs := make([]procgroup.Event, 3)
	for i := range evs {
		if evs[i], err = g.NewEvent(); err != nil {
			t.Fatal(err)
		}
		defer g.DestroyEvent(evs[i])
	}
	query := func(e procgroup.Event) int64 {
		time.Sleep(20 * time.Millisecond) // the streams' threads have run what they can
		return l.knob("event_query", int64(e))
	}
	const ready, notReady = 0, 600

	// A blocking stream held back: the legacy stream waits for it; a non-blocking does not.
	l.knob("gate_close", int64(blocking))
	if err := g.RecordEvent(evs[0], 0); err != nil {
		t.Fatal(err)
	}
	if err := g.RecordEvent(evs[1], nonBlocking); err != nil {
		t.Fatal(err)
	}
	if r := query(evs[0]); r != notReady {
		t.Errorf("an event on the legacy stream behind a held blocking stream: cuEventQuery = %d, want %d", r, notReady)
	}
	if r := query(evs[1]); r != ready {
		t.Errorf("an event on a non-blocking stream: cuEventQuery = %d, want %d", r, ready)
	}
	l.knob("gate_open", 0)
	if err := g.SyncStream(0); err != nil {
		t.Fatal(err)
	}
	if r := query(evs[0]); r != ready {
		t.Errorf("the legacy stream's event after the gate opened: cuEventQuery = %d, want %d", r, ready)
	}

	// The legacy stream held back: a blocking stream waits for it.
	l.knob("gate_close", 0)
	if err := g.RecordEvent(evs[2], blocking); err != nil {
		t.Fatal(err)
	}
	if r := query(evs[2]); r != notReady {
		t.Errorf("an event on a blocking stream behind the held legacy stream: cuEventQuery = %d, want %d", r, notReady)
	}
	l.knob("gate_open", 0)
	if err := g.SyncStream(blocking); err != nil {
		t.Fatal(err)
	}
	g.Close()
}
