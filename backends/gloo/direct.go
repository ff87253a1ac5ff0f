package gloo

import (
	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// directAllReduce: every rank sends its buffer to every other and combines all n buffers
// in Note [One association] (so every rank computes the same bits).
func (g *group) directAllReduce(o *op) error {
	n, r, seq := g.size, g.rank, uint32(o.seq)
	for j := 1; j < n; j++ {
		if err := g.sendAll(g.peers[(r+j)%n], seq, o.buf); err != nil {
			return err
		}
	}
	t := &g.tree // Note [One association]: the ranks' buffers in ring order
	t.reset(o.dt, o.rop, n, len(o.buf))
	for _, j := range g.ring {
		b := t.slot()
		if j == r {
			copy(b, o.buf)
		} else if err := g.recvAll(g.peers[j], seq, b); err != nil {
			return err
		}
		t.push(b)
	}
	if err := g.waitSends(); err != nil {
		return err
	}
	copy(o.buf, t.result())
	if o.rop == procgroup.Avg {
		kernels.Divide(o.dt, o.buf, n)
	}
	return nil
}

func (g *group) directAllGather(o *op) error {
	n, r, seq := g.size, g.rank, uint32(o.seq)
	blk := len(o.in)
	own := o.buf[r*blk : (r+1)*blk]
	for j := 1; j < n; j++ {
		if err := g.sendAll(g.peers[(r+j)%n], seq, own); err != nil {
			return err
		}
	}
	for j := 1; j < n; j++ {
		src := (r + n - j) % n
		if err := g.recvAll(g.peers[src], seq, o.buf[src*blk:(src+1)*blk]); err != nil {
			return err
		}
	}
	return g.waitSends()
}

func (g *group) directReduceScatter(o *op) error {
	n, r, seq := g.size, g.rank, uint32(o.seq)
	blk := len(o.buf)
	for j := 1; j < n; j++ {
		d := (r + j) % n
		if err := g.sendAll(g.peers[d], seq, o.in[d*blk:(d+1)*blk]); err != nil {
			return err
		}
	}
	acc := g.scratch(blk)
	for j := 0; j < n; j++ {
		if j == r {
			if j == 0 {
				copy(acc, o.in[r*blk:(r+1)*blk])
			} else {
				kernels.Reduce(o.dt, o.rop, acc, o.in[r*blk:(r+1)*blk])
			}
			continue
		}
		if j == 0 {
			if err := g.recvAll(g.peers[j], seq, acc); err != nil {
				return err
			}
			continue
		}
		for a := 0; a < blk; {
			l := g.segLen(blk, a)
			if err := g.recv(g.peers[j], seq, g.tmp[:l]); err != nil {
				return err
			}
			kernels.Reduce(o.dt, o.rop, acc[a:a+l], g.tmp[:l])
			a += l
		}
	}
	if err := g.waitSends(); err != nil {
		return err
	}
	copy(o.buf, acc)
	if o.rop == procgroup.Avg {
		kernels.Divide(o.dt, o.buf, n)
	}
	return nil
}
