package ddp

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/goddp/goddp/ddp/optim"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/reducer"
)

// Sentinel errors. They are ddp's own, so that a message names the layer that refused the
// call; an error from the reducer below wraps the reducer's (ErrUnusedParameters and
// ErrMarkedTwice are the reducer's too).
var (
	// ErrInvalidArgument: a bad parameter, buffer or option (wrapped with the details).
	ErrInvalidArgument = errors.New("ddp: invalid argument")
	// ErrMismatch is wrapped by *MismatchError: the ranks' parameters or buffers differ.
	ErrMismatch = errors.New("ddp: ranks disagree on the model")
	// ErrPhase: a call out of turn, such as Finalize without BeginBackward. It leaves the
	// DDP usable.
	ErrPhase = errors.New("ddp: call out of turn")
	// ErrClosed: the DDP was closed.
	ErrClosed = errors.New("ddp: closed")
)

// Param is one learnable parameter of a trainer that brings its own gradients.
type Param struct {
	// Name appears in errors; it must be the same on every rank.
	Name string
	// Data holds the parameter's values, a []float32 or a []float64 (with Options.Device,
	// a procgroup.DeviceBuffer of Float32 or Float64). New overwrites it with rank 0's
	// values.
	Data any
	// Grad is where Finalize leaves the averaged gradient: the same type and length as
	// Data. With Options.GradientAsBucketView it must be nil: read the gradient with
	// DDP.Grad32 (or Grad64) instead. No two of the parameters' Data and Grad may share
	// memory (New refuses them, naming both): a tensor used twice, such as a tied weight,
	// is one Param, its gradient summed and reported once.
	Grad any
	// Shape is the parameter's shape; nil means [len(Data)]. Its product must be len(Data).
	Shape []int
}

// Buffer is a tensor that is broadcast from rank 0 but not reduced (PyTorch's buffers,
// such as batch-norm running statistics).
type Buffer struct {
	Name string
	// Data is a []float32, []float64, []int32, []int64, []procgroup.BF16 or
	// []procgroup.F16.
	Data any
	// Shape as in Param.
	Shape []int
}

// Options configure a DDP. They mirror the arguments of PyTorch's
// DistributedDataParallel. The zero value of a field means its default; the defaults of
// the fields the reducer shares (bucket caps, CommHook, Logger) are
// reducer.Options.WithDefaults's.
type Options struct {
	// BucketCapMB caps every gradient bucket but the first, in MiB (default 25).
	// AutoBucketCap chooses both caps from measurements of the first three synced steps,
	// keeping FirstBucketCapMB and 25 MiB unless another layout is predicted at least 5%
	// faster (reducer Note [Auto buckets]; AutoPlan says what it chose).
	BucketCapMB float64
	// FirstBucketCapMB caps the first bucket, in MiB (default 1).
	FirstBucketCapMB float64
	// FindUnusedParameters: parameters that get no gradient in a synced backward are reduced
	// as zeros instead of failing Finalize.
	FindUnusedParameters bool
	// GradientAsBucketView: gradients live in the buckets (read them with Grad32/Grad64,
	// again after each Finalize); nothing is copied back. Param.Grad must be nil.
	GradientAsBucketView bool
	// CommHook reduces each bucket (default: one all-reduce, AllReduceHook).
	CommHook CommHook
	// Device: parameters and gradients live on the GPU (reducer Note [Device buckets]):
	// Param.Data and Param.Grad are procgroup.DeviceBuffers, gradients are reported with
	// GradReadyDevice, and the process group must offer procgroup.Device (the nccl
	// backend). Stream is the trainer's compute stream.
	Device bool
	Stream procgroup.Stream
	// Logger receives the rare log lines; nil means zap.NewNop().
	Logger *zap.Logger
	// Buffers are broadcast from rank 0 at New and by BroadcastBuffers, never reduced.
	Buffers []Buffer
	// BroadcastChunkMB caps each of the broadcasts that copy rank 0's parameters and
	// buffers at New, in MiB (default 64): tensors of one element type are packed into
	// chunks of this size, so a model takes a few large broadcasts, not one per tensor.
	BroadcastChunkMB float64
	// AfterSync, if set, is called by every synced Finalize once the averaged gradients are
	// in place, before it returns (an adapter copies them into its framework's tensors:
	// gorgoniaddp.WrapNodes). It runs on Finalize's goroutine without the DDP's lock, so it
	// may read the DDP (Grad32, Grad64, Err); its error fails the DDP and is Finalize's.
	AfterSync func(d *DDP) error
	// Shards, if positive, fixes the global batch instead of the per-rank batch: each step's
	// batch is cut into Shards logical shards, a rank runs its own (LocalShards) with
	// BeginShard or BackwardShards, and Finalize leaves the mean over the shards of their
	// gradients, summed in shard order, so that it is the same bits at every world size
	// (reducer Note [Shards]). The world size must divide Shards: New refuses another
	// with a *ShardsError listing the sizes that work. Keying the data and every random
	// number by (shard, step), never by rank, is the trainer's part. It takes the default
	// CommHook, a fixed BucketCapMB and host memory, without FindUnusedParameters.
	// 0 (the default): no shards, the per-rank batch and the all-reduce.
	Shards int
	// NoFiniteCheck turns off the check that names the ranks and parameters of a NaN or
	// infinite gradient (a *NonFiniteError from Finalize; reducer Note [Non-finite
	// gradients]): with it, such a gradient reaches every rank's average silently. It must
	// be the same on every rank.
	NoFiniteCheck bool
	// UnevenInputs lets ranks run different numbers of steps: a rank whose data has run
	// out calls Join, and shadows the other ranks' synced steps until every rank has
	// (Note [Join] in join.go). It costs one small all-reduce per synced step, the count of
	// the ranks still training, issued by BeginBackward(Sync); without it Join is refused
	// and a rank that leaves early fails its peers, as before. It must be the same on every
	// rank, and takes host memory, without Shards. BroadcastBuffers then issues the count
	// too, so that the ranks in Join take part in it.
	UnevenInputs bool
	// JoinDivideByActive (with UnevenInputs) averages each synced step's gradients over the
	// ranks still training in it (PyTorch's divide_by_initial_world_size=False) instead of
	// over the world size (the default, as in PyTorch: every sample weighs the same in
	// every step, and the averages are the reducer's own bits, with no extra pass).
	JoinDivideByActive bool
	// Zero shards the optimizer over the ranks (ZeRO, Note [ZeRO] in zero.go): 1 shards its
	// state, each rank stepping about 1/n of every bucket's elements (Step, after Finalize,
	// then all-gathers the parameters); 2 also reduce-scatters each bucket instead of
	// all-reducing it, so that a rank receives only its shard's averaged gradients. It
	// needs Optimizer, float32 parameters on the host and a fixed BucketCapMB, without
	// Shards, UnevenInputs or GradientAsBucketView (and at stage 2 without a CommHook),
	// and must be the same on every rank. 0 (the default): plain DDP, the trainer steps.
	Zero int
	// ZeroOverlap (with Zero) steps each bucket's shard as soon as its reduction
	// completes and issues its all-gather then, during the rest of backward, instead of
	// all in Step (Note [ZeRO overlap] in zero_overlap.go): the all-gathers queue on the
	// link behind the reductions. The result is the bits of Step without it. It changes
	// what the trainer may do in a step: Param.Data is written from Finalize until Step
	// returns, so the trainer must not read it then (nor in AfterSync), nor write it
	// between BeginBackward and Step; the step takes the reduced gradients during
	// backward, so the trainer must not change its Param.Grad between Finalize and Step
	// (clip or scale them: Step fails if this rank's blocks changed; scale the loss
	// instead); Step must follow every synced Finalize; and since
	// the step is taken before the check for non-finite gradients, a *NonFiniteError from
	// Finalize fails the DDP. At stage 1 it takes the default all-reduce only. It must be
	// the same on every rank.
	ZeroOverlap bool
	// ZeroForwardOverlap (with Zero) lets Step return once it has stepped the shard and
	// issued the parameters' all-gathers, first parameters first, so that they run during
	// the next forward (Note [ZeRO forward overlap] in zero_forward.go): the trainer must
	// call WaitParams for a parameter before it reads that parameter's Param.Data, and
	// not write it before then (the copy overwrites it; gorgoniaddp's taps wait where
	// each parameter is first used). Finalize,
	// GatherOptimizerState and Close complete what is left. The result is the bits of
	// Step without it. The forward waits for a whole bucket where it first needs one, so
	// on a slow link it gains most with buckets smaller than the default 25 MiB (about
	// 6 MiB on 1 Gbit/s in docs/results/2026-12-08-zero-forward-overlap.md). It cannot be
	// combined with ZeroOverlap, and must be the same on every rank.
	ZeroForwardOverlap bool
	// Optimizer makes the optimizer of this rank's shard, for n elements, with Zero (for
	// instance optim.NewAdamW with the trainer's options). It must work element by element
	// (package optim).
	Optimizer optim.Factory
}

// validate fills in the defaults (the reducer's options from reducer.Options.WithDefaults,
// the one place they are set) and checks the sizes.
func (o *Options) validate() error {
	r := o.reducerOptions().WithDefaults()
	o.BucketCapMB, o.FirstBucketCapMB, o.CommHook, o.Logger = r.BucketCapMB, r.FirstBucketCapMB, r.CommHook, r.Logger
	if o.BroadcastChunkMB == 0 {
		o.BroadcastChunkMB = 64
	}
	if !(o.BucketCapMB > 0 || o.BucketCapMB == AutoBucketCap) || !(o.FirstBucketCapMB > 0) || !(o.BroadcastChunkMB > 0) {
		return fmt.Errorf("%w: BucketCapMB %v, FirstBucketCapMB %v, BroadcastChunkMB %v: want all positive (or BucketCapMB AutoBucketCap)",
			ErrInvalidArgument, o.BucketCapMB, o.FirstBucketCapMB, o.BroadcastChunkMB)
	}
	return nil
}

// reducerOptions are the reducer's share of o.
func (o *Options) reducerOptions() reducer.Options {
	return reducer.Options{
		BucketCapMB:          o.BucketCapMB,
		FirstBucketCapMB:     o.FirstBucketCapMB,
		FindUnusedParameters: o.FindUnusedParameters,
		GradientAsBucketView: o.GradientAsBucketView,
		CommHook:             o.CommHook,
		Device:               o.Device,
		Stream:               o.Stream,
		Logger:               o.Logger,
		Shards:               o.Shards,
		NoFiniteCheck:        o.NoFiniteCheck,
	}
}

// phase is where the DDP is in a training step: the one field that says it.
type phase int

const (
	phaseIdle       phase = iota // after New or Finalize
	phaseSync                    // a synced backward has begun
	phaseAccumulate              // a NoSync backward has begun
	phaseFinalizing              // inside Finalize
	phaseFailed                  // err ended the DDP
	phaseJoined                  // inside Join: shadowing the others' synced steps
	phaseStepping                // inside Step or GatherOptimizerState (Options.Zero)
	phaseClosed
)

// DDP averages the gradients of a model replicated on every rank of a process group, the way
// PyTorch's DistributedDataParallel does: see the package documentation for the loop.
//
// A DDP is driven by one training goroutine (BeginBackward, Finalize, NoSync, Backward);
// GradReady may be called from the goroutine that runs backward (an adapter's hook, such as
// gorgoniaddp's, calls it there); Stats, Err, Fail and Close may be called from any
// goroutine.
//
// Failure is final: once a step fails (a hook's error, an unused parameter, a failed
// collective, a backward function's error), the ranks' collectives can no longer be matched,
// so the process group is aborted (peers fail at once instead of hanging) and every later
// Finalize returns the same error.
type DDP struct {
	pg      procgroup.ProcessGroup
	r       *reducer.Reducer
	opts    Options
	log     *zap.Logger
	params  []Param
	buffers []Buffer

	failed atomic.Bool // the hot path's view of phase == phaseFailed

	join joinState  // with Options.UnevenInputs: the per-step count of active ranks
	zero *zeroState // with Options.Zero (Note [ZeRO]); its ready flag is guarded by mu

	mu      sync.Mutex // guards the fields below
	phase   phase
	err     error          // why phase is phaseFailed
	closing bool           // Close has begun: Step and GatherOptimizerState refuse
	steps   sync.WaitGroup // a Step or GatherOptimizerState at work without mu, which Close waits for
}

// New wraps params, replicated on every rank of pg. It checks that every rank has the same
// parameters and buffers (count, names, element types and shapes; a difference is a
// *MismatchError naming the first differing tensor and the ranks) and the same
// Options.Shards and CommHook (DescribeHook's line: a hook or its settings, such as
// PowerSGD's rank, that differ are an error wrapping ErrMismatch naming both sides),
// then copies rank 0's
// parameters and buffers to every rank. Every rank must call New with the same model; it
// returns when all have (or ctx ends). The process group stays the caller's.
func New(ctx context.Context, pg procgroup.ProcessGroup, params []Param, opts Options) (*DDP, error) {
	if pg == nil {
		return nil, fmt.Errorf("%w: nil process group", ErrInvalidArgument)
	}
	if err := opts.validate(); err != nil {
		return nil, err
	}
	if opts.Shards < 0 {
		return nil, fmt.Errorf("%w: Shards %d, want 0 (no shards) or positive", ErrInvalidArgument, opts.Shards)
	}
	if err := reducer.CheckShards(opts.Shards, pg.Size()); err != nil { // before any collective
		return nil, fmt.Errorf("%w: Options.Shards: %w", ErrInvalidArgument, err)
	}
	if err := checkJoinOptions(&opts); err != nil {
		return nil, err
	}
	if err := checkZero(&opts); err != nil {
		return nil, err
	}
	d := &DDP{pg: pg, opts: opts, log: opts.Logger}
	descs := make([]desc, 0, len(params)+len(opts.Buffers))
	d.params = make([]Param, len(params))
	for i, p := range params {
		dd, err := describe(kindParam, i, p.Name, p.Data, p.Shape)
		if err != nil {
			return nil, err
		}
		if dd.dtype != procgroup.Float32 && dd.dtype != procgroup.Float64 {
			return nil, fmt.Errorf("%w: %s: element type %v, want float32 or float64", ErrInvalidArgument, dd.label(), dd.dtype)
		}
		if err := checkGrad(dd, p.Grad, opts.GradientAsBucketView); err != nil {
			return nil, err
		}
		if err := checkPlace(dd, p.Data, p.Grad, opts.Device); err != nil {
			return nil, err
		}
		p.Shape = dd.shape
		d.params[i] = p
		descs = append(descs, dd)
	}
	if err := checkOverlap(d.params); err != nil {
		return nil, err
	}
	d.buffers = make([]Buffer, len(opts.Buffers))
	for i, b := range opts.Buffers {
		dd, err := describe(kindBuffer, i, b.Name, b.Data, b.Shape)
		if err != nil {
			return nil, err
		}
		b.Shape = dd.shape
		d.buffers[i] = b
		descs = append(descs, dd)
	}
	d.opts.Buffers = d.buffers
	if pg.Size() > 1 {
		if err := verify(ctx, pg, descs, opts.Shards, reducer.DescribeHook(opts.CommHook)+zeroLine(&opts), opts.NoFiniteCheck, opts.UnevenInputs); err != nil {
			return nil, err
		}
		if err := broadcastAll(ctx, pg, d.tensors(true), chunkBytes(opts.BroadcastChunkMB)); err != nil {
			return nil, fmt.Errorf("ddp: rank %d: initial broadcast of rank 0's parameters: %w", pg.Rank(), err)
		}
	}
	rp := make([]reducer.Param, len(d.params))
	for i, p := range d.params {
		rp[i] = reducer.Param{Name: p.Name, Grad: p.Grad, DType: descs[i].dtype, Len: descs[i].n, Shape: descs[i].shape}
	}
	ro := opts.reducerOptions()
	if opts.Zero > 0 {
		z, err := newZero(&opts, d.params, pg.Rank(), pg.Size(), &ro)
		if err != nil {
			return nil, err
		}
		d.zero = z
	}
	r, err := reducer.New(pg, rp, ro)
	if err != nil {
		return nil, fmt.Errorf("ddp: %w", err)
	}
	d.r = r
	d.log.Info("ddp: model replicated", zap.Int("rank", pg.Rank()), zap.Int("world_size", pg.Size()),
		zap.Int("params", len(d.params)), zap.Int("buffers", len(d.buffers)))
	return d, nil
}

// checkPlace checks that a parameter's Data and Grad are device buffers exactly when
// Options.Device is set.
func checkPlace(dd desc, data, grad any, device bool) error {
	_, dataDev := data.(procgroup.DeviceBuffer)
	_, gradDev := grad.(procgroup.DeviceBuffer)
	switch {
	case device && !dataDev:
		return fmt.Errorf("%w: %s: Data is %T; with Options.Device it must be a procgroup.DeviceBuffer", ErrInvalidArgument, dd.label(), data)
	case device && grad != nil && !gradDev:
		return fmt.Errorf("%w: %s: Grad is %T; with Options.Device it must be a procgroup.DeviceBuffer", ErrInvalidArgument, dd.label(), grad)
	case !device && (dataDev || gradDev):
		return fmt.Errorf("%w: %s: device memory needs Options.Device (and Options.Stream)", ErrInvalidArgument, dd.label())
	}
	return nil
}

func checkGrad(dd desc, grad any, bucketView bool) error {
	if grad == nil {
		if bucketView {
			return nil
		}
		return fmt.Errorf("%w: %s: nil Grad (allowed only with GradientAsBucketView)", ErrInvalidArgument, dd.label())
	}
	if bucketView {
		return fmt.Errorf("%w: %s: Grad must be nil with GradientAsBucketView (read gradients with Grad32/Grad64)", ErrInvalidArgument, dd.label())
	}
	gdt, gn, err := procgroup.DTypeOf(grad)
	if err != nil {
		return fmt.Errorf("%w: %s: Grad: %w", ErrInvalidArgument, dd.label(), err)
	}
	if gdt != dd.dtype || gn != dd.n {
		return fmt.Errorf("%w: %s: Grad is %v×%d but Data is %v×%d", ErrInvalidArgument, dd.label(), gdt, gn, dd.dtype, dd.n)
	}
	return nil
}

// tensors lists the Data of the parameters (when params is set) and of the buffers.
func (d *DDP) tensors(params bool) []any {
	var ts []any
	if params {
		for _, p := range d.params {
			ts = append(ts, p.Data)
		}
	}
	for _, b := range d.buffers {
		ts = append(ts, b.Data)
	}
	return ts
}

// Rank is this process's rank; Size the world size.
func (d *DDP) Rank() int { return d.pg.Rank() }

// Size is the world size.
func (d *DDP) Size() int { return d.pg.Size() }

// Params returns the parameters as New checked them (Shape filled in). Do not modify it.
func (d *DDP) Params() []Param { return d.params }

// BeginBackward starts the backward pass of one micro-batch, in mode Sync (this pass's
// gradients, added to those of the Accumulate passes since the last synced Finalize, are
// averaged across ranks) or Accumulate (PyTorch's no_sync: the gradients only add up
// locally). Then run backward, reporting each gradient with GradReady, and after a synced
// pass call Finalize (after an Accumulate pass Finalize is optional).
//
// It never blocks and returns nothing: an error (another mode, or a previous synced pass
// that was never finalized, naming the parameters that got no gradient) fails the DDP and
// is returned by the next Finalize, as are the hooks' errors.
func (d *DDP) BeginBackward(mode SyncMode) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.mayBeginLocked("BeginBackward") {
		return
	}
	var next phase
	switch mode {
	case Sync:
		next = phaseSync
	case Accumulate:
		next = phaseAccumulate
	default:
		d.failLocked(fmt.Errorf("%w: BeginBackward(%d): want Sync or Accumulate", ErrInvalidArgument, int(mode)))
		return
	}
	if err := d.r.BeginBackward(mode); err != nil {
		d.failLocked(err)
		return
	}
	if z := d.zero; mode == Sync && z != nil && z.overlap && z.opts != nil {
		d.startOverlapLocked() // Note [ZeRO overlap]
	}
	if mode == Sync && d.opts.UnevenInputs {
		// Before any bucket of the pass can launch: Note [Join].
		if err := d.join.launch(d.pg, 1, 0); err != nil {
			d.failLocked(err)
			return
		}
	}
	d.phase = next
}

// mayBeginLocked reports whether a backward pass may begin now (what names the caller): not
// after the DDP failed or closed (the next Finalize reports that), and not during Finalize
// or Join, which fail the DDP with ErrPhase. d.mu must be held.
func (d *DDP) mayBeginLocked(what string) bool {
	switch d.phase {
	case phaseFailed, phaseClosed:
		return false
	case phaseFinalizing:
		d.failLocked(fmt.Errorf("%s during Finalize: %w", what, ErrPhase))
		return false
	case phaseJoined:
		d.failLocked(fmt.Errorf("%s during Join: %w", what, ErrPhase))
		return false
	case phaseStepping:
		d.failLocked(fmt.Errorf("%s during Step: %w", what, ErrPhase))
		return false
	}
	if d.zero != nil && d.zero.run != nil {
		d.failLocked(fmt.Errorf("%s before Step: with Options.ZeroOverlap every synced Finalize must be followed by Step, which collects its step's all-gathers: %w", what, ErrPhase))
		return false
	}
	if d.zero != nil {
		d.zero.ready = false
	}
	return true
}

// BeginShard starts the backward pass of shard s, one of this rank's (LocalShards), with
// Options.Shards; it takes BeginBackward's place. Report the pass's gradients with
// GradReady (each shard's own gradient: the DDP keeps every shard's apart and scales
// nothing), then begin the rank's next shard; after the last of them, Finalize leaves in
// each Param.Grad the mean over all the step's shards. The shards may run in any order,
// each once per step. Like BeginBackward it never blocks and returns nothing: a shard
// that is not this rank's, a shard run twice, a shard's pass that did not report every
// parameter, or a missing shard at Finalize fails the DDP, and Finalize returns the error.
// BackwardShards runs the whole loop.
func (d *DDP) BeginShard(s int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.mayBeginLocked("BeginShard") {
		return
	}
	sync, err := d.r.BeginShard(s)
	if err != nil {
		d.failLocked(err)
		return
	}
	d.phase = phaseAccumulate
	if sync {
		d.phase = phaseSync
	}
}

// LocalShards returns the shards this rank runs with Options.Shards, [lo, hi): rank r of
// a world of n runs [r·Shards/n, (r+1)·Shards/n). Without Shards it returns 0, 0.
func (d *DDP) LocalShards() (lo, hi int) { return d.r.LocalShards() }

// BackwardShards runs one step's backward with Options.Shards: for each of this rank's
// shards in order, BeginShard and backward(shard), which must compute that shard's
// micro-batch and report every gradient with GradReady; then Finalize(ctx). An error of
// backward fails the DDP (see DDP).
func (d *DDP) BackwardShards(ctx context.Context, backward func(shard int) error) error {
	lo, hi := d.LocalShards()
	if hi == lo {
		return d.fail(fmt.Errorf("%w: BackwardShards without Options.Shards: use Backward", ErrInvalidArgument))
	}
	for s := lo; s < hi; s++ {
		d.BeginShard(s)
		if err := backward(s); err != nil {
			return d.fail(fmt.Errorf("backward of shard %d: %w", s, err))
		}
	}
	return d.Finalize(ctx)
}

// GradReady reports parameter i's gradient of the current backward pass (once per pass,
// after all its contributions are summed): it is copied (divided by the world size) into
// its bucket, and completed buckets start their all-reduce. It never blocks; grad may be
// reused once it returns. Its error also fails the DDP (see DDP).
func (d *DDP) GradReady(i int, grad []float32) error {
	if d.failed.Load() {
		return d.Err()
	}
	if err := d.r.GradReady(i, grad); err != nil {
		return d.fail(err)
	}
	return nil
}

// GradReadyDevice is GradReady with Options.Device: grad is in device memory, produced on
// Options.Stream. The copy into the bucket is enqueued on that stream; it never waits on
// the host.
func (d *DDP) GradReadyDevice(i int, grad procgroup.DeviceBuffer) error {
	if d.failed.Load() {
		return d.Err()
	}
	if err := d.r.GradReadyDevice(i, grad); err != nil {
		return d.fail(err)
	}
	return nil
}

// GradReady64 is GradReady for a float64 parameter.
func (d *DDP) GradReady64(i int, grad []float64) error {
	if d.failed.Load() {
		return d.Err()
	}
	if err := d.r.GradReady64(i, grad); err != nil {
		return d.fail(err)
	}
	return nil
}

// Finalize ends the backward pass. After a synced pass it waits for every bucket's
// all-reduce and leaves the averaged gradients in each Param.Grad (with
// GradientAsBucketView, in Grad32/Grad64) and then calls Options.AfterSync; after a NoSync
// pass it returns at once. It returns the step's first error (see DDP), or ctx's error if
// ctx ends first (which fails the DDP too), or ErrPhase without a backward pass to
// finalize.
//
// If the averaged gradients hold a NaN or an infinity, it returns a *NonFiniteError, the
// same on every rank, naming the ranks, the step and the parameters whose local gradient
// was not finite (or an overflow in the CommHook). That error does not fail the DDP: the
// gradients are left as averaged, non-finite values included, AfterSync is not called,
// and the trainer must not step the optimizer. It may stop, or skip the step and go on
// with the next BeginBackward, as every rank gets the same error.
func (d *DDP) Finalize(ctx context.Context) error {
	d.mu.Lock()
	switch d.phase {
	case phaseFailed:
		defer d.mu.Unlock()
		return d.err
	case phaseClosed:
		d.mu.Unlock()
		return ErrClosed
	case phaseIdle, phaseFinalizing, phaseJoined, phaseStepping:
		d.mu.Unlock()
		return fmt.Errorf("%w: Finalize without a backward pass (call BeginBackward first)", ErrPhase)
	}
	synced := d.phase == phaseSync
	d.phase = phaseFinalizing
	var run *overlapRun // the pass's overlapped step (Note [ZeRO overlap])
	if synced && d.zero != nil {
		run = d.zero.run
	}
	d.mu.Unlock()
	if run != nil {
		run.backwardOver() // backward is over: Param.Data may be written
	}

	var active int
	err := d.completeGathers(ctx) // what forward did not wait for: Note [ZeRO forward overlap]
	if err == nil && synced && d.opts.UnevenInputs {
		active, _, err = d.join.wait(ctx)
	}
	if err == nil {
		err = d.r.Finalize(ctx) // without d.mu: Stats, Err and Close stay responsive
	}
	if synced && d.zero != nil && (err == nil || errors.As(err, new(*NonFiniteError))) {
		d.zero.rebuilt.Store(true) // the reducer rebuilt the buckets: Note [ZeRO]
	}
	if err == nil && synced && d.opts.JoinDivideByActive && active < d.pg.Size() {
		d.rescale(float64(d.pg.Size()) / float64(active))
	}

	if nf := (*NonFiniteError)(nil); run != nil && errors.As(err, &nf) {
		err = fmt.Errorf("%w (with Options.ZeroOverlap the step was taken before the check: the DDP fails)", err)
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	if nf := (*NonFiniteError)(nil); run == nil && errors.As(err, &nf) && d.phase == phaseFinalizing {
		// Every rank has the same error after the same collectives: the DDP stays usable,
		// and AfterSync does not run (the gradients must not reach the optimizer).
		d.phase = phaseIdle
		return err
	}
	if err := d.settleLocked(err); err != nil {
		return err
	}
	if synced && d.opts.AfterSync != nil {
		d.mu.Unlock()
		err = d.opts.AfterSync(d) // without d.mu: it may call the DDP's methods
		d.mu.Lock()
		if err := d.settleLocked(err); err != nil {
			return err
		}
	}
	if synced && d.zero != nil {
		d.zero.ready = true
	}
	d.phase = phaseIdle
	return nil
}

// settleLocked is what Finalize returns after a part that ran without d.mu and returned
// err: ErrClosed or the DDP's error if Close or a failure came meanwhile, else err, which
// fails the DDP; nil if none of these. d.mu must be held.
func (d *DDP) settleLocked(err error) error {
	switch {
	case d.phase == phaseClosed:
		return ErrClosed
	case d.phase == phaseFailed:
		return d.err
	case err != nil:
		return d.failLocked(err)
	}
	return nil
}

// Backward runs one synced backward pass: BeginBackward(Sync), backward (which must report
// every gradient with GradReady, directly or through an adapter's hook), Finalize(ctx). An
// error of backward fails the DDP (see DDP).
func (d *DDP) Backward(ctx context.Context, backward func() error) error {
	d.BeginBackward(Sync)
	if err := backward(); err != nil {
		return d.fail(fmt.Errorf("backward: %w", err))
	}
	return d.Finalize(ctx)
}

// NoSync runs one backward pass whose gradients only add up locally (PyTorch's no_sync):
// the next synced pass averages the sum. It returns the DDP's error, if any; an error of
// backward fails the DDP (see DDP).
func (d *DDP) NoSync(backward func() error) error {
	d.BeginBackward(Accumulate)
	if err := backward(); err != nil {
		return d.fail(fmt.Errorf("NoSync backward: %w", err))
	}
	return d.Err()
}

// Grad returns parameter i's averaged gradient after a synced Finalize: its Param.Grad, or
// with GradientAsBucketView its slot in the bucket (valid until the next Finalize, since the
// first synced Finalize rebuilds the buckets once: take it again after each Finalize).
// It is a []float32 or a []float64; nil for an index out of range.
func (d *DDP) Grad(i int) any {
	if i < 0 || i >= len(d.params) {
		return nil
	}
	if !d.opts.GradientAsBucketView {
		return d.params[i].Grad
	}
	v, _ := d.r.GradView(i)
	return v
}

// GradDevice is Grad with Options.Device: the averaged gradient on the device, valid for
// kernels queued on Options.Stream after Finalize.
func (d *DDP) GradDevice(i int) procgroup.DeviceBuffer {
	g, _ := d.Grad(i).(procgroup.DeviceBuffer)
	return g
}

// Grad32 is Grad for a float32 parameter (nil for a float64 one).
func (d *DDP) Grad32(i int) []float32 { g, _ := d.Grad(i).([]float32); return g }

// Grad64 is Grad for a float64 parameter (nil for a float32 one).
func (d *DDP) Grad64(i int) []float64 { g, _ := d.Grad(i).([]float64); return g }

// Stats returns the measurements of the last finalized backward pass (per gradient and
// bucket timestamps, communication and overlap), or nil before the first. It is a copy: the
// caller may keep it.
func (d *DDP) Stats() *IterStats {
	if st := d.r.Stats(); st != nil {
		return st.Clone()
	}
	return nil
}

// ProcessGroup is the group the DDP reduces over (the caller's: New's pg).
func (d *DDP) ProcessGroup() procgroup.ProcessGroup { return d.pg }

// CommHook returns Options.CommHook as New was given it (nil: the default all-reduce),
// for a trainer that checkpoints the hook's state (ddp/checkpoint's PerRank).
func (d *DDP) CommHook() CommHook { return d.opts.CommHook }

// BucketParams returns the current bucket layout: the indices of the parameters in each
// bucket, buckets in launch order. The layout changes at the first synced Finalize (with
// AutoBucketCap or an AutoHook, at each of the first three; Generation tells which one this is). The
// slices are the caller's.
func (d *DDP) BucketParams() [][]int {
	bs := d.r.Buckets()
	out := make([][]int, len(bs))
	for b, bk := range bs {
		out[b] = append([]int(nil), bk.Params...)
	}
	return out
}

// AutoPlan returns the automatic bucket sizing's choice (Options.BucketCapMB =
// AutoBucketCap) and an AutoHook's (its Hooks), or nil before it decided (at the end of
// the third synced step), with neither of them, with one rank, or if this rank could not
// model the step (it then logs why, and the DDP keeps its first layout's caps and the
// plain all-reduce).
func (d *DDP) AutoPlan() *AutoPlan { return d.r.AutoPlan() }

// Generation counts the bucket layouts (0, then 1 after the first synced Finalize; with
// AutoBucketCap or an AutoHook, up to 3 after the third).
func (d *DDP) Generation() int { return d.r.Generation() }

// BroadcastBuffers copies rank 0's buffers (Options.Buffers) to every rank, as PyTorch does
// before each forward with broadcast_buffers. Every rank must call it at the same point,
// outside a backward pass. With Options.UnevenInputs the ranks in Join take part, and once
// a rank has joined the source is the highest rank still training (Note [Join]).
func (d *DDP) BroadcastBuffers(ctx context.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch d.phase {
	case phaseFailed:
		return d.err
	case phaseClosed:
		return ErrClosed
	case phaseIdle:
	default:
		return fmt.Errorf("%w: BroadcastBuffers during a backward pass", ErrPhase)
	}
	if d.pg.Size() == 1 || len(d.buffers) == 0 {
		return nil
	}
	root := 0
	if d.opts.UnevenInputs { // Note [Join]: the ranks in Join take part
		err := d.join.launch(d.pg, 0, 1)
		var n int
		if err == nil {
			_, n, err = d.join.wait(ctx)
		}
		if err == nil {
			root, err = bufferRoot(ctx, d.pg, n, true)
		}
		if err != nil {
			return d.failLocked(fmt.Errorf("broadcast of buffers: %w", err))
		}
	}
	if err := broadcastFrom(ctx, d.pg, d.tensors(false), chunkBytes(d.opts.BroadcastChunkMB), root); err != nil {
		return d.failLocked(fmt.Errorf("broadcast of buffers from rank %d: %w", root, err))
	}
	return nil
}

// Err returns the error that failed the DDP, or nil.
func (d *DDP) Err() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.err
}

// Close releases the DDP (not the process group, which stays the caller's). Closing during a
// synced backward aborts the process group. It is idempotent and cannot fail; Finalize and
// BroadcastBuffers return ErrClosed after it. A Step or GatherOptimizerState at work on
// another goroutine is let finish first (within the group's timeout; so Close must not be
// called from the optimizer's own Step), and later ones return ErrClosed. With Options.ZeroForwardOverlap it first waits for the all-gathers
// that Step left in flight: between steps (or in a NoSync pass) within the group's timeout,
// since the peers match them; in a synced pass, or after a failure, once it has aborted the
// group.
func (d *DDP) Close() {
	d.mu.Lock()
	d.closing = true // no Step or GatherOptimizerState starts now; one at work is waited for
	d.mu.Unlock()
	// A Step at work ends first, its all-gathers matched by its peers' (within the group's
	// timeout): they may go into the reducer's buckets (Note [ZeRO]), which an abort would
	// take from under it (the group's shared memory reads as zeros once released), and so
	// would the reducer's Close below; and with Options.ZeroForwardOverlap it may yet issue
	// the all-gathers that the drain below waits for.
	d.steps.Wait()
	d.mu.Lock()
	if z := d.zero; z != nil && z.forward && z.gather.pending.Load() > 0 &&
		d.phase != phaseIdle && d.phase != phaseAccumulate && d.phase != phaseClosed {
		d.pg.Abort(fmt.Errorf("ddp: rank %d: closed with the parameters' all-gathers in flight", d.pg.Rank()))
	}
	d.mu.Unlock()
	d.drainGathers() // Note [ZeRO forward overlap]; an error fails nothing now
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.phase == phaseClosed {
		return
	}
	if d.phase == phaseJoined { // the peers wait for this rank's shadow collectives
		d.pg.Abort(fmt.Errorf("ddp: rank %d: closed during Join", d.pg.Rank()))
	}
	var run *overlapRun
	if d.zero != nil {
		run = d.zero.run
	}
	if run != nil { // an overlapped step not collected by Step: Note [ZeRO overlap]
		select {
		case <-run.done:
		default: // its peers wait for its collectives
			d.pg.Abort(fmt.Errorf("ddp: rank %d: closed during an overlapped ZeRO step", d.pg.Rank()))
		}
		run.halt()
	}
	d.phase = phaseClosed
	_ = d.r.Close() // always nil: it only releases
	if run != nil {
		<-run.done // bounded: the abort
		d.zero.run = nil
		d.zero.cur.Store(nil)
	}
}

// Fail ends the DDP with err, as a failed step does (see DDP): the process group is aborted
// and every later Finalize returns the error, which Fail returns too. The first error
// counts: after an earlier failure Fail returns that one (ErrClosed after Close); a nil err
// changes nothing and returns Err. It is for adapters whose hooks cannot return an error
// (gorgoniaddp's GradHook).
func (d *DDP) Fail(err error) error {
	if err == nil {
		return d.Err()
	}
	return d.fail(err)
}

func (d *DDP) fail(err error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.failLocked(err)
}

// failLocked ends the DDP with err (the first error counts) and aborts the process group,
// so that peers waiting on this rank's collectives fail instead of hanging. d.mu must be
// held.
func (d *DDP) failLocked(err error) error {
	switch d.phase {
	case phaseFailed:
		return d.err
	case phaseClosed:
		return ErrClosed
	}
	err = fmt.Errorf("ddp: rank %d: %w", d.pg.Rank(), err)
	d.phase, d.err = phaseFailed, err
	d.failed.Store(true)
	d.log.Error("ddp: step failed; aborting the process group", zap.Int("rank", d.pg.Rank()), zap.Error(err))
	d.pg.Abort(err)
	if d.zero != nil && d.zero.run != nil {
		d.zero.run.halt() // Step or Close waits for it
	}
	return err
}
