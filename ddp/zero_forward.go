package ddp

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
)

// Note [ZeRO forward overlap]: with Options.ZeroForwardOverlap, Step steps the shard as
// without it and issues every bucket's all-gather of the parameters, but returns without
// waiting for them: they run while the trainer begins the next step's forward, which waits
// for each bucket's parameters where it first reads one of them (WaitParams). That is the
// part of the wire time that Note [ZeRO overlap] cannot hide, since an all-gather there can
// only follow its bucket's reduction, and the last buckets' reductions end with backward.
//
// The buckets hold the parameters in reverse order (Note [Rebuild] in package reducer), so
// the last bucket holds the first layers, which forward needs first: the all-gathers are
// issued from bucket B−1 down to bucket 0, the same order on every rank (it depends on the
// bucket count alone), and forward finds them arriving in the order it reads them.
// WaitParams(i) waits for the all-gather of parameter i's bucket and copies every
// parameter of that bucket into Param.Data, once; a later call for the bucket returns at
// once. gorgoniaddp's taps call it in forward, before they copy their parameter, so a
// gorgonia model needs no change.
//
// What the trainer may do changes, hence the option: between Step and the WaitParams of a
// parameter, its Param.Data holds the old values, so the trainer must call WaitParams
// before it reads it (WaitParams with no index waits for all, for a checkpoint or an
// evaluation), and what it writes there first is overwritten by the copy. What nothing
// read, the unused parameters, is completed by the next Finalize (of a synced pass or
// not), and by GatherOptimizerState and Close, which wait for every all-gather left
// (Close within the process group's timeout between steps; in a synced pass, where a
// forward may be waiting on a peer that has stopped, it aborts the group first, as it
// does for the pass's reductions). The waits hold no lock, so Close from another
// goroutine is not held up by a forward's wait, and a bucket's copy is counted done only
// once it is made, so a concurrent WaitParams never returns before it. Nothing else
// changes: the reductions of the next backward queue behind the all-gathers on the group,
// in the same order on every rank, and write other memory (the buckets); the shard that
// the all-gathers read is written only by the next Step, after a Finalize has completed
// them. The bits are those of Step without the option.
//
// A failed all-gather fails the DDP (WaitParams returns the error, as does every later
// call); so does the end of WaitParams's ctx before its all-gather completes.

// gatherState holds the all-gathers that Step left in flight, in zeroSeg.work. A bucket's
// work is cleared, and pending counted down, only after its parameters are copied out, so
// that pending = 0 (read without mu) means every copy is done and visible.
type gatherState struct {
	mu      sync.Mutex   // guards zeroSeg.work and the copies out; not held while waiting
	pending atomic.Int32 // buckets whose all-gather is issued and not yet copied out
	segOf   []int        // parameter i's bucket, made with the shard before pending is set
}

// issueGathers issues every bucket's all-gather of the stepped shard, last bucket first,
// and returns without waiting (Note [ZeRO forward overlap]).
func (d *DDP) issueGathers() {
	z := d.zero
	g := &z.gather
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.segOf == nil {
		g.segOf = make([]int, len(d.params))
		for b := range z.segs {
			for _, i := range z.segs[b].bk.Params {
				g.segOf[i] = b
			}
		}
	}
	for b := len(z.segs) - 1; b >= 0; b-- {
		seg := &z.segs[b]
		// Not Step's ctx: the all-gather outlives Step. The group's timeout and Abort
		// bound it.
		seg.work = d.pg.AllGather(context.Background(), seg.all, z.shardP[seg.off:seg.off+seg.blk])
	}
	g.pending.Store(int32(len(z.segs)))
}

// WaitParams returns once the parameters with the given indices (every parameter, with
// none) hold this step's values in Param.Data: with Options.ZeroForwardOverlap it waits
// for their buckets' all-gathers that Step left in flight and copies them out (Note [ZeRO
// forward overlap]); otherwise, or once they are in place, it returns at once. It is safe
// for concurrent use (gorgoniaddp's taps call it from the goroutine that runs forward). An
// index out of range is an error wrapping ErrInvalidArgument and changes nothing; a
// failed all-gather, or ctx ending first, fails the DDP, and once it has failed WaitParams
// returns its error.
func (d *DDP) WaitParams(ctx context.Context, params ...int) error {
	for _, i := range params {
		if i < 0 || i >= len(d.params) {
			return fmt.Errorf("%w: WaitParams(%d): the DDP has %d parameters", ErrInvalidArgument, i, len(d.params))
		}
	}
	z := d.zero
	if z == nil || !z.forward {
		return nil
	}
	if d.failed.Load() {
		return d.Err()
	}
	if z.gather.pending.Load() == 0 {
		return nil
	}
	if err := d.waitGathers(ctx, params); err != nil {
		return d.fail(err)
	}
	return nil
}

// ForwardOverlap reports whether Step may leave the parameters' all-gathers in flight
// (Options.ZeroForwardOverlap with more than one rank), so that the trainer must call
// WaitParams before it reads Param.Data.
func (d *DDP) ForwardOverlap() bool { return d.zero != nil && d.zero.forward }

// waitGathers waits for the all-gathers in flight of the given parameters' buckets (all,
// with none) and copies each into Param.Data, last bucket first.
func (d *DDP) waitGathers(ctx context.Context, params []int) error {
	z := d.zero
	if len(params) == 0 {
		for b := len(z.segs) - 1; b >= 0; b-- {
			if err := d.collectGather(ctx, b); err != nil {
				return err
			}
		}
		return nil
	}
	for _, i := range params {
		if err := d.collectGather(ctx, z.gather.segOf[i]); err != nil {
			return err
		}
	}
	return nil
}

// collectGather waits for bucket b's all-gather, if it is in flight, and copies it into
// Param.Data once, whichever goroutine gets there first. The wait holds no lock, so Close
// can abort the group under a forward that waits. A failed all-gather stays in flight
// (the DDP fails, and later calls return its error).
func (d *DDP) collectGather(ctx context.Context, b int) error {
	g, seg := &d.zero.gather, &d.zero.segs[b]
	g.mu.Lock()
	w := seg.work
	g.mu.Unlock()
	if w == nil {
		return nil
	}
	if err := w.Wait(ctx); err != nil {
		return fmt.Errorf("zero: all-gather of bucket %d's parameters: %w", b, err)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if seg.work == w { // not copied out by another goroutine meanwhile
		d.scatterParams(seg, seg.all)
		seg.work = nil
		g.pending.Add(-1)
	}
	return nil
}

// completeGathers is waitGathers for every bucket where Options.ZeroForwardOverlap may
// have left all-gathers in flight: what Finalize and GatherOptimizerState run first.
func (d *DDP) completeGathers(ctx context.Context) error {
	if z := d.zero; z == nil || !z.forward || z.gather.pending.Load() == 0 {
		return nil
	}
	return d.waitGathers(ctx, nil)
}

// drainGathers is Close's completeGathers: it waits for every all-gather still in flight
// (bounded by the group's timeout, or by the abort Close issued first), copies out those
// that succeeded, and drops the errors.
func (d *DDP) drainGathers() {
	z := d.zero
	if z == nil || !z.forward || z.gather.pending.Load() == 0 {
		return
	}
	for b := len(z.segs) - 1; b >= 0; b-- {
		_ = d.collectGather(context.Background(), b)
	}
}
