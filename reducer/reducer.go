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
}

// Options configure a Reducer.
type Options struct {
	// BucketCapMB caps every bucket but the first, in MiB (default 25). AutoBucketCap lets
	// the reducer choose the layout from what it measures in the first synced passes
	// (Note [Auto buckets]); FirstBucketCapMB is then chosen too.
	BucketCapMB float64
	// FirstBucketCapMB caps the first bucket, in MiB (default 1), so that the first
	// all-reduce starts early in backward.
	FirstBucketCapMB float64
	// FindUnusedParameters: parameters that get no gradient in a synced backward are reduced
	// as zeros at Finalize (and listed in IterStats.Unused) instead of failing it.
	FindUnusedParameters bool
	// GradientAsBucketView: parameters' gradients live in the buckets (see GradView);
	// Finalize copies nothing back and Param.Grad is not used.
	GradientAsBucketView bool
	// CommHook reduces each bucket (default AllReduceHook). Its buckets hold the gradients
	// divided by the world size, unless it is a DividingHook that asks for them undivided.
	CommHook CommHook
	// Device: the gradients live in device memory (Note [Device buckets]). The group must
	// offer procgroup.Device (procgroup.FindDevice: the nccl backend, through any
	// wrappers); the buckets are allocated on the device, gradients are reported with
	// GradReadyDevice, and every Param.Grad is a procgroup.DeviceBuffer (or nil with
	// GradientAsBucketView).
	Device bool
	// Stream is the trainer's compute stream (with Device): the stream its backward
	// kernels produce the gradients on and its optimizer reads them from. The reducer
	// enqueues its copies there, and makes it wait for the buckets' all-reduces.
	Stream procgroup.Stream
	// Logger receives the rare log lines (layout, rebuild); nil means zap.NewNop().
	Logger *zap.Logger
}

// WithDefaults returns o with its zero fields set to their defaults: BucketCapMB 25,
// FirstBucketCapMB 1 (bucket.DefaultCapBytes and DefaultFirstCapBytes), CommHook
// AllReduceHook, Logger zap.NewNop(). It is the one place those defaults are set (package
// ddp fills its Options from it).
func (o Options) WithDefaults() Options {
	if o.BucketCapMB == 0 {
		o.BucketCapMB = float64(bucket.DefaultCapBytes) / (1 << 20)
	}
	if o.FirstBucketCapMB == 0 {
		o.FirstBucketCapMB = float64(bucket.DefaultFirstCapBytes) / (1 << 20)
	}
	if o.CommHook == nil {
		o.CommHook = AllReduceHook()
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	return o
}

func (o *Options) validate() error {
	*o = o.WithDefaults()
	if !(o.BucketCapMB > 0 || o.BucketCapMB == AutoBucketCap) || !(o.FirstBucketCapMB > 0) {
		return fmt.Errorf("%w: bucket caps %v MiB and first %v MiB, want both positive (or the cap AutoBucketCap)", ErrInvalidArgument, o.BucketCapMB, o.FirstBucketCapMB)
	}
	if o.BucketCapMB == AutoBucketCap && o.Device {
		return fmt.Errorf("%w: AutoBucketCap is not available with Options.Device yet: give BucketCapMB", ErrInvalidArgument)
	}
	return nil
}

func mib(mb float64) int64 {
	b := int64(mb * (1 << 20))
	if b < 1 {
		b = 1
	}
	return b
}

// slot is one bucket's driver state.
type slot struct {
	f32  []float32 // the flat buffer, one of the three: a slice of Reducer.mem on the host
	f64  []float64
	dev  procgroup.DeviceBuffer // with Options.Device, on Options.Stream
	view BucketView
	work procgroup.Work // the bucket's in-flight reduction, nil when not launched
	seen bool           // its completion was recorded in the stats
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
// call returns the same error.
type Reducer struct {
	pg      procgroup.ProcessGroup
	dev     procgroup.Device          // with Options.Device
	alloc   procgroup.BufferAllocator // host buckets from the group, when it offers them
	opts    Options
	log     *zap.Logger
	params  []Param
	bparams []bucket.Param
	inv32   float32 // 1 / world size
	inv64   float64

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
	auto     *autoTuner               // with AutoBucketCap
	retired  []procgroup.DeviceBuffer // device buckets of the layout before the rebuild, freed at Close
	late     []lateWork               // device collectives of earlier passes not yet seen complete
	mem      [2]hostMem               // the host buckets' memory (float32, float64; Note [Bucket memory])
	spare    [2]hostMem               // the memory of the layout before, while another rebuild is owed
}

// Note [Bucket memory]: a layout's host buckets of one element type are slices of one
// buffer (hostMem), each from a 64-byte boundary, so that the buffer's size is the same for
// every layout: the type's gradients plus 64 bytes per parameter. A rebuild needs the new
// buffer while it copies from the old one; the one before the old one is free by then, and
// while the Machine owes another rebuild it is kept and reused (cleared) instead of
// allocated, so that after the second rebuild no bucket memory is new. Under the auto
// sizing's three rebuilds (Note [Auto buckets]) fresh buckets meant fresh pages: at L=4
// h=512, two ranks on one host, three launches each (2026-12-04), steps 2 and 3 took
// 734–880 ms with new buffers and 507–679 ms reusing them, and the first step with the
// chosen layout took 37–139 ms longer than the median of the later ones (26–80 ms reusing
// them). Once no rebuild is owed the spare is dropped, so a job holds one layout's buckets,
// as before. The auto sizing's probe (before its first rebuild) runs on the memory that the
// rebuild then takes, held meanwhile as the spare. It used to run on a buffer of its own.
// At L=4 h=512 that buffer left each rank 50 MB larger for the rest of the job, and on
// the testbed at 10 Gbit/s auto's steps ran 1.03-1.04x those of cap 25 in the same layout
// (docs/DESIGN.md).

// hostMem is one layout's host memory for the buckets of one element type: from the group's
// BufferAllocator (shared), or an ordinary slice.
type hostMem struct {
	f32    []float32
	f64    []float64
	shared bool
}

// release gives shared memory back to the group; an ordinary slice is left to the collector.
func (m *hostMem) release(alloc procgroup.BufferAllocator) {
	if m.shared {
		if m.f32 != nil {
			alloc.FreeBuffer(m.f32)
		} else {
			alloc.FreeBuffer(m.f64)
		}
	}
	*m = hostMem{}
}

// bucketAlign is the boundary, in bytes, at which Note [Bucket memory] starts each bucket.
const bucketAlign = 64

// New returns a Reducer for params over pg with the initial bucket layout (Note [Bucket
// assignment] in package bucket). It issues no collective.
func New(pg procgroup.ProcessGroup, params []Param, opts Options) (*Reducer, error) {
	if pg == nil {
		return nil, fmt.Errorf("%w: nil process group", ErrInvalidArgument)
	}
	if err := opts.validate(); err != nil {
		return nil, err
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
	r.firstCap, r.capBytes = mib(opts.FirstBucketCapMB), mib(opts.BucketCapMB)
	rebuilds := 1
	if opts.BucketCapMB == AutoBucketCap {
		// The first pass runs PyTorch's default layout; then see Note [Auto buckets].
		r.capBytes = bucket.DefaultCapBytes
		if pg.Size() > 1 {
			r.auto = &autoTuner{}
			for _, p := range r.bparams {
				r.auto.total += p.Bytes()
			}
			rebuilds = autoPasses
		}
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
	r.order64 = make([]int64, len(params))
	if err := r.setLayout(r.m.Layout()); err != nil {
		r.freeDevice()
		return nil, err
	}
	r.log.Info("reducer: buckets assigned", zap.Int("rank", pg.Rank()), zap.Int("params", len(params)),
		zap.Int("buckets", len(buckets)), zap.Float64("bucket_cap_mb", opts.BucketCapMB), zap.Float64("first_bucket_cap_mb", opts.FirstBucketCapMB))
	return r, nil
}

// setLayout allocates the flat buffers of lay; in bucket-view mode it carries the gradients
// over from the old buffers, so that the views hold the same values after the rebuild.
// Device buckets are zeroed and carried over on the compute stream; the old ones are kept
// until Close (queued work may still use them, and freeing them now would need a host
// synchronisation).
func (r *Reducer) setLayout(lay *bucket.Layout) error {
	slots := make([]slot, len(lay.Buckets))
	var mem [2]hostMem
	var used [2]int // elements of mem handed out
	if r.dev == nil {
		n := r.hostElems()
		for t := range mem {
			if n[t] > 0 {
				mem[t] = r.hostMemFor(t, n[t])
			}
		}
	}
	for b, bk := range lay.Buckets {
		s := &slots[b]
		s.view = BucketView{Index: b, DType: procgroup.DType(bk.DType), Params: bk.Params, Offsets: bk.Offsets}
		switch {
		case r.dev != nil:
			d, err := r.dev.AllocDevice(procgroup.DType(bk.DType), bk.Len)
			if err == nil {
				d.Stream = r.opts.Stream
				err = r.dev.ZeroAsync(r.opts.Stream, d)
				r.retired = append(r.retired, d) // freed at Close
			}
			if err != nil {
				return fmt.Errorf("reducer: bucket %d (%d bytes) on the device: %w", b, bk.Bytes(), err)
			}
			s.dev = d
			s.view.Buffer, s.view.Device, s.view.Stream = d, r.dev, r.opts.Stream
		case bk.DType == procgroup.Float32:
			u := &used[0]
			s.f32 = mem[0].f32[*u : *u+bk.Len : *u+bk.Len]
			*u += (bk.Len + bucketAlign/4 - 1) &^ (bucketAlign/4 - 1)
			s.view.Buffer = s.f32
		default:
			u := &used[1]
			s.f64 = mem[1].f64[*u : *u+bk.Len : *u+bk.Len]
			*u += (bk.Len + bucketAlign/8 - 1) &^ (bucketAlign/8 - 1)
			s.view.Buffer = s.f64
		}
	}
	if r.lay != nil {
		for b := range r.slots {
			if d, ok := r.slots[b].view.Scratch.(procgroup.DeviceBuffer); ok {
				r.retired = append(r.retired, d)
			}
		}
		for i, from := range r.lay.Where {
			to, old, neu := lay.Where[i], &r.slots[r.lay.Where[i].Bucket], &slots[lay.Where[i].Bucket]
			switch {
			case r.dev != nil:
				if err := r.dev.ScaleAsync(r.opts.Stream, devView(neu.dev, to), devView(old.dev, from), 1, false); err != nil {
					return fmt.Errorf("reducer: rebuild: %w", err)
				}
			case old.f32 != nil:
				copy(bucket.View(neu.f32, to), bucket.View(old.f32, from))
			default:
				copy(bucket.View(neu.f64, to), bucket.View(old.f64, from))
			}
		}
	}
	// No collective uses the old buffers now; their views expire with the generation.
	for t := range r.mem {
		if r.m.rebuilds > 0 {
			r.spare[t] = r.mem[t]
		} else {
			r.mem[t].release(r.alloc)
		}
	}
	r.mem = mem
	r.lay, r.slots = lay, slots
	return nil
}

// hostElems is the number of elements of each type (float32, float64) of a layout's host
// bucket memory (Note [Bucket memory]): the same for every layout.
func (r *Reducer) hostElems() [2]int {
	var n [2]int
	for _, p := range r.bparams {
		t := typeIndex(p.DType)
		n[t] += p.Len + bucketAlign/p.DType.Size()
	}
	return n
}

// typeIndex is a host element type's index in Reducer.mem.
func typeIndex(dt procgroup.DType) int {
	if dt == procgroup.Float32 {
		return 0
	}
	return 1
}

// hostMemFor returns n elements of type t (0: float32, 1: float64) for a layout's buckets:
// the spare if it has them (cleared), else new memory (Note [Bucket memory]).
func (r *Reducer) hostMemFor(t, n int) hostMem {
	if sp := r.spare[t]; len(sp.f32) == n || len(sp.f64) == n {
		r.spare[t] = hostMem{}
		clear(sp.f32)
		clear(sp.f64)
		return sp
	}
	r.spare[t].release(r.alloc)
	var m hostMem
	if t == 0 {
		m.f32, m.shared = hostBuf[float32](r, procgroup.Float32, n)
	} else {
		m.f64, m.shared = hostBuf[float64](r, procgroup.Float64, n)
	}
	return m
}

// hostBuf returns n elements for a host buffer that is all-reduced (a bucket): from the
// group's allocator when it gives them (gloo: its shared arena, all-reduced in place; every
// rank allocates the same buckets in the same order), an ordinary slice otherwise; shared
// says which.
func hostBuf[T float32 | float64](r *Reducer, dt procgroup.DType, n int) (buf []T, shared bool) {
	if r.alloc != nil {
		if b, err := r.alloc.AllocBuffer(dt, n); err == nil && b != nil {
			if s, ok := b.([]T); ok {
				return s, true
			}
			r.alloc.FreeBuffer(b)
		}
	}
	return make([]T, n), false
}

// freeShared gives the buckets' shared memory back to the group, and the spare's.
func (r *Reducer) freeShared() {
	for t := range r.mem {
		r.mem[t].release(r.alloc)
		r.spare[t].release(r.alloc)
	}
}

// devView is bucket.View for a device bucket.
func devView(b procgroup.DeviceBuffer, loc bucket.Loc) procgroup.DeviceBuffer {
	return b.Slice(loc.Offset, loc.Offset+loc.Len)
}

// freeDevice releases every device bucket (Close), and the device scratch of the comm
// hooks (BucketView.Scratch holding a procgroup.DeviceBuffer).
func (r *Reducer) freeDevice() {
	if r.dev == nil {
		return
	}
	for _, d := range r.retired {
		_ = r.dev.FreeDevice(d)
	}
	r.retired = nil
	for b := range r.slots {
		if d, ok := r.slots[b].view.Scratch.(procgroup.DeviceBuffer); ok {
			_ = r.dev.FreeDevice(d)
			r.slots[b].view.Scratch = nil
		}
	}
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
// synced backward (with AutoBucketCap, up to 3 after the third). Slices from GradView belong
// to one generation.
func (r *Reducer) Generation() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.gen
}

// GradView returns parameter i's slot in its bucket: with GradientAsBucketView, the
// parameter's gradient itself (averaged after Finalize). It is a []float32 or []float64,
// valid until the Generation changes (in the first synced Finalize, and with AutoBucketCap
// in the second and third too); take it again after such a Finalize. The caller may read and write it between Finalize and the next
// BeginBackward only. After Close it fails with ErrClosed.
func (r *Reducer) GradView(i int) (any, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, ErrClosed
	}
	if i < 0 || i >= len(r.params) {
		return nil, fmt.Errorf("%w: GradView(%d): parameter index outside [0, %d)", ErrInvalidArgument, i, len(r.params))
	}
	loc := r.lay.Where[i]
	switch s := &r.slots[loc.Bucket]; {
	case r.dev != nil:
		return devView(s.dev, loc), nil
	case s.f32 != nil:
		return bucket.View(s.f32, loc), nil
	default:
		return bucket.View(s.f64, loc), nil
	}
}

// GradViewDevice is GradView with Options.Device: parameter i's slot in its device bucket,
// on Options.Stream. The caller's kernels may read and write it on that stream between
// Finalize and the next BeginBackward.
func (r *Reducer) GradViewDevice(i int) (procgroup.DeviceBuffer, error) {
	v, err := r.GradView(i)
	if err != nil {
		return procgroup.DeviceBuffer{}, err
	}
	d, ok := v.(procgroup.DeviceBuffer)
	if !ok {
		return procgroup.DeviceBuffer{}, fmt.Errorf("%w: GradViewDevice(%d): the buckets are in host memory (Options.Device is off)", ErrInvalidArgument, i)
	}
	return d, nil
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
// bucket slot, divided by the world size — or adds it there, after an Accumulate pass — and
// launches every bucket this completes, in bucket order. It never blocks on communication.
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
	dst := bucket.View(r.slots[a.Bucket].f32, r.lay.Where[i])
	scaleInto(dst, grad, r.inv32, a.Add)
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
	dst := bucket.View(r.slots[a.Bucket].f64, r.lay.Where[i])
	scaleInto(dst, grad, r.inv64, a.Add)
	r.afterCopy(i, acts[1:], t0)
	return nil
}

// GradReadyDevice is GradReady with Options.Device: grad is parameter i's gradient in device
// memory, produced on Options.Stream. It enqueues, on that stream, the copy of grad divided
// by the world size into the bucket slot (or its addition there, after an Accumulate pass)
// and launches every bucket this completes, in bucket order: the collective's stream waits,
// on the device, for the copies queued before it (Note [Device buckets]). It never waits on
// the host. grad may be overwritten by kernels queued on the stream after this call.
func (r *Reducer) GradReadyDevice(i int, grad procgroup.DeviceBuffer) error {
	t0 := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dev == nil {
		if r.closed {
			return ErrClosed
		}
		return r.failLocked(fmt.Errorf("%w: GradReadyDevice(%d) without Options.Device", ErrInvalidArgument, i))
	}
	if err := r.checkGrad(i, grad.Type, grad.Count); err != nil {
		return err
	}
	acts, err := r.m.GradReady(i)
	if err != nil {
		return r.afterMachineErr(err)
	}
	a := acts[0]
	inv := r.inv64
	if err := r.dev.ScaleAsync(r.opts.Stream, devView(r.slots[a.Bucket].dev, r.lay.Where[i]), grad, inv, a.Add); err != nil {
		return r.failLocked(fmt.Errorf("reducer: GradReadyDevice(%d): %w", i, err))
	}
	r.afterCopy(i, acts[1:], t0)
	return nil
}

// lateWork is a device bucket's collective that was still in flight when a later pass
// began (Note [Late failures]).
type lateWork struct {
	w      procgroup.Work
	iter   int // the backward pass that launched it
	bucket int
}

// Note [Late failures]: on the device path Finalize does not wait for the buckets'
// collectives (Note [Device buckets]), so those of synced pass k may still be in flight
// when pass k+1 begins, and fail later. BeginBackward moves the ones still in flight to
// Reducer.late before it clears the slots, and every BeginBackward and device Finalize
// after that checks them: one that has failed fails the Reducer with its error, one that
// has succeeded is dropped. So a failure reaches the trainer at the first such call after
// it happens (and the group's watchdog aborts the group meanwhile); Close waits for them
// too before it frees the buckets. The list is reused: no allocation once it has grown to
// the buckets in flight. The host path needs none of this: its Finalize waits for every
// bucket's collective and reports its error.

// checkLate drops the collectives of Reducer.late that have completed, and returns the
// error of the first that failed. r.mu must be held.
func (r *Reducer) checkLate() error {
	kept := r.late[:0]
	for _, l := range r.late {
		if !isDone(l.w) {
			kept = append(kept, l)
			continue
		}
		if err := l.w.Err(); err != nil {
			return fmt.Errorf("reducer: backward %d: bucket %d (found at backward %d): %w", l.iter, l.bucket, r.m.Iter(), err)
		}
	}
	clear(r.late[len(kept):])
	r.late = kept
	return nil
}

func isDone(w procgroup.Work) bool {
	select {
	case <-w.Done():
		return true
	default:
		return false
	}
}

// scaleInto sets dst to src·inv, or adds src·inv to it. With one rank inv is exactly 1.
func scaleInto[T float32 | float64](dst, src []T, inv T, add bool) {
	src = src[:len(dst)]
	switch {
	case add:
		for k, v := range src {
			dst[k] += v * inv
		}
	case inv == 1:
		copy(dst, src)
	default:
		for k, v := range src {
			dst[k] = v * inv
		}
	}
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
	s.work = r.opts.CommHook.Launch(context.Background(), r.pg, &s.view)
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
// GradientAsBucketView, in the views); after the first synced pass (with AutoBucketCap, each
// of the first three) it also rebuilds the buckets (Note [Rebuild], Note [Auto buckets]). After an Accumulate pass it returns at once: the running sum
// stays in the bucket slots (Param.Grad is not written until the next synced Finalize).
//
// It fails with an *UnusedError if parameters got no gradient (without
// FindUnusedParameters), with ErrMarkedTwice or a collective's error, or with ctx's error if
// ctx ends first; every failure aborts the process group (see Reducer).
func (r *Reducer) Finalize(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	now := time.Now()
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
				if r.auto != nil && st.Mode == Sync {
					r.auto.passDone(r, st)
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
	if err := r.opts.CommHook.Finish(&s.view); err != nil {
		return fmt.Errorf("reducer: backward %d: bucket %d: comm hook: %w", r.m.Iter(), b, err)
	}
	if r.opts.GradientAsBucketView {
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
		if s.f32 != nil {
			copy(r.params[i].Grad.([]float32), bucket.View(s.f32, loc))
		} else {
			copy(r.params[i].Grad.([]float64), bucket.View(s.f64, loc))
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
// they agree whatever their own hooks' order. This is done once (with AutoBucketCap, after
// each of the first three synced passes, Note [Auto buckets]): later passes keep the
// layout. It happens inside Finalize because Finalize has a ctx for the broadcast and is
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
