package nccl

import (
	"errors"
	"fmt"

	"github.com/goddp/goddp/procgroup"
)

// ErrUnavailable: NCCL, the CUDA driver or a device is missing. Errors that wrap it say
// which, and which environment variable points the backend at a library.
var ErrUnavailable = errors.New("nccl: unavailable")

// DevicePtr is a CUDA device address (CUdeviceptr; gorgonia.org/cu's cu.DevicePtr): the
// procgroup vocabulary, so that the reducer can hold device buffers without importing a
// backend.
type DevicePtr = procgroup.DevicePtr

// Stream is a CUDA stream handle (CUstream); 0 is the legacy default stream.
type Stream = procgroup.Stream

// DeviceBuffer is a buffer in device memory that the collectives accept in place of a host
// slice (procgroup.DeviceBuffer). Stream is the compute stream that produces (and will
// consume) its contents: a collective on the buffer first makes the group's communication
// stream wait, on the GPU, for the work queued on Stream so far (Note [Stream order]). The
// memory must stay allocated until the collective's Work completes.
type DeviceBuffer = procgroup.DeviceBuffer

// Config is the backend's part of procgroup.Options (Options.Backend = *nccl.Config).
type Config struct {
	// NCCLLib and CUDALib are the paths (or sonames) of libnccl.so.2 and libcuda.so.1;
	// empty means $GODDP_NCCL_LIB / $GODDP_CUDA_LIB, else the sonames, found by the
	// dynamic loader.
	NCCLLib, CUDALib string
}

// buffer classifies a collective's buffer: a host slice or a DeviceBuffer.
type buffer struct {
	dt   procgroup.DType
	n    int
	host any // the host slice, or nil
	dev  DeviceBuffer
}

func classify(buf any) (buffer, error) {
	switch b := buf.(type) {
	case DeviceBuffer:
		return checkDev(b)
	case *DeviceBuffer:
		if b == nil {
			return buffer{}, fmt.Errorf("%w: nil *DeviceBuffer", procgroup.ErrInvalidArgument)
		}
		return checkDev(*b)
	case procgroup.Buffer:
		return buffer{}, fmt.Errorf("%w: buffer type %T is not a host slice or nccl.DeviceBuffer", procgroup.ErrInvalidArgument, buf)
	}
	dt, n, err := procgroup.DTypeOf(buf)
	if err != nil {
		return buffer{}, err
	}
	return buffer{dt: dt, n: n, host: buf}, nil
}

func checkDev(b DeviceBuffer) (buffer, error) {
	if err := checkStream(b.Stream); err != nil {
		return buffer{}, err
	}
	if b.Type.Size() == 0 {
		return buffer{}, fmt.Errorf("%w: DeviceBuffer of unknown dtype %v", procgroup.ErrInvalidArgument, b.Type)
	}
	if b.Count < 0 || (b.Count > 0 && b.Ptr == 0) {
		return buffer{}, fmt.Errorf("%w: DeviceBuffer at %#x with %d elements", procgroup.ErrInvalidArgument, uintptr(b.Ptr), b.Count)
	}
	return buffer{dt: b.Type, n: b.Count, dev: b}, nil
}

// ncclType maps a dtype to ncclDataType_t.
func ncclType(dt procgroup.DType) int {
	switch dt {
	case procgroup.Int32:
		return 2
	case procgroup.Int64:
		return 4
	case procgroup.Float16:
		return 6
	case procgroup.Float32:
		return 7
	case procgroup.Float64:
		return 8
	case procgroup.BFloat16:
		return 9
	}
	return -1
}

// ncclOp maps a reduction to ncclRedOp_t.
func ncclOp(op procgroup.ReduceOp) int {
	switch op {
	case procgroup.Sum:
		return 0
	case procgroup.Prod:
		return 1
	case procgroup.Max:
		return 2
	case procgroup.Min:
		return 3
	case procgroup.Avg:
		return 4
	}
	return -1
}

// Stream handles of cuda.h with a special meaning.
const (
	streamLegacy    Stream = 0x1 // CU_STREAM_LEGACY: the legacy default stream, as 0
	streamPerThread Stream = 0x2 // CU_STREAM_PER_THREAD
)

// checkStream refuses CU_STREAM_PER_THREAD: it names the default stream of the calling OS
// thread, and a goroutine's calls run on whichever thread it is on at the moment, so the
// work would land on streams the caller cannot predict.
func checkStream(s Stream) error {
	if s == streamPerThread {
		return fmt.Errorf("%w: stream CU_STREAM_PER_THREAD (0x2) is the calling OS thread's default stream, and goroutines move between OS threads; "+
			"use a stream from cuStreamCreate (Group.NewStream) or the legacy default stream (0)", procgroup.ErrInvalidArgument)
	}
	return nil
}
