package gloo

import (
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// Note [Shared buffers]: buffers from AllocBuffer (the reducer's buckets) live in an arena
// that the ranks of a host share, so that an all-reduce among them reads the peers' buffers
// in place rather than copying every chunk into a slot and out again (Note [Shared memory]).
// Every peer's posted state must name this collective: a rank that issued something else
// fails it, as the slot ring's headers do.
//
// The arena is a second memfd the host's leader creates with the region, one part per
// member (Config.ShmArenaMiB), sent with it and mapped whole by every member. It is address
// space: a page takes memory once written, and FreeBuffer gives the pages back
// (MADV_REMOVE; where that fails it writes zeros instead), so a freed buffer reads as
// zeros. Each rank hands out its own part, first fit, page by page. The reducer allocates
// its buckets in the same order and sizes on every rank, so whether a bucket fits comes
// out the same everywhere; the all-reduce checks it
// anyway, below. At Close anonymous zero pages replace the arena (releaseArena): the
// memory goes, and a view of a buffer that outlives the group reads zeros, never faults.
//
// An all-reduce of more than DirectMaxBytes, when every rank shares the region, first posts
// in its line of the region: the offset and length of its buffer in its arena part and
// whether it is there, then state = seq<<2|1, and rings the others. Once every peer has
// posted for this seq: if all buffers are in their arenas and of one length, the ranks run
// in place; otherwise all of them run Note [Single copy] where the group agreed on it, the
// slot ring elsewhere, with nothing else changed. In place,
// rank r reduces chunk r of every buffer and writes the result into chunk r of every buffer
// (Note [One pass]; state seq<<2|3), and returns once every rank has done so: no rank may
// touch its buffer again while a peer still reads or writes it. Each chunk is computed by
// one rank and copied by it to the others, so every rank ends with the same bits. Waiting
// is the bell of Note [Shared memory], with its abort checks and Note [Stalls].

const pageSize = 4096

// arenaHeap is a first-fit allocator over one arena part, in pages.
type arenaHeap struct {
	mu     sync.Mutex
	free   []span      // sorted by offset, coalesced
	live   map[int]int // offset → length of the buffers handed out
	closed bool        // the group is closed: zero pages replaced the arena
}

type span struct{ off, n int }

// setArena installs the arena (all parts, part bytes each); nil leaves the region without.
func (m *shmRegion) setArena(arena []byte, part int) {
	if arena == nil || part <= 0 {
		return
	}
	m.arena, m.arenaLen = arena, part
	m.heap.free = []span{{0, part}}
	m.heap.live = map[int]int{}
}

// get hands out n bytes (rounded up to pages), first fit; ok is false when none is left.
func (h *arenaHeap) get(n int) (off int, ok bool) {
	n = (n + pageSize - 1) &^ (pageSize - 1)
	for i, s := range h.free {
		if s.n < n {
			continue
		}
		h.live[s.off] = n
		if s.n == n {
			h.free = append(h.free[:i], h.free[i+1:]...)
		} else {
			h.free[i] = span{s.off + n, s.n - n}
		}
		return s.off, true
	}
	return 0, false
}

// getHigh is get from the top of the part: the highest free pages that fit. Note
// [Adopted buffers] takes its pages there, so that the buckets, from the bottom, find the
// same room on every rank whatever each rank adopted.
func (h *arenaHeap) getHigh(n int) (off int, ok bool) {
	n = (n + pageSize - 1) &^ (pageSize - 1)
	for i := len(h.free) - 1; i >= 0; i-- {
		s := h.free[i]
		if s.n < n {
			continue
		}
		off = s.off + s.n - n
		h.live[off] = n
		if s.n == n {
			h.free = append(h.free[:i], h.free[i+1:]...)
		} else {
			h.free[i] = span{s.off, s.n - n}
		}
		return off, true
	}
	return 0, false
}

// put takes back the buffer at off and returns its length (0 if none was handed out there).
func (h *arenaHeap) put(off int) int {
	n, ok := h.live[off]
	if !ok {
		return 0
	}
	delete(h.live, off)
	i := sort.Search(len(h.free), func(i int) bool { return h.free[i].off > off })
	h.free = append(h.free, span{})
	copy(h.free[i+1:], h.free[i:])
	h.free[i] = span{off, n}
	// Coalesce with the next, then the previous.
	if i+1 < len(h.free) && h.free[i].off+h.free[i].n == h.free[i+1].off {
		h.free[i].n += h.free[i+1].n
		h.free = append(h.free[:i+1], h.free[i+2:]...)
	}
	if i > 0 && h.free[i-1].off+h.free[i-1].n == h.free[i].off {
		h.free[i-1].n += h.free[i].n
		h.free = append(h.free[:i], h.free[i+1:]...)
	}
	return n
}

// inPlaceOK reports whether all-reduces may run in place: every rank shares the region, and
// it has an arena.
func (g *group) inPlaceOK() bool {
	m := g.shm
	return m != nil && m.arena != nil && m.members == g.size
}

// hostInPlaceOK reports whether Note [Hierarchical]'s host phases may run in place (Note
// [Host phases in place]): the region has an arena and its members are this host's ranks.
func (g *group) hostInPlaceOK() bool { return g.hostShm && g.shm.arena != nil }

// sharedAlloc is AllocBuffer's work: arenaAlloc, or an error once the group has aborted
// (Note [Late ranks]).
func (g *group) sharedAlloc(dt procgroup.DType, count int) (any, error) {
	if err := g.allocAborted(); err != nil {
		return nil, err
	}
	return g.arenaAlloc(dt, count), nil
}

// arenaAlloc hands out count (> 0) elements of dt from this rank's arena part (Note
// [Shared buffers]); nil when the group has no arena, when no all-reduce would read it in
// place (the ranks neither all share it nor form Note [Hierarchical]'s hosts), when the
// part is full, or once the group has aborted (Note [Late ranks]).
func (g *group) arenaAlloc(dt procgroup.DType, count int) any {
	if !g.inPlaceOK() && !g.hostInPlaceOK() {
		return nil
	}
	m := g.shm
	if count > m.arenaLen/dt.Size() {
		return nil
	}
	m.heap.mu.Lock()
	defer m.heap.mu.Unlock()
	if m.heap.closed || g.allocAborted() != nil {
		return nil
	}
	off, ok := m.heap.get(count * dt.Size())
	if !ok {
		return nil
	}
	base := m.me*m.arenaLen + off
	return kernels.Typed(dt, m.arena[base:base+count*dt.Size():base+count*dt.Size()])
}

// Note [Late ranks]: a rank can stall inside an in-place all-reduce (descheduled,
// stopped, swapped out) while it writes its finished chunk into the peers' buffers, for
// longer than the collective's timeout. Its peers then time out and abort, and their
// callers see the error, free the buffers (FreeBuffer) or reuse them. When the late rank
// wakes it must neither go on writing nor report success. So:
//
//   - reduceBlocks checks for an abort (shmCheck: this group's, and every member's flag
//     in the region) before each block, and hostBroadcast before each piece: a late
//     rank writes at most the block it was stalled in, not the rest of its chunk;
//   - shmPhase checks for an abort also when every peer's mark is already past the
//     target, which is what a late rank finds on waking. The rank publishes its mark
//     before it reads the flags, and an aborting peer sets its flag towards this rank
//     (group.abort, once the abort frame is written to this rank's socket) before its
//     caller learns of the failure, so a rank that returns nil finished every write
//     before any peer's caller could touch its buffer again: nil still means the
//     result is complete. (A peer that gives up at the very moment the last mark
//     arrives fails while the others succeed, with whole results; only an agreement
//     round could make them all agree, and the group is aborted anyway.)
//   - an aborted group's AllocBuffer fails instead of handing out arena memory. A late
//     rank may still write up to one block into a buffer freed after the abort;
//     those pages are never handed out again, and Close replaces this rank's view of
//     the arena with zero pages (releaseArena). An error is better than falling back
//     to nil (an ordinary slice, which a late writer could not reach either): every
//     collective of the group fails from now on, and the caller learns why at once.
//
// A buffer the caller keeps after a failed all-reduce holds undefined bytes, as after
// any failed collective; a late rank may change them until the caller closes the group.

// allocAborted is AllocBuffer's error once the group has aborted (Note [Late ranks]).
func (g *group) allocAborted() error {
	select {
	case <-g.aborted:
		return fmt.Errorf("gloo: rank %d: AllocBuffer: the group has aborted, its shared memory is handed out no more: %w", g.rank, g.abortErr)
	default:
		return nil
	}
}

// FreeBuffer gives back a buffer from AllocBuffer; its pages read as zeros afterwards.
// Other buffers are ignored.
func (g *group) FreeBuffer(buf any) {
	b, _, _, err := kernels.Bytes(buf)
	if err != nil || len(b) == 0 || g.shm == nil || g.shm.arena == nil {
		return
	}
	m := g.shm
	off, ok := m.ownOffset(b)
	if !ok {
		return
	}
	m.heap.mu.Lock()
	defer m.heap.mu.Unlock()
	if m.heap.closed {
		return // the arena is zero pages now (releaseArena)
	}
	if n := m.heap.put(off); n > 0 {
		base := m.me*m.arenaLen + off
		if b := m.arena[base : base+n]; madvise(b, unix.MADV_REMOVE) != nil {
			// The pages stay: AllocBuffer promises zeros, so write them.
			clear(b)
		}
	}
}

// madvise is unix.Madvise; tests make it fail.
var madvise = unix.Madvise

// releaseArena ends the arena at Close: anonymous zero pages replace it, so that the
// memfd and its pages go, while slices of buffers still handed out (a bucket, a gradient
// view) read zeros instead of faulting. The address space stays reserved until the
// process exits. Adopted buffers stay the user's (endAdoptions).
func (m *shmRegion) releaseArena(aborted bool) {
	m.heap.mu.Lock()
	defer m.heap.mu.Unlock()
	if m.arena == nil || m.heap.closed {
		return
	}
	m.endAdoptions(aborted) // Note [Adopted buffers]: they outlive the group
	if m.adopt.fd >= 0 {
		unix.Close(m.adopt.fd)
		m.adopt.fd = -1
	}
	m.heap.closed = true
	if _, err := unix.MmapPtr(-1, 0, unsafe.Pointer(&m.arena[0]), uintptr(len(m.arena)),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_FIXED|unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err != nil {
		// Keep the shared mapping rather than leave a hole that live slices would fault in.
		return
	}
}

// ownOffset is b's offset in this rank's arena part; ok is false when b is not inside it.
func (m *shmRegion) ownOffset(b []byte) (int, bool) {
	if m.arena == nil || len(b) == 0 {
		return 0, false
	}
	start := uintptr(unsafe.Pointer(&m.arena[m.me*m.arenaLen]))
	p := uintptr(unsafe.Pointer(&b[0]))
	if p < start || p+uintptr(len(b)) > start+uintptr(m.arenaLen) {
		return 0, false
	}
	return int(p - start), true
}

// ownsShared reports whether b lies in this rank's arena part.
func (g *group) ownsShared(b []byte) bool {
	if g.shm == nil {
		return false
	}
	_, ok := g.shm.ownOffset(b)
	return ok
}

// shmAllReduce is the all-reduce over shared memory for messages above DirectMaxBytes:
// in place when every rank's buffer is in its arena, Note [Single copy] when the group
// reads its peers with process_vm_readv, the slot ring otherwise (Note [Shared buffers]).
func (g *group) shmAllReduce(o *op) error {
	vm := g.cmaFor(procgroup.OpAllReduce, len(o.buf))
	if !g.inPlaceOK() && !vm {
		return g.shmRingAllReduce(o)
	}
	// Every rank is a member, and its local index is its rank.
	inPlace, vm, err := g.postBuffer(o, o.buf, vm)
	switch {
	case err != nil:
		return err
	case inPlace:
		return g.inPlaceAllReduce(o)
	case vm:
		return g.cmaAllReduce(o)
	}
	return g.shmRingAllReduce(o)
}

// postBuffer posts b, the buffer of o its peers read (Note [Shared buffers], Note [Single
// copy]), among the region's members and waits until every member has posted, checking
// that each posted the same collective. inPlace: every member's buffer is in its arena,
// and m.peerBufs holds their views, by local index. vm (only when asked for, which every
// rank does alike): m.peerPID and m.peerAddr locate the members' buffers for
// process_vm_readv.
func (g *group) postBuffer(o *op, b []byte, vmAsked bool) (inPlace, vm bool, err error) {
	m := g.shm
	off, mine := m.ownOffset(b)
	p := m.post(m.me)
	*m.u64(p + 8) = uint64(off)
	*m.u64(p + 16) = uint64(len(b))
	flag := uint32(0)
	if mine {
		flag = postArena
	}
	if vmAsked && len(b) > 0 {
		flag |= postVM
		pid := m.pid
		if vmPIDHook != nil {
			pid = vmPIDHook(g, pid)
		}
		*m.u64(p + 32) = uint64(pid)
		*m.u64(p + 40) = uint64(uintptr(unsafe.Pointer(&b[0])))
	}
	*m.u32(p + 28) = uint32(o.dt)
	what := postWhat(o)
	*m.u64(p + 48) = what
	atomic.StoreUint32(m.u32(p+24), flag)
	if err := g.shmPhase(o.seq<<2 | 1); err != nil {
		return false, false, err
	}
	if stallHook != nil {
		stallHook(g, "postBuffer")
	}
	n := m.members
	if len(m.peerBufs) != n {
		m.peerBufs = make([][]byte, n) // once: collectives allocate nothing
		m.peerPID, m.peerAddr = make([]int, n), make([]uintptr, n)
	}
	inPlace, vm = mine, flag&postVM != 0
	for j := range n {
		if j == m.me {
			continue
		}
		q, rank := m.post(j), m.ranks[j]
		// A peer that skipped this collective and posted a later one satisfies every
		// phase wait; a correct peer cannot leave this one before this rank does.
		if st := atomic.LoadUint64(m.u64(q)); st>>2 != o.seq {
			return false, false, fmt.Errorf("%w: rank %d posted collective #%d in shared memory while this rank runs %v #%d (ranks issued different collectives?)",
				procgroup.ErrInvalidArgument, rank, st>>2, o.kind, o.seq)
		}
		pOff, pLen, pw := *m.u64(q + 8), *m.u64(q + 16), *m.u64(q + 48)
		f := atomic.LoadUint32(m.u32(q + 24))
		if pLen != uint64(len(b)) || procgroup.DType(*m.u32(q + 28)) != o.dt || pw != what {
			return false, false, fmt.Errorf("%w: rank %d posted %v (root %d) of %d bytes of %v for #%d in shared memory, this rank runs %v (root %d) of %d bytes of %v (ranks issued different collectives?)",
				procgroup.ErrInvalidArgument, rank, procgroup.CollectiveOp(pw>>32), int32(pw), pLen, procgroup.DType(*m.u32(q + 28)), o.seq,
				o.kind, int32(what), len(b), o.dt)
		}
		if f&postVM == 0 {
			vm = false
		} else {
			m.peerPID[j], m.peerAddr[j] = int(*m.u64(q + 32)), uintptr(*m.u64(q + 40))
		}
		if f&postArena == 0 {
			inPlace = false
			m.peerBufs[j] = nil
			continue
		}
		if pOff > uint64(m.arenaLen) || pLen > uint64(m.arenaLen)-pOff {
			return false, false, fmt.Errorf("%w: rank %d posted a buffer of %d bytes at %d of its arena for collective #%d, this rank has %d bytes (ranks issued different collectives?)",
				procgroup.ErrInvalidArgument, rank, pLen, pOff, o.seq, len(b))
		}
		at := j*m.arenaLen + int(pOff)
		m.peerBufs[j] = m.arena[at : at+len(b) : at+len(b)]
	}
	return inPlace, vm, nil
}

// postWhat is the collective a post names besides its sequence number: its kind and,
// for Broadcast, its root.
func postWhat(o *op) uint64 {
	w := uint64(o.kind) << 32
	if o.kind == procgroup.OpBroadcast {
		w |= uint64(uint32(o.root))
	}
	return w
}

// inPlaceAllReduce is Note [Shared buffers]'s in-place all-reduce, once every rank has
// posted its buffer in its arena: one pass (Note [One pass]), each rank reducing its own
// chunk from all the buffers, a block at a time, and writing each finished block into
// every buffer.
func (g *group) inPlaceAllReduce(o *op) error {
	es := o.dt.Size()
	g.setChunks(len(o.buf)/es, es)
	g.lastPath = "shm-inplace"
	if err := g.reduceBlocks(o, g.chunk(o.buf, g.rank), g.offs[g.rank], true); err != nil {
		return err
	}
	return g.shmPhase(o.seq<<2 | 3)
}

// Note [One pass]: the in-place all-reduce over the arena's views reads every byte of
// every buffer once and writes it once: rank r reduces block after block of its chunk r,
// from its own buffer and then each peer's in rank order, and copies each finished block
// into chunk r of every peer's buffer while the block is still in cache, so the copy reads
// nothing from memory and its stores hit lines the reduction has just read. That is 2
// bytes of traffic per message byte per rank, against 5(n-1)/n for a reduce-scatter then
// an all-gather (a second pass that reads the peers' chunks back from memory), and one
// phase wait instead of two. It is safe without a wait between blocks: chunk r of any
// buffer is read and written by rank r alone, from the post (every buffer is final) until
// the last phase (every chunk is everywhere). A block of reduceBlock bytes for each of the
// n buffers stays in L2. On the development VM (2 ranks, 16-256 MiB) the one pass gave
// 1.6-1.9 times the two passes' busbw; 16, 32, 64 and 256 KiB blocks did not differ beyond
// the noise.

// reduceBlock is the block of Note [One pass], in bytes (a multiple of every element size).
const reduceBlock = 32 << 10

// reduceBlocks is the block loop of Notes [One pass] and [Host phases in place]: own,
// bytes at.. of this rank's buffer, ends as o.rop of those bytes over every member's
// buffer (g.shm.peerBufs, by local index: rank order), a block at a time, divided by the
// group's size for Avg. With bcast each finished block is also written into every peer's
// buffer while it is still in cache. It stops at the first block that finds the group
// aborted (Note [Late ranks]).
func (g *group) reduceBlocks(o *op, own []byte, at int, bcast bool) error {
	m := g.shm
	for a := 0; a < len(own); a += reduceBlock {
		if stallHook != nil {
			stallHook(g, "reduceBlocks")
		}
		if err := g.shmCheck(); err != nil {
			return err
		}
		b := min(a+reduceBlock, len(own))
		for j, p := range m.peerBufs {
			if j != m.me {
				kernels.Reduce(o.dt, o.rop, own[a:b], p[at+a:at+b])
			}
		}
		if o.rop == procgroup.Avg {
			kernels.Divide(o.dt, own[a:b], g.size)
		}
		if bcast {
			for j, p := range m.peerBufs {
				if j != m.me {
					copy(p[at+a:at+b], own[a:b])
				}
			}
		}
	}
	return nil
}

// stallHook, nil outside tests, runs before each block of reduceBlocks and each piece
// of hostBroadcast, and once every member has posted in postBuffer (at names which): a test holds a rank there to make it late (Note
// [Late ranks]).
var stallHook func(g *group, at string)

// Note [Host phases in place]: in Note [Hierarchical], when the region's members are
// exactly this host's ranks of the group and every one's buffer is in its arena, the two
// host phases run in place instead of as rings through the slots. The members post as for
// Note [Shared buffers]; local rank l then reduces chunk l of every member's buffer into
// its own chunk l, a block at a time; the middle ring all-reduces that chunk across hosts;
// then local rank l copies it into chunk l of every member's buffer, and all wait once
// for each other. With Note [Hierarchical pipeline] the same runs piece by piece, chunk l
// being that of the piece. No wait is needed between: chunk l of any buffer (of any
// piece) is read and written only by local rank l, from the post to the last wait. Each host decides alone (its
// members see the same posts), since the middle ring does not care how a host formed its
// sum. Across hosts the reducer's buckets then come from the arena too (arenaAlloc), so
// DDP takes this path. A host phase then reads each byte of the message once and writes
// each chunk once, where a ring copies it into a slot and out again at every step.

// hierPost posts o's buffer among the host's members for Note [Host phases in place]; it
// reports whether the host phases run in place.
func (g *group) hierPost(o *op) (bool, error) {
	if !g.hostInPlaceOK() {
		return false, nil
	}
	inPlace, _, err := g.postBuffer(o, o.buf, false)
	return inPlace, err
}

// hostReduce is the first host phase of Note [Host phases in place], for b, the piece of
// o.buf at byte at (Note [Hierarchical pipeline]) whose local chunks are in g.local: this
// rank's local chunk of b ends as its sum over the host's buffers (o.rop, never Avg here).
// After an abort it stops short and returns the abort's error, which hierPipeline
// must not pass over: the unreduced chunk would go to the middle ring, whose peers on
// other hosts may not have seen the abort yet, and they would sum it as if complete.
func (g *group) hostReduce(o *op, b []byte, at int) error {
	v := &g.local // its positions are the members in rank order, as their local indices
	return g.reduceBlocks(o, v.chunk(b, v.pos), at+v.offs[v.ids[v.pos]], false)
}

// hostBroadcast is the last host phase of Note [Host phases in place], for the piece b at
// at as in hostReduce: this rank's local chunk of b, final, goes into every member's
// buffer. The members wait for each other once, after the last piece. After an abort it
// writes nothing (Note [Late ranks]); the last phase then fails.
func (g *group) hostBroadcast(b []byte, at int) error {
	if stallHook != nil {
		stallHook(g, "hostBroadcast")
	}
	if err := g.shmCheck(); err != nil {
		return err
	}
	m, v := g.shm, &g.local
	own := v.chunk(b, v.pos)
	at += v.offs[v.ids[v.pos]]
	for j, p := range m.peerBufs {
		if j != m.me {
			copy(p[at:at+len(own)], own)
		}
	}
	return nil
}

// shmPhase publishes this rank's state, rings the peers, and waits until every peer's
// state has reached it. It fails if the group has aborted, even when every peer's state
// had reached it already (Note [Late ranks]).
func (g *group) shmPhase(state uint64) error {
	m := g.shm
	atomic.StoreUint64(m.u64(m.post(m.me)), state)
	for i := range m.members {
		if i != m.me {
			m.ring(i)
		}
	}
	bell := m.u32(m.rankArea(m.me) + shmBell)
	for {
		v := atomic.LoadUint32(bell)
		done := true
		for i := range m.members {
			if i != m.me && atomic.LoadUint64(m.u64(m.post(i))) < state {
				done = false
				break
			}
		}
		if done {
			return g.shmCheck()
		}
		if err := g.shmWait(v); err != nil {
			return err
		}
	}
}

// The flags of a post (Note [Shared buffers]): the buffer is in the poster's arena; the
// buffer may be read with process_vm_readv at the posted pid and address (Note [Single
// copy]).
const (
	postArena = 1
	postVM    = 2
)
