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
// evaluation). What nothing read, the unused parameters, is completed by the next
// Finalize (of a synced pass or not), and by GatherOptimizerState and Close, which wait
// for every all-gather left (Close within the process group's timeout). Nothing else
// changes: the reductions of the next backward queue behind the all-gathers on the group,
// in the same order on every rank, and write other memory (the buckets); the shard that
// the all-gathers read is written only by the next Step, after a Finalize has completed
// them. The bits are those of Step without the option.
//
// A failed all-gather fails the DDP (WaitParams returns the error, as does every later
// call); so does the end of WaitParams's ctx before its all-gather completes.

// gatherState holds the all-gathers that Step left in flight, in zeroSeg.work.
type gatherState struct {
	mu      sync.Mutex   // held while an all-gather is waited for and copied out
	pending atomic.Int32 // buckets whose all-gather is issued and not yet copied out
	segOf   []int        // parameter i's bucket, made with the shard
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
// to call from the goroutine that runs forward (gorgoniaddp's taps call it there). An
// index out of range is an error wrapping ErrInvalidArgument and changes nothing; a
// failed all-gather, or ctx ending first, fails the DDP.
func (d *DDP) WaitParams(ctx context.Context, params ...int) error {
	for _, i := range params {
		if i < 0 || i >= len(d.params) {
			return fmt.Errorf("%w: WaitParams(%d): the DDP has %d parameters", ErrInvalidArgument, i, len(d.params))
		}
	}
	z := d.zero
	if z == nil || !z.forward || z.gather.pending.Load() == 0 {
		return nil
	}
	if err := d.Err(); err != nil {
		return err
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
	g := &z.gather
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(params) == 0 {
		for b := len(z.segs) - 1; b >= 0 && g.pending.Load() > 0; b-- {
			if err := d.collectGather(ctx, b); err != nil {
				return err
			}
		}
		return nil
	}
	for _, i := range params {
		if err := d.collectGather(ctx, g.segOf[i]); err != nil {
			return err
		}
	}
	return nil
}

// collectGather waits for bucket b's all-gather, if it is in flight, and copies it into
// Param.Data. z.gather.mu must be held.
func (d *DDP) collectGather(ctx context.Context, b int) error {
	seg := &d.zero.segs[b]
	if seg.work == nil {
		return nil
	}
	err := seg.work.Wait(ctx)
	seg.work = nil
	d.zero.gather.pending.Add(-1)
	if err != nil {
		return fmt.Errorf("zero: all-gather of bucket %d's parameters: %w", b, err)
	}
	d.scatterParams(seg, seg.all)
	return nil
}

// completeGathers is waitGathers for every bucket where Options.ZeroForwardOverlap may
// have left all-gathers in flight: what Finalize, GatherOptimizerState and Close run
// first.
func (d *DDP) completeGathers(ctx context.Context) error {
	if z := d.zero; z == nil || !z.forward || z.gather.pending.Load() == 0 {
		return nil
	}
	return d.waitGathers(ctx, nil)
}
