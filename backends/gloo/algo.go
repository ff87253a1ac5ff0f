package gloo

import (
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"time"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// AllReduceAlgorithm names the path run takes for an all-reduce of buf (every rank passing
// the same kind of buffer), and the bytes of the ranks' buffers it reads and writes per
// rank, per message byte (procgroup.AlgorithmReporter). Slots, segments and scratch are
// small and stay in cache. With chunks c = bytes/n:
//   - shm-ring, ring, pair: each of the n-1 reduce-scatter steps reads the chunk it sends
//     and reads and writes the chunk it reduces into (3c); each of the n-1 all-gather
//     steps reads the chunk it sends and writes the one it receives (2c): 5(n-1)/n;
//   - shm-inplace (Note [One pass]): chunk r of every buffer read once and written once:
//     2, whatever n;
//   - shm-vm: n-1 reductions of a peer's chunk into one's own (3c each), n-1 chunks copied
//     from the peers (2c each): 5(n-1)/n, as the ring; it saves the copies through the
//     slots, not buffer traffic;
//   - shm-direct, direct: the buffer is read once per peer it goes to and once into the
//     accumulator, and written once with the result: n+1;
//   - hierarchical-inplace (Note [Host phases in place]), L ranks on each of H hosts:
//     (L+1)/L to sum the host's chunk, 5(H-1)/H of it across hosts, 2(L-1)/L to copy it
//     to the host's other buffers.
func (g *group) AllReduceAlgorithm(buf any) (name string, traffic float64) {
	b, dt, _, err := kernels.Bytes(buf)
	if err != nil {
		return "invalid", 0
	}
	n := float64(g.size)
	ring := 5 * (n - 1) / n
	switch name = g.allReducePath(dt, len(b)); name {
	case "none", "widened":
		return name, 0
	case "shm-direct", "direct":
		return name, n + 1
	case "rd":
		return name, 5 * math.Ceil(math.Log2(n)) // per round: send, receive, combine
	case "shm-ring":
		if g.inPlaceOK() && g.ownsShared(b) {
			return "shm-inplace", 2
		}
		if g.inPlaceOK() && g.cfg.VMReadv { // when every peer sets it too
			return "shm-vm", ring
		}
	case "hierarchical":
		L, H := float64(g.local.n), float64(g.cross.n)
		if g.hostInPlaceOK() && g.ownsShared(b) { // Note [Host phases in place]
			return "hierarchical-inplace", (L + 1 + 5*(H-1)/H + 2*(L-1)) / L
		}
		return name, (5*(L-1) + 5*(H-1)/H) / L
	}
	return name, ring
}

// widened reports whether dt is reduced through float32 (runWide): bfloat16 and float16.
func widened(dt procgroup.DType) bool { return dt == procgroup.BFloat16 || dt == procgroup.Float16 }

// allReducePath names the path run takes for an all-reduce of n bytes of dt: the one
// dispatch that run and AllReduceAlgorithm share. ("shm-ring" runs in place when every
// rank's buffer is in its arena: Note [Shared buffers].)
func (g *group) allReducePath(dt procgroup.DType, n int) string {
	switch {
	case g.size == 1 || n == 0:
		return "none"
	case widened(dt):
		return "widened"
	case g.cfg.Algorithm == AlgoRD:
		return "rd"
	case g.model != nil && g.cfg.Algorithm == AlgoAuto:
		return g.model.choose(n) // Note [Algorithm choice]
	case g.useDirect(n) && g.useShmDirect(n):
		return "shm-direct"
	case g.useDirect(n):
		return "direct"
	}
	return g.ringPath()
}

// run executes one collective on the worker goroutine.
func (g *group) run(o *op) error {
	if err := o.ctx.Err(); err != nil {
		return err
	}
	n := g.size
	g.seg = g.cfg.SegmentSize
	if (o.kind == procgroup.OpAllReduce || o.kind == procgroup.OpReduceScatter) && n > 1 && widened(o.dt) {
		return g.runWide(o)
	}
	switch o.kind {
	case procgroup.OpAllReduce:
		path := o.force
		if path == "" {
			path = g.allReducePath(o.dt, len(o.buf))
		}
		g.lastPath = path
		switch path {
		case "none":
			return nil
		case "shm-direct":
			return g.shmDirectAllReduce(o)
		case "direct":
			return g.directAllReduce(o)
		case "shm-ring":
			return g.shmAllReduce(o)
		case "hierarchical":
			return g.hierAllReduce(o)
		case "rd":
			return g.rdAllReduce(o)
		case "pair":
			if g.inlinePair() {
				return g.inlinePairAllReduce(o)
			}
			return g.pairAllReduce(o)
		}
		es := o.dt.Size()
		g.setChunks(len(o.buf)/es, es)
		g.seg = g.ringSegment(len(o.buf))
		seq := uint32(o.seq)
		if err := g.ringReduceScatter(o, seq, o.buf, true, &g.flat); err != nil {
			return err
		}
		if err := g.ringAllGather(seq, o.buf, true, &g.flat); err != nil {
			return err
		}
		return g.waitSends()
	case procgroup.OpBroadcast:
		if n == 1 || len(o.buf) == 0 {
			return nil
		}
		return g.broadcast(o)
	case procgroup.OpAllGather:
		copy(o.buf[g.rank*len(o.in):], o.in)
		if n == 1 || len(o.in) == 0 {
			return nil
		}
		if g.useDirect(len(o.buf)) {
			return g.directAllGather(o)
		}
		g.setBlocks(len(o.in))
		if err := g.ringAllGather(uint32(o.seq), o.buf, false, &g.flat); err != nil {
			return err
		}
		return g.waitSends()
	case procgroup.OpReduceScatter:
		if n == 1 {
			copy(o.buf, o.in)
			return nil
		}
		if len(o.buf) == 0 {
			return nil
		}
		if g.useDirect(len(o.in)) {
			return g.directReduceScatter(o)
		}
		w := g.scratch(len(o.in))
		copy(w, o.in)
		g.setBlocks(len(o.buf))
		if err := g.ringReduceScatter(o, uint32(o.seq), w, false, &g.flat); err != nil {
			return err
		}
		if err := g.waitSends(); err != nil {
			return err
		}
		copy(o.buf, w[g.offs[g.rank]:g.offs[g.rank+1]])
		return nil
	case procgroup.OpBarrier:
		if n == 1 {
			return nil
		}
		for j := 1; j < n; j++ {
			if err := g.sendInline(g.peers[(g.rank+j)%n], uint32(o.seq), nil); err != nil {
				return err
			}
		}
		for j := 1; j < n; j++ {
			if err := g.recv(g.peers[(g.rank+n-j)%n], uint32(o.seq), nil); err != nil {
				return err
			}
		}
		return nil
	}
	return fmt.Errorf("%w: op %d", procgroup.ErrInvalidArgument, o.kind)
}

// runWide runs a 16-bit reduction in float32: the buffers are widened into scratch, reduced
// as float32 (on the wire too) and rounded once at the end, so the result is the float32
// reduction correctly rounded, whatever the world size and algorithm.
func (g *group) runWide(o *op) error {
	w := &g.wideOp
	*w = *o
	w.dt = procgroup.Float32
	if cap(g.wideBuf) < 2*len(o.buf) {
		g.wideBuf = kernels.Aligned(2 * len(o.buf))
	}
	w.buf = g.wideBuf[:2*len(o.buf)]
	if o.kind == procgroup.OpReduceScatter {
		if cap(g.wideIn) < 2*len(o.in) {
			g.wideIn = kernels.Aligned(2 * len(o.in))
		}
		w.in = g.wideIn[:2*len(o.in)]
		kernels.Widen(o.dt, w.in, o.in)
	} else {
		kernels.Widen(o.dt, w.buf, o.buf)
	}
	err := g.run(w)
	if err == nil {
		kernels.Narrow(o.dt, o.buf, w.buf)
	}
	*w = op{}
	return err
}

func (g *group) useDirect(bytes int) bool {
	switch g.cfg.Algorithm {
	case AlgoDirect:
		return true
	case AlgoRing:
		return false
	}
	return bytes <= g.cfg.DirectMaxBytes
}

// setChunks splits count elements of es bytes into size balanced chunks (byte offsets).
func (g *group) setChunks(count, es int) { splitChunks(g.offs, count, es) }

// splitChunks fills offs (len parts+1) with the byte offsets of count elements of es bytes
// split into parts balanced chunks.
func splitChunks(offs []int, count, es int) {
	parts := len(offs) - 1
	for i := range offs {
		offs[i] = i * count / parts * es
	}
}

// setBlocks splits a buffer into size blocks of blk bytes.
func (g *group) setBlocks(blk int) {
	for i := 0; i <= g.size; i++ {
		g.offs[i] = i * blk
	}
}

func (g *group) chunk(buf []byte, c int) []byte {
	c = ((c % g.size) + g.size) % g.size
	return buf[g.offs[c]:g.offs[c+1]]
}

func (g *group) scratch(n int) []byte {
	if cap(g.acc) < n {
		g.acc = kernels.Aligned(n)
	}
	return g.acc[:n]
}

// segLen is the length of the segment at offset a of a region of n bytes.
func (g *group) segLen(n, a int) int { return min(g.seg, n-a) }

// ringSegment is the socket all-reduce's segment for a message of n bytes: about half a
// chunk, so that even a message of one segment per chunk is pipelined (a 1 MiB all-reduce
// at n=2 would otherwise move 512 KiB frames with no overlap at all), but at least 256 KiB
// (smaller frames cost more in wake-ups than they gain in overlap, measured on TCP) and at
// most Config.SegmentSize. A multiple of 8, so segments stay aligned for every element type.
func (g *group) ringSegment(n int) int {
	return min(g.cfg.SegmentSize, max(256<<10, (n/g.size/2+7)&^7))
}

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
				g.hostReduce(sum, b, at)
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
					g.hostBroadcast(b, at)
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
