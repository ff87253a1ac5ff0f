//go:build cgo

package nccl

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goddp/goddp/procgroup"
)

// gpuMode: GODDP_GPU=1 runs the tests against the libraries the environment names (a real
// GPU, or the fakes when scripts/gpu_check.sh is tried without one); otherwise TestMain
// builds the fake libraries and points the backend at them.
var gpuMode = os.Getenv("GODDP_GPU") == "1"

func TestMain(m *testing.M) {
	code := func() int {
		if !gpuMode {
			dir, err := os.MkdirTemp("", "goddp-fake-nccl-")
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			defer os.RemoveAll(dir)
			if err := buildFakes(dir); err != nil {
				fmt.Fprintln(os.Stderr, "building the fake libcuda/libnccl:", err)
				return 1
			}
			os.Setenv(EnvCUDALib, filepath.Join(dir, "libcuda.so.1"))
			os.Setenv(EnvNCCLLib, filepath.Join(dir, "libnccl.so.2"))
			os.Setenv(EnvCUBLASLib, filepath.Join(dir, "libcublas.so"))
		}
		code := m.Run()
		if !gpuMode {
			// Every test ends with the fake's count of calls on a freed communicator at 0.
			if l, err := loadLib(libPaths(&Config{})); err == nil {
				if n := l.knob("nccl_use_after_free", 0); n != 0 {
					fmt.Fprintf(os.Stderr, "fakenccl: %d NCCL calls on an aborted or destroyed communicator\n", n)
					code = 1
				}
			}
		}
		if code == 0 {
			if err := goleak.Find(); err != nil {
				fmt.Fprintln(os.Stderr, "goleak:", err)
				return 1
			}
		}
		return code
	}()
	os.Exit(code)
}

// buildFakes compiles testdata/fake into dir: libcuda.so.1, libnccl.so.2 and libcublas.so
// (which find the fake driver by its soname, through their rpath).
func buildFakes(dir string) error {
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	for _, args := range [][]string{
		{"-shared", "-fPIC", "-O1", "-ffp-contract=off", "-o", filepath.Join(dir, "libcuda.so.1"), "-Wl,-soname,libcuda.so.1",
			"testdata/fake/fakecuda.c", "-lpthread", "-lm"},
		{"-shared", "-fPIC", "-O1", "-o", filepath.Join(dir, "libnccl.so.2"), "-Wl,-soname,libnccl.so.2",
			"testdata/fake/fakenccl.c", "-L" + dir, "-l:libcuda.so.1", "-Wl,-rpath," + dir, "-lpthread", "-lm"},
		{"-shared", "-fPIC", "-O1", "-ffp-contract=off", "-o", filepath.Join(dir, "libcublas.so"), "-Wl,-soname,libcublas.so",
			"testdata/fake/fakecublas.c", "-L" + dir, "-l:libcuda.so.1", "-Wl,-rpath," + dir},
	} {
		out, err := exec.Command(cc, args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s %v: %w\n%s", cc, args, err, out)
		}
	}
	return nil
}

var prefixN atomic.Int64

// streamGroup is a one-rank group with a stream of its own, both closed when t ends.
func streamGroup(t testing.TB) (*Group, Stream) {
	t.Helper()
	g := startGroups(t, 1, 0)[0]
	t.Cleanup(func() { g.Close() })
	s, err := g.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { g.DestroyStream(s) })
	return g, s
}

// startGroups creates size ranks (rank r on fake device r) as goroutines of this process.
// The caller closes them (or a cleanup aborts what is left).
func startGroups(t testing.TB, size int, timeout time.Duration) []*Group {
	t.Helper()
	gs, err := tryGroups(size, timeout)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, g := range gs {
			g.Abort(nil)
		}
	})
	return gs
}

func tryGroups(size int, timeout time.Duration) ([]*Group, error) {
	store := procgroup.NewMemStore()
	defer store.Close()
	prefix := fmt.Sprintf("t%d", prefixN.Add(1))
	pgs := make([]procgroup.ProcessGroup, size)
	errs := make([]error, size)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for r := range size {
		wg.Go(func() {
			pgs[r], errs[r] = procgroup.New(ctx, "nccl", procgroup.Options{
				Rank: r, Size: size, LocalRank: r, LocalSize: size, Store: store, Prefix: prefix, Timeout: timeout,
			})
		})
	}
	wg.Wait()
	gs := make([]*Group, size)
	var first error
	for r, pg := range pgs {
		if errs[r] != nil && first == nil {
			first = fmt.Errorf("rank %d: %w", r, errs[r])
		}
		if pg != nil {
			gs[r] = pg.(*Group)
		}
	}
	if first != nil {
		for _, g := range gs {
			if g != nil {
				g.Abort(nil)
			}
		}
		return nil, first
	}
	return gs, nil
}

func waitT(t testing.TB, w procgroup.Work) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := w.Wait(ctx)
	if ctx.Err() != nil {
		t.Fatalf("work did not complete in 30s: %v", err)
	}
	return err
}

// testLib is the loaded pair of libraries of the environment (the fakes, usually).
func testLib(t testing.TB) *lib {
	t.Helper()
	l, err := loadLib(libPaths(&Config{}))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// fake skips the test unless the loaded libraries are the fakes.
func fake(t testing.TB) *lib {
	t.Helper()
	l := testLib(t)
	if l.knob("tasks_run", 0) < 0 {
		t.Skip("needs the fake libraries")
	}
	return l
}
