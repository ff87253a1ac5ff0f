//go:build linux

package gloo

import (
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// Note [Inline exchange]: the two-rank socket all-reduce (TCP, or Unix sockets without
// shared memory) runs entirely on the worker goroutine, with non-blocking sendmsg and
// recvmsg on the peer's descriptor and poll(2) when neither can move. Both ranks send
// their whole buffer and combine what they receive, as pairAllReduce does, but with no
// writer goroutine. Why: with one process per rank, a writer goroutine and the worker
// handed segments to each other through the scheduler and the netpoller, and those
// hand-offs and thread wake-ups, not the bytes, cost about half of a 1 MiB all-reduce over
// TCP on two cores shared with the other rank (1.6 ms, against 1.06 ms with GOMAXPROCS=1).
// Per collective a rank now makes about one sendmsg per MiB and one or two recvmsg per
// arrival, and sleeps in poll only when the peer is behind (after yielding the CPU a
// while: inlineSpins).
//
// The peer's bytes land in a staging ring of two frames; a range is combined into the
// buffer once it has both arrived and been sent from this rank's own copy, in steps of at
// least grain ≤ one frame (or the rest). Receiving stops while the ring is full and
// sending never waits for receiving, so two ranks cannot deadlock: if both stood still,
// each ring full and neither able to combine, each rank would have received more than
// ring − grain bytes beyond what it has sent, which the other cannot have sent.
//
// Frames are those of Note [Wire format], Config.SegmentSize bytes each; the first one's
// payload starts with the message length (8 bytes), so that ranks issuing different
// lengths both fail at once with a clear error. A header is sent in the same sendmsg as
// its payload, and read in the same recvmsg as the end of the previous payload (or the
// start of its own). p.wmu is held from a frame's first byte to its last, so an abort
// frame (sendAbort) only ever lands between frames, and no frame is started once the
// group is aborted; a rank whose send fails still reads what the peer sent before it
// went, so an abort frame is reported as the abort it is. The loop runs inside
// RawConn.Control, which keeps the descriptor open: shutdown wakes the poll by shutting
// the socket down (closeConn), and a poll that times out runs the checks of Note [Stalls].

const (
	inlineGrain   = 128 << 10 // combine at least this many bytes at a time (or the rest)
	inlineSendMax = 1 << 20   // the most payload bytes one sendmsg offers
	// inlineSpins is how many passes without progress (each ending in sched_yield) the
	// exchange makes before it sleeps in poll, with a peer on this host: 1 MiB over TCP on
	// loopback, medians of 8 interleaved runs, 1.49 ms without, 1.30 ms with (4 MiB
	// unchanged). With a peer on another host it polls at once (peer.spins): there the
	// bytes trickle in at the link's rate, so the yields never ran out and the worker kept
	// a core busy for the whole collective, taken from backward's compute on the same cores
	// (the transformer at 1 Gbit/s on the testbed: see the commit that made it so).
	inlineSpins = 200
)

// inlineState is the worker's state for Note [Inline exchange]; it lives in the group so
// that a collective allocates nothing.
type inlineState struct {
	o      *op
	p      *peer
	err    error
	fn     func(fd uintptr) // g.pairLoop, bound once
	stage  []byte
	msg    unix.Msghdr
	iov    [2]unix.Iovec
	pfd    [1]unix.PollFd
	whdr   [frameHeaderLen + 8]byte // a frame's header; the first one's has the length appended
	rhdr   [frameHeaderLen + 8]byte
	abortH frameHeader // an abort frame's header met in the stream (errAbortFrame)
	abortN int         // how much of its payload came with it (in p.abortBuf)
}

// errAbortFrame: the peer sent an abort frame; its header is in inlineState.abortH.
var errAbortFrame = errors.New("gloo: abort frame")

// setSpins gives each peer its yields before poll (Note [Inline exchange]): inlineSpins
// for a peer on this host, none across hosts.
func (g *group) setSpins() {
	for _, p := range g.peers {
		if p != nil && g.hostIDs[p.rank] == g.hostIDs[g.rank] {
			p.spins = inlineSpins
		}
	}
}

// inlinePair reports whether the two-rank all-reduce can run inline on the peer's socket.
func (g *group) inlinePair() bool {
	return g.size == 2 && g.peers[1-g.rank].raw != nil
}

// inlinePairAllReduce is the two-rank socket all-reduce of Note [Inline exchange].
func (g *group) inlinePairAllReduce(o *op) error {
	s := &g.inl
	if s.fn == nil {
		s.fn = g.pairLoop
	}
	if s.stage == nil {
		s.stage = kernels.Aligned(2 * g.pairFrame())
	}
	p := g.peers[1-g.rank]
	s.o, s.p, s.err = o, p, nil
	err := p.raw.Control(s.fn)
	if err != nil {
		err = g.lostErr(p, err)
	} else {
		err = s.err
	}
	s.o, s.p, s.err = nil, nil, nil
	s.iov = [2]unix.Iovec{}
	if errors.Is(err, errAbortFrame) {
		return g.abortFrame(p, s.abortH, s.abortN)
	}
	return err
}

// pairFrame is the exchange's frame payload: Config.SegmentSize, less 8 where the first
// frame's length prefix would take it over maxFrameLen.
func (g *group) pairFrame() int { return min(g.cfg.SegmentSize, maxFrameLen-8) }

func (g *group) pairLoop(fd uintptr) { g.inl.err = g.pairExchange(int(fd)) }

func (s *inlineState) setIov(i int, b []byte) {
	s.iov[i].Base = &b[0]
	s.iov[i].SetLen(len(b))
}

// pairRun is one collective of Note [Inline exchange] in progress, both ways.
type pairRun struct {
	g       *group
	s       *inlineState
	p       *peer
	fd      int
	buf     []byte
	total   int
	F, Q    int // frame payload, staging ring
	grain   int
	seq     uint32
	snt     int   // payload bytes sent
	sEnd    int   // end of the frame being sent
	hs, hl  int   // header bytes of that frame sent, of hl
	open    bool  // a frame is being sent (p.wmu held)
	rcv     int   // payload bytes received
	rEnd    int   // end of the frame being received
	hg      int   // header bytes of the next frame received (while rcv == rEnd)
	red     int   // bytes combined into buf
	sendErr error // sending failed: receive what the peer sent before it went
}

// pairExchange runs Note [Inline exchange] on descriptor fd: send, receive and combine
// whatever can move, and yield or poll when nothing did.
func (g *group) pairExchange(fd int) error {
	s := &g.inl
	r := pairRun{g: g, s: s, p: s.p, fd: fd, buf: s.o.buf, total: len(s.o.buf),
		F: g.pairFrame(), Q: len(s.stage), seq: uint32(s.o.seq)}
	r.grain = min(inlineGrain, r.F)
	defer r.closeFrame()
	idle := 0 // passes without progress since the last
	for r.snt < r.total || r.red < r.total {
		sent, err := r.send()
		if err != nil {
			return err
		}
		got, err := r.receive()
		if err != nil {
			return err
		}
		combined := r.combine()
		if sent || got || combined {
			idle = 0
			continue
		}
		if idle < r.p.spins { // poll's sleep and wake-up cost more than a few yields
			idle++
			unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
			continue
		}
		idle = 0
		if err := r.wait(); err != nil {
			return err
		}
	}
	return nil
}

// closeFrame finishes a frame left half sent by a failure (Note [Torn frames]).
func (r *pairRun) closeFrame() {
	if r.open {
		r.g.finishFrame(r.p, r.fd, r.s.whdr[r.hs:r.hl], r.buf[r.snt:r.sEnd])
		r.p.wmu.Unlock()
	}
}

// send offers the socket the next bytes of the frame being sent, opening the next frame
// first; it reports whether anything moved. A failed send is kept in sendErr (the peer
// may have aborted, and its abort frame is still to be read): from then on it only
// receives.
func (r *pairRun) send() (bool, error) {
	if r.snt >= r.total || r.sendErr != nil {
		return false, nil
	}
	s, p := r.s, r.p
	if !r.open {
		select {
		case <-r.g.aborted:
			return false, r.g.abortErr
		default:
		}
		p.wmu.Lock()
		r.open, r.hs, r.hl = true, 0, frameHeaderLen
		r.sEnd = r.snt + min(r.F, r.total-r.snt)
		pl := r.sEnd - r.snt
		if r.snt == 0 {
			r.hl += 8
			binary.LittleEndian.PutUint64(s.whdr[frameHeaderLen:], uint64(r.total))
			pl += 8
		}
		putHeader(s.whdr[:], kindData, r.seq, pl)
	}
	k := 0
	if r.hs < r.hl {
		s.setIov(k, s.whdr[r.hs:r.hl])
		k++
	}
	s.setIov(k, r.buf[r.snt:min(r.sEnd, r.snt+inlineSendMax)])
	k++
	s.msg.Iov, s.msg.Iovlen = &s.iov[0], uint64(k)
	n, _, e := unix.Syscall(unix.SYS_SENDMSG, uintptr(r.fd), uintptr(unsafe.Pointer(&s.msg)), unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
	switch {
	case e == 0:
		h := min(int(n), r.hl-r.hs)
		r.hs += h
		r.snt += int(n) - h
		if r.snt == r.sEnd {
			r.open = false
			p.wmu.Unlock()
		}
		return true, nil
	case e == unix.EAGAIN || e == unix.EINTR:
		return false, nil
	default:
		r.sendErr = fmt.Errorf("send: %w", e)
		return true, nil
	}
}

// receive reads, in one recvmsg, a header (the first frame's has the length appended) and
// then payload into the staging ring, or payload and then the next header; it reports
// whether anything moved.
func (r *pairRun) receive() (bool, error) {
	s, p, Q := r.s, r.p, r.Q
	avail := r.red + Q - r.rcv // free staging bytes
	if r.rcv >= r.total || (r.rcv != r.rEnd && avail <= 0) {
		return false, nil
	}
	off := r.rcv % Q
	rhl := frameHeaderLen // the next header's length
	if r.rcv == 0 {
		rhl += 8
	}
	k, pl := 0, 0
	if r.rcv == r.rEnd {
		s.setIov(k, s.rhdr[r.hg:rhl])
		k++
		if pl = min(r.F, r.total-r.rcv, avail, Q-off); pl > 0 {
			s.setIov(k, s.stage[off:off+pl])
			k++
		}
	} else {
		pl = min(r.rEnd-r.rcv, avail, Q-off)
		s.setIov(k, s.stage[off:off+pl])
		k++
		if r.rcv+pl == r.rEnd && r.rEnd < r.total {
			s.setIov(k, s.rhdr[:frameHeaderLen])
			k++
		}
	}
	s.msg.Iov, s.msg.Iovlen = &s.iov[0], uint64(k)
	n, _, e := unix.Syscall(unix.SYS_RECVMSG, uintptr(r.fd), uintptr(unsafe.Pointer(&s.msg)), unix.MSG_DONTWAIT)
	switch {
	case e == 0 && n == 0:
		if r.sendErr != nil {
			return false, r.g.lostErr(p, r.sendErr)
		}
		return false, r.g.lostErr(p, errors.New("connection closed by peer"))
	case e == unix.EAGAIN || e == unix.EINTR:
		return false, nil
	case e != 0:
		if r.sendErr != nil {
			return false, r.g.lostErr(p, r.sendErr)
		}
		return false, r.g.lostErr(p, fmt.Errorf("receive: %w", e))
	}
	m := int(n)
	if r.rcv < r.rEnd { // payload first
		t := min(m, pl)
		r.rcv += t
		m -= t
		off = r.rcv % Q
	}
	if m == 0 {
		return true, nil
	}
	// (the rest of) the next header, then maybe payload at off
	t := min(m, rhl-r.hg)
	r.hg += t
	m -= t
	if r.hg < frameHeaderLen {
		return true, nil
	}
	h, err := parseHeader(s.rhdr[:frameHeaderLen])
	if err != nil {
		return false, fmt.Errorf("from rank %d: %w", p.rank, err)
	}
	if h.kind == kindAbort { // its payload may have followed
		n := copy(p.abortBuf[:h.len], s.rhdr[frameHeaderLen:r.hg])
		s.abortH, s.abortN = h, n+copy(p.abortBuf[n:h.len], s.stage[off:off+m])
		return false, errAbortFrame
	}
	if r.hg < rhl {
		return true, nil // the first frame's length is not all in yet
	}
	want := min(r.F, r.total-r.rcv)
	if r.rcv == 0 {
		if t := binary.LittleEndian.Uint64(s.rhdr[frameHeaderLen:]); t != uint64(r.total) && h.seq == r.seq {
			return false, fmt.Errorf("%w: rank %d all-reduces %d bytes in collective #%d, this rank %d bytes (ranks issued different collectives?)",
				procgroup.ErrInvalidArgument, p.rank, t, r.seq, r.total)
		}
		want += 8
	}
	if h.seq != r.seq || h.len != uint64(want) {
		return false, mismatchErr(p.rank, h, want, r.seq)
	}
	r.rEnd = r.rcv + min(r.F, r.total-r.rcv)
	r.rcv += m
	r.hg = 0
	return true, nil
}

// combine reduces into buf what has both arrived and been sent, in steps of at least
// grain (or the rest); it reports whether it did.
func (r *pairRun) combine() bool {
	limit := min(r.rcv, r.snt)
	if limit < r.total {
		limit &^= 7 // whole elements (every element size divides 8)
	}
	if limit <= r.red || (limit-r.red < r.grain && limit != r.total) {
		return false
	}
	o, Q := r.s.o, r.Q
	for r.red < limit {
		off := r.red % Q
		l := min(limit-r.red, Q-off)
		seg, st := r.buf[r.red:r.red+l], r.s.stage[off:off+l]
		if r.g.rank == 0 {
			kernels.Reduce(o.dt, o.rop, seg, st)
		} else { // rank 0's value first, as on rank 0: identical bits
			kernels.ReduceInto(o.dt, o.rop, seg, st, seg)
		}
		if o.rop == procgroup.Avg {
			kernels.Divide(o.dt, seg, 2)
		}
		r.red += l
	}
	return true
}

// wait sleeps in poll until the socket can take or give bytes, the poll interval passes
// (then the checks of Note [Stalls] run), or the descriptor is shut down.
func (r *pairRun) wait() error {
	s, g, p := r.s, r.g, r.p
	var ev int16
	if r.snt < r.total && r.sendErr == nil {
		ev |= unix.POLLOUT
	}
	if r.rcv < r.total && (r.rcv == r.rEnd || r.red+r.Q > r.rcv) {
		ev |= unix.POLLIN
	}
	if ev == 0 && r.sendErr != nil {
		return g.lostErr(p, r.sendErr)
	}
	if ev == 0 {
		return fmt.Errorf("gloo: inline exchange stuck (sent %d, received %d, combined %d of %d)", r.snt, r.rcv, r.red, r.total)
	}
	s.pfd[0] = unix.PollFd{Fd: int32(r.fd), Events: ev}
	n, err := unix.Poll(s.pfd[:], int(g.cfg.PollInterval.Milliseconds())+1)
	switch {
	case err == unix.EINTR:
	case err != nil:
		return g.lostErr(p, fmt.Errorf("poll: %w", err))
	case n == 0:
		return g.stalled()
	case s.pfd[0].Revents&unix.POLLNVAL != 0:
		return g.lostErr(p, errors.New("poll: descriptor not open"))
	}
	return nil
}

// closeConn shuts p's socket down before closing it: a worker inside Note [Inline exchange]
// holds the descriptor open and must be woken from poll.
func closeConn(p *peer) {
	if p.raw != nil {
		p.raw.Control(func(fd uintptr) { syscall.Shutdown(int(fd), syscall.SHUT_RDWR) })
	}
	p.conn.Close()
}

// Note [Torn frames]: an inline path that fails while a frame to p is partly written must
// not leave the stream there: the abort frame that follows would land inside the payload
// and reach p as garbage, and p would report this rank lost instead of the abort's
// cause. So the rest of the frame (header and payload; the bytes do not matter any more)
// is written first, for at most 300 ms, as sendAbort would wait for a writer; if it cannot
// be, p is marked torn and nothing more is written to it. Called with p.wmu held.
func (g *group) finishFrame(p *peer, fd int, hdr, data []byte) {
	deadline := time.Now().Add(300 * time.Millisecond)
	for len(hdr)+len(data) > 0 {
		s := &g.inl
		k := 0
		if len(hdr) > 0 {
			s.setIov(k, hdr)
			k++
		}
		if len(data) > 0 {
			s.setIov(k, data)
			k++
		}
		s.msg.Iov, s.msg.Iovlen = &s.iov[0], uint64(k)
		n, _, e := unix.Syscall(unix.SYS_SENDMSG, uintptr(fd), uintptr(unsafe.Pointer(&s.msg)), unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
		switch {
		case e == 0:
			h := min(int(n), len(hdr))
			hdr, data = hdr[h:], data[int(n)-h:]
			continue
		case e != unix.EAGAIN && e != unix.EINTR:
			p.torn = true
			return
		}
		left := time.Until(deadline)
		if left <= 0 {
			p.torn = true
			return
		}
		pfd := [1]unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		unix.Poll(pfd[:], int(left/time.Millisecond)+1)
	}
}
