//go:build cgo

package nccl

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// The fake driver keeps the current context per thread and tells contexts apart
// (fakecuda.c); these tests hold their goroutine on one OS thread to see it.

// TestCallerContextRestored: a caller with a context of its own (gorgonia/cu's NewContext:
// another context on the same device) finds it still current after every entry point.
func TestCallerContextRestored(t *testing.T) {
	l := fake(t)
	gs := startGroups(t, 1, 0)
	g := gs[0]
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	mine := l.knob("ctx_create", 0) // current now, on this thread
	if mine <= 0 {
		t.Fatal("the fake cannot create a context")
	}
	defer l.knob("ctx_set", 0)
	check := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if cur := l.knob("ctx_get", 0); cur != mine {
			t.Errorf("after %s the current context is %#x, want the caller's %#x (the group's is %#x)", what, cur, mine, int64(uintptr(g.cuCtx)))
			l.knob("ctx_set", mine)
		}
	}
	s, err := g.NewStream()
	check("NewStream", err)
	buf, err := g.Alloc(procgroup.Float32, 64)
	check("Alloc", err)
	buf.Stream = s
	tmp, err := g.Alloc(procgroup.Float32, 64)
	check("Alloc", err)
	tmp.Stream = s
	rng := rand.New(rand.NewPCG(5, 6))
	in := make([]float32, 64)
	for i := range in {
		in[i] = float32(rng.Float64()*2 - 1)
	}
	check("CopyIn", g.CopyIn(buf, in))
	check("ZeroAsync", g.ZeroAsync(s, tmp))
	check("ScaleAsync", g.ScaleAsync(s, tmp, buf, 0.5, true))
	ev, err := g.NewEvent()
	check("NewEvent", err)
	check("RecordEvent", g.RecordEvent(ev, s))
	check("WaitEvent", g.WaitEvent(s, ev))
	w := g.AllReduce(context.Background(), tmp, procgroup.Sum)
	check("AllReduce (device)", nil)
	check("WaitStream", w.(*Work).WaitStream(s))
	check("Work.Wait", waitT(t, w))
	host := append([]float32(nil), in...)
	check("AllReduce (host)", waitT(t, g.AllReduce(context.Background(), host, procgroup.Sum)))
	check("Barrier", waitT(t, g.Barrier(context.Background())))
	got := make([]float32, 64)
	check("CopyOut", g.CopyOut(got, tmp))
	for i := range got {
		if want := in[i] * 0.5; got[i] != want || host[i] != in[i] {
			t.Fatalf("[%d]: device %v, host %v; want %v and %v", i, got[i], host[i], want, in[i])
		}
	}
	check("SyncStream", g.SyncStream(s))
	check("DestroyEvent", g.DestroyEvent(ev))
	check("Free", g.Free(tmp))
	check("Free", g.Free(buf))
	check("DestroyStream", g.DestroyStream(s))
	check("Close", g.Close())
}

// TestForeignContextRefused: device memory or a stream of another context than the
// device's primary one (gorgonia/cu's NewContext) fails the collective at once, with an
// error that says whose they are.
func TestForeignContextRefused(t *testing.T) {
	l := fake(t)
	for _, which := range []string{"memory", "stream"} {
		t.Run(which, func(t *testing.T) {
			gs := startGroups(t, 1, 0)
			g := gs[0]
			ours, err := g.Alloc(procgroup.Float32, 16)
			if err != nil {
				t.Fatal(err)
			}
			defer g.Free(ours)
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			mine := l.knob("ctx_create", 0)
			defer l.knob("ctx_set", 0)
			buf := ours
			if which == "memory" {
				buf.Ptr = DevicePtr(l.knob("mem_alloc", 64)) // in the caller's context
				if owner := l.knob("ptr_ctx", int64(buf.Ptr)); owner != mine {
					t.Fatalf("the fake says memory allocated in context %#x is %#x's", mine, owner)
				}
			} else {
				buf.Stream = Stream(l.knob("stream_create", 1))
			}
			w := gs[0].AllReduce(context.Background(), buf, procgroup.Sum)
			select {
			case <-w.Done():
			case <-time.After(hangBound):
				t.Fatal("an all-reduce on another context's " + which + " is pending, want it failed at once")
			}
			what := "the input's memory"
			if which == "stream" {
				what = "the input's stream"
			}
			wantErr(t, w.Err(), procgroup.ErrInvalidArgument, what, fmt.Sprintf("belongs to CUDA context %#x", mine),
				"not to the primary context", "NewContext")
			if cur := l.knob("ctx_get", 0); cur != mine {
				t.Errorf("the current context is %#x after the refusal, want the caller's %#x", cur, mine)
			}
		})
	}
}

// TestPerThreadStreamRefused: CU_STREAM_PER_THREAD is refused with an error that says why,
// before anything is issued: the group stays usable.
func TestPerThreadStreamRefused(t *testing.T) {
	gs := startGroups(t, 1, 0)
	g := gs[0]
	buf, err := g.Alloc(procgroup.Float32, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Free(buf)
	pt := buf
	pt.Stream = streamPerThread
	ev, err := g.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	defer g.DestroyEvent(ev)
	for what, err := range map[string]error{
		"AllReduce":   waitT(t, g.AllReduce(context.Background(), pt, procgroup.Sum)),
		"AllGather":   waitT(t, g.AllGather(context.Background(), pt, pt)),
		"ScaleAsync":  g.ScaleAsync(streamPerThread, buf, buf, 2, false),
		"ZeroAsync":   g.ZeroAsync(streamPerThread, buf),
		"RecordEvent": g.RecordEvent(ev, streamPerThread),
		"WaitEvent":   g.WaitEvent(streamPerThread, ev),
		"SyncStream":  g.SyncStream(streamPerThread),
		"CopyIn":      g.CopyIn(pt, make([]float32, 4)),
	} {
		if err == nil || !errorsIs(err, procgroup.ErrInvalidArgument) {
			t.Errorf("%s on CU_STREAM_PER_THREAD: err = %v, want ErrInvalidArgument", what, err)
			continue
		}
		wantErr(t, err, procgroup.ErrInvalidArgument, "CU_STREAM_PER_THREAD", "goroutines move between OS threads")
	}
	if err := waitT(t, g.AllReduce(context.Background(), buf, procgroup.Sum)); err != nil {
		t.Fatalf("the group after the refusals: %v", err)
	}
	g.Close()
}

// TestGatherScatterWaitForOutputStream: AllGather and ReduceScatter on device buffers order
// after the output buffer's stream as well as the input's: work queued on the output's
// stream before the collective (here a memset that a gate holds back) must not overwrite
// the result.
func TestGatherScatterWaitForOutputStream(t *testing.T) {
	l := fake(t)
	for _, n := range []int{1, 2, 3} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			gs := startGroups(t, n, 0)
			const count = 3 * 256
			rng := rand.New(rand.NewPCG(uint64(n), 11))
			ins := make([][]float32, n)
			for r := range ins {
				ins[r] = make([]float32, count)
				for i := range ins[r] {
					ins[r][i] = float32(rng.IntN(1000) - 500) // exact sums
				}
			}
			gated := make(chan struct{})
			issued := make(chan struct{}, n)
			go func() {
				for range n {
					<-issued
				}
				l.knob("gate_open", 0)
				close(gated)
			}()
			each(t, gs, func(r int, g *Group) error {
				s1, err := g.NewStream()
				if err != nil {
					return err
				}
				defer g.DestroyStream(s1)
				s2, err := g.NewStream()
				if err != nil {
					return err
				}
				defer g.DestroyStream(s2)
				in, err := g.Alloc(procgroup.Float32, count)
				if err != nil {
					return err
				}
				defer g.Free(in)
				ag, err := g.Alloc(procgroup.Float32, n*count)
				if err != nil {
					return err
				}
				defer g.Free(ag)
				rs, err := g.Alloc(procgroup.Float32, count/n)
				if err != nil {
					return err
				}
				defer g.Free(rs)
				in.Stream, ag.Stream, rs.Stream = s1, s2, s2
				if err := g.CopyIn(in, ins[r]); err != nil {
					return err
				}
				// The output's stream still has to clear the outputs when the
				// collectives are issued.
				l.knob("gate_close", int64(s2))
				if err := g.memsetD32(ag, math.Float32bits(7), ag.Count, s2); err != nil {
					return err
				}
				if err := g.memsetD32(rs, math.Float32bits(7), rs.Count, s2); err != nil {
					return err
				}
				w1 := g.AllGather(context.Background(), ag, in)
				w2 := g.ReduceScatter(context.Background(), rs, in, procgroup.Sum)
				issued <- struct{}{}
				<-gated
				for _, w := range []procgroup.Work{w1, w2} {
					if err := w.(*Work).WaitStream(s2); err != nil {
						return err
					}
					if err := waitT(t, w); err != nil {
						return err
					}
				}
				gotAG := make([]float32, n*count)
				if err := g.CopyOut(gotAG, ag); err != nil {
					return err
				}
				for i, v := range gotAG {
					if want := ins[i/count][i%count]; v != want {
						return fmt.Errorf("all-gather [%d] = %v, want %v (7: the output's stream ran after the collective)", i, v, want)
					}
				}
				gotRS := make([]float32, count/n)
				if err := g.CopyOut(gotRS, rs); err != nil {
					return err
				}
				for i, v := range gotRS {
					var want float32
					for q := range n {
						want += ins[q][r*(count/n)+i]
					}
					if v != want {
						return fmt.Errorf("reduce-scatter [%d] = %v, want %v (7: the output's stream ran after the collective)", i, v, want)
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

// TestStreamGetCtxPlainABI: the owner check of a device buffer's stream must call
// cuStreamGetCtx, not cuStreamGetCtx_v2, which CUDA 12.5 drivers export with a third
// argument (CUgreenCtx *) and write through it: called with two arguments it writes
// through whatever the third register holds. The fake exports both, as the real driver
// does, and counts their calls.
func TestStreamGetCtxPlainABI(t *testing.T) {
	l := fake(t)
	const n = 257
	gs := startGroups(t, 2, 0)
	rng := rand.New(rand.NewPCG(7, 8))
	ins := make([][]float32, len(gs))
	want := make([]float32, n)
	for r := range gs {
		ins[r] = make([]float32, n)
		for i := range ins[r] {
			ins[r][i] = float32(rng.Float64()*2 - 1)
		}
	}
	for i := range want {
		want[i] = ins[0][i] + ins[1][i] // two terms: the order does not matter
	}
	plain, v2 := l.knob("stream_get_ctx", 0), l.knob("stream_get_ctx_v2", 0)
	got := make([][]float32, len(gs))
	each(t, gs, func(r int, g *Group) error {
		s, err := g.NewStream()
		if err != nil {
			return err
		}
		defer g.DestroyStream(s)
		buf, err := g.Alloc(procgroup.Float32, n)
		if err != nil {
			return err
		}
		defer g.Free(buf)
		buf.Stream = s
		if err := g.CopyIn(buf, ins[r]); err != nil {
			return err
		}
		if err := waitT(t, g.AllReduce(context.Background(), buf, procgroup.Sum)); err != nil {
			return err
		}
		got[r] = make([]float32, n)
		return g.CopyOut(got[r], buf)
	})
	if d := l.knob("stream_get_ctx_v2", 0) - v2; d != 0 {
		t.Errorf("cuStreamGetCtx_v2 (three arguments) called %d times through the two-argument cuStreamGetCtx pointer", d)
	}
	if d := l.knob("stream_get_ctx", 0) - plain; d < 2 {
		t.Errorf("cuStreamGetCtx called %d times for 2 ranks' device all-reduces, want at least 2 (the stream's owner is checked)", d)
	}
	for r := range gs {
		for i := range want {
			if got[r][i] != want[i] {
				t.Fatalf("rank %d [%d] = %v, want %v", r, i, got[r][i], want[i])
			}
		}
	}
}
