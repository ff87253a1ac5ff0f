package pgtest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// Cluster is an in-memory world of Size ranks whose groups run real collectives on host
// buffers, for unit tests of the layers above procgroup. It is deterministic (no network, no
// timeouts) and offers fault injection: a delay per rank (SetDelay), a rank held back
// (Pause, Resume) and the death of a rank (Kill). Every collective a rank issues is recorded
// (Issued) and may be reported as it is issued (OnIssue).
//
// Semantics follow a real backend (see procgroup.ProcessGroup), with these choices:
//   - Each rank has one worker goroutine that runs its works strictly in issue order; a work
//     completes when every rank has reached the same sequence number, at which moment the
//     whole collective is computed (in the buffers' own precision, BFloat16 and Float16 in
//     float32, ranks combined in rank order) and every rank's work completes.
//   - Invalid arguments fail the Work at once with procgroup.ErrInvalidArgument and use no
//     sequence number, so the group goes on.
//   - Two ranks issuing different collectives (op, dtype, count, root or reduce op) at the
//     same sequence number abort the group: every rank's pending and later works fail with
//     an error wrapping procgroup.ErrAborted and a *MismatchError.
//   - A rank that stops — Close, Abort, Kill or a ctx that ends — fails its pending works
//     (with procgroup.ErrClosed after Close, procgroup.ErrAborted otherwise); its peers can
//     no longer complete a collective, so they are aborted too: their pending and later works
//     fail with an error wrapping procgroup.ErrAborted and procgroup.ErrPeerLost that names
//     the rank. Unlike a graceful backend, Close does not wait for pending works: they fail.
//
// All methods are safe for concurrent use. Close must be called (by the test, for instance
// with defer) to stop the worker goroutines.
type Cluster struct {
	// OnIssue, if set, is called for each collective as a rank issues it, on the issuing
	// goroutine, before the call returns its Work. Calls are serialized in issue order
	// across all ranks; OnIssue may call Issued but must not issue collectives. Set it
	// before any collective is issued. It must not block.
	OnIssue func(rank int, r Record)

	size   int
	groups []*group
	wg     sync.WaitGroup // the workers

	issueMu sync.Mutex // serializes issuing, so that OnIssue sees issue order

	mu    sync.Mutex    // guards the fields below and every group's mutable fields
	slots map[int]*slot // collectives some rank has reached, by sequence number
	link  float64       // SetLink's bytes per second; 0: none
}

// NewCluster returns a cluster of size ranks and starts one worker per rank. It panics if
// size < 1.
func NewCluster(size int) *Cluster {
	if size < 1 {
		panic(fmt.Sprintf("pgtest: NewCluster(%d): size must be at least 1", size))
	}
	c := &Cluster{size: size, slots: map[int]*slot{}}
	c.groups = make([]*group, size)
	for r := range c.groups {
		c.groups[r] = &group{
			c:      c,
			rank:   r,
			wake:   make(chan struct{}, 1), // size 1: one pending wake-up is enough
			stop:   make(chan struct{}),
			exited: make(chan struct{}),
		}
	}
	c.wg.Add(size)
	for _, g := range c.groups {
		go g.run()
	}
	return c
}

// Size is the number of ranks.
func (c *Cluster) Size() int { return c.size }

// Group returns rank's ProcessGroup (the same handle on every call). It panics if rank is
// outside [0, Size).
func (c *Cluster) Group(rank int) procgroup.ProcessGroup { return c.group(rank) }

// Groups returns every rank's ProcessGroup, in rank order.
func (c *Cluster) Groups() []procgroup.ProcessGroup {
	gs := make([]procgroup.ProcessGroup, c.size)
	for r, g := range c.groups {
		gs[r] = g
	}
	return gs
}

func (c *Cluster) group(rank int) *group {
	if rank < 0 || rank >= c.size {
		panic(fmt.Sprintf("pgtest: rank %d outside [0, %d)", rank, c.size))
	}
	return c.groups[rank]
}

// Each runs f for every rank concurrently, each on its own goroutine (as each rank would run
// in its own process), waits for all of them and returns their errors joined, each prefixed
// with its rank.
func (c *Cluster) Each(f func(rank int, pg procgroup.ProcessGroup) error) error {
	errs := make([]error, c.size)
	var wg sync.WaitGroup
	for r, g := range c.groups {
		wg.Go(func() {
			if err := f(r, g); err != nil {
				errs[r] = fmt.Errorf("rank %d: %w", r, err)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// SetDelay makes each of rank's later collectives start d after its predecessor finished (or
// after it was issued), as if that rank were slow. Zero removes the delay.
func (c *Cluster) SetDelay(rank int, d time.Duration) {
	g := c.group(rank)
	c.mu.Lock()
	g.delay = d
	c.mu.Unlock()
}

// SetLink makes every rank's later collectives start Count·size/bytesPerSec after their
// predecessor finished (or after they were issued), on top of SetDelay's delay: one
// collective at a time moves its bytes over a link of that speed, as a slow network
// would have it. Zero removes it.
func (c *Cluster) SetLink(bytesPerSec float64) {
	c.mu.Lock()
	c.link = bytesPerSec
	c.mu.Unlock()
}

// Pause stops rank from starting collectives: the works it issues stay pending (and so do
// its peers' matching works) until Resume. A collective already started is not affected.
// Pause lets a test hold works pending deterministically, without timing.
func (c *Cluster) Pause(rank int) {
	g := c.group(rank)
	c.mu.Lock()
	g.paused = true
	c.mu.Unlock()
}

// Resume undoes Pause.
func (c *Cluster) Resume(rank int) {
	g := c.group(rank)
	c.mu.Lock()
	g.paused = false
	c.mu.Unlock()
	g.signal()
}

// Kill makes rank die: its pending and later works fail with an error wrapping
// procgroup.ErrAborted; every other rank's pending and later works fail with an error
// wrapping procgroup.ErrPeerLost (and procgroup.ErrAborted) that names rank. Works that
// had already completed keep their results.
func (c *Cluster) Kill(rank int) {
	c.group(rank)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stopAllLocked(rank, fmt.Errorf("%w: rank %d killed", procgroup.ErrAborted, rank), "killed")
}

// Issued returns the collectives rank has issued so far (invalid calls excluded), in issue
// order.
func (c *Cluster) Issued(rank int) []Record {
	g := c.group(rank)
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]Record(nil), g.issued...)
}

// Close closes every group (failing pending works) and waits for the workers to exit.
func (c *Cluster) Close() {
	for _, g := range c.groups {
		_ = g.Close()
	}
	c.wg.Wait()
}

// stopAllLocked stops rank with err and every other rank with a peer-lost error saying how
// rank went away. c.mu must be held.
func (c *Cluster) stopAllLocked(rank int, err error, how string) {
	c.groups[rank].stopLocked(err)
	peerErr := fmt.Errorf("%w: %w: rank %d %s", procgroup.ErrAborted, procgroup.ErrPeerLost, rank, how)
	for _, g := range c.groups {
		if g.rank != rank {
			g.stopLocked(peerErr)
		}
	}
	// Every rank has stopped, so no slot can ever complete; their works have failed.
	clear(c.slots)
}

// slot is one collective (one sequence number) that at least one rank has reached.
type slot struct {
	seq   int
	first int   // the rank that arrived first; its record is the reference
	ops   []*op // by rank; nil until that rank arrives
	n     int   // ranks arrived
	done  chan struct{}
}

// depositLocked adds o, rank g's work at o.rec.Seq, to its slot; when it is the last rank
// to arrive it runs the collective and completes every rank's work. It returns the slot,
// whose done channel closes when the collective has completed or failed. c.mu must be held.
func (c *Cluster) depositLocked(g *group, o *op) *slot {
	s := c.slots[o.rec.Seq]
	if s == nil {
		s = &slot{seq: o.rec.Seq, first: g.rank, ops: make([]*op, c.size), done: make(chan struct{})}
		c.slots[s.seq] = s
	}
	s.ops[g.rank] = o
	s.n++
	if want := s.ops[s.first].rec; !o.rec.matches(want) {
		// The ranks are out of step: abort them all with the mismatch as the cause.
		mm := &MismatchError{Seq: s.seq, Rank: g.rank, Got: o.rec, Peer: s.first, Want: want}
		err := fmt.Errorf("%w: %w", procgroup.ErrAborted, mm)
		for r, p := range s.ops {
			if p != nil {
				c.groups[r].completeLocked(p, err)
			}
		}
		close(s.done)
		for _, g := range c.groups {
			g.stopLocked(err)
		}
		clear(c.slots)
		return s
	}
	if s.n < c.size {
		return s
	}
	run(o.rec, s.ops)
	for r, p := range s.ops {
		c.groups[r].completeLocked(p, nil)
	}
	close(s.done)
	delete(c.slots, s.seq)
	return s
}

// op is one issued collective on one rank.
type op struct {
	rec     Record
	in, out any // the buffers; for AllReduce and Broadcast both are buf
	fut     *procgroup.Future
	stopCtx func() bool // stops the ctx watch; nil when there is none
}

// group is one rank's ProcessGroup.
type group struct {
	c      *Cluster
	rank   int
	wake   chan struct{} // signals the worker that the queue grew
	stop   chan struct{} // closed when the rank stops
	exited chan struct{} // closed when the worker has returned

	// guarded by c.mu
	seq     int           // sequence number of the last issued collective
	delay   time.Duration // start delay of each collective
	queue   []*op         // issued, not yet completed, in issue order
	issued  []Record
	paused  bool  // Pause was called, not yet Resume
	closed  bool  // Close was called
	stopErr error // why the rank stopped; nil while it runs
}

var _ procgroup.ProcessGroup = (*group)(nil)

func (g *group) Rank() int { return g.rank }
func (g *group) Size() int { return g.c.size }

// opErr is the error of work o on this rank.
func (g *group) opErr(rec Record, err error) error {
	if rec.Seq == 0 {
		return fmt.Errorf("pgtest: rank %d: %s: %w", g.rank, rec.Op, err)
	}
	return fmt.Errorf("pgtest: rank %d: %s seq %d: %w", g.rank, rec.Op, rec.Seq, err)
}

// completeLocked completes o with err (nil: success), with this rank's context added.
func (g *group) completeLocked(o *op, err error) {
	if err != nil {
		err = g.opErr(o.rec, err)
	}
	o.fut.Complete(err)
	if o.stopCtx != nil {
		o.stopCtx()
	}
}

// stopLocked stops the rank: its queued works fail with err and its worker exits. Only the
// first stop counts.
func (g *group) stopLocked(err error) {
	if g.stopErr != nil {
		return
	}
	g.stopErr = err
	close(g.stop)
	for _, o := range g.queue {
		g.completeLocked(o, err)
	}
	g.queue = nil
}

// run is the rank's worker: it takes the works in issue order, waits for the rank's delay,
// joins the collective and waits for it to complete.
func (g *group) run() {
	defer g.c.wg.Done()
	defer close(g.exited)
	c := g.c
	for {
		c.mu.Lock()
		for (len(g.queue) == 0 || g.paused) && g.stopErr == nil {
			c.mu.Unlock()
			select {
			case <-g.wake:
			case <-g.stop:
			}
			c.mu.Lock()
		}
		if g.stopErr != nil {
			c.mu.Unlock()
			return
		}
		o, delay := g.queue[0], g.delay
		if c.link > 0 {
			delay += time.Duration(float64(o.rec.Count*o.rec.DType.Size()) / c.link * float64(time.Second))
		}
		c.mu.Unlock()

		if delay > 0 {
			t := time.NewTimer(delay)
			select {
			case <-t.C:
			case <-g.stop:
				t.Stop()
				return
			}
		}

		c.mu.Lock()
		if g.stopErr != nil {
			c.mu.Unlock()
			return
		}
		s := c.depositLocked(g, o)
		c.mu.Unlock()

		select {
		case <-s.done:
		case <-g.stop:
			return
		}
		c.mu.Lock()
		if len(g.queue) > 0 && g.queue[0] == o {
			g.queue = g.queue[1:]
		}
		c.mu.Unlock()
	}
}

// issue validates nothing (the caller did), queues the collective and returns its Work.
func (g *group) issue(ctx context.Context, rec Record, in, out any) procgroup.Work {
	c := g.c
	c.issueMu.Lock()
	defer c.issueMu.Unlock()

	c.mu.Lock()
	switch {
	case g.closed:
		c.mu.Unlock()
		return procgroup.Completed(g.opErr(rec, procgroup.ErrClosed))
	case g.stopErr != nil:
		err := g.stopErr
		c.mu.Unlock()
		return procgroup.Completed(g.opErr(rec, err))
	}
	g.seq++
	rec.Seq = g.seq
	o := &op{rec: rec, in: in, out: out, fut: procgroup.NewFuture()}
	g.issued = append(g.issued, rec)
	g.queue = append(g.queue, o)
	if ctx.Done() != nil {
		o.stopCtx = context.AfterFunc(ctx, func() { g.ctxDone(ctx, o) })
	}
	hook := c.OnIssue
	c.mu.Unlock()

	g.signal()
	if hook != nil {
		hook(g.rank, rec)
	}
	return o.fut
}

// signal wakes the worker up.
func (g *group) signal() {
	select {
	case g.wake <- struct{}{}:
	default: // a wake-up is already pending
	}
}

// ctxDone fails o with ctx's error if it is still pending and aborts the group: its peers
// are mid-protocol.
func (g *group) ctxDone(ctx context.Context, o *op) {
	c := g.c
	c.mu.Lock()
	defer c.mu.Unlock()
	select {
	case <-o.fut.Done():
		return
	default:
	}
	err := context.Cause(ctx)
	g.completeLocked(o, err)
	c.stopAllLocked(g.rank, fmt.Errorf("%w: %s seq %d: %w", procgroup.ErrAborted, o.rec.Op, o.rec.Seq, err), "aborted")
}

func (g *group) invalid(op procgroup.CollectiveOp, format string, args ...any) procgroup.Work {
	return procgroup.Completed(g.opErr(Record{Op: op},
		fmt.Errorf("%w: "+format, append([]any{procgroup.ErrInvalidArgument}, args...)...)))
}

// hostDType is procgroup.DTypeOf restricted to host slices, which is all pgtest handles.
func hostDType(buf any) (procgroup.DType, int, error) {
	if _, ok := buf.(procgroup.Buffer); ok {
		return 0, 0, fmt.Errorf("%w: pgtest handles host slices only, not %T", procgroup.ErrInvalidArgument, buf)
	}
	return procgroup.DTypeOf(buf)
}

func validOp(op procgroup.ReduceOp) bool { return op >= procgroup.Sum && op <= procgroup.Prod }

var errNilCtx = fmt.Errorf("%w: nil context", procgroup.ErrInvalidArgument)

// AllReduce implements procgroup.ProcessGroup.
func (g *group) AllReduce(ctx context.Context, buf any, op procgroup.ReduceOp) procgroup.Work {
	if ctx == nil {
		return procgroup.Completed(g.opErr(Record{Op: procgroup.OpAllReduce}, errNilCtx))
	}
	dt, n, err := hostDType(buf)
	if err != nil {
		return procgroup.Completed(g.opErr(Record{Op: procgroup.OpAllReduce}, err))
	}
	if !validOp(op) {
		return g.invalid(procgroup.OpAllReduce, "unknown reduce op %v", op)
	}
	return g.issue(ctx, Record{Op: procgroup.OpAllReduce, DType: dt, Count: n, ReduceOp: op}, buf, buf)
}

// Broadcast implements procgroup.ProcessGroup.
func (g *group) Broadcast(ctx context.Context, buf any, root int) procgroup.Work {
	if ctx == nil {
		return procgroup.Completed(g.opErr(Record{Op: procgroup.OpBroadcast}, errNilCtx))
	}
	dt, n, err := hostDType(buf)
	if err != nil {
		return procgroup.Completed(g.opErr(Record{Op: procgroup.OpBroadcast}, err))
	}
	if root < 0 || root >= g.c.size {
		return g.invalid(procgroup.OpBroadcast, "root %d outside [0, %d)", root, g.c.size)
	}
	return g.issue(ctx, Record{Op: procgroup.OpBroadcast, DType: dt, Count: n, Root: root}, buf, buf)
}

// AllGather implements procgroup.ProcessGroup.
func (g *group) AllGather(ctx context.Context, out, in any) procgroup.Work {
	if ctx == nil {
		return procgroup.Completed(g.opErr(Record{Op: procgroup.OpAllGather}, errNilCtx))
	}
	dt, nIn, nOut, err := g.pair(in, out)
	if err != nil {
		return procgroup.Completed(g.opErr(Record{Op: procgroup.OpAllGather}, err))
	}
	if nOut != g.c.size*nIn {
		return g.invalid(procgroup.OpAllGather, "len(out) %d, want size %d × len(in) %d", nOut, g.c.size, nIn)
	}
	if err := g.slot(out, in); err != nil {
		return procgroup.Completed(g.opErr(Record{Op: procgroup.OpAllGather}, err))
	}
	return g.issue(ctx, Record{Op: procgroup.OpAllGather, DType: dt, Count: nIn}, in, out)
}

// ReduceScatter implements procgroup.ProcessGroup.
func (g *group) ReduceScatter(ctx context.Context, out, in any, op procgroup.ReduceOp) procgroup.Work {
	if ctx == nil {
		return procgroup.Completed(g.opErr(Record{Op: procgroup.OpReduceScatter}, errNilCtx))
	}
	dt, nIn, nOut, err := g.pair(in, out)
	if err != nil {
		return procgroup.Completed(g.opErr(Record{Op: procgroup.OpReduceScatter}, err))
	}
	if nIn != g.c.size*nOut {
		return g.invalid(procgroup.OpReduceScatter, "len(in) %d, want size %d × len(out) %d", nIn, g.c.size, nOut)
	}
	if !validOp(op) {
		return g.invalid(procgroup.OpReduceScatter, "unknown reduce op %v", op)
	}
	if err := g.slot(in, out); err != nil {
		return procgroup.Completed(g.opErr(Record{Op: procgroup.OpReduceScatter}, err))
	}
	return g.issue(ctx, Record{Op: procgroup.OpReduceScatter, DType: dt, Count: nOut, ReduceOp: op}, in, out)
}

// pair checks that in and out are host slices of one element type.
func (g *group) pair(in, out any) (dt procgroup.DType, nIn, nOut int, err error) {
	dt, nIn, err = hostDType(in)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("in: %w", err)
	}
	dtOut, nOut, err := hostDType(out)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("out: %w", err)
	}
	if dt != dtOut {
		return 0, 0, 0, fmt.Errorf("%w: in is %v, out is %v", procgroup.ErrInvalidArgument, dt, dtOut)
	}
	return dt, nIn, nOut, nil
}

// slot refuses buffers that overlap other than in the in-place layout, as the real backends
// do (procgroup.CheckSlot); whole is the large one.
func (g *group) slot(whole, part any) error {
	wb, _, _, _ := kernels.Bytes(whole)
	pb, _, _, _ := kernels.Bytes(part)
	return kernels.CheckSlot(wb, pb, g.rank)
}

// Barrier implements procgroup.ProcessGroup.
func (g *group) Barrier(ctx context.Context) procgroup.Work {
	if ctx == nil {
		return procgroup.Completed(g.opErr(Record{Op: procgroup.OpBarrier}, errNilCtx))
	}
	return g.issue(ctx, Record{Op: procgroup.OpBarrier}, nil, nil)
}

// Close fails the rank's pending works with procgroup.ErrClosed (its peers' with
// procgroup.ErrPeerLost) and waits for its worker to exit; later works fail with
// procgroup.ErrClosed. It is idempotent and returns nil.
func (g *group) Close() error {
	c := g.c
	c.mu.Lock()
	if !g.closed {
		g.closed = true
		c.stopAllLocked(g.rank, procgroup.ErrClosed, "closed")
	}
	c.mu.Unlock()
	<-g.exited
	return nil
}

// Abort fails the rank's pending and later works with an error wrapping
// procgroup.ErrAborted (and cause, if not nil); its peers' fail with procgroup.ErrPeerLost.
func (g *group) Abort(cause error) {
	err := procgroup.ErrAborted
	if cause != nil {
		err = fmt.Errorf("%w: %w", procgroup.ErrAborted, cause)
	}
	c := g.c
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stopAllLocked(g.rank, err, "aborted")
}
