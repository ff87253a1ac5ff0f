package observe

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/tracefile"
)

// Note [Trace format]: a Tracer writes the Chrome trace event format (the JSON object form:
// {"otherData": …, "traceEvents": [...]}), which Perfetto and chrome://tracing open. One
// process track (pid) per rank, with four threads (tid, the TraceLane constants). Every
// timestamp is in microseconds since the file's epoch, a wall-clock instant recorded in
// otherData.goddp_epoch_unix_us; the times themselves are measured on the monotonic clock
// from that epoch, so they do not jump with the wall clock during a run. Files of several
// ranks merge by shifting each file by the difference of the epochs (tracefile.Merge): the
// ranks' clocks are aligned to the extent that their wall clocks agree (exactly, for ranks
// on one host). Events are written one per line as they are recorded, so the file of a rank
// that crashes is complete up to its last flushed step, and tracefile.Read repairs its missing
// tail.
//
// Every event's args carry "step" (the trainer's step, from BeginStep, or the backward
// pass's number when BeginStep is never called); the reducer's events also carry "iter"
// (the backward pass number, IterStats.Iter, the same on every rank) and, per bucket,
// "bucket". The pair (iter, bucket) names one collective across ranks.

// TraceLane is the thread (tid) of a rank's track that an event is drawn on.
type TraceLane int

const (
	// LaneTrainer holds the trainer's spans (Span: forward, backward, optimizer, …) and the
	// step spans.
	LaneTrainer TraceLane = iota
	// LaneReducer holds the backward pass as the reducer saw it (BeginBackward to Finalize),
	// the finalize wait, and an instant per gradient ready.
	LaneReducer
	// LaneComm holds each bucket's launch (an instant: the rank's arrival at the collective)
	// and the collective's own run (from its launch, or from the previous bucket's finish
	// when it was queued behind it, to its observed finish).
	LaneComm
	// LaneCopy holds each bucket's copy-in: from its first gradient's arrival to its last.
	LaneCopy
	numLanes
)

var laneNames = [numLanes]string{"trainer", "reducer", "all-reduce", "bucket copy-in"}

// Event categories ("cat") the Tracer writes.
const (
	CatStep     = "step"     // one training step, BeginStep to the next
	CatCompute  = "compute"  // a trainer span (Span)
	CatBackward = "backward" // the reducer's backward pass
	CatWait     = "wait"     // Finalize waiting for the buckets
	CatGrad     = "grad"     // a gradient reported ready (instant)
	CatLaunch   = "launch"   // a bucket's collective issued (instant)
	CatComm     = "comm"     // a bucket's collective running
	CatCopy     = "copy"     // a bucket's copy-in
)

// TraceEnvVar names the environment variable OpenTrace falls back to; ddprun --trace_merge
// sets it for every rank.
const TraceEnvVar = tracefile.EnvVar

// TraceOptions configure a Tracer.
type TraceOptions struct {
	// Rank is the track (pid) of this process's events.
	Rank int
	// WorldSize is recorded in the file.
	WorldSize int
	// ParamNames name the gradient events (default "param <i>").
	ParamNames []string
	// NoGradEvents drops the instant event per gradient (the largest part of a trace for a
	// model with many parameters).
	NoGradEvents bool
	// Epoch is the instant timestamps count from (default: now). It must carry a monotonic
	// clock reading (time.Now does) for the times to be monotonic.
	Epoch time.Time
}

// Tracer writes one rank's timeline in the Chrome trace event format (Note [Trace format]).
// A nil *Tracer is valid and does nothing, so a trainer calls it unconditionally:
//
//	tr, err := observe.OpenTrace(*traceFile, d) // nil, nil when tracing is off
//	defer tr.Close()
//	for step := ... {
//		tr.BeginStep(step)
//		end := tr.Span("forward+backward")
//		... d.BeginBackward(ddp.Sync); g.Run() ...
//		end()
//		err := d.Finalize(ctx)
//		tr.Record(d.Stats()) // gradients, buckets, collectives, finalize wait
//		end = tr.Span("optimizer")
//		opt.Step(...)
//		end()
//	}
//
// Recording costs nothing on the reducer's hot path: the gradient and bucket events are
// read from the IterStats the reducer keeps anyway, after Finalize. All methods are safe for
// concurrent use. Write errors are kept and returned by Close.
type Tracer struct {
	rank       int
	world      int
	names      []string
	gradEvents bool
	epoch      time.Time

	mu        sync.Mutex // guards the fields below
	w         *bufio.Writer
	closer    io.Closer // the file OpenTrace created; nil for a caller's writer
	d         *ddp.DDP
	where     map[int][]int // generation → bucket of each parameter
	step      int
	stepSet   bool
	stepStart time.Time
	lastIter  int
	events    int
	buf       []byte
	err       error
	closed    bool
}

// NewTracer starts a trace on w (which stays the caller's: Close flushes but does not close
// it) and writes the file's header.
func NewTracer(w io.Writer, opts TraceOptions) (*Tracer, error) {
	if w == nil {
		return nil, fmt.Errorf("%w: NewTracer: nil writer", ddp.ErrInvalidArgument)
	}
	if opts.Rank < 0 {
		return nil, fmt.Errorf("%w: NewTracer: negative rank %d", ddp.ErrInvalidArgument, opts.Rank)
	}
	if opts.Epoch.IsZero() {
		opts.Epoch = time.Now()
	}
	t := &Tracer{
		rank: opts.Rank, world: opts.WorldSize, names: opts.ParamNames, gradEvents: !opts.NoGradEvents,
		epoch: opts.Epoch, w: bufio.NewWriterSize(w, 64<<10), where: map[int][]int{},
	}
	b := t.buf[:0]
	b = append(b, `{"displayTimeUnit":"ms","otherData":{"goddp_epoch_unix_us":`...)
	b = strconv.AppendInt(b, opts.Epoch.UnixMicro(), 10)
	b = append(b, `,"goddp_clock":"wall","goddp_ranks":[`...)
	b = strconv.AppendInt(b, int64(opts.Rank), 10)
	b = append(b, `],"goddp_world_size":`...)
	b = strconv.AppendInt(b, int64(opts.WorldSize), 10)
	b = append(b, `},"traceEvents":[`...)
	t.buf = b
	t.flushBufLocked()
	t.meta("process_name", -1, "rank "+strconv.Itoa(opts.Rank))
	t.meta("process_sort_index", -1, strconv.Itoa(opts.Rank))
	for l := TraceLane(0); l < numLanes; l++ {
		t.meta("thread_name", l, laneNames[l])
	}
	return t, t.err
}

// TracePath expands the placeholders of a trace path for one rank: "{rank}" becomes the
// rank and "{attempt}" the restart count (TORCHELASTIC_RESTART_COUNT, 0 when unset). A path
// without "{rank}" gets ".rank<N>" before its extension when the world has more than one
// rank, so that ranks sharing a command line do not write one file.
func TracePath(path string, rank, worldSize int) string {
	attempt := os.Getenv("TORCHELASTIC_RESTART_COUNT")
	if attempt == "" {
		attempt = "0"
	}
	r := strconv.Itoa(rank)
	if !strings.Contains(path, "{rank}") && worldSize > 1 {
		ext := ""
		if i := strings.LastIndexByte(path, '.'); i > strings.LastIndexByte(path, '/') {
			path, ext = path[:i], path[i:]
		}
		path += ".rank{rank}" + ext
	}
	return strings.NewReplacer("{rank}", r, "{attempt}", attempt).Replace(path)
}

// OpenTrace creates the trace file of d's rank at TracePath(path) (path "" falls back to
// the environment variable GODDP_TRACE, which ddprun --trace_merge sets), and the folders
// above it, and attaches d (parameter names, bucket layouts). With both a path and
// GODDP_TRACE set, the trace goes to path and a symbolic link at GODDP_TRACE's path points
// to it, so that ddprun --trace_merge finds it too. With neither set it returns a nil
// *Tracer and no error: tracing is off and every method of the nil Tracer does nothing.
func OpenTrace(path string, d *ddp.DDP) (*Tracer, error) {
	merge := os.Getenv(TraceEnvVar)
	if path == "" {
		path, merge = merge, ""
	}
	if path == "" {
		return nil, nil
	}
	if d == nil {
		return nil, fmt.Errorf("%w: OpenTrace: nil DDP", ddp.ErrInvalidArgument)
	}
	path = TracePath(path, d.Rank(), d.Size())
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("ddp: rank %d: trace: %w", d.Rank(), err)
	}
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&fs.ModeSymlink != 0 {
		os.Remove(path) // a link left by an earlier run: write a file of its own, not through it
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("ddp: rank %d: trace: %w", d.Rank(), err)
	}
	if merge != "" {
		if err := linkTrace(path, TracePath(merge, d.Rank(), d.Size())); err != nil {
			f.Close()
			return nil, fmt.Errorf("ddp: rank %d: trace: %s: %w", d.Rank(), TraceEnvVar, err)
		}
	}
	names := make([]string, len(d.Params()))
	for i, p := range d.Params() {
		names[i] = p.Name
	}
	t, err := NewTracer(f, TraceOptions{Rank: d.Rank(), WorldSize: d.Size(), ParamNames: names})
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("ddp: rank %d: trace %s: %w", d.Rank(), path, err)
	}
	t.closer = f
	t.Attach(d)
	return t, nil
}

// linkTrace makes link a symbolic link to the trace file at target (unless they are the
// same path), replacing whatever link was.
func linkTrace(target, link string) error {
	abs, err := filepath.Abs(target)
	if err != nil {
		return err
	}
	if l, err := filepath.Abs(link); err == nil && l == abs {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
		return err
	}
	if err := os.Remove(link); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return os.Symlink(abs, link)
}

// Attach lets the Tracer read d's bucket layouts, which the copy-in events need. Call it
// before the first backward pass (OpenTrace does) so that the layout of the first pass,
// before the rebuild, is known.
func (t *Tracer) Attach(d *ddp.DDP) {
	if t == nil || d == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.d = d
	t.layoutLocked(d.Generation())
}

// layoutLocked returns the bucket of each parameter in layout generation gen, or nil if it
// is unknown: the attached DDP can only tell its current layout. t.mu must be held.
func (t *Tracer) layoutLocked(gen int) []int {
	if w, ok := t.where[gen]; ok {
		return w
	}
	if t.d == nil || t.d.Generation() != gen {
		return nil
	}
	w := make([]int, len(t.d.Params()))
	for b, ps := range t.d.BucketParams() {
		for _, i := range ps {
			w[i] = b
		}
	}
	t.where[gen] = w
	return w
}

// BeginStep starts training step step: later events carry it, and the previous step's
// span is written.
func (t *Tracer) BeginStep(step int) {
	if t == nil {
		return
	}
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.endStepLocked(now)
	t.step, t.stepSet, t.stepStart = step, true, now
	// The layout this step's pass will use: the attached DDP tells only its current one,
	// and auto bucket sizing changes it after each of its first three synced steps.
	if t.d != nil {
		t.layoutLocked(t.d.Generation())
	}
}

func (t *Tracer) endStepLocked(now time.Time) {
	if !t.stepSet || t.stepStart.IsZero() {
		return
	}
	t.complete("step "+strconv.Itoa(t.step), CatStep, LaneTrainer, t.stepStart.Sub(t.epoch), now.Sub(t.stepStart), -1, -1, -1)
	t.stepStart = time.Time{}
}

var noopEnd = func() {}

// Span starts a trainer span (forward, backward, optimizer, data loading…) on the trainer
// lane and returns the function that ends it. Spans on one goroutine should nest.
func (t *Tracer) Span(name string) (end func()) {
	if t == nil {
		return noopEnd
	}
	start := time.Now()
	return func() {
		now := time.Now()
		t.mu.Lock()
		defer t.mu.Unlock()
		t.complete(name, CatCompute, LaneTrainer, start.Sub(t.epoch), now.Sub(start), -1, -1, -1)
	}
}

// Record writes the events of one backward pass from the reducer's measurements: the
// backward pass, each gradient's ready time, each bucket's copy-in, launch and collective,
// and the finalize wait. Call it after each Finalize with d.Stats(); a pass already recorded
// (same Iter) and a nil st are ignored.
func (t *Tracer) Record(st *ddp.IterStats) {
	if t == nil || st == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if st.Iter == t.lastIter || t.closed {
		return
	}
	t.lastIter = st.Iter
	step := st.Iter
	if t.stepSet {
		step = t.step
	}
	base := st.Start.Sub(t.epoch)
	iter := st.Iter
	if st.BackwardEnd >= 0 {
		t.complete("backward pass", CatBackward, LaneReducer, base, st.BackwardEnd, iter, -1, step)
		if st.FinalizeEnd >= st.BackwardEnd {
			t.complete("finalize wait", CatWait, LaneReducer, base+st.BackwardEnd, st.FinalizeEnd-st.BackwardEnd, iter, -1, step)
		}
	}
	where := t.layoutLocked(st.Generation)
	if t.gradEvents {
		for i, at := range st.GradReady {
			if at < 0 {
				continue
			}
			b := -1
			if where != nil && i < len(where) {
				b = where[i]
			}
			name := ""
			if i < len(t.names) {
				name = t.names[i]
			} else {
				name = "param " + strconv.Itoa(i)
			}
			t.event(name, CatGrad, "i", LaneReducer, base+at, 0, iter, b, step, int64(i), -1)
		}
	}
	if where != nil {
		for b := range st.BucketReady {
			first := time.Duration(-1)
			for i, wb := range where {
				if wb == b && i < len(st.GradReady) && st.GradReady[i] >= 0 && (first < 0 || st.GradReady[i] < first) {
					first = st.GradReady[i]
				}
			}
			if ready := st.BucketReady[b]; first >= 0 && ready >= first {
				t.complete("copy-in "+strconv.Itoa(b), CatCopy, LaneCopy, base+first, ready-first, iter, b, step)
			}
		}
	}
	prevFinish := time.Duration(-1)
	for b, launched := range st.BucketLaunched {
		if launched < 0 {
			continue
		}
		var bytes int64 = -1
		if b < len(st.BucketBytes) {
			bytes = st.BucketBytes[b]
		}
		t.event("launch "+strconv.Itoa(b), CatLaunch, "i", LaneComm, base+launched, 0, iter, b, step, -1, bytes)
		fin := st.BucketFinished[b]
		if fin < 0 {
			continue
		}
		// Collectives run in launch order: one launched before the previous finished waited.
		start := max(launched, prevFinish)
		if fin >= start {
			t.event("all-reduce "+strconv.Itoa(b), CatComm, "X", LaneComm, base+start, fin-start, iter, b, step, -1, bytes)
		}
		prevFinish = fin
	}
	t.flushBufLocked()
}

// Close writes the last step's span and the file's end, flushes, closes the file OpenTrace
// created, and returns the first write error. It is idempotent.
func (t *Tracer) Close() error {
	if t == nil {
		return nil
	}
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return t.err
	}
	t.endStepLocked(now)
	t.buf = append(t.buf, "\n]}\n"...)
	t.flushBufLocked()
	t.closed = true
	if err := t.w.Flush(); err != nil && t.err == nil {
		t.err = fmt.Errorf("ddp: rank %d: trace: %w", t.rank, err)
	}
	if t.closer != nil {
		if err := t.closer.Close(); err != nil && t.err == nil {
			t.err = fmt.Errorf("ddp: rank %d: trace: %w", t.rank, err)
		}
	}
	return t.err
}

// complete appends a complete ("X") event. t.mu must be held.
func (t *Tracer) complete(name, cat string, lane TraceLane, ts, dur time.Duration, iter, b, step int) {
	if step < 0 {
		step = t.step
		if !t.stepSet {
			step = t.lastIter
		}
	}
	t.event(name, cat, "X", lane, ts, dur, iter, b, step, -1, -1)
	t.flushBufLocked()
}

// event appends one event to t.buf; negative iter, bucket, param and bytes are left out.
// t.mu must be held.
func (t *Tracer) event(name, cat, ph string, lane TraceLane, ts, dur time.Duration, iter, b, step int, param, bytes int64) {
	if t.closed {
		return
	}
	bf := t.buf
	if t.events > 0 {
		bf = append(bf, ',')
	}
	t.events++
	bf = append(bf, "\n{\"name\":"...)
	bf = appendJSONString(bf, name)
	bf = append(bf, `,"cat":"`...)
	bf = append(bf, cat...)
	bf = append(bf, `","ph":"`...)
	bf = append(bf, ph...)
	bf = append(bf, `","ts":`...)
	bf = appendMicros(bf, ts)
	if ph == "X" {
		bf = append(bf, `,"dur":`...)
		bf = appendMicros(bf, dur)
	} else if ph == "i" {
		bf = append(bf, `,"s":"t"`...)
	}
	bf = append(bf, `,"pid":`...)
	bf = strconv.AppendInt(bf, int64(t.rank), 10)
	bf = append(bf, `,"tid":`...)
	bf = strconv.AppendInt(bf, int64(lane), 10)
	bf = append(bf, `,"args":{"step":`...)
	bf = strconv.AppendInt(bf, int64(step), 10)
	for _, kv := range [...]struct {
		k string
		v int64
	}{{"iter", int64(iter)}, {"bucket", int64(b)}, {"param", param}, {"bytes", bytes}} {
		if kv.v >= 0 {
			bf = append(bf, `,"`...)
			bf = append(bf, kv.k...)
			bf = append(bf, `":`...)
			bf = strconv.AppendInt(bf, kv.v, 10)
		}
	}
	bf = append(bf, "}}"...)
	t.buf = bf
}

// meta writes a metadata ("M") event naming the rank's process (lane < 0) or a lane.
func (t *Tracer) meta(name string, lane TraceLane, value string) {
	bf := t.buf
	if t.events > 0 {
		bf = append(bf, ',')
	}
	t.events++
	bf = append(bf, "\n{\"name\":\""...)
	bf = append(bf, name...)
	bf = append(bf, `","ph":"M","pid":`...)
	bf = strconv.AppendInt(bf, int64(t.rank), 10)
	if lane >= 0 {
		bf = append(bf, `,"tid":`...)
		bf = strconv.AppendInt(bf, int64(lane), 10)
	}
	if name == "process_sort_index" {
		bf = append(bf, `,"args":{"sort_index":`...)
		bf = append(bf, value...)
	} else {
		bf = append(bf, `,"args":{"name":`...)
		bf = appendJSONString(bf, value)
	}
	bf = append(bf, "}}"...)
	t.buf = bf
	t.flushBufLocked()
}

// flushBufLocked moves t.buf to the buffered writer, keeping the first error.
func (t *Tracer) flushBufLocked() {
	if len(t.buf) == 0 {
		return
	}
	if t.err == nil {
		if _, err := t.w.Write(t.buf); err != nil {
			t.err = fmt.Errorf("ddp: rank %d: trace: %w", t.rank, err)
		}
	}
	t.buf = t.buf[:0]
}

// appendMicros appends d in microseconds with nanosecond precision.
func appendMicros(b []byte, d time.Duration) []byte {
	if d < 0 {
		b = append(b, '-')
		d = -d
	}
	b = strconv.AppendInt(b, int64(d/time.Microsecond), 10)
	if ns := int64(d % time.Microsecond); ns != 0 {
		b = append(b, '.')
		s := strconv.AppendInt(nil, ns+1000, 10)[1:] // three digits, leading zeros kept
		for len(s) > 0 && s[len(s)-1] == '0' {
			s = s[:len(s)-1]
		}
		b = append(b, s...)
	}
	return b
}

// appendJSONString appends s as a JSON string (invalid UTF-8 becomes U+FFFD).
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				b = append(b, '\\', c)
			case c < 0x20:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			default:
				b = append(b, c)
			}
			i++
			continue
		}
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			b = append(b, `\ufffd`...)
		} else {
			b = append(b, s[i:i+n]...)
		}
		i += n
	}
	return append(b, '"')
}
