package nccl

/*
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/goddp/goddp/procgroup"
)

// Device-memory helpers on the group's device and context, for callers without a CUDA
// binding of their own (the example's GPU mode stages buckets through them) and for the
// tests. Callers that compute on the GPU bring their own memory and streams (see cu.go).

// Alloc allocates n elements of dt on the group's device; free it with Free. The buffer's
// Stream is 0 (the legacy default stream) until the caller sets it.
func (g *Group) Alloc(dt procgroup.DType, n int) (DeviceBuffer, error) {
	if dt.Size() == 0 || n < 0 {
		return DeviceBuffer{}, fmt.Errorf("%w: nccl: Alloc(%v, %d)", procgroup.ErrInvalidArgument, dt, n)
	}
	var p C.goddp_CUdeviceptr
	err := g.onDevice(func() error {
		if r := C.goddp_cuMemAlloc(g.lib.p, &p, C.size_t(max(n*dt.Size(), 1))); r != 0 {
			return g.lib.cuErr("cuMemAlloc", r)
		}
		return nil
	})
	if err != nil {
		return DeviceBuffer{}, fmt.Errorf("nccl: rank %d: %w", g.rank, err)
	}
	return DeviceBuffer{Ptr: DevicePtr(p), Type: dt, Count: n}, nil
}

// Free releases memory from Alloc. No work may still use it.
func (g *Group) Free(b DeviceBuffer) error {
	return g.onDevice(func() error {
		if r := C.goddp_cuMemFree(g.lib.p, C.goddp_CUdeviceptr(b.Ptr)); r != 0 {
			return fmt.Errorf("nccl: rank %d: %w", g.rank, g.lib.cuErr("cuMemFree", r))
		}
		return nil
	})
}

// NewStream creates a non-blocking CUDA stream on the group's device; destroy it with
// DestroyStream.
func (g *Group) NewStream() (Stream, error) {
	var s C.goddp_CUstream
	err := g.onDevice(func() error {
		if r := C.goddp_cuStreamCreate(g.lib.p, &s, C.GODDP_CU_STREAM_NON_BLOCKING); r != 0 {
			return g.lib.cuErr("cuStreamCreate", r)
		}
		return nil
	})
	return Stream(uintptr(unsafe.Pointer(s))), err
}

// DestroyStream destroys a stream from NewStream (after the work queued on it).
func (g *Group) DestroyStream(s Stream) error {
	if s == 0 || s == streamLegacy || s == streamPerThread {
		return fmt.Errorf("%w: nccl: DestroyStream(%#x): not a stream from NewStream", procgroup.ErrInvalidArgument, uintptr(s))
	}
	if r := C.goddp_stream_sync_handle(g.lib.p, g.cuCtx, C.uintptr_t(s)); r != 0 {
		return fmt.Errorf("nccl: rank %d: %w", g.rank, g.lib.cuErr("cuStreamSynchronize", r))
	}
	C.goddp_stream_destroy_handle(g.lib.p, C.uintptr_t(s))
	return nil
}

// SyncStream blocks until the work queued on s has finished.
func (g *Group) SyncStream(s Stream) error {
	if err := checkStream(s); err != nil {
		return fmt.Errorf("nccl: rank %d: SyncStream: %w", g.rank, err)
	}
	if r := C.goddp_stream_sync_handle(g.lib.p, g.cuCtx, C.uintptr_t(s)); r != 0 {
		return fmt.Errorf("nccl: rank %d: %w", g.rank, g.lib.cuErr("cuStreamSynchronize", r))
	}
	return nil
}

// CopyIn copies the host slice src into dst (same dtype and length), queued on dst.Stream
// through a pinned staging area, and waits for it.
func (g *Group) CopyIn(dst DeviceBuffer, src any) error { return g.copyHost(dst, src, true) }

// CopyOut copies src into the host slice dst (same dtype and length), queued on src.Stream
// after the work already there, and waits for it.
func (g *Group) CopyOut(dst any, src DeviceBuffer) error { return g.copyHost(src, dst, false) }

func (g *Group) copyHost(d DeviceBuffer, h any, in bool) error {
	dt, n, err := procgroup.DTypeOf(h)
	if err != nil {
		return err
	}
	if _, ok := h.(procgroup.Buffer); ok || dt != d.Type || n != d.Count {
		return fmt.Errorf("%w: nccl: copy between %T (%v×%d) and a DeviceBuffer (%v×%d)", procgroup.ErrInvalidArgument, h, dt, n, d.Type, d.Count)
	}
	if err := checkStream(d.Stream); err != nil {
		return fmt.Errorf("nccl: rank %d: %w", g.rank, err)
	}
	bytes := n * dt.Size()
	if bytes == 0 {
		return nil
	}
	g.mu.Lock()
	st, err := g.stagingLocked(bytes)
	g.mu.Unlock()
	if err != nil {
		return fmt.Errorf("nccl: rank %d: %w", g.rank, err)
	}
	defer func() {
		g.mu.Lock()
		if g.pool != nil {
			g.pool[st.class] = append(g.pool[st.class], st)
		}
		g.mu.Unlock()
	}()
	pinned := unsafe.Slice((*byte)(st.host), bytes)
	if in {
		copy(pinned, rawBytes(h))
	}
	h2d := C.int(0)
	if in {
		h2d = 1
	}
	if r := C.goddp_copy_sync(g.lib.p, g.cuCtx, C.goddp_CUdeviceptr(d.Ptr), st.host, C.size_t(bytes), h2d, C.uintptr_t(d.Stream)); r != 0 {
		return fmt.Errorf("nccl: rank %d: %w", g.rank, g.lib.cuErr("cuMemcpy", r))
	}
	if !in {
		copy(rawBytes(h), pinned)
	}
	return nil
}

// memsetD32 queues a 32-bit memset of n words at b on stream s (for the tests).
func (g *Group) memsetD32(b DeviceBuffer, v uint32, n int, s Stream) error {
	if r := C.goddp_memset32(g.lib.p, g.cuCtx, C.goddp_CUdeviceptr(b.Ptr), C.uint(v), C.size_t(n), C.uintptr_t(s)); r != 0 {
		return g.lib.cuErr("cuMemsetD32Async", r)
	}
	return nil
}
