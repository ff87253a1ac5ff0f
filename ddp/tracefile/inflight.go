package tracefile

import (
	"fmt"
	"slices"
	"time"
)

// InFlight is what LinkUse measured of a merged trace.
type InFlight struct {
	// Ranks is the number of ranks whose collectives were matched.
	Ranks int
	// Collectives counts the bucket collectives that every rank traced.
	Collectives int
	// Bytes is the buffer bytes those collectives reduced, per rank.
	Bytes int64
	// Busy is the time during which at least one of them was on the wire (see LinkUse).
	Busy time.Duration
}

// LinkUse measures how long the buckets' collectives of the steps from fromStep on were
// on the wire, from a merged trace of every rank (ddprun --trace_merge).
//
// A collective cannot move its data before the last rank has started it, and it is done
// when the last rank has its result; so each one counts from the latest start among the
// ranks to the latest end. Its own rank's view would also count the time it waited for a
// late peer, which is skew, not traffic. Busy is the union of those intervals, and Bytes
// their sizes, over the collectives that every rank traced (matched by pass and bucket).
func LinkUse(tf *File, fromStep int) (InFlight, error) {
	ranks := tf.OtherData.Ranks
	if len(ranks) == 0 {
		return InFlight{}, fmt.Errorf("%w: LinkUse: the trace names no ranks", ErrInvalidArgument)
	}
	type key struct{ iter, bucket int64 }
	type span struct {
		start, end float64 // µs: the latest start and the latest end so far
		seen       map[int]bool
		bytes      int64
	}
	spans := map[key]*span{}
	for i := range tf.TraceEvents {
		e := &tf.TraceEvents[i]
		if e.Cat != "comm" || e.Ph != "X" {
			continue
		}
		step, ok1 := e.Arg("step")
		iter, ok2 := e.Arg("iter")
		b, ok3 := e.Arg("bucket")
		if !ok1 || !ok2 || !ok3 || step < int64(fromStep) {
			continue
		}
		k := key{iter, b}
		s := spans[k]
		if s == nil {
			s = &span{start: e.TS, end: e.End(), seen: map[int]bool{}}
			spans[k] = s
		}
		s.start, s.end = max(s.start, e.TS), max(s.end, e.End())
		s.seen[e.PID] = true
		if n, ok := e.Arg("bytes"); ok {
			s.bytes = n
		}
	}
	var ivs [][2]float64
	out := InFlight{Ranks: len(ranks)}
	for _, s := range spans {
		if len(s.seen) != len(ranks) {
			continue // a rank's trace ended before this collective: not comparable
		}
		out.Collectives++
		out.Bytes += s.bytes
		ivs = append(ivs, [2]float64{s.start, s.end})
	}
	if out.Collectives == 0 {
		return out, fmt.Errorf("%w: LinkUse: no collective from step %d on was traced by all %d ranks", ErrInvalidArgument, fromStep, len(ranks))
	}
	slices.SortFunc(ivs, func(a, b [2]float64) int {
		switch {
		case a[0] < b[0]:
			return -1
		case a[0] > b[0]:
			return 1
		}
		return 0
	})
	var busy float64
	cur := ivs[0]
	for _, iv := range ivs[1:] {
		if iv[0] > cur[1] {
			busy += max(cur[1]-cur[0], 0)
			cur = iv
			continue
		}
		cur[1] = max(cur[1], iv[1])
	}
	busy += max(cur[1]-cur[0], 0)
	out.Busy = time.Duration(busy * float64(time.Microsecond))
	return out, nil
}
