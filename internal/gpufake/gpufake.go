// Package gpufake builds the fake CUDA driver, NCCL and cuBLAS of the tests
// (backends/nccl/testdata/fake) and turns their knobs, for tests outside backends/nccl that
// run the GPU path on the CPU (the reducer's device buckets, examples/gpumlp).
//
// # Usage
//
//	func TestMain(m *testing.M) {
//		libs, err := gpufake.Build(dir) // then point the backend at them:
//		libs.Setenv()                   // GODDP_CUDA_LIB, GODDP_NCCL_LIB, GODDP_CUBLAS_LIB
//		...
//	}
//	n := gpufake.Knob("syncs", 0) // host synchronisations so far (see fakecuda.c)
//
// The fakes keep all their state in the process: libraries loaded by path twice (by the
// backend and by Knob) are the same library.
package gpufake

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>

static long long knob(void *h, const char *name, long long value) {
	long long (*f)(const char *, long long) = (long long (*)(const char *, long long))dlsym(h, "fake_knob");
	return f ? f(name, value) : -1;
}
*/
import "C"

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"unsafe"
)

// Libs are the paths of the built fakes.
type Libs struct {
	CUDA, NCCL, CUBLAS string
}

// Setenv points the nccl backend (GODDP_CUDA_LIB, GODDP_NCCL_LIB) and the example's cuBLAS
// loader (GODDP_CUBLAS_LIB) at the fakes.
func (l Libs) Setenv() {
	os.Setenv("GODDP_CUDA_LIB", l.CUDA)
	os.Setenv("GODDP_NCCL_LIB", l.NCCL)
	os.Setenv("GODDP_CUBLAS_LIB", l.CUBLAS)
}

// Source is the directory of the fakes' C sources.
func Source() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "backends", "nccl", "testdata", "fake")
}

var (
	mu     sync.Mutex // guards handle
	handle unsafe.Pointer
)

// Build compiles the fakes into dir: libcuda.so.1, libnccl.so.2 and libcublas.so (the
// last two find the fake driver by its soname, through their rpath). $CC overrides gcc.
func Build(dir string) (Libs, error) {
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	src := Source()
	l := Libs{CUDA: filepath.Join(dir, "libcuda.so.1"), NCCL: filepath.Join(dir, "libnccl.so.2"), CUBLAS: filepath.Join(dir, "libcublas.so")}
	for _, args := range [][]string{
		{"-shared", "-fPIC", "-O1", "-ffp-contract=off", "-o", l.CUDA, "-Wl,-soname,libcuda.so.1", filepath.Join(src, "fakecuda.c"), "-lpthread", "-lm"},
		{"-shared", "-fPIC", "-O1", "-o", l.NCCL, "-Wl,-soname,libnccl.so.2", filepath.Join(src, "fakenccl.c"),
			"-L" + dir, "-l:libcuda.so.1", "-Wl,-rpath," + dir, "-lpthread", "-lm"},
		{"-shared", "-fPIC", "-O1", "-ffp-contract=off", "-o", l.CUBLAS, "-Wl,-soname,libcublas.so", filepath.Join(src, "fakecublas.c"),
			"-L" + dir, "-l:libcuda.so.1", "-Wl,-rpath," + dir},
	} {
		if out, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
			return Libs{}, fmt.Errorf("gpufake: %s %v: %w\n%s", cc, args, err, out)
		}
	}
	return l, nil
}

// Knob calls fake_knob(name, value) of the fake NCCL (which passes names it does not know
// to the fake driver) named by $GODDP_NCCL_LIB, and returns its result: -1 when the
// library is not a fake (or cannot be loaded). See fakecuda.c and fakenccl.c for the
// knobs.
func Knob(name string, value int64) int64 {
	mu.Lock()
	if handle == nil {
		p := C.CString(os.Getenv("GODDP_NCCL_LIB"))
		handle = C.dlopen(p, C.RTLD_NOW|C.RTLD_LOCAL)
		C.free(unsafe.Pointer(p))
	}
	h := handle
	mu.Unlock()
	if h == nil {
		return -1
	}
	cn := C.CString(name)
	defer C.free(unsafe.Pointer(cn))
	return int64(C.knob(h, cn, C.longlong(value)))
}
