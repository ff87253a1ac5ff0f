//go:build linux

package gloo

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/debug"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goddp/goddp/procgroup"
)

// randomInts fills b with small random integers (sums stay exact in float32).
func randomInts(rng *rand.Rand, b []float32) {
	for i := range b {
		b[i] = float32(rng.IntN(41) - 20)
	}
}

// sumRandom fills each rank's buffer with random integers, all-reduces them (Sum), and
// returns the float64 reference sum computed before.
func sumRandom(t *testing.T, rng *rand.Rand, groups []procgroup.ProcessGroup, bufs [][]float32) []float64 {
	t.Helper()
	x := make([][]float64, len(bufs))
	for r, b := range bufs {
		randomInts(rng, b)
		x[r] = make([]float64, len(b))
		for i, v := range b {
			x[r][i] = float64(v)
		}
	}
	want := reduceRef(x, procgroup.Sum)
	each(t, groups, func(r int, g procgroup.ProcessGroup) error {
		return wait(g.AllReduce(ctx, bufs[r], procgroup.Sum))
	})
	return want
}

// sumOnRing is sumRandom for buffers that must not be adopted: every rank takes the slot
// ring, and every element is the reference's.
func sumOnRing(t *testing.T, what string, rng *rand.Rand, groups []procgroup.ProcessGroup, bs [][]float32) {
	t.Helper()
	want := sumRandom(t, rng, groups, bs)
	for r, g := range groups {
		if p := g.(*group).lastPath; p != "shm-ring" {
			t.Fatalf("%s: rank %d took %q, want shm-ring", what, r, p)
		}
		for i, v := range bs[r] {
			if float64(v) != want[i] {
				t.Fatalf("%s: rank %d [%d] = %v, want %v", what, r, i, v, want[i])
			}
		}
	}
}

// adoptedAlias checks, by writing through the arena, that b's remapped pages are the
// arena's: a word written in the arena's view shows in b. It restores the word.
func adoptedAlias(t *testing.T, g *group, b []byte) bool {
	t.Helper()
	m := g.shm
	m.heap.mu.Lock()
	defer m.heap.mu.Unlock()
	v, h, tl := m.adoptedView(b)
	if v == nil || tl-h < 8 {
		return false
	}
	i := (h + 7) &^ 7
	old := b[i]
	v[i] = ^old
	alias := b[i] == ^old
	v[i] = old
	b[i] = old
	return alias
}

// TestAdoptedBuffers: buffers the user allocated, kept across collectives (a page-aligned
// one and one that starts and ends inside pages), take their usual path at the first
// collective and are adopted at the second (Note [Adopted buffers]): the all-reduce runs
// in place, AllGather, ReduceScatter and Broadcast read the arena, and every result
// matches a reference element by element, the all-reduce with the same bits on every
// rank. Writing through the arena shows in the user's slice; after Close the slices keep
// their last results and are private again.
func TestAdoptedBuffers(t *testing.T) {
	const count = 70001 // 273 KiB of float32: more than one reduceBlock
	for size := 2; size <= 4; size++ {
		t.Run(fmt.Sprintf("n%d", size), func(t *testing.T) {
			groups := startGroupsNoCleanup(t, size, &Config{Transport: TransportUnix})
			rng := rand.New(rand.NewPCG(uint64(size), 52))
			// Rank r's buffers: ar aligned to a page (a fresh large object), un starting
			// 20 bytes into one; gin, gout and rsin for the other collectives.
			ar := make([][]float32, size)
			un := make([][]float32, size)
			gin := make([][]float32, size)
			gout := make([][]float32, size)
			rsin := make([][]float32, size)
			rsout := make([][]float32, size)
			for r := range size {
				ar[r] = make([]float32, count)
				un[r] = make([]float32, count+64)[5 : 5+count]
				gin[r] = make([]float32, count)
				gout[r] = make([]float32, count*size)
				rsin[r] = make([]float32, count*size)
				rsout[r] = make([]float32, count)
			}
			for round := range 4 {
				for _, bufs := range [][][]float32{ar, un} {
					want := sumRandom(t, rng, groups, bufs)
					wantPath := "shm-inplace"
					if round == 0 {
						wantPath = "shm-ring"
					}
					for r, g := range groups {
						if p := g.(*group).lastPath; p != wantPath {
							t.Fatalf("round %d: rank %d took %q, want %q", round, r, p, wantPath)
						}
						for i, v := range bufs[r] {
							if float64(v) != want[i] || math.Float32bits(v) != math.Float32bits(bufs[0][i]) {
								t.Fatalf("round %d rank %d: [%d] = %v, want %v (rank 0 %v)", round, r, i, v, want[i], bufs[0][i])
							}
						}
						b := unsafe.Slice((*byte)(unsafe.Pointer(&bufs[r][0])), 4*count)
						if alias := adoptedAlias(t, g.(*group), b); alias != (round > 0) {
							t.Fatalf("round %d rank %d: the arena is the buffer's memory: %t", round, r, alias)
						}
					}
				}
				// AllGather, ReduceScatter and Broadcast on kept buffers.
				for r := range size {
					randomInts(rng, gin[r])
					randomInts(rng, rsin[r])
				}
				each(t, groups, func(r int, g procgroup.ProcessGroup) error {
					if err := wait(g.AllGather(ctx, gout[r], gin[r])); err != nil {
						return err
					}
					return wait(g.ReduceScatter(ctx, rsout[r], rsin[r], procgroup.Sum))
				})
				for r := range size {
					for j := range size {
						for i := range count {
							if got := gout[r][j*count+i]; got != gin[j][i] {
								t.Fatalf("round %d: allgather rank %d [%d] = %v, want %v", round, r, j*count+i, got, gin[j][i])
							}
						}
					}
					for i := range count {
						var s float32
						for j := range size {
							s += rsin[j][r*count+i]
						}
						if rsout[r][i] != s {
							t.Fatalf("round %d: reducescatter rank %d [%d] = %v, want %v", round, r, i, rsout[r][i], s)
						}
					}
				}
				if p := groups[0].(*group).lastPath; round > 0 && p != "shm-arena" {
					t.Fatalf("round %d: reducescatter took %q, want shm-arena", round, p)
				}
				root := round % size
				want := append([]float32(nil), gin[root]...)
				each(t, groups, func(r int, g procgroup.ProcessGroup) error {
					return wait(g.Broadcast(ctx, gin[r], root))
				})
				for r := range size {
					for i := range count {
						if gin[r][i] != want[i] {
							t.Fatalf("round %d: broadcast from %d, rank %d [%d] = %v, want %v", round, root, r, i, gin[r][i], want[i])
						}
					}
				}
			}
			saved := make([][]float32, size)
			for r := range size {
				saved[r] = append([]float32(nil), un[r]...)
			}
			for _, g := range groups {
				g.Close()
			}
			adopted.Lock()
			left := len(adopted.by)
			adopted.Unlock()
			if left != 0 {
				t.Fatalf("%d adoptions left after Close", left)
			}
			for r := range size {
				for i := range count {
					if un[r][i] != saved[r][i] {
						t.Fatalf("rank %d: after Close [%d] = %v, want %v", r, i, un[r][i], saved[r][i])
					}
				}
				un[r][0]++ // still writable memory
			}
		})
	}
}

// TestAdoptedChurn: buffers of changing sizes come and go, with garbage collections and
// small objects between them; the adoptions hold the buffers they took until Close, up to
// half the arena part, and the rest take the ring. Every all-reduce matches its
// reference, the small objects keep what was written into them, and after Close the
// dropped buffers' pages serve the allocator again (TestAdoptedHeapSafety checks that
// more).
func TestAdoptedChurn(t *testing.T) {
	const size = 2
	groups := startGroups(t, size, &Config{Transport: TransportUnix, ShmArenaMiB: 16})
	rng := rand.New(rand.NewPCG(9, 52))
	var keep [][]int64
	for it := range 60 {
		count := 20000 + rng.IntN(400000) // up to 1.6 MiB: some fit in 8 MiB, not all
		bufs := make([][]float32, size)
		for r := range size {
			off := rng.IntN(3) // some start inside a page
			bufs[r] = make([]float32, count+off)[off:]
		}
		for rep := range 3 {
			want := sumRandom(t, rng, groups, bufs)
			for r := range size {
				for i, v := range bufs[r] {
					if float64(v) != want[i] {
						t.Fatalf("iteration %d rep %d rank %d: [%d] = %v, want %v", it, rep, r, i, v, want[i])
					}
				}
			}
		}
		if it%3 == 0 {
			runtime.GC()
			for range 200 {
				s := make([]int64, 1+rng.IntN(600))
				for i := range s {
					s[i] = int64(len(keep))<<20 | int64(i)
				}
				keep = append(keep, s)
			}
		}
	}
	for k, s := range keep {
		for i, v := range s {
			if v != int64(k)<<20|int64(i) {
				t.Fatalf("small object %d: [%d] = %#x, want %#x", k, i, v, int64(k)<<20|int64(i))
			}
		}
	}
	m := groups[0].(*group).shm
	m.heap.mu.Lock()
	n, bytes := len(m.adopt.list), m.adopt.bytes
	m.heap.mu.Unlock()
	if n == 0 || bytes > m.arenaLen/2 {
		t.Errorf("%d adoptions hold %d bytes; want some, at most half the %d-byte part", n, bytes, m.arenaLen)
	}
}

// TestAdoptedTwoGroups: one buffer passed to two groups of one process is adopted by one
// of them at most; the other keeps its path, and both give the right sums.
func TestAdoptedTwoGroups(t *testing.T) {
	const size, count = 2, 100000
	a := startGroups(t, size, &Config{Transport: TransportUnix})
	b := startGroups(t, size, &Config{Transport: TransportUnix})
	bufs := make([][]float32, size)
	for r := range size {
		bufs[r] = make([]float32, count)
	}
	rng := rand.New(rand.NewPCG(3, 52))
	for it := range 6 {
		groups := a
		if it%2 == 1 {
			groups = b
		}
		want := sumRandom(t, rng, groups, bufs)
		for r := range size {
			for i, v := range bufs[r] {
				if float64(v) != want[i] {
					t.Fatalf("iteration %d rank %d: [%d] = %v, want %v", it, r, i, v, want[i])
				}
			}
		}
	}
	if pa, pb := a[0].(*group).lastPath, b[0].(*group).lastPath; pa == pb {
		t.Errorf("both groups took %q; want one in place, the other not", pa)
	}
}

// TestAdoptOff: with GODDP_GLOO_ADOPT=off a kept buffer stays private.
func TestAdoptOff(t *testing.T) {
	t.Setenv("GODDP_GLOO_ADOPT", "off")
	groups := startGroups(t, 2, &Config{Transport: TransportUnix})
	bufs := [][]float32{make([]float32, 100000), make([]float32, 100000)}
	for range 3 {
		each(t, groups, func(r int, g procgroup.ProcessGroup) error {
			return wait(g.AllReduce(ctx, bufs[r], procgroup.Sum))
		})
	}
	if p := groups[0].(*group).lastPath; p != "shm-ring" {
		t.Errorf("took %q, want shm-ring", p)
	}
	t.Setenv("GODDP_GLOO_ADOPT", "sometimes")
	if err := (&Config{}).validate(); err == nil {
		t.Errorf("GODDP_GLOO_ADOPT=sometimes: no error")
	}
}

// heapCheck builds pointer-rich garbage and checks it, with collections between, so that
// pages the allocator takes for zeros and are not would show (as they did when adopted
// pages were scavenged: docs/results/2026-12-07-adopted-buffers.md).
func heapCheck(t *testing.T, rounds int) {
	t.Helper()
	type node struct {
		a    []int
		next *node
	}
	for it := range rounds {
		var head *node
		for i := range 3000 {
			head = &node{a: make([]int, i%70), next: head}
		}
		n := 0
		for p := head; p != nil; p = p.next {
			for _, v := range p.a {
				if v != 0 {
					t.Fatalf("round %d: a fresh slice holds %d", it, v)
				}
			}
			n++
		}
		if n != 3000 {
			t.Fatalf("round %d: a list of 3000 has %d nodes", it, n)
		}
		if it%10 == 0 {
			runtime.GC()
			debug.FreeOSMemory() // scavenges every free page
		}
	}
}

// TestAdoptedHeapSafety: adopted buffers dropped by the program, before and after Close,
// with the heap scavenged between, leave the allocator's memory as it expects.
func TestAdoptedHeapSafety(t *testing.T) {
	const size = 2
	for rep := range 3 {
		groups := startGroupsNoCleanup(t, size, &Config{Transport: TransportUnix})
		for range 6 {
			count := 50000 + rep*70000
			bufs := [][]float32{make([]float32, count), make([]float32, count)}
			for range 3 {
				each(t, groups, func(r int, g procgroup.ProcessGroup) error {
					return wait(g.AllReduce(ctx, bufs[r], procgroup.Sum))
				})
			}
			if p := groups[0].(*group).lastPath; p != "shm-inplace" {
				t.Fatalf("took %q, want shm-inplace", p)
			}
			heapCheck(t, 20)
		}
		for _, g := range groups {
			g.Close()
		}
		heapCheck(t, 60)
	}
}

// TestAdoptNotAnonymous: a buffer in a file's shared mapping, and one from another
// group's arena, are never adopted (their mappings would change under the program); they
// keep their paths and their sums.
func TestAdoptNotAnonymous(t *testing.T) {
	const size, count = 2, 100000
	groups := startGroups(t, size, &Config{Transport: TransportUnix})
	other := startGroups(t, size, &Config{Transport: TransportUnix})
	bufs := make([][]float32, size)
	for r := range size {
		bufs[r] = fileF32(t, count)
	}
	arenaBufs := make([][]float32, size)
	for r, g := range other {
		b, err := g.(procgroup.BufferAllocator).AllocBuffer(procgroup.Float32, count)
		if err != nil || b == nil {
			t.Fatalf("rank %d: AllocBuffer: %v, %v", r, b, err)
		}
		arenaBufs[r] = b.([]float32)
	}
	rng := rand.New(rand.NewPCG(4, 52))
	for k, bs := range [][][]float32{bufs, arenaBufs} {
		for it := range 3 {
			sumOnRing(t, fmt.Sprintf("buffers %d, iteration %d", k, it), rng, groups, bs)
		}
	}
}

// fileF32 maps count float32s of a new file, shared, until t's end.
func fileF32(t *testing.T, count int) []float32 {
	t.Helper()
	f, err := os.CreateTemp(t.TempDir(), "buf")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(int64(4 * count)); err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, 4*count, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	return unsafe.Slice((*float32)(unsafe.Pointer(&mem[0])), count)
}

// mmapF32 maps count float32s of private anonymous memory, at addr when it is not nil.
func mmapF32(t *testing.T, addr unsafe.Pointer, count int) []float32 {
	t.Helper()
	flags := unix.MAP_PRIVATE | unix.MAP_ANONYMOUS
	if addr != nil {
		flags |= unix.MAP_FIXED
	}
	p, err := unix.MmapPtr(-1, 0, addr, uintptr(4*count), unix.PROT_READ|unix.PROT_WRITE, flags)
	if err != nil {
		t.Fatal(err)
	}
	return unsafe.Slice((*float32)(p), count)
}

var globalBufs [2][100000]float32

// TestAdoptNotHeap: only Go's heap is adopted. The program's own anonymous mapping, which
// it may unmap and map again at the same address, and a global keep their paths; after
// the program remapped its buffer the sums are still right, and Close leaves what the
// program wrote there.
func TestAdoptNotHeap(t *testing.T) {
	const size, count = 2, 98 * 1024
	groups := startGroupsNoCleanup(t, size, &Config{Transport: TransportUnix})
	bufs := [][]float32{mmapF32(t, nil, count), mmapF32(t, nil, count)}
	rng := rand.New(rand.NewPCG(5, 52))
	check := func(what string, bs [][]float32) {
		t.Helper()
		sumOnRing(t, what, rng, groups, bs)
	}
	for range 3 {
		check("mmap", bufs)
		check("global", [][]float32{globalBufs[0][:], globalBufs[1][:]})
	}
	for r := range size {
		a := unsafe.Pointer(&bufs[r][0])
		if err := unix.MunmapPtr(a, 4*count); err != nil {
			t.Fatal(err)
		}
		bufs[r] = mmapF32(t, a, count)
	}
	check("mapped again", bufs)
	for r := range size {
		bufs[r][0] = 7
	}
	for _, g := range groups {
		g.Close()
	}
	for r := range size {
		if bufs[r][0] != 7 {
			t.Errorf("rank %d: after Close [0] = %v, want the 7 the program wrote", r, bufs[r][0])
		}
		unix.MunmapPtr(unsafe.Pointer(&bufs[r][0]), 4*count)
	}
}

// TestAdoptCloseReleases: once every rank has closed, the arena's memfd holds no pages,
// whether a rank adopted a buffer (rank 0) or not (rank 1, whose buffer is a file's
// mapping), and the buckets both handed out are gone with it.
func TestAdoptCloseReleases(t *testing.T) {
	const size, count = 2, 100000
	groups := startGroupsNoCleanup(t, size, &Config{Transport: TransportUnix, ShmArenaMiB: 64})
	for _, g := range groups {
		b, err := g.(procgroup.BufferAllocator).AllocBuffer(procgroup.Float32, 4<<20)
		if err != nil || b == nil {
			t.Fatalf("AllocBuffer: %v, %v", b, err)
		}
		for i := range b.([]float32) {
			b.([]float32)[i] = 1
		}
	}
	bufs := [][]float32{make([]float32, count), fileF32(t, count)}
	rng := rand.New(rand.NewPCG(6, 52))
	for range 3 {
		sumRandom(t, rng, groups, bufs)
	}
	if !groups[0].(*group).isAdopted(unsafe.Slice((*byte)(unsafe.Pointer(&bufs[0][0])), 4*count)) {
		t.Fatal("rank 0's buffer was not adopted")
	}
	fd, err := unix.FcntlInt(uintptr(groups[0].(*group).shm.adopt.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	var before, after unix.Stat_t
	unix.Fstat(fd, &before)
	saved := append([]float32(nil), bufs[0]...)
	for _, g := range groups {
		g.Close()
	}
	unix.Fstat(fd, &after)
	if before.Blocks == 0 || after.Blocks != 0 {
		t.Errorf("the arena's memfd held %d bytes before Close and %d after; want some, then none", before.Blocks*512, after.Blocks*512)
	}
	for i, v := range bufs[0] {
		if v != saved[i] {
			t.Fatalf("after Close [%d] = %v, want %v", i, v, saved[i])
		}
	}
}

// TestAdoptBroadcastFallback: a Broadcast whose root's buffer cannot be read in place
// (process_vm_readv off, the buffer not adopted yet) falls back to the chain only after
// every rank has read the posts, so a late peer does not find the root's next post (it
// failed so before).
func TestAdoptBroadcastFallback(t *testing.T) {
	groups := startGroupsTimeout(t, 2, &Config{Transport: TransportUnix, VMReadv: VMReadvOff}, 10*time.Second)
	var once sync.Once
	stallHook = func(g *group, at string) {
		if at == "postBuffer" && g.rank == 1 {
			once.Do(func() { time.Sleep(200 * time.Millisecond) })
		}
	}
	t.Cleanup(func() { stallHook = nil })
	const count = 64 << 10 // 256 KiB: the chain's message fits the slots
	const rounds = 3
	rng := rand.New(rand.NewPCG(7, 52))
	sent := make([][]float32, rounds) // the root's data, round by round
	for it := range rounds {
		sent[it] = make([]float32, count)
		randomInts(rng, sent[it])
	}
	got := make([][]float32, rounds)
	// Each rank runs its broadcasts back to back, as a program does: the root may run
	// ahead of rank 1.
	each(t, groups, func(r int, g procgroup.ProcessGroup) error {
		buf := make([]float32, count)
		for it := range rounds {
			if r == 0 {
				copy(buf, sent[it])
			}
			if err := wait(g.Broadcast(ctx, buf, 0)); err != nil {
				return fmt.Errorf("broadcast %d: %w", it, err)
			}
			if r == 1 {
				got[it] = append([]float32(nil), buf...)
			}
		}
		return nil
	})
	for it := range rounds {
		for i, v := range got[it] {
			if v != sent[it][i] {
				t.Fatalf("broadcast %d: rank 1 [%d] = %v, want %v", it, i, v, sent[it][i])
			}
		}
	}
}
