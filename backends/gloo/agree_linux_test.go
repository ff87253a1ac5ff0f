//go:build linux

package gloo

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// mixedShmCase is one all-reduce of TestMixedSharedMemory: count elements of dt.
type mixedShmCase struct {
	dt    procgroup.DType
	op    procgroup.ReduceOp
	count int
	arena bool // buffers from AllocBuffer where the rank's host has them
}

// mixedData holds random inputs for runMixed and their reduction, per (dtype, op), as
// the byte views of typed buffers of the largest count: the reduction of a prefix is the
// prefix of the reduction, so each case copies and compares bytes (cheap under -race).
type mixedData struct {
	in   map[mixedKey][][]byte // by rank
	want map[mixedKey][]byte
}

type mixedKey struct {
	dt procgroup.DType
	op procgroup.ReduceOp
}

func newMixedData(seed uint64, size int, cases []mixedShmCase) *mixedData {
	d := &mixedData{in: map[mixedKey][][]byte{}, want: map[mixedKey][]byte{}}
	counts := map[mixedKey]int{}
	for _, c := range cases {
		k := mixedKey{c.dt, c.op}
		counts[k] = max(counts[k], c.count)
	}
	for k, n := range counts {
		seed++
		xs := inputs(seed, size, n, k.op)
		d.in[k] = make([][]byte, size)
		for r := range xs {
			d.in[k][r], _, _, _ = kernels.Bytes(toBuf(k.dt, xs[r]))
		}
		d.want[k], _, _, _ = kernels.Bytes(toBuf(k.dt, reduceRef(xs, k.op)))
	}
	return d
}

// runMixed all-reduces each case on groups (simulated hosts) and checks every rank's
// result byte for byte against the reference (computed in float64: the inputs are small
// integers, exact on every path).
func runMixed(t *testing.T, groups []procgroup.ProcessGroup, d *mixedData, cases []mixedShmCase) {
	t.Helper()
	size := len(groups)
	for _, c := range cases {
		what := fmt.Sprintf("%v %v of %s (%d elements), arena %v", c.dt, c.op, sizeName(c.count*c.dt.Size()), c.count, c.arena)
		k, nb := mixedKey{c.dt, c.op}, c.count*c.dt.Size()
		bufs := make([]any, size)
		for r, g := range groups {
			var b any
			if c.arena {
				b, _ = g.(procgroup.BufferAllocator).AllocBuffer(c.dt, c.count)
			}
			if b == nil {
				b = procgroup.NewBuffer(c.dt, c.count)
			}
			dst, _, _, _ := kernels.Bytes(b)
			copy(dst, d.in[k][r][:nb])
			bufs[r] = b
		}
		each(t, groups, func(r int, g procgroup.ProcessGroup) error { return wait(g.AllReduce(ctx, bufs[r], c.op)) })
		want := d.want[k][:nb]
		for r, g := range groups {
			if p := g.(*group).lastPath; !strings.HasPrefix(p, "hierarchical") {
				t.Errorf("%s: rank %d took %q, want the hierarchical all-reduce", what, r, p)
			}
			if got, _, _, _ := kernels.Bytes(bufs[r]); !bytes.Equal(got, want) {
				es, wrong, first := c.dt.Size(), 0, -1
				for i := 0; i < c.count; i++ {
					if !bytes.Equal(got[i*es:(i+1)*es], want[i*es:(i+1)*es]) {
						if wrong == 0 {
							first = i
						}
						wrong++
					}
				}
				t.Fatalf("%s: rank %d: %d of %d elements wrong, the first at [%d]", what, r, wrong, c.count, first)
			}
			if c.arena {
				g.(procgroup.BufferAllocator).FreeBuffer(bufs[r])
			}
		}
	}
}

// TestMixedSharedMemory (issue 53): two simulated hosts of 2 and of 4 ranks, with shared
// memory on or off on each host (every combination), GODDP_GLOO_TUNE off as in the
// issue's repro, and the default piece of Note [Hierarchical pipeline] (2 MiB): float32
// sums of 1 to 8 MiB (from 4 MiB the shared-memory hosts would cut pieces), float64
// averages of an odd count, and the arena's buffers where a host has them (the host
// phases in place); every rank's result is checked element by element. The pipeline runs
// only where both hosts share memory (group.piece), and every rank agrees.
func TestMixedSharedMemory(t *testing.T) {
	cases := []mixedShmCase{
		{procgroup.Float32, procgroup.Sum, 1 << 18, false},
		{procgroup.Float32, procgroup.Sum, 1 << 19, false},
		{procgroup.Float32, procgroup.Sum, 1 << 20, false},
		{procgroup.Float32, procgroup.Sum, 1 << 21, false},
		{procgroup.Float64, procgroup.Avg, 1<<19 + 3, false},
		{procgroup.Float32, procgroup.Sum, 1<<20 + 5, true},
	}
	for _, L := range []int{2, 4} {
		hosts := make([]string, 2*L)
		for r := range hosts {
			hosts[r] = string(rune('a' + r/L))
		}
		d := newMixedData(uint64(53+L), 2*L, cases)
		for _, shm := range [][2]string{{ShmAuto, ShmAuto}, {ShmAuto, ShmOff}, {ShmOff, ShmAuto}, {ShmOff, ShmOff}} {
			t.Run(fmt.Sprintf("%dx%d/%s-%s", 2, L, shm[0], shm[1]), func(t *testing.T) {
				groups := startGroupsCfg(t, len(hosts), func(r int) *Config {
					return &Config{HostID: hosts[r], Tune: TuneOff, SharedMemory: shm[r/L]}
				}, nil, 0)
				t.Cleanup(func() {
					for _, g := range groups {
						g.Close()
					}
				})
				both := shm[0] == ShmAuto && shm[1] == ShmAuto
				for r, g := range groups {
					gg := g.(*group)
					if want := shm[r/L] == ShmAuto; gg.hostShm != want {
						t.Errorf("rank %d (host %s, shared memory %s): hostShm %v", r, hosts[r], shm[r/L], gg.hostShm)
					}
					if want := map[bool]int{true: 2 << 20, false: -1}[both]; gg.piece != want {
						t.Errorf("rank %d: piece %d, want %d", r, gg.piece, want)
					}
				}
				runMixed(t, groups, d, cases)
			})
		}
	}
}

// TestMixedSharedMemorySmallPieces: as TestMixedSharedMemory at 2 × 2 ranks, in pieces of
// 16 KiB and segments of 4 KiB, so that small messages run many pieces of uneven lengths
// where both hosts share memory, and no pieces where one does not; int32 and float64, Sum
// and Max.
func TestMixedSharedMemorySmallPieces(t *testing.T) {
	hosts := []string{"a", "a", "b", "b"}
	var cases []mixedShmCase
	for _, dt := range []procgroup.DType{procgroup.Int32, procgroup.Float64} {
		for _, op := range []procgroup.ReduceOp{procgroup.Sum, procgroup.Max} {
			for _, count := range []int{4099, 70001} {
				cases = append(cases, mixedShmCase{dt, op, count, false}, mixedShmCase{dt, op, count, true})
			}
		}
	}
	d := newMixedData(530, len(hosts), cases)
	for _, shm := range [][2]string{{ShmAuto, ShmAuto}, {ShmAuto, ShmOff}, {ShmOff, ShmAuto}} {
		t.Run(shm[0]+"-"+shm[1], func(t *testing.T) {
			groups := startGroupsCfg(t, len(hosts), func(r int) *Config {
				return &Config{HostID: hosts[r], Tune: TuneOff, SharedMemory: shm[r/2], DirectMaxBytes: 8,
					SegmentSize: 4096, ShmSlotSize: 4096, ShmSlots: 2, HierPieceSize: 16 << 10}
			}, nil, 0)
			t.Cleanup(func() {
				for _, g := range groups {
					g.Close()
				}
			})
			runMixed(t, groups, d, cases)
		})
	}
}

// TestSharedMemoryOffWithinHost: one rank of a host with shared memory off (the host's
// leader, or another rank) is left out of the region: its host runs its host phases on
// the sockets, New neither waits for a region that never comes nor sends one nobody
// reads, and the sums are right.
func TestSharedMemoryOffWithinHost(t *testing.T) {
	hosts := []string{"a", "a", "b", "b"}
	cases := []mixedShmCase{
		{procgroup.Float32, procgroup.Sum, 1 << 20, false},
		{procgroup.Float32, procgroup.Sum, 1 << 20, true},
	}
	d := newMixedData(531, len(hosts), cases)
	for _, off := range []int{1, 2} {
		t.Run(fmt.Sprintf("rank%d", off), func(t *testing.T) {
			groups := startGroupsCfg(t, len(hosts), func(r int) *Config {
				c := &Config{HostID: hosts[r], Tune: TuneOff, HandshakeTimeout: 3 * time.Second, PollInterval: 100 * time.Millisecond}
				if r == off {
					c.SharedMemory = ShmOff
				}
				return c
			}, nil, 10*time.Second)
			t.Cleanup(func() {
				for _, g := range groups {
					g.Close()
				}
			})
			for r, g := range groups {
				if gg := g.(*group); gg.hostShm != (hosts[r] != hosts[off]) || gg.piece != -1 {
					t.Errorf("rank %d: hostShm %v, piece %d; want hostShm only off rank %d's host, and no pieces", r, gg.hostShm, gg.piece, off)
				}
			}
			runMixed(t, groups, d, cases)
		})
	}
}

// TestShmCreateFails: the region of one host cannot be created (memfd_create failing,
// through testShmCreate): that host's leader only warns, its ranks use the sockets, and the
// group agrees to run without pieces, with right sums on every rank at sizes where the
// other host would cut them.
func TestShmCreateFails(t *testing.T) {
	testShmCreate = func(host string) error {
		if host == "b" {
			return errors.New("memfd_create: cannot allocate memory (test)")
		}
		return nil
	}
	t.Cleanup(func() { testShmCreate = nil })
	hosts := []string{"a", "a", "a", "a", "b", "b", "b", "b"}
	groups := startGroupsHosts(t, hosts, Config{Tune: TuneOff})
	for r, g := range groups {
		gg := g.(*group)
		if (gg.shm == nil) != (hosts[r] == "b") || gg.hostShm != (hosts[r] == "a") || gg.piece != -1 {
			t.Errorf("rank %d (host %s): region %v, hostShm %v, piece %d; want a region only on host a, no pieces",
				r, hosts[r], gg.shm != nil, gg.hostShm, gg.piece)
		}
	}
	cases := []mixedShmCase{
		{procgroup.Float32, procgroup.Sum, 1 << 20, false},
		{procgroup.Float32, procgroup.Sum, 1 << 21, false},
		{procgroup.Float32, procgroup.Sum, 1 << 21, true},
		{procgroup.Float64, procgroup.Sum, 1<<19 + 1, false},
	}
	runMixed(t, groups, newMixedData(532, len(hosts), cases), cases)
}

// TestHierBlocksSharedMemory: Note [Hierarchical blocks]' host rings run through a host's
// shared-memory slots where the host has them, and over the sockets where it does not,
// with shared memory on or off on each of two simulated hosts of 2 or 3 ranks. Every
// collective's result is checked element by element (checkCollectives), and the slots
// are seen to carry a reduce-scatter's and an all-gather's host ring exactly on the hosts
// that share memory.
func TestHierBlocksSharedMemory(t *testing.T) {
	for _, L := range []int{2, 3} {
		hosts := make([]string, 2*L)
		for r := range hosts {
			hosts[r] = string(rune('a' + r/L))
		}
		for _, shm := range [][2]string{{ShmAuto, ShmAuto}, {ShmAuto, ShmOff}} {
			t.Run(fmt.Sprintf("%dx%d/%s-%s", 2, L, shm[0], shm[1]), func(t *testing.T) {
				groups := startGroupsCfg(t, len(hosts), func(r int) *Config {
					return &Config{HostID: hosts[r], Tune: TuneOff, SharedMemory: shm[r/L], DirectMaxBytes: 8,
						SegmentSize: 4096, ShmSlotSize: 4096, ShmSlots: 2}
				}, nil, 0)
				t.Cleanup(func() {
					for _, g := range groups {
						g.Close()
					}
				})
				checkCollectives(t, groups, []int{3, 4099})
				n := len(groups)
				for _, k := range []string{"reduce-scatter", "all-gather"} {
					before := make([]uint64, n)
					for r, g := range groups {
						before[r] = slotsSent(g.(*group))
					}
					each(t, groups, func(r int, g procgroup.ProcessGroup) error {
						if k == "reduce-scatter" {
							return wait(g.ReduceScatter(ctx, make([]float32, 1<<14), make([]float32, n<<14), procgroup.Sum))
						}
						return wait(g.AllGather(ctx, make([]float32, n<<14), make([]float32, 1<<14)))
					})
					for r, g := range groups {
						gg := g.(*group)
						if p := gg.lastPath; p != "hierarchical" {
							t.Errorf("rank %d: %s ran %q, want hierarchical", r, k, p)
						}
						sent := slotsSent(gg) - before[r]
						if on := shm[r/L] == ShmAuto; (sent > 0) != on {
							t.Errorf("rank %d (host %s, shared memory %s): %s sent %d slots", r, hosts[r], shm[r/L], k, sent)
						}
					}
				}
			})
		}
	}
}

// slotsSent is how many slots g has filled for its region's members (0 without one).
func slotsSent(g *group) uint64 {
	var s uint64
	if g.shm != nil {
		for _, p := range g.shm.prod {
			s += p
		}
	}
	return s
}
