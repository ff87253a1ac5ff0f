package gloo

import (
	"fmt"
	"math"

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
//   - shm-vm (Note [Single copy]): the n-1 peers' chunks r read once each, one's own read
//     and written once (a block stays in cache while every peer's is reduced in), n-1
//     chunks copied from the peers (2c each): (3n-1)/n, all but 2c of it the kernel's;
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
		if g.inPlaceOK() && (g.ownsShared(b) || g.isAdopted(b)) {
			return "shm-inplace", 2
		}
		if g.cmaFor(procgroup.OpAllReduce, len(b)) { // Note [Single copy]
			return "shm-vm", (3*n - 1) / n
		}
	case "hierarchical":
		L, H := float64(g.local.n), float64(g.cross.n)
		if g.hostInPlaceOK() && (g.ownsShared(b) || g.isAdopted(b)) { // Note [Host phases in place]
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
			return g.adopting(o, g.shmAllReduce)
		case "hierarchical":
			return g.adopting(o, g.hierAllReduce)
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
		g.lastPath = ""
		if n == 1 || len(o.buf) == 0 {
			return nil
		}
		if g.peerReadFor(o.kind, len(o.buf)) {
			if done, err := g.peerBroadcast(o); done {
				return err
			}
		}
		return g.broadcast(o)
	case procgroup.OpAllGather:
		g.lastPath = ""
		if slot := o.buf[g.rank*len(o.in):]; len(o.in) > 0 && &slot[0] != &o.in[0] { // not in place
			copy(slot, o.in)
		}
		if n == 1 || len(o.in) == 0 {
			return nil
		}
		if g.peerReadFor(o.kind, len(o.buf)) {
			if done, err := g.peerAllGather(o); done {
				return err
			}
		}
		if g.useDirect(len(o.buf)) {
			return g.directAllGather(o)
		}
		if g.useHier() {
			return g.hierAllGather(o)
		}
		g.setBlocks(len(o.in))
		if err := g.ringAllGather(uint32(o.seq), o.buf, false, &g.flat); err != nil {
			return err
		}
		return g.waitSends()
	case procgroup.OpReduceScatter:
		g.lastPath = ""
		if n == 1 {
			copy(o.buf, o.in)
			return nil
		}
		if len(o.buf) == 0 {
			return nil
		}
		if g.peerReadFor(o.kind, len(o.in)) {
			if done, err := g.peerReduceScatter(o); done {
				return err
			}
		}
		if g.useDirect(len(o.in)) {
			return g.directReduceScatter(o)
		}
		if g.useHier() {
			return g.hierReduceScatter(o)
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
