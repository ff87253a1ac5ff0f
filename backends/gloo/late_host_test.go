//go:build linux

package gloo

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// TestLateHostReduce: hosts a a b b, the hierarchical all-reduce with its host phases in
// place (arena buffers) and 4 pieces. Rank 1 stalls at the first block of its first
// hostReduce; rank 0 finishes everything it can (its middle rings with rank 2, its
// broadcasts), then gives up in the last phase (its ctx is cancelled) and aborts, which
// sets its shared-memory abort flag towards rank 1. When rank 1 wakes, reduceBlocks sees
// the flag and stops short: rank 1 must fail, and must not send its unreduced chunk to
// the middle ring with rank 3, whose group has not seen the abort yet (the abort frame
// waits unread in its socket; Note [Probing peers] delays the verdict). Ranks 2 and 3 may
// then fail or succeed, but never return nil with wrong sums.
func TestLateHostReduce(t *testing.T) {
	const count = 1 << 18 // 1 MiB of float32: 4 pieces of 256 KiB
	hosts := []string{"a", "a", "b", "b"}
	var hold atomic.Bool
	holding, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	defer free()
	stallHook = func(g *group, at string) {
		if g.rank == 1 && at == "reduceBlocks" && hold.CompareAndSwap(true, false) {
			close(holding)
			<-release
		}
	}
	t.Cleanup(func() { stallHook = nil })
	groups := startGroupsCfg(t, len(hosts), func(r int) *Config {
		return &Config{HostID: hosts[r], Tune: TuneOff, Algorithm: AlgoHier, HierPieceSize: 256 << 10,
			PollInterval: time.Second}
	}, nil, 60*time.Second)
	t.Cleanup(func() {
		for _, g := range groups {
			g.Abort(nil)
		}
	})
	xs := inputs(77, len(hosts), count, procgroup.Sum)
	bufs := make([]any, len(hosts))
	for r, g := range groups {
		bufs[r] = sharedBuf(t, g, procgroup.Float32, xs[r])
	}
	each(t, groups, func(r int, g procgroup.ProcessGroup) error { return wait(g.AllReduce(ctx, bufs[r], procgroup.Sum)) })
	want := reduceRef(xs, procgroup.Sum)
	for r, g := range groups {
		if p := g.(*group).lastPath; p != "hierarchical-inplace" {
			t.Fatalf("rank %d took %q, want hierarchical-inplace", r, p)
		}
		checkClose(t, "warm-up", procgroup.Float32, procgroup.Sum, fromBuf(bufs[r]), want)
	}
	// The same inputs again.
	for r := range bufs {
		dst, _, _, _ := kernels.Bytes(bufs[r])
		src, _, _, _ := kernels.Bytes(toBuf(procgroup.Float32, xs[r]))
		copy(dst, src)
	}
	g0 := groups[0].(*group)
	m0 := g0.shm
	before := atomic.LoadUint64(m0.u64(m0.post(m0.me)))

	hold.Store(true)
	ctx0, cancel0 := context.WithCancel(context.Background())
	defer cancel0()
	works := make([]procgroup.Work, len(hosts))
	for r, g := range groups {
		c := ctx
		if r == 0 {
			c = ctx0
		}
		works[r] = g.AllReduce(c, bufs[r], procgroup.Sum)
	}
	select {
	case <-holding:
	case <-time.After(20 * time.Second):
		t.Fatal("rank 1 never stalled")
	}
	// Wait until rank 0 has posted its last phase: every middle ring of its is done.
	deadline := time.Now().Add(20 * time.Second)
	for {
		st := atomic.LoadUint64(m0.u64(m0.post(m0.me)))
		if st > before && st&3 == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("rank 0 never reached its last phase (state %#x)", st)
		}
		time.Sleep(time.Millisecond)
	}
	cancel0()
	if err := wait(works[0]); err == nil {
		t.Fatalf("rank 0: nil; want its ctx's error")
	}
	free() // rank 1 wakes
	if err := wait(works[1]); err == nil {
		t.Errorf("rank 1 (late): nil; want an error")
	}
	for _, r := range []int{2, 3} {
		err := wait(works[r])
		if err != nil {
			t.Logf("rank %d: %v (no wrong result here)", r, err)
			continue
		}
		got := fromBuf(bufs[r])
		wrong, first := 0, -1
		for i := range want {
			if got[i] != want[i] {
				if wrong == 0 {
					first = i
				}
				wrong++
			}
		}
		if wrong > 0 {
			t.Errorf("rank %d: all-reduce returned nil with %d of %d elements wrong (the first at [%d]: %v, want %v)",
				r, wrong, count, first, got[first], want[first])
		}
	}
}
