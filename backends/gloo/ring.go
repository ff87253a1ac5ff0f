package gloo

import (
	"slices"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// Note [Ring]: rank r ends the reduce-scatter owning chunk r. At step s (0 ≤ s < n-1) it
// sends chunk r-1-s to r+1 and receives chunk r-2-s from r-1, reducing it into its own copy;
// the chunk it sends at step s+1 is the one it just reduced, so every reduced segment is
// queued for sending at once (the pipeline). The all-gather then circulates the owned
// chunks: at step s rank r sends chunk r-s and receives chunk r-1-s in place. Chunks are
// reduced by one chain and then copied, so every rank ends with identical bits.
//
// The all-gather receives into chunks the reduce-scatter sent from; each such receive first
// waits until the writer has written that segment (by the data flow it almost always has:
// the bytes arriving depend on the peers having read it, but the writer's goroutine may not
// have returned from the write yet). Every collective ends with waitSends.

// Note [Ring order]: the rings (reduce-scatter, all-gather, the pipelined broadcast, and
// the shared-memory ring) visit the ranks host by host: hosts in the order of their lowest
// rank, and each host's ranks in rank order (ringOrder). With ranks placed contiguously
// (ddprun, torchrun) that is rank order. With ranks placed round-robin across the hosts it
// still crosses between hosts once per host and direction, where rank order would cross at
// every step. Positions replace ranks in the ring's arithmetic; chunk q of the ring is
// chunk ring[q] of the buffer, so a reduce-scatter still leaves every rank its own chunk.

// ringOrder returns the ranks grouped by host (hostIDs by rank): hosts ordered by their
// lowest rank, ranks ascending within a host.
func ringOrder(hostIDs []string) []int {
	first := map[string]int{}
	for r, h := range hostIDs {
		if _, ok := first[h]; !ok {
			first[h] = r
		}
	}
	order := make([]int, len(hostIDs))
	for r := range order {
		order[r] = r
	}
	slices.SortStableFunc(order, func(a, b int) int { return first[hostIDs[a]] - first[hostIDs[b]] })
	return order
}

// ringView is one ring: the whole group in ring order (group.flat), or, for
// hierAllReduce, the ranks of this host (group.local) or this rank's counterparts on the
// other hosts (group.cross).
type ringView struct {
	n, pos int
	ranks  []int // by position
	ids    []int // by position: the index of that position's chunk in offs
	offs   []int // chunk offsets in bytes
}

// peer is the peer at ring position pos+d.
func (v *ringView) peer(g *group, d int) *peer {
	return g.peers[v.ranks[((v.pos+d)%v.n+v.n)%v.n]]
}

// chunk is the chunk of ring position q (any integer, taken modulo n).
func (v *ringView) chunk(w []byte, q int) []byte {
	i := v.ids[(q%v.n+v.n)%v.n]
	return w[v.offs[i]:v.offs[i+1]]
}

// ringReduceScatter runs the reduce-scatter half over w on ring v. With forward, each
// finished segment of the owned chunk is queued as step 0 of the all-gather.
func (g *group) ringReduceScatter(o *op, seq uint32, w []byte, forward bool, v *ringView) error {
	n, r := v.n, v.pos
	next, prev := v.peer(g, 1), v.peer(g, -1)
	g.marks[0] = next.issued
	first := v.chunk(w, r-1)
	for a := 0; a < len(first); a += g.segLen(len(first), a) {
		next.enqueue(seq, first[a:a+g.segLen(len(first), a)])
	}
	for s := 0; s < n-1; s++ {
		c := v.chunk(w, r-2-s)
		last := s == n-2
		if !last {
			g.marks[s+1] = next.issued
		}
		for a := 0; a < len(c); {
			l := g.segLen(len(c), a)
			seg := c[a : a+l]
			tmp := g.tmp[:l]
			if err := g.recv(prev, seq, tmp); err != nil {
				return err
			}
			kernels.Reduce(o.dt, o.rop, seg, tmp)
			if last && o.rop == procgroup.Avg {
				kernels.Divide(o.dt, seg, n)
			}
			if !last || forward {
				next.enqueue(seq, seg)
			}
			a += l
		}
	}
	return nil
}

// pairAllReduce is the socket all-reduce of two ranks. There the ring's two phases move the
// same bytes as one exchange (each rank sends its whole buffer once), but the all-gather
// must wait for the reduce-scatter; the exchange has no such bubble. Every segment is
// queued at once; each one received is combined with ours once ours has been written out.
// Both ranks compute (rank 0's) op (rank 1's), operands in that order, so the bits agree
// for every op, NaNs and signed zeros included (rank 1 uses kernels.ReduceInto).
func (g *group) pairAllReduce(o *op) error {
	seq, p := uint32(o.seq), g.peers[1-g.rank]
	g.seg = g.ringSegment(len(o.buf))
	mark := p.issued
	for a := 0; a < len(o.buf); a += g.segLen(len(o.buf), a) {
		p.enqueue(seq, o.buf[a:a+g.segLen(len(o.buf), a)])
	}
	for a, j := 0, 1; a < len(o.buf); j++ {
		l := g.segLen(len(o.buf), a)
		seg, tmp := o.buf[a:a+l], g.tmp[:l]
		if err := g.recv(p, seq, tmp); err != nil {
			return err
		}
		if err := g.waitDone(p, mark+j); err != nil {
			return err
		}
		if g.rank == 0 {
			kernels.Reduce(o.dt, o.rop, seg, tmp)
		} else {
			kernels.ReduceInto(o.dt, o.rop, seg, tmp, seg)
		}
		if o.rop == procgroup.Avg {
			kernels.Divide(o.dt, seg, 2)
		}
		a += l
	}
	return nil
}

// ringAllGather circulates the chunks of w on ring v; each position starts owning its
// chunk. With queued, the owned chunk's sends were already queued by ringReduceScatter,
// whose step marks (g.marks) it uses.
func (g *group) ringAllGather(seq uint32, w []byte, queued bool, v *ringView) error {
	n, r := v.n, v.pos
	next, prev := v.peer(g, 1), v.peer(g, -1)
	if !queued {
		own := v.chunk(w, r)
		for a := 0; a < len(own); a += g.segLen(len(own), a) {
			next.enqueue(seq, own[a:a+g.segLen(len(own), a)])
		}
	}
	for s := 0; s < n-1; s++ {
		c := v.chunk(w, r-1-s)
		for a, j := 0, 0; a < len(c); j++ {
			l := g.segLen(len(c), a)
			seg := c[a : a+l]
			if queued {
				// After a reduce-scatter, chunk r-1-s went out at its step s, and that
				// send must be written before the chunk is overwritten (Note [Ring]).
				if err := g.waitDone(next, g.marks[s]+j+1); err != nil {
					return err
				}
			}
			if err := g.recv(prev, seq, seg); err != nil {
				return err
			}
			if s < n-2 {
				next.enqueue(seq, seg)
			}
			a += l
		}
	}
	return nil
}

// sendAll sends data to p as segments: inline when small, else through p's writer.
func (g *group) sendAll(p *peer, seq uint32, data []byte) error {
	if len(data) <= g.cfg.InlineMaxBytes {
		return g.sendInline(p, seq, data)
	}
	for a := 0; a < len(data); a += g.segLen(len(data), a) {
		p.enqueue(seq, data[a:a+g.segLen(len(data), a)])
	}
	return nil
}

// recvAll receives len(dst) bytes from p, segmented as sendAll sends them.
func (g *group) recvAll(p *peer, seq uint32, dst []byte) error {
	if len(dst) <= g.cfg.InlineMaxBytes {
		return g.recv(p, seq, dst)
	}
	for a := 0; a < len(dst); a += g.segLen(len(dst), a) {
		if err := g.recv(p, seq, dst[a:a+g.segLen(len(dst), a)]); err != nil {
			return err
		}
	}
	return nil
}

// broadcast: direct from the root for small messages, else a pipelined chain
// root → root+1 → … → root-1.
func (g *group) broadcast(o *op) error {
	n, r, seq := g.size, g.rank, uint32(o.seq)
	if g.useDirect(len(o.buf)) {
		if r == o.root {
			for j := 1; j < n; j++ {
				if err := g.sendAll(g.peers[(r+j)%n], seq, o.buf); err != nil {
					return err
				}
			}
			return g.waitSends()
		}
		return g.recvAll(g.peers[o.root], seq, o.buf)
	}
	v := (g.pos - slices.Index(g.ring, o.root) + n) % n // Note [Ring order]
	var next *peer
	if v < n-1 {
		next = g.flat.peer(g, 1)
	}
	if v == 0 {
		for a := 0; a < len(o.buf); a += g.segLen(len(o.buf), a) {
			next.enqueue(seq, o.buf[a:a+g.segLen(len(o.buf), a)])
		}
		return g.waitSends()
	}
	prev := g.flat.peer(g, -1)
	for a := 0; a < len(o.buf); {
		l := g.segLen(len(o.buf), a)
		seg := o.buf[a : a+l]
		if err := g.recv(prev, seq, seg); err != nil {
			return err
		}
		if next != nil {
			next.enqueue(seq, seg)
		}
		a += l
	}
	return g.waitSends()
}
