package gloo

import (
	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// Note [One association]: the all-reduces that combine whole buffers (direct, shm-direct
// and recursive doubling) all combine the n buffers in one association, a balanced tree
// over the ring positions (Note [Ring order]) with lower positions as left operands: with
// p the largest power of two ≤ n and e = n-p, positions 2v and 2v+1 (v < e) are folded
// first, leaving p operands, and those are combined pairwise, then the pairs pairwise, and
// so on. That is the order in which recursive doubling meets its partners, so the three
// give the same bits wherever they run, and the cost model (Note [Algorithm choice]) can
// pick any of them for a message without changing a result. (For n = 2 it is a0 op a1,
// which is also what the two-rank exchange computes.)

// treeAcc combines buffers given in position order, 0 to n-1, in Note [One association]:
// a stack of partial results, each covering 2^level leaves of the tree.
type treeAcc struct {
	dt    procgroup.DType
	op    procgroup.ReduceOp
	n, e  int
	next  int        // the position of the next buffer
	stack []treeNode // partial results, their levels strictly decreasing
	free  [][]byte   // spare buffers of the message's length
	all   [][]byte   // every buffer handed out, kept across collectives (capacity ≥ l)
	l     int
}

type treeNode struct {
	b     []byte
	level int // -1: the first of a folded pair, waiting for the second
}

// foldSplit is Note [One association]'s shape for n operands: p, the largest power of two
// ≤ n, and e = n-p, the pairs folded first. treeAcc and rdAllReduce must agree on it.
func foldSplit(n int) (p, e int) {
	p = 1
	for p*2 <= n {
		p *= 2
	}
	return p, n - p
}

// reset starts a combination of n buffers of l bytes.
func (t *treeAcc) reset(dt procgroup.DType, op procgroup.ReduceOp, n, l int) {
	_, e := foldSplit(n)
	t.dt, t.op, t.n, t.e, t.next = dt, op, n, e, 0
	t.stack, t.free, t.l = t.stack[:0], t.free[:0], l
	for _, b := range t.all {
		if cap(b) < l {
			t.all = t.all[:0] // a larger message: new buffers from here on
			break
		}
	}
	for _, b := range t.all {
		t.free = append(t.free, b[:l])
	}
}

// slot returns a buffer of l bytes for the next position's data; push takes it back filled.
func (t *treeAcc) slot() []byte {
	if k := len(t.free); k > 0 {
		b := t.free[k-1]
		t.free = t.free[:k-1]
		return b
	}
	b := kernels.Aligned(t.l)
	t.all = append(t.all, b)
	return b[:t.l]
}

// push adds the next position's buffer b (from slot) and combines what the tree allows.
func (t *treeAcc) push(b []byte) {
	pos := t.next
	t.next++
	if pos < 2*t.e {
		if pos%2 == 0 {
			t.stack = append(t.stack, treeNode{b, -1})
			return
		}
		top := &t.stack[len(t.stack)-1]
		kernels.Reduce(t.dt, t.op, top.b, b)
		t.free = append(t.free, b)
		top.level = 0
	} else {
		t.stack = append(t.stack, treeNode{b, 0})
	}
	for k := len(t.stack); k >= 2 && t.stack[k-1].level == t.stack[k-2].level; k-- {
		lo, hi := &t.stack[k-2], t.stack[k-1]
		kernels.Reduce(t.dt, t.op, lo.b, hi.b)
		t.free = append(t.free, hi.b)
		lo.level++
		t.stack = t.stack[:k-1]
	}
}

// result is the combination of all n buffers (after the n-th push).
func (t *treeAcc) result() []byte {
	if t.next != t.n || len(t.stack) != 1 {
		panic("gloo: treeAcc: result before every position was pushed")
	}
	return t.stack[0].b
}

// Note [Recursive doubling]: for small messages across hosts, log2(p) rounds instead of
// direct's n-1 messages per rank: in round d = 1, 2, 4, … each rank exchanges its whole
// partial result with the rank whose virtual position differs in bit d, and both combine
// them, the lower position's on the left (Note [One association]). When n is not a power
// of two, the first 2e positions fold in pairs before the rounds (the even one sends its
// buffer to the odd one and waits) and get the result back after them. Positions are ring
// positions, so the first rounds stay inside a host and the last ones cross between hosts.

// rdAllReduce is the all-reduce of Note [Recursive doubling].
func (g *group) rdAllReduce(o *op) error {
	n, pos, seq := g.size, g.pos, uint32(o.seq)
	p, e := foldSplit(n)
	at := func(q int) *peer { return g.peers[g.ring[q]] }
	if pos < 2*e && pos%2 == 0 {
		// Folded: hand the buffer to the odd partner, which returns the result.
		if err := g.sendAll(at(pos+1), seq, o.buf); err != nil {
			return err
		}
		if err := g.waitSends(); err != nil {
			return err
		}
		return g.recvAll(at(pos+1), seq, o.buf)
	}
	tmp := g.scratch(len(o.buf))
	if pos < 2*e {
		if err := g.recvAll(at(pos-1), seq, tmp); err != nil {
			return err
		}
		kernels.ReduceInto(o.dt, o.rop, o.buf, tmp, o.buf)
	}
	v := pos - e
	if pos < 2*e {
		v = pos / 2
	}
	real := func(u int) int {
		if u < e {
			return 2*u + 1
		}
		return u + e
	}
	for d := 1; d < p; d <<= 1 {
		u := v ^ d
		q := at(real(u))
		if err := g.sendAll(q, seq, o.buf); err != nil {
			return err
		}
		if err := g.recvAll(q, seq, tmp); err != nil {
			return err
		}
		// The sends must be written before the buffer changes under them.
		if err := g.waitSends(); err != nil {
			return err
		}
		if v < u {
			kernels.Reduce(o.dt, o.rop, o.buf, tmp)
		} else {
			kernels.ReduceInto(o.dt, o.rop, o.buf, tmp, o.buf)
		}
	}
	if o.rop == procgroup.Avg {
		kernels.Divide(o.dt, o.buf, n)
	}
	if pos < 2*e {
		if err := g.sendAll(at(pos-1), seq, o.buf); err != nil {
			return err
		}
	}
	return g.waitSends()
}
