package observe

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/internal/ddptest"
	"github.com/goddp/goddp/ddp/tracefile"
)

func TestTraceMatchesStats(t *testing.T) {
	const size, steps = 3, 4
	epoch0 := time.Now()
	bufs := make([]bytes.Buffer, size)
	trs := make([]*Tracer, size)
	kept := make([][]*ddp.IterStats, size)
	epochs := make([]time.Time, size)
	ddptest.Run(t, size, steps, -1, 0, ddp.Options{},
		func(rank int, d *ddp.DDP) error {
			// Different epochs per rank, as separate processes would have.
			epochs[rank] = epoch0.Add(time.Duration(rank) * 1500 * time.Microsecond)
			var err error
			trs[rank], err = NewTracer(&bufs[rank], TraceOptions{Rank: rank, WorldSize: size, ParamNames: paramNames(d), Epoch: epochs[rank]})
			trs[rank].Attach(d)
			return err
		},
		func(rank, step int, d *ddp.DDP, st *ddp.IterStats) error {
			tr := trs[rank]
			tr.BeginStep(step)
			end := tr.Span("optimizer")
			end()
			tr.Record(st)
			tr.Record(st) // a repeat is ignored
			kept[rank] = append(kept[rank], st.Clone())
			if step == steps-1 {
				return tr.Close()
			}
			return nil
		})
	files := make([]*tracefile.File, size)
	for rank := range size {
		tf, err := tracefile.Read(bytes.NewReader(bufs[rank].Bytes()))
		if err != nil {
			t.Fatalf("rank %d: %v\n%s", rank, err, bufs[rank].String())
		}
		files[rank] = tf
		if got := tf.OtherData.EpochUnixMicro; got != epochs[rank].UnixMicro() {
			t.Errorf("rank %d: epoch %d, want %d", rank, got, epochs[rank].UnixMicro())
		}
		checkRankTrace(t, rank, tf, kept[rank], epochs[rank], 0)
	}
	merged, err := tracefile.Merge(files...)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(merged.OtherData.Ranks) != "[0 1 2]" {
		t.Errorf("merged ranks %v", merged.OtherData.Ranks)
	}
	// Round trip through WriteTrace, then each rank's events must sit at the same wall
	// instants as before, on rank 0's epoch.
	var out bytes.Buffer
	if err := tracefile.Write(&out, merged); err != nil {
		t.Fatal(err)
	}
	back, err := tracefile.Read(&out)
	if err != nil {
		t.Fatal(err)
	}
	for rank := range size {
		checkRankTrace(t, rank, back, kept[rank], epochs[0], 0)
	}
	// Every collective is in the merged trace with all three arrivals, which are the
	// launch instants of the stats.
	arr := ArrivalsFromTrace(back)
	nb := 0
	for _, st := range kept[0] {
		nb += len(st.BucketLaunched)
	}
	if len(arr) != nb {
		t.Fatalf("%d collectives with arrivals, want %d", len(arr), nb)
	}
	for _, a := range arr {
		for rank := range size {
			st := kept[rank][a.Iter-1]
			want := st.Start.Sub(epochs[0]) + st.BucketLaunched[a.Bucket]
			if d := a.At[rank] - want; d < -time.Microsecond || d > time.Microsecond {
				t.Errorf("iter %d bucket %d rank %d: arrival %v, want %v", a.Iter, a.Bucket, rank, a.At[rank], want)
			}
		}
	}
	if _, err := tracefile.Merge(files[0], files[0]); !errors.Is(err, tracefile.ErrInvalidArgument) {
		t.Errorf("merging a rank twice: %v", err)
	}
}

func paramNames(d *ddp.DDP) []string {
	var s []string
	for _, p := range d.Params() {
		s = append(s, p.Name)
	}
	return s
}

// checkRankTrace compares rank's events in tf against its stats, computed from the stats
// with the rank's epoch at shift µs after the file's.
func checkRankTrace(t *testing.T, rank int, tf *tracefile.File, stats []*ddp.IterStats, epoch time.Time, shift float64) {
	t.Helper()
	us := func(d time.Duration) float64 { return float64(d) / 1e3 }
	near := func(what string, got, want float64) {
		if math.Abs(got-want) > 0.002 {
			t.Errorf("rank %d: %s at %.3fµs, want %.3fµs", rank, what, got, want)
		}
	}
	type key struct {
		cat  string
		iter int64
		b    int64
		p    int64
	}
	evs := map[key]tracefile.Event{}
	counts := map[string]int{}
	for _, e := range tf.TraceEvents {
		if e.PID != rank || e.Ph == "M" {
			continue
		}
		counts[e.Cat]++
		it, _ := e.Arg("iter")
		b, ok := e.Arg("bucket")
		if !ok {
			b = -1
		}
		p, ok := e.Arg("param")
		if !ok {
			p = -1
		}
		if step, ok := e.Arg("step"); !ok || (e.Cat != CatStep && e.Cat != CatCompute && step != it-1) {
			t.Errorf("rank %d: %s %q: step %d (ok %v), iter %d", rank, e.Cat, e.Name, step, ok, it)
		}
		evs[key{e.Cat, it, b, p}] = e
	}
	nb := 0
	for _, st := range stats {
		it := int64(st.Iter)
		base := st.Start.Sub(epoch)
		bw := evs[key{CatBackward, it, -1, -1}]
		near("backward pass start", bw.TS, shift+us(base))
		near("backward pass end", bw.End(), shift+us(base+st.BackwardEnd))
		fw := evs[key{CatWait, it, -1, -1}]
		near("finalize wait end", fw.End(), shift+us(base+st.FinalizeEnd))
		for i, at := range st.GradReady {
			var e tracefile.Event
			for k, v := range evs {
				if k.cat == CatGrad && k.iter == it && k.p == int64(i) {
					e = v
				}
			}
			near(fmt.Sprintf("iter %d grad %d", it, i), e.TS, shift+us(base+at))
			if e.Name != fmt.Sprintf("layer%d.w", i) {
				t.Errorf("rank %d: grad event named %q", rank, e.Name)
			}
		}
		prev := time.Duration(-1)
		for b := range st.BucketLaunched {
			nb++
			l := evs[key{CatLaunch, it, int64(b), -1}]
			near(fmt.Sprintf("iter %d launch %d", it, b), l.TS, shift+us(base+st.BucketLaunched[b]))
			if n, _ := l.Arg("bytes"); n != st.BucketBytes[b] {
				t.Errorf("rank %d: launch %d: %d bytes, want %d", rank, b, n, st.BucketBytes[b])
			}
			c := evs[key{CatComm, it, int64(b), -1}]
			near(fmt.Sprintf("iter %d all-reduce %d start", it, b), c.TS, shift+us(base+max(st.BucketLaunched[b], prev)))
			near(fmt.Sprintf("iter %d all-reduce %d end", it, b), c.End(), shift+us(base+st.BucketFinished[b]))
			prev = st.BucketFinished[b]
			cp := evs[key{CatCopy, it, int64(b), -1}]
			near(fmt.Sprintf("iter %d copy-in %d end", it, b), cp.End(), shift+us(base+st.BucketReady[b]))
		}
	}
	n := len(stats)
	want := map[string]int{CatBackward: n, CatWait: n, CatGrad: 5 * n, CatLaunch: nb, CatComm: nb, CatCopy: nb, CatCompute: n, CatStep: n}
	if fmt.Sprint(counts) != fmt.Sprint(want) {
		t.Errorf("rank %d: event counts %v, want %v", rank, counts, want)
	}
}

func TestReadTraceRepairsTruncation(t *testing.T) {
	var buf bytes.Buffer
	tr, err := NewTracer(&buf, TraceOptions{Rank: 2})
	if err != nil {
		t.Fatal(err)
	}
	for s := range 5 {
		tr.BeginStep(s)
		tr.Span("forward")()
	}
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	full, err := tracefile.Read(bytes.NewReader(buf.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	data := buf.Bytes()
	for cut := len(data) - 1; cut > len(data)/2; cut -= 7 {
		tf, err := tracefile.Read(bytes.NewReader(data[:cut]))
		if err != nil {
			t.Fatalf("cut at %d of %d: %v", cut, len(data), err)
		}
		if n := len(tf.TraceEvents); n == 0 || n > len(full.TraceEvents) {
			t.Fatalf("cut at %d: %d events of %d", cut, n, len(full.TraceEvents))
		}
		for i, e := range tf.TraceEvents {
			if fmt.Sprint(e) != fmt.Sprint(full.TraceEvents[i]) {
				t.Fatalf("cut at %d: event %d is %v, want %v", cut, i, e, full.TraceEvents[i])
			}
		}
	}
	if _, err := tracefile.Read(strings.NewReader("not json")); err == nil {
		t.Error("garbage read without error")
	}
}

func TestNilTracerAndBadInput(t *testing.T) {
	var tr *Tracer
	tr.BeginStep(1)
	tr.Span("x")()
	tr.Record(&ddp.IterStats{Iter: 1})
	tr.Attach(nil)
	if err := tr.Close(); err != nil {
		t.Error(err)
	}
	t.Setenv(TraceEnvVar, "")
	if tr, err := OpenTrace("", nil); tr != nil || err != nil {
		t.Errorf("OpenTrace with tracing off: %v, %v", tr, err)
	}
	if _, err := OpenTrace("x.json", nil); !errors.Is(err, ddp.ErrInvalidArgument) {
		t.Errorf("OpenTrace(nil DDP): %v", err)
	}
	if _, err := NewTracer(nil, TraceOptions{}); !errors.Is(err, ddp.ErrInvalidArgument) {
		t.Errorf("NewTracer(nil): %v", err)
	}
	if _, err := NewTracer(&bytes.Buffer{}, TraceOptions{Rank: -1}); !errors.Is(err, ddp.ErrInvalidArgument) {
		t.Errorf("NewTracer(rank -1): %v", err)
	}
	// A failing writer: the error comes back from Close.
	tr, err := NewTracer(failWriter{}, TraceOptions{})
	if err == nil {
		err = tr.Close()
	}
	if err == nil || !strings.Contains(err.Error(), "disk full") {
		t.Errorf("failing writer: %v", err)
	}
}

type failWriter struct{}

func (failWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

func TestTracePath(t *testing.T) {
	t.Setenv("TORCHELASTIC_RESTART_COUNT", "2")
	for _, tc := range []struct {
		path        string
		rank, world int
		want        string
	}{
		{"trace.json", 0, 1, "trace.json"},
		{"trace.json", 1, 4, "trace.rank1.json"},
		{"out/run.v2/trace", 3, 4, "out/run.v2/trace.rank3"},
		{"t_{rank}_a{attempt}.json", 3, 4, "t_3_a2.json"},
	} {
		if got := TracePath(tc.path, tc.rank, tc.world); got != tc.want {
			t.Errorf("TracePath(%q, %d, %d) = %q, want %q", tc.path, tc.rank, tc.world, got, tc.want)
		}
	}
}

func TestAppendJSONStringAndMicros(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		b := make([]byte, r.IntN(12))
		for i := range b {
			b[i] = byte(r.IntN(256))
		}
		s := string(b)
		if r.IntN(2) == 0 {
			s = strings.ToValidUTF8(s, "x")
		}
		var back, ref string
		if err := json.Unmarshal(appendJSONString(nil, s), &back); err != nil {
			t.Fatalf("%q: %v", s, err)
		}
		m, _ := json.Marshal(s) // the reference: encoding/json, one U+FFFD per invalid byte
		if err := json.Unmarshal(m, &ref); err != nil || back != ref {
			t.Fatalf("%q round-tripped to %q, want %q", s, back, ref)
		}
	}
	for _, d := range []time.Duration{0, 1, 999, 1000, 1001, 123456789, -2500} {
		var got float64
		if err := json.Unmarshal(appendMicros(nil, d), &got); err != nil || got != float64(d)/1e3 {
			t.Errorf("appendMicros(%d) = %s", d, appendMicros(nil, d))
		}
	}
}

// BenchmarkTracerRecord: the cost of tracing one backward pass of 100 parameters in 10
// buckets (with and without the per-gradient events), written to io.Discard.
func BenchmarkTracerRecord(b *testing.B) {
	st := &ddp.IterStats{Mode: ddp.Sync, Start: time.Now(), BackwardEnd: time.Millisecond, FinalizeEnd: 2 * time.Millisecond}
	for i := range 100 {
		st.GradReady = append(st.GradReady, time.Duration(i)*time.Microsecond)
	}
	for k := range 10 {
		st.BucketReady = append(st.BucketReady, time.Duration(k*10)*time.Microsecond)
		st.BucketLaunched = append(st.BucketLaunched, time.Duration(k*10+1)*time.Microsecond)
		st.BucketFinished = append(st.BucketFinished, time.Duration(k*10+50)*time.Microsecond)
		st.BucketBytes = append(st.BucketBytes, 1<<20)
	}
	for _, grads := range []bool{true, false} {
		b.Run(fmt.Sprintf("grad_events=%v", grads), func(b *testing.B) {
			tr, _ := NewTracer(io.Discard, TraceOptions{NoGradEvents: !grads})
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				st.Iter = i + 1
				tr.Record(st)
			}
			tr.Close()
		})
	}
}
