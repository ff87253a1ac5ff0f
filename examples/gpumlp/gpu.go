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

// Why dlopen, and not gorgonia.org/cu: the trainer needs SGEMM (cuBLAS) and five small
// element-wise kernels, nothing more. Loading libcuda.so.1 and libcublas.so at run time, as
// backends/nccl loads NCCL, keeps the example buildable with gcc alone (no cuda.h, no
// link stubs, no build tag), so it builds, vets and tests on every machine, where the fake
// driver and fake cuBLAS of backends/nccl/testdata/fake stand in for the GPU. The kernels
// are PTX (kernels.ptx, from kernels.ll by gen.sh), JIT-compiled by the driver.

//go:embed kernels.ptx
var kernelsPTX string

// EnvCUBLASLib names cuBLAS (a colon-separated list of paths or sonames, tried in order).
const EnvCUBLASLib = "GODDP_CUBLAS_LIB"

const defaultCUBLAS = "libcublas.so.13:libcublas.so.12:libcublas.so"

// gpu is the trainer's view of its device: the primary context (the one the nccl backend
// uses), one cuBLAS handle on the compute stream, and the kernels.
type gpu struct {
	l      *C.gm_lib
	ctx    unsafe.Pointer
	blas   unsafe.Pointer
	stream procgroup.Stream
	fns    map[string]unsafe.Pointer
}

var kernelNames = []string{"gpumlp_add_bias", "gpumlp_relu", "gpumlp_relu_bwd", "gpumlp_sub_scale", "gpumlp_colsum"}

func openGPU(device int, stream procgroup.Stream) (*gpu, error) {
	cudaPath := os.Getenv("GODDP_CUDA_LIB")
	if cudaPath == "" {
		cudaPath = "libcuda.so.1"
	}
	blasPaths := os.Getenv(EnvCUBLASLib)
	if blasPaths == "" {
		blasPaths = defaultCUBLAS
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cc, cb := C.CString(cudaPath), C.CString(blasPaths)
	defer C.free(unsafe.Pointer(cc))
	defer C.free(unsafe.Pointer(cb))
	var errbuf [1024]C.char
	l := C.gm_load(cc, cb, &errbuf[0], C.size_t(len(errbuf)))
	if l == nil {
		return nil, fmt.Errorf("gpumlp: loading the CUDA driver and cuBLAS (set GODDP_CUDA_LIB, %s): %s", EnvCUBLASLib, C.GoString(&errbuf[0]))
	}
	g := &gpu{l: l, stream: stream, fns: map[string]unsafe.Pointer{}}
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
	if r := C.gm_cublas(l, g.ctx, C.uintptr_t(stream), &g.blas); r != 0 {
		return nil, fmt.Errorf("gpumlp: cuBLAS handle: status %d", int(r))
	}
	return g, nil
}

func (g *gpu) close() {
	if g.blas != nil {
		runtime.LockOSThread()
		C.gm_cublas_destroy(g.l, g.ctx, g.blas)
		runtime.UnlockOSThread()
		g.blas = nil
	}
}

// gemm enqueues the row-major C[m×n] = op(A)[m×k]·op(B)[k×n] + beta·C, where op(X) is X or
// Xᵀ as stored (row-major). cuBLAS is column-major: a row-major matrix is its transpose
// there, so this is Cᵀ = op(B)ᵀ·op(A)ᵀ with the operands swapped and the same op flags.
func (g *gpu) gemm(transA, transB bool, m, n, k int, a, b, c procgroup.DeviceBuffer, beta float32) error {
	lda, ldb := k, n
	ta, tb := C.int(0), C.int(0)
	if transA {
		lda, ta = m, 1
	}
	if transB {
		ldb, tb = k, 1
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if r := C.gm_sgemm(g.l, g.ctx, g.blas, tb, ta, C.int(n), C.int(m), C.int(k), 1, C.uintptr_t(b.Ptr), C.int(ldb),
		C.uintptr_t(a.Ptr), C.int(lda), C.float(beta), C.uintptr_t(c.Ptr), C.int(n)); r != 0 {
		return fmt.Errorf("gpumlp: cublasSgemm (%d×%d×%d): status %d", m, n, k, int(r))
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
