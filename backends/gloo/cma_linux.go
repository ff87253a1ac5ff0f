package gloo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"sync/atomic"
	"time"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// Note [Single copy]: when every rank of the group shares one region (one host), the
// collectives on buffers the user allocated read the peers' buffers straight out of their
// processes with process_vm_readv (cross-memory attach, CMA): one copy, made by the
// kernel, where the slot ring makes two (into a slot, out of it) and the sockets more.
// Each rank posts its buffer's address and its pid in its line of the region (postBuffer),
// waits for every peer's post, then
//
//   - AllReduce: rank r reduces chunk r, a block of cmaBlock bytes at a time: each peer's
//     block is read into g.tmp (in cache) and reduced into this rank's own, peers in rank
//     order, as Note [One pass] reduces (so both give the same bits); then, once every
//     rank has finished its chunk (state seq<<2|2), it reads every other chunk from its
//     owner straight into its buffer;
//   - ReduceScatter: the same first half, reading chunk r of the peers' inputs, into out;
//   - AllGather: it reads each peer's input straight into its slot of out;
//   - Broadcast: a non-root rank reads the root's buffer into its own.
//
// Every rank then waits for the others (state seq<<2|3) before it returns, because a peer
// may still be reading its buffer. Nothing is written into another process: a rank that
// is late (Note [Late ranks]) can only read, and the abort checks before each block and
// in every phase wait stop it. A peer whose process is gone fails the collective with a
// *PeerLostError (ESRCH).
//
// The kernel must let every rank read every other: same user, no seccomp filter against
// the call, Yama's ptrace_scope 0 (at 1 only an ancestor may read, which is rarely both
// ways), the same pid namespace. So New probes it (agreeCMA), in the region before any
// collective: each rank posts its pid and the address of a random cookie, reads every
// peer's cookie back with process_vm_readv, and posts whether it failed. A rank that
// cannot read a peer (or whose Config.VMReadv is off) logs why, once, and the whole group
// runs without: every rank decides alike (Note [Agreement]), and the result is the same.
// Where the kernel copies slower than the other paths (small messages: its per-call cost
// and the phase waits; the all-reduce, whose slot ring copies twice but in user space,
// several times faster per byte than the kernel's page-at-a-time copy), cmaFor keeps them.

// cmaBlock is the block of Note [Single copy]'s reductions: one peer's block in g.tmp and
// this rank's own stay in L2 while every peer's is reduced in.
const cmaBlock = 256 << 10

// cmaMinBytes is the smallest message of each collective (by procgroup.CollectiveOp)
// that Note [Single copy] takes: below it the phase waits and the kernel's per-call cost
// lose to direct exchange or the sockets. The all-reduce never takes it by default: the
// slot ring's two user-space copies of a byte ran faster than the kernel's one at every
// size from 1 to 256 MiB, n = 2 and 4 (docs/results/2026-12-07-single-copy.md), and the
// arena's one pass faster still. Tests lower them.
var cmaMinBytes = [procgroup.OpBarrier + 1]int{
	procgroup.OpAllReduce:     math.MaxInt,
	procgroup.OpReduceScatter: 64 << 10,
	procgroup.OpAllGather:     64 << 10,
	procgroup.OpBroadcast:     64 << 10,
	procgroup.OpBarrier:       math.MaxInt,
}

// cmaFor reports whether a collective of this kind and size (the bytes that AllReduce and
// Broadcast pass, that AllGather gathers and ReduceScatter reduces) takes Note [Single
// copy]: the group agreed on it and peerSized. Every rank decides alike.
func (g *group) cmaFor(kind procgroup.CollectiveOp, bytes int) bool {
	return g.cma && g.peerSized(kind, bytes)
}

// peerReadFor reports whether a collective of this kind and size reads its peers'
// buffers straight (Note [Single copy]): through process_vm_readv where the group agreed
// on it, through the arena where the buffers are there or adopted (Note [Adopted
// buffers]). Every rank decides alike; the posts then say whether every buffer can be
// read (peerPost).
func (g *group) peerReadFor(kind procgroup.CollectiveOp, bytes int) bool {
	return (g.cma || g.inPlaceOK()) && g.peerSized(kind, bytes)
}

// peerSized reports whether a message is large enough for Note [Single copy] and above
// DirectMaxBytes unless an algorithm is forced (Config.Algorithm "direct" never takes it).
func (g *group) peerSized(kind procgroup.CollectiveOp, bytes int) bool {
	switch {
	case bytes < cmaMinBytes[kind] || g.cfg.Algorithm == AlgoDirect:
		return false
	case g.cfg.Algorithm == AlgoAuto:
		return bytes > g.cfg.DirectMaxBytes
	}
	return true
}

// vmPIDHook, nil outside tests, changes the pid a rank posts for process_vm_readv.
var vmPIDHook func(g *group, pid int) int

// vmProbeHook, nil outside tests, stands in for the kernel's answer to a rank's probe of
// Note [Single copy]: an error it returns is that rank's failure.
var vmProbeHook func(g *group) error

// agreeCMA runs Note [Single copy]'s probe and agreement in the region, before the worker
// starts (so it takes no sequence number from the user's collectives). Each member posts
// its pid, the address of its cookie and the cookie in its post line (state 1), reads
// every peer's cookie back, posts whether it failed (state 2), reads every verdict, and
// says it is done (state 3) before any member posts its first collective over the line.
func (g *group) agreeCMA(ctx context.Context) error {
	m := g.shm
	if m == nil || m.members != g.size {
		return nil
	}
	deadline := time.Now().Add(g.opts.ConnectTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	m.vmCookie = rand.Uint64()>>1 | 1
	p := m.post(m.me)
	*m.u64(p + 32), *m.u64(p + 40), *m.u64(p + 48) = uint64(m.pid), uint64(uintptr(unsafe.Pointer(&m.vmCookie))), m.vmCookie
	if err := g.probePhase(1, deadline); err != nil {
		return err
	}
	var why error
	switch {
	case g.cfg.VMReadv == VMReadvOff:
		why = errors.New("process_vm_readv is off here (GODDP_GLOO_VMREADV, gloo.Config.VMReadv)")
	case vmProbeHook != nil:
		why = vmProbeHook(g)
	}
	for j := 0; j < m.members && why == nil; j++ {
		if j == m.me {
			continue
		}
		q := m.post(j)
		pid, at, cookie := int(*m.u64(q + 32)), uintptr(*m.u64(q + 40)), *m.u64(q + 48)
		var got uint64
		err := vmReadPID(pid, unsafe.Slice((*byte)(unsafe.Pointer(&got)), 8), at)
		switch {
		case err != nil:
			why = fmt.Errorf("process_vm_readv of rank %d (pid %d): %w", m.ranks[j], pid, err)
		case got != cookie:
			why = fmt.Errorf("process_vm_readv at rank %d's pid %d read another process (another pid namespace?)", m.ranks[j], pid)
		}
	}
	if why != nil {
		atomic.StoreUint32(m.u32(p+24), 1)
	} else {
		atomic.StoreUint32(m.u32(p+24), 0)
	}
	if err := g.probePhase(2, deadline); err != nil {
		return err
	}
	var without []int
	for j := range m.members {
		if atomic.LoadUint32(m.u32(m.post(j)+24)) != 0 {
			without = append(without, m.ranks[j])
		}
	}
	if err := g.probePhase(3, deadline); err != nil {
		return err
	}
	switch {
	case len(without) == 0:
		g.cma = true
	case why != nil:
		g.log.Warn("gloo: this rank cannot read its peers' buffers with process_vm_readv (it needs the same user, the same pid namespace and Yama ptrace_scope 0): "+
			"every rank's collectives on its own buffers go through the shared-memory slots and the sockets instead",
			zap.Error(why), zap.String("ranks without", rankList(without)))
	case g.rank == firstNotIn(without):
		// One rank that could read its peers says why the group goes without.
		g.log.Warn("gloo: some ranks cannot read their peers' buffers with process_vm_readv: "+
			"every rank's collectives on its own buffers go through the shared-memory slots and the sockets instead",
			zap.String("ranks without", rankList(without)))
	}
	return nil
}

// probePhase is shmPhase for agreeCMA, bounded by deadline (there is no collective yet
// whose timeout would bound it).
func (g *group) probePhase(state uint64, deadline time.Time) error {
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
		late := -1
		for i := range m.members {
			if i != m.me && atomic.LoadUint64(m.u64(m.post(i))) < state {
				late = m.ranks[i]
				break
			}
		}
		if late < 0 {
			return g.shmCheck()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("probing process_vm_readv: rank %d did not reach step %d in time (bounded by %s, %s)",
				late, state, g.opts.ConnectTimeout, procgroup.ConnectTimeoutEnv)
		}
		if err := g.shmWait(v); err != nil {
			return fmt.Errorf("probing process_vm_readv: %w", err)
		}
	}
}

// cmaAllReduce is Note [Single copy]'s all-reduce, once postBuffer has found every
// peer's buffer.
func (g *group) cmaAllReduce(o *op) error {
	n, r := g.size, g.rank
	es := o.dt.Size()
	g.setChunks(len(o.buf)/es, es)
	g.lastPath = "shm-vm"
	if err := g.cmaReduce(o, g.chunk(o.buf, r), g.chunk(o.buf, r), g.offs[r]); err != nil {
		return err
	}
	if err := g.shmPhase(o.seq<<2 | 2); err != nil {
		return err
	}
	for j := range n {
		if j != r {
			if err := g.peerRead(j, g.chunk(o.buf, j), g.offs[j]); err != nil {
				return err
			}
		}
	}
	return g.shmPhase(o.seq<<2 | 3)
}

// cmaReduce makes dst o.rop, over every rank's posted buffer, of its bytes at..
// (divided by the group's size for Avg), a block at a time: this rank's own bytes, own,
// are copied in first unless own is dst, then each peer's are reduced in, in rank order,
// straight from the arena or read into g.tmp. It checks for an abort before each block (Note [Late ranks]).
func (g *group) cmaReduce(o *op, dst, own []byte, at int) error {
	blk := min(cmaBlock, len(g.tmp)) &^ 7
	same := len(dst) > 0 && &dst[0] == &own[0]
	for a := 0; a < len(dst); a += blk {
		if err := g.shmCheck(); err != nil {
			return err
		}
		e := min(a+blk, len(dst))
		d := dst[a:e]
		if !same {
			copy(d, own[a:e])
		}
		for j := range g.size {
			if j == g.rank {
				continue
			}
			src := g.tmp[:e-a]
			if p := g.shm.peerBufs[j]; p != nil {
				src = p[at+a : at+e] // in the arena: read in place
			} else if err := g.vmRead(j, src, at+a); err != nil {
				return err
			}
			kernels.Reduce(o.dt, o.rop, d, src)
		}
		if o.rop == procgroup.Avg {
			kernels.Divide(o.dt, d, g.size)
		}
	}
	return nil
}

// peerPost posts b for a collective of Note [Single copy] other than the all-reduce and
// waits for every peer's post. ok: every member's buffer can be read, from the arena
// (its own, or adopted: Note [Adopted buffers]) or with process_vm_readv; every rank
// finds the same, and without it all take their other path.
func (g *group) peerPost(o *op, b []byte) (ok bool, err error) {
	inPlace, vm, err := g.postBuffer(o, b, g.cma)
	ok = err == nil && (inPlace || vm)
	switch {
	case ok && inPlace:
		g.lastPath = "shm-arena"
	case ok:
		g.lastPath = "shm-vm"
	}
	return ok, err
}

// adoptInput is adoptIn for b, a collective's input: its adopted view, or b itself.
func (g *group) adoptInput(b []byte) []byte {
	if v, _, _ := g.adoptIn(b); v != nil {
		return v
	}
	return b
}

// peerAllGather is Note [Single copy]'s AllGather; run has copied this rank's input into
// its slot of o.buf. done is false when a peer's input cannot be read (peerPost): run
// then takes its other path.
func (g *group) peerAllGather(o *op) (done bool, err error) {
	ok, err := g.peerPost(o, g.adoptInput(o.in))
	if !ok {
		return err != nil, err
	}
	l := len(o.in)
	for j := range g.size {
		if j == g.rank {
			continue
		}
		if err := g.shmCheck(); err != nil {
			return true, err
		}
		if err := g.peerRead(j, o.buf[j*l:(j+1)*l], 0); err != nil {
			return true, err
		}
	}
	return true, g.shmPhase(o.seq<<2 | 3)
}

// peerReduceScatter is Note [Single copy]'s ReduceScatter: o.buf is the reduction of
// chunk g.rank of every rank's input. done as for peerAllGather.
func (g *group) peerReduceScatter(o *op) (done bool, err error) {
	in := g.adoptInput(o.in)
	ok, err := g.peerPost(o, in)
	if !ok {
		return err != nil, err
	}
	l := len(o.buf)
	own := in[g.rank*l : (g.rank+1)*l]
	if &o.buf[0] == &o.in[g.rank*l] { // in place: this rank's chunk is where its result goes
		own = o.buf
	}
	if err := g.cmaReduce(o, o.buf, own, g.rank*l); err != nil {
		return true, err
	}
	return true, g.shmPhase(o.seq<<2 | 3)
}

// peerBroadcast is Note [Single copy]'s Broadcast: every rank but the root reads the
// root's buffer into its own. Only the root's buffer is read, so only it is adopted, and
// done (as for peerAllGather) needs only it to be readable.
func (g *group) peerBroadcast(o *op) (done bool, err error) {
	m, b := g.shm, o.buf
	if g.rank == o.root {
		b = g.adoptInput(b)
	}
	_, vm, err := g.postBuffer(o, b, g.cma)
	if err != nil {
		return true, err
	}
	root := m.local[o.root]
	_, mine := m.ownOffset(b)
	rootArena := (root == m.me && mine) || (root != m.me && m.peerBufs[root] != nil)
	if !rootArena && !vm {
		// The chain's root only sends: without this phase it could return and post its
		// next collective before a peer has read this post. (AllGather's and
		// ReduceScatter's other paths need every rank's data, so none leaves early.)
		if err := g.shmPhase(o.seq<<2 | 3); err != nil {
			return true, err
		}
		return false, nil
	}
	g.lastPath = "shm-arena"
	if !rootArena {
		g.lastPath = "shm-vm"
	}
	if g.rank != o.root {
		if err := g.peerRead(root, o.buf, 0); err != nil {
			return true, err
		}
	}
	return true, g.shmPhase(o.seq<<2 | 3)
}

// peerRead reads len(dst) bytes at offset off of peer j's (local index) posted buffer
// into dst: a copy from the arena where the peer posted it there, process_vm_readv
// otherwise.
func (g *group) peerRead(j int, dst []byte, off int) error {
	if p := g.shm.peerBufs[j]; p != nil {
		copy(dst, p[off:off+len(dst)])
		return nil
	}
	return g.vmRead(j, dst, off)
}

// vmRead reads len(dst) bytes at offset off of peer j's (local index) posted buffer into
// dst. A peer whose process is gone (ESRCH, where the probe had read it) is lost.
func (g *group) vmRead(j int, dst []byte, off int) error {
	m := g.shm
	err := vmReadPID(m.peerPID[j], dst, m.peerAddr[j]+uintptr(off))
	if err == nil {
		return nil
	}
	rank := m.ranks[j]
	if errors.Is(err, unix.ESRCH) {
		return &PeerLostError{Rank: rank, Host: g.hosts[rank], Reporter: g.rank,
			Err: fmt.Errorf("its process (pid %d) is gone: %w", m.peerPID[j], err)}
	}
	return fmt.Errorf("gloo: rank %d: process_vm_readv of rank %d (pid %d): %w", g.rank, rank, m.peerPID[j], err)
}

// vmReadPID reads len(dst) bytes at address at of process pid into dst, with no
// allocation.
func vmReadPID(pid int, dst []byte, at uintptr) error {
	for len(dst) > 0 {
		local := unix.Iovec{Base: &dst[0]}
		local.SetLen(len(dst))
		remote := unix.RemoteIovec{Base: at, Len: len(dst)}
		k, _, errno := unix.Syscall6(unix.SYS_PROCESS_VM_READV, uintptr(pid),
			uintptr(unsafe.Pointer(&local)), 1, uintptr(unsafe.Pointer(&remote)), 1, 0)
		if errno != 0 {
			return errno
		}
		if k == 0 {
			return io.ErrUnexpectedEOF
		}
		dst, at = dst[k:], at+k
	}
	return nil
}

// firstNotIn is the lowest rank not in the ascending list rs.
func firstNotIn(rs []int) int {
	r := 0
	for _, x := range rs {
		if x != r {
			break
		}
		r++
	}
	return r
}
