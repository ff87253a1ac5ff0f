package reducer

import (
	"context"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/procgroup"
)

// Param is one parameter the Reducer averages.
type Param struct {
	// Name appears in errors.
	Name string
	// Grad is where Finalize writes the averaged gradient: a []float32 or []float64, or with
	// Options.Device a procgroup.DeviceBuffer (Float32 or Float64). It sets the parameter's
	// element type and length. With Options.GradientAsBucketView it is not written and may
	// be nil, if DType and Len are set instead. No two Params' Grad may share memory (New
	// refuses them): a tensor used twice is one Param.
	Grad any
	// DType (Float32 or Float64) and Len describe a parameter whose Grad is nil.
	DType procgroup.DType
	Len   int
	// Shape is the parameter's shape, for a ShapedHook; nil means [Len]. Its product must
	// be the length.
	Shape []int
}

// slot is one bucket's driver state.
type slot struct {
	f32  []float32 // the flat buffer, one of the three: a slice of Reducer.mem on the host
	f64  []float64
	dev  procgroup.DeviceBuffer // with Options.Device, on Options.Stream
	view BucketView
	work procgroup.Work // the bucket's in-flight reduction, nil when not launched
	seen bool           // its completion was recorded in the stats
	sh   *shardBufs     // with Options.Shards (Note [Shards])
}

// Reducer averages gradients across the ranks of a ProcessGroup: the driver of a Machine.
//
// Use from one training loop: BeginBackward, then GradReady for each parameter as backward
// produces its gradient (from any goroutine, typically the one running backward; calls are
// serialized), then Finalize. Collectives are issued from GradReady and Finalize only, under
// the Reducer's lock, so they have the same order on every rank. Stats may be called at any
// time.
//
// Failure is final (docs/DESIGN.md, failure model): once an iteration fails — an unused
// or twice-marked parameter, a wrong gradient, a failed collective, Finalize's ctx ending —
// the ranks' collective sequences can no longer be trusted to match, so the Reducer aborts
// the process group with the error (peers fail at once instead of hanging) and every later
// call returns the same error. A *NonFiniteError from Finalize is not a failure (every rank
// gets it after the same collectives).
type Reducer struct {
	pg      procgroup.ProcessGroup
	dev     procgroup.Device          // with Options.Device
	hookDev DeviceStateHook           // the comm hook, if it keeps device state (released at Close)
	alloc   procgroup.BufferAllocator // host buckets from the group, when it offers them
	opts    Options
	log     *zap.Logger
	params  []Param
	bparams []bucket.Param
	inv32   float32 // 1 / world size (1 with Options.Shards: the fold divides)
	inv64   float64
	sh      *shardState // with Options.Shards (Note [Shards]); its step fields are guarded by mu
	check   bool        // the check for non-finite gradients is on (Note [Non-finite gradients])

	mu       sync.Mutex // guards the fields below
	m        *Machine
	lay      *bucket.Layout
	slots    []slot
	gen      int
	polled   int // the lowest launched bucket whose completion is not yet recorded
	stats    [2]IterStats
	cur      int // stats[cur] is being filled; stats[1-cur] is the last finished pass
	finished bool
	aborted  bool
	closed   bool
	order64  []int64 // the rebuild's broadcast buffer
	firstCap int64   // the caps of the current layout, in bytes
	capBytes int64
	auto     *autoTuner               // with AutoBucketCap or an AutoHook
	retired  []procgroup.DeviceBuffer // device buckets of the layout before the rebuild, freed at Close
	late     []lateWork               // device collectives of earlier passes not yet seen complete
	mem      [2]hostMem               // the host buckets' memory (float32, float64; Note [Bucket memory])
	spare    [2]hostMem               // the memory of the layout before, while another rebuild is owed
	fin      finiteState              // with check
}

// New returns a Reducer for params over pg with the initial bucket layout (Note [Bucket
// assignment] in package bucket). It issues no collective.
func New(pg procgroup.ProcessGroup, params []Param, opts Options) (*Reducer, error) {
	if pg == nil {
		return nil, fmt.Errorf("%w: nil process group", ErrInvalidArgument)
	}
	if err := opts.validate(); err != nil {
		return nil, err
	}
	if opts.Scattered && (opts.PadBuckets != pg.Size() || pg.Size() < 2) {
		return nil, fmt.Errorf("%w: Scattered needs PadBuckets equal to the world size (%d), got %d", ErrInvalidArgument, pg.Size(), opts.PadBuckets)
	}
	r := &Reducer{pg: pg, opts: opts, log: opts.Logger, params: append([]Param(nil), params...)}
	if opts.Device {
		dev, ok := procgroup.FindDevice(pg)
		if !ok {
			return nil, fmt.Errorf("%w: Options.Device needs a process group with device memory (procgroup.Device, for instance the nccl backend); %T has none", ErrInvalidArgument, pg)
		}
		r.dev = dev
	} else if a, ok := procgroup.Find[procgroup.BufferAllocator](pg); ok {
		r.alloc = a
	}
	r.bparams = make([]bucket.Param, len(params))
	for i, p := range r.params {
		dt, n := p.DType, p.Len
		_, onDev := p.Grad.(procgroup.DeviceBuffer)
		if p.Grad != nil && onDev != opts.Device {
			if opts.Device {
				return nil, fmt.Errorf("%w: parameter %d (%s): Grad is %T; with Options.Device it must be a procgroup.DeviceBuffer", ErrInvalidArgument, i, p.Name, p.Grad)
			}
			return nil, fmt.Errorf("%w: parameter %d (%s): Grad is a procgroup.DeviceBuffer; set Options.Device (and Stream) for device gradients", ErrInvalidArgument, i, p.Name)
		}
		if p.Grad != nil {
			gdt, gn, err := procgroup.DTypeOf(p.Grad)
			if err != nil {
				return nil, fmt.Errorf("%w: parameter %d (%s): %w", ErrInvalidArgument, i, p.Name, err)
			}
			if (dt != 0 && dt != gdt) || (n != 0 && n != gn) {
				return nil, fmt.Errorf("%w: parameter %d (%s): Grad is %v×%d but DType, Len say %v×%d", ErrInvalidArgument, i, p.Name, gdt, gn, dt, n)
			}
			dt, n = gdt, gn
		} else if !opts.GradientAsBucketView {
			return nil, fmt.Errorf("%w: parameter %d (%s): nil Grad (allowed only with GradientAsBucketView)", ErrInvalidArgument, i, p.Name)
		}
		if dt != procgroup.Float32 && dt != procgroup.Float64 {
			return nil, fmt.Errorf("%w: parameter %d (%s): element type %v, want float32 or float64", ErrInvalidArgument, i, p.Name, dt)
		}
		if n < 0 {
			return nil, fmt.Errorf("%w: parameter %d (%s): negative length %d", ErrInvalidArgument, i, p.Name, n)
		}
		r.params[i].DType, r.params[i].Len = dt, n
		r.bparams[i] = bucket.Param{Name: p.Name, DType: dt, Len: n}
	}
	if err := checkOverlap(r.params); err != nil {
		return nil, err
	}
	var err error
	if r.hookDev, err = setupHook(opts, r.params, pg.Size(), r.dev); err != nil {
		return nil, err
	}
	created := false
	defer func() {
		if !created && r.hookDev != nil {
			r.hookDev.ReleaseDevice()
		}
	}()
	r.firstCap, r.capBytes = mib(opts.FirstBucketCapMB), mib(opts.BucketCapMB)
	rebuilds := 1
	ah, _ := opts.CommHook.(*autoHook)
	if opts.BucketCapMB == AutoBucketCap {
		// The first pass runs PyTorch's default layout; then see Note [Auto buckets].
		r.capBytes = bucket.DefaultCapBytes
	}
	if (opts.BucketCapMB == AutoBucketCap || ah != nil) && pg.Size() > 1 {
		// With fixed caps and an AutoHook, the same passes measure for the hook alone
		// (Note [Auto hook]).
		r.auto = &autoTuner{hook: ah, fixed: opts.BucketCapMB != AutoBucketCap}
		for _, p := range r.bparams {
			r.auto.total += p.Bytes()
		}
		rebuilds = autoPasses
	}
	buckets, err := bucket.Assign(r.bparams, r.firstCap, r.capBytes)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidArgument, err)
	}
	r.m, err = NewMachine(MachineConfig{Params: r.bparams, Buckets: buckets, FindUnusedParameters: opts.FindUnusedParameters, Rebuilds: rebuilds})
	if err != nil {
		return nil, err
	}
	r.inv32, r.inv64 = 1/float32(pg.Size()), 1/float64(pg.Size())
	if h, ok := opts.CommHook.(DividingHook); ok && h.DividesByWorldSize() {
		r.inv32, r.inv64 = 1, 1 // the hook averages the local sums itself
	}
	if opts.Shards > 0 {
		if err := CheckShards(opts.Shards, pg.Size()); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidArgument, err)
		}
		r.sh = newShardState(opts.Shards, pg.Rank(), pg.Size())
		r.inv32, r.inv64 = 1, 1 // each shard's gradient is kept as it is; the fold divides
	}
	r.order64 = make([]int64, len(params))
	if r.check = !opts.NoFiniteCheck && !opts.Device; r.check {
		r.fin.localBad, r.fin.reducedBad = make([]bool, len(params)), make([]bool, len(params))
	}
	if err := r.setLayout(r.m.Layout()); err != nil {
		r.freeDevice()
		return nil, err
	}
	r.log.Info("reducer: buckets assigned", zap.Int("rank", pg.Rank()), zap.Int("params", len(params)),
		zap.Int("buckets", len(buckets)), zap.Float64("bucket_cap_mb", opts.BucketCapMB), zap.Float64("first_bucket_cap_mb", opts.FirstBucketCapMB))
	created = true
	return r, nil
}

// setupHook checks the parameters' shapes and gives them to a ShapedHook. It returns the
// hook if it was set up and keeps device state, which the reducer must release.
func setupHook(opts Options, params []Param, world int, dev procgroup.Device) (DeviceStateHook, error) {
	h, ok := opts.CommHook.(ShapedHook)
	if !ok || opts.Shards > 0 {
		return nil, nil
	}
	hp := make([]HookParam, len(params))
	for i, p := range params {
		shape := p.Shape
		if shape == nil {
			shape = []int{p.Len}
		}
		size := 1
		for _, d := range shape {
			if d < 0 {
				return nil, fmt.Errorf("%w: parameter %d (%s): negative dimension in shape %v", ErrInvalidArgument, i, p.Name, shape)
			}
			size *= d
		}
		if size != p.Len {
			return nil, fmt.Errorf("%w: parameter %d (%s): shape %v holds %d elements but the parameter has %d", ErrInvalidArgument, i, p.Name, shape, size, p.Len)
		}
		hp[i] = HookParam{Name: p.Name, DType: p.DType, Shape: shape}
	}
	setup := HookSetup{Params: hp, Device: opts.Device, WorldSize: world}
	if opts.Device {
		setup.DeviceOps, setup.Stream = dev, opts.Stream
	}
	if err := h.Setup(setup); err != nil {
		return nil, fmt.Errorf("%w: CommHook %s: %w", ErrInvalidArgument, DescribeHook(h), err)
	}
	ds, _ := h.(DeviceStateHook)
	return ds, nil
}

// Size returns the world size.
func (r *Reducer) Size() int { return r.pg.Size() }

// Buckets returns the current bucket layout (read only).
func (r *Reducer) Buckets() []bucket.Bucket {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lay.Buckets
}

// Generation counts the bucket layouts: 0 at New, 1 after the rebuild that follows the first
// synced backward (with AutoBucketCap or an AutoHook, up to 3 after the third). Slices from
// GradView belong to one generation.
func (r *Reducer) Generation() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.gen
}

// Accumulated reports whether Accumulate passes since the last synced Finalize left
// gradients in the buckets, which the next synced pass adds to.
func (r *Reducer) Accumulated() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.m.Accumulated()
}

// fail ends the reducer with err and aborts the process group (see Reducer).
// r.mu must be held.
func (r *Reducer) failLocked(err error) error {
	err = r.m.Fail(err)
	if !r.aborted {
		r.aborted = true
		r.log.Error("reducer: iteration failed; aborting the process group", zap.Int("rank", r.pg.Rank()), zap.Error(err))
		r.pg.Abort(err)
	}
	return err
}

// BeginBackward starts a backward pass: Sync to reduce this pass (plus what Accumulate passes
// left), Accumulate to add this pass's gradients up locally (NoSync). It fails with an
// *UnusedError, naming the parameters, if the previous synced pass never got all its
// gradients and was not finalized. It does not block.
func (r *Reducer) BeginBackward(mode Mode) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	if r.sh != nil {
		return fmt.Errorf("%w: BeginBackward with Options.Shards: begin each shard's pass with BeginShard", ErrInvalidArgument)
	}
	return r.beginLocked(mode)
}

// beginLocked is BeginBackward's work. r.mu must be held.
func (r *Reducer) beginLocked(mode Mode) error {
	if a := r.auto; a != nil && a.hook != nil && a.hook.restored != nil && !a.decided {
		if err := a.adopt(r); err != nil { // Note [Auto hook checkpoints]
			return r.failLocked(err)
		}
	}
	if err := r.m.BeginBackward(mode); err != nil {
		return r.afterMachineErr(err)
	}
	if r.dev != nil { // Finalize did not wait on the host: Note [Late failures]
		if err := r.checkLate(); err != nil {
			return r.failLocked(err)
		}
		for b := range r.slots {
			w := r.slots[b].work
			switch {
			case w == nil:
			case !isDone(w):
				r.late = append(r.late, lateWork{w: w, iter: r.m.Iter() - 1, bucket: b})
			case w.Err() != nil:
				return r.failLocked(fmt.Errorf("reducer: backward %d: bucket %d: %w", r.m.Iter()-1, b, w.Err()))
			}
		}
	}
	if r.finished { // publish the finished pass's stats; fill the other buffer
		r.cur = 1 - r.cur
	} // else an Accumulate pass was not finalized: its stats are dropped
	r.finished = false
	r.stats[r.cur].reset(r.m.Iter(), mode, r.gen, time.Now(), len(r.params), len(r.slots))
	for b := range r.slots {
		r.slots[b].work, r.slots[b].seen = nil, false
		r.stats[r.cur].BucketBytes[b] = r.lay.Buckets[b].Bytes()
	}
	r.polled = 0
	return nil
}

// GradReady copies parameter i's freshly computed gradient (a float32 parameter's) into its
// bucket slot, divided by the world size — or adds it there, after an Accumulate pass; with
// Options.Shards it copies it, undivided, into the running shard's buffer — and launches
// every bucket this completes, in bucket order. It never blocks on communication.
// grad is only read, and may be reused once GradReady returns.
func (r *Reducer) GradReady(i int, grad []float32) error {
	t0 := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.checkGrad(i, procgroup.Float32, len(grad)); err != nil {
		return err
	}
	if r.dev != nil {
		return r.failLocked(fmt.Errorf("%w: GradReady(%d) with Options.Device: report device gradients with GradReadyDevice", ErrInvalidArgument, i))
	}
	acts, err := r.m.GradReady(i)
	if err != nil {
		return r.afterMachineErr(err)
	}
	a := acts[0] // always the copy
	s := &r.slots[a.Bucket]
	buf, add := s.f32, a.Add
	if s.sh != nil { // the running shard's own buffer, overwritten (Note [Shards])
		buf, add = s.sh.in32[r.sh.cur*len(buf):][:len(buf)], false
	}
	if r.check {
		r.noteLocal(i, scaleCheck(bucket.View(buf, r.lay.Where[i]), grad, r.inv32, add))
	} else {
		scaleInto(bucket.View(buf, r.lay.Where[i]), grad, r.inv32, add)
	}
	r.afterCopy(i, acts[1:], t0)
	return nil
}

// GradReady64 is GradReady for a float64 parameter.
func (r *Reducer) GradReady64(i int, grad []float64) error {
	t0 := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.checkGrad(i, procgroup.Float64, len(grad)); err != nil {
		return err
	}
	if r.dev != nil {
		return r.failLocked(fmt.Errorf("%w: GradReady64(%d) with Options.Device: report device gradients with GradReadyDevice", ErrInvalidArgument, i))
	}
	acts, err := r.m.GradReady(i)
	if err != nil {
		return r.afterMachineErr(err)
	}
	a := acts[0]
	s := &r.slots[a.Bucket]
	buf, add := s.f64, a.Add
	if s.sh != nil {
		buf, add = s.sh.in64[r.sh.cur*len(buf):][:len(buf)], false
	}
	if r.check {
		r.noteLocal(i, scaleCheck(bucket.View(buf, r.lay.Where[i]), grad, r.inv64, add))
	} else {
		scaleInto(bucket.View(buf, r.lay.Where[i]), grad, r.inv64, add)
	}
	r.afterCopy(i, acts[1:], t0)
	return nil
}

// checkGrad validates a GradReady call's arguments. r.mu must be held.
func (r *Reducer) checkGrad(i int, dt procgroup.DType, n int) error {
	if r.closed {
		return ErrClosed
	}
	if err := r.m.Err(); err != nil {
		return err
	}
	if i < 0 || i >= len(r.params) {
		return r.failLocked(fmt.Errorf("%w: GradReady(%d): parameter index outside [0, %d)", ErrInvalidArgument, i, len(r.params)))
	}
	if p := &r.params[i]; p.DType != dt || p.Len != n {
		return r.failLocked(fmt.Errorf("%w: GradReady(%d): gradient of parameter %s is %v×%d, want %v×%d", ErrInvalidArgument, i, p.Name, dt, n, p.DType, p.Len))
	}
	return nil
}

// afterMachineErr turns a Machine error into the call's: a call out of turn leaves the
// iteration intact; anything else has failed it. r.mu must be held.
func (r *Reducer) afterMachineErr(err error) error {
	if r.m.Err() == nil {
		return err
	}
	return r.failLocked(err)
}

// afterCopy records the stats of gradient i, reported at t0, then launches buckets.
// It reads the clock once, or twice if it launches. r.mu must be held.
func (r *Reducer) afterCopy(i int, launches []Action, t0 time.Time) {
	st := &r.stats[r.cur]
	t1 := time.Now()
	st.GradReady[i] = t0.Sub(st.Start)
	st.CopyTime += t1.Sub(t0)
	end := t1
	if len(launches) > 0 {
		st.BucketReady[r.lay.Where[i].Bucket] = t1.Sub(st.Start)
		for _, a := range launches {
			end = r.launch(a.Bucket, t1)
		}
	}
	r.poll(end)
	st.HookTime += end.Sub(t0)
}

// launch performs ActLaunch for bucket b, which became ready at now, and returns the time
// it was launched. r.mu must be held.
func (r *Reducer) launch(b int, now time.Time) time.Time {
	st := &r.stats[r.cur]
	s := &r.slots[b]
	if st.BucketReady[b] < 0 {
		st.BucketReady[b] = now.Sub(st.Start)
	}
	// The hook's ctx: GradReady has none to give. The group's Timeout bounds each
	// collective, and Finalize's ctx bounds the wait for them (the group is aborted if it
	// ends first).
	// The launch time is taken before the call: a collective may complete inside it, and
	// its exact completion time (finishedAt) must not come before its launch.
	t := time.Now()
	if s.sh != nil {
		s.work = r.launchShards(s)
	} else {
		s.work = r.opts.CommHook.Launch(context.Background(), r.pg, &s.view)
	}
	st.BucketLaunched[b] = t.Sub(st.Start)
	return t
}

// finishedAt is when w completed, if it records that (procgroup.CompletedAt), else seen: the
// moment its completion was noticed, an upper bound.
func finishedAt(w procgroup.Work, seen time.Time) time.Time {
	if t, ok := procgroup.CompletedAt(w); ok && t.Before(seen) {
		return t
	}
	return seen
}

// poll records the finish time of the launched buckets seen complete at now, in order.
// r.mu must be held.
func (r *Reducer) poll(now time.Time) {
	st := &r.stats[r.cur]
	for r.polled < len(r.slots) {
		s := &r.slots[r.polled]
		if s.work == nil {
			return
		}
		select {
		case <-s.work.Done():
		default:
			return
		}
		st.BucketFinished[r.polled] = max(finishedAt(s.work, now).Sub(st.Start), st.BucketLaunched[r.polled])
		s.seen = true
		r.polled++
	}
}

// Finalize ends the backward pass. After a synced pass it launches the buckets left (with
// FindUnusedParameters, those of unused parameters, reduced as zeros), waits for every
// bucket, and leaves the averaged gradients in each Param.Grad (or, with
// GradientAsBucketView, in the views); after the first synced pass (with AutoBucketCap or
// an AutoHook, each of the first three) it also rebuilds the buckets (Note [Rebuild], Note
// [Auto buckets]). After an Accumulate pass it returns at once: the running sum
// stays in the bucket slots (Param.Grad is not written until the next synced Finalize).
//
// It fails with an *UnusedError if parameters got no gradient (without
// FindUnusedParameters), with ErrMarkedTwice or a collective's error, or with ctx's error if
// ctx ends first; every failure aborts the process group (see Reducer).
//
// After a synced pass whose averaged gradients hold a NaN or an infinity it returns a
// *NonFiniteError, the same on every rank, naming the ranks and parameters they came from
// (Note [Non-finite gradients]). That is not a failure: the pass is over, the gradients
// are left as reduced (non-finite values included; do not step the optimizer on them), and
// the next BeginBackward may follow.
func (r *Reducer) Finalize(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	now := time.Now()
	if r.sh != nil {
		if err := r.checkShardsRun(); err != nil {
			return err
		}
	}
	acts, err := r.m.Finalize()
	if err != nil {
		return r.afterMachineErr(err)
	}
	st := &r.stats[r.cur]
	st.BackwardEnd = now.Sub(st.Start)
	st.Unused = append(st.Unused[:0], r.m.Unused()...)
	for b := 0; ; b++ {
		for _, a := range acts {
			switch a.Kind {
			case ActZero:
				loc := r.lay.Where[a.Param]
				switch s := &r.slots[a.Bucket]; {
				case r.dev != nil:
					if err := r.dev.ZeroAsync(r.opts.Stream, devView(s.dev, loc)); err != nil {
						return r.failLocked(fmt.Errorf("reducer: backward %d: zeroing unused parameter %d: %w", r.m.Iter(), a.Param, err))
					}
				case s.f32 != nil:
					clear(bucket.View(s.f32, loc))
				default:
					clear(bucket.View(s.f64, loc))
				}
			case ActLaunch:
				r.launch(a.Bucket, now)
			case ActUnpack:
				t0 := time.Now()
				if err := r.unpack(a.Bucket); err != nil {
					return r.failLocked(err)
				}
				st.UnpackTime += time.Since(t0)
			case ActRebuild:
				if err := r.rebuild(ctx); err != nil {
					return r.failLocked(err)
				}
			case ActDone:
				if err := r.checkLate(); err != nil {
					return r.failLocked(err)
				}
				st.FinalizeEnd = time.Since(st.Start)
				r.finished = true
				if r.sh != nil {
					r.sh.endStep()
				}
				if r.auto != nil && st.Mode == Sync {
					r.auto.passDone(r, st)
				}
				if r.check && st.Mode == Sync {
					// Note [Non-finite gradients]: a *NonFiniteError leaves the Reducer
					// usable; a failed AllGather of the flags does not.
					if nf, err := r.endStepFinite(ctx); err != nil {
						return r.failLocked(err)
					} else if nf != nil {
						return nf
					}
				}
				return nil
			}
		}
		// Wait for the next bucket, in order.
		s := &r.slots[b]
		if r.dev != nil {
			// Note [Device buckets]: the compute stream waits, on the device, for the
			// bucket's collective; the host goes on.
			werr := r.dev.WaitWork(r.opts.Stream, s.work)
			if acts, err = r.m.BucketDone(b, werr); err != nil {
				return r.failLocked(err)
			}
			continue
		}
		// Wait without the lock, so that Stats (and Close, which aborts) are not held up.
		// Any other call meanwhile is out of turn and the Machine refuses it.
		r.mu.Unlock()
		werr := s.work.Wait(ctx)
		r.mu.Lock()
		if r.closed { // Close ran meanwhile: the buckets may be gone
			return ErrClosed
		}
		if werr != nil && ctx.Err() != nil && s.work.Err() == nil {
			return r.failLocked(fmt.Errorf("reducer: backward %d: Finalize: waiting for bucket %d: %w", r.m.Iter(), b, werr))
		}
		if !s.seen {
			st.BucketFinished[b] = max(finishedAt(s.work, time.Now()).Sub(st.Start), st.BucketLaunched[b])
			s.seen = true
			r.polled = b + 1
		}
		acts, err = r.m.BucketDone(b, werr)
		if err != nil {
			return r.failLocked(err)
		}
	}
}

// unpack finishes bucket b's reduction: the hook's Finish, then (unless the gradients are
// bucket views) the copy of the averaged gradients back into each Param.Grad.
// r.mu must be held.
func (r *Reducer) unpack(b int) error {
	s := &r.slots[b]
	if s.sh != nil {
		r.foldShards(s)
	} else if err := r.opts.CommHook.Finish(&s.view); err != nil {
		return fmt.Errorf("reducer: backward %d: bucket %d: comm hook: %w", r.m.Iter(), b, err)
	}
	if r.opts.GradientAsBucketView {
		if r.check {
			r.checkBucket(b)
		}
		return nil
	}
	for _, i := range r.lay.Buckets[b].Params {
		loc := r.lay.Where[i]
		if r.dev != nil {
			if err := r.dev.ScaleAsync(r.opts.Stream, r.params[i].Grad.(procgroup.DeviceBuffer), devView(s.dev, loc), 1, false); err != nil {
				return fmt.Errorf("reducer: backward %d: bucket %d: copy back: %w", r.m.Iter(), b, err)
			}
			continue
		}
		var finite bool // the view just copied, read again while it is in cache
		if s.f32 != nil {
			v := bucket.View(s.f32, loc)
			copy(r.params[i].Grad.([]float32), v)
			lo, hi := r.checkedPart(loc, len(s.f32))
			finite = !r.check || allFinite(v[lo:hi])
		} else {
			v := bucket.View(s.f64, loc)
			copy(r.params[i].Grad.([]float64), v)
			lo, hi := r.checkedPart(loc, len(s.f64))
			finite = !r.check || allFinite(v[lo:hi])
		}
		if !finite {
			r.noteReduced(i)
		}
	}
	return nil
}

// rebuild performs ActRebuild (Note [Rebuild]). r.mu must be held.
//
// Note [Rebuild]: the initial buckets follow reverse registration order, a guess at the
// order backward produces gradients in. At the end of the first synced Finalize, after
// every bucket of that pass is reduced, every rank issues one Broadcast from rank 0 of
// rank 0's observed grad-ready order (parameters that got no gradient follow, in reverse
// registration order), and all ranks rebuild their buckets from it with the same caps, so
// they agree whatever their own hooks' order. This is done once (with AutoBucketCap or an
// AutoHook, after each of the first three synced passes, Note [Auto buckets]): later
// passes keep the layout. It happens inside Finalize because Finalize has a ctx for the broadcast and is
// already a point every rank reaches in step. In bucket-view mode the averaged gradients
// are carried over into the new buffers and Generation is incremented, so views taken
// before must be taken again; if the order reproduces the current layout nothing changes.
func (r *Reducer) rebuild(ctx context.Context) error {
	var agreed []int
	if r.auto == nil || r.auto.order == nil {
		order := r.m.Order()
		for k, i := range order {
			r.order64[k] = int64(i)
		}
		if err := r.pg.Broadcast(ctx, r.order64, 0).Wait(ctx); err != nil {
			return fmt.Errorf("reducer: rebuild: broadcast of rank 0's grad-ready order: %w", err)
		}
		agreed = make([]int, len(r.order64))
		for k, i := range r.order64 {
			agreed[k] = int(i)
		}
	}
	if r.auto != nil {
		if err := r.auto.rebuild(ctx, r, agreed); err != nil {
			return err
		}
		agreed = r.auto.order
	}
	buckets, err := bucket.AssignOrdered(r.bparams, agreed, r.firstCap, r.capBytes)
	if err != nil {
		return fmt.Errorf("reducer: rebuild from rank 0's order: %w", err)
	}
	if sameBuckets(buckets, r.lay.Buckets) {
		if r.m.rebuilds == 0 {
			for t := range r.spare {
				r.spare[t].release(r.alloc)
			}
		}
		return nil
	}
	if err := r.m.SetBuckets(buckets); err != nil {
		return fmt.Errorf("reducer: rebuild: %w", err)
	}
	if err := r.setLayout(r.m.Layout()); err != nil {
		return fmt.Errorf("reducer: rebuild: %w", err)
	}
	r.gen++
	r.log.Info("reducer: buckets rebuilt from the observed grad-ready order", zap.Int("rank", r.pg.Rank()),
		zap.Int("buckets", len(buckets)), zap.Int("generation", r.gen), zap.Int64("first_cap_bytes", r.firstCap), zap.Int64("cap_bytes", r.capBytes))
	return nil
}

func sameBuckets(a, b []bucket.Bucket) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if len(a[k].Params) != len(b[k].Params) {
			return false
		}
		for j := range a[k].Params {
			if a[k].Params[j] != b[k].Params[j] {
				return false
			}
		}
	}
	return true
}

// Stats returns the measurements of the last finalized backward pass, or nil before the
// first. The IterStats is reused: it stays valid until the second BeginBackward from now;
// Clone it to keep it longer. Do not modify it.
func (r *Reducer) Stats() *IterStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.finished {
		return &r.stats[r.cur]
	}
	if s := &r.stats[1-r.cur]; s.Iter > 0 {
		return s
	}
	return nil
}

// Close releases the Reducer; later calls fail with ErrClosed. If a synced pass is in
// progress, its collectives can no longer be matched by this rank, so Close aborts the
// process group (its peers fail instead of hanging). It does not close the group, which
// belongs to the caller. Buckets the group handed out (procgroup.BufferAllocator) go back
// to it: GradView slices of them read as zeros afterwards. It is idempotent and returns
// nil.
func (r *Reducer) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	if r.m.Busy() && !r.aborted {
		r.aborted = true
		r.pg.Abort(fmt.Errorf("reducer: closed during backward %d", r.m.Iter()))
	}
	if r.dev != nil || r.alloc != nil {
		// Device buckets, and buckets the group handed out, may still be read or written by
		// queued work: wait for the collectives on the host (and, on a device, for the
		// compute stream), then free them.
		for b := range r.slots {
			if w := r.slots[b].work; w != nil {
				<-w.Done() // bounded: the group's timeout, or the abort above
			}
		}
		for _, l := range r.late {
			<-l.w.Done()
		}
		r.late = nil
	}
	if r.dev != nil {
		_ = r.dev.SyncStream(r.opts.Stream)
		r.freeDevice()
	}
	if r.alloc != nil {
		r.freeShared()
	}
	return nil
}
