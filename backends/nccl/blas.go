package nccl

/*
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"os"
	"sync"
	"unsafe"

	"github.com/goddp/goddp/procgroup"
)

// EnvCUBLASLib names cuBLAS for GemmAsync: a colon-separated list of paths or sonames,
// tried in order (default "libcublas.so.13:libcublas.so.12:libcublas.so", as
// examples/gpumlp).
const EnvCUBLASLib = "GODDP_CUBLAS_LIB"

const defaultCUBLAS = "libcublas.so.13:libcublas.so.12:libcublas.so"

var _ procgroup.DeviceBLAS = (*Group)(nil)

var (
	blasLibsMu sync.Mutex // guards blasLibs
	blasLibs   = map[string]*C.goddp_blas{}
)

// loadBLAS opens cuBLAS (once per list of paths; a failure is not cached).
func loadBLAS() (*C.goddp_blas, error) {
	paths := os.Getenv(EnvCUBLASLib)
	if paths == "" {
		paths = defaultCUBLAS
	}
	blasLibsMu.Lock()
	defer blasLibsMu.Unlock()
	if b := blasLibs[paths]; b != nil {
		return b, nil
	}
	cp := C.CString(paths)
	defer C.free(unsafe.Pointer(cp))
	var errbuf [1024]C.char
	b := C.goddp_blas_load(cp, &errbuf[0], C.size_t(len(errbuf)))
	if b == nil {
		return nil, fmt.Errorf("%w: cannot load cuBLAS from %q (%s); install it (for instance the nvidia-cublas-cu13 pip package) or set %s to its path",
			ErrUnavailable, paths, C.GoString(&errbuf[0]), EnvCUBLASLib)
	}
	blasLibs[paths] = b
	return b, nil
}

// Note [cuBLAS handle]: a group creates one cuBLAS handle, at its first GemmAsync, with its
// context (the device's primary context, the one the CUDA runtime under cuBLAS uses too)
// current, as cublasCreate binds a handle to the device current then. A handle is not safe
// for concurrent use from several host threads, and its stream is handle state
// (cublasSetStream), so g.blasMu serialises each cublasSetStream + cublasSgemm pair: the
// stream is set on every call, since callers pass their own. The handle keeps its defaults:
// CUBLAS_POINTER_MODE_HOST (alpha and beta are read from host memory during the call, so
// stack values will do) and CUBLAS_DEFAULT_MATH (float32 arithmetic; TF32 only where the
// process asks for it, NVIDIA_TF32_OVERRIDE=1). releaseDevice destroys it after the comm
// stream has drained; cublasDestroy synchronises the device (cuBLAS's documentation), which
// is acceptable at teardown only.

// blasLocked returns the group's cuBLAS handle, created on first use. g.blasMu is held.
func (g *Group) blasLocked() (*C.goddp_blas, C.goddp_cublasHandle_t, error) {
	if g.blasH != nil || g.blasErr != nil {
		return g.blasLib, g.blasH, g.blasErr
	}
	b, err := loadBLAS()
	if err != nil {
		g.blasErr = fmt.Errorf("nccl: rank %d: %w", g.rank, err)
		return nil, nil, g.blasErr
	}
	var h C.goddp_cublasHandle_t
	var st C.goddp_cublasStatus_t
	if r := C.goddp_blas_create(g.lib.p, g.cuCtx, b, &h, &st); r != 0 {
		return nil, nil, g.devErr("GemmAsync", g.lib.cuErr("cuCtxSetCurrent", r))
	}
	if st != 0 {
		g.blasErr = g.devErr("GemmAsync", fmt.Errorf("cublasCreate: status %d", int(st)))
		return nil, nil, g.blasErr
	}
	g.blasLib, g.blasH = b, h
	return b, h, nil
}

// releaseBLAS destroys the cuBLAS handle (releaseDevice).
func (g *Group) releaseBLAS() {
	g.blasMu.Lock()
	defer g.blasMu.Unlock()
	if g.blasH != nil {
		var st C.goddp_cublasStatus_t
		C.goddp_blas_destroy(g.lib.p, g.cuCtx, g.blasLib, g.blasH, &st)
		g.blasH = nil
	}
	g.blasErr = fmt.Errorf("nccl: rank %d: %w", g.rank, procgroup.ErrClosed)
}

// GemmAsync implements procgroup.DeviceBLAS with cublasSgemm_v2 on s (Note [cuBLAS
// handle]). It checks the shapes against the buffers' lengths, so that a wrong call fails
// here rather than reading or writing outside them on the device.
func (g *Group) GemmAsync(s procgroup.Stream, transA, transB bool, m, n, k int, alpha float32, a procgroup.DeviceBuffer, lda int,
	b procgroup.DeviceBuffer, ldb int, beta float32, c procgroup.DeviceBuffer, ldc int) error {
	if err := checkStream(s); err != nil {
		return g.devErr("GemmAsync", err)
	}
	if err := checkGemm(transA, transB, m, n, k, a, lda, b, ldb, c, ldc); err != nil {
		return g.devErr("GemmAsync", err)
	}
	if m == 0 || n == 0 {
		return nil
	}
	g.blasMu.Lock()
	defer g.blasMu.Unlock()
	lib, h, err := g.blasLocked()
	if err != nil {
		return err
	}
	ta, tb := C.int(0), C.int(0) // CUBLAS_OP_N
	if transA {
		ta = 1 // CUBLAS_OP_T
	}
	if transB {
		tb = 1
	}
	var st C.goddp_cublasStatus_t
	if r := C.goddp_blas_sgemm(g.lib.p, g.cuCtx, lib, h, C.uintptr_t(s), ta, tb, C.int(m), C.int(n), C.int(k), C.float(alpha),
		C.goddp_CUdeviceptr(a.Ptr), C.int(lda), C.goddp_CUdeviceptr(b.Ptr), C.int(ldb), C.float(beta), C.goddp_CUdeviceptr(c.Ptr), C.int(ldc), &st); r != 0 {
		return g.devErr("GemmAsync", g.lib.cuErr("cuCtxSetCurrent", r))
	}
	if st != 0 {
		return g.devErr("GemmAsync", fmt.Errorf("cublasSgemm (%d×%d×%d): status %d", m, n, k, int(st)))
	}
	return nil
}

// checkGemm checks a column-major SGEMM's arguments: float32 buffers, leading dimensions
// of at least the stored rows (and 1), and every buffer long enough for its matrix.
func checkGemm(transA, transB bool, m, n, k int, a procgroup.DeviceBuffer, lda int, b procgroup.DeviceBuffer, ldb int, c procgroup.DeviceBuffer, ldc int) error {
	if m < 0 || n < 0 || k < 0 || m > 1<<31-1 || n > 1<<31-1 || k > 1<<31-1 {
		return fmt.Errorf("%w: shape %d×%d×%d", procgroup.ErrInvalidArgument, m, n, k)
	}
	ar, ac := m, k // A as stored: ar rows, ac columns
	if transA {
		ar, ac = k, m
	}
	br, bc := k, n
	if transB {
		br, bc = n, k
	}
	for _, x := range []struct {
		name         string
		buf          procgroup.DeviceBuffer
		ld, rows, cs int
	}{{"A", a, lda, ar, ac}, {"B", b, ldb, br, bc}, {"C", c, ldc, m, n}} {
		if x.buf.Type != procgroup.Float32 {
			return fmt.Errorf("%w: %s is %v, want float32", procgroup.ErrInvalidArgument, x.name, x.buf.Type)
		}
		if x.ld < max(x.rows, 1) || x.ld > 1<<31-1 {
			return fmt.Errorf("%w: leading dimension of %s %d, want at least %d", procgroup.ErrInvalidArgument, x.name, x.ld, max(x.rows, 1))
		}
		if x.rows == 0 || x.cs == 0 {
			continue
		}
		if need := (x.cs-1)*x.ld + x.rows; x.buf.Count < need || x.buf.Ptr == 0 {
			return fmt.Errorf("%w: %s holds %d elements, its %d×%d matrix (leading dimension %d) needs %d", procgroup.ErrInvalidArgument, x.name, x.buf.Count, x.rows, x.cs, x.ld, need)
		}
	}
	return nil
}

// OrthonormalizeAsync implements procgroup.DeviceBLAS with the kernel goddp_orth_f32
// (kernels/kernels.ll): one thread does it all, which suits PowerSGD's factors (a few
// thousand rows, r ≤ 8 columns: about 3·rows·r² dependent float64 operations).
func (g *Group) OrthonormalizeAsync(s procgroup.Stream, a procgroup.DeviceBuffer, rows, cols int, seed uint64) error {
	if err := checkStream(s); err != nil {
		return g.devErr("OrthonormalizeAsync", err)
	}
	switch {
	case a.Type != procgroup.Float32:
		return g.devErr("OrthonormalizeAsync", fmt.Errorf("%w: a is %v, want float32", procgroup.ErrInvalidArgument, a.Type))
	case rows < 0 || cols < 0 || cols > 1<<31-1 || (rows > 0 && cols > a.Count/rows):
		return g.devErr("OrthonormalizeAsync", fmt.Errorf("%w: %d×%d in %d elements", procgroup.ErrInvalidArgument, rows, cols, a.Count))
	case rows*cols > 0 && a.Ptr == 0:
		return g.devErr("OrthonormalizeAsync", fmt.Errorf("%w: nil device pointer", procgroup.ErrInvalidArgument))
	}
	if rows == 0 || cols == 0 {
		return nil
	}
	return g.launch("OrthonormalizeAsync", kOrth, func(fn C.goddp_CUfunction) C.goddp_CUresult {
		return C.goddp_launch_orth(g.lib.p, g.cuCtx, fn, C.uintptr_t(s), C.goddp_CUdeviceptr(a.Ptr), C.ulonglong(rows), C.uint(cols), C.ulonglong(seed))
	})
}
