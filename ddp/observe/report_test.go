package observe

import (
	"context"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/internal/ddptest"
)

func TestOverlapAccumulatorArithmetic(t *testing.T) {
	// Two passes, times in µs: buckets [launched, finished].
	mk := func(iter, gen int, bwdEnd, finEnd time.Duration, launched, finished []time.Duration, bytes []int64, unused []int) *ddp.IterStats {
		return &ddp.IterStats{Iter: iter, Mode: ddp.Sync, Generation: gen, BackwardEnd: bwdEnd * time.Microsecond,
			FinalizeEnd: finEnd * time.Microsecond, BucketLaunched: us(launched), BucketFinished: us(finished), BucketBytes: bytes,
			HookTime: 10 * time.Microsecond, CopyTime: 4 * time.Microsecond, Unused: unused}
	}
	a := NewOverlapAccumulator(nil)
	// Pass 1: comm [100,300] ∪ [250,400] = 300µs, 200 before backward's end at 300; the
	// finalize wait is 150.
	a.Add(mk(1, 0, 300, 450, []time.Duration{100, 250}, []time.Duration{300, 400}, []int64{1 << 20, 3 << 20}, []int{2}))
	a.Add(mk(1, 0, 300, 450, []time.Duration{100, 250}, []time.Duration{300, 400}, []int64{1 << 20, 3 << 20}, []int{2})) // repeat
	a.Add(&ddp.IterStats{Iter: 2, Mode: ddp.Accumulate, BackwardEnd: time.Second})                                       // NoSync
	// Pass 3: one bucket [500, 900], backward ends at 1000: all overlapped; wait 50.
	a.Add(mk(3, 1, 1000, 1050, []time.Duration{500}, []time.Duration{900}, []int64{4 << 20}, nil))
	a.AddForward(2 * time.Millisecond)
	a.AddForward(4 * time.Millisecond)
	a.AddStep(10 * time.Millisecond)
	got := a.Report()
	want := OverlapReport{
		Passes: 2, Forward: 3 * time.Millisecond, Step: 10 * time.Millisecond,
		Backward: 650 * time.Microsecond, BackwardCompute: 640 * time.Microsecond,
		Comm: 350 * time.Microsecond, Overlap: 300 * time.Microsecond, Exposed: 50 * time.Microsecond,
		FinalizeWait: 100 * time.Microsecond, Copy: 4 * time.Microsecond, BytesReduced: 4 << 20,
		BucketBytesBefore: []int64{1 << 20, 3 << 20}, BucketBytesAfter: []int64{4 << 20},
		UnusedParams: []string{"param 2"}, UnusedPasses: 1,
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("report\n got %+v\nwant %+v", got, want)
	}
	if f := got.OverlapFraction(); f < 0.857 || f > 0.858 {
		t.Errorf("overlap fraction %v, want 300/350", f)
	}
	line := got.String()
	for _, s := range []string{"2 passes", "comm 0.35ms", "overlapped 0.30ms (86%)", "exposed 0.05ms", "buckets [1.00 3.00]MB rebuilt [4.00]MB", "unused [param 2] in 1 passes"} {
		if !strings.Contains(line, s) {
			t.Errorf("line %q lacks %q", line, s)
		}
	}
	if n := len(got.Fields()); n != 16 {
		t.Errorf("%d fields", n)
	}
	a.Reset()
	r := a.Report()
	if r.Passes != 0 || r.Comm != 0 || r.BucketBytesAfter == nil || r.UnusedParams != nil {
		t.Errorf("after Reset: %+v", r)
	}
}

func us(v []time.Duration) []time.Duration {
	out := make([]time.Duration, len(v))
	for i, d := range v {
		out[i] = d * time.Microsecond
	}
	return out
}

func TestOverlapAccumulatorOnDDP(t *testing.T) {
	const steps = 3
	accs := make([]*OverlapAccumulator, 2)
	sums := make([]time.Duration, 2)
	ddptest.Run(t, 2, steps, -1, 0, ddp.Options{FindUnusedParameters: true},
		func(rank int, d *ddp.DDP) error { accs[rank] = NewOverlapAccumulator(d); return nil },
		func(rank, step int, d *ddp.DDP, st *ddp.IterStats) error {
			accs[rank].Add(st)
			sums[rank] += st.Comm()
			return nil
		})
	for rank, a := range accs {
		r := a.Report()
		if r.Passes != steps || r.Comm != sums[rank]/steps {
			t.Errorf("rank %d: %d passes, comm %v, want %d, %v", rank, r.Passes, r.Comm, steps, sums[rank]/steps)
		}
		if !reflect.DeepEqual(r.UnusedParams, []string{"layer1.w"}) || r.UnusedPasses != steps {
			t.Errorf("rank %d: unused %v in %d passes", rank, r.UnusedParams, r.UnusedPasses)
		}
		var total int64
		for _, n := range r.BucketBytesBefore {
			total += n
		}
		if total != 4*(40+24+64+8+32) || r.BytesReduced != total {
			t.Errorf("rank %d: buckets %v, %d bytes per pass", rank, r.BucketBytesBefore, r.BytesReduced)
		}
	}
}

func TestAnalyzeArrivals(t *testing.T) {
	ms := func(v ...int) []time.Duration {
		out := make([]time.Duration, len(v))
		for i, x := range v {
			out[i] = time.Duration(x) * time.Millisecond
		}
		return out
	}
	arr := []Arrival{
		{At: ms(10, 12, 15)}, // skew 5, rank 2 last
		{At: ms(20, 20, 21)}, // skew 1, rank 2
		{At: ms(34, 30, 30)}, // skew 4, rank 0
		{At: ms(40, 43, 43)}, // skew 3, tie: nobody
		{At: ms(50, 50, 50)}, // skew 0
		{At: ms(60, -1, 70)}, // incomplete: skipped
	}
	got := AnalyzeArrivals(arr)
	want := StragglerReport{
		Collectives: 5, LastCount: []int{1, 0, 2}, Straggler: 2,
		MeanLag: []time.Duration{4 * time.Millisecond / 5, 5 * time.Millisecond / 5, 9 * time.Millisecond / 5},
		SkewP50: 3 * time.Millisecond, SkewP90: 5 * time.Millisecond, SkewMax: 5 * time.Millisecond,
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("report\n got %+v\nwant %+v", got, want)
	}
	if s := got.String(); !strings.Contains(s, "rank 2 arrived last most often (2 of 5, 40%") {
		t.Errorf("line %q", s)
	}
	if r := AnalyzeArrivals(nil); r.Straggler != -1 || r.String() != "ddp stragglers: no collectives seen" {
		t.Errorf("empty: %+v %q", r, r.String())
	}
}

func TestStragglerMonitorNamesSlowRank(t *testing.T) {
	const size, steps, slow = 3, 12, 2
	mons := make([]*StragglerMonitor, size)
	kept := make([][]*ddp.IterStats, size)
	ddptest.Run(t, size, steps, slow, 5*time.Millisecond, ddp.Options{},
		func(rank int, d *ddp.DDP) error {
			var err error
			mons[rank], err = NewStragglerMonitor(d, 5)
			return err
		},
		func(rank, step int, d *ddp.DDP, st *ddp.IterStats) error {
			kept[rank] = append(kept[rank], st.Clone())
			if err := mons[rank].Record(context.Background(), st); err != nil {
				return err
			}
			if step == steps-1 {
				return mons[rank].Flush(context.Background())
			}
			return nil
		})
	// The reference: the same analysis of the stats, gathered here instead of by AllGather.
	var arr []Arrival
	for p := range steps {
		for b := range kept[0][p].BucketLaunched {
			at := make([]time.Duration, size)
			for r := range size {
				st := kept[r][p]
				at[r] = time.Duration(st.Start.UnixNano() + int64(st.BucketLaunched[b]))
			}
			arr = append(arr, Arrival{Iter: p + 1, Bucket: b, At: at})
		}
	}
	want := AnalyzeArrivals(arr)
	for r, m := range mons {
		got := m.Report()
		if !reflect.DeepEqual(got, want) {
			t.Errorf("rank %d: report\n got %+v\nwant %+v", r, got, want)
		}
	}
	rep := mons[0].Report()
	t.Log(rep)
	if rep.Straggler != slow || rep.LastCount[slow] <= rep.Collectives/2 || rep.Collectives != len(arr) {
		t.Errorf("the report does not name rank %d: %v", slow, rep)
	}
	if !strings.Contains(rep.String(), fmt.Sprintf("rank %d arrived last most often", slow)) {
		t.Errorf("line %q", rep.String())
	}
	if _, err := NewStragglerMonitor(nil, 1); err == nil {
		t.Error("nil DDP accepted")
	}
}

// Past maxSkewSamples collectives the straggler statistics keep a fixed-size uniform sample:
// the count and the maximum stay exact and the median stays close.
func TestStragglerStatsBounded(t *testing.T) {
	var s stragglerStats
	n := maxSkewSamples + maxSkewSamples/2
	for i := range n {
		s.add([]time.Duration{0, time.Duration(i + 1)}) // rank 1 last, skew i+1
	}
	if len(s.skews) != maxSkewSamples {
		t.Fatalf("kept %d skews, want %d", len(s.skews), maxSkewSamples)
	}
	r := s.report()
	if r.Collectives != n || r.SkewMax != time.Duration(n) || r.Straggler != 1 || r.LastCount[1] != n {
		t.Fatalf("report %+v; want %d collectives, max %d, rank 1 last every time", r, n, n)
	}
	if mid := time.Duration(n / 2); r.SkewP50 < mid*97/100 || r.SkewP50 > mid*103/100 {
		t.Errorf("p50 %d, want within 3%% of %d", r.SkewP50, mid)
	}
}
