//go:build linux

package gloo

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// sharedBuf allocates count elements of dt from g's arena and fills them with v.
func sharedBuf(t *testing.T, g procgroup.ProcessGroup, dt procgroup.DType, v []float64) any {
	t.Helper()
	buf, err := g.(procgroup.BufferAllocator).AllocBuffer(dt, len(v))
	if err != nil || (buf == nil && len(v) > 0) {
		t.Fatalf("rank %d: AllocBuffer(%v, %d) = %v, %v; want a shared buffer", g.Rank(), dt, len(v), buf, err)
	}
	if len(v) == 0 {
		return procgroup.NewBuffer(dt, 0)
	}
	dst, _, _, _ := kernels.Bytes(buf)
	src, _, _, _ := kernels.Bytes(toBuf(dt, v))
	copy(dst, src)
	return buf
}

// slotSegments counts the segments rank g has sent through the slots (the ring's traffic).
func slotSegments(g procgroup.ProcessGroup) uint64 {
	var n uint64
	for _, p := range g.(*group).shm.prod {
		n += p
	}
	return n
}

// TestSharedBuffersAllReduce: all-reduces of buffers from AllocBuffer run in place (no
// segment goes through the slots) and match a float64 reference, for world sizes 2-4, every
// type the arena takes and every op, counts below the world size included, many in flight
// at once and interleaved with all-reduces of private buffers (which take the ring). Every
// rank ends with the same bits.
func TestSharedBuffersAllReduce(t *testing.T) {
	counts := []int{1, 2, 3, 7, 100, 4099, 70000}
	dts := []procgroup.DType{procgroup.Float32, procgroup.Float64, procgroup.Int32, procgroup.Int64}
	for size := 2; size <= 4; size++ {
		t.Run(fmt.Sprintf("n%d", size), func(t *testing.T) {
			groups := startGroups(t, size, &Config{Transport: TransportUnix, Algorithm: AlgoRing, ShmSlotSize: 4096, ShmSlots: 2})
			seed := uint64(100)
			for _, dt := range dts {
				for _, op := range procgroup.ReduceOps {
					xs := make([][][]float64, len(counts))
					shared := make([][]any, len(counts))
					private := make([][]any, len(counts))
					for i, count := range counts {
						seed++
						xs[i] = inputs(seed, size, count, op)
						shared[i], private[i] = make([]any, size), make([]any, size)
						for r, g := range groups {
							shared[i][r] = sharedBuf(t, g, dt, xs[i][r])
							private[i][r] = toBuf(dt, xs[i][r])
						}
					}
					before := slotSegments(groups[0])
					each(t, groups, func(r int, g procgroup.ProcessGroup) error {
						var works []procgroup.Work
						for i := range counts {
							works = append(works, g.AllReduce(ctx, shared[i][r], op))
						}
						for _, w := range works {
							if err := wait(w); err != nil {
								return err
							}
						}
						return nil
					})
					if after := slotSegments(groups[0]); after != before {
						t.Fatalf("%v %v: %d segments went through the slots; want none (in place)", dt, op, after-before)
					}
					for r, g := range groups {
						if p := g.(*group).lastPath; p != "shm-inplace" {
							t.Fatalf("%v %v: rank %d's last all-reduce took %q, want shm-inplace", dt, op, r, p)
						}
					}
					each(t, groups, func(r int, g procgroup.ProcessGroup) error {
						var works []procgroup.Work
						for i := range counts { // shared and private alternate, all in flight
							works = append(works, g.AllReduce(ctx, private[i][r], op), g.AllReduce(ctx, toBuf(dt, xs[i][r]), op))
						}
						for _, w := range works {
							if err := wait(w); err != nil {
								return err
							}
						}
						return nil
					})
					if slotSegments(groups[0]) == before {
						t.Fatalf("%v %v: private buffers did not take the slot ring", dt, op)
					}
					for i, count := range counts {
						want := reduceRef(xs[i], op)
						got0 := fromBuf(shared[i][0])
						for r := range size {
							what := fmt.Sprintf("%v %v count %d rank %d", dt, op, count, r)
							got := fromBuf(shared[i][r])
							checkClose(t, what+" (shared)", dt, op, got, want)
							checkClose(t, what+" (private)", dt, op, fromBuf(private[i][r]), want)
							for k := range got {
								if math.Float64bits(got[k]) != math.Float64bits(got0[k]) {
									t.Fatalf("%s: element %d is %v, rank 0 has %v: ranks differ", what, k, got[k], got0[k])
								}
							}
						}
						for r, g := range groups {
							g.(procgroup.BufferAllocator).FreeBuffer(shared[i][r])
						}
					}
				}
			}
		})
	}
}

// TestSharedBuffersGatherScatterInPlace: ReduceScatter and AllGather in place on buffers
// from AllocBuffer read the peers from the arena (shm-arena) and match a float64
// reference, for world sizes 2-4, short and long blocks, every rank's result its own.
func TestSharedBuffersGatherScatterInPlace(t *testing.T) {
	for size := 2; size <= 4; size++ {
		t.Run(fmt.Sprintf("n%d", size), func(t *testing.T) {
			cmaEverySize(t) // and the ring's rules, so that the smallest take the arena too
			groups := startGroups(t, size, &Config{Transport: TransportUnix, Algorithm: AlgoRing})
			for _, count := range []int{1, 7, 4099, 70000} {
				x := inputs(uint64(count), size, size*count, procgroup.Sum)
				sum := reduceRef(x, procgroup.Sum)
				var gathered []float64
				for r := range size {
					gathered = append(gathered, x[r][r*count:(r+1)*count]...)
				}
				for _, k := range []string{"reduce-scatter", "all-gather"} {
					bufs := make([]any, size)
					for r, g := range groups {
						bufs[r] = sharedBuf(t, g, procgroup.Float32, x[r])
					}
					each(t, groups, func(r int, g procgroup.ProcessGroup) error {
						part := procgroup.SliceBuffer(bufs[r], r*count, (r+1)*count)
						if k == "reduce-scatter" {
							return wait(g.ReduceScatter(ctx, part, bufs[r], procgroup.Sum))
						}
						return wait(g.AllGather(ctx, bufs[r], part))
					})
					for r, g := range groups {
						what := fmt.Sprintf("%s count %d rank %d", k, count, r)
						if p := g.(*group).lastPath; p != "shm-arena" {
							t.Errorf("%s: took %q, want shm-arena", what, p)
						}
						if k == "reduce-scatter" {
							got := fromBuf(procgroup.SliceBuffer(bufs[r], r*count, (r+1)*count))
							checkClose(t, what, procgroup.Float32, procgroup.Sum, got, sum[r*count:(r+1)*count])
						} else {
							checkClose(t, what, procgroup.Float32, procgroup.Sum, fromBuf(bufs[r]), gathered)
						}
						g.(procgroup.BufferAllocator).FreeBuffer(bufs[r])
					}
				}
			}
		})
	}
}

// TestSharedBuffersMixed: when one rank's buffer is private and the others' shared, every
// rank reads the peers with process_vm_readv where Note [Single copy] takes the size, or,
// with it off, falls back to the slot ring; the result is right either way.
func TestSharedBuffersMixed(t *testing.T) {
	const size, count = 3, 50000
	for _, mode := range []string{VMReadvAuto, VMReadvOff} {
		t.Run(mode, func(t *testing.T) {
			cmaEverySize(t)
			groups := startGroups(t, size, &Config{Transport: TransportUnix, VMReadv: mode, AdoptBuffers: AdoptOff})
			xs := inputs(7, size, count, procgroup.Sum)
			bufs := mixedBufs(t, groups, xs)
			before := slotSegments(groups[0])
			each(t, groups, func(r int, g procgroup.ProcessGroup) error { return wait(g.AllReduce(ctx, bufs[r], procgroup.Sum)) })
			if ring := slotSegments(groups[0]) != before; ring != (mode == VMReadvOff) {
				t.Errorf("segments through the slots: %t, want %t", ring, mode == VMReadvOff)
			}
			for r, g := range groups {
				if p, want := g.(*group).lastPath, map[string]string{VMReadvAuto: "shm-vm", VMReadvOff: "shm-ring"}[mode]; p != want {
					t.Errorf("rank %d took %q, want %q", r, p, want)
				}
			}
			want := reduceRef(xs, procgroup.Sum)
			for r := range size {
				checkClose(t, fmt.Sprintf("rank %d", r), procgroup.Float64, procgroup.Sum, fromBuf(bufs[r]), want)
			}
		})
	}
}

// mixedBufs holds xs[r] as float64 in a private buffer for rank 1 and in shared ones for
// the others.
func mixedBufs(t *testing.T, groups []procgroup.ProcessGroup, xs [][]float64) []any {
	bufs := make([]any, len(groups))
	for r, g := range groups {
		if r == 1 {
			bufs[r] = toBuf(procgroup.Float64, xs[r])
		} else {
			bufs[r] = sharedBuf(t, g, procgroup.Float64, xs[r])
		}
	}
	return bufs
}

// TestArenaHeap: first fit in pages, full arena → nil, freed buffers read as zeros and are
// handed out again, neighbours coalesce, and a buffer stays readable after Close.
func TestArenaHeap(t *testing.T) {
	groups := startGroupsNoCleanup(t, 2, &Config{Transport: TransportUnix, ShmArenaMiB: 1})
	a := groups[0].(procgroup.BufferAllocator)
	var bufs [][]float32
	for range 256 { // 1 MiB = 256 pages
		b, err := a.AllocBuffer(procgroup.Float32, 1000) // 4000 bytes: one page each
		if err != nil || b == nil {
			t.Fatalf("allocation %d: %v, %v", len(bufs), b, err)
		}
		bufs = append(bufs, b.([]float32))
	}
	if b, err := a.AllocBuffer(procgroup.Float32, 1); b != nil || err != nil {
		t.Fatalf("full arena: %v, %v; want nil, nil", b, err)
	}
	for i := range bufs[10] {
		bufs[10][i], bufs[11][i] = 3, 4
	}
	a.FreeBuffer(bufs[10])
	a.FreeBuffer(bufs[11])
	for i := range bufs[10] {
		if bufs[10][i] != 0 || bufs[11][i] != 0 {
			t.Fatalf("freed buffers read %v, %v at %d; want zeros", bufs[10][i], bufs[11][i], i)
		}
	}
	// The two freed pages coalesced: a two-page buffer fits, where they were.
	b, err := a.AllocBuffer(procgroup.Float64, 1000) // 8000 bytes
	if err != nil || b == nil {
		t.Fatalf("two pages after freeing two neighbours: %v, %v", b, err)
	}
	two := b.([]float64)
	if uintptrOf(&two[0]) != uintptrOf(&bufs[10][0]) {
		t.Errorf("the two-page buffer is not where the freed ones were")
	}
	if b, err := a.AllocBuffer(procgroup.BFloat16, 10); b != nil || err != nil {
		t.Errorf("bfloat16 (widened for reductions): %v, %v; want nil, nil", b, err)
	}
	if _, err := a.AllocBuffer(procgroup.Float32, -1); !errors.Is(err, procgroup.ErrInvalidArgument) {
		t.Errorf("negative count: %v; want ErrInvalidArgument", err)
	}
	bufs[0][0] = 42
	a.FreeBuffer(bufs[1])
	for _, g := range groups {
		g.Close()
	}
	// After Close the arena is zero pages: a live buffer and a freed one both read zeros
	// (and writing does not fault), and nothing more is handed out.
	if bufs[0][0] != 0 || bufs[1][0] != 0 {
		t.Errorf("after Close a live buffer reads %v and a freed one %v, want zeros", bufs[0][0], bufs[1][0])
	}
	bufs[1][0] = 7
	if b, err := a.AllocBuffer(procgroup.Float32, 10); b != nil || err != nil {
		t.Errorf("AllocBuffer after Close: %v, %v; want nil, nil", b, err)
	}
	if b, err := a.AllocBuffer(procgroup.Float32, 1<<62+1); b != nil || err != nil {
		t.Errorf("AllocBuffer of 2^62+1 elements: %v, %v; want nil, nil", b, err)
	}
}

// TestSharedBuffersMismatch: a rank whose peer issued another collective before its
// all-reduce fails with the mismatch, instead of taking the peer's later post for this
// one (the peer then waits until its timeout, as with any mismatch).
func TestSharedBuffersMismatch(t *testing.T) {
	groups := startGroupsTimeout(t, 2, &Config{Transport: TransportUnix, Algorithm: AlgoRing}, 3*time.Second)
	b0 := sharedBuf(t, groups[0], procgroup.Float32, make([]float64, 1<<16))
	b1 := sharedBuf(t, groups[1], procgroup.Float32, make([]float64, 1<<16))
	w0 := groups[0].AllReduce(ctx, b0, procgroup.Sum)
	wb := groups[1].Broadcast(ctx, make([]float32, 4), 1) // rank 1's collective #1 differs
	w1 := groups[1].AllReduce(ctx, b1, procgroup.Sum)
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w0.Wait(c); !errors.Is(err, procgroup.ErrInvalidArgument) || !strings.Contains(err.Error(), "different collectives") {
		t.Errorf("rank 0: %v; want ErrInvalidArgument naming different collectives", err)
	}
	for _, g := range groups {
		g.Abort(nil)
	}
	wb.Wait(c)
	w1.Wait(c)
}

// TestSharedBuffersAbort: a rank waiting in place for a peer that never comes ends with
// that peer's abort, through shared memory.
func TestSharedBuffersAbort(t *testing.T) {
	groups := startGroupsNoCleanup(t, 2, &Config{Transport: TransportUnix, PollInterval: time.Minute})
	buf := sharedBuf(t, groups[0], procgroup.Float32, make([]float64, 1<<18))
	w := groups[0].AllReduce(ctx, buf, procgroup.Sum)
	time.Sleep(20 * time.Millisecond)
	groups[1].Abort(errors.New("operator pulled the plug"))
	c, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := w.Wait(c); !errors.Is(err, procgroup.ErrAborted) || !strings.Contains(err.Error(), "operator pulled the plug") {
		t.Errorf("%v; want ErrAborted with rank 1's reason", err)
	}
	for _, g := range groups {
		g.Abort(nil)
	}
}

func uintptrOf[T any](p *T) uintptr { return uintptr(unsafe.Pointer(p)) }

// TestVMReadvAllReduce: with Config.VMReadv on every rank, all-reduces of private buffers
// read the peers' buffers with process_vm_readv (path shm-vm, no segment through the
// slots), match a float64 reference, leave every rank with the same bits, and give the
// bits of the arena's in-place path; a rank without VMReadv sends every rank to the ring.
func TestVMReadvAllReduce(t *testing.T) {
	cmaEverySize(t)
	counts := []int{1, 3, 100, 4099, 70000}
	for size := 2; size <= 4; size++ {
		t.Run(fmt.Sprintf("n%d", size), func(t *testing.T) {
			cfg := Config{Transport: TransportUnix, Algorithm: AlgoRing, ShmSlotSize: 4096, ShmSlots: 2, AdoptBuffers: AdoptOff}
			groups := startGroups(t, size, &cfg)
			seed := uint64(900)
			for _, dt := range []procgroup.DType{procgroup.Float32, procgroup.Int64} {
				for _, op := range procgroup.ReduceOps {
					for _, count := range counts {
						seed++
						xs := inputs(seed, size, count, op)
						private, shared := make([]any, size), make([]any, size)
						for r, g := range groups {
							private[r], shared[r] = toBuf(dt, xs[r]), sharedBuf(t, g, dt, xs[r])
						}
						before := slotSegments(groups[0])
						each(t, groups, func(r int, g procgroup.ProcessGroup) error {
							return wait(g.AllReduce(ctx, private[r], op))
						})
						what := fmt.Sprintf("%v %v count %d", dt, op, count)
						if after := slotSegments(groups[0]); after != before {
							t.Fatalf("%s: %d segments went through the slots", what, after-before)
						}
						for r, g := range groups {
							if p := g.(*group).lastPath; p != "shm-vm" && count*dt.Size() > g.(*group).cfg.DirectMaxBytes {
								t.Fatalf("%s: rank %d took %q, want shm-vm", what, r, p)
							}
						}
						each(t, groups, func(r int, g procgroup.ProcessGroup) error {
							return wait(g.AllReduce(ctx, shared[r], op))
						})
						want := reduceRef(xs, op)
						ref := fromBuf(shared[0])
						for r := range size {
							got := fromBuf(private[r])
							checkClose(t, fmt.Sprintf("%s rank %d", what, r), dt, op, got, want)
							for k := range got {
								if math.Float64bits(got[k]) != math.Float64bits(ref[k]) {
									t.Fatalf("%s rank %d: element %d is %v, the in-place path gives %v", what, r, k, got[k], ref[k])
								}
							}
						}
						for r, g := range groups {
							g.(procgroup.BufferAllocator).FreeBuffer(shared[r])
						}
					}
				}
			}
		})
	}
	t.Run("different lengths", func(t *testing.T) {
		groups := startGroups(t, 2, &Config{Transport: TransportUnix, Algorithm: AlgoRing, ShmSlotSize: 4096, ShmSlots: 2})
		errs := make([]error, 2)
		done := make(chan int, 2)
		for r, g := range groups {
			go func() {
				errs[r] = wait(g.AllReduce(ctx, make([]float32, 20000+r), procgroup.Sum))
				done <- r
			}()
		}
		<-done
		<-done
		for r, err := range errs {
			if err == nil || !strings.Contains(err.Error(), "ranks issued different collectives?") {
				t.Errorf("rank %d: %v; want the mismatch named", r, err)
			}
		}
	})
	t.Run("one rank without", func(t *testing.T) {
		groups := startGroupsCfg(t, 3, func(r int) *Config {
			return &Config{Transport: TransportUnix, Algorithm: AlgoRing, ShmSlotSize: 4096, ShmSlots: 2, VMReadv: vmOffAt(r, 1)}
		}, nil, time.Minute)
		t.Cleanup(func() {
			for _, g := range groups {
				g.Close()
			}
		})
		xs := inputs(77, 3, 5000, procgroup.Sum)
		bufs := make([]any, 3)
		each(t, groups, func(r int, g procgroup.ProcessGroup) error {
			bufs[r] = toBuf(procgroup.Float64, xs[r])
			return wait(g.AllReduce(ctx, bufs[r], procgroup.Sum))
		})
		for r, g := range groups {
			if p := g.(*group).lastPath; p != "shm-ring" {
				t.Errorf("rank %d took %q, want shm-ring", r, p)
			}
			checkClose(t, fmt.Sprintf("rank %d", r), procgroup.Float64, procgroup.Sum, fromBuf(bufs[r]), reduceRef(xs, procgroup.Sum))
		}
	})
}

// TestHostPhasesInPlace: across (simulated) hosts, buffers from AllocBuffer take Note [Host
// phases in place] (no segment goes through a host's slots), for contiguous and
// round-robin placements, two and three ranks a host, every op and counts below the world
// size, and match a float64 reference; every rank ends with the same bits. When one rank's
// buffer is private, its host runs the rings through its slots while the other host stays
// in place, and the result is still right.
func TestHostPhasesInPlace(t *testing.T) {
	counts := []int{1, 5, 4099, 70000}
	for _, hosts := range [][]string{
		{"a", "a", "b", "b"},
		{"a", "b", "a", "b"},
		{"a", "a", "a", "b", "b", "b"},
	} {
		t.Run(strings.Join(hosts, ""), func(t *testing.T) {
			size := len(hosts)
			// Pieces of 4 KiB (Note [Hierarchical pipeline]): the larger counts run as 2-16
			// pieces of uneven lengths.
			groups := startGroupsHosts(t, hosts, Config{Tune: TuneOff, DirectMaxBytes: 8, SegmentSize: 4096, ShmSlotSize: 4096, ShmSlots: 2, HierPieceSize: 4096})
			for r, g := range groups {
				buf := sharedBuf(t, g, procgroup.Float32, make([]float64, 1<<18))
				if name, _, _ := procgroup.AllReduceAlgorithm(g, buf); name != "hierarchical-inplace" {
					t.Errorf("rank %d: a shared 1 MiB all-reduce takes %q, want hierarchical-inplace", r, name)
				}
				g.(procgroup.BufferAllocator).FreeBuffer(buf)
			}
			seed := uint64(300)
			for _, dt := range []procgroup.DType{procgroup.Float32, procgroup.Float64, procgroup.Int64} {
				for _, op := range procgroup.ReduceOps {
					for _, count := range counts {
						seed++
						xs := inputs(seed, size, count, op)
						bufs := make([]any, size)
						for r, g := range groups {
							bufs[r] = sharedBuf(t, g, dt, xs[r])
						}
						before := make([]uint64, size)
						for r, g := range groups {
							before[r] = slotSegments(g)
						}
						each(t, groups, func(r int, g procgroup.ProcessGroup) error { return wait(g.AllReduce(ctx, bufs[r], op)) })
						what := fmt.Sprintf("%v %v count %d", dt, op, count)
						for r, g := range groups {
							if p := g.(*group).lastPath; count*dt.Size() > 8 && p != "hierarchical-inplace" {
								t.Fatalf("%s: rank %d took %q, want hierarchical-inplace", what, r, p)
							}
							if after := slotSegments(g); after != before[r] {
								t.Fatalf("%s: rank %d sent %d segments through the slots; want none (in place)", what, r, after-before[r])
							}
						}
						want := reduceRef(xs, op)
						got0 := fromBuf(bufs[0])
						for r, g := range groups {
							got := fromBuf(bufs[r])
							checkClose(t, fmt.Sprintf("%s rank %d", what, r), dt, op, got, want)
							for k := range got {
								if math.Float64bits(got[k]) != math.Float64bits(got0[k]) {
									t.Fatalf("%s: rank %d element %d is %v, rank 0 has %v: ranks differ", what, r, k, got[k], got0[k])
								}
							}
							g.(procgroup.BufferAllocator).FreeBuffer(bufs[r])
						}
					}
				}
			}
			// Mixed: rank 1's buffer is private, so its host takes the rings, through the
			// host's slots.
			xs := inputs(9, size, 50000, procgroup.Avg)
			bufs := mixedBufs(t, groups, xs)
			before := make([]uint64, size)
			for r, g := range groups {
				before[r] = slotSegments(g)
			}
			each(t, groups, func(r int, g procgroup.ProcessGroup) error {
				return wait(g.AllReduce(ctx, bufs[r], procgroup.Avg))
			})
			want := reduceRef(xs, procgroup.Avg)
			for r, g := range groups {
				wantPath, slots := "hierarchical-inplace", false
				if hosts[r] == hosts[1] {
					wantPath, slots = "hierarchical", true
				}
				if p := g.(*group).lastPath; p != wantPath {
					t.Errorf("mixed: rank %d (host %s) took %q, want %q", r, hosts[r], p, wantPath)
				}
				if sent := slotSegments(g) - before[r]; (sent > 0) != slots {
					t.Errorf("mixed: rank %d (host %s) sent %d segments through its host's slots, want them used: %v", r, hosts[r], sent, slots)
				}
				checkClose(t, fmt.Sprintf("mixed rank %d", r), procgroup.Float64, procgroup.Avg, fromBuf(bufs[r]), want)
			}
		})
	}
}

// TestHierPipelinePeerLost: a rank that dies (its sockets closed abruptly, as for SIGKILL)
// while the others run Note [Hierarchical pipeline] (the ranks of the other host are
// mid-pipeline, their middle rings blocked on it or on its host) fails every other rank's
// pending all-reduces within seconds with a PeerLostError naming it, on private buffers
// (the host rings through the slots) and on the arena's (in place); the worker and
// crossWorker of every rank stop (the package's goroutine check).
func TestHierPipelinePeerLost(t *testing.T) {
	const dead, ops = 3, 30
	for _, shared := range []bool{false, true} {
		t.Run(fmt.Sprintf("shared=%v", shared), func(t *testing.T) {
			hosts := []string{"a", "a", "b", "b"}
			groups := startGroupsHosts(t, hosts, Config{Tune: TuneOff, HierPieceSize: 64 << 10, PollInterval: 100 * time.Millisecond})
			works := make([][]procgroup.Work, len(groups))
			for r, g := range groups {
				if r == dead {
					continue
				}
				var buf any = make([]float32, 1<<20)
				if shared {
					buf = sharedBuf(t, g, procgroup.Float32, make([]float64, 1<<20))
				}
				for range ops {
					works[r] = append(works[r], g.AllReduce(ctx, buf, procgroup.Sum))
				}
			}
			time.Sleep(30 * time.Millisecond)
			start := time.Now()
			for _, p := range groups[dead].(*group).peers {
				if p != nil {
					p.conn.Close()
				}
			}
			c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			for r, ws := range works {
				if r == dead {
					continue
				}
				failed := 0
				for i, w := range ws {
					err := w.Wait(c)
					var ple *PeerLostError
					switch {
					case err == nil:
						continue
					case errors.Is(err, context.DeadlineExceeded):
						t.Fatalf("rank %d: all-reduce %d: no result %v after the loss", r, i, time.Since(start))
					case !errors.As(err, &ple) || ple.Rank != dead:
						t.Errorf("rank %d: all-reduce %d: %v; want a PeerLostError naming rank %d", r, i, err, dead)
					}
					failed++
				}
				if failed == 0 {
					t.Errorf("rank %d: all %d all-reduces succeeded without rank %d", r, ops, dead)
				}
			}
			for _, g := range groups {
				g.Abort(nil)
			}
		})
	}
}

// TestSharedBuffersLateRank (Note [Late ranks]): rank 1 stalls inside an in-place
// all-reduce while its peers time out and abort, and rank 0's caller frees its buffer and
// asks for another. When rank 1 wakes, its all-reduce fails instead of returning nil, it
// has written nothing into rank 0's freed buffer, and no rank hands out arena memory any
// more. Flat: 2 ranks, held before its first block in reduceBlocks. Hierarchical: hosts
// a a b b, held before its last piece's hostBroadcast (every middle ring is done). A first
// all-reduce with the hook in place but not holding matches the reference.
func TestSharedBuffersLateRank(t *testing.T) {
	const count = 1 << 18 // 1 MiB of float32: 16 blocks of a rank's chunk at n=2
	for _, tc := range []struct {
		name, at, path string
		alg            string
		hosts          []string
	}{
		{"flat", "reduceBlocks", "shm-inplace", AlgoRing, []string{"a", "a"}},
		{"hierarchical", "hostBroadcast", "hierarchical-inplace", AlgoHier, []string{"a", "a", "b", "b"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			size := len(tc.hosts)
			var hold atomic.Bool
			holding, release := make(chan struct{}), make(chan struct{})
			var releaseOnce sync.Once
			free := func() { releaseOnce.Do(func() { close(release) }) }
			defer free() // before the groups' cleanup, which waits for rank 1's worker
			stallHook = func(g *group, at string) {
				if g.rank == 1 && at == tc.at && hold.CompareAndSwap(true, false) {
					close(holding)
					<-release
				}
			}
			t.Cleanup(func() { stallHook = nil }) // after the groups' cleanup below
			groups := startGroupsCfg(t, size, func(r int) *Config {
				return &Config{HostID: tc.hosts[r], Tune: TuneOff, Algorithm: tc.alg, HierPieceSize: 256 << 10, PollInterval: 20 * time.Millisecond}
			}, nil, 500*time.Millisecond)
			t.Cleanup(func() {
				for _, g := range groups {
					g.Abort(nil)
				}
			})
			xs := inputs(41, size, count, procgroup.Sum)
			bufs := make([]any, size)
			for r, g := range groups {
				bufs[r] = sharedBuf(t, g, procgroup.Float32, xs[r])
			}
			each(t, groups, func(r int, g procgroup.ProcessGroup) error { return wait(g.AllReduce(ctx, bufs[r], procgroup.Sum)) })
			want := reduceRef(xs, procgroup.Sum)
			for r, g := range groups {
				if p := g.(*group).lastPath; p != tc.path {
					t.Fatalf("rank %d took %q, want %q", r, p, tc.path)
				}
				checkClose(t, fmt.Sprintf("rank %d", r), procgroup.Float32, procgroup.Sum, fromBuf(bufs[r]), want)
			}

			if tc.at == "hostBroadcast" {
				n := 0 // hold rank 1 at its last piece
				stallHook = func(g *group, at string) {
					if g.rank == 1 && at == tc.at {
						if n++; n == count*4/(256<<10) {
							close(holding)
							<-release
						}
					}
				}
			}
			hold.Store(true)
			works := make([]procgroup.Work, size)
			for r, g := range groups {
				works[r] = g.AllReduce(ctx, bufs[r], procgroup.Sum)
			}
			c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			select {
			case <-holding:
			case <-c.Done():
				t.Fatalf("rank 1 never reached %s", tc.at)
			}
			// Rank 1's host peers time out; the other host's ranks, whose host phases do
			// not wait for it, may finish first, with the whole result.
			again := make([][]float64, size) // every buffer holds want: the inputs now
			for r := range again {
				again[r] = want
			}
			for r, w := range works {
				if r == 1 {
					continue
				}
				switch err := w.Wait(c); {
				case errors.Is(err, context.DeadlineExceeded):
					t.Fatalf("rank %d: no result", r)
				case err == nil && tc.hosts[r] == tc.hosts[1]:
					t.Errorf("rank %d: nil; want it to time out or abort", r)
				case err == nil:
					checkClose(t, fmt.Sprintf("rank %d (other host)", r), procgroup.Float32, procgroup.Sum, fromBuf(bufs[r]), reduceRef(again, procgroup.Sum))
				}
			}
			// Rank 0's caller, told of the failure, frees its buffer (its pages now read
			// zeros) and asks for memory again.
			a0 := groups[0].(procgroup.BufferAllocator)
			freed := bufs[0].([]float32)
			a0.FreeBuffer(freed)
			b, err := a0.AllocBuffer(procgroup.Float32, count)
			if b != nil || !errors.Is(err, procgroup.ErrAborted) {
				t.Errorf("rank 0: AllocBuffer after the abort: %T, %v; want nil and ErrAborted", b, err)
			}
			if b != nil {
				a0.FreeBuffer(b)
			}
			free()
			if err := works[1].Wait(c); err == nil || !errors.Is(err, procgroup.ErrAborted) {
				t.Errorf("rank 1, late: %v; want ErrAborted, not success", err)
			}
			for i, v := range freed {
				if v != 0 {
					t.Fatalf("rank 0's freed buffer reads %v at element %d after rank 1 woke; want zeros (rank 1 wrote into it)", v, i)
				}
			}
			if b, err := groups[1].(procgroup.BufferAllocator).AllocBuffer(procgroup.Float32, 1024); b != nil || !errors.Is(err, procgroup.ErrAborted) {
				t.Errorf("rank 1: AllocBuffer after its failure: %T, %v; want nil and ErrAborted", b, err)
			}
		})
	}
}

// TestVMReadvPeerGone: with Config.VMReadv, a peer whose process is gone (its posted pid
// is that of a child that has exited: process_vm_readv fails with ESRCH) fails the
// all-reduce with a PeerLostError naming it, not a bare errno; an all-reduce before it
// matches the reference.
func TestVMReadvPeerGone(t *testing.T) {
	cmaEverySize(t)
	cmd := exec.Command("/bin/true")
	if err := cmd.Run(); err != nil {
		t.Skipf("no child process: %v", err)
	}
	gone := cmd.Process.Pid // exited and reaped
	var swap atomic.Bool
	vmPIDHook = func(g *group, pid int) int {
		if g.rank == 1 && swap.Load() {
			return gone
		}
		return pid
	}
	t.Cleanup(func() { vmPIDHook = nil }) // after the groups' cleanup below
	groups := startGroupsTimeout(t, 2, &Config{Transport: TransportUnix, Algorithm: AlgoRing, PollInterval: 50 * time.Millisecond, AdoptBuffers: AdoptOff}, 10*time.Second)
	const count = 50000
	xs := inputs(5, 2, count, procgroup.Sum)
	bufs := []any{toBuf(procgroup.Float32, xs[0]), toBuf(procgroup.Float32, xs[1])}
	each(t, groups, func(r int, g procgroup.ProcessGroup) error { return wait(g.AllReduce(ctx, bufs[r], procgroup.Sum)) })
	for r, g := range groups {
		if p := g.(*group).lastPath; p != "shm-vm" {
			t.Fatalf("rank %d took %q, want shm-vm", r, p)
		}
		checkClose(t, fmt.Sprintf("rank %d", r), procgroup.Float32, procgroup.Sum, fromBuf(bufs[r]), reduceRef(xs, procgroup.Sum))
	}
	swap.Store(true)
	w0 := groups[0].AllReduce(ctx, bufs[0], procgroup.Sum)
	w1 := groups[1].AllReduce(ctx, bufs[1], procgroup.Sum)
	err := wait(w0)
	var ple *PeerLostError
	if !errors.As(err, &ple) || ple.Rank != 1 || !errors.Is(err, procgroup.ErrPeerLost) || !errors.Is(err, syscall.ESRCH) {
		t.Errorf("rank 0: %v; want a PeerLostError naming rank 1 (ESRCH)", err)
	}
	if err := wait(w1); err == nil {
		t.Errorf("rank 1: nil; want its peer's failure")
	}
}

// TestFreeBufferMadviseFails: when MADV_REMOVE fails (a test hook), FreeBuffer zeroes the
// pages itself: the freed buffer reads zeros, and the buffer AllocBuffer hands out again
// in its place is all zeros.
func TestFreeBufferMadviseFails(t *testing.T) {
	madvise = func([]byte, int) error { return syscall.EINVAL }
	t.Cleanup(func() { madvise = unix.Madvise })
	groups := startGroups(t, 2, &Config{Transport: TransportUnix, ShmArenaMiB: 1})
	a := groups[0].(procgroup.BufferAllocator)
	const count = 3000 // 3 pages of float32
	b, err := a.AllocBuffer(procgroup.Float32, count)
	if err != nil || b == nil {
		t.Fatalf("AllocBuffer: %v, %v", b, err)
	}
	x := b.([]float32)
	for i := range x {
		x[i] = float32(i + 1)
	}
	a.FreeBuffer(x)
	for i, v := range x {
		if v != 0 {
			t.Fatalf("freed buffer reads %v at %d; want zeros", v, i)
		}
	}
	b, err = a.AllocBuffer(procgroup.Float32, count)
	if err != nil || b == nil {
		t.Fatalf("AllocBuffer again: %v, %v", b, err)
	}
	y := b.([]float32)
	if uintptrOf(&y[0]) != uintptrOf(&x[0]) {
		t.Fatalf("the second buffer is not where the first was")
	}
	for i, v := range y[:cap(y)] {
		if v != 0 {
			t.Fatalf("handed out %v at %d; want zeros", v, i)
		}
	}
}
