package procgroup

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
)

// Sentinel errors. Backends wrap them with %w and context (rank, op, sequence number).
var (
	// ErrClosed: the group was closed with Close; works pending at that moment fail with it.
	ErrClosed = errors.New("procgroup: closed")
	// ErrAborted: the group was aborted (by Abort, a dead peer, a timeout or a failed
	// collective); every pending and later work fails with an error that wraps it.
	ErrAborted = errors.New("procgroup: aborted")
	// ErrInvalidArgument: a buffer of the wrong type or length, an unknown op, a bad root.
	ErrInvalidArgument = errors.New("procgroup: invalid argument")
	// ErrPeerLost: a peer closed its connection or stopped answering.
	ErrPeerLost = errors.New("procgroup: peer lost")
	// ErrTimeout: a collective did not complete within the group's timeout.
	ErrTimeout = errors.New("procgroup: collective timed out")
)

// ProcessGroup is a set of ranks that run collectives together.
//
// Every collective is asynchronous: it validates its arguments, queues the operation and
// returns a Work at once. Works run in the order they were issued, and every rank must issue
// the same collectives, with the same element types and counts, in the same order (Note
// [Collective order]). Until its Work completes, a collective owns its buffers: the caller
// must neither read nor write them. Methods are safe for concurrent use, but collectives
// issued concurrently from several goroutines have no defined order between them, so a caller
// that needs the same order on every rank issues them from one goroutine.
//
// The ctx of a collective bounds it: if ctx ends before the collective completes, the Work
// fails with ctx's error and the group is aborted, since its peers are mid-protocol.
type ProcessGroup interface {
	// Rank is this process's index in [0, Size).
	Rank() int
	// Size is the number of ranks (the world size).
	Size() int
	// AllReduce reduces buf element-wise across all ranks, in place, with op.
	AllReduce(ctx context.Context, buf any, op ReduceOp) Work
	// Broadcast copies root's buf into buf on every other rank.
	Broadcast(ctx context.Context, buf any, root int) Work
	// AllGather concatenates every rank's in, in rank order, into out on every rank;
	// len(out) must be Size()*len(in), and in and out have the same element type. It
	// runs in place where in is rank r's own slot of out (out[r*len(in):(r+1)*len(in)]),
	// as NCCL's does; any other overlap of in and out fails with ErrInvalidArgument.
	AllGather(ctx context.Context, out, in any) Work
	// ReduceScatter reduces in element-wise across ranks and leaves the r-th block of
	// len(out) elements of the result in rank r's out; len(in) must be Size()*len(out).
	// It runs in place where out is rank r's own block of in, which then holds the
	// result, as NCCL's does; any other overlap fails with ErrInvalidArgument.
	ReduceScatter(ctx context.Context, out, in any, op ReduceOp) Work
	// Barrier completes once every rank has entered it.
	Barrier(ctx context.Context) Work
	// Close waits for the works already issued to complete, then releases the group's
	// connections and goroutines. Works issued after Close fail with ErrClosed.
	// It is idempotent.
	Close() error
	// Abort fails every pending and later work with an error wrapping ErrAborted (and
	// cause, when not nil) and releases the group's resources without waiting for peers.
	// It is idempotent and safe to call from any goroutine.
	Abort(cause error)
}

// Work is the handle of one asynchronous collective.
//
// A Work completes exactly once, with a nil error or not. For host buffers, "complete" means
// the result is in the caller's buffer and visible to the caller's goroutine once Wait returns
// nil or Done is closed. (A GPU backend documents its own, stream-ordered meaning.) All methods
// are safe for concurrent use.
type Work interface {
	// Wait blocks until the work completes or ctx ends. It returns the work's error, or
	// ctx's error if ctx ended first (the work itself goes on).
	Wait(ctx context.Context) error
	// Done is closed when the work completes.
	Done() <-chan struct{}
	// Err is the work's error once it has completed, and nil before.
	Err() error
}

// Future is the ready-made Work every backend uses: a fire-once event with an error.
type Future struct {
	once sync.Once
	done chan struct{}
	err  error     // written once, before done is closed
	at   time.Time // when it completed, written with err
}

// NewFuture returns a pending Future.
func NewFuture() *Future { return &Future{done: make(chan struct{})} }

// Completed returns a Future that has already completed with err.
func Completed(err error) *Future {
	f := NewFuture()
	f.Complete(err)
	return f
}

// Complete completes f with err; only the first call counts. It reports whether this call
// completed f.
func (f *Future) Complete(err error) bool {
	fired := false
	f.once.Do(func() {
		f.err = err
		f.at = time.Now()
		close(f.done)
		fired = true
	})
	return fired
}

// Wait implements Work.
func (f *Future) Wait(ctx context.Context) error {
	select {
	case <-f.done:
		return f.err
	default:
	}
	select {
	case <-f.done:
		return f.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Done implements Work.
func (f *Future) Done() <-chan struct{} { return f.done }

// Err implements Work.
func (f *Future) Err() error {
	select {
	case <-f.done:
		return f.err
	default:
		return nil
	}
}

var _ Work = (*Future)(nil)

// Options configure a new group. Rank, Size and Store are required.
type Options struct {
	Rank int
	Size int
	// LocalRank and LocalSize place the rank on its host (LOCAL_RANK, LOCAL_WORLD_SIZE).
	LocalRank int
	LocalSize int
	// Store is the rendezvous store the ranks use to find each other. The group uses keys
	// under its own prefix; several groups may share a store if each has its own Prefix.
	Store Store
	// Prefix namespaces this group's keys in the store (for instance per restart).
	Prefix string
	// Token is the job's secret: data-plane connections authenticate with it.
	Token string
	// Timeout bounds each collective (default 30 minutes, like PyTorch); a collective
	// that takes longer fails and aborts the group.
	Timeout time.Duration
	// Logger receives the group's log lines; nil means zap.NewNop().
	Logger *zap.Logger
	// Backend holds backend-specific options (for instance *gloo.Config); nil means the
	// backend's defaults.
	Backend any
	// TLS, when set, secures the data plane's connections between hosts (gloo's TCP
	// transport; a backend-specific setting such as gloo.Config.TLS takes precedence). It
	// serves both roles, as TLSFiles.PeerConfig builds it; nil means plain connections,
	// still authenticated with Token.
	TLS *tls.Config
	// StoreAddr is the rendezvous store's "host:port" as this rank dialed it, when known. A
	// backend that picks its own listen address takes the local end of the route to it
	// (ChooseListenAddr).
	StoreAddr string
	// ConnectTimeout bounds each step of the set-up: waiting for a peer's address, each
	// dial, each handshake (default DefaultConnectTimeout; ddp.InitProcessGroup reads
	// GODDP_CONNECT_TIMEOUT).
	ConnectTimeout time.Duration
	// LookupEnv reads the environment for backend settings (GODDP_SOCKET_IFNAME and the
	// like); nil means os.LookupEnv.
	LookupEnv func(string) (string, bool)
}

// DefaultTimeout is the collective timeout when Options.Timeout is zero.
const DefaultTimeout = 30 * time.Minute

// Validate checks o and fills defaults.
func (o *Options) Validate() error {
	if o.Size < 1 {
		return fmt.Errorf("%w: world size %d, want at least 1", ErrInvalidArgument, o.Size)
	}
	if o.Rank < 0 || o.Rank >= o.Size {
		return fmt.Errorf("%w: rank %d outside [0, %d)", ErrInvalidArgument, o.Rank, o.Size)
	}
	if o.LocalSize == 0 {
		o.LocalSize = 1
	}
	if o.LocalRank < 0 || o.LocalRank >= o.LocalSize {
		return fmt.Errorf("%w: local rank %d outside [0, %d)", ErrInvalidArgument, o.LocalRank, o.LocalSize)
	}
	if o.Store == nil {
		return fmt.Errorf("%w: no store", ErrInvalidArgument)
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.ConnectTimeout <= 0 {
		o.ConnectTimeout = DefaultConnectTimeout
	}
	if o.LookupEnv == nil {
		o.LookupEnv = os.LookupEnv
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	return nil
}

// Factory creates a backend's group. It blocks until every rank has joined or ctx ends.
type Factory func(ctx context.Context, opts Options) (ProcessGroup, error)

var (
	registryMu sync.RWMutex // guards registry
	registry   = map[string]Factory{}
)

// Register makes a backend available by name. Backends call it from init(). It panics if
// name is empty, factory is nil, or name is already registered.
func Register(name string, factory Factory) {
	if name == "" {
		panic("procgroup: Register with an empty name")
	}
	if factory == nil {
		panic("procgroup: Register of a nil factory for " + name)
	}
	registryMu.Lock()
	defer registryMu.Unlock()
	if _, dup := registry[name]; dup {
		panic("procgroup: Register called twice for backend " + name)
	}
	registry[name] = factory
}

// Backends lists the registered backend names.
func Backends() []string {
	registryMu.RLock()
	defer registryMu.RUnlock()
	names := make([]string, 0, len(registry))
	for n := range registry {
		names = append(names, n)
	}
	return names
}

// knownBackends maps the names of goddp's own backends to the import path of the package
// that registers each one: a program uses a backend only if it links that package in, with
// a blank import in its main package (procgroup itself imports no backend).
var knownBackends = map[string]string{
	"gloo": "github.com/goddp/goddp/backends/gloo",
	"nccl": "github.com/goddp/goddp/backends/nccl",
}

// ErrUnknownBackend is wrapped by Lookup's (and so New's) error for a name no linked-in
// package has registered. The message says which import adds the backend.
var ErrUnknownBackend = errors.New("procgroup: unknown backend")

// Lookup returns the factory registered under name, or an error wrapping ErrUnknownBackend
// that names the import to add (for goddp's own gloo and nccl) and the backends known and
// linked in:
//
//	procgroup: unknown backend "gloo": not linked into this program; add import _ "github.com/goddp/goddp/backends/gloo" (known backends: gloo → github.com/goddp/goddp/backends/gloo, nccl → github.com/goddp/goddp/backends/nccl; linked in: none)
func Lookup(name string) (Factory, error) {
	registryMu.RLock()
	f, ok := registry[name]
	registryMu.RUnlock()
	if !ok {
		return nil, unknownBackend(name)
	}
	return f, nil
}

// unknownBackend is Lookup's error for name.
func unknownBackend(name string) error {
	known := make([]string, 0, len(knownBackends))
	for n := range knownBackends {
		known = append(known, n)
	}
	slices.Sort(known)
	for k, n := range known {
		known[k] = n + " → " + knownBackends[n]
	}
	linked := Backends()
	slices.Sort(linked)
	linkedList := "none"
	if len(linked) > 0 {
		linkedList = strings.Join(linked, ", ")
	}
	hint := "no backend of that name exists"
	if path, ok := knownBackends[name]; ok {
		hint = fmt.Sprintf("not linked into this program; add import _ %q", path)
	}
	return fmt.Errorf("%w %q: %s (known backends: %s; linked in: %s)",
		ErrUnknownBackend, name, hint, strings.Join(known, ", "), linkedList)
}

// New validates opts and creates a group with the named backend.
func New(ctx context.Context, backend string, opts Options) (ProcessGroup, error) {
	f, err := Lookup(backend)
	if err != nil {
		return nil, err
	}
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	return f(ctx, opts)
}

// TransportReporter is implemented by groups that can say how they reach each peer.
type TransportReporter interface {
	// Transports returns one entry per rank: "self" for the caller, else the backend's
	// name for the path to that rank (gloo: "shm", "unix" or "tcp HOST:PORT").
	Transports() []string
}

// Transports is pg's TransportReporter answer, looking through wrappers (Find); nil when no
// layer reports.
func Transports(pg ProcessGroup) []string {
	if t, ok := Find[TransportReporter](pg); ok {
		return t.Transports()
	}
	return nil
}

// AlgorithmReporter is implemented by groups that can say how they would all-reduce a
// buffer: the algorithm's name, and its memory traffic per rank: the bytes of the ranks'
// own buffers it reads and writes, per byte of the message (staging memory that stays in
// cache, such as gloo's shared-memory slots, is not counted). allreduce-perf --ceiling
// divides the memory bandwidth it measures by it. traffic is 0 where the model does not
// apply (bfloat16 and float16, which are widened first). The answer assumes that every
// rank passes the same kind of buffer (all from AllocBuffer, or none).
type AlgorithmReporter interface {
	AllReduceAlgorithm(buf any) (name string, traffic float64)
}

// AllReduceAlgorithm is pg's AlgorithmReporter answer, looking through wrappers (Find);
// ok is false when no layer reports.
func AllReduceAlgorithm(pg ProcessGroup, buf any) (name string, traffic float64, ok bool) {
	a, ok := Find[AlgorithmReporter](pg)
	if !ok {
		return "", 0, false
	}
	name, traffic = a.AllReduceAlgorithm(buf)
	return name, traffic, true
}

// BufferAllocator is implemented by groups that can place a collective's buffer where
// their collectives run faster: gloo puts it in memory that the ranks of a host share, so
// that an all-reduce reads the peers' buffers in place instead of copying through staging
// slots (Note [Shared buffers] in backends/gloo). The reducer allocates its buckets this
// way when the group offers it.
//
// AllocBuffer returns a zeroed buffer of count elements of dt (the slice type DTypeOf maps
// back to dt), or nil when the group has no such memory for it (then use an ordinary
// slice: collectives take both). Call it on every rank in the same order with the same
// sizes, as the buckets are: whether a buffer fits is decided on each rank alone, and an
// all-reduce only runs in place when it does on all of them. FreeBuffer gives a buffer back
// once no collective uses it; afterwards it reads as zeros. Once the group is closed its
// buffers read as zeros too (they stay addressable: no fault).
type BufferAllocator interface {
	AllocBuffer(dt DType, count int) (any, error)
	FreeBuffer(buf any)
}

// CompletedAt is when f completed (the zero time before).
func (f *Future) CompletedAt() time.Time {
	select {
	case <-f.done:
		return f.at
	default:
		return time.Time{}
	}
}

// CompletedAt returns when w completed, where w, or a Work it wraps (FindWork), records
// it; ok is false otherwise or before completion. The reducer uses it for exact bucket
// finish times.
func CompletedAt(w Work) (t time.Time, ok bool) {
	c, found := FindWork[interface{ CompletedAt() time.Time }](w)
	if !found {
		return time.Time{}, false
	}
	t = c.CompletedAt()
	return t, !t.IsZero()
}
