package reducer

import (
	"context"
	"fmt"

	"github.com/goddp/goddp/procgroup"
)

// BucketView is what a CommHook sees of one bucket. It lives as long as the bucket layout
// (until the rebuild), so a hook may keep per-bucket state in Scratch across iterations.
type BucketView struct {
	// Index is the bucket's launch position.
	Index int
	// DType is Float32 or Float64; Buffer is the bucket's flat []float32 or []float64 (or,
	// with Options.Device, a procgroup.DeviceBuffer on Stream), holding every gradient
	// already divided by the world size, so a plain sum over ranks is the average (for a
	// DividingHook that asks for it, this rank's gradients undivided instead). The hook
	// owns Buffer from Launch until its Work completes and must leave the reduced result in
	// it by the end of Finish (for a device bucket: enqueued on Stream by then).
	DType  procgroup.DType
	Buffer any
	// Device and Stream are set for a device bucket (Options.Device): the group's device
	// operations and the trainer's compute stream. Before Finish, the reducer has made
	// Stream wait for the Work that Launch returned; Finish enqueues its work on Stream.
	Device procgroup.Device
	Stream procgroup.Stream
	// Params and Offsets say which parameter sits where in Buffer (in elements).
	Params  []int
	Offsets []int
	// Scratch is the hook's own: the reducer never reads it and resets it at the rebuild. A
	// procgroup.DeviceBuffer in it is freed by the reducer (at the rebuild and at Close).
	Scratch any
}

// CommHook reduces buckets. The reducer calls Launch once per bucket per synced backward,
// in bucket order (Note [Bucket order]) and possibly from the goroutine that runs backward:
// Launch must issue its collectives and return their Work at once, without blocking. Once
// that Work has completed without error, the reducer calls Finish, from Finalize, for the
// hook to post-process the result into b.Buffer (decompress, say). Every rank must issue
// the same collectives for the same bucket.
//
// The buckets a hook gets hold the gradients already divided by the world size, so that
// the sum over ranks is the average: unlike PyTorch's DDP, whose hooks get the gradients
// undivided and divide themselves (allreduce_hook divides by the world size, then
// all-reduces). A hook ported from PyTorch as it is would return the average divided by
// the world size once more; it should either drop its division or be a DividingHook.
type CommHook interface {
	Launch(ctx context.Context, pg procgroup.ProcessGroup, b *BucketView) procgroup.Work
	Finish(b *BucketView) error
}

// DividingHook is the optional interface of a CommHook that divides by the world size
// itself, as PyTorch's hooks do. If DividesByWorldSize reports true (the reducer asks once,
// at New), the reducer does not divide: a bucket holds this rank's gradients as they are
// (after NoSync passes, their sum over the window), and the hook must leave their average
// over the ranks in Buffer by the end of Finish, for instance by dividing by
// pg.Size() in Launch and then all-reducing the sum. A CommHook that is not a DividingHook,
// or reports false, gets its buckets divided, as before.
type DividingHook interface {
	CommHook
	DividesByWorldSize() bool
}

// HookParam is what a ShapedHook learns of one parameter at New.
type HookParam struct {
	Name  string
	DType procgroup.DType
	// Shape is the parameter's shape (Param.Shape; [Len] when that is nil).
	Shape []int
}

// HookSetup is what the reducer tells a ShapedHook at New.
type HookSetup struct {
	// Params are the parameters, indexed as BucketView.Params indexes them.
	Params []HookParam
	// Device: the buckets live in device memory (Options.Device); DeviceOps are then the
	// group's device operations (found with procgroup.FindDevice, possibly also a
	// procgroup.DeviceBLAS) and Stream is Options.Stream, on which the hook's device work
	// goes. A hook may allocate device memory at Setup; if it implements
	// DeviceStateHook, the reducer has it released at Close (or when New fails after
	// Setup).
	Device    bool
	DeviceOps procgroup.Device
	Stream    procgroup.Stream
	WorldSize int
}

// DeviceStateHook is the optional interface of a ShapedHook that keeps device memory of
// its own from Setup on (PowerSGDHook on device buckets). The reducer calls
// ReleaseDevice once no queued work uses it any more: at Close, after the compute stream
// has drained, or when New fails after Setup. It must be safe to call more than once.
type DeviceStateHook interface {
	ShapedHook
	ReleaseDevice()
}

// ShapedHook is the optional interface of a CommHook that needs to know the parameters
// (their shapes, say, to treat each as a matrix: PowerSGDHook). The reducer calls Setup
// once, at New, before any Launch; an error fails New. A bucket rebuild does not call it
// again: the parameters stay the same.
type ShapedHook interface {
	CommHook
	Setup(s HookSetup) error
}

// DescribedHook is the optional interface of a CommHook that says what it is and with
// which settings, in a line such as "powersgd(rank 2, …)". Package ddp's check at New
// compares DescribeHook's line across the ranks, which must all run the same hook.
type DescribedHook interface {
	CommHook
	Describe() string
}

// DescribeHook is h's Describe line if it is a DescribedHook (the hooks of this package
// are: "allreduce", "fp16", "bf16", "powersgd(…)"), else its Go type.
func DescribeHook(h CommHook) string {
	if h == nil {
		return "allreduce"
	}
	if d, ok := h.(DescribedHook); ok {
		return d.Describe()
	}
	return fmt.Sprintf("%T", h)
}

// AllReduceHook is the default hook: one all-reduce (sum) of the bucket's buffer.
func AllReduceHook() CommHook { return allReduceHook{} }

type allReduceHook struct{}

func (allReduceHook) Launch(ctx context.Context, pg procgroup.ProcessGroup, b *BucketView) procgroup.Work {
	return pg.AllReduce(ctx, b.Buffer, procgroup.Sum)
}

func (allReduceHook) Finish(*BucketView) error { return nil }

func (allReduceHook) Describe() string { return "allreduce" }

// FP16CompressHook casts the (pre-divided) bucket to IEEE half precision, all-reduces it, and
// casts the sum back: half the bytes on the wire, about 3 significant digits kept, and values
// beyond ±65504 overflow to infinity.
func FP16CompressHook() CommHook {
	return compressHook[procgroup.F16]{name: "fp16", narrow: procgroup.F16FromFloat32, widen: procgroup.F16.Float32}
}

// BF16CompressHook is FP16CompressHook with bfloat16: float32's range, about 2 significant
// digits.
func BF16CompressHook() CommHook {
	return compressHook[procgroup.BF16]{name: "bf16", narrow: procgroup.BF16FromFloat32, widen: procgroup.BF16.Float32}
}

type compressHook[H procgroup.F16 | procgroup.BF16] struct {
	name   string
	narrow func(float32) H
	widen  func(H) float32
}

func (h compressHook[H]) Describe() string { return h.name }

// scratch returns the bucket's compressed buffer, allocated on the bucket's first launch,
// as a slice and as the interface value that boxes it (passing the slice itself to
// AllReduce would allocate a new box on every launch).
func (h compressHook[H]) scratch(b *BucketView, n int) ([]H, any) {
	if s, ok := b.Scratch.([]H); ok && len(s) == n {
		return s, b.Scratch
	}
	s := make([]H, n)
	b.Scratch = s
	return s, b.Scratch
}

// devScratch returns the bucket's compressed device buffer, allocated on the first launch,
// boxed in b.Scratch (passed as is to AllReduce: no allocation per launch).
func (h compressHook[H]) devScratch(b *BucketView, n int) (procgroup.DeviceBuffer, error) {
	if d, ok := b.Scratch.(procgroup.DeviceBuffer); ok && d.Count == n {
		return d, nil
	}
	var z H
	dt := procgroup.Float16
	if _, bf := any(z).(procgroup.BF16); bf {
		dt = procgroup.BFloat16
	}
	d, err := b.Device.AllocDevice(dt, n)
	if err != nil {
		return d, err
	}
	d.Stream = b.Stream
	b.Scratch = d
	return d, nil
}

func (h compressHook[H]) Launch(ctx context.Context, pg procgroup.ProcessGroup, b *BucketView) procgroup.Work {
	switch buf := b.Buffer.(type) {
	case procgroup.DeviceBuffer:
		if buf.Type != procgroup.Float32 {
			return procgroup.Completed(fmt.Errorf("%w: compression hook: device bucket %d holds %v; device compression is for float32 buckets", ErrInvalidArgument, b.Index, buf.Type))
		}
		d, err := h.devScratch(b, buf.Count)
		if err == nil {
			err = b.Device.ConvertAsync(b.Stream, d, buf)
		}
		if err != nil {
			return procgroup.Completed(fmt.Errorf("reducer: compression hook: bucket %d: %w", b.Index, err))
		}
		return pg.AllReduce(ctx, b.Scratch, procgroup.Sum)
	case []float32:
		s, boxed := h.scratch(b, len(buf))
		for k, v := range buf {
			s[k] = h.narrow(v)
		}
		return pg.AllReduce(ctx, boxed, procgroup.Sum)
	case []float64:
		s, boxed := h.scratch(b, len(buf))
		for k, v := range buf {
			s[k] = h.narrow(float32(v))
		}
		return pg.AllReduce(ctx, boxed, procgroup.Sum)
	}
	return procgroup.Completed(fmt.Errorf("%w: compression hook: bucket %d holds %T", ErrInvalidArgument, b.Index, b.Buffer))
}

func (h compressHook[H]) Finish(b *BucketView) error {
	if buf, ok := b.Buffer.(procgroup.DeviceBuffer); ok {
		d, _ := b.Scratch.(procgroup.DeviceBuffer)
		return b.Device.ConvertAsync(b.Stream, buf, d)
	}
	s, _ := b.Scratch.([]H)
	switch buf := b.Buffer.(type) {
	case []float32:
		for k := range buf {
			buf[k] = h.widen(s[k])
		}
	case []float64:
		for k := range buf {
			buf[k] = float64(h.widen(s[k]))
		}
	}
	return nil
}
