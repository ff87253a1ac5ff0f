//go:build cuda

package nccl

import (
	"unsafe"

	"gorgonia.org/cu"

	"github.com/goddp/goddp/procgroup"
)

// FromCU describes n elements of dt at a gorgonia.org/cu device pointer, produced on
// stream s (a zero cu.Stream is the legacy default stream). p and s must belong to the
// primary context of the group's device (cu.Device.RetainPrimaryCtx): memory or a stream
// of another context, such as one from cu.NewContext, makes the collective fail at once
// with an error wrapping procgroup.ErrInvalidArgument that names the context.
func FromCU(p cu.DevicePtr, dt procgroup.DType, n int, s cu.Stream) DeviceBuffer {
	return DeviceBuffer{Ptr: DevicePtr(p), Type: dt, Count: n, Stream: streamOf(s)}
}

// WaitCU is WaitStream for a gorgonia.org/cu stream.
func (w *Work) WaitCU(s cu.Stream) error { return w.WaitStream(streamOf(s)) }

// streamOf is the CUstream handle of s (a C pointer of package cu, taken as an address).
func streamOf(s cu.Stream) Stream {
	return Stream(uintptr(unsafe.Pointer(s.C())))
}
