package nccl

/*
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

func init() { procgroup.Register("nccl", New) }

// Group states (Note [Group lifecycle]).
const (
	stateLive = iota
	stateClosing
	stateAborted
)

// Group is the NCCL process group: one communicator on one device, one communication
// stream, and one goroutine (the watchdog) that completes works in order, polls
// ncclCommGetAsyncError and enforces the collective timeout.
//
// Note [Group lifecycle]: live → closing (Close: later works fail with ErrClosed, pending
// ones complete, then the watchdog finalizes and destroys the communicator, releases
// everything and exits) or live/closing → aborted (Abort, a timeout, an NCCL async error,
// a failed enqueue, or a work's ctx ending: the watchdog calls ncclCommAbort, the comm
// stream is drained, every pending work fails, the watchdog releases everything and
// exits). Every wait on the way out is bounded (Note [Bounded teardown]).
//
// Note [No NCCL call under the lock]: an NCCL collective may block in the host call, for
// instance while it connects to its peers at the first one (NCCL_RUNTIME_CONNECT=1), for as
// long as a peer is late or dead. So g.mu, which the watchdog and Abort need, is held only
// to read and update the group's state, never across an NCCL call or a blocking CUDA call
// (PyTorch's ProcessGroupNCCL takes its mutex likewise only to read the communicator).
// Issuing is serialised by g.issueSem instead, held across the NCCL call (collectives must
// reach NCCL, and the comm stream, in sequence order), which neither the watchdog nor Abort
// waits for unboundedly; an issuer waiting for it gives up when the group aborts or its ctx
// ends. A work joins g.pending before its NCCL call, not yet issued: the watchdog enforces
// its timeout and context while the call blocks. The communicator's own calls
// (ncclCommGetAsyncError, ncclCommAbort, ncclCommFinalize, ncclCommDestroy) are made by the
// watchdog alone, so that none of them races the abort that frees the communicator; Abort
// only marks the group aborted and wakes the watchdog, whose ncclCommAbort unblocks an
// issuer stuck inside NCCL. The gate of shim.h (Note [Communicator gate]) tells the
// watchdog whether an issuer is inside its NCCL call, and keeps one that is not from
// entering it once the abort has begun (see finishAbort).
type Group struct {
	rank, size int
	opts       procgroup.Options
	log        *zap.Logger
	host       string
	lib        *lib
	device     int
	cuDev      C.goddp_CUdevice
	cuCtx      C.goddp_CUcontext
	stream     C.goddp_CUstream
	comm       C.goddp_ncclComm_t
	barrierBuf C.goddp_CUdeviceptr // one float32 on the device, the operand of Barrier
	drainEv    C.goddp_CUevent     // recorded on the comm stream to drain it at teardown

	// Bounds of the teardown (Note [Bounded teardown]) and the abort's grace for a call in
	// progress (finishAbort), from the package's defaults.
	finalizeTimeout, drainTimeout, abortGrace time.Duration

	// The watchdog's own: the communicator is gone (destroyed or aborted); Close's result.
	commGone bool
	closeErr error

	issueSem chan struct{} // size 1: serialises issuing, across the NCCL call (Note [No NCCL call under the lock])
	// Out of the Group (which holds Go pointers, so cgo may not be handed pointers into it),
	// allocated once: the call being issued (guarded by issueSem), the watchdog's
	// out-parameter of ncclCommGetAsyncError, and the gate (Note [Communicator gate] in
	// shim.h), only ever accessed atomically, in C.
	cc     *C.goddp_call
	asyncR *C.goddp_ncclResult_t
	gate   *C.int

	// stuck counts the goroutines of the teardown still inside an NCCL call (ncclCommAbort,
	// ncclCommFinalize, ncclCommDestroy) that was given up on (Note [Bounded teardown]).
	stuck sync.WaitGroup

	mu       sync.Mutex // guards the fields below; never held across an NCCL call
	state    int
	abortErr error // set when state becomes stateAborted
	closed   bool  // Close was called: later works fail with ErrClosed even if aborted since
	seq      uint64
	pending  []*Work            // issued, not completed, in issue (= stream) order
	events   []C.goddp_CUevent  // free events
	pool     map[int][]*staging // free staging areas by size class (log2 bytes)
	allEv    []C.goddp_CUevent  // every event created, destroyed at release
	allSt    []*staging         // every staging area, freed at release

	devMu  sync.Mutex   // guards the kernel module (devops.go)
	modUse sync.RWMutex // held (read) across a kernel launch or load; releaseDevice takes it to unload the module
	// devClosed: the teardown has begun (markDeviceClosed), so GemmAsync, PrepareBLAS and
	// kernel launches fail with ErrClosed, whether or not the resources get freed.
	devClosed atomic.Bool
	module    C.goddp_CUmodule
	moduleErr error
	fns       [nKernels]C.goddp_CUfunction

	blasMu  sync.Mutex // guards the cuBLAS handle (blas.go: Note [cuBLAS handle])
	blasLib *C.goddp_blas
	blasH   C.goddp_cublasHandle_t
	blasErr error

	kick     chan struct{} // size 1: a work was issued or the state changed
	stop     chan struct{} // closed when the group is aborted
	loopDone chan struct{} // closed when the watchdog has released everything and exited
}

var _ procgroup.ProcessGroup = (*Group)(nil)

// staging is a pinned host area and a device area of the same size, for host buffers.
type staging struct {
	class int
	host  unsafe.Pointer
	dev   C.goddp_CUdeviceptr
}

// New creates the calling rank's group: it loads the libraries, opens device
// opts.LocalRank, exchanges the ncclUniqueId through opts.Store (rank 0 creates it) and
// creates the communicator. It blocks until every rank has joined or ctx ends (the last
// step, ncclCommInitRank, starts only once every rank has reached it, and cannot be
// interrupted). Errors wrap ErrUnavailable when a library or device is missing.
func New(ctx context.Context, opts procgroup.Options) (procgroup.ProcessGroup, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	cfg := &Config{}
	switch c := opts.Backend.(type) {
	case nil:
	case *Config:
		if c != nil {
			cfg = c
		}
	default:
		return nil, fmt.Errorf("%w: nccl: Options.Backend is %T, want *nccl.Config", procgroup.ErrInvalidArgument, opts.Backend)
	}
	host, _ := os.Hostname()
	g := &Group{
		rank: opts.Rank, size: opts.Size, opts: opts, host: host, device: opts.LocalRank,
		log:  opts.Logger.With(zap.String("backend", "nccl")),
		pool: map[int][]*staging{},
		kick: make(chan struct{}, 1), stop: make(chan struct{}), loopDone: make(chan struct{}),
		finalizeTimeout: defaultFinalizeTimeout, drainTimeout: defaultDrainTimeout, abortGrace: defaultAbortGrace,
		cc: new(C.goddp_call), asyncR: new(C.goddp_ncclResult_t), gate: new(C.int),
		issueSem: make(chan struct{}, 1),
	}
	l, err := loadLib(libPaths(cfg))
	if err != nil {
		return nil, fmt.Errorf("rank %d: %w", g.rank, err)
	}
	g.lib = l
	g.log.Info("nccl loaded", zap.String("nccl_version", versionString(l.ncclVersion)),
		zap.Int("cuda_driver_version", l.cudaDriverVersion), zap.String("nccl_lib", l.ncclPath),
		zap.String("cuda_lib", l.cudaPath))
	if err := g.openDevice(); err != nil {
		g.releaseDevice(time.Now().Add(g.drainTimeout)) // nothing to wait for yet
		return nil, fmt.Errorf("nccl: rank %d: %w", g.rank, err)
	}
	if err := g.initComm(ctx); err != nil {
		g.releaseDevice(time.Now().Add(g.drainTimeout)) // nothing to wait for yet
		return nil, fmt.Errorf("nccl: rank %d: %w", g.rank, err)
	}
	g.log.Info("nccl communicator ready", zap.Int("rank", g.rank), zap.Int("size", g.size), zap.Int("device", g.device))
	go g.watchdog()
	return g, nil
}

// onDevice runs f with the group's context current on a locked OS thread, and then makes
// the thread's own context current again (Note [Caller's context] in shim.c): f calls the
// trampolines, which do not switch contexts themselves. Single calls go through the C
// helpers instead, which switch and restore within the one cgo call.
func (g *Group) onDevice(f func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var prev C.goddp_CUcontext
	if r := C.goddp_ctx_enter(g.lib.p, g.cuCtx, &prev); r != 0 {
		return g.lib.cuErr("cuCtxSetCurrent", r)
	}
	err := f()
	if r := C.goddp_ctx_leave(g.lib.p, prev); r != 0 && err == nil {
		err = g.lib.cuErr("cuCtxSetCurrent (the caller's context)", r)
	}
	return err
}

func (g *Group) openDevice() error {
	l := g.lib
	return g.onDevice(func() error {
		if r := C.goddp_cuInit(l.p); r != 0 {
			if r == 100 { // CUDA_ERROR_NO_DEVICE
				return fmt.Errorf("%w: no CUDA device (cuInit: %s); the nccl backend needs one GPU per rank",
					ErrUnavailable, C.GoString(C.goddp_cu_error(l.p, r)))
			}
			return fmt.Errorf("%w: %w", ErrUnavailable, l.cuErr("cuInit", r))
		}
		var n C.int
		if r := C.goddp_cuDeviceGetCount(l.p, &n); r != 0 {
			return fmt.Errorf("%w: %w", ErrUnavailable, l.cuErr("cuDeviceGetCount", r))
		}
		if n == 0 {
			return fmt.Errorf("%w: no CUDA device (cuDeviceGetCount = 0); the nccl backend needs one GPU per rank (check CUDA_VISIBLE_DEVICES)", ErrUnavailable)
		}
		if g.device >= int(n) {
			return fmt.Errorf("%w: local rank %d needs device %d but only %d CUDA devices are visible (one GPU per rank)",
				ErrUnavailable, g.device, g.device, int(n))
		}
		if r := C.goddp_cuDeviceGet(l.p, &g.cuDev, C.int(g.device)); r != 0 {
			return l.cuErr("cuDeviceGet", r)
		}
		var ctx C.goddp_CUcontext
		if r := C.goddp_cuDevicePrimaryCtxRetain(l.p, &ctx, g.cuDev); r != 0 {
			return l.cuErr("cuDevicePrimaryCtxRetain", r)
		}
		g.cuCtx = ctx
		if r := C.goddp_cuCtxSetCurrent(l.p, ctx); r != 0 {
			return l.cuErr("cuCtxSetCurrent", r)
		}
		if r := C.goddp_cuStreamCreate(l.p, &g.stream, C.GODDP_CU_STREAM_NON_BLOCKING); r != 0 {
			return l.cuErr("cuStreamCreate", r)
		}
		if r := C.goddp_cuMemAlloc(l.p, &g.barrierBuf, 4); r != 0 {
			return l.cuErr("cuMemAlloc", r)
		}
		if r := C.goddp_cuEventCreate(l.p, &g.drainEv); r != 0 {
			return l.cuErr("cuEventCreate", r)
		}
		var name [256]C.char
		if C.goddp_cuDeviceGetName(l.p, &name[0], C.int(len(name)), g.cuDev) == 0 {
			g.log.Info("nccl device", zap.Int("device", g.device), zap.String("name", C.GoString(&name[0])))
		}
		return nil
	})
}

// markDeviceClosed begins the teardown of the device operations (the watchdog, before it
// finalizes or aborts the communicator): from then on they fail, even where the resources
// under them are left allocated (Note [Bounded teardown]).
func (g *Group) markDeviceClosed() { g.devClosed.Store(true) }

// closedErr is the error of a device operation after markDeviceClosed.
func (g *Group) closedErr() error {
	return fmt.Errorf("nccl: rank %d: %w", g.rank, procgroup.ErrClosed)
}

// releaseGrace is the least time releaseDevice gets, whatever is left of the deadline the
// drain before it shared: freeing takes microseconds where nothing is stuck, and a
// deadline already spent would report a timeout where there was none.
const releaseGrace = 100 * time.Millisecond

// releaseDevice frees what openDevice created, once the comm stream has drained (or was
// never used). The handles stay in their fields (dangling): every user checks g.state under
// g.mu first. It returns "" once it has, or what did not return by deadline (cublasDestroy,
// or a kernel launch in progress); the device resources are then left allocated, as Note
// [Bounded teardown] leaves them under any call that may still use them.
func (g *Group) releaseDevice(deadline time.Time) string {
	if g.cuCtx == nil {
		return ""
	}
	g.markDeviceClosed()
	if least := time.Now().Add(releaseGrace); deadline.Before(least) {
		deadline = least
	}
	if why := g.releaseBLAS(deadline); why != "" {
		return why
	}
	if !lockBy(&g.modUse, deadline) {
		return "a kernel launch did not return"
	}
	defer g.modUse.Unlock()
	g.mu.Lock()
	allEv, allSt := g.allEv, g.allSt
	g.allEv, g.events, g.allSt, g.pool = nil, nil, nil, nil
	g.mu.Unlock()
	_ = g.onDevice(func() error {
		l := g.lib.p
		for _, ev := range allEv {
			C.goddp_cuEventDestroy(l, ev)
		}
		for _, s := range allSt {
			C.goddp_cuMemFreeHost(l, s.host)
			C.goddp_cuMemFree(l, s.dev)
		}
		if g.drainEv != nil {
			C.goddp_cuEventDestroy(l, g.drainEv)
		}
		if g.barrierBuf != 0 {
			C.goddp_cuMemFree(l, g.barrierBuf)
		}
		g.devMu.Lock()
		if g.module != nil {
			C.goddp_module_unload(l, g.cuCtx, g.module)
		}
		g.module, g.moduleErr = nil, g.closedErr()
		g.devMu.Unlock()
		if g.stream != nil {
			C.goddp_cuStreamDestroy(l, g.stream)
		}
		C.goddp_cuDevicePrimaryCtxRelease(l, g.cuDev)
		return nil
	})
	return ""
}

// initComm exchanges the unique id through the store and creates the communicator.
func (g *Group) initComm(ctx context.Context) error {
	st := g.opts.Store
	key := func(k string) string { return g.opts.Prefix + "/nccl/" + k }
	var id [C.GODDP_NCCL_UNIQUE_ID_BYTES]byte
	if g.rank == 0 {
		if r := C.goddp_get_unique_id(g.lib.p, unsafe.Pointer(&id[0])); r != 0 {
			return g.lib.ncclErr("ncclGetUniqueId", r)
		}
		if err := st.Set(ctx, key("uid"), id[:]); err != nil {
			return fmt.Errorf("publishing the ncclUniqueId: %w", err)
		}
	} else {
		v, err := st.Get(ctx, key("uid"))
		if err != nil {
			return fmt.Errorf("waiting for rank 0's ncclUniqueId: %w", err)
		}
		if len(v) != len(id) {
			return fmt.Errorf("ncclUniqueId from the store has %d bytes, want %d", len(v), len(id))
		}
		copy(id[:], v)
	}
	// Every rank reaches ncclCommInitRank before any calls it: the call itself blocks until
	// all have joined and cannot be interrupted, so a rank that never comes must be caught
	// here, where ctx still counts.
	n, err := st.Add(ctx, key("joined"), 1)
	if err != nil {
		return fmt.Errorf("joining: %w", err)
	}
	if n == int64(g.size) {
		if err := st.Set(ctx, key("ready"), []byte("1")); err != nil {
			return fmt.Errorf("joining: %w", err)
		}
	}
	if err := st.Wait(ctx, key("ready")); err != nil {
		return fmt.Errorf("waiting for %d ranks to join: %w", g.size, err)
	}
	cid := C.malloc(C.size_t(len(id)))
	defer C.free(cid)
	copy(unsafe.Slice((*byte)(cid), len(id)), id[:])
	if r := C.goddp_comm_init(g.lib.p, g.cuCtx, &g.comm, C.int(g.size), cid, C.int(g.rank)); r != 0 {
		g.comm = nil
		return g.lib.ncclErr("ncclCommInitRank", r)
	}
	return nil
}

// Rank implements procgroup.ProcessGroup.
func (g *Group) Rank() int { return g.rank }

// Size implements procgroup.ProcessGroup.
func (g *Group) Size() int { return g.size }

// Device is the CUDA device ordinal of this rank.
func (g *Group) Device() int { return g.device }

// NCCLVersion is the loaded NCCL's version, for instance "2.21.5".
func (g *Group) NCCLVersion() string { return versionString(g.lib.ncclVersion) }

// Work is the handle of one collective of the nccl backend. Its Wait, Done and Err are
// host-visible: complete means the collective's end event has completed on the GPU and,
// for host buffers, the result has been copied into the caller's slice. WaitStream is the
// stream-ordered alternative for device buffers. The collective's buffers stay referenced
// (host ones by the Work, device ones must stay allocated) until the Work completes. All
// methods are safe for concurrent use.
type Work struct {
	*procgroup.Future
	g        *Group
	op       procgroup.CollectiveOp
	seq      uint64
	ctx      context.Context
	deadline time.Time
	startEv  C.goddp_CUevent // recorded on the input's stream (device buffers)
	outEv    C.goddp_CUevent // recorded on the output's stream, where it is another
	endEv    C.goddp_CUevent
	st       *staging
	out      any // host slice the result is copied into, or nil
	outOff   int // byte offset of the result in the staging area
	outBytes int
	keep     any // the input buffer, referenced until completion

	mu       sync.Mutex // guards released
	released bool       // the events went back to the pool; WaitStream must not use them

	issued bool // its NCCL call has returned (guarded by g.mu)
}

var _ procgroup.Work = (*Work)(nil)

// WaitStream makes stream s wait, on the GPU, for the collective to finish (no host
// blocking): work queued on s afterwards sees the result. For a host buffer it blocks
// like Wait, since the result reaches the slice only through the host. It returns the
// work's error if it has already failed.
func (w *Work) WaitStream(s Stream) error {
	if w.out != nil {
		return w.Wait(context.Background())
	}
	if err := checkStream(s); err != nil {
		return fmt.Errorf("nccl: rank %d: %s #%d: WaitStream: %w", w.g.rank, w.op, w.seq, err)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.released {
		return w.Err() // completed: nothing to wait for on the GPU
	}
	if r := C.goddp_stream_wait(w.g.lib.p, w.g.cuCtx, C.uintptr_t(s), w.endEv); r != 0 {
		return fmt.Errorf("nccl: rank %d: %s #%d: %w", w.g.rank, w.op, w.seq, w.g.lib.cuErr("cuStreamWaitEvent", r))
	}
	return nil
}

func (g *Group) failed(op procgroup.CollectiveOp, err error) *Work {
	return &Work{Future: procgroup.Completed(fmt.Errorf("nccl: rank %d: %s: %w", g.rank, op, err)), g: g, op: op, released: true}
}

// call describes one collective before it is issued.
type call struct {
	op        procgroup.CollectiveOp
	kind      C.int
	dt        procgroup.DType
	redop     int
	root      int
	count     int // NCCL's count argument
	dev       bool
	stream    Stream              // compute stream (device buffers): the input's
	outStream Stream              // the output's stream, waited for too where it differs
	send      C.goddp_CUdeviceptr // device buffers
	recv      C.goddp_CUdeviceptr
	hostIn    any // host input slice, copied into the staging area at inOff
	inOff     int
	inBytes   int
	hostOut   any // host output slice, filled from the staging area at outOff
	outOff    int
	outBytes  int
	size      int // staging bytes
	sendOff   int // offsets of send and recv in the staging area
	recvOff   int
	keep      any
	barrier   bool // send and recv are g.barrierBuf
}

// AllReduce implements procgroup.ProcessGroup. buf is a host slice or a DeviceBuffer.
func (g *Group) AllReduce(ctx context.Context, buf any, op procgroup.ReduceOp) procgroup.Work {
	b, err := classify(buf)
	if err != nil {
		return g.failed(procgroup.OpAllReduce, err)
	}
	c := &call{op: procgroup.OpAllReduce, kind: C.GODDP_ALLREDUCE, dt: b.dt, count: b.n}
	if c.redop, err = g.reduceOp(op); err != nil {
		return g.failed(procgroup.OpAllReduce, err)
	}
	bytes := b.n * b.dt.Size()
	if b.host == nil {
		c.dev, c.stream, c.send, c.recv = true, b.dev.Stream, dptr(b.dev), dptr(b.dev)
	} else {
		c.hostIn, c.inBytes, c.hostOut, c.outBytes, c.size = b.host, bytes, b.host, bytes, bytes
	}
	return g.issue(ctx, c)
}

// Broadcast implements procgroup.ProcessGroup.
func (g *Group) Broadcast(ctx context.Context, buf any, root int) procgroup.Work {
	b, err := classify(buf)
	if err != nil {
		return g.failed(procgroup.OpBroadcast, err)
	}
	if root < 0 || root >= g.size {
		return g.failed(procgroup.OpBroadcast, fmt.Errorf("%w: root %d outside [0, %d)", procgroup.ErrInvalidArgument, root, g.size))
	}
	c := &call{op: procgroup.OpBroadcast, kind: C.GODDP_BROADCAST, dt: b.dt, count: b.n, root: root}
	bytes := b.n * b.dt.Size()
	if b.host == nil {
		c.dev, c.stream, c.send, c.recv = true, b.dev.Stream, dptr(b.dev), dptr(b.dev)
	} else {
		c.hostOut, c.outBytes, c.size = b.host, bytes, bytes
		if g.rank == root {
			c.hostIn, c.inBytes = b.host, bytes
		}
	}
	return g.issue(ctx, c)
}

// AllGather implements procgroup.ProcessGroup. out and in are both host slices or both
// DeviceBuffers.
func (g *Group) AllGather(ctx context.Context, out, in any) procgroup.Work {
	bo, bi, err := g.pair(out, in, 1, g.size)
	if err == nil {
		err = g.slot(bo, bi)
	}
	if err != nil {
		return g.failed(procgroup.OpAllGather, err)
	}
	c := &call{op: procgroup.OpAllGather, kind: C.GODDP_ALLGATHER, dt: bi.dt, count: bi.n}
	es := bi.dt.Size()
	if bi.host == nil {
		c.dev, c.stream, c.send, c.recv = true, bi.dev.Stream, dptr(bi.dev), dptr(bo.dev)
		c.outStream = bo.dev.Stream
	} else {
		// In place in the staging area: rank r's input sits at its block of the output.
		c.size = bo.n * es
		c.hostIn, c.inOff, c.inBytes = bi.host, g.rank*bi.n*es, bi.n*es
		c.sendOff = c.inOff
		c.hostOut, c.outBytes = bo.host, c.size
		c.keep = in
	}
	return g.issue(ctx, c)
}

// ReduceScatter implements procgroup.ProcessGroup. out and in are both host slices or both
// DeviceBuffers.
func (g *Group) ReduceScatter(ctx context.Context, out, in any, op procgroup.ReduceOp) procgroup.Work {
	bo, bi, err := g.pair(out, in, g.size, 1)
	if err == nil {
		err = g.slot(bi, bo)
	}
	if err != nil {
		return g.failed(procgroup.OpReduceScatter, err)
	}
	c := &call{op: procgroup.OpReduceScatter, kind: C.GODDP_REDUCESCATTER, dt: bi.dt, count: bo.n}
	if c.redop, err = g.reduceOp(op); err != nil {
		return g.failed(procgroup.OpReduceScatter, err)
	}
	es := bi.dt.Size()
	if bi.host == nil {
		c.dev, c.stream, c.send, c.recv = true, bi.dev.Stream, dptr(bi.dev), dptr(bo.dev)
		c.outStream = bo.dev.Stream
	} else {
		// In place in the staging area: rank r's result is its block of the input.
		c.size = bi.n * es
		c.hostIn, c.inBytes = bi.host, c.size
		c.recvOff = g.rank * bo.n * es
		c.hostOut, c.outOff, c.outBytes = bo.host, c.recvOff, bo.n*es
		c.keep = in
	}
	return g.issue(ctx, c)
}

// Barrier implements procgroup.ProcessGroup: a one-element all-reduce on the device.
func (g *Group) Barrier(ctx context.Context) procgroup.Work {
	c := &call{op: procgroup.OpBarrier, kind: C.GODDP_ALLREDUCE, dt: procgroup.Float32, count: 1, dev: true, barrier: true}
	return g.issue(ctx, c)
}

// pair checks out and in of AllGather (outMul=1, inMul=size: len(out) = size·len(in)) or
// ReduceScatter (len(in) = size·len(out)).
func (g *Group) pair(out, in any, inMul, outMul int) (bo, bi buffer, err error) {
	if bo, err = classify(out); err != nil {
		return bo, bi, fmt.Errorf("out: %w", err)
	}
	if bi, err = classify(in); err != nil {
		return bo, bi, fmt.Errorf("in: %w", err)
	}
	switch {
	case bo.dt != bi.dt:
		return bo, bi, fmt.Errorf("%w: out is %v, in is %v", procgroup.ErrInvalidArgument, bo.dt, bi.dt)
	case (bo.host == nil) != (bi.host == nil):
		return bo, bi, fmt.Errorf("%w: out and in must both be host slices or both DeviceBuffers", procgroup.ErrInvalidArgument)
	case bo.n*inMul != bi.n*outMul:
		return bo, bi, fmt.Errorf("%w: len(out) = %d, len(in) = %d, world size %d", procgroup.ErrInvalidArgument, bo.n, bi.n, g.size)
	}
	return bo, bi, nil
}

// slot refuses buffers that overlap other than in the in-place layout (procgroup.CheckSlot):
// NCCL leaves that case undefined. whole is the large buffer of the two.
func (g *Group) slot(whole, part buffer) error {
	if whole.host != nil {
		return kernels.CheckSlot(rawBytes(whole.host), rawBytes(part.host), g.rank)
	}
	return procgroup.CheckSlot(uintptr(whole.dev.Ptr), whole.dev.Bytes(), uintptr(part.dev.Ptr), part.dev.Bytes(), g.rank)
}

func (g *Group) reduceOp(op procgroup.ReduceOp) (int, error) {
	r := ncclOp(op)
	if r < 0 {
		return 0, fmt.Errorf("%w: reduce op %v", procgroup.ErrInvalidArgument, op)
	}
	if op == procgroup.Avg && !atLeast(g.lib.ncclVersion, 2, 10) {
		return 0, fmt.Errorf("%w: avg needs NCCL 2.10 or later (ncclAvg), have %s", procgroup.ErrInvalidArgument, versionString(g.lib.ncclVersion))
	}
	return r, nil
}

func dptr(b DeviceBuffer) C.goddp_CUdeviceptr { return C.goddp_CUdeviceptr(b.Ptr) }

// rawBytes is the memory of a host slice.
func rawBytes(buf any) []byte {
	switch b := buf.(type) {
	case []float32:
		return asBytes(b)
	case []float64:
		return asBytes(b)
	case []int32:
		return asBytes(b)
	case []int64:
		return asBytes(b)
	case []procgroup.BF16:
		return asBytes(b)
	case []procgroup.F16:
		return asBytes(b)
	}
	panic(fmt.Sprintf("nccl: rawBytes of %T", buf))
}

func asBytes[T any](s []T) []byte {
	if len(s) == 0 {
		return nil
	}
	var z T
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), len(s)*int(unsafe.Sizeof(z)))
}

// issue queues c on the comm stream. Called with nothing locked; the NCCL call is made
// under g.issueSem alone (Note [No NCCL call under the lock]).
func (g *Group) issue(ctx context.Context, c *call) procgroup.Work {
	if ctx == nil {
		ctx = context.Background()
	}
	if ncclType(c.dt) < 0 {
		return g.failed(c.op, fmt.Errorf("%w: dtype %v", procgroup.ErrInvalidArgument, c.dt))
	}
	if c.dt == procgroup.BFloat16 && !atLeast(g.lib.ncclVersion, 2, 10) {
		return g.failed(c.op, fmt.Errorf("%w: bfloat16 needs NCCL 2.10 or later, have %s", procgroup.ErrInvalidArgument, versionString(g.lib.ncclVersion)))
	}
	if err := g.lockIssue(ctx, c.op); err != nil {
		return g.failed(c.op, err)
	}
	g.mu.Lock()
	var err error
	switch {
	case g.closed, g.state == stateClosing:
		err = procgroup.ErrClosed
	case g.state == stateAborted:
		err = g.abortErr
	}
	if err != nil {
		g.mu.Unlock()
		g.unlockIssue()
		return g.failed(c.op, err)
	}
	g.seq++
	w := &Work{Future: procgroup.NewFuture(), g: g, op: c.op, seq: g.seq, ctx: ctx,
		deadline: time.Now().Add(g.opts.Timeout), keep: c.keep}
	cc := g.cc
	err = g.prepareLocked(w, c, cc)
	g.pending = append(g.pending, w) // pending, not yet issued: its timeout counts from now
	g.mu.Unlock()
	g.kickLoop()
	if err == nil {
		if c.inBytes > 0 {
			copy(unsafe.Slice((*byte)(unsafe.Add(w.st.host, c.inOff)), c.inBytes), rawBytes(c.hostIn))
		}
		err = g.enqueue(cc, c)
	}
	if err == nil {
		g.mu.Lock()
		w.issued = true // not on failure: its end event, never recorded, would read as complete
		g.mu.Unlock()
	}
	g.unlockIssue()
	switch {
	case err == errGateClosed:
		// The watchdog is aborting the group; it fails the work, pending since before.
	case err != nil:
		g.abort(fmt.Errorf("nccl: rank %d (%s): %s #%d: %w", g.rank, g.host, c.op, w.seq, err), false)
	default:
		g.kickLoop() // a watchdog waiting for this work's call to return polls it at once
	}
	return w
}

// lockIssue takes g.issueSem. While another issuer holds it (one stuck in NCCL, perhaps,
// or a healthy one copying a large host buffer), it gives up when the group aborts,
// failing with the abort's error, or when ctx ends, which aborts the group: this rank's
// collectives would no longer match its peers' (see the package doc on a collective's ctx).
func (g *Group) lockIssue(ctx context.Context, op procgroup.CollectiveOp) error {
	select {
	case g.issueSem <- struct{}{}:
		return nil
	default:
	}
	select {
	case g.issueSem <- struct{}{}:
		return nil
	case <-g.stop:
		g.mu.Lock()
		defer g.mu.Unlock()
		return g.abortErr
	case <-ctx.Done():
		const what = "waiting for the collective before it to be issued"
		g.abort(fmt.Errorf("nccl: rank %d (%s): %s: %s: %w", g.rank, g.host, op, what, ctx.Err()), true)
		return fmt.Errorf("%w: %s: %w", procgroup.ErrAborted, what, ctx.Err())
	}
}

// unlockIssue releases g.issueSem.
func (g *Group) unlockIssue() { <-g.issueSem }

// errGateClosed: the issuer found the gate closed and made no NCCL call (Note
// [Communicator gate] in shim.h).
var errGateClosed = errors.New("nccl: the communicator is being aborted")

// prepareLocked acquires the work's events and staging and fills in its goddp_call. g.mu
// is held (the driver calls here, on a pool miss, do not block).
func (g *Group) prepareLocked(w *Work, c *call, cc *C.goddp_call) error {
	var err error
	if w.endEv, err = g.eventLocked(); err != nil {
		return err
	}
	if c.barrier {
		c.send, c.recv = g.barrierBuf, g.barrierBuf
	}
	*cc = C.goddp_call{
		ctx: g.cuCtx, comm: g.comm, comm_stream: g.stream, end_event: w.endEv, kind: c.kind,
		send: c.send, recv: c.recv, count: C.size_t(c.count),
		dtype: C.int(ncclType(c.dt)), op: C.int(c.redop), root: C.int(c.root),
	}
	switch {
	case c.dev:
		if w.startEv, err = g.eventLocked(); err != nil {
			return err
		}
		cc.wait_compute, cc.compute_stream, cc.start_event = 1, C.uintptr_t(c.stream), w.startEv
		if c.outStream != c.stream {
			if w.outEv, err = g.eventLocked(); err != nil {
				return err
			}
			cc.wait_out, cc.out_stream, cc.out_event = 1, C.uintptr_t(c.outStream), w.outEv
		}
	case c.size > 0:
		if w.st, err = g.stagingLocked(c.size); err != nil {
			return err
		}
		cc.host, cc.dev = w.st.host, w.st.dev
		cc.send, cc.recv = w.st.dev+C.goddp_CUdeviceptr(c.sendOff), w.st.dev+C.goddp_CUdeviceptr(c.recvOff)
		cc.h2d_off, cc.h2d_bytes = C.size_t(c.inOff), C.size_t(c.inBytes)
		cc.d2h_off, cc.d2h_bytes = C.size_t(c.outOff), C.size_t(c.outBytes)
		w.out, w.outOff, w.outBytes = c.hostOut, c.outOff, c.outBytes
	default:
		w.out = c.hostOut // zero elements: nothing to copy, but still host-completed
	}
	return nil
}

// enqueue makes the one cgo call that queues the collective: it may block inside NCCL.
// g.issueSem is held, g.mu is not.
func (g *Group) enqueue(cc *C.goddp_call, c *call) error {
	r := C.goddp_issue(g.lib.p, cc, g.gate)
	switch {
	case r == 0:
		return nil
	case r == C.GODDP_ISSUE_GATE_CLOSED:
		return errGateClosed
	case cc.wrong != 0:
		what := [...]string{C.GODDP_WRONG_COMPUTE_STREAM: fmt.Sprintf("the input's stream %#x", uintptr(c.stream)),
			C.GODDP_WRONG_OUT_STREAM: fmt.Sprintf("the output's stream %#x", uintptr(c.outStream)),
			C.GODDP_WRONG_SEND:       fmt.Sprintf("the input's memory at %#x", uint64(c.send)),
			C.GODDP_WRONG_RECV:       fmt.Sprintf("the output's memory at %#x", uint64(c.recv))}[cc.wrong]
		return fmt.Errorf("%w: %s belongs to CUDA context %p, not to the primary context %p of device %d, the one the nccl backend uses: "+
			"a context of its own (gorgonia/cu's NewContext, cuCtxCreate) or of another device cannot be used; "+
			"allocate and create streams in the device's primary context (cu.Device.RetainPrimaryCtx, or Group.Alloc and Group.NewStream)",
			procgroup.ErrInvalidArgument, what, unsafe.Pointer(cc.wrong_ctx), unsafe.Pointer(g.cuCtx), g.device)
	}
	step := C.GoString(cc.failed_step)
	if cc.failed_nccl != 0 {
		return g.lib.ncclErr(step, C.goddp_ncclResult_t(r))
	}
	return g.lib.cuErr(step, C.goddp_CUresult(r))
}

func (g *Group) eventLocked() (C.goddp_CUevent, error) {
	if n := len(g.events); n > 0 {
		ev := g.events[n-1]
		g.events = g.events[:n-1]
		return ev, nil
	}
	var ev C.goddp_CUevent
	if r := C.goddp_event_create(g.lib.p, g.cuCtx, &ev); r != 0 {
		return nil, g.lib.cuErr("cuEventCreate", r)
	}
	g.allEv = append(g.allEv, ev)
	return ev, nil
}

// stagingLocked returns a free staging area of at least size bytes (sizes are rounded up
// to a power of two, at least 4 KiB, so areas are reused across buckets of similar size).
func (g *Group) stagingLocked(size int) (*staging, error) {
	class := max(12, bits.Len(uint(size-1)))
	if free := g.pool[class]; len(free) > 0 {
		s := free[len(free)-1]
		g.pool[class] = free[:len(free)-1]
		return s, nil
	}
	s := &staging{class: class}
	n := C.size_t(1) << class
	if r := C.goddp_staging_alloc(g.lib.p, g.cuCtx, &s.host, &s.dev, n); r != 0 {
		return nil, g.lib.cuErr("cuMemHostAlloc and cuMemAlloc("+strconv.Itoa(int(n))+")", r)
	}
	g.allSt = append(g.allSt, s)
	return s, nil
}

// recycleLocked returns w's events and staging to the pools. g.mu is held.
func (g *Group) recycleLocked(w *Work) {
	w.mu.Lock()
	w.released = true
	w.mu.Unlock()
	if w.endEv != nil {
		g.events = append(g.events, w.endEv)
	}
	if w.startEv != nil {
		g.events = append(g.events, w.startEv)
	}
	if w.outEv != nil {
		g.events = append(g.events, w.outEv)
	}
	if w.st != nil && g.pool != nil {
		g.pool[w.st.class] = append(g.pool[w.st.class], w.st)
	}
	w.st, w.keep = nil, nil
}

func (g *Group) kickLoop() {
	select {
	case g.kick <- struct{}{}:
	default:
	}
}

// Close implements procgroup.ProcessGroup: it waits for the works already issued (a work
// that cannot complete ends with the timeout, an NCCL error or a peer's abort), finalizes
// and destroys the communicator and frees the group's device resources. Finalizing waits
// for the peers; past a deadline the communicator is aborted instead, and Close returns an
// error wrapping procgroup.ErrTimeout (Note [Bounded teardown]).
func (g *Group) Close() error {
	g.mu.Lock()
	g.closed = true
	if g.state == stateLive {
		g.state = stateClosing
	}
	g.mu.Unlock()
	g.kickLoop()
	<-g.loopDone
	return g.closeErr
}

// Abort implements procgroup.ProcessGroup: ncclCommAbort, then every pending work fails
// with an error wrapping procgroup.ErrAborted and cause. It returns once the comm stream
// has drained and the group's resources are freed, or the bound of Note [Bounded
// teardown] has passed. It takes no lock that an NCCL call holds: a collective blocked
// inside NCCL does not hold it up (Note [No NCCL call under the lock]).
func (g *Group) Abort(cause error) {
	err := fmt.Errorf("nccl: rank %d (%s): %w", g.rank, g.host, procgroup.ErrAborted)
	if cause != nil {
		err = fmt.Errorf("%w: %w", procgroup.ErrAborted, cause)
	}
	g.abort(err, false)
}

// abort moves the group to stateAborted with err (which wraps procgroup.ErrAborted, or
// is wrapped so that it does) and wakes the watchdog, which aborts the communicator.
// Unless called from the watchdog (internal), it waits for the watchdog to fail the
// pending works and exit.
func (g *Group) abort(err error, internal bool) {
	if !errors.Is(err, procgroup.ErrAborted) {
		err = fmt.Errorf("%w: %w", procgroup.ErrAborted, err)
	}
	g.mu.Lock()
	if g.state != stateAborted {
		g.state = stateAborted
		g.abortErr = err
		close(g.stop)
		g.log.Warn("nccl group aborted", zap.Int("rank", g.rank), zap.Error(err))
	}
	g.mu.Unlock()
	if !internal {
		<-g.loopDone
	}
}
