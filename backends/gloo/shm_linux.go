package gloo

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// Note [Shared memory]: ranks on one host that reach each other over Unix sockets share one
// memory region, and the ring all-reduce moves its data through it: the sender copies a
// segment into a slot of the (sender → receiver) channel and the receiver reduces (or
// copies) straight out of the slot into its buffer — one copy and no syscall per segment,
// against two copies and two syscalls over a socket. The sockets stay: they carry the
// handshake, the other collectives, abort frames, and the liveness probes of Note [Stalls].
//
// Setup (after the mesh is authenticated, before the worker starts): the host's leader
// (its lowest rank) creates the region as a memfd and hands the descriptor to each
// member — every same-host rank whose connection to the leader is a Unix socket — with
// SCM_RIGHTS in a setup frame listing the members and the layout. Nothing is mapped
// before the peer has authenticated; the region has no name anyone else could open, and
// it disappears with the last process that maps it.
//
// Layout: a header line; per member (local index i) a rank area: bell (futex word) and
// sleeping flag on separate cache lines, then its abort record (lost rank, reason); then a
// channel per ordered pair (i, j): producer count, consumer count and abort flag (own cache
// lines), a (seq, len) header per slot, and ShmSlots slots of ShmSlotSize bytes.
//
// Waiting: a worker that can make no progress reads its bell, re-checks its conditions and
// sleeps on the bell (FUTEX_WAIT, bounded by Config.PollInterval so Note [Stalls] still
// runs); whoever publishes a segment or frees a slot adds to the owner's bell and wakes it
// if it sleeps. Since both the condition and the bell are re-read after the sleeping flag
// is set, no wake-up is lost. It polls the bell first, since a futex wake-up costs tens of
// µs here, calling sched_yield now and then (at every poll when the host's members
// outnumber the CPUs: pure spinning would steal the time of the rank it waits for).
//
// Aborts: the aborting rank writes its record and sets the abort flag of its channel to
// each peer that also got the abort frame on the socket (so shared memory tells no more
// than the socket would), then rings the bells; a waiter checks its incoming flags on every
// wake-up. A peer that dies without a word is found by the socket probe after at most one
// PollInterval.

const (
	shmLine      = 64
	shmHeaderLen = shmLine
	maxShmSlot   = 64 << 20
	maxShmSlots  = 64
	maxShmRanks  = 1024

	kindShm = 3 // setup frame; accepted only during setup

	// rank area offsets
	shmBell     = 0
	shmSleeping = shmLine
	shmLost     = 2 * shmLine
	shmReason   = shmLost + 8 // uint32 length, then the bytes
	shmRankLen  = (shmReason + 4 + maxAbortLen + shmLine - 1) &^ (shmLine - 1)

	// channel offsets
	shmProd      = 0
	shmCons      = shmLine
	shmAbortFlag = 2 * shmLine
	shmSlotHdrs  = 3 * shmLine

	futexWait = 0
	futexWake = 1

	// Waiting (Note [Shared memory]): a waiter polls its bell shmSpins times, calling
	// sched_yield every shmYieldEvery polls, before it sleeps on the futex; with more
	// members than CPUs it only yields, shmSpinsOversubscribed times. A futex wake-up
	// costs tens of µs (a 4 KiB all-reduce is one or two of them); the yields hand the
	// CPU to a peer that waits for it instead of burning it. Polling first takes a 4 KiB
	// all-reduce on 2 CPUs from 57 to 20-32 µs at n=2, and from 230 to 94 µs at n=4.
	shmSpins               = 5000
	shmYieldEvery          = 100
	shmSpinsOversubscribed = 150
)

// shmRegion is this rank's view of its host's region.
type shmRegion struct {
	mu  sync.Mutex // guards mem against release while abort writes into it
	mem []byte     // nil once released

	members int   // L
	slot    int   // S
	slots   int   // K
	me      int   // this rank's local index
	local   []int // local index by rank, -1 for ranks not in the region
	ranks   []int // rank by local index
	chanLen int
	spins   int // bell polls before sleeping
	yield   int // sched_yield every yield polls (0: never)

	// worker-only
	prod []uint64 // by local index: segments this rank published to that member
	cons []uint64 // by local index: segments this rank consumed from that member

	// Note [Shared buffers]: every member's arena, arenaLen bytes each, back to back; nil
	// when the host has none. heap hands out this rank's.
	arena    []byte
	arenaLen int
	heap     arenaHeap
	peerBufs [][]byte // worker-only: the peers' buffers of an in-place all-reduce
	peerPID  []int    // worker-only: the peers' pids and buffer addresses (Note [Single copy])
	peerAddr []uintptr
	pid      int        // this process's, posted for process_vm_readv
	vmCookie uint64     // this rank's word for the peers' probe (Note [Single copy])
	adopt    adoptTable // Note [Adopted buffers], guarded by heap.mu
}

func shmLayout(members, slot, slots int) (chanLen, total int) {
	hdr := (shmSlotHdrs + 8*slots + shmLine - 1) &^ (shmLine - 1)
	chanLen = hdr + slots*slot
	total = shmHeaderLen + members*shmRankLen + members*members*chanLen + members*shmLine
	return chanLen, total
}

// post is member i's line of Note [Shared buffers]: its state, then the offset and length
// of its buffer in its arena, the flags (postArena, postVM) and the element type, and with
// postVM its pid and the buffer's address; then the collective's kind and root (postWhat).
func (m *shmRegion) post(i int) int {
	return shmHeaderLen + m.members*shmRankLen + m.members*m.members*m.chanLen + i*shmLine
}

func (m *shmRegion) rankArea(i int) int { return shmHeaderLen + i*shmRankLen }

func (m *shmRegion) channel(from, to int) int {
	return shmHeaderLen + m.members*shmRankLen + (from*m.members+to)*m.chanLen
}

func (m *shmRegion) u32(off int) *uint32 { return (*uint32)(unsafe.Pointer(&m.mem[off])) }
func (m *shmRegion) u64(off int) *uint64 { return (*uint64)(unsafe.Pointer(&m.mem[off])) }

func (m *shmRegion) slotHdr(ch, i int) int { return ch + shmSlotHdrs + 8*i }

func (m *shmRegion) slotData(ch, i, n int) []byte {
	a := ch + m.chanLen - (m.slots-i)*m.slot
	return m.mem[a : a+n : a+n]
}

// ring adds to member i's bell and wakes it if it sleeps.
func (m *shmRegion) ring(i int) {
	bell := m.u32(m.rankArea(i) + shmBell)
	atomic.AddUint32(bell, 1)
	if atomic.LoadUint32(m.u32(m.rankArea(i)+shmSleeping)) != 0 {
		unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(bell)), futexWake, 1, 0, 0, 0)
	}
}

// setupShm runs the setup of Note [Shared memory]; it leaves g.shm nil when the region
// cannot or need not be used.
func (g *group) setupShm(ctx context.Context) error {
	if g.cfg.SharedMemory == ShmOff || g.size == 1 {
		return nil
	}
	leader := g.rank
	for j := 0; j < g.rank; j++ {
		if g.hostIDs[j] == g.cfg.HostID {
			leader = j
			break
		}
	}
	if leader == g.rank {
		var members []int
		for j := g.rank + 1; j < g.size; j++ {
			if g.hostIDs[j] == g.cfg.HostID && g.isUnix(j) && g.shmWanted[j] { // Note [Agreement]
				members = append(members, j)
			}
		}
		if len(members) == 0 {
			return nil
		}
		return g.leadShm(append([]int{g.rank}, members...))
	}
	if !g.isUnix(leader) || !g.shmWanted[leader] {
		return nil
	}
	return g.joinShm(ctx, leader)
}

func (g *group) isUnix(j int) bool {
	_, ok := g.peers[j].conn.(*net.UnixConn)
	return ok
}

// leadShm creates the region for members (members[0] is this rank) and sends it to the
// others. A region that cannot be created is not an error: the members are told to use
// the sockets.
func (g *group) leadShm(members []int) error {
	S, K, L := g.cfg.ShmSlotSize, g.cfg.ShmSlots, len(members)
	chanLen, total := shmLayout(L, S, K)
	fd, mem, err := -1, []byte(nil), error(nil)
	if testShmCreate != nil {
		err = testShmCreate(g.cfg.HostID)
	}
	if err == nil {
		fd, mem, err = createShm(total)
	}
	if err != nil {
		g.log.Warn("gloo: no shared memory, same-host data goes over Unix sockets", zap.Error(err))
		L = 0
	}
	if fd >= 0 {
		defer syscall.Close(fd)
	}
	// Note [Shared buffers]: the arena, one part per member, sent with the region.
	arenaMiB, afd := 0, -1
	var arena []byte
	if L > 0 && g.cfg.ShmArenaMiB > 0 {
		afd, arena, err = createShm(L * g.cfg.ShmArenaMiB << 20)
		if err != nil {
			g.log.Warn("gloo: no shared arena, buckets stay in private memory", zap.Error(err))
		} else {
			arenaMiB = g.cfg.ShmArenaMiB
			defer syscall.Close(afd)
		}
	}
	payload := make([]byte, 16+4*L)
	binary.LittleEndian.PutUint32(payload[0:], uint32(L))
	binary.LittleEndian.PutUint32(payload[4:], uint32(S))
	binary.LittleEndian.PutUint32(payload[8:], uint32(K))
	binary.LittleEndian.PutUint32(payload[12:], uint32(arenaMiB))
	for i, r := range members[:L] {
		binary.LittleEndian.PutUint32(payload[16+4*i:], uint32(r))
	}
	frame := make([]byte, frameHeaderLen+len(payload))
	putHeader(frame, kindShm, 0, len(payload))
	copy(frame[frameHeaderLen:], payload)
	var oob []byte
	switch {
	case L > 0 && arenaMiB > 0:
		oob = syscall.UnixRights(fd, afd)
	case L > 0:
		oob = syscall.UnixRights(fd)
	}
	for _, j := range members[1:] {
		c := g.peers[j].conn.(*net.UnixConn)
		c.SetWriteDeadline(time.Now().Add(g.cfg.HandshakeTimeout))
		n, _, err := c.WriteMsgUnix(frame, oob, nil)
		if err == nil && n < len(frame) {
			_, err = c.Write(frame[n:])
		}
		c.SetWriteDeadline(time.Time{})
		if err != nil {
			if mem != nil {
				syscall.Munmap(mem)
			}
			if arena != nil {
				syscall.Munmap(arena)
			}
			return fmt.Errorf("send region to rank %d: %w", j, err)
		}
	}
	if L == 0 {
		return nil
	}
	g.shm = newShmRegion(mem, members, g.size, g.rank, S, K, chanLen)
	g.shm.setArena(arena, arenaMiB<<20)
	g.adoptSetup(afd)
	return nil
}

// joinShm receives the region from the host's leader.
func (g *group) joinShm(ctx context.Context, leader int) error {
	c := g.peers[leader].conn.(*net.UnixConn)
	deadline := time.Now().Add(g.cfg.HandshakeTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	c.SetReadDeadline(deadline)
	defer c.SetReadDeadline(time.Time{})
	var hdr [frameHeaderLen]byte
	oob := make([]byte, syscall.CmsgSpace(4*4))
	n, oobn, _, _, err := c.ReadMsgUnix(hdr[:], oob)
	var fds []int
	if err == nil && oobn > 0 {
		fds, err = parseRights(oob[:oobn])
	}
	defer func() {
		for _, fd := range fds {
			syscall.Close(fd)
		}
	}()
	if err != nil {
		return fmt.Errorf("from rank %d: %w", leader, err)
	}
	if n < frameHeaderLen {
		if _, err := readFull(c, hdr[n:]); err != nil {
			return fmt.Errorf("from rank %d: %w", leader, err)
		}
	}
	if hdr[0] != kindShm || hdr[1]|hdr[2]|hdr[3] != 0 {
		return fmt.Errorf("from rank %d: %w: want a shared-memory setup frame, got kind %d", leader, errBadFrame, hdr[0])
	}
	plen := binary.LittleEndian.Uint64(hdr[8:])
	if plen < 16 || plen > uint64(16+4*min(g.size, maxShmRanks)) || (plen-16)%4 != 0 {
		return fmt.Errorf("from rank %d: %w: setup payload of %d bytes", leader, errBadFrame, plen)
	}
	payload := make([]byte, plen)
	if _, err := readFull(c, payload); err != nil {
		return fmt.Errorf("from rank %d: %w", leader, err)
	}
	L := int(binary.LittleEndian.Uint32(payload[0:]))
	S := int(binary.LittleEndian.Uint32(payload[4:]))
	K := int(binary.LittleEndian.Uint32(payload[8:]))
	if L == 0 {
		return nil // the leader has no region: sockets only
	}
	if uint64(16+4*L) != plen || L < 2 || S < 64 || S > maxShmSlot || S%64 != 0 || K < 1 || K > maxShmSlots {
		return fmt.Errorf("from rank %d: %w: bad layout (members %d, slot %d, slots %d)", leader, errBadFrame, L, S, K)
	}
	members := make([]int, L)
	me := -1
	for i := range members {
		r := int(binary.LittleEndian.Uint32(payload[16+4*i:]))
		if r >= g.size || (i > 0 && r <= members[i-1]) {
			return fmt.Errorf("from rank %d: %w: bad member list", leader, errBadFrame)
		}
		members[i] = r
		if r == g.rank {
			me = i
		}
	}
	if members[0] != leader || me < 0 {
		return fmt.Errorf("from rank %d: %w: member list %v lacks it or this rank", leader, errBadFrame, members)
	}
	arenaMiB := int(binary.LittleEndian.Uint32(payload[12:]))
	if arenaMiB > maxShmArenaMiB {
		return fmt.Errorf("from rank %d: %w: shared arena of %d MiB", leader, errBadFrame, arenaMiB)
	}
	if want := 1 + min(arenaMiB, 1); len(fds) != want {
		return fmt.Errorf("from rank %d: %w: %d descriptors with the setup frame, want %d", leader, errBadFrame, len(fds), want)
	}
	chanLen, total := shmLayout(L, S, K)
	var st syscall.Stat_t
	if err := syscall.Fstat(fds[0], &st); err != nil {
		return fmt.Errorf("region from rank %d: %w", leader, err)
	}
	if st.Size != int64(total) {
		return fmt.Errorf("from rank %d: %w: region of %d bytes, layout needs %d", leader, errBadFrame, st.Size, total)
	}
	var arena []byte
	if arenaMiB > 0 {
		alen := L * arenaMiB << 20
		if err := syscall.Fstat(fds[1], &st); err != nil {
			return fmt.Errorf("arena from rank %d: %w", leader, err)
		}
		if st.Size != int64(alen) {
			return fmt.Errorf("from rank %d: %w: arena of %d bytes, want %d", leader, errBadFrame, st.Size, alen)
		}
		if arena, err = syscall.Mmap(fds[1], 0, alen, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED); err != nil {
			return fmt.Errorf("map arena from rank %d: %w", leader, err)
		}
	}
	mem, err := syscall.Mmap(fds[0], 0, total, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		if arena != nil {
			syscall.Munmap(arena)
		}
		return fmt.Errorf("map region from rank %d: %w", leader, err)
	}
	g.shm = newShmRegion(mem, members, g.size, g.rank, S, K, chanLen)
	g.shm.setArena(arena, arenaMiB<<20)
	afd := -1
	if arena != nil {
		afd = fds[1]
	}
	g.adoptSetup(afd)
	return nil
}

func parseRights(oob []byte) ([]int, error) {
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	for i := range msgs {
		f, err := syscall.ParseUnixRights(&msgs[i])
		if err == nil {
			fds = append(fds, f...)
		}
	}
	return fds, nil
}

func readFull(c net.Conn, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := c.Read(b[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// shmName names the memfds of the region and the arena (in /proc/PID/maps).
const shmName = "goddp-gloo"

func createShm(size int) (int, []byte, error) {
	fd, err := unix.MemfdCreate(shmName, unix.MFD_CLOEXEC)
	if err != nil {
		return -1, nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err := syscall.Ftruncate(fd, int64(size)); err != nil {
		syscall.Close(fd)
		return -1, nil, fmt.Errorf("size region: %w", err)
	}
	mem, err := syscall.Mmap(fd, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		syscall.Close(fd)
		return -1, nil, fmt.Errorf("map region: %w", err)
	}
	return fd, mem, nil
}

func newShmRegion(mem []byte, members []int, size, rank, S, K, chanLen int) *shmRegion {
	m := &shmRegion{mem: mem, members: len(members), slot: S, slots: K, chanLen: chanLen,
		local: make([]int, size), ranks: members,
		prod: make([]uint64, len(members)), cons: make([]uint64, len(members)), pid: os.Getpid()}
	for i := range m.local {
		m.local[i] = -1
	}
	for i, r := range members {
		m.local[r] = i
		if r == rank {
			m.me = i
		}
	}
	// Note [Shared memory] (waiting): spin, yielding the CPU now and then, before sleeping.
	if len(members) <= runtime.NumCPU() {
		m.spins, m.yield = shmSpins, shmYieldEvery
	} else {
		m.spins, m.yield = shmSpinsOversubscribed, 1
	}
	return m
}

// releaseShm unmaps the region; the worker and writers must have exited.
func (g *group) releaseShm() {
	m := g.shm
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mem != nil {
		syscall.Munmap(m.mem)
		m.mem = nil
	}
	m.releaseArena(g.allocAborted() != nil)
}

// shmAbort tells peer (if it shares the region) that this rank aborts (Note [Shared
// memory]).
func (g *group) shmAbort(peer, lost int, reason string) {
	m := g.shm
	if m == nil || m.local[peer] < 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mem == nil {
		return
	}
	ra := m.rankArea(m.me)
	if atomic.LoadUint32(m.u32(ra+shmLost+4)) == 0 { // record not written yet
		atomic.StoreUint32(m.u32(ra+shmLost), uint32(int32(lost)))
		n := copy(m.mem[ra+shmReason+4:ra+shmReason+4+maxAbortLen], reason)
		atomic.StoreUint32(m.u32(ra+shmReason), uint32(n))
		atomic.StoreUint32(m.u32(ra+shmLost+4), 1)
	}
	atomic.StoreUint32(m.u32(m.channel(m.me, m.local[peer])+shmAbortFlag), 1)
	m.ring(m.local[peer])
}

// shmWake wakes this rank's worker if it sleeps on its bell.
func (g *group) shmWake() {
	m := g.shm
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mem != nil {
		m.ring(m.me)
	}
}

// shmCheck reports an abort of this group or of a peer that told us through the region.
func (g *group) shmCheck() error {
	select {
	case <-g.aborted:
		return g.abortErr
	default:
	}
	m := g.shm
	for i, r := range m.ranks {
		if i == m.me || atomic.LoadUint32(m.u32(m.channel(i, m.me)+shmAbortFlag)) == 0 {
			continue
		}
		ra := m.rankArea(i)
		lost := int(int32(atomic.LoadUint32(m.u32(ra + shmLost))))
		n := min(int(atomic.LoadUint32(m.u32(ra+shmReason))), maxAbortLen)
		reason := string(m.mem[ra+shmReason+4 : ra+shmReason+4+n])
		if lost >= 0 && lost < g.size {
			return &PeerLostError{Rank: lost, Host: g.hosts[lost], Reporter: r, Err: errors.New(reason)}
		}
		return fmt.Errorf("%w by rank %d: %s", procgroup.ErrAborted, r, reason)
	}
	return nil
}

// shmWait waits until this rank's bell differs from v (or PollInterval passes), then
// checks for aborts; on a timeout it also runs Note [Stalls].
func (g *group) shmWait(v uint32) error {
	m := g.shm
	ra := m.rankArea(m.me)
	bell := m.u32(ra + shmBell)
	for i := 0; i < m.spins; i++ {
		if atomic.LoadUint32(bell) != v {
			return g.shmCheck()
		}
		if m.yield > 0 && i%m.yield == m.yield-1 {
			unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
		}
	}
	sleeping := m.u32(ra + shmSleeping)
	atomic.StoreUint32(sleeping, 1)
	ts := unix.NsecToTimespec(int64(g.cfg.PollInterval))
	_, _, errno := unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(bell)), futexWait, uintptr(v),
		uintptr(unsafe.Pointer(&ts)), 0, 0)
	atomic.StoreUint32(sleeping, 0)
	if err := g.shmCheck(); err != nil {
		return err
	}
	if errno == unix.ETIMEDOUT {
		return g.stalled()
	}
	return nil
}

// shmHolds reports whether ranks are exactly the members of this rank's region.
func (g *group) shmHolds(ranks []int) bool {
	m := g.shm
	if m == nil || m.members != len(ranks) {
		return false
	}
	for _, r := range ranks {
		if m.local[r] < 0 {
			return false
		}
	}
	return true
}

// useShmRing reports whether the ring all-reduce runs over shared memory.
func (g *group) useShmRing() bool {
	// Every rank must decide alike: a rank whose ring neighbours share its region while
	// theirs do not would wait on slots that they fill over the sockets. So the ring runs
	// over shared memory only when the whole group shares one region.
	m := g.shm
	return m != nil && m.members == g.size
}

// shmRingAllReduce is the ring of Note [Ring] over shared memory, run inline by the worker.
func (g *group) shmRingAllReduce(o *op) error {
	es := o.dt.Size()
	g.setChunks(len(o.buf)/es, es)
	return g.shmRing(o, o.buf, &g.flat, 0, 2*g.size-2)
}

// shmRing runs stream steps t0 … t1-1 of ring v (all of whose ranks share the region) over
// w through the slots. Both halves of the ring form one stream per direction: this rank
// sends chunks r-1-t and receives chunks r-2-t for t = 0 … 2n-3; stream chunk t < n-1 is
// reduced into w (the reduce-scatter), the others are copied (the all-gather). Steps 0 …
// n-2 alone are the reduce-scatter, n-1 … 2n-3 alone the all-gather. Outgoing chunk t+1
// is incoming chunk t after processing, so its segment a may go once incoming segment a of
// chunk t is done. An all-gather segment may only land in w once the same bytes, sent n-1
// chunks earlier, have been copied out (before t0 they all were: a send copies into its
// slot at once). The loop sends whatever is ready while a slot is free, processes whatever
// has arrived, and sleeps on its bell when neither can move.
func (g *group) shmRing(o *op, w []byte, v *ringView, t0, t1 int) error {
	m := g.shm
	n, r := v.n, v.pos // Note [Ring order]: positions, and chunks by position
	ni, pi := m.local[v.ranks[(r+1)%n]], m.local[v.ranks[(r+n-1)%n]]
	out, in := m.channel(m.me, ni), m.channel(pi, m.me)
	outProd, outCons := m.u64(out+shmProd), m.u64(out+shmCons)
	inProd, inCons := m.u64(in+shmProd), m.u64(in+shmCons)
	seq := uint32(o.seq)
	S, K := m.slot, uint64(m.slots)
	bell := m.u32(m.rankArea(m.me) + shmBell)
	outA, inA := 0, 0
	// skip moves a cursor past empty chunks (count < n); both sides skip the same ones.
	skip := func(t, off int) int {
		for t < t1 && len(v.chunk(w, r-off-t)) == 0 {
			t++
		}
		return t
	}
	outT, inT := skip(t0, 1), skip(t0, 2)
	for outT < t1 || inT < t1 {
		bv := atomic.LoadUint32(bell)
		moved := false
		// Send what is ready while slots are free.
		for outT < t1 && (outT == t0 || inT > outT-1 || (inT == outT-1 && inA > outA)) {
			p := m.prod[ni]
			if p-atomic.LoadUint64(outCons) >= K {
				break
			}
			c := v.chunk(w, r-1-outT)
			l := min(S, len(c)-outA)
			i := int(p % K)
			copy(m.slotData(out, i, l), c[outA:outA+l])
			h := m.slotHdr(out, i)
			*m.u32(h) = seq
			*m.u32(h + 4) = uint32(l)
			m.prod[ni] = p + 1
			atomic.StoreUint64(outProd, p+1)
			m.ring(ni)
			moved = true
			if outA += l; outA == len(c) {
				outT, outA = skip(outT+1, 1), 0
			}
		}
		// Process what has arrived.
		for inT < t1 {
			cn := m.cons[pi]
			if atomic.LoadUint64(inProd) <= cn {
				break
			}
			if ag := inT - (n - 1); ag >= t0 && (outT < ag || (outT == ag && outA <= inA)) {
				break // its bytes are not copied out yet
			}
			c := v.chunk(w, r-2-inT)
			l := min(S, len(c)-inA)
			i := int(cn % K)
			h := m.slotHdr(in, i)
			if hs, hl := *m.u32(h), *m.u32(h + 4); hs != seq || int(hl) != l {
				return fmt.Errorf("%w: rank %d sent %d bytes for collective #%d through shared memory, this rank expects %d bytes for #%d (ranks issued different collectives?)",
					procgroup.ErrInvalidArgument, m.ranks[pi], hl, hs, l, seq)
			}
			seg, slot := c[inA:inA+l], m.slotData(in, i, l)
			if inT < n-1 {
				kernels.Reduce(o.dt, o.rop, seg, slot)
				if inT == n-2 && o.rop == procgroup.Avg {
					kernels.Divide(o.dt, seg, n)
				}
			} else {
				copy(seg, slot)
			}
			m.cons[pi] = cn + 1
			atomic.StoreUint64(inCons, cn+1)
			m.ring(pi)
			moved = true
			if inA += l; inA == len(c) {
				inT, inA = skip(inT+1, 2), 0
			}
		}
		if !moved {
			if err := g.shmWait(bv); err != nil {
				return err
			}
		}
	}
	return nil
}

// useShmDirect reports whether a direct all-reduce of this many bytes runs over shared
// memory: every rank shares the region and the message fits in one slot.
func (g *group) useShmDirect(bytes int) bool {
	m := g.shm
	return m != nil && m.members == g.size && bytes <= m.slot
}

// shmDirectAllReduce is directAllReduce over shared memory, for small messages: this rank
// copies its buffer into a slot to every peer, then combines the n buffers, copied from
// the slots, in Note [One association] (so every rank computes the same bits). All ranks
// are members, so local index = rank.
func (g *group) shmDirectAllReduce(o *op) error {
	m := g.shm
	n, r, seq := g.size, g.rank, uint32(o.seq)
	l, K := len(o.buf), uint64(m.slots)
	bell := m.u32(m.rankArea(m.me) + shmBell)
	for j := 1; j < n; j++ {
		d := (r + j) % n
		ch := m.channel(r, d)
		for {
			v := atomic.LoadUint32(bell)
			p := m.prod[d]
			if p-atomic.LoadUint64(m.u64(ch+shmCons)) < K {
				i := int(p % K)
				copy(m.slotData(ch, i, l), o.buf)
				h := m.slotHdr(ch, i)
				*m.u32(h) = seq
				*m.u32(h + 4) = uint32(l)
				m.prod[d] = p + 1
				atomic.StoreUint64(m.u64(ch+shmProd), p+1)
				m.ring(d)
				break
			}
			if err := g.shmWait(v); err != nil {
				return err
			}
		}
	}
	t := &g.tree // Note [One association]
	t.reset(o.dt, o.rop, n, l)
	for _, j := range g.ring {
		b := t.slot()
		if j == r {
			copy(b, o.buf)
			t.push(b)
			continue
		}
		ch := m.channel(j, r)
		for {
			v := atomic.LoadUint32(bell)
			c := m.cons[j]
			if atomic.LoadUint64(m.u64(ch+shmProd)) > c {
				i := int(c % K)
				h := m.slotHdr(ch, i)
				if hs, hl := *m.u32(h), *m.u32(h + 4); hs != seq || int(hl) != l {
					return fmt.Errorf("%w: rank %d sent %d bytes for collective #%d through shared memory, this rank expects %d bytes for #%d (ranks issued different collectives?)",
						procgroup.ErrInvalidArgument, j, hl, hs, l, seq)
				}
				copy(b, m.slotData(ch, i, l))
				t.push(b)
				m.cons[j] = c + 1
				atomic.StoreUint64(m.u64(ch+shmCons), c+1)
				m.ring(j)
				break
			}
			if err := g.shmWait(v); err != nil {
				return err
			}
		}
	}
	copy(o.buf, t.result())
	if o.rop == procgroup.Avg {
		kernels.Divide(o.dt, o.buf, n)
	}
	return nil
}

// has reports whether rank j is in the region.
func (r *shmRegion) has(j int) bool { return j >= 0 && j < len(r.local) && r.local[j] >= 0 }
