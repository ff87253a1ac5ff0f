package nccl

/*
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"context"
	_ "embed"
	"fmt"
	"unsafe"

	"github.com/goddp/goddp/procgroup"
)

// kernelsPTX holds the kernels of ScaleAsync, ConvertAsync and OrthonormalizeAsync
// (kernels/kernels.ll, compiled to PTX by kernels/gen.sh). The driver JIT-compiles it when
// the first one is needed.
//
//go:embed kernels/kernels.ptx
var kernelsPTX string

var _ procgroup.Device = (*Group)(nil)

// kernel names, in the order of Group.fns.
const (
	kScale32 = iota
	kScale64
	kF32ToF16
	kF16ToF32
	kF32ToBF16
	kBF16ToF32
	kOrth
	nKernels
)

var kernelNames = [nKernels]string{"goddp_scale_f32", "goddp_scale_f64", "goddp_f32_to_f16", "goddp_f16_to_f32", "goddp_f32_to_bf16", "goddp_bf16_to_f32", "goddp_orth_f32"}

// kernelsLocked loads the module once. g.devMu is held.
func (g *Group) kernelsLocked() error {
	if g.devClosed.Load() {
		return g.closedErr()
	}
	if g.module != nil {
		return nil
	}
	if g.moduleErr != nil {
		return g.moduleErr
	}
	err := g.onDevice(func() error {
		img := C.CString(kernelsPTX)
		defer C.free(unsafe.Pointer(img))
		var m C.goddp_CUmodule
		if r := C.goddp_module_load(g.lib.p, g.cuCtx, img, &m); r != 0 {
			return g.lib.cuErr("cuModuleLoadData (the PTX of kernels/kernels.ptx)", r)
		}
		for k, name := range kernelNames {
			cn := C.CString(name)
			r := C.goddp_module_function(g.lib.p, m, cn, &g.fns[k])
			C.free(unsafe.Pointer(cn))
			if r != 0 {
				return g.lib.cuErr("cuModuleGetFunction("+name+")", r)
			}
		}
		g.module = m
		return nil
	})
	if err != nil {
		g.moduleErr = fmt.Errorf("nccl: rank %d: %w", g.rank, err)
	}
	return g.moduleErr
}

// AllocDevice implements procgroup.Device with cuMemAlloc (Alloc).
func (g *Group) AllocDevice(dt procgroup.DType, n int) (procgroup.DeviceBuffer, error) {
	return g.Alloc(dt, n)
}

// FreeDevice implements procgroup.Device.
func (g *Group) FreeDevice(b procgroup.DeviceBuffer) error { return g.Free(b) }

func (g *Group) devErr(op string, err error) error {
	return fmt.Errorf("nccl: rank %d: %s: %w", g.rank, op, err)
}

func (g *Group) checkPair(op string, dst, src procgroup.DeviceBuffer) error {
	if dst.Count != src.Count {
		return g.devErr(op, fmt.Errorf("%w: dst has %d elements, src %d", procgroup.ErrInvalidArgument, dst.Count, src.Count))
	}
	if (dst.Count > 0 && dst.Ptr == 0) || (src.Count > 0 && src.Ptr == 0) {
		return g.devErr(op, fmt.Errorf("%w: nil device pointer", procgroup.ErrInvalidArgument))
	}
	return nil
}

// ScaleAsync implements procgroup.Device with the kernels goddp_scale_f32/f64; a plain copy
// (a == 1, add false, distinct buffers) is cuMemcpyDtoDAsync.
func (g *Group) ScaleAsync(s procgroup.Stream, dst, src procgroup.DeviceBuffer, a float64, add bool) error {
	if err := g.checkPair("ScaleAsync", dst, src); err != nil {
		return err
	}
	if err := checkStream(s); err != nil {
		return g.devErr("ScaleAsync", err)
	}
	if dst.Type != src.Type || (dst.Type != procgroup.Float32 && dst.Type != procgroup.Float64) {
		return g.devErr("ScaleAsync", fmt.Errorf("%w: dst is %v, src %v; want both float32 or both float64", procgroup.ErrInvalidArgument, dst.Type, src.Type))
	}
	if dst.Count == 0 {
		return nil
	}
	if a == 1 && !add {
		if dst.Ptr == src.Ptr {
			return nil
		}
		if r := C.goddp_copy_d2d(g.lib.p, g.cuCtx, C.goddp_CUdeviceptr(dst.Ptr), C.goddp_CUdeviceptr(src.Ptr), C.size_t(dst.Bytes()), C.uintptr_t(s)); r != 0 {
			return g.devErr("ScaleAsync", g.lib.cuErr("cuMemcpyDtoDAsync", r))
		}
		return nil
	}
	k, f64 := kScale32, 0
	if dst.Type == procgroup.Float64 {
		k, f64 = kScale64, 1
	}
	return g.launch("ScaleAsync", k, func(fn C.goddp_CUfunction) C.goddp_CUresult {
		var ad C.int
		if add {
			ad = 1
		}
		return C.goddp_launch_scale(g.lib.p, g.cuCtx, fn, C.uintptr_t(s), C.goddp_CUdeviceptr(dst.Ptr), C.goddp_CUdeviceptr(src.Ptr),
			C.ulonglong(dst.Count), C.double(a), ad, C.int(f64))
	})
}

// ConvertAsync implements procgroup.Device.
func (g *Group) ConvertAsync(s procgroup.Stream, dst, src procgroup.DeviceBuffer) error {
	if err := g.checkPair("ConvertAsync", dst, src); err != nil {
		return err
	}
	if err := checkStream(s); err != nil {
		return g.devErr("ConvertAsync", err)
	}
	k := -1
	switch {
	case src.Type == procgroup.Float32 && dst.Type == procgroup.Float16:
		k = kF32ToF16
	case src.Type == procgroup.Float16 && dst.Type == procgroup.Float32:
		k = kF16ToF32
	case src.Type == procgroup.Float32 && dst.Type == procgroup.BFloat16:
		k = kF32ToBF16
	case src.Type == procgroup.BFloat16 && dst.Type == procgroup.Float32:
		k = kBF16ToF32
	}
	if k < 0 {
		return g.devErr("ConvertAsync", fmt.Errorf("%w: %v to %v; want float32 to or from float16 or bfloat16", procgroup.ErrInvalidArgument, src.Type, dst.Type))
	}
	if dst.Count == 0 {
		return nil
	}
	return g.launch("ConvertAsync", k, func(fn C.goddp_CUfunction) C.goddp_CUresult {
		return C.goddp_launch_convert(g.lib.p, g.cuCtx, fn, C.uintptr_t(s), C.goddp_CUdeviceptr(dst.Ptr), C.goddp_CUdeviceptr(src.Ptr), C.ulonglong(dst.Count))
	})
}

// launch runs call with kernel k's function, loading the module first if need be. It
// holds g.modUse (read) across the call, so that releaseDevice cannot unload the module
// between the lookup and the launch.
func (g *Group) launch(op string, k int, call func(C.goddp_CUfunction) C.goddp_CUresult) error {
	g.modUse.RLock()
	defer g.modUse.RUnlock()
	g.devMu.Lock()
	err := g.kernelsLocked()
	fn := g.fns[k]
	g.devMu.Unlock()
	if err != nil {
		return err
	}
	if r := call(fn); r != 0 { // one cgo call, which switches contexts itself
		return g.devErr(op, g.lib.cuErr("cuLaunchKernel("+kernelNames[k]+")", r))
	}
	return nil
}

// ZeroAsync implements procgroup.Device.
func (g *Group) ZeroAsync(s procgroup.Stream, b procgroup.DeviceBuffer) error {
	bytes := b.Bytes()
	if bytes == 0 {
		return nil
	}
	if bytes%4 != 0 {
		return g.devErr("ZeroAsync", fmt.Errorf("%w: %d bytes, want a multiple of 4", procgroup.ErrInvalidArgument, bytes))
	}
	if err := checkStream(s); err != nil {
		return g.devErr("ZeroAsync", err)
	}
	if r := C.goddp_memset32(g.lib.p, g.cuCtx, C.goddp_CUdeviceptr(b.Ptr), 0, C.size_t(bytes/4), C.uintptr_t(s)); r != 0 {
		return g.devErr("ZeroAsync", g.lib.cuErr("cuMemsetD32Async", r))
	}
	return nil
}

// NewEvent implements procgroup.Device (an event without timing, the cheap kind).
func (g *Group) NewEvent() (procgroup.Event, error) { return g.newEvent(false) }

// NewTimedEvent is NewEvent for an event that records a timestamp (EventElapsed).
func (g *Group) NewTimedEvent() (procgroup.Event, error) { return g.newEvent(true) }

func (g *Group) newEvent(timing bool) (procgroup.Event, error) {
	var ev C.goddp_CUevent
	t := C.int(0)
	if timing {
		t = 1
	}
	if r := C.goddp_event_create_timed(g.lib.p, g.cuCtx, &ev, t); r != 0 {
		return 0, g.devErr("NewEvent", g.lib.cuErr("cuEventCreate", r))
	}
	return procgroup.Event(uintptr(unsafe.Pointer(ev))), nil
}

// DestroyEvent implements procgroup.Device.
func (g *Group) DestroyEvent(e procgroup.Event) error {
	if r := C.goddp_event_destroy_handle(g.lib.p, C.uintptr_t(e)); r != 0 {
		return g.devErr("DestroyEvent", g.lib.cuErr("cuEventDestroy", r))
	}
	return nil
}

// RecordEvent implements procgroup.Device.
func (g *Group) RecordEvent(e procgroup.Event, s procgroup.Stream) error {
	if err := checkStream(s); err != nil {
		return g.devErr("RecordEvent", err)
	}
	if r := C.goddp_event_record(g.lib.p, g.cuCtx, C.uintptr_t(e), C.uintptr_t(s)); r != 0 {
		return g.devErr("RecordEvent", g.lib.cuErr("cuEventRecord", r))
	}
	return nil
}

// WaitEvent implements procgroup.Device.
func (g *Group) WaitEvent(s procgroup.Stream, e procgroup.Event) error {
	if err := checkStream(s); err != nil {
		return g.devErr("WaitEvent", err)
	}
	if r := C.goddp_stream_wait_handle(g.lib.p, g.cuCtx, C.uintptr_t(s), C.uintptr_t(e)); r != 0 {
		return g.devErr("WaitEvent", g.lib.cuErr("cuStreamWaitEvent", r))
	}
	return nil
}

// EventElapsed returns the milliseconds between two completed timed events (NewTimedEvent),
// from start to end; it fails with CUDA_ERROR_NOT_READY if either has not completed.
func (g *Group) EventElapsed(start, end procgroup.Event) (float64, error) {
	var ms C.float
	if r := C.goddp_event_elapsed(g.lib.p, g.cuCtx, &ms, C.uintptr_t(start), C.uintptr_t(end)); r != 0 {
		return 0, g.devErr("EventElapsed", g.lib.cuErr("cuEventElapsedTime", r))
	}
	return float64(ms), nil
}

// WaitWork implements procgroup.Device: (*Work).WaitStream on the nccl Work inside w
// (through the watchdog and debug wrappers). A Work of another group, or one a wrapper has
// not issued yet, is waited for on the host.
func (g *Group) WaitWork(s procgroup.Stream, w procgroup.Work) error {
	if err := checkStream(s); err != nil {
		return g.devErr("WaitWork", err)
	}
	if nw, ok := procgroup.FindWork[*Work](w); ok && nw.g == g {
		if err := nw.WaitStream(s); err != nil {
			return err
		}
		return w.Err() // the wrapper's view of an error already known
	}
	return w.Wait(context.Background())
}
