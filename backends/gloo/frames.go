package gloo

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// sendInline writes one frame to p from the worker goroutine: Note [Inline writes].
func (g *group) sendInline(p *peer, seq uint32, data []byte) error {
	b := g.sendBuf[:frameHeaderLen+len(data)]
	putHeader(b, kindData, seq, len(data))
	copy(b[frameHeaderLen:], data)
	p.wmu.Lock()
	_, err := p.conn.Write(b)
	p.wmu.Unlock()
	if err != nil {
		return g.lostErr(p, err)
	}
	return nil
}

// recv reads one data frame of exactly len(dst) bytes for collective seq from p. A small
// frame is read with its header in one read call when the bytes are there.
func (g *group) recv(p *peer, seq uint32, dst []byte) error {
	now := time.Now()
	if p.deadline.Sub(now) < g.cfg.PollInterval/2 {
		p.deadline = now.Add(g.cfg.PollInterval)
		p.conn.SetReadDeadline(p.deadline)
	}
	small := len(dst) <= g.cfg.InlineMaxBytes
	b := p.hdr[:]
	if small {
		b = p.rbuf[:frameHeaderLen+len(dst)]
	}
	n, err := g.readAtLeast(p, b, frameHeaderLen)
	if err != nil {
		return err
	}
	h, err := parseHeader(b)
	if err != nil {
		return fmt.Errorf("from rank %d: %w", p.rank, err)
	}
	if h.kind == kindAbort {
		return g.abortFrame(p, h, copy(p.abortBuf[:h.len], b[frameHeaderLen:n]))
	}
	if h.seq != seq || h.len != uint64(len(dst)) {
		return mismatchErr(p.rank, h, len(dst), seq)
	}
	if !small {
		_, err := g.readAtLeast(p, dst, len(dst))
		return err
	}
	if _, err := g.readAtLeast(p, b[n:], len(b)-n); err != nil {
		return err
	}
	copy(dst, b[frameHeaderLen:])
	return nil
}

// abortFrame reads the rest of an abort frame with header h, whose first got payload bytes
// are already in p.abortBuf, and returns the error it carries.
func (g *group) abortFrame(p *peer, h frameHeader, got int) error {
	ab := p.abortBuf[:h.len]
	if got < len(ab) { // the inline paths leave an old read deadline behind
		p.deadline = time.Now().Add(g.cfg.PollInterval)
		p.conn.SetReadDeadline(p.deadline)
	}
	if _, err := g.readAtLeast(p, ab[got:], len(ab)-got); err != nil {
		return err
	}
	lost, reason, err := parseAbort(ab, g.size)
	if err != nil {
		return fmt.Errorf("from rank %d: %w", p.rank, err)
	}
	if lost >= 0 {
		return &PeerLostError{Rank: lost, Host: g.hosts[lost], Reporter: p.rank, Err: errors.New(reason)}
	}
	return fmt.Errorf("%w by rank %d: %s", procgroup.ErrAborted, p.rank, reason)
}

// mismatchErr reports a data frame from rank whose header h does not match the want
// bytes of collective seq this rank expects.
func mismatchErr(rank int, h frameHeader, want int, seq uint32) error {
	return fmt.Errorf("%w: rank %d sent %d bytes for collective #%d, this rank expects %d bytes for #%d (ranks issued different collectives?)",
		procgroup.ErrInvalidArgument, rank, h.len, h.seq, want, seq)
}

// readAtLeast reads from p into b until at least min bytes have come, and returns how
// many did. Note [Stalls]: reads carry a deadline PollInterval ahead; when it passes, the
// worker checks for abort, ctx, the collective's timeout and probes every other peer's
// connection, so a dead peer is named within about one PollInterval even when this rank is
// blocked on a different one.
func (g *group) readAtLeast(p *peer, b []byte, min int) (int, error) {
	n := 0
	for n < min {
		m, err := p.conn.Read(b[n:])
		n += m
		if err == nil {
			continue
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			if err := g.stalled(); err != nil {
				return n, err
			}
			p.deadline = time.Now().Add(g.cfg.PollInterval)
			p.conn.SetReadDeadline(p.deadline)
			continue
		}
		return n, g.lostErr(p, err)
	}
	return n, nil
}

// stalled runs the checks of Note [Stalls].
func (g *group) stalled() error {
	select {
	case <-g.aborted:
		return g.abortErr
	default:
	}
	if o := g.cur; o != nil {
		if err := o.ctx.Err(); err != nil {
			return err
		}
		if time.Now().After(o.deadline) {
			return fmt.Errorf("%w after %v", procgroup.ErrTimeout, g.opts.Timeout)
		}
	}
	for _, q := range g.peers {
		if q == nil {
			continue
		}
		if ok, err := q.alive(); !ok {
			return g.lostErr(q, err)
		}
	}
	return nil
}

// lostErr turns an I/O error on p into the error to report: the abort cause if the group
// was aborted meanwhile (its connections were closed under us), else p's loss.
func (g *group) lostErr(p *peer, err error) error {
	select {
	case <-g.aborted:
		return g.abortErr
	default:
	}
	return &PeerLostError{Rank: p.rank, Host: g.hosts[p.rank], Reporter: g.rank, Err: err}
}

// waitSends waits until every peer's writer has written everything queued.
func (g *group) waitSends() error {
	for _, p := range g.peers {
		if p != nil {
			if err := g.waitDone(p, p.issued); err != nil {
				return err
			}
		}
	}
	return nil
}

// waitDone waits until p's writer has written its first target requests.
func (g *group) waitDone(p *peer, target int) error {
	for {
		p.mu.Lock()
		done, werr := p.done, p.werr
		p.mu.Unlock()
		if werr != nil {
			return g.lostErr(p, werr)
		}
		if done >= target {
			return nil
		}
		g.timer.Reset(g.cfg.PollInterval)
		select {
		case <-p.progress:
		case <-g.aborted:
			g.timer.Stop()
			return g.abortErr
		case <-g.timer.C:
			if err := g.stalled(); err != nil {
				return err
			}
		}
		g.timer.Stop()
	}
}
