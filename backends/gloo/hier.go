package gloo

import (
	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// Note [Hierarchical]: when the group spans hosts that each run the same number L ≥ 2
// of its ranks, an all-reduce above DirectMaxBytes (with GODDP_GLOO_ALGO auto or
// hierarchical) runs in three rings: a reduce-scatter among the L ranks of each host,
// leaving local rank l the host's sum of chunk l of L; an all-reduce of that chunk among
// the H ranks with local index l, one per host, all L of them at once; and an all-gather
// among each host's ranks. Between hosts each rank sends 2(H-1)/H of its 1/L chunk, so a
// host's link carries 2(H-1)/H of the message each way, against 2(n-1)/n·(number of ring
// crossings) for the flat ring: 1 against 1.5 messages at 2 hosts × 2 ranks. Avg reduces
// as Sum and divides once, by n, after the middle ring. The host rings run through the
// host's shared-memory slots (shmRing) when its ranks are exactly the region's members
// (group.hostShm), else over the sockets; each host's own choice, since its host rings
// touch no other host, but what crosses hosts is the group's (Note [Agreement]). The flat
// ring remains for GODDP_GLOO_ALGO=ring and for uneven placements.

// setupHier prepares Note [Hierarchical]'s rings when the placement allows them.
func (g *group) setupHier() {
	var hosts [][]int // ranks by host, in ring order (g.ring keeps each host's together)
	for i, r := range g.ring {
		if i == 0 || g.hostIDs[r] != g.hostIDs[g.ring[i-1]] {
			hosts = append(hosts, nil)
		}
		hosts[len(hosts)-1] = append(hosts[len(hosts)-1], r)
	}
	L, H := len(hosts[0]), len(hosts)
	if H < 2 || L < 2 {
		return
	}
	for _, h := range hosts {
		if len(h) != L {
			return
		}
	}
	ids := func(k int) []int {
		s := make([]int, k)
		for i := range s {
			s[i] = i
		}
		return s
	}
	myHost, myLocal := g.pos/L, g.pos%L
	cross := make([]int, H)
	for h := range hosts {
		cross[h] = hosts[h][myLocal]
	}
	g.hierAt = make([]int, g.size)
	for h := range hosts {
		for l, r := range hosts[h] {
			g.hierAt[r] = l*H + h // Note [Hierarchical blocks]
		}
	}
	g.local = ringView{n: L, pos: myLocal, ranks: hosts[myHost], ids: ids(L), offs: make([]int, L+1)}
	g.cross = ringView{n: H, pos: myHost, ranks: cross, ids: ids(H), offs: make([]int, H+1)}
	g.hier = true
}

// useHier reports whether an all-reduce that takes a ring takes Note [Hierarchical]'s.
func (g *group) useHier() bool {
	return g.hier && (g.cfg.Algorithm == AlgoAuto || g.cfg.Algorithm == AlgoHier)
}

// hierAllReduce is the all-reduce of Note [Hierarchical].
func (g *group) hierAllReduce(o *op) error {
	sum := &g.hierSum
	*sum = *o
	if o.rop == procgroup.Avg {
		sum.rop = procgroup.Sum
	}
	inPlace, err := g.hierPost(o) // Note [Host phases in place]
	if err != nil {
		return err
	}
	if inPlace || g.hostShm {
		return g.hierPipeline(o, inPlace)
	}
	es := o.dt.Size()
	splitChunks(g.local.offs, len(o.buf)/es, es)
	seq := uint32(o.seq)
	g.seg = g.ringSegment(len(o.buf))
	if err := g.ringReduceScatter(sum, seq, o.buf, false, &g.local); err != nil {
		return err
	}
	// The all-gather below overwrites the chunks the reduce-scatter sent.
	if err := g.waitSends(); err != nil {
		return err
	}
	if err := g.crossAllReduce(crossJob{sum, g.local.chunk(o.buf, g.local.pos), o.rop == procgroup.Avg}); err != nil {
		return err
	}
	if err := g.ringAllGather(seq, o.buf, false, &g.local); err != nil {
		return err
	}
	return g.waitSends()
}

// Note [Hierarchical pipeline]: where the host phases run through shared memory (the
// slots, or in place), the message is cut into pieces of about Config.HierPieceSize bytes
// (at most hierMaxPieces), each all-reduced as in Note [Hierarchical], and the host phases
// of one piece overlap the middle ring of another: the worker sums piece k on its host
// and queues its middle ring, then (while that crosses the link) sums piece k+1 and
// queues it, then waits for piece k and shares it on its host, and so on; a goroutine of
// its own (crossWorker) runs the queued middle rings in order. Without it, the link idles
// while a host sums and shares, and each host phase took about a third of the middle
// ring's time on the testbed at 10 Gbit/s. Only shared memory is touched by the worker
// meanwhile, so the sockets' worker-side state (g.tmp, g.marks, g.timer, the cross peers'
// reads and queues) belongs to crossWorker until the last piece is back. Every rank cuts
// the same pieces from the message's length and the group's piece (group.piece), so the
// rings match across hosts. Where a host lacks shared memory, its host rings need the
// sockets that crossWorker holds meanwhile, so the group cuts no pieces (Note
// [Agreement]). Each host's ranks run the same sequence of host phases, so its slot
// streams match too. A failure on either side aborts the group (which closes the
// connections under a blocked read), and the worker collects every queued piece before
// it returns.

// hierMaxPieces bounds Note [Hierarchical pipeline]'s pieces per all-reduce (and sizes the
// queues to crossWorker, so that neither side ever blocks on a send).
const hierMaxPieces = 16

// crossJob is one middle ring of Note [Hierarchical]: w (this rank's sum of its local
// chunk, or of a piece's) is all-reduced with o among the ranks with this rank's local
// index; with avg the result is then divided by the group's size.
type crossJob struct {
	o   *op
	w   []byte
	avg bool
}

// crossAllReduce runs job j.
func (g *group) crossAllReduce(j crossJob) error {
	es, seq := j.o.dt.Size(), uint32(j.o.seq)
	splitChunks(g.cross.offs, len(j.w)/es, es)
	if err := g.ringReduceScatter(j.o, seq, j.w, true, &g.cross); err != nil {
		return err
	}
	if err := g.ringAllGather(seq, j.w, true, &g.cross); err != nil {
		return err
	}
	// The cross ring sends only to its next rank; w is the caller's once that is written.
	next := g.cross.peer(g, 1)
	if err := g.waitDone(next, next.issued); err != nil {
		return err
	}
	if j.avg {
		kernels.Divide(j.o.dt, j.w, g.size)
	}
	return nil
}

// crossWorker runs Note [Hierarchical pipeline]'s middle rings as the worker queues them,
// until the worker closes the queue.
func (g *group) crossWorker() {
	defer g.wg.Done()
	for j := range g.crossJobs {
		g.crossDone <- g.crossAllReduce(j)
	}
}

// hierPipeline is hierAllReduce with Note [Hierarchical pipeline]: the host phases in
// place (inPlace: every buffer of the host is in its arena, and posted) or through the
// host's slots.
func (g *group) hierPipeline(o *op, inPlace bool) error {
	g.lastPath = "hierarchical"
	if inPlace {
		g.lastPath = "hierarchical-inplace"
	}
	sum, es, L := &g.hierSum, o.dt.Size(), g.local.n
	count := len(o.buf) / es
	P := 1
	if ps := g.piece; ps > 0 { // Note [Agreement]
		P = min(hierMaxPieces, max(1, len(o.buf)/ps))
	}
	// piece k holds elements k·count/P … (k+1)·count/P-1; it starts at byte at. Its local
	// chunks go into g.local.offs, relative to at.
	piece := func(k int) (at int, b []byte) {
		lo, hi := k*count/P*es, (k+1)*count/P*es
		splitChunks(g.local.offs, (hi-lo)/es, es)
		return lo, o.buf[lo:hi]
	}
	g.seg = g.ringSegment(len(o.buf) / P)
	sent, got := 0, 0
	var err error
	for k := 0; k <= P && err == nil; k++ {
		if k < P { // sum piece k on this host, and send it across
			at, b := piece(k)
			if inPlace {
				err = g.hostReduce(sum, b, at)
			} else {
				err = g.shmRing(sum, b, &g.local, 0, L-1)
			}
			if err == nil {
				g.crossJobs <- crossJob{sum, g.local.chunk(b, g.local.pos), o.rop == procgroup.Avg}
				sent++
			}
		}
		if k > 0 && err == nil { // piece k-1 is back: share it on this host
			err = <-g.crossDone
			got++
			if err == nil {
				at, b := piece(k - 1)
				if inPlace {
					err = g.hostBroadcast(b, at)
				} else {
					err = g.shmRing(o, b, &g.local, L-1, 2*L-2)
				}
			}
		}
	}
	if err != nil {
		g.abort(g.opErr(o, err)) // a read crossWorker is blocked in returns
		for ; got < sent; got++ {
			<-g.crossDone
		}
		return err
	}
	if inPlace {
		return g.shmPhase(o.seq<<2 | 3)
	}
	return nil
}

// Note [Hierarchical blocks]: on the same placements, a reduce-scatter or an all-gather
// above DirectMaxBytes takes two rings too. The message's n blocks (one per rank) are
// copied into scratch in another order, local index major and host minor, so that the
// blocks of the ranks with local index l (one per host) make chunk l. The reduce-scatter
// then runs among each host's L ranks, over those chunks, leaving local rank l the host's
// sum of chunk l, and then among the H ranks with local index l, over chunk l's H blocks,
// leaving each rank the sum of its own; the all-gather runs the same rings the other way
// round and copies the blocks back into rank order. The host rings take the host's
// shared-memory slots where the all-reduce's host phases do (hostBlocks). Between hosts each rank sends (H-1)/H
// of its chunk, L/n of the message, so a host's link carries (H-1)/H of the message each
// way: half of it at two hosts, against three quarters for the flat ring at 2 hosts × 2
// ranks, which crosses the link twice per direction. ZeRO's stage 2 pays for its
// reduce-scatter and all-gather together what the all-reduce pays (Note [ZeRO] in
// package ddp). The copies cost one pass over the message each way; the link's time at
// these sizes is far more. Avg reduces as Sum and divides the rank's block once, by n.

// hierReduceScatter is the reduce-scatter of Note [Hierarchical blocks].
func (g *group) hierReduceScatter(o *op) error {
	g.lastPath = "hierarchical"
	blk, H := len(o.buf), g.cross.n
	w := g.scratch(len(o.in))
	for r, at := range g.hierAt {
		copy(w[at*blk:(at+1)*blk], o.in[r*blk:(r+1)*blk])
	}
	sum := &g.hierSum
	*sum = *o
	if o.rop == procgroup.Avg {
		sum.rop = procgroup.Sum
	}
	g.hierBlocks(blk, H)
	seq := uint32(o.seq)
	if err := g.hostBlocks(sum, seq, w, true); err != nil {
		return err
	}
	c := g.local.chunk(w, g.local.pos)
	if err := g.ringReduceScatter(sum, seq, c, false, &g.cross); err != nil {
		return err
	}
	if err := g.waitSends(); err != nil {
		return err
	}
	copy(o.buf, g.cross.chunk(c, g.cross.pos))
	if o.rop == procgroup.Avg {
		kernels.Divide(o.dt, o.buf, g.size)
	}
	return nil
}

// hierAllGather is the all-gather of Note [Hierarchical blocks].
func (g *group) hierAllGather(o *op) error {
	g.lastPath = "hierarchical"
	blk, H := len(o.in), g.cross.n
	w := g.scratch(len(o.buf))
	g.hierBlocks(blk, H)
	c := g.local.chunk(w, g.local.pos)
	copy(g.cross.chunk(c, g.cross.pos), o.in)
	seq := uint32(o.seq)
	if err := g.ringAllGather(seq, c, false, &g.cross); err != nil {
		return err
	}
	if err := g.waitSends(); err != nil {
		return err
	}
	if err := g.hostBlocks(o, seq, w, false); err != nil {
		return err
	}
	for r, at := range g.hierAt {
		copy(o.buf[r*blk:(r+1)*blk], w[at*blk:(at+1)*blk])
	}
	return nil
}

// hostBlocks runs Note [Hierarchical blocks]' host ring over w with o: the reduce-scatter
// (rs) or the all-gather. It runs through the host's shared-memory slots where the host's
// ranks are the region's members (hostShm, which every rank of a host agrees on: Note
// [Agreement]), as the all-reduce's host phases do, and over the sockets otherwise.
func (g *group) hostBlocks(o *op, seq uint32, w []byte, rs bool) error {
	L := g.local.n
	switch {
	case g.hostShm && rs:
		return g.shmRing(o, w, &g.local, 0, L-1)
	case g.hostShm:
		return g.shmRing(o, w, &g.local, L-1, 2*L-2)
	case rs:
		if err := g.ringReduceScatter(o, seq, w, false, &g.local); err != nil {
			return err
		}
	default:
		if err := g.ringAllGather(seq, w, false, &g.local); err != nil {
			return err
		}
	}
	return g.waitSends()
}

// hierBlocks sets the host ring's chunks to H blocks of blk bytes each, and the cross
// ring's to one block each.
func (g *group) hierBlocks(blk, H int) {
	for i := range g.local.offs {
		g.local.offs[i] = i * H * blk
	}
	for i := range g.cross.offs {
		g.cross.offs[i] = i * blk
	}
}
