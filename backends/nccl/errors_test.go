//go:build cgo

package nccl

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
)

func newOne(cfg *Config, localRank, localSize int) (procgroup.ProcessGroup, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return procgroup.New(ctx, "nccl", procgroup.Options{Rank: 0, Size: 1, LocalRank: localRank, LocalSize: localSize,
		Store: procgroup.NewMemStore(), Backend: cfg})
}

func wantErr(t *testing.T, err error, target error, parts ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("err = nil, want an error wrapping %v", target)
	}
	if target != nil && !errors.Is(err, target) {
		t.Errorf("err = %v, want it to wrap %v", err, target)
	}
	for _, p := range parts {
		if !strings.Contains(err.Error(), p) {
			t.Errorf("err = %v, want it to mention %q", err, p)
		}
	}
}

func TestRegistered(t *testing.T) {
	if _, err := procgroup.Lookup("nccl"); err != nil {
		t.Fatal(err)
	}
}

func TestLibraryMissing(t *testing.T) {
	cuda, nccl := libPaths(&Config{})
	_, err := newOne(&Config{CUDALib: cuda, NCCLLib: "/nonexistent/libnccl.so.2"}, 0, 1)
	wantErr(t, err, ErrUnavailable, "libnccl.so.2", EnvNCCLLib, "rank 0")
	_, err = newOne(&Config{CUDALib: "/nonexistent/libcuda.so.1", NCCLLib: nccl}, 0, 1)
	wantErr(t, err, ErrUnavailable, "libcuda.so.1", EnvCUDALib)
	pg, err := newOne(nil, 0, 1) // the environment's libraries: fine
	if err != nil {
		t.Fatal(err)
	}
	pg.Close()
}

func TestBadBackendOption(t *testing.T) {
	ctx := context.Background()
	_, err := procgroup.New(ctx, "nccl", procgroup.Options{Rank: 0, Size: 1, Store: procgroup.NewMemStore(), Backend: 42})
	wantErr(t, err, procgroup.ErrInvalidArgument, "*nccl.Config")
}

func TestNoDevice(t *testing.T) {
	l := fake(t)
	old := l.knob("device_count", 0)
	defer l.knob("device_count", old)
	_, err := newOne(nil, 0, 1)
	wantErr(t, err, ErrUnavailable, "no CUDA device", "cuDeviceGetCount = 0")

	l.knob("device_count", 1)
	_, err = newOne(nil, 1, 2)
	wantErr(t, err, ErrUnavailable, "local rank 1 needs device 1", "only 1 CUDA devices")
}

func TestInitFailure(t *testing.T) {
	l := fake(t)
	l.knob("nccl_init_fail", 2) // ncclSystemError
	defer l.knob("nccl_init_fail", 0)
	_, err := tryGroups(2, 0)
	wantErr(t, err, nil, "ncclCommInitRank", "unhandled system error")
}

// stuck issues an all-reduce on rank 0 only, which cannot complete.
func stuck(t *testing.T, gs []*Group) procgroup.Work {
	w := gs[0].AllReduce(context.Background(), []float32{1, 2, 3}, procgroup.Sum)
	select {
	case <-w.Done():
		t.Fatalf("a collective only rank 0 issued completed: %v", w.Err())
	default:
	}
	return w
}

func TestAsyncErrorAborts(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 2, 0)
	// One collective that completes, then one that cannot.
	ws := []procgroup.Work{
		gs[0].AllReduce(context.Background(), []float32{1}, procgroup.Sum),
		gs[1].AllReduce(context.Background(), []float32{2}, procgroup.Sum),
	}
	for _, w := range ws {
		if err := waitT(t, w); err != nil {
			t.Fatal(err)
		}
	}
	w := stuck(t, gs)
	l.knob("nccl_async_error", 6) // ncclRemoteError
	err := waitT(t, w)
	wantErr(t, err, procgroup.ErrAborted, "rank 0", "allreduce #2", "last completed #1", "ncclCommGetAsyncError", "remote process exited")
	// Later works fail at once.
	w2 := gs[0].Barrier(context.Background())
	select {
	case <-w2.Done():
		wantErr(t, w2.Err(), procgroup.ErrAborted)
	default:
		t.Fatal("work issued after the abort is pending")
	}
	for _, g := range gs {
		g.Close()
	}
}

func TestTimeoutAborts(t *testing.T) {
	gs := startGroups(t, 2, 50*time.Millisecond)
	w := stuck(t, gs)
	w2 := gs[0].Broadcast(context.Background(), []int64{1, 2}, 1)
	err := waitT(t, w)
	wantErr(t, err, procgroup.ErrTimeout, "rank 0", "allreduce #1", "did not complete within 50ms")
	wantErr(t, err, procgroup.ErrAborted)
	wantErr(t, waitT(t, w2), procgroup.ErrAborted, "broadcast #2", "allreduce #1")
	for _, g := range gs {
		g.Close()
	}
}

func TestContextEndAborts(t *testing.T) {
	gs := startGroups(t, 2, 0)
	ctx, cancel := context.WithCancel(context.Background())
	w := gs[0].AllGather(ctx, make([]float32, 4), []float32{1, 2})
	cancel()
	wantErr(t, waitT(t, w), context.Canceled, "allgather #1")
	wantErr(t, w.Err(), procgroup.ErrAborted)
	for _, g := range gs {
		g.Close()
	}
}

func TestMismatchedCollectives(t *testing.T) {
	gs := startGroups(t, 2, 0)
	w0 := gs[0].AllReduce(context.Background(), make([]float32, 5), procgroup.Sum)
	w1 := gs[1].AllReduce(context.Background(), make([]float32, 6), procgroup.Sum)
	wantErr(t, waitT(t, w0), procgroup.ErrAborted, "allreduce #1", "invalid usage")
	wantErr(t, waitT(t, w1), procgroup.ErrAborted, "allreduce #1", "invalid usage")
	for _, g := range gs {
		g.Close()
	}
}

func TestInvalidDeviceBuffers(t *testing.T) {
	gs := startGroups(t, 1, 0)
	g := gs[0]
	ctx := context.Background()
	for name, w := range map[string]procgroup.Work{
		"nil ptr":    g.AllReduce(ctx, DeviceBuffer{Type: procgroup.Float32, Count: 3}, procgroup.Sum),
		"bad dtype":  g.AllReduce(ctx, DeviceBuffer{Ptr: 8, Type: 0, Count: 3}, procgroup.Sum),
		"nil *buf":   g.AllReduce(ctx, (*DeviceBuffer)(nil), procgroup.Sum),
		"mixed":      g.AllGather(ctx, DeviceBuffer{Ptr: 8, Type: procgroup.Float32, Count: 3}, []float32{1, 2, 3}),
		"foreign":    g.AllReduce(ctx, otherBuf{}, procgroup.Sum),
		"bad stream": g.AllReduce(ctx, DeviceBuffer{Ptr: 8, Type: procgroup.Float32, Count: -1}, procgroup.Sum),
	} {
		if err := waitT(t, w); !errors.Is(err, procgroup.ErrInvalidArgument) {
			t.Errorf("%s: err = %v, want ErrInvalidArgument", name, err)
		}
	}
	g.Close()
}

type otherBuf struct{}

func (otherBuf) DType() procgroup.DType { return procgroup.Float32 }
func (otherBuf) Len() int               { return 1 }

func TestVersionString(t *testing.T) {
	for code, want := range map[int]string{22105: "2.21.5", 21003: "2.10.3", 2804: "2.8.4"} {
		if got := versionString(code); got != want {
			t.Errorf("versionString(%d) = %q, want %q", code, got, want)
		}
	}
	if !atLeast(21003, 2, 10) || atLeast(2804, 2, 10) || !atLeast(30000, 2, 10) {
		t.Error("atLeast is wrong")
	}
}
