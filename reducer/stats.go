package reducer

import "time"

// IterStats are the measurements of one backward pass, for the trainer to log and for a
// model that chooses bucket sizes. Every time is an offset from Start on the monotonic
// clock; -1 means the event did not happen. Recording them costs one clock read per event
// and allocates nothing (the slices are reused).
//
// Finish times are observed, not reported by the backend (the reducer runs no goroutine):
// a bucket's finish is noticed at the next GradReady or while Finalize waits, so
// BucketFinished is an upper bound, exact for the buckets Finalize had to wait for.
type IterStats struct {
	Iter  int  // backward passes counted from 1
	Mode  Mode // Sync or Accumulate
	Start time.Time
	// Generation of the bucket layout the pass used (0, then 1 after the rebuild; with
	// AutoBucketCap up to 3).
	Generation int

	// GradReady[i]: when parameter i's gradient was reported.
	GradReady []time.Duration
	// Per bucket: when its last gradient arrived (or Finalize, for unused parameters),
	// when its collective was issued, and when it was seen complete.
	BucketReady    []time.Duration
	BucketLaunched []time.Duration
	BucketFinished []time.Duration
	// BucketBytes[b] is the size of bucket b's flat buffer.
	BucketBytes []int64

	// BackwardEnd: when Finalize was called (the end of backward compute).
	BackwardEnd time.Duration
	// FinalizeEnd: when Finalize returned.
	FinalizeEnd time.Duration
	// CopyTime: time spent copying (or adding) gradients into bucket slots, measured from
	// each GradReady call to the end of its copy (so it includes taking the reducer's lock
	// and tens of nanoseconds of bookkeeping).
	CopyTime time.Duration
	// HookTime: all the time spent inside GradReady (copies, launches, bookkeeping).
	HookTime time.Duration
	// UnpackTime: Finalize's time finishing reduced buckets (the comm hook's Finish and the
	// copy back into each Param.Grad).
	UnpackTime time.Duration
	// Unused lists the parameters reduced as zeros (FindUnusedParameters), ascending.
	Unused []int
}

// Backward is the wall time of the backward pass, from BeginBackward to Finalize.
func (s *IterStats) Backward() time.Duration { return s.BackwardEnd }

// Compute is the backward compute time: Backward less the time spent in the reducer's hooks.
func (s *IterStats) Compute() time.Duration { return s.BackwardEnd - s.HookTime }

// Comm is the time during which at least one bucket's collective was in flight.
func (s *IterStats) Comm() time.Duration { return s.commWithin(-1) }

// Overlap is the part of Comm that happened before BackwardEnd, hidden behind compute.
func (s *IterStats) Overlap() time.Duration { return s.commWithin(s.BackwardEnd) }

// Exposed is the part of Comm after BackwardEnd: what the step waits for.
func (s *IterStats) Exposed() time.Duration { return s.Comm() - s.Overlap() }

// commWithin measures the union of the buckets' [launched, finished] intervals, clipped at
// end unless end is negative. Collectives run in launch order, so one sweep suffices.
func (s *IterStats) commWithin(end time.Duration) time.Duration {
	var total, covered time.Duration
	for b := range s.BucketLaunched {
		lo, hi := s.BucketLaunched[b], s.BucketFinished[b]
		if lo < 0 || hi < 0 {
			continue
		}
		if end >= 0 && hi > end {
			hi = end
		}
		if lo < covered {
			lo = covered
		}
		if hi > lo {
			total += hi - lo
			covered = hi
		}
	}
	return total
}

// Clone returns a deep copy of s, to keep beyond the reducer's reuse of s.
func (s *IterStats) Clone() *IterStats {
	c := *s
	c.GradReady = append([]time.Duration(nil), s.GradReady...)
	c.BucketReady = append([]time.Duration(nil), s.BucketReady...)
	c.BucketLaunched = append([]time.Duration(nil), s.BucketLaunched...)
	c.BucketFinished = append([]time.Duration(nil), s.BucketFinished...)
	c.BucketBytes = append([]int64(nil), s.BucketBytes...)
	c.Unused = append([]int(nil), s.Unused...)
	return &c
}

// reset prepares s for a new pass over nParams parameters and nBuckets buckets, reusing its
// slices.
func (s *IterStats) reset(iter int, mode Mode, gen int, start time.Time, nParams, nBuckets int) {
	s.Iter, s.Mode, s.Generation, s.Start = iter, mode, gen, start
	s.GradReady = fill(s.GradReady, nParams)
	s.BucketReady = fill(s.BucketReady, nBuckets)
	s.BucketLaunched = fill(s.BucketLaunched, nBuckets)
	s.BucketFinished = fill(s.BucketFinished, nBuckets)
	if cap(s.BucketBytes) < nBuckets {
		s.BucketBytes = make([]int64, nBuckets)
	}
	s.BucketBytes = s.BucketBytes[:nBuckets]
	s.BackwardEnd, s.FinalizeEnd, s.CopyTime, s.HookTime, s.UnpackTime = -1, -1, 0, 0, 0
	if cap(s.Unused) < nParams {
		s.Unused = make([]int, 0, nParams)
	}
	s.Unused = s.Unused[:0]
}

func fill(d []time.Duration, n int) []time.Duration {
	if cap(d) < n {
		d = make([]time.Duration, n)
	}
	d = d[:n]
	for k := range d {
		d[k] = -1
	}
	return d
}
