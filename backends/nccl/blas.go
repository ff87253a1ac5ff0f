package nccl

/*
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"
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

// blasPaths are the candidates of EnvCUBLASLib (or the default), in order.
func blasPaths() (string, []string) {
	paths := os.Getenv(EnvCUBLASLib)
	if paths == "" {
		paths = defaultCUBLAS
	}
	var list []string
	for _, p := range strings.Split(paths, ":") {
		if p != "" {
			list = append(list, p)
		}
	}
	return paths, list
}

// loadBLAS opens the cuBLAS at path, a path or soname (once per path; a failure is not
// cached).
func loadBLAS(path string) (*C.goddp_blas, error) {
	blasLibsMu.Lock()
	defer blasLibsMu.Unlock()
	if b := blasLibs[path]; b != nil {
		return b, nil
	}
	cp := C.CString(path)
	defer C.free(unsafe.Pointer(cp))
	var errbuf [1024]C.char
	b := C.goddp_blas_load(cp, &errbuf[0], C.size_t(len(errbuf)))
	if b == nil {
		msg := C.GoString(&errbuf[0])
		if !strings.Contains(msg, path) { // a missing symbol's message does not name the file
			msg = path + ": " + msg
		}
		return nil, errors.New(msg)
	}
	blasLibs[path] = b
	return b, nil
}

// Note [cuBLAS handle]: a group creates one cuBLAS handle, at PrepareBLAS or its first
// GemmAsync, with its context (the device's primary context, the one the CUDA runtime
// under cuBLAS uses too) current, as cublasCreate binds a handle to the device current
// then. cuBLAS's calls are thread safe on one handle, but the stream is handle state
// (cublasSetStream), so g.blasMu serialises each cublasSetStream + cublasSgemm pair: the
// stream is set on every call, since callers pass their own. The handle keeps its
// defaults: CUBLAS_POINTER_MODE_HOST (alpha and beta are read from host memory during the
// call, so stack values will do) and CUBLAS_DEFAULT_MATH (float32 arithmetic, no tensor
// op math). cuBLAS gives the same bits from run to run on one architecture and SM count
// with one stream in use (its "Results reproducibility"); ranks on different GPUs (or MIG
// slices of different sizes) may round differently. PowerSGD's Setup calls PrepareBLAS, so
// that cublasCreate, which allocates device memory, does not run inside a Launch while
// earlier buckets' collectives are in flight. releaseDevice destroys the handle after the
// comm stream has drained, bounded (releaseBLAS).

// blasLocked returns the group's cuBLAS handle, created on first use with the first
// candidate of EnvCUBLASLib that loads, resolves cuBLAS's symbols and creates a handle: a
// libcublas.so.13 that loads but cannot initialise (a driver older than CUDA 13) gives way
// to a libcublas.so.12 after it. g.blasMu is held.
func (g *Group) blasLocked() (*C.goddp_blas, C.goddp_cublasHandle_t, error) {
	if g.devClosed.Load() {
		return nil, nil, g.closedErr()
	}
	if g.blasH != nil || g.blasErr != nil {
		return g.blasLib, g.blasH, g.blasErr
	}
	paths, list := blasPaths()
	if len(list) == 0 {
		g.blasErr = fmt.Errorf("nccl: rank %d: %w: %s=%q names no library", g.rank, ErrUnavailable, EnvCUBLASLib, paths)
		return nil, nil, g.blasErr
	}
	var why []string
	for _, p := range list {
		b, err := loadBLAS(p)
		if err != nil {
			why = append(why, err.Error())
			continue
		}
		var h C.goddp_cublasHandle_t
		var st C.goddp_cublasStatus_t
		if r := C.goddp_blas_create(g.lib.p, g.cuCtx, b, &h, &st); r != 0 {
			return nil, nil, g.devErr("GemmAsync", g.lib.cuErr("cuCtxSetCurrent", r))
		}
		if st != 0 {
			why = append(why, fmt.Sprintf("%s: cublasCreate: status %d", p, int(st)))
			continue
		}
		g.blasLib, g.blasH = b, h
		return b, h, nil
	}
	g.blasErr = fmt.Errorf("nccl: rank %d: %w: no usable cuBLAS in %q (%s); install it (for instance the nvidia-cublas-cu12 or -cu13 pip package, whichever the driver supports) or set %s to its path",
		g.rank, ErrUnavailable, paths, strings.Join(why, "; "), EnvCUBLASLib)
	return nil, nil, g.blasErr
}

// releaseBLAS destroys the cuBLAS handle (releaseDevice): it returns "" once it has by
// deadline, or what did not return. cublasDestroy synchronises the whole device (it calls cudaDeviceSynchronize,
// by cuBLAS's documentation), so it also waits for the trainer's streams, and a kernel
// there that never ends (another communicator's, waiting for a dead peer) would hold it
// for good: it runs on a goroutine of its own, counted in g.stuck, as ncclCommAbort does
// (Note [Bounded teardown]). A GemmAsync inside its cgo call holds g.blasMu; so does
// releaseBLAS only while it takes the handle away. Later calls fail with ErrClosed.
func (g *Group) releaseBLAS(deadline time.Time) string {
	if !lockBy(&g.blasMu, deadline) {
		return "a GemmAsync in progress did not return"
	}
	lib, h := g.blasLib, g.blasH
	g.blasH = nil
	g.blasErr = g.closedErr()
	g.blasMu.Unlock()
	if h != nil && !g.bounded(deadline, func() {
		var st C.goddp_cublasStatus_t
		C.goddp_blas_destroy(g.lib.p, g.cuCtx, lib, h, &st)
	}) {
		return "cublasDestroy (which synchronises the device) did not return"
	}
	return ""
}

// PrepareBLAS implements procgroup.DeviceBLAS: it creates the cuBLAS handle and loads the
// kernels' module now, so that neither happens inside a hook's Launch, while the
// collectives of earlier buckets run (cublasCreate and cuModuleLoadData allocate device
// memory, which may wait for the device).
func (g *Group) PrepareBLAS() error {
	g.blasMu.Lock()
	_, _, err := g.blasLocked()
	g.blasMu.Unlock()
	if err != nil {
		return err
	}
	g.modUse.RLock() // as a launch: releaseDevice waits for a load in progress, bounded
	defer g.modUse.RUnlock()
	g.devMu.Lock()
	defer g.devMu.Unlock()
	return g.kernelsLocked()
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
