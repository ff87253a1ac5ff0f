//go:build cgo

package nccl

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/goddp/goddp/procgroup"
)

// These tests use device buffers. They run on the fakes in CI and, with GODDP_GPU=1, on a
// real GPU at world size 1 (scripts/gpu_check.sh); the sizes > 1 run on the fakes only.

func worldSizes() []int {
	if gpuMode {
		return []int{1}
	}
	return []int{1, 2, 3}
}

func each(t *testing.T, gs []*Group, f func(r int, g *Group) error) {
	t.Helper()
	errs := make([]error, len(gs))
	done := make(chan int)
	for r, g := range gs {
		go func() { errs[r] = f(r, g); done <- r }()
	}
	for range gs {
		<-done
	}
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
}

// TestDeviceAllReduce all-reduces random float32 and int64 device buffers (each rank on
// its own compute stream) and compares with a reference summed on the host.
func TestDeviceAllReduce(t *testing.T) {
	for _, n := range worldSizes() {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			gs := startGroups(t, n, 0)
			const count = 4099
			rng := rand.New(rand.NewPCG(uint64(n), 7))
			ins := make([][]float32, n)
			ints := make([][]int64, n)
			want := make([]float64, count)
			wantI := make([]int64, count)
			for r := range n {
				ins[r] = make([]float32, count)
				ints[r] = make([]int64, count)
				for i := range count {
					ins[r][i] = float32(rng.Float64()*2 - 1)
					ints[r][i] = rng.Int64N(1<<40) - 1<<39
					want[i] += float64(ins[r][i])
					wantI[i] += ints[r][i]
				}
			}
			each(t, gs, func(r int, g *Group) error {
				s, err := g.NewStream()
				if err != nil {
					return err
				}
				defer g.DestroyStream(s)
				f, err := g.Alloc(procgroup.Float32, count)
				if err != nil {
					return err
				}
				defer g.Free(f)
				i64, err := g.Alloc(procgroup.Int64, count)
				if err != nil {
					return err
				}
				defer g.Free(i64)
				f.Stream, i64.Stream = s, s
				if err := g.CopyIn(f, ins[r]); err != nil {
					return err
				}
				if err := g.CopyIn(i64, ints[r]); err != nil {
					return err
				}
				w1 := g.AllReduce(context.Background(), f, procgroup.Sum)
				w2 := g.AllReduce(context.Background(), &i64, procgroup.Max)
				// Stream-ordered: the copies out wait on the GPU for the collectives.
				if err := w1.(*Work).WaitStream(s); err != nil {
					return err
				}
				if err := w2.(*Work).WaitStream(s); err != nil {
					return err
				}
				gotF := make([]float32, count)
				gotI := make([]int64, count)
				if err := g.CopyOut(gotF, f); err != nil {
					return err
				}
				if err := g.CopyOut(gotI, i64); err != nil {
					return err
				}
				for _, w := range []procgroup.Work{w1, w2} {
					if err := w.Wait(context.Background()); err != nil {
						return err
					}
				}
				for i := range count {
					if d := math.Abs(float64(gotF[i]) - want[i]); d > 1e-5*float64(n) {
						return fmt.Errorf("float32 sum [%d] = %v, want %v", i, gotF[i], want[i])
					}
					var m int64 = math.MinInt64
					for q := range n {
						m = max(m, ints[q][i])
					}
					if gotI[i] != m {
						return fmt.Errorf("int64 max [%d] = %d, want %d", i, gotI[i], m)
					}
				}
				return nil
			})
			for _, g := range gs {
				g.Close()
			}
		})
	}
}

// TestStreamOrder checks Note [Stream order]: a collective on a device buffer waits, on the
// GPU, for the work queued before it on the buffer's compute stream. The compute stream
// first runs something slow (on the fakes: a gate the test opens; on a GPU: a long series
// of memsets), then sets the input to 2.0; the out-of-place all-gather and reduce-scatter
// must see 2.0, never the 1.0 the input held when they were issued.
func TestStreamOrder(t *testing.T) {
	for _, n := range worldSizes() {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			gs := startGroups(t, n, 0)
			gated := gs[0].lib.knob("tasks_run", 0) >= 0
			const count = 12 << 12 // a multiple of every world size tested
			// Every rank queues its collectives (started), then every rank checks that they
			// wait (checked), and only then does rank 0 open the gate, which the ranks share.
			ready, allChecked := make(chan struct{}), make(chan struct{})
			started, checked := make(chan Stream, n), make(chan struct{}, n)
			go func() {
				for range n {
					<-started
				}
				close(ready)
				for range n {
					<-checked
				}
				close(allChecked)
			}()
			each(t, gs, func(r int, g *Group) error {
				s, err := g.NewStream()
				if err != nil {
					return err
				}
				defer g.DestroyStream(s)
				in, err := g.Alloc(procgroup.Float32, count)
				if err != nil {
					return err
				}
				defer g.Free(in)
				out, err := g.Alloc(procgroup.Float32, n*count)
				if err != nil {
					return err
				}
				defer g.Free(out)
				rs, err := g.Alloc(procgroup.Float32, count/n)
				if err != nil {
					return err
				}
				defer g.Free(rs)
				in.Stream, out.Stream, rs.Stream = s, s, s
				ones := make([]float32, count)
				for i := range ones {
					ones[i] = 1
				}
				if err := g.CopyIn(in, ones); err != nil {
					return err
				}
				if gated {
					g.lib.knob("gate_close", int64(s))
				} else {
					scratch, err := g.Alloc(procgroup.Float32, 64<<20) // 256 MiB
					if err != nil {
						return err
					}
					defer g.Free(scratch)
					for k := range 200 {
						if err := g.memsetD32(scratch, uint32(k), scratch.Count, s); err != nil {
							return err
						}
					}
				}
				if err := g.memsetD32(in, math.Float32bits(2), count, s); err != nil {
					return err
				}
				ag := g.AllGather(context.Background(), out, in)
				rsw := g.ReduceScatter(context.Background(), rs, in, procgroup.Sum)
				started <- s
				if gated {
					<-ready
					select {
					case <-ag.Done():
						checked <- struct{}{}
						return fmt.Errorf("all-gather completed while its compute stream was blocked: %v", ag.Err())
					default:
					}
					checked <- struct{}{}
					<-allChecked
					if r == 0 {
						g.lib.knob("gate_open", 0)
					}
				}
				for _, w := range []procgroup.Work{ag, rsw} {
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					err := w.Wait(ctx)
					cancel()
					if err != nil {
						return err
					}
				}
				got := make([]float32, n*count)
				if err := g.CopyOut(got, out); err != nil {
					return err
				}
				for i, v := range got {
					if v != 2 {
						return fmt.Errorf("all-gather [%d] = %v, want 2 (the collective did not wait for the compute stream)", i, v)
					}
				}
				gotRS := make([]float32, count/n)
				if err := g.CopyOut(gotRS, rs); err != nil {
					return err
				}
				for i, v := range gotRS {
					if v != float32(2*n) {
						return fmt.Errorf("reduce-scatter [%d] = %v, want %d", i, v, 2*n)
					}
				}
				return nil
			})
			for _, g := range gs {
				g.Close()
			}
			if !gated {
				t.Logf("stream order verified on %s, NCCL %s", os.Getenv(EnvNCCLLib), gs[0].NCCLVersion())
			}
		})
	}
}

// TestGPUStreamWaitTimeline shows, from event timestamps, the communication stream waiting
// on the compute stream (Note [Stream order]): timed events mark, on the compute stream,
// the start and the end of slow work that writes the all-reduce's input (on the fakes: a
// gate the test opens; on a GPU: a series of large memsets), and on the comm stream the
// moment it was free before the all-reduce was issued and the all-reduce's end. The
// all-reduce must end after the compute work, though the comm stream was free long before;
// and its result is the compute work's value. It logs the timeline (scripts/gpu_check.sh
// prints it).
func TestGPUStreamWaitTimeline(t *testing.T) {
	gs := startGroups(t, 1, 0)
	g := gs[0]
	gated := g.lib.knob("tasks_run", 0) >= 0
	s, err := g.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer g.DestroyStream(s)
	ev := make([]procgroup.Event, 4) // compute start, compute end, comm free, comm all-reduce end
	for k := range ev {
		if ev[k], err = g.NewTimedEvent(); err != nil {
			t.Fatal(err)
		}
		defer g.DestroyEvent(ev[k])
	}
	const count = 1 << 20
	buf, err := g.Alloc(procgroup.Float32, count)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Free(buf)
	buf.Stream = s
	if err := g.RecordEvent(ev[0], s); err != nil {
		t.Fatal(err)
	}
	if gated {
		g.lib.knob("gate_close", int64(s))
	} else {
		scratch, err := g.Alloc(procgroup.Float32, 64<<20)
		if err != nil {
			t.Fatal(err)
		}
		defer g.Free(scratch)
		for k := range 100 {
			if err := g.memsetD32(scratch, uint32(k), scratch.Count, s); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := g.memsetD32(buf, math.Float32bits(3), count, s); err != nil {
		t.Fatal(err)
	}
	if err := g.RecordEvent(ev[1], s); err != nil {
		t.Fatal(err)
	}
	commStream := procgroup.Stream(uintptr(unsafe.Pointer(g.stream)))
	if err := g.RecordEvent(ev[2], commStream); err != nil { // the comm stream is idle here
		t.Fatal(err)
	}
	if err := g.SyncStream(commStream); err != nil { // so ev[2] is stamped before the all-reduce is issued
		t.Fatal(err)
	}
	w := g.AllReduce(context.Background(), buf, procgroup.Sum)
	if err := g.RecordEvent(ev[3], commStream); err != nil {
		t.Fatal(err)
	}
	if gated {
		g.lib.knob("gate_open", 0)
	}
	if err := waitT(t, w); err != nil {
		t.Fatal(err)
	}
	if err := g.SyncStream(commStream); err != nil {
		t.Fatal(err)
	}
	at := make([]float64, 4)
	for k := 1; k < 4; k++ {
		if at[k], err = g.EventElapsed(ev[0], ev[k]); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("timeline (ms from the compute stream's start): comm stream idle at %.3f; compute work ends %.3f; all-reduce ends %.3f: the comm stream waited %.3f ms for the compute stream",
		at[2], at[1], at[3], at[1]-at[2])
	if !(at[3] >= at[1]) {
		t.Fatalf("the all-reduce ended at %.3f ms, before the compute work it reads (%.3f ms)", at[3], at[1])
	}
	got := make([]float32, count)
	if err := g.CopyOut(got, buf); err != nil {
		t.Fatal(err)
	}
	for k, v := range got {
		if v != 3 {
			t.Fatalf("[%d] = %v, want 3 (the compute stream's value)", k, v)
		}
	}
	g.Close()
}
