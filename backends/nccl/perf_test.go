//go:build cgo

package nccl

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// TestGPUPerfTable prints an allreduce-perf (nccl-tests style) table of float32 sum
// all-reduces on device buffers, stream-ordered, at the group's world size (1 on one GPU:
// busbw is then 0 by definition). It runs only with GODDP_GPU=1; it checks every result.
func TestGPUPerfTable(t *testing.T) {
	if !gpuMode {
		t.Skip("GODDP_GPU=1 only (scripts/gpu_check.sh)")
	}
	g, s := streamGroup(t)
	maxBytes := 256 << 20
	if os.Getenv("GODDP_GPU_PERF_MAX") != "" {
		fmt.Sscan(os.Getenv("GODDP_GPU_PERF_MAX"), &maxBytes)
	}
	buf, err := g.Alloc(procgroup.Float32, maxBytes/4)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Free(buf)
	buf.Stream = s
	n := g.Size()
	fmt.Printf("# allreduce-perf (device buffers): backend nccl %s, %d rank(s), float32 sum, stream-ordered\n", g.NCCLVersion(), n)
	fmt.Printf("%12s %12s %8s %10s %10s %10s %6s\n", "size(B)", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "check")
	for bytes := 4096; bytes <= maxBytes; bytes *= 4 {
		b := buf.Slice(0, bytes/4)
		host := make([]float32, b.Count)
		for i := range host {
			host[i] = float32(i%251) * 0.5
		}
		if err := g.CopyIn(b, host); err != nil {
			t.Fatal(err)
		}
		const warm, iters = 5, 20
		run := func(k int) {
			var w procgroup.Work
			for range k {
				w = g.AllReduce(context.Background(), b, procgroup.Sum)
				if err := w.(*Work).WaitStream(s); err != nil {
					t.Fatal(err)
				}
			}
			if err := g.SyncStream(s); err != nil {
				t.Fatal(err)
			}
			if err := w.Wait(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		run(warm)
		start := time.Now()
		run(iters)
		el := time.Since(start) / iters
		got := make([]float32, b.Count)
		if err := g.CopyOut(got, b); err != nil {
			t.Fatal(err)
		}
		check := "ok"
		scale := float32(1)
		for range warm + iters {
			scale *= float32(n)
		}
		for i, v := range got {
			if v != host[i]*scale {
				check = fmt.Sprintf("FAIL[%d]=%v", i, v)
				t.Errorf("size %d: element %d = %v, want %v", bytes, i, v, host[i]*scale)
				break
			}
		}
		algbw := float64(bytes) / el.Seconds() / 1e9
		busbw := algbw * 2 * float64(n-1) / float64(n)
		fmt.Printf("%12d %12d %8s %10.1f %10.2f %10.2f %6s\n", bytes, b.Count, "float32", float64(el.Microseconds()), algbw, busbw, check)
	}
}
