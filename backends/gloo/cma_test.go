//go:build linux

package gloo

import (
	"fmt"
	"math"
	"strings"
	"syscall"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/goddp/goddp/procgroup"
)

// refuseAt makes Note [Single copy]'s probe fail with EPERM on rank bad only (as Yama's
// ptrace_scope or a seccomp filter would) until t's end; call it before starting groups.
func refuseAt(t testing.TB, bad int) {
	vmProbeHook = func(g *group) error {
		if g.rank == bad {
			return fmt.Errorf("process_vm_readv of rank 0: %w", syscall.EPERM)
		}
		return nil
	}
	t.Cleanup(func() { vmProbeHook = nil })
}

// TestSingleCopyCollectives: with Note [Single copy] on (every size takes it), every
// collective on private buffers, in place and out of place, every element type and
// reduce op, at n = 2, 3 and 4, reads the peers with process_vm_readv (path shm-vm),
// sends nothing through the slots, and matches a float64 reference element by element,
// every rank's all-reduce with the same bits. With the probe refused on one rank, every
// rank takes the old paths and gives the same results.
func TestSingleCopyCollectives(t *testing.T) {
	cmaEverySize(t)
	counts := []int{1, 3, 1001, 70001} // 70001 float32s: more than one block of cmaBlock
	for size := 2; size <= 4; size++ {
		for _, refused := range []bool{false, true} {
			t.Run(fmt.Sprintf("n%d/refused=%t", size, refused), func(t *testing.T) {
				if refused {
					refuseAt(t, size-1)
				}
				groups := startGroups(t, size, &Config{Transport: TransportUnix, Algorithm: AlgoRing, AdoptBuffers: AdoptOff})
				checkSingleCopy(t, groups, counts, !refused)
			})
		}
	}
}

// checkSingleCopy runs every collective on groups against a float64 reference; vm says
// whether each must have taken Note [Single copy].
func checkSingleCopy(t *testing.T, groups []procgroup.ProcessGroup, counts []int, vm bool) {
	t.Helper()
	size := len(groups)
	seed := uint64(7000)
	path := func(what string) {
		t.Helper()
		for r, g := range groups {
			if got := g.(*group).lastPath == "shm-vm"; got != vm {
				t.Fatalf("%s: rank %d took %q; want shm-vm %t", what, r, g.(*group).lastPath, vm)
			}
		}
	}
	for _, dt := range procgroup.DTypes {
		for _, count := range counts {
			for _, op := range procgroup.ReduceOps {
				seed++
				x := inputs(seed, size, count, op)
				bufs := make([]any, size)
				before := slotSegments(groups[0])
				each(t, groups, func(r int, g procgroup.ProcessGroup) error {
					bufs[r] = toBuf(dt, x[r])
					return wait(g.AllReduce(ctx, bufs[r], op))
				})
				what := fmt.Sprintf("allreduce %v %v count %d", dt, op, count)
				path(what)
				if after := slotSegments(groups[0]); vm && after != before {
					t.Fatalf("%s: %d segments went through the slots", what, after-before)
				}
				want := reduceRef(x, op)
				r0 := fromBuf(bufs[0])
				for r := range size {
					got := fromBuf(bufs[r])
					checkClose(t, fmt.Sprintf("%s rank %d", what, r), dt, op, got, want)
					for k := range got {
						if math.Float64bits(got[k]) != math.Float64bits(r0[k]) {
							t.Fatalf("%s: rank %d has %v at %d, rank 0 %v", what, r, got[k], k, r0[k])
						}
					}
				}

				// ReduceScatter, out of place and in place (out is chunk r of in).
				xs := inputs(seed+500, size, count*size, op)
				wantRS := reduceRef(xs, op)
				for _, inPlace := range []bool{false, true} {
					outs := make([]any, size)
					each(t, groups, func(r int, g procgroup.ProcessGroup) error {
						in := toBuf(dt, xs[r])
						outs[r] = toBuf(dt, make([]float64, count))
						if inPlace {
							outs[r] = sub(in, r*count, count)
						}
						return wait(g.ReduceScatter(ctx, outs[r], in, op))
					})
					what := fmt.Sprintf("reducescatter %v %v count %d in place %t", dt, op, count, inPlace)
					path(what)
					for r := range size {
						checkClose(t, fmt.Sprintf("%s rank %d", what, r), dt, op, fromBuf(outs[r]), wantRS[r*count:(r+1)*count])
					}
				}
			}

			// AllGather, out of place and in place (in is slot r of out).
			seed++
			y := inputs(seed, size, count, procgroup.Sum)
			var wantAG []float64
			for r := range size {
				wantAG = append(wantAG, y[r]...)
			}
			for _, inPlace := range []bool{false, true} {
				outs := make([]any, size)
				each(t, groups, func(r int, g procgroup.ProcessGroup) error {
					outs[r] = toBuf(dt, make([]float64, count*size))
					in := toBuf(dt, y[r])
					if inPlace {
						copyInto(outs[r], in, r*count)
						in = sub(outs[r], r*count, count)
					}
					return wait(g.AllGather(ctx, outs[r], in))
				})
				what := fmt.Sprintf("allgather %v count %d in place %t", dt, count, inPlace)
				path(what)
				for r := range size {
					checkClose(t, fmt.Sprintf("%s rank %d", what, r), dt, procgroup.Sum, fromBuf(outs[r]), wantAG)
				}
			}
			// Broadcast from every root.
			for root := range size {
				bufs := make([]any, size)
				each(t, groups, func(r int, g procgroup.ProcessGroup) error {
					bufs[r] = toBuf(dt, y[r])
					return wait(g.Broadcast(ctx, bufs[r], root))
				})
				what := fmt.Sprintf("broadcast %v count %d root %d", dt, count, root)
				path(what)
				for r := range size {
					checkClose(t, fmt.Sprintf("%s rank %d", what, r), dt, procgroup.Sum, fromBuf(bufs[r]), y[root])
				}
			}
		}
	}
}

// sub is b[off:off+n] of a typed buffer.
func sub(b any, off, n int) any {
	switch b := b.(type) {
	case []float32:
		return b[off : off+n]
	case []float64:
		return b[off : off+n]
	case []int32:
		return b[off : off+n]
	case []int64:
		return b[off : off+n]
	case []procgroup.BF16:
		return b[off : off+n]
	case []procgroup.F16:
		return b[off : off+n]
	}
	panic(fmt.Sprintf("sub of %T", b))
}

// copyInto copies the typed buffer src into dst at off.
func copyInto(dst, src any, off int) {
	switch d := dst.(type) {
	case []float32:
		copy(d[off:], src.([]float32))
	case []float64:
		copy(d[off:], src.([]float64))
	case []int32:
		copy(d[off:], src.([]int32))
	case []int64:
		copy(d[off:], src.([]int64))
	case []procgroup.BF16:
		copy(d[off:], src.([]procgroup.BF16))
	case []procgroup.F16:
		copy(d[off:], src.([]procgroup.F16))
	}
}

// TestSingleCopyRefusedLogsOnce: where the kernel refuses one rank's probe, that rank logs
// the reason once and one other rank names it; no collective logs again.
func TestSingleCopyRefusedLogsOnce(t *testing.T) {
	refuseAt(t, 2)
	core, logs := observer.New(zap.WarnLevel)
	groups := startGroupsLogged(t, 3, &Config{Transport: TransportUnix, AdoptBuffers: AdoptOff}, zap.New(core))
	for range 3 {
		each(t, groups, func(r int, g procgroup.ProcessGroup) error {
			return wait(g.AllGather(ctx, make([]float32, 3<<18), make([]float32, 1<<18)))
		})
	}
	var lines []string
	for _, e := range logs.All() {
		if strings.Contains(e.Message, "process_vm_readv") {
			lines = append(lines, fmt.Sprintf("%s %v", e.Message, e.ContextMap()))
		}
	}
	if len(lines) != 2 || !strings.Contains(strings.Join(lines, "\n"), syscall.EPERM.Error()) || !strings.Contains(strings.Join(lines, "\n"), "rank 2") {
		t.Errorf("logged:\n%s\nwant two lines: rank 2's reason (EPERM) and one naming rank 2", strings.Join(lines, "\n"))
	}
	for r, g := range groups {
		if g.(*group).cma || g.(*group).lastPath == "shm-vm" {
			t.Errorf("rank %d: cma %t, path %q; want the sockets on every rank", r, g.(*group).cma, g.(*group).lastPath)
		}
	}
}
