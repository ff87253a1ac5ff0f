package procgroup

import (
	"context"
	"testing"
	"time"
)

// lateTimer is a context whose deadline has passed but whose timer has not fired yet, as a
// wait's context can be on a loaded machine when a gRPC server ends the call at the deadline.
type lateTimer struct {
	context.Context
	deadline time.Time
}

func (l lateTimer) Deadline() (time.Time, bool) { return l.deadline, true }

func TestTimedOut(t *testing.T) {
	bg := context.Background()
	past := time.Now().Add(-time.Millisecond)
	expired, cancel := context.WithDeadline(bg, past)
	defer cancel()
	cancelled, cancel2 := context.WithCancel(bg)
	cancel2()
	parentBound, cancel3 := context.WithDeadline(bg, past.Add(-time.Second))
	defer cancel3()
	for _, c := range []struct {
		name      string
		ctx, wctx context.Context
		want      bool
	}{
		{"bound fired", bg, expired, true},
		{"bound passed, timer late", bg, lateTimer{bg, past}, true},
		{"bound ahead", bg, lateTimer{bg, time.Now().Add(time.Hour)}, false},
		{"no bound", bg, bg, false},
		{"caller cancelled", cancelled, expired, false},
		{"caller's own deadline", lateTimer{bg, past}, lateTimer{bg, past}, false},
		{"caller's deadline already err", parentBound, expired, false},
	} {
		if got := TimedOut(c.ctx, c.wctx); got != c.want {
			t.Errorf("%s: TimedOut = %v, want %v", c.name, got, c.want)
		}
	}
}
