//go:build cgo

package nccl

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// stubCUBLAS is a library with cuBLAS's four entry points whose cublasCreate_v2 fails with
// CUBLAS_STATUS_NOT_INITIALIZED, as a real libcublas.so.13 does where the driver is older
// than CUDA 13 (its runtime cannot initialise).
const stubCUBLAS = `
int cublasCreate_v2(void **h) { *h = 0; return 1; }
int cublasDestroy_v2(void *h) { return 0; }
int cublasSetStream_v2(void *h, void *s) { return 0; }
int cublasSgemm_v2(void) { return 1; }
`

// TestGPUGemmLibFallback: GODDP_CUBLAS_LIB is "tried in order", so a candidate that loads
// but is no usable cuBLAS (missing symbols, or a cublasCreate that fails) must not stop
// the search for the ones after it.
func TestGPUGemmLibFallback(t *testing.T) {
	if gpuMode {
		t.Skip("fakes only")
	}
	good := os.Getenv(EnvCUBLASLib)
	dir := t.TempDir()
	src, stub := filepath.Join(dir, "stub.c"), filepath.Join(dir, "libcublas.so.13")
	if err := os.WriteFile(src, []byte(stubCUBLAS), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("gcc", "-shared", "-fPIC", "-o", stub, src).CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, tc := range []struct{ name, paths string }{
		{"no symbols", "libm.so.6:" + good},
		{"create fails", stub + ":" + good},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(EnvCUBLASLib, tc.paths)
			g, s := streamGroup(t)
			a := devMat(t, g, s, []float32{2})
			b := devMat(t, g, s, []float32{3})
			c := devMat(t, g, s, []float32{0})
			if err := g.GemmAsync(s, false, false, 1, 1, 1, 1, a, 1, b, 1, 0, c, 1); err != nil {
				t.Fatalf("GODDP_CUBLAS_LIB=%q: %v", tc.paths, err)
			}
			got := make([]float32, 1)
			if err := g.CopyOut(got, c); err != nil {
				t.Fatal(err)
			}
			if got[0] != 6 {
				t.Fatalf("2·3 = %v", got[0])
			}
		})
	}
}

// TestGPUPrepareBLAS: PrepareBLAS creates the cuBLAS handle (and loads the kernels) ahead of
// the first GemmAsync, once; Close destroys it.
func TestGPUPrepareBLAS(t *testing.T) {
	if gpuMode {
		t.Skip("fakes only")
	}
	g := startGroups(t, 1, 0)[0]
	before := g.lib.knob("blas_handles", 0)
	for range 2 {
		if err := g.PrepareBLAS(); err != nil {
			t.Fatal(err)
		}
	}
	if n := g.lib.knob("blas_handles", 0) - before; n != 1 {
		t.Fatalf("%d handles after PrepareBLAS twice, want 1", n)
	}
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	if n := g.lib.knob("blas_handles", 0) - before; n != 0 {
		t.Fatalf("%d handles left after Close, want 0", n)
	}
	if err := g.PrepareBLAS(); !errorsIs(err, procgroup.ErrClosed) {
		t.Fatalf("PrepareBLAS after Close: %v, want ErrClosed", err)
	}
}

// TestGPUKernelsAfterClose: a group that never launched a kernel (so never loaded its
// module) still refuses one after Close, rather than loading the module into the context
// it has released.
func TestGPUKernelsAfterClose(t *testing.T) {
	g, s := streamGroup(t)
	d, err := g.Alloc(procgroup.Float32, 4)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	d.Stream = s
	if err := g.ScaleAsync(s, d, d, 2, true); !errorsIs(err, procgroup.ErrClosed) {
		t.Fatalf("ScaleAsync after Close: %v, want ErrClosed", err)
	}
}

// TestGPUBLASDestroyBounded: cublasDestroy synchronises the device, so a trainer's stream
// that never finishes would hold Close inside it for good. Close returns by its deadline
// instead, with an error naming cublasDestroy that wraps ErrTimeout, and leaves the
// device resources allocated; the call returns once the stream moves again.
func TestGPUBLASDestroyBounded(t *testing.T) {
	if gpuMode {
		t.Skip("fakes only")
	}
	g, s := streamGroup(t)
	if err := g.PrepareBLAS(); err != nil {
		t.Fatal(err)
	}
	setTeardownTimeouts(g, time.Second, 300*time.Millisecond)
	g.lib.knob("gate_close", int64(s)) // the trainer's stream stops
	start := time.Now()
	err := g.Close()
	took := time.Since(start)
	g.lib.knob("gate_open", 0)
	waitStuck(g)
	if !errorsIs(err, procgroup.ErrTimeout) || !strings.Contains(err.Error(), "cublasDestroy") {
		t.Fatalf("Close: %v; want a timeout naming cublasDestroy", err)
	}
	if took > 5*time.Second {
		t.Fatalf("Close took %v, past its bounds", took)
	}
}
