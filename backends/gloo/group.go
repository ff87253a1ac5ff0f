package gloo

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

func init() { procgroup.Register("gloo", New) }

// op is one queued collective. ops are recycled through group.free.
type op struct {
	kind     procgroup.CollectiveOp
	dt       procgroup.DType
	rop      procgroup.ReduceOp
	buf, in  []byte // buf: the in-place buffer, or out; in: AllGather/ReduceScatter input
	root     int
	seq      uint64
	ctx      context.Context
	deadline time.Time
	fut      *procgroup.Future
	force    string // an all-reduce's path, set by the calibration (submitPath)
}

// group is the gloo ProcessGroup. Note [Threads]: one worker goroutine runs the works in
// issue order and does all reads itself (inline); each peer has a writer goroutine for the
// sends that must not block the worker (ring segments, large direct messages). Small
// messages are written inline by the worker: Note [Inline writes].
type group struct {
	rank, size int
	cfg        Config
	opts       procgroup.Options
	log        *zap.Logger
	hosts      []string // host names by rank, for errors
	hostIDs    []string // Config.HostID by rank (filled by connect)

	peers []*peer // by rank; nil at g.rank

	listeners []net.Listener

	qmu     sync.Mutex // guards the fields below
	queue   []*op
	qhead   int
	free    []*op
	seq     uint64
	closing bool
	qwake   chan struct{} // size 1: the worker has something to look at

	abortOnce  sync.Once
	aborted    chan struct{} // closed on abort
	abortErr   error         // written before aborted is closed
	stop       chan struct{} // closed when goroutines must exit
	stopOnce   sync.Once
	workerDone chan struct{}  // closed when the worker exits
	wg         sync.WaitGroup // every goroutine of the group

	hsMu    sync.Mutex // guards hsConns
	hsConns map[net.Conn]struct{}
	hsSem   chan struct{} // bounds concurrent handshakes

	meshMu sync.Mutex    // guards peers during setup (accepting side)
	meshCh chan struct{} // size 1: an accepted peer was registered

	// worker-only state
	tmp  []byte // one segment, 8-aligned
	seg  int    // the current collective's segment size (≤ Config.SegmentSize)
	acc  []byte // direct all-reduce accumulator / reduce-scatter work buffer
	offs []int  // chunk offsets in bytes, len size+1
	ring []int  // Note [Ring order]: the ranks in ring order, each host's together
	pos  int    // this rank's index in ring
	flat ringView
	hier bool // Note [Hierarchical] applies: local and cross are set
	// hostShm: hier, and this host's ranks are exactly the members of its shared-memory
	// region, so the host phases run through its slots or in place (Note [Hierarchical]);
	// cleared on every rank of the host where one lacks it (Note [Agreement]).
	hostShm bool
	// piece is Note [Hierarchical pipeline]'s piece as the group agreed it (Note
	// [Agreement]): Config.HierPieceSize where every host's ranks share memory, else -1.
	piece int
	// Note [Agreement]'s record of the others' settings: every rank asks for the
	// calibration (Config.Tune); which ranks allow shared memory (Config.SharedMemory).
	tuneAll   bool
	shmWanted []bool
	// cma: every rank can read every other's buffers with process_vm_readv, and the
	// collectives on the user's buffers do (Note [Single copy]); the group's, set in New.
	cma bool
	// lastPath is the path the worker's latest all-reduce took (allReducePath, or
	// "shm-inplace"), or "shm-vm" where another collective took Note [Single copy] (""
	// where it did not), for the tests.
	lastPath string
	local    ringView // this host's ranks
	cross    ringView // the ranks with this rank's local index, one per host
	marks    []int    // ring: next.issued before each reduce-scatter step's sends
	wideOp   op       // runWide's float32 twin of a 16-bit op
	hierSum  op       // hierAllReduce's op with Avg as Sum
	hierAt   []int    // by rank: its block's index in Note [Hierarchical blocks]'s order
	// Note [Hierarchical pipeline]: the middle rings the worker queues for crossWorker,
	// and their results, in order; nil unless hier.
	crossJobs chan crossJob
	crossDone chan error
	wideBuf   []byte // runWide's float32 buffers
	wideIn    []byte
	sendBuf   []byte // inline frame

	model *costModel  // Note [Algorithm choice]; nil: the fixed rules
	shm   *shmRegion  // nil: no shared memory (Note [Shared memory])
	inl   inlineState // Note [Inline exchange]
	tree  treeAcc     // Note [One association]
	timer *time.Timer
	cur   *op
}

var _ procgroup.ProcessGroup = (*group)(nil)

// New creates a gloo group: it listens, publishes its addresses in opts.Store, connects the
// full mesh, and returns once every peer is connected and authenticated or ctx ends.
// opts.Backend may be a *Config (nil: defaults).
func New(ctx context.Context, opts procgroup.Options) (procgroup.ProcessGroup, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	var cfg Config
	switch b := opts.Backend.(type) {
	case nil:
	case *Config:
		if b != nil {
			cfg = *b
		}
	case Config:
		cfg = b
	default:
		return nil, fmt.Errorf("%w: gloo: Options.Backend is %T, want *gloo.Config", procgroup.ErrInvalidArgument, opts.Backend)
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	g := &group{
		rank: opts.Rank,
		size: opts.Size,
		cfg:  cfg,
		opts: opts,
		// The caller's logger carries the rank (ddp.InitProcessGroup and the commands add
		// it); adding it again here would print it twice.
		log:        opts.Logger.With(zap.String("backend", "gloo")),
		hosts:      make([]string, opts.Size),
		hostIDs:    make([]string, opts.Size),
		peers:      make([]*peer, opts.Size),
		qwake:      make(chan struct{}, 1),
		aborted:    make(chan struct{}),
		stop:       make(chan struct{}),
		workerDone: make(chan struct{}),
		hsConns:    map[net.Conn]struct{}{},
		hsSem:      make(chan struct{}, 16),
		meshCh:     make(chan struct{}, 1),
		tmp:        kernels.Aligned(cfg.SegmentSize),
		offs:       make([]int, opts.Size+1),
		marks:      make([]int, opts.Size),
		sendBuf:    make([]byte, frameHeaderLen+cfg.InlineMaxBytes),
	}
	g.timer = time.NewTimer(time.Hour)
	g.timer.Stop()
	if opts.Token == "" {
		g.log.Warn("gloo: empty job token: data-plane connections are not protected")
	}
	if err := g.connect(ctx); err != nil {
		g.shutdown()
		return nil, fmt.Errorf("gloo: rank %d: setup: %w", g.rank, err)
	}
	g.ring = ringOrder(g.hostIDs)
	g.pos = slices.Index(g.ring, g.rank)
	g.flat = ringView{n: g.size, pos: g.pos, ranks: g.ring, ids: g.ring, offs: g.offs}
	g.setupHier()
	g.setSpins()
	if err := g.setupShm(ctx); err != nil {
		g.shutdown()
		g.releaseShm()
		return nil, fmt.Errorf("gloo: rank %d: shared memory setup: %w", g.rank, err)
	}
	g.hostShm = g.hier && g.shmHolds(g.local.ranks)
	if err := g.agreeCMA(ctx); err != nil {
		g.shutdown()
		g.releaseShm()
		return nil, fmt.Errorf("gloo: rank %d: %w", g.rank, err)
	}
	for _, p := range g.peers {
		if p != nil {
			g.wg.Add(1)
			go p.writeLoop()
		}
	}
	if g.hier {
		g.crossJobs, g.crossDone = make(chan crossJob, hierMaxPieces), make(chan error, hierMaxPieces)
		g.wg.Add(1)
		go g.crossWorker()
	}
	g.wg.Add(1)
	go g.worker()
	if err := g.agreeShm(ctx); err != nil {
		g.Close()
		return nil, fmt.Errorf("gloo: rank %d: %w", g.rank, err)
	}
	if err := g.calibrate(ctx); err != nil {
		g.Close()
		return nil, fmt.Errorf("gloo: rank %d: %w", g.rank, err)
	}
	return g, nil
}

func (g *group) Rank() int { return g.rank }
func (g *group) Size() int { return g.size }

func (g *group) AllReduce(ctx context.Context, buf any, rop procgroup.ReduceOp) procgroup.Work {
	b, dt, _, err := kernels.Bytes(buf)
	if err == nil {
		err = checkOp(rop)
	}
	if err != nil {
		return g.invalid(procgroup.OpAllReduce, err)
	}
	return g.submit(ctx, procgroup.OpAllReduce, dt, rop, b, nil, 0)
}

// submitPath queues an all-reduce that takes path (allReducePath's names) whatever the
// rules say: Note [Algorithm choice]'s calibration.
func (g *group) submitPath(ctx context.Context, buf any, rop procgroup.ReduceOp, path string) procgroup.Work {
	b, dt, _, err := kernels.Bytes(buf)
	if err != nil {
		return g.invalid(procgroup.OpAllReduce, err)
	}
	return g.submitForce(ctx, procgroup.OpAllReduce, dt, rop, b, nil, 0, path)
}

func (g *group) Broadcast(ctx context.Context, buf any, root int) procgroup.Work {
	b, dt, _, err := kernels.Bytes(buf)
	if err == nil && (root < 0 || root >= g.size) {
		err = fmt.Errorf("%w: root %d outside [0, %d)", procgroup.ErrInvalidArgument, root, g.size)
	}
	if err != nil {
		return g.invalid(procgroup.OpBroadcast, err)
	}
	return g.submit(ctx, procgroup.OpBroadcast, dt, 0, b, nil, root)
}

func (g *group) AllGather(ctx context.Context, out, in any) procgroup.Work {
	ob, odt, on, err := kernels.Bytes(out)
	if err != nil {
		return g.invalid(procgroup.OpAllGather, fmt.Errorf("out: %w", err))
	}
	ib, idt, inn, err := kernels.Bytes(in)
	if err != nil {
		return g.invalid(procgroup.OpAllGather, fmt.Errorf("in: %w", err))
	}
	if odt != idt || on != g.size*inn {
		return g.invalid(procgroup.OpAllGather, fmt.Errorf("%w: out is %v×%d, want %v×%d (size × len(in))",
			procgroup.ErrInvalidArgument, odt, on, idt, g.size*inn))
	}
	if err := kernels.CheckSlot(ob, ib, g.rank); err != nil {
		return g.invalid(procgroup.OpAllGather, err)
	}
	return g.submit(ctx, procgroup.OpAllGather, odt, 0, ob, ib, 0)
}

func (g *group) ReduceScatter(ctx context.Context, out, in any, rop procgroup.ReduceOp) procgroup.Work {
	ob, odt, on, err := kernels.Bytes(out)
	if err != nil {
		return g.invalid(procgroup.OpReduceScatter, fmt.Errorf("out: %w", err))
	}
	ib, idt, inn, err := kernels.Bytes(in)
	if err != nil {
		return g.invalid(procgroup.OpReduceScatter, fmt.Errorf("in: %w", err))
	}
	if odt != idt || inn != g.size*on {
		return g.invalid(procgroup.OpReduceScatter, fmt.Errorf("%w: in is %v×%d, want %v×%d (size × len(out))",
			procgroup.ErrInvalidArgument, idt, inn, odt, g.size*on))
	}
	if err := checkOp(rop); err != nil {
		return g.invalid(procgroup.OpReduceScatter, err)
	}
	if err := kernels.CheckSlot(ib, ob, g.rank); err != nil {
		return g.invalid(procgroup.OpReduceScatter, err)
	}
	return g.submit(ctx, procgroup.OpReduceScatter, odt, rop, ob, ib, 0)
}

func (g *group) Barrier(ctx context.Context) procgroup.Work {
	return g.submit(ctx, procgroup.OpBarrier, 0, 0, nil, nil, 0)
}

func checkOp(rop procgroup.ReduceOp) error {
	switch rop {
	case procgroup.Sum, procgroup.Avg, procgroup.Min, procgroup.Max, procgroup.Prod:
		return nil
	}
	return fmt.Errorf("%w: unknown reduce op %v", procgroup.ErrInvalidArgument, rop)
}

func (g *group) invalid(k procgroup.CollectiveOp, err error) procgroup.Work {
	return procgroup.Completed(fmt.Errorf("gloo: rank %d: %v: %w", g.rank, k, err))
}

func (g *group) submit(ctx context.Context, k procgroup.CollectiveOp, dt procgroup.DType, rop procgroup.ReduceOp, buf, in []byte, root int) procgroup.Work {
	return g.submitForce(ctx, k, dt, rop, buf, in, root, "")
}

func (g *group) submitForce(ctx context.Context, k procgroup.CollectiveOp, dt procgroup.DType, rop procgroup.ReduceOp, buf, in []byte, root int, force string) procgroup.Work {
	if ctx == nil {
		ctx = context.Background()
	}
	fut := procgroup.NewFuture()
	g.qmu.Lock()
	if g.closing {
		g.qmu.Unlock()
		fut.Complete(fmt.Errorf("gloo: rank %d: %v: %w", g.rank, k, procgroup.ErrClosed))
		return fut
	}
	select {
	case <-g.aborted:
		g.qmu.Unlock()
		fut.Complete(fmt.Errorf("gloo: rank %d: %v: %w", g.rank, k, g.abortErr))
		return fut
	default:
	}
	var o *op
	if n := len(g.free); n > 0 {
		o, g.free = g.free[n-1], g.free[:n-1]
	} else {
		o = new(op)
	}
	g.seq++
	*o = op{kind: k, dt: dt, rop: rop, buf: buf, in: in, root: root, seq: g.seq, ctx: ctx, fut: fut, force: force}
	if g.qhead > 0 && g.qhead == len(g.queue) {
		clear(g.queue)
		g.queue, g.qhead = g.queue[:0], 0
	}
	g.queue = append(g.queue, o)
	g.qmu.Unlock()
	select {
	case g.qwake <- struct{}{}:
	default:
	}
	return fut
}

// next pops the next op; nil means the worker must exit.
func (g *group) next() *op {
	for {
		g.qmu.Lock()
		if g.qhead < len(g.queue) {
			o := g.queue[g.qhead]
			g.queue[g.qhead] = nil
			g.qhead++
			g.qmu.Unlock()
			return o
		}
		closing := g.closing
		g.qmu.Unlock()
		if closing {
			return nil
		}
		select {
		case <-g.qwake:
		case <-g.aborted:
			// Fail whatever is still queued.
			g.qmu.Lock()
			if g.qhead < len(g.queue) {
				o := g.queue[g.qhead]
				g.queue[g.qhead] = nil
				g.qhead++
				g.qmu.Unlock()
				return o
			}
			g.qmu.Unlock()
			return nil
		}
	}
}

func (g *group) worker() {
	defer g.wg.Done()
	defer close(g.workerDone)
	if g.crossJobs != nil {
		defer close(g.crossJobs) // crossWorker exits
	}
	for {
		o := g.next()
		if o == nil {
			return
		}
		var err error
		select {
		case <-g.aborted:
			err = g.opErr(o, g.abortErr)
		default:
			g.cur = o
			o.deadline = time.Now().Add(g.opts.Timeout)
			err = g.run(o)
			g.cur = nil
			if err != nil {
				err = g.opErr(o, err)
				g.abort(err)
			}
		}
		fut := o.fut
		*o = op{}
		g.qmu.Lock()
		g.free = append(g.free, o)
		g.qmu.Unlock()
		fut.Complete(err)
	}
}

func (g *group) opErr(o *op, err error) error {
	if o.kind == procgroup.OpBarrier {
		return fmt.Errorf("gloo: rank %d: barrier #%d: %w", g.rank, o.seq, err)
	}
	return fmt.Errorf("gloo: rank %d: %v #%d (%v, %d bytes): %w", g.rank, o.kind, o.seq, o.dt, len(o.buf), err)
}

// abort fails the group with cause: it is recorded once, peers are told (best effort),
// connections are closed so that blocked reads and writes return. It does not wait for
// goroutines (it may run on one of them).
func (g *group) abort(cause error) {
	g.abortOnce.Do(func() {
		if !errors.Is(cause, procgroup.ErrAborted) {
			cause = fmt.Errorf("%w: %w", procgroup.ErrAborted, cause)
		}
		g.abortErr = cause
		close(g.aborted)
		g.log.Error("gloo: group aborted", zap.Error(cause))
		lost := -1
		var ple *PeerLostError
		if errors.As(cause, &ple) {
			lost = ple.Rank
		}
		deadline := time.Now().Add(300 * time.Millisecond)
		for _, p := range g.peers {
			if p == nil {
				continue
			}
			if p.rank != lost {
				p.sendAbort(lost, cause.Error(), deadline)
			}
			// Note [Shared memory]: a peer of the region also gets the abort where it
			// waits on shared memory, whether or not its frame went out in time and
			// even if it is the rank named lost: a late rank must see it before it
			// touches buffers that this rank's caller may free (Note [Late ranks]).
			g.shmAbort(p.rank, lost, cause.Error())
		}
		g.shmWake()
		g.shutdown()
	})
}

// shutdown closes every listener and connection and tells goroutines to stop.
func (g *group) shutdown() {
	g.stopOnce.Do(func() { close(g.stop) })
	for _, ln := range g.listeners {
		ln.Close()
	}
	g.meshMu.Lock()
	for _, p := range g.peers {
		if p != nil {
			closeConn(p)
		}
	}
	g.meshMu.Unlock()
	g.hsMu.Lock()
	for c := range g.hsConns {
		c.Close()
	}
	g.hsMu.Unlock()
}

// Abort implements procgroup.ProcessGroup.
func (g *group) Abort(cause error) {
	if cause == nil {
		cause = errors.New("Abort called")
	}
	g.abort(fmt.Errorf("rank %d: %w", g.rank, cause))
	g.wg.Wait()
	g.releaseShm()
}

// Close implements procgroup.ProcessGroup: pending works complete first.
func (g *group) Close() error {
	g.qmu.Lock()
	g.closing = true
	g.qmu.Unlock()
	select {
	case g.qwake <- struct{}{}:
	default:
	}
	// The worker exits once the queue is empty (or the group aborted).
	<-g.workerDone
	g.shutdown()
	g.wg.Wait()
	g.releaseShm()
	return nil
}

func hostname() string {
	h, _ := os.Hostname()
	return h
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return b
}

// AllocBuffer hands out count elements of dt that every rank of this host can read
// (procgroup.BufferAllocator, Note [Shared buffers]); nil when the group has no such memory
// (no arena, not Linux, ranks on several hosts that Note [Hierarchical] does not fit), when
// dt is widened for reductions
// (bfloat16, float16), or when the arena is full.
func (g *group) AllocBuffer(dt procgroup.DType, count int) (any, error) {
	if dt.Size() == 0 || count < 0 {
		return nil, fmt.Errorf("%w: gloo: AllocBuffer of %d elements of %v", procgroup.ErrInvalidArgument, count, dt)
	}
	if count == 0 || widened(dt) {
		return nil, nil
	}
	return g.sharedAlloc(dt, count)
}

// Transports reports, for each rank, how this rank exchanges data with it: "self", "shm"
// (shared memory, a Unix socket for control), "unix", or "tcp HOST:PORT" with the peer's
// address (procgroup.TransportReporter).
func (g *group) Transports() []string {
	out := make([]string, g.size)
	for j := range g.size {
		switch {
		case j == g.rank:
			out[j] = "self"
		case g.peers[j] == nil:
			out[j] = "none"
		case g.shm != nil && g.shm.has(j):
			out[j] = "shm"
		default:
			switch c := g.peers[j].conn.(type) {
			case *net.UnixConn:
				out[j] = "unix"
			default:
				out[j] = "tcp " + c.RemoteAddr().String()
			}
		}
	}
	return out
}
