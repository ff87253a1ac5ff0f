package procgroup

import (
	"fmt"
)

// DevicePtr is an address in device memory (a CUdeviceptr, gorgonia.org/cu's cu.DevicePtr).
type DevicePtr uintptr

// Stream is a device stream handle (a CUstream); 0 is the legacy default stream.
type Stream uintptr

// Event is a device event handle (a CUevent), created by a Device.
type Event uintptr

// DeviceBuffer is a buffer in device memory that a GPU backend's collectives accept in place
// of a host slice. Stream is the compute stream that produces (and will consume) its
// contents: a collective on the buffer first makes the backend's communication stream wait,
// on the GPU, for the work queued on Stream so far. The memory must stay allocated until the
// collective's Work completes.
type DeviceBuffer struct {
	Ptr    DevicePtr
	Type   DType
	Count  int
	Stream Stream
}

// DType implements Buffer.
func (b DeviceBuffer) DType() DType { return b.Type }

// Len implements Buffer.
func (b DeviceBuffer) Len() int { return b.Count }

// Bytes is the buffer's size in bytes.
func (b DeviceBuffer) Bytes() int { return b.Count * b.Type.Size() }

// Slice returns the elements [from, to) of b, on the same stream. It panics if the range is
// outside b (a programmer error, like slicing a slice).
func (b DeviceBuffer) Slice(from, to int) DeviceBuffer {
	if from < 0 || to < from || to > b.Count {
		panic(fmt.Sprintf("procgroup: DeviceBuffer.Slice(%d, %d) of %d elements", from, to, b.Count))
	}
	return DeviceBuffer{Ptr: b.Ptr + DevicePtr(from*b.Type.Size()), Type: b.Type, Count: to - from, Stream: b.Stream}
}

// On returns b with its Stream set to s.
func (b DeviceBuffer) On(s Stream) DeviceBuffer { b.Stream = s; return b }

var _ Buffer = DeviceBuffer{}

// Device is the optional interface of a ProcessGroup whose collectives accept DeviceBuffers
// (backends/nccl implements it). It is what the reducer needs to keep gradient buckets on the
// device: memory, stream-ordered copies and scaling, and events. Find it with
// FindDevice, which looks through the wrappers (watchdog, debug) as well.
//
// Every operation that takes a Stream is enqueued on that stream and returns at once: the
// host never waits for the device (errors are those of the enqueue itself). Buffers must
// stay allocated until the work queued on them has run. Methods are safe for concurrent use.
type Device interface {
	// AllocDevice allocates n elements of dt on the group's device (Stream 0), uninitialised
	// (zero them with ZeroAsync). Free it with FreeDevice once no queued work uses it.
	AllocDevice(dt DType, n int) (DeviceBuffer, error)
	// FreeDevice releases memory from AllocDevice.
	FreeDevice(b DeviceBuffer) error
	// ScaleAsync enqueues dst[k] = a·src[k] (add false) or dst[k] += a·src[k] (add true) on s.
	// dst and src have the same element type (Float32 or Float64) and length, and may be the
	// same buffer (in-place scaling). With a == 1 and add false it is a plain copy.
	ScaleAsync(s Stream, dst, src DeviceBuffer, a float64, add bool) error
	// ConvertAsync enqueues dst[k] = src[k] converted between Float32 and Float16 or
	// BFloat16 (either way; round to nearest even) on s. The lengths must match.
	ConvertAsync(s Stream, dst, src DeviceBuffer) error
	// ZeroAsync enqueues the zeroing of b on s.
	ZeroAsync(s Stream, b DeviceBuffer) error
	// NewEvent creates an event; DestroyEvent releases it.
	NewEvent() (Event, error)
	DestroyEvent(e Event) error
	// RecordEvent enqueues e on s: it completes when the work queued on s before it has.
	RecordEvent(e Event, s Stream) error
	// WaitEvent makes s wait, on the device, for the last record of e (no host blocking).
	WaitEvent(s Stream, e Event) error
	// SyncStream blocks the host until the work queued on s has run (for shutdown, never
	// inside a training step).
	SyncStream(s Stream) error
	// WaitWork makes s wait, on the device, for w, a Work of this group's collectives on
	// DeviceBuffers (possibly wrapped: see UnwrapWork); work queued on s afterwards sees the
	// result. For a Work it cannot order on the device (a host buffer's, or one a wrapper
	// has not issued yet), it blocks like Wait. It returns w's error if w has already failed.
	WaitWork(s Stream, w Work) error
}

// Unwrapper is implemented by a ProcessGroup that wraps another (WithWatchdog, WithDebug):
// Unwrap returns the wrapped group, so that optional interfaces of the backend underneath
// (Device, a backend's own methods) can be found through the wrappers.
type Unwrapper interface {
	Unwrap() ProcessGroup
}

// WorkUnwrapper is implemented by a Work that wraps another: Unwrap returns the wrapped Work,
// or nil if there is none yet (the debug wrapper issues the real collective later).
type WorkUnwrapper interface {
	Unwrap() Work
}

// Find returns the first group of type T found in pg or, through Unwrap, in the groups it
// wraps: the idiom for reaching a backend's optional interface or concrete type through
// the wrappers that ddp.InitProcessGroup puts around it, for instance
//
//	dev, ok := procgroup.Find[procgroup.Device](pg)
//	g, ok := procgroup.Find[*nccl.Group](pg)
//
// Operations found this way bypass the wrappers: a collective issued on the unwrapped
// group is not numbered, timed or fingerprinted by them. Use the found value for what the
// wrappers do not offer (device memory, stream-ordered waits), and issue collectives on pg.
func Find[T any](pg ProcessGroup) (T, bool) {
	for pg != nil {
		if t, ok := pg.(T); ok {
			return t, true
		}
		u, ok := pg.(Unwrapper)
		if !ok {
			break
		}
		pg = u.Unwrap()
	}
	var zero T
	return zero, false
}

// FindWork is Find for a Work: the first Work of type T in w or in the works it wraps,
// for instance
//
//	nw, ok := procgroup.FindWork[*nccl.Work](w) // then nw.WaitStream(computeStream)
//
// It reports false if a wrapper has no inner Work yet.
func FindWork[T any](w Work) (T, bool) {
	for w != nil {
		if t, ok := w.(T); ok {
			return t, true
		}
		u, ok := w.(WorkUnwrapper)
		if !ok {
			break
		}
		w = u.Unwrap()
	}
	var zero T
	return zero, false
}

// FindDevice is Find[Device]: the group's device operations, or false for a host-only
// backend (gloo, pgtest).
func FindDevice(pg ProcessGroup) (Device, bool) { return Find[Device](pg) }

// DeviceBLAS is the optional interface of a Device group with the dense linear algebra of
// PowerSGD on device buckets (reducer's PowerSGDHook; backends/nccl implements it with
// cuBLAS and a kernel of its own). Find it with Find[DeviceBLAS]. As with Device, the
// operations that take a Stream are enqueued on it and return at once.
type DeviceBLAS interface {
	Device
	// GemmAsync enqueues C = alpha·op(A)·op(B) + beta·C on s, for float32 buffers in
	// column-major order, exactly as cuBLAS's cublasSgemm: op(A) is m×k (A itself, or the
	// transpose of the k×m matrix A holds when transA), op(B) is k×n, C is m×n; lda, ldb
	// and ldc are the leading dimensions (the distance in elements between two columns,
	// at least the stored matrix's rows). With beta 0, C is not read.
	GemmAsync(s Stream, transA, transB bool, m, n, k int, alpha float32, a DeviceBuffer, lda int, b DeviceBuffer, ldb int, beta float32, c DeviceBuffer, ldc int) error
	// OrthonormalizeAsync enqueues on s the orthonormalisation, in place, of the cols
	// columns of the float32 matrix a (rows×cols, column-major, leading dimension rows) by
	// modified Gram-Schmidt in float64 arithmetic, each element rounded to float32 when
	// stored: for each column c in order, its projections on the columns before it are
	// subtracted, one at a time, twice over (the second pass removes what float32 storage
	// left of them), and it is divided by its norm. A column left with no length of its own
	// (a norm at most 1e-5 of its norm before the projections, zero or not finite) is
	// replaced, at try t (0 to 2), by rows SplitMix64 draws uniform in [−1, 1) (the 53 high
	// bits of each output, over 2⁵², minus 1) from the state seed ^ (c+1 + t<<32), and
	// orthonormalised again; after the third replacement a column still degenerate is set
	// to zero. Every dot product sums its terms in index order from 0, with no fused
	// multiply-add, so the result is the same bits on every device and rank.
	OrthonormalizeAsync(s Stream, a DeviceBuffer, rows, cols int, seed uint64) error
	// PrepareBLAS readies what GemmAsync and OrthonormalizeAsync use (nccl: the cuBLAS
	// handle and the kernels' module), so that their first calls, inside a hook's Launch,
	// do not load libraries or allocate device memory; a hook calls it at Setup.
	PrepareBLAS() error
	// CopyIn copies the host slice src into dst (same element type and length) on
	// dst.Stream and blocks the host until it is done; CopyOut copies src into the host
	// slice dst after the work queued on src.Stream, and blocks likewise. For set-up and
	// checkpoints, never inside a training step.
	CopyIn(dst DeviceBuffer, src any) error
	CopyOut(dst any, src DeviceBuffer) error
}
