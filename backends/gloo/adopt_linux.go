package gloo

import (
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// Note [Adopted buffers]: a buffer the user allocated (a Go slice on the heap) is not in
// the arena, so its peers cannot read it in place (Note [Shared buffers]), and a kernel
// copy (Note [Single copy]) costs about four user-space copies a byte here. So a rank
// adopts such a buffer into its arena part: it copies the buffer's whole pages into arena
// pages once, then maps those arena pages over the buffer's own addresses (mmap MAP_FIXED
// of the arena's memfd). From then on the buffer is arena memory at the user's address:
// the user's slice, unchanged, reads and writes the shared pages, and every later
// collective on it runs in place, as the reducer's buckets do, or reads the peers' inputs
// with a user-space copy (AllGather, ReduceScatter, Broadcast). NCCL's buffer registration
// does this job where the user asks for it.
//
//   - What is remapped: only the pages wholly inside the buffer (its interior), and
//     only in Go's heap (inGoHeap): the program's own mappings (unix.Mmap, C's malloc,
//     a file) could be unmapped and mapped again under the adoption, which would then
//     stand for memory that is no longer there. The caller gives the buffer to the
//     collective, so nothing else writes those pages while they are copied and remapped.
//     A partial first or last page also holds other memory: it stays private, and its
//     bytes of the buffer are copied into the arena page that stands for it (a shadow)
//     before each collective and, for a result, back after it.
//   - The adoption holds the buffer (pin) until Close. This is what makes it safe: Go's
//     allocator takes pages it scavenged (MADV_DONTNEED) for zeros, and shared pages are
//     not zeros after it (docs/results/2026-12-07-adopted-buffers.md). A pinned object's
//     pages are never free, so never scavenged. The price is memory: a buffer the program
//     drops stays until Close, and so the adoptions of a rank are bounded by half its
//     arena part and adoptMax; past that, buffers take their other paths. Adoptions take
//     the top of the part (getHigh), the buckets the bottom, so that what each rank
//     adopted does not change whether a bucket fits.
//   - When: at the second collective that passes a buffer over the same pages (a rank
//     remembers the last adoptSeen it passed over): a buffer used once takes the slot
//     ring, which costs less than copying it in, and is not held. A buffer over pages
//     inside an adoption (a part of the same object) uses it.
//   - Each rank decides alone; the posts (postBuffer) make the ranks agree on the path,
//     and a rank whose buffer is not adopted sends every rank down the path it would take
//     without it. A path taken after the posts must keep every rank until all have read
//     them: the rings and exchanges do (each needs every rank's data), and Broadcast's
//     chain, whose root only sends, waits a phase first.
//   - At Close (evict) each interior is mapped again, privately (MAP_PRIVATE of the same
//     memfd range: every byte reads as before, and no write by another goroutine is lost,
//     since the kernel replaces the mapping under its lock), each page is made private at
//     once (MADV_POPULATE_WRITE), and the rank's arena part is released (MADV_REMOVE), so
//     that no rank's pages outlive the group in the memfd that those mappings keep open.
//     Nobody writes the part again, so a page the allocator scavenges later reads as
//     zeros, as it expects (and costs a page of the memfd once the allocator touches it
//     again, at most the adopted bytes). After an abort a late peer (Note [Late ranks])
//     might still write into the part, so the adoptions stay shared and held, and so does
//     one whose pages could not all be made private; their arena pages are not released,
//     and a late peer may change such a buffer even after Close.
//   - One process may hold several groups; a page is adopted by one at most (adopted,
//     below), and never again once its group has aborted.
//
// Config.AdoptBuffers (GODDP_GLOO_ADOPT) turns it off, as GODEBUG harddecommit, pages
// other than 4 KiB and a kernel without MADV_POPULATE_WRITE do.

// adoptMax bounds the adoptions of a rank (each splits a mapping, and the kernel bounds
// their number); adoptSeen buffers not adopted are remembered.
const (
	adoptMax  = 256
	adoptSeen = 64
)

// adoptMinBytes is the smallest buffer a rank adopts. It is a variable, and adoptFirst
// (adopt at the first collective) exists, for tests.
var (
	adoptMinBytes = 64 << 10
	adoptFirst    = false
)

// adoption is one adopted buffer's pages: user pages lo..hi stand at arena offset off of
// this rank's part, of which ilo..ihi are remapped (the rest are shadows). pin holds the
// buffer's object.
type adoption struct {
	lo, hi, ilo, ihi uintptr
	off              int
	pin              unsafe.Pointer
}

// adoptTable is a rank's adoptions, guarded by its arena heap's lock.
type adoptTable struct {
	list  []*adoption
	bytes int
	seen  pageRing // recent buffers not adopted
	// recent buffers found outside Go's heap, not tested again (the test allocates,
	// and collectives allocate nothing in steady state)
	refused pageRing
	fd      int  // the arena's memfd, -1 when none
	off     bool // by Config, unsupported, full, or the group aborted or closed
	full    bool // the budget was reached once (logged)
	log     *zap.Logger
}

// pageRing remembers the page ranges lo..hi of the last adoptSeen buffers added.
type pageRing struct {
	spans [adoptSeen][2]uintptr
	next  int
}

func (r *pageRing) has(lo, hi uintptr) bool {
	return slices.Contains(r.spans[:], [2]uintptr{lo, hi})
}

func (r *pageRing) add(lo, hi uintptr) {
	r.spans[r.next] = [2]uintptr{lo, hi}
	r.next = (r.next + 1) % adoptSeen
}

// adopted is the process's adoptions, by owner (Note [Adopted buffers]). It keeps the
// pins of adoptions kept after an abort for the rest of the process.
var adopted struct {
	sync.Mutex
	by map[*adoption]*shmRegion
}

// pageSpan is the page range of b and its interior (the pages wholly inside it).
func pageSpan(b []byte) (lo, hi, ilo, ihi uintptr) {
	p := uintptr(unsafe.Pointer(&b[0]))
	end := p + uintptr(len(b))
	return p &^ (pageSize - 1), (end + pageSize - 1) &^ (pageSize - 1), (p + pageSize - 1) &^ (pageSize - 1), end &^ (pageSize - 1)
}

// adoptSetup enables adoption for the region, whose arena is mapped from fd (a copy of
// it is kept until Close), unless the config or the kernel rules it out.
func (g *group) adoptSetup(fd int) {
	m := g.shm
	t := &m.adopt
	t.fd, t.off, t.log = -1, true, g.log
	if fd < 0 || m.arena == nil || g.cfg.AdoptBuffers == AdoptOff {
		return
	}
	switch {
	case os.Getpagesize() != pageSize:
		g.log.Info("gloo: the kernel's pages are not 4 KiB: buffers the user allocated are not adopted into shared memory", zap.Int("page size", os.Getpagesize()))
		return
	case hardDecommit():
		g.log.Info("gloo: GODEBUG harddecommit is set: buffers the user allocated are not adopted into shared memory")
		return
	case !populateWriteWorks():
		g.log.Info("gloo: the kernel lacks MADV_POPULATE_WRITE (Linux 5.14): buffers the user allocated are not adopted into shared memory")
		return
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		g.log.Info("gloo: buffers the user allocated are not adopted into shared memory", zap.Error(err))
		return
	}
	t.fd, t.off = dup, false
}

// adoptable reports whether b would run in place if adopted: adoption is on and b is
// large enough and has a whole page.
func (m *shmRegion) adoptable(b []byte) bool {
	if m == nil || m.adopt.off || len(b) < adoptMinBytes {
		return false
	}
	_, _, ilo, ihi := pageSpan(b)
	return ilo < ihi
}

// adoptedView is b's view in this rank's arena part when b lies in one of its adoptions,
// with the bytes of b outside the remapped pages (head ..h, tail t..) to copy; nil
// otherwise. The caller holds m.heap.mu.
func (m *shmRegion) adoptedView(b []byte) (v []byte, h, t int) {
	a := m.adoptionOf(b)
	if a == nil {
		return nil, 0, 0
	}
	p := uintptr(unsafe.Pointer(&b[0]))
	at := m.me*m.arenaLen + a.off + int(p-a.lo)
	v = m.arena[at : at+len(b) : at+len(b)]
	h = max(0, min(len(b), int(a.ilo)-int(p)))
	t = max(0, min(len(b), int(a.ihi)-int(p)))
	return v, h, t
}

// adoptIn is Note [Adopted buffers] for b, a buffer that a collective passes: b's view in
// the arena, its shadow bytes copied in, and the head and tail (see adoptedView) to copy
// back out for a result; nil when b is not adopted (adoption off, b too small, seen for
// the first time, no room, not anonymous memory, or another group holds its pages).
func (g *group) adoptIn(b []byte) (v []byte, h, t int) {
	m := g.shm
	if !m.adoptable(b) || g.ownsShared(b) || g.allocAborted() != nil {
		return nil, 0, 0
	}
	m.heap.mu.Lock()
	defer m.heap.mu.Unlock()
	if m.heap.closed || m.adopt.off {
		return nil, 0, 0
	}
	if v, h, t = m.adoptedView(b); v == nil && m.adoptNew(b) {
		v, h, t = m.adoptedView(b)
	}
	if v != nil {
		copy(v[:h], b[:h])
		copy(v[t:], b[t:])
	}
	return v, h, t
}

// adoptOut copies a result's shadow bytes (see adoptedView) from v back into b.
func adoptOut(b, v []byte, h, t int) {
	copy(b[:h], v[:h])
	copy(b[t:], v[t:])
}

// adoptNew adopts b's pages (the caller holds m.heap.mu) if it has seen them before and
// they fit; it reports whether it did.
func (m *shmRegion) adoptNew(b []byte) bool {
	t := &m.adopt
	lo, hi, ilo, ihi := pageSpan(b)
	if !adoptFirst && !t.seen.has(lo, hi) {
		t.seen.add(lo, hi)
		return false
	}
	if t.refused.has(lo, hi) {
		return false
	}
	n := int(hi - lo)
	if t.bytes+n > m.arenaLen/2 || len(t.list) >= adoptMax {
		if !t.full {
			t.full = true
			t.log.Info("gloo: the adopted buffers reached their bound (half the shared arena's part, or 256): later buffers the user allocated take their other paths until Close",
				zap.Int("adopted bytes", t.bytes), zap.Int("adoptions", len(t.list)))
		}
		return false
	}
	adopted.Lock()
	defer adopted.Unlock()
	for a := range adopted.by {
		if a.ilo < ihi && ilo < a.ihi {
			return false // another group's pages, or another part of an adopted object
		}
	}
	if !inGoHeap(unsafe.Pointer(&b[0])) {
		t.refused.add(lo, hi)
		return false
	}
	off, ok := m.heap.getHigh(n)
	if !ok {
		return false
	}
	base := m.me*m.arenaLen + off
	p := uintptr(unsafe.Pointer(&b[0]))
	in := b[ilo-p : ihi-p]
	copy(m.arena[base+int(ilo-lo):], in)
	if err := m.remap(ilo, ihi-ilo, base+int(ilo-lo), unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		// A MAP_FIXED mmap that fails may or may not have unmapped the range first (at
		// the mapping limit it fails before): where the range is no longer all mapped
		// (madvise's ENOMEM), put private pages back with the bytes just copied.
		if unmapped(ilo, ihi) {
			if m.remap(ilo, ihi-ilo, -1, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS) != nil {
				panic(fmt.Sprintf("gloo: adopting %d bytes at %#x failed (%v), and so did restoring them", ihi-ilo, ilo, err))
			}
			copy(in, m.arena[base+int(ilo-lo):base+int(ihi-lo)])
		}
		m.release(off)
		t.off = true
		t.log.Warn("gloo: adopting a buffer into shared memory failed; buffers the user allocated take the other paths from now on", zap.Error(err))
		return false
	}
	a := &adoption{lo: lo, hi: hi, ilo: ilo, ihi: ihi, off: off, pin: unsafe.Pointer(&b[0])}
	t.list = append(t.list, a)
	t.bytes += n
	if adopted.by == nil {
		adopted.by = map[*adoption]*shmRegion{}
	}
	adopted.by[a] = m
	return true
}

// inGoHeap reports whether p points into an object of Go's heap: the only memory whose
// mapping the program leaves to the runtime, and which the pin holds. The user's own
// mappings (unix.Mmap, C's malloc, a file) could be unmapped and mapped again under the
// adoption, and globals are never freed but are not the heap's either. runtime.AddCleanup
// is the public test: it returns a real Cleanup for a heap object (stopped at once), the
// zero one for a global, and panics elsewhere.
func inGoHeap(p unsafe.Pointer) (heap bool) {
	defer func() {
		if recover() != nil {
			heap = false
		}
	}()
	c := runtime.AddCleanup((*byte)(p), func(int) {}, 0)
	if c == (runtime.Cleanup{}) {
		return false
	}
	c.Stop()
	return true
}

// evict gives adoption a's pages back at Close (Note [Adopted buffers]); the caller holds
// m.heap.mu and adopted's lock. It reports whether it did: where the pages cannot all be
// made private, the adoption stays, held, and its arena pages stay too (they are the
// buffer's).
func (m *shmRegion) evict(a *adoption) bool {
	at := m.me*m.arenaLen + a.off + int(a.ilo-a.lo)
	err := m.remap(a.ilo, a.ihi-a.ilo, at, unix.MAP_PRIVATE)
	if err != nil && unmapped(a.ilo, a.ihi) {
		// The failed mmap took the old mapping with it (some kernels charge a private
		// mapping after unmapping): map the shared pages back, which costs no charge.
		if m.remap(a.ilo, a.ihi-a.ilo, at, unix.MAP_SHARED) != nil {
			panic(fmt.Sprintf("gloo: giving back %d adopted bytes at %#x failed (%v), and so did mapping them again", a.ihi-a.ilo, a.ilo, err))
		}
	}
	if err == nil {
		if _, _, e := unix.Syscall(unix.SYS_MADVISE, a.ilo, a.ihi-a.ilo, unix.MADV_POPULATE_WRITE); e != 0 {
			err = e
		}
	}
	if err != nil {
		m.adopt.log.Warn("gloo: giving an adopted buffer's pages back at Close failed; the buffer keeps its arena pages and is held until the process exits", zap.Error(err))
		return false
	}
	delete(adopted.by, a)
	return true
}

// unmapped reports whether some page of lo..hi is not mapped (madvise(2): ENOMEM).
func unmapped(lo, hi uintptr) bool {
	_, _, e := unix.Syscall(unix.SYS_MADVISE, lo, hi-lo, unix.MADV_NORMAL)
	return e == unix.ENOMEM
}

// release takes back the arena pages handed out at off and frees their memory.
func (m *shmRegion) release(off int) {
	if n := m.heap.put(off); n > 0 {
		base := m.me*m.arenaLen + off
		if b := m.arena[base : base+n]; madvise(b, unix.MADV_REMOVE) != nil {
			clear(b)
		}
	}
}

// endAdoptions is Close's part of Note [Adopted buffers] (the caller holds m.heap.mu):
// every adoption is given back, unless the group aborted, and then this rank's arena
// part is released but for the adoptions still held (after an abort, or where evict
// failed), so that the memfd keeps no pages once every rank has closed.
func (m *shmRegion) endAdoptions(aborted bool) {
	t := &m.adopt
	t.off = true
	var held []span // this rank's arena offsets, sorted
	if len(t.list) > 0 {
		adopted.Lock()
		for _, a := range t.list {
			if aborted || !m.evict(a) {
				held = append(held, span{a.off, int(a.hi - a.lo)})
			}
		}
		adopted.Unlock()
	}
	slices.SortFunc(held, func(x, y span) int { return x.off - y.off })
	base, at := m.me*m.arenaLen, 0
	for _, h := range append(held, span{m.arenaLen, 0}) {
		if h.off > at {
			if b := m.arena[base+at : base+h.off]; madvise(b, unix.MADV_REMOVE) != nil {
				clear(b)
			}
		}
		at = max(at, h.off+h.n)
	}
	t.list, t.bytes = nil, 0
}

// remap maps n bytes of the arena's memfd at file offset at (or anonymous memory, for
// at < 0) over the pages at addr. It takes the address as a number: an evicted buffer may
// be dead, its pages free or other objects'.
func (m *shmRegion) remap(addr, n uintptr, at int, flags int) error {
	fd, off := m.adopt.fd, uintptr(at)
	if at < 0 {
		fd, off = -1, 0
	}
	p, _, e := unix.Syscall6(unix.SYS_MMAP, addr, n, unix.PROT_READ|unix.PROT_WRITE, uintptr(flags|unix.MAP_FIXED), uintptr(fd), off)
	switch {
	case e != 0:
		return e
	case p != addr:
		return fmt.Errorf("mmap placed %#x at %#x", addr, p)
	}
	return nil
}

// populateWriteWorks reports whether the kernel knows MADV_POPULATE_WRITE, which evict
// needs.
func populateWriteWorks() bool {
	b, err := unix.Mmap(-1, 0, pageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return false
	}
	defer unix.Munmap(b)
	return unix.Madvise(b, unix.MADV_POPULATE_WRITE) == nil
}

// hardDecommit reports whether GODEBUG sets harddecommit, under which the runtime remaps
// freed heap pages itself.
func hardDecommit() bool {
	for _, kv := range strings.Split(os.Getenv("GODEBUG"), ",") {
		if k, v, _ := strings.Cut(kv, "="); k == "harddecommit" && v != "" && v != "0" {
			return true
		}
	}
	return false
}

// adopting runs f, an all-reduce o, on o.buf's adopted view when it is adopted (adoptIn),
// then puts the user's buffer back, with the result's shadow bytes (adoptOut).
func (g *group) adopting(o *op, f func(*op) error) error {
	if !g.inPlaceOK() && !g.hostInPlaceOK() {
		return f(o)
	}
	user := o.buf
	v, h, t := g.adoptIn(user)
	if v == nil {
		return f(o)
	}
	o.buf = v
	err := f(o)
	o.buf = user
	adoptOut(user, v, h, t)
	return err
}

// isAdopted reports whether b lies in one of this rank's adoptions.
func (g *group) isAdopted(b []byte) bool {
	m := g.shm
	if m == nil || m.arena == nil || len(b) == 0 {
		return false
	}
	m.heap.mu.Lock()
	defer m.heap.mu.Unlock()
	return m.adoptionOf(b) != nil
}

// adoptionOf is the adoption that b lies in: its pages inside the adoption's, its
// remapped pages inside the adoption's remapped ones; nil if none. The caller holds
// m.heap.mu.
func (m *shmRegion) adoptionOf(b []byte) *adoption {
	lo, hi, ilo, ihi := pageSpan(b)
	for _, a := range m.adopt.list {
		if a.lo <= lo && hi <= a.hi && a.ilo <= ilo && ihi <= a.ihi {
			return a
		}
	}
	return nil
}
