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
	// exchange makes before it sleeps in poll: 1 MiB over TCP, medians of 8 interleaved
	// runs, 1.49 ms without, 1.30 ms with (4 MiB unchanged).
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

// pairExchange runs Note [Inline exchange] on descriptor fd.
func (g *group) pairExchange(fd int) error {
	s := &g.inl
	o, p := s.o, s.p
	buf, total := o.buf, len(o.buf)
	F, Q := g.pairFrame(), len(s.stage)
	grain := min(inlineGrain, F)
	seq := uint32(o.seq)

	snt, sEnd := 0, 0 // payload bytes sent; end of the frame being sent
	hs, hl := 0, 0    // header bytes of that frame sent, of hl
	open := false     // a frame is being sent (p.wmu held)
	defer func() {
		if open { // failing mid-frame: Note [Torn frames]
			g.finishFrame(p, fd, s.whdr[hs:hl], buf[snt:sEnd])
			p.wmu.Unlock()
		}
	}()
	rcv, rEnd := 0, 0 // payload bytes received; end of the frame being received
	hg := 0           // header bytes of the next frame received (while rcv == rEnd)
	red := 0          // bytes combined into buf
	var sendErr error // sending failed: receive what the peer sent before it went
	idle := 0         // passes without progress since the last

	for snt < total || red < total {
		progress := false

		// Send.
		if snt < total && sendErr == nil {
			if !open {
				select {
				case <-g.aborted:
					return g.abortErr
				default:
				}
				p.wmu.Lock()
				open, hs, hl = true, 0, frameHeaderLen
				sEnd = snt + min(F, total-snt)
				pl := sEnd - snt
				if snt == 0 {
					hl += 8
					binary.LittleEndian.PutUint64(s.whdr[frameHeaderLen:], uint64(total))
					pl += 8
				}
				putHeader(s.whdr[:], kindData, seq, pl)
			}
			k := 0
			if hs < hl {
				s.setIov(k, s.whdr[hs:hl])
				k++
			}
			s.setIov(k, buf[snt:min(sEnd, snt+inlineSendMax)])
			k++
			s.msg.Iov, s.msg.Iovlen = &s.iov[0], uint64(k)
			n, _, e := unix.Syscall(unix.SYS_SENDMSG, uintptr(fd), uintptr(unsafe.Pointer(&s.msg)), unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
			switch {
			case e == 0:
				progress = true
				h := min(int(n), hl-hs)
				hs += h
				snt += int(n) - h
				if snt == sEnd {
					open = false
					p.wmu.Unlock()
				}
			case e == unix.EAGAIN || e == unix.EINTR:
			default:
				// The peer may have aborted: its abort frame, if it sent one, is
				// still to be read; only receive from now on.
				sendErr = fmt.Errorf("send: %w", e)
				progress = true
			}
		}

		// Receive: a header (the first frame's has the length appended) and then payload
		// into the ring, or payload and then the next header, in one recvmsg.
		avail := red + Q - rcv // free staging bytes
		if rcv < total && (rcv == rEnd || avail > 0) {
			off := rcv % Q
			rhl := frameHeaderLen // the next header's length
			if rcv == 0 {
				rhl += 8
			}
			k, pl := 0, 0
			if rcv == rEnd {
				s.setIov(k, s.rhdr[hg:rhl])
				k++
				if pl = min(F, total-rcv, avail, Q-off); pl > 0 {
					s.setIov(k, s.stage[off:off+pl])
					k++
				}
			} else {
				pl = min(rEnd-rcv, avail, Q-off)
				s.setIov(k, s.stage[off:off+pl])
				k++
				if rcv+pl == rEnd && rEnd < total {
					s.setIov(k, s.rhdr[:frameHeaderLen])
					k++
				}
			}
			s.msg.Iov, s.msg.Iovlen = &s.iov[0], uint64(k)
			n, _, e := unix.Syscall(unix.SYS_RECVMSG, uintptr(fd), uintptr(unsafe.Pointer(&s.msg)), unix.MSG_DONTWAIT)
			switch {
			case e == 0 && n == 0:
				if sendErr != nil {
					return g.lostErr(p, sendErr)
				}
				return g.lostErr(p, errors.New("connection closed by peer"))
			case e == 0:
				progress = true
				m := int(n)
				if rcv < rEnd { // payload first
					t := min(m, pl)
					rcv += t
					m -= t
					off = rcv % Q
				}
				if m > 0 { // (the rest of) the next header, then maybe payload at off
					t := min(m, rhl-hg)
					hg += t
					m -= t
					if hg < frameHeaderLen {
						break
					}
					h, err := parseHeader(s.rhdr[:frameHeaderLen])
					if err != nil {
						return fmt.Errorf("from rank %d: %w", p.rank, err)
					}
					if h.kind == kindAbort { // its payload may have followed
						n := copy(p.abortBuf[:h.len], s.rhdr[frameHeaderLen:hg])
						s.abortH, s.abortN = h, n+copy(p.abortBuf[n:h.len], s.stage[off:off+m])
						return errAbortFrame
					}
					if hg < rhl {
						break // the first frame's length is not all in yet
					}
					want := min(F, total-rcv)
					if rcv == 0 {
						if t := binary.LittleEndian.Uint64(s.rhdr[frameHeaderLen:]); t != uint64(total) && h.seq == seq {
							return fmt.Errorf("%w: rank %d all-reduces %d bytes in collective #%d, this rank %d bytes (ranks issued different collectives?)",
								procgroup.ErrInvalidArgument, p.rank, t, seq, total)
						}
						want += 8
					}
					if h.seq != seq || h.len != uint64(want) {
						return mismatchErr(p.rank, h, want, seq)
					}
					rEnd = rcv + min(F, total-rcv)
					rcv += m
					hg = 0
				}
			case e == unix.EAGAIN || e == unix.EINTR:
			default:
				if sendErr != nil {
					return g.lostErr(p, sendErr)
				}
				return g.lostErr(p, fmt.Errorf("receive: %w", e))
			}
		}

		// Combine what has both arrived and been sent.
		limit := min(rcv, snt)
		if limit < total {
			limit &^= 7 // whole elements (every element size divides 8)
		}
		if limit > red && (limit-red >= grain || limit == total) {
			progress = true
			for red < limit {
				off := red % Q
				l := min(limit-red, Q-off)
				seg, st := buf[red:red+l], s.stage[off:off+l]
				if g.rank == 0 {
					kernels.Reduce(o.dt, o.rop, seg, st)
				} else { // rank 0's value first, as on rank 0: identical bits
					kernels.ReduceInto(o.dt, o.rop, seg, st, seg)
				}
				if o.rop == procgroup.Avg {
					kernels.Divide(o.dt, seg, 2)
				}
				red += l
			}
		}

		if progress {
			idle = 0
			continue
		}
		if idle < inlineSpins { // poll's sleep and wake-up cost more than a few yields
			idle++
			unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
			continue
		}
		idle = 0
		var ev int16
		if snt < total && sendErr == nil {
			ev |= unix.POLLOUT
		}
		if rcv < total && (rcv == rEnd || red+Q > rcv) {
			ev |= unix.POLLIN
		}
		if ev == 0 && sendErr != nil {
			return g.lostErr(p, sendErr)
		}
		if ev == 0 {
			return fmt.Errorf("gloo: inline exchange stuck (sent %d, received %d, combined %d of %d)", snt, rcv, red, total)
		}
		s.pfd[0] = unix.PollFd{Fd: int32(fd), Events: ev}
		n, err := unix.Poll(s.pfd[:], int(g.cfg.PollInterval.Milliseconds())+1)
		switch {
		case err == unix.EINTR:
		case err != nil:
			return g.lostErr(p, fmt.Errorf("poll: %w", err))
		case n == 0:
			if err := g.stalled(); err != nil {
				return err
			}
		case s.pfd[0].Revents&unix.POLLNVAL != 0:
			return g.lostErr(p, errors.New("poll: descriptor not open"))
		}
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
