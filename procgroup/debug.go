package procgroup

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"

	"go.uber.org/zap"
)

// CollectiveOp names a collective in reports, fingerprints and the backends' errors.
type CollectiveOp uint8

// The collectives of ProcessGroup.
const (
	OpAllReduce CollectiveOp = iota + 1
	OpBroadcast
	OpAllGather
	OpReduceScatter
	OpBarrier
)

// String is the op's lower-case name, as in "allreduce #57".
func (o CollectiveOp) String() string {
	switch o {
	case OpAllReduce:
		return "allreduce"
	case OpBroadcast:
		return "broadcast"
	case OpAllGather:
		return "allgather"
	case OpReduceScatter:
		return "reducescatter"
	case OpBarrier:
		return "barrier"
	}
	return "op(" + strconv.Itoa(int(o)) + ")"
}

// method is the op's ProcessGroup method name.
func (o CollectiveOp) method() string {
	switch o {
	case OpAllReduce:
		return "AllReduce"
	case OpBroadcast:
		return "Broadcast"
	case OpAllGather:
		return "AllGather"
	case OpReduceScatter:
		return "ReduceScatter"
	case OpBarrier:
		return "Barrier"
	}
	return o.String()
}

// DebugEnv selects the debug level: "detail" (any case) turns on WithDebug in
// ddp.InitProcessGroup, like TORCH_DISTRIBUTED_DEBUG=DETAIL; "off", "info" or empty do not.
const DebugEnv = "GODDP_DEBUG"

// DebugFromEnv reports whether $GODDP_DEBUG asks for the debug wrapper (lookup nil means
// os.LookupEnv). An unknown value is an error.
func DebugFromEnv(lookup func(string) (string, bool)) (bool, error) {
	if lookup == nil {
		lookup = os.LookupEnv
	}
	v, _ := lookup(DebugEnv)
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "detail":
		return true, nil
	case "", "off", "info":
		return false, nil
	}
	return false, fmt.Errorf("%w: %s=%q: want off, info or detail", ErrInvalidArgument, DebugEnv, v)
}

// Fingerprint describes one collective as one rank issued it: what the ranks compare in
// debug mode. Count is len(buf) for AllReduce and Broadcast, len(in) for AllGather and
// len(out) for ReduceScatter (what each rank contributes or receives per rank), 0 for
// Barrier; Root is set for Broadcast only, ReduceOp for AllReduce and ReduceScatter only.
type Fingerprint struct {
	Seq      int64
	Op       CollectiveOp
	DType    DType
	Count    int64
	Root     int64
	ReduceOp ReduceOp
}

// String renders f as a call: AllReduce(float32, 1048576, sum), Broadcast(float32, 1024,
// root 0), AllGather(int64, 7), Barrier().
func (f Fingerprint) String() string {
	switch f.Op {
	case OpBarrier:
		return "Barrier()"
	case OpBroadcast:
		return fmt.Sprintf("Broadcast(%v, %d, root %d)", f.DType, f.Count, f.Root)
	case OpAllReduce, OpReduceScatter:
		return fmt.Sprintf("%s(%v, %d, %v)", f.Op.method(), f.DType, f.Count, f.ReduceOp)
	}
	return fmt.Sprintf("%s(%v, %d)", f.Op.method(), f.DType, f.Count)
}

// fpWords is the length of an encoded fingerprint; fpMagic its first word.
const (
	fpWords = 7
	fpMagic = 0x676f646470667031 // "goddpfp1"
)

func (f Fingerprint) encode() []int64 {
	return []int64{fpMagic, f.Seq, int64(f.Op), int64(f.DType), f.Count, f.Root, int64(f.ReduceOp)}
}

func decodeFingerprint(w []int64) Fingerprint {
	return Fingerprint{Seq: w[1], Op: CollectiveOp(w[2]), DType: DType(w[3]), Count: w[4], Root: w[5], ReduceOp: ReduceOp(w[6])}
}

// DesyncError is the error of a collective that the ranks issued differently at the same
// position (Note [Collective order]), found by WithDebug. Every rank's work fails with it
// (the real collective is not issued) and the group is aborted with it as the cause.
type DesyncError struct {
	Rank int // the rank reporting
	Seq  int64
	// Fingerprints holds every rank's collective at Seq, by rank.
	Fingerprints []Fingerprint
}

func (e *DesyncError) Error() string {
	// Group the ranks by what they ran, in order of the lowest rank of each group.
	var groups [][]int
	for r, f := range e.Fingerprints {
		i := slices.IndexFunc(groups, func(g []int) bool { return e.Fingerprints[g[0]] == f })
		if i < 0 {
			groups = append(groups, []int{r})
		} else {
			groups[i] = append(groups[i], r)
		}
	}
	parts := make([]string, len(groups))
	for i, g := range groups {
		names := make([]string, len(g))
		for j, r := range g {
			names[j] = strconv.Itoa(r)
		}
		if len(g) == 1 {
			parts[i] = fmt.Sprintf("rank %s runs %v", names[0], e.Fingerprints[g[0]])
		} else {
			parts[i] = fmt.Sprintf("ranks %s run %v", strings.Join(names, ", "), e.Fingerprints[g[0]])
		}
	}
	return fmt.Sprintf("procgroup: rank %d: collectives out of step at #%d: %s",
		e.Rank, e.Seq, strings.Join(parts, " while "))
}

// DebugOptions configure WithDebug.
type DebugOptions struct {
	// Logger receives the desync reports; nil means zap.NewNop().
	Logger *zap.Logger
}

// WithDebug wraps pg so that before each collective the ranks compare its fingerprint
// (sequence number, op, element type, count, root, reduce op): an AllGather of a small
// fixed-size record through pg itself, issued in order just before the real collective.
// When the fingerprints differ, the real collective is not issued, the work fails on every
// rank with a *DesyncError naming what each rank runs, and pg is aborted with it.
//
// Cost: one extra small AllGather per collective, and the collectives no longer pipeline:
// each one's fingerprint exchange waits for the one before it to complete (Note [Debug
// queue]). It is a debugging aid (GODDP_DEBUG=detail), not for production runs.
//
// Invalid calls fail at once with ErrInvalidArgument and exchange nothing. Close waits for
// the works already issued, then closes pg; Abort aborts pg and waits for the wrapper's
// goroutine, which every pending work lets go at once.
func WithDebug(pg ProcessGroup, opts DebugOptions) (ProcessGroup, error) {
	if pg == nil {
		return nil, fmt.Errorf("%w: WithDebug needs a group", ErrInvalidArgument)
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	d := &debugGroup{
		inner: pg, rank: pg.Rank(), size: pg.Size(),
		log:    opts.Logger.With(zap.String("component", "debug")),
		wake:   make(chan struct{}, 1), // size 1: one pending wake-up is enough
		exited: make(chan struct{}),
	}
	go d.run()
	return d, nil
}

// Note [Debug queue]: the wrapper's calls must return at once (a gradient hook must not
// block), yet the real collective may be issued only after the fingerprints compared
// equal. So calls queue their collective, and one goroutine per group, in issue order,
// exchanges the fingerprint, waits for it, compares, and issues the real collective; it
// completes the caller's Future when the real work completes. Since the inner group runs
// works in issue order, the exchange for collective k+1 completes after collective k.

type debugState uint8

const (
	debugOpen debugState = iota
	debugClosing
	debugAborted
)

type debugItem struct {
	ctx  context.Context
	fp   Fingerprint
	call func() Work
	fut  *debugWork
}

// debugWork is a Work of the debug wrapper: it completes when the real collective does,
// which the wrapper's goroutine issues once the fingerprints compared equal.
type debugWork struct {
	*Future
	mu    sync.Mutex // guards inner
	inner Work       // the real collective's Work, once issued
}

// Unwrap implements WorkUnwrapper: the real collective's Work, or nil while its
// fingerprint exchange is still going on (or if it was never issued).
func (w *debugWork) Unwrap() Work {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.inner
}

// Unwrap implements Unwrapper: the group the debug wrapper wraps.
func (d *debugGroup) Unwrap() ProcessGroup { return d.inner }

type debugGroup struct {
	inner      ProcessGroup
	log        *zap.Logger
	rank, size int
	wake       chan struct{}
	exited     chan struct{} // closed when run returns

	mu    sync.Mutex // guards the fields below
	state debugState
	cause error // the desync that aborted the group, if any
	seq   int64
	queue []*debugItem

	closeOnce sync.Once
	closeErr  error
}

var _ ProcessGroup = (*debugGroup)(nil)

func (d *debugGroup) Rank() int { return d.rank }
func (d *debugGroup) Size() int { return d.size }

func (d *debugGroup) signal() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// enqueue queues a valid collective (fp without its sequence number) behind its
// fingerprint exchange.
func (d *debugGroup) enqueue(ctx context.Context, fp Fingerprint, call func() Work) Work {
	d.mu.Lock()
	switch d.state {
	case debugClosing:
		d.mu.Unlock()
		return Completed(fmt.Errorf("procgroup: rank %d: %v: %w", d.rank, fp.Op, ErrClosed))
	case debugAborted:
		cause := d.cause
		d.mu.Unlock()
		if cause != nil {
			return Completed(d.abortedErr(fp.Op, cause))
		}
		return call() // the inner group fails it at once, with its abort error
	}
	d.seq++
	fp.Seq = d.seq
	it := &debugItem{ctx: ctx, fp: fp, call: call, fut: &debugWork{Future: NewFuture()}}
	d.queue = append(d.queue, it)
	d.mu.Unlock()
	d.signal()
	return it.fut
}

// abortedErr is the error of a collective issued after a desync.
func (d *debugGroup) abortedErr(op CollectiveOp, cause error) error {
	return fmt.Errorf("procgroup: rank %d: %v: %w: %w", d.rank, op, ErrAborted, cause)
}

func (d *debugGroup) invalid(op CollectiveOp, format string, args ...any) Work {
	return Completed(fmt.Errorf("%w: rank %d: %v: %s", ErrInvalidArgument, d.rank, op, fmt.Sprintf(format, args...)))
}

func validReduceOp(op ReduceOp) bool { return op >= Sum && op <= Prod }

func (d *debugGroup) AllReduce(ctx context.Context, buf any, op ReduceOp) Work {
	dt, n, err := DTypeOf(buf)
	if err != nil {
		return d.invalid(OpAllReduce, "%v", err)
	}
	if !validReduceOp(op) {
		return d.invalid(OpAllReduce, "unknown reduce op %v", op)
	}
	fp := Fingerprint{Op: OpAllReduce, DType: dt, Count: int64(n), ReduceOp: op}
	return d.enqueue(ctx, fp, func() Work { return d.inner.AllReduce(ctx, buf, op) })
}

func (d *debugGroup) Broadcast(ctx context.Context, buf any, root int) Work {
	dt, n, err := DTypeOf(buf)
	if err != nil {
		return d.invalid(OpBroadcast, "%v", err)
	}
	if root < 0 || root >= d.size {
		return d.invalid(OpBroadcast, "root %d outside [0, %d)", root, d.size)
	}
	fp := Fingerprint{Op: OpBroadcast, DType: dt, Count: int64(n), Root: int64(root)}
	return d.enqueue(ctx, fp, func() Work { return d.inner.Broadcast(ctx, buf, root) })
}

// pair checks the buffers of AllGather (big = out) and ReduceScatter (big = in).
func (d *debugGroup) pair(big, small any) (DType, int, error) {
	dtb, nb, err := DTypeOf(big)
	if err != nil {
		return 0, 0, err
	}
	dts, ns, err := DTypeOf(small)
	if err != nil {
		return 0, 0, err
	}
	if dtb != dts {
		return 0, 0, fmt.Errorf("element types differ: %v and %v", dtb, dts)
	}
	if nb != d.size*ns {
		return 0, 0, fmt.Errorf("%d elements, want %d×%d", nb, d.size, ns)
	}
	return dts, ns, nil
}

func (d *debugGroup) AllGather(ctx context.Context, out, in any) Work {
	dt, n, err := d.pair(out, in)
	if err != nil {
		return d.invalid(OpAllGather, "%v", err)
	}
	fp := Fingerprint{Op: OpAllGather, DType: dt, Count: int64(n)}
	return d.enqueue(ctx, fp, func() Work { return d.inner.AllGather(ctx, out, in) })
}

func (d *debugGroup) ReduceScatter(ctx context.Context, out, in any, op ReduceOp) Work {
	dt, n, err := d.pair(in, out)
	if err != nil {
		return d.invalid(OpReduceScatter, "%v", err)
	}
	if !validReduceOp(op) {
		return d.invalid(OpReduceScatter, "unknown reduce op %v", op)
	}
	fp := Fingerprint{Op: OpReduceScatter, DType: dt, Count: int64(n), ReduceOp: op}
	return d.enqueue(ctx, fp, func() Work { return d.inner.ReduceScatter(ctx, out, in, op) })
}

func (d *debugGroup) Barrier(ctx context.Context) Work {
	return d.enqueue(ctx, Fingerprint{Op: OpBarrier}, func() Work { return d.inner.Barrier(ctx) })
}

// Close lets the queued collectives run, waits for them, then closes the inner group.
func (d *debugGroup) Close() error {
	d.closeOnce.Do(func() {
		d.mu.Lock()
		if d.state == debugOpen {
			d.state = debugClosing
		}
		d.mu.Unlock()
		d.signal()
		<-d.exited
		d.closeErr = d.inner.Close()
	})
	return d.closeErr
}

// Abort aborts the inner group (so queued and pending works fail at once) and waits for
// the wrapper's goroutine.
func (d *debugGroup) Abort(cause error) {
	d.mu.Lock()
	d.state = debugAborted
	d.mu.Unlock()
	d.inner.Abort(cause)
	d.signal()
	<-d.exited
}

type inflight struct {
	work Work
	fut  *debugWork
}

// run is the group's goroutine (Note [Debug queue]). It returns once the group is closing
// or aborted and nothing is queued or in flight.
func (d *debugGroup) run() {
	defer close(d.exited)
	var fly []inflight // real works issued, in issue order
	for {
		for len(fly) > 0 && isDone(fly[0].work) {
			fly[0].fut.Complete(fly[0].work.Err())
			fly[0] = inflight{}
			fly = fly[1:]
		}
		d.mu.Lock()
		var it *debugItem
		if len(d.queue) > 0 {
			it = d.queue[0]
			d.queue[0] = nil
			d.queue = d.queue[1:]
		}
		stopping := d.state != debugOpen
		d.mu.Unlock()
		if it != nil {
			if w := d.process(it); w != nil {
				fly = append(fly, inflight{w, it.fut})
			}
			continue
		}
		if stopping && len(fly) == 0 {
			return
		}
		var front <-chan struct{}
		if len(fly) > 0 {
			front = fly[0].work.Done()
		}
		select {
		case <-d.wake:
		case <-front:
		}
	}
}

// process exchanges its fingerprint and, if every rank's matches, issues the real
// collective and returns its work; otherwise it completes it.fut itself and returns nil.
func (d *debugGroup) process(it *debugItem) Work {
	d.mu.Lock()
	cause := d.cause
	d.mu.Unlock()
	if cause != nil {
		it.fut.Complete(d.abortedErr(it.fp.Op, cause))
		return nil
	}
	all := make([]int64, d.size*fpWords)
	fw := d.inner.AllGather(it.ctx, all, it.fp.encode())
	<-fw.Done() // bounded: the inner group's works complete or fail (Close, Abort, timeout)
	if err := fw.Err(); err != nil {
		it.fut.Complete(fmt.Errorf("procgroup: rank %d: %v #%d: fingerprint exchange: %w", d.rank, it.fp.Op, it.fp.Seq, err))
		return nil
	}
	fps := make([]Fingerprint, d.size)
	same := true
	for r := range fps {
		w := all[r*fpWords : (r+1)*fpWords]
		if w[0] != fpMagic {
			// A peer's exchange was paired with some other AllGather of fpWords int64s: a
			// peer that does not run the debug wrapper.
			fps[r] = Fingerprint{Seq: -1, Op: OpAllGather, DType: Int64, Count: fpWords}
		} else {
			fps[r] = decodeFingerprint(w)
		}
		same = same && fps[r] == it.fp
	}
	if same {
		w := it.call()
		it.fut.mu.Lock()
		it.fut.inner = w
		it.fut.mu.Unlock()
		return w
	}
	derr := &DesyncError{Rank: d.rank, Seq: it.fp.Seq, Fingerprints: fps}
	d.log.Error("collective desync; aborting the group", zap.Error(derr))
	d.mu.Lock()
	d.state, d.cause = debugAborted, derr
	d.mu.Unlock()
	d.inner.Abort(derr)
	it.fut.Complete(derr)
	return nil
}
