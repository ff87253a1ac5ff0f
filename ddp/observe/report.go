package observe

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/goddp/goddp/ddp"
)

// OverlapReport is the DDP logging data PyTorch users know (its DDPLoggingData), averaged
// over the synced backward passes of a window: where a step's time goes, and how much of the
// communication the backward pass hid. Times are averages per pass; a zero Forward or Step
// means the trainer did not report them.
type OverlapReport struct {
	// Passes is the number of synced backward passes averaged.
	Passes int
	// Forward and Step are the averages of what the trainer reported with AddForward and
	// AddStep.
	Forward, Step time.Duration
	// Backward is the wall time from BeginBackward to Finalize; BackwardCompute is Backward
	// less the time spent in the reducer's hooks.
	Backward, BackwardCompute time.Duration
	// Comm is the time at least one bucket's collective was in flight; Overlap the part of
	// it before the end of backward; Exposed = Comm − Overlap, what the step waited for.
	Comm, Overlap, Exposed time.Duration
	// FinalizeWait is the time spent in Finalize; Copy the time copying gradients into the
	// buckets.
	FinalizeWait, Copy time.Duration
	// BytesReduced is the bytes all-reduced per pass.
	BytesReduced int64
	// BucketBytesBefore and BucketBytesAfter are the bucket sizes of the first layout and
	// of the latest layout after a rebuild (nil until a pass with it was seen).
	BucketBytesBefore, BucketBytesAfter []int64
	// UnusedParams names the parameters that got no gradient in some pass of the window
	// (FindUnusedParameters); UnusedPasses counts those passes.
	UnusedParams []string
	UnusedPasses int
}

// OverlapFraction is Overlap / Comm (0 without communication).
func (r OverlapReport) OverlapFraction() float64 {
	if r.Comm <= 0 {
		return 0
	}
	return float64(r.Overlap) / float64(r.Comm)
}

// String is the report as one log line.
func (r OverlapReport) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "ddp: %d passes:", r.Passes)
	if r.Step > 0 {
		fmt.Fprintf(&b, " step %s", ms(r.Step))
	}
	if r.Forward > 0 {
		fmt.Fprintf(&b, " forward %s", ms(r.Forward))
	}
	fmt.Fprintf(&b, " backward %s (compute %s) comm %s overlapped %s (%.0f%%) exposed %s finalize_wait %s copy %s reduced %s/pass",
		ms(r.Backward), ms(r.BackwardCompute), ms(r.Comm), ms(r.Overlap), 100*r.OverlapFraction(), ms(r.Exposed),
		ms(r.FinalizeWait), ms(r.Copy), mb(r.BytesReduced))
	fmt.Fprintf(&b, " buckets %s", mbList(r.BucketBytesBefore))
	if r.BucketBytesAfter != nil {
		fmt.Fprintf(&b, " rebuilt %s", mbList(r.BucketBytesAfter))
	}
	if r.UnusedPasses > 0 {
		fmt.Fprintf(&b, " unused %v in %d passes", r.UnusedParams, r.UnusedPasses)
	} else {
		b.WriteString(" unused none")
	}
	return b.String()
}

// Fields is the report as zap fields, for a structured log line.
func (r OverlapReport) Fields() []zap.Field {
	return []zap.Field{
		zap.Int("passes", r.Passes), zap.Duration("avg_step", r.Step), zap.Duration("avg_forward", r.Forward),
		zap.Duration("avg_backward", r.Backward), zap.Duration("avg_backward_compute", r.BackwardCompute),
		zap.Duration("avg_comm", r.Comm), zap.Duration("avg_overlap", r.Overlap), zap.Duration("avg_exposed_comm", r.Exposed),
		zap.Float64("overlap_fraction", r.OverlapFraction()), zap.Duration("avg_finalize_wait", r.FinalizeWait),
		zap.Duration("avg_copy", r.Copy), zap.Int64("bytes_reduced_per_pass", r.BytesReduced),
		zap.Int64s("bucket_bytes", r.BucketBytesBefore), zap.Int64s("bucket_bytes_rebuilt", r.BucketBytesAfter),
		zap.Strings("unused_params", r.UnusedParams), zap.Int("unused_passes", r.UnusedPasses),
	}
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2fms", float64(d)/1e6) }
func mb(n int64) string         { return fmt.Sprintf("%.2fMB", float64(n)/(1<<20)) }

func mbList(v []int64) string {
	if v == nil {
		return "[]"
	}
	s := make([]string, len(v))
	for i, n := range v {
		s[i] = fmt.Sprintf("%.2f", float64(n)/(1<<20))
	}
	return "[" + strings.Join(s, " ") + "]MB"
}

// OverlapAccumulator sums IterStats over training steps and reports their averages
// (OverlapReport). Feed it d.Stats() after each Finalize:
//
//	acc := observe.NewOverlapAccumulator(d)
//	for step := ... {
//		... d.Finalize(ctx) ...
//		acc.Add(d.Stats())
//		if rank == 0 && (step+1)%100 == 0 {
//			log.Info("ddp overlap", acc.Report().Fields()...)
//			acc.Reset()
//		}
//	}
//
// Only synced passes count (a NoSync pass has no communication); a pass given twice (the
// same Iter) counts once. It is not safe for concurrent use.
type OverlapAccumulator struct {
	names []string

	lastIter                    int
	passes, fwdN, stepN         int
	fwd, step                   time.Duration
	bwd, compute, comm, overlap time.Duration
	wait, copy                  time.Duration
	bytes                       int64
	unusedPasses                int
	unused                      map[int]bool
	before, after               []int64
	afterGen                    int // the generation of after
}

// NewOverlapAccumulator returns an empty accumulator; d (which may be nil) names the unused
// parameters.
func NewOverlapAccumulator(d *ddp.DDP) *OverlapAccumulator {
	a := &OverlapAccumulator{unused: map[int]bool{}}
	if d != nil {
		for _, p := range d.Params() {
			a.names = append(a.names, p.Name)
		}
	}
	return a
}

// Add counts one backward pass (nil, NoSync passes and repeats are ignored).
func (a *OverlapAccumulator) Add(st *ddp.IterStats) {
	if st == nil || st.Mode != ddp.Sync || st.Iter == a.lastIter || st.BackwardEnd < 0 {
		return
	}
	a.lastIter = st.Iter
	a.passes++
	a.bwd += st.Backward()
	a.compute += st.Compute()
	a.comm += st.Comm()
	a.overlap += st.Overlap()
	if st.FinalizeEnd >= st.BackwardEnd {
		a.wait += st.FinalizeEnd - st.BackwardEnd
	}
	a.copy += st.CopyTime
	for _, n := range st.BucketBytes {
		a.bytes += n
	}
	switch {
	case st.Generation == 0 && a.before == nil:
		a.before = slices.Clone(st.BucketBytes)
	case st.Generation > a.afterGen:
		a.after, a.afterGen = slices.Clone(st.BucketBytes), st.Generation // the latest layout (auto rebuilds up to 3 times)
	}
	if len(st.Unused) > 0 {
		a.unusedPasses++
		for _, i := range st.Unused {
			a.unused[i] = true
		}
	}
}

// AddForward counts the forward time of one step.
func (a *OverlapAccumulator) AddForward(d time.Duration) { a.fwd += d; a.fwdN++ }

// AddStep counts the wall time of one whole step.
func (a *OverlapAccumulator) AddStep(d time.Duration) { a.step += d; a.stepN++ }

// Report returns the averages since the last Reset.
func (a *OverlapAccumulator) Report() OverlapReport {
	r := OverlapReport{Passes: a.passes, BucketBytesBefore: a.before, BucketBytesAfter: a.after, UnusedPasses: a.unusedPasses}
	avg := func(d time.Duration, n int) time.Duration {
		if n == 0 {
			return 0
		}
		return d / time.Duration(n)
	}
	r.Forward, r.Step = avg(a.fwd, a.fwdN), avg(a.step, a.stepN)
	r.Backward, r.BackwardCompute = avg(a.bwd, a.passes), avg(a.compute, a.passes)
	r.Comm, r.Overlap = avg(a.comm, a.passes), avg(a.overlap, a.passes)
	r.Exposed = r.Comm - r.Overlap
	r.FinalizeWait, r.Copy = avg(a.wait, a.passes), avg(a.copy, a.passes)
	if a.passes > 0 {
		r.BytesReduced = a.bytes / int64(a.passes)
	}
	idx := make([]int, 0, len(a.unused))
	for i := range a.unused {
		idx = append(idx, i)
	}
	slices.Sort(idx)
	for _, i := range idx {
		if i < len(a.names) {
			r.UnusedParams = append(r.UnusedParams, a.names[i])
		} else {
			r.UnusedParams = append(r.UnusedParams, fmt.Sprintf("param %d", i))
		}
	}
	return r
}

// Reset starts a new window; the bucket sizes before and after the rebuild are kept.
func (a *OverlapAccumulator) Reset() {
	*a = OverlapAccumulator{names: a.names, lastIter: a.lastIter, before: a.before, after: a.after, afterGen: a.afterGen, unused: map[int]bool{}}
}
