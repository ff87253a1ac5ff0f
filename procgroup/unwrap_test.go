package procgroup_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/goddp/goddp/procgroup"
)

// tagged is a backend group with a method of its own and Works of its own type, to be found
// through the wrappers.
type tagged struct{ procgroup.ProcessGroup }

type taggedWork struct{ procgroup.Work }

func (t *tagged) AllReduce(ctx context.Context, buf any, op procgroup.ReduceOp) procgroup.Work {
	return &taggedWork{t.ProcessGroup.AllReduce(ctx, buf, op)}
}

// TestFindThroughWrappers: procgroup.Find reaches the backend's group through the watchdog
// and debug wrappers (as ddp.InitProcessGroup stacks them), FindWork reaches the backend's
// Work of a collective issued on the outer group once it has been issued, FindDevice
// reports false for a host-only group, and the collective's result is right (element by
// element against a sum computed on the host).
func TestFindThroughWrappers(t *testing.T) {
	for _, debug := range []bool{false, true} {
		t.Run(fmt.Sprintf("debug=%v", debug), func(t *testing.T) {
			const n = 2
			w := newWorld(t, "cluster", n)
			outer := make([]procgroup.ProcessGroup, n)
			inner := make([]*tagged, n)
			for r := range n {
				inner[r] = &tagged{w.inner[r]}
				var pg procgroup.ProcessGroup = inner[r]
				if debug {
					pg = mustDebug(t, pg, procgroup.DebugOptions{})
				}
				outer[r] = mustWatchdog(t, pg, w.wdStore(), procgroup.WatchdogOptions{})
			}
			defer closeAll(outer)
			rng := rand.New(rand.NewPCG(1, 2))
			bufs := make([][]float64, n)
			want := make([]float64, 33)
			for r := range bufs {
				bufs[r] = make([]float64, len(want))
				for k := range bufs[r] {
					bufs[r][k] = rng.NormFloat64()
					want[k] += bufs[r][k]
				}
			}
			runRanks(outer, func(r int, pg procgroup.ProcessGroup) {
				got, ok := procgroup.Find[*tagged](pg)
				if !ok || got != inner[r] {
					t.Errorf("rank %d: Find[*tagged] = %v, %v; want the backend group", r, got, ok)
				}
				if _, ok := procgroup.FindDevice(pg); ok {
					t.Errorf("rank %d: FindDevice found device memory in a host group", r)
				}
				wk := pg.AllReduce(testCtx(t), bufs[r], procgroup.Sum)
				if err := wk.Wait(testCtx(t)); err != nil {
					t.Errorf("rank %d: %v", r, err)
					return
				}
				if _, ok := procgroup.FindWork[*taggedWork](wk); !ok {
					t.Errorf("rank %d: FindWork[*taggedWork] found nothing in %T", r, wk)
				}
				for k, v := range bufs[r] {
					if d := v - want[k]; d > 1e-12 || d < -1e-12 {
						t.Errorf("rank %d [%d] = %v, want %v", r, k, v, want[k])
						return
					}
				}
			})
		})
	}
}
