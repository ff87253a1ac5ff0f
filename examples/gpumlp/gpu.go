package main

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "gpu.h"
*/
import "C"

import (
	_ "embed"
	"fmt"
	"os"
	"runtime"
	"unsafe"

	"github.com/goddp/goddp/procgroup"
)

// Why dlopen, and not gorgonia.org/cu: the trainer needs SGEMM and five small element-wise
// kernels, nothing more. SGEMM is the nccl group's (procgroup.DeviceBLAS: its cuBLAS
// handle, loaded as backends/nccl loads NCCL). The kernels need the CUDA driver itself:
// loading libcuda.so.1 at run time keeps the example buildable with gcc alone (no cuda.h,
// no link stubs, no build tag), so it builds, vets and tests on every machine, where the
// fake driver and fake cuBLAS of backends/nccl/testdata/fake stand in for the GPU. The
// kernels are PTX (kernels.ptx, from kernels.ll by gen.sh), JIT-compiled by the driver.

//go:embed kernels.ptx
var kernelsPTX string

// gpu is the trainer's view of its device: the primary context (the one the nccl backend
// uses), the group's SGEMM on the compute stream, and the kernels.
type gpu struct {
	l      *C.gm_lib
	ctx    unsafe.Pointer
	blas   procgroup.DeviceBLAS
	stream procgroup.Stream
	fns    map[string]unsafe.Pointer
}

var kernelNames = []string{"gpumlp_add_bias", "gpumlp_relu", "gpumlp_relu_bwd", "gpumlp_sub_scale", "gpumlp_colsum"}

// openGPU loads the kernels on device (an ordinal) for stream, with blas the group's SGEMM.
func openGPU(device int, stream procgroup.Stream, blas procgroup.DeviceBLAS) (*gpu, error) {
	cudaPath := os.Getenv("GODDP_CUDA_LIB")
	if cudaPath == "" {
		cudaPath = "libcuda.so.1"
	}
	if err := blas.PrepareBLAS(); err != nil {
		return nil, fmt.Errorf("gpumlp: %w", err)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cc := C.CString(cudaPath)
	defer C.free(unsafe.Pointer(cc))
	var errbuf [1024]C.char
	l := C.gm_load(cc, &errbuf[0], C.size_t(len(errbuf)))
	if l == nil {
		return nil, fmt.Errorf("gpumlp: loading the CUDA driver (set GODDP_CUDA_LIB): %s", C.GoString(&errbuf[0]))
	}
	g := &gpu{l: l, blas: blas, stream: stream, fns: map[string]unsafe.Pointer{}}
	if r := C.gm_context(l, C.int(device), &g.ctx); r != 0 {
		return nil, fmt.Errorf("gpumlp: primary context of device %d: CUresult %d", device, int(r))
	}
	ptx := C.CString(kernelsPTX)
	defer C.free(unsafe.Pointer(ptx))
	var mod unsafe.Pointer
	if r := C.gm_module(l, g.ctx, ptx, &mod); r != 0 {
		return nil, fmt.Errorf("gpumlp: cuModuleLoadData: CUresult %d", int(r))
	}
	for _, name := range kernelNames {
		cn := C.CString(name)
		var fn unsafe.Pointer
		r := C.gm_function(l, mod, cn, &fn)
		C.free(unsafe.Pointer(cn))
		if r != 0 {
			return nil, fmt.Errorf("gpumlp: cuModuleGetFunction(%s): CUresult %d", name, int(r))
		}
		g.fns[name] = fn
	}
	return g, nil
}

// gemm enqueues the row-major C[m×n] = op(A)[m×k]·op(B)[k×n] + beta·C, where op(X) is X or
// Xᵀ as stored (row-major). cuBLAS is column-major: a row-major matrix is its transpose
// there, so this is Cᵀ = op(B)ᵀ·op(A)ᵀ with the operands swapped and the same op flags.
func (g *gpu) gemm(transA, transB bool, m, n, k int, a, b, c procgroup.DeviceBuffer, beta float32) error {
	lda, ldb := k, n
	if transA {
		lda = m
	}
	if transB {
		ldb = k
	}
	if err := g.blas.GemmAsync(g.stream, transB, transA, n, m, k, 1, b, ldb, a, lda, beta, c, n); err != nil {
		return fmt.Errorf("gpumlp: SGEMM (%d×%d×%d): %w", m, n, k, err)
	}
	return nil
}

// launch enqueues kernel name over threads threads with 64-bit arguments u (device
// pointers and counts) and, if hasF, a float f last.
func (g *gpu) launch(name string, threads int, f float32, hasF bool, u ...uint64) error {
	var args [7]C.ulonglong
	for i, v := range u {
		args[i] = C.ulonglong(v)
	}
	hf := C.int(0)
	if hasF {
		hf = 1
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if r := C.gm_launch(g.l, g.ctx, g.fns[name], C.uintptr_t(g.stream), C.ulonglong(threads), &args[0], C.int(len(u)), C.float(f), hf); r != 0 {
		return fmt.Errorf("gpumlp: launching %s: CUresult %d", name, int(r))
	}
	return nil
}

func ptr(b procgroup.DeviceBuffer) uint64 { return uint64(b.Ptr) }
