package ddp

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/ddp/optim"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/reducer"
)

// Note [ZeRO]: with Options.Zero the optimizer is sharded over the ranks, as in PyTorch's
// ZeroRedundancyOptimizer and DeepSpeed's ZeRO stages 1 and 2. The shard follows the
// bucket layout: bucket b of len_b elements is cut into n blocks of blk_b = ⌈len_b/n⌉
// (the last one short), and rank r owns block r of every bucket, so each rank owns about
// 1/n of every bucket and each shard is contiguous in its bucket's buffer. The layout is
// the one the first synced Finalize rebuilds (Note [Rebuild] in package reducer), which no
// later step changes (AutoBucketCap, whose later rebuilds would move the shards, is
// refused); the shard, and the optimizer that Options.Optimizer makes for its Σ blk_b
// elements, are made at the first Step. The optimizer must work element by element
// (package optim), so that n optimizers over the blocks compute the bits of one over
// everything.
//
// Stage 1 reduces the gradients as plain DDP does (an all-reduce per bucket, or the
// CommHook), and Step steps this rank's blocks alone: it copies them out of Param.Data and
// Param.Grad into one flat shard, steps it, and all-gathers every bucket's blocks into the
// parameters, each bucket's all-gather issued at once and copied out as it completes, in
// order. The optimizer state per rank is 1/n of plain DDP's, plus under one element per
// bucket per rank of padding. The reduction is plain DDP's, so the parameters are the same
// bits as plain DDP with the same optimizer; the all-gather comes on top, half again plain
// DDP's bytes on the wire (PyTorch's ZeroRedundancyOptimizer broadcasts the same way).
//
// Stage 2 reduce-scatters each bucket as backward completes it (a CommHook of its own,
// launched like the all-reduce, so the overlap with backward is the same), from the second
// synced pass on: the first one's buckets are all-reduced, since the rebuild at its end
// moves the buckets, and with them the blocks that Step then reads. The buckets are
// padded with zeros to a multiple of n elements (reducer Options.PadBuckets) and a rank
// receives the sum of its block only, half the all-reduce's bytes each way on a ring (and
// between hosts, with gloo's Note [Hierarchical blocks]); Step
// then all-gathers the parameters, the other half. Finalize leaves the averaged gradient in
// the rank's own blocks of Param.Grad only; the rest holds this rank's local gradient,
// divided by n, and must not be used. The memory of the full local gradient (Param.Grad and
// the buckets, which GradReady fills) is not released: what stage 2 saves is the wire's
// bytes, not gradient memory. The buckets serve twice instead: between passes the reducer
// lends them (reducer.ScratchBucket), padded to n blocks and overwritten by the next pass's
// gradients before anything reads them, and Step all-gathers the parameters into them, in
// place, so that no second copy of the model is held (stage 1's buckets are not padded, and
// the overlapped steps' all-gathers outlive the bucket's next use: those gather into
// buffers of their own). With two ranks a reduce-scatter adds the same two numbers as
// the all-reduce, and the bits are plain DDP's; with more, the ring sums a block in
// another order than the all-reduce's chunks do, and the results differ by float32
// rounding (examples/mlp's test states the bound it checks).
//
// Without Options.ZeroOverlap, Step steps the whole shard and then issues the
// all-gathers, after backward, with nothing to overlap them; with it (Note [ZeRO overlap]
// in zero_overlap.go) each bucket's block is stepped, and its all-gather issued, as soon as
// its reduction completes, in a fixed order on one goroutine, so the all-gathers queue on
// the link behind the reductions during the rest of backward, with the bits of Step
// without it. Either way Step returns once the parameters are in place, unless
// Options.ZeroForwardOverlap lets the all-gathers run into the next forward instead (Note
// [ZeRO forward overlap] in zero_forward.go). Checkpoints see the whole state, as one
// optimizer over every parameter in index order would hold it: GatherOptimizerState
// all-gathers it, SetOptimizerState takes this rank's blocks from it, at any world size.

// zeroState is the DDP's state with Options.Zero.
type zeroState struct {
	stage   int
	factory optim.Factory
	// opts are the shard's optimizers: one over the whole shard, or with overlap one per
	// bucket's block (Note [ZeRO overlap]); nil before the first Step.
	opts    []optim.Optimizer
	overlap bool                       // Options.ZeroOverlap, with more than one rank
	forward bool                       // Options.ZeroForwardOverlap, with more than one rank
	gather  gatherState                // the all-gathers Step left in flight (forward only)
	inner   reducer.CommHook           // the reduction the overlap's issuer launches
	run     *overlapRun                // the overlapped pass not yet collected by Step; guarded by mu
	cur     atomic.Pointer[overlapRun] // the same, for the hook
	passes  int                        // the overlapped passes started; guarded by mu
	segs    []zeroSeg
	shardP  []float32   // this rank's blocks of the parameters, bucket by bucket (blk each)
	shardG  []float32   // and of the averaged gradients
	starts  []int       // starts[i]: parameter i's first element in the index-order flattening
	lens    []int       // lens[i]: parameter i's element count
	elems   int         // every parameter's elements
	ready   bool        // a synced Finalize succeeded since the last Step
	rebuilt atomic.Bool // a synced Finalize has rebuilt the buckets (stage 2's hook reads it)
	pending *optim.State
}

// zeroSeg is one bucket's share of the shard.
type zeroSeg struct {
	bk     bucket.Bucket
	blk    int            // the block length, ⌈len/n⌉
	lo, hi int            // this rank's elements of the bucket, [lo, hi)
	off    int            // the block's offset in shardP and shardG
	all    []float32      // n·blk elements: the all-gather's output where no bucket is lent (gatherOut)
	work   procgroup.Work // the all-gather in flight
}

// checkZero checks Options.Zero against the other options, before any collective.
func checkZero(o *Options) error {
	switch {
	case o.Zero == 0:
		if o.ZeroOverlap || o.ZeroForwardOverlap {
			return fmt.Errorf("%w: %s without Options.Zero: set Zero 1 or 2", ErrInvalidArgument, zeroOverlapName(o))
		}
		if o.Optimizer != nil {
			return fmt.Errorf("%w: Options.Optimizer without Options.Zero: step the optimizer yourself, or set Zero 1 or 2", ErrInvalidArgument)
		}
		return nil
	case o.Zero != 1 && o.Zero != 2:
		return fmt.Errorf("%w: Options.Zero %d, want 0 (plain DDP), 1 (optimizer state sharded) or 2 (gradients reduce-scattered too)", ErrInvalidArgument, o.Zero)
	case o.Optimizer == nil:
		return fmt.Errorf("%w: Options.Zero %d needs Options.Optimizer, which makes the optimizer of this rank's shard", ErrInvalidArgument, o.Zero)
	}
	var with string
	switch {
	case o.Device:
		with = "Options.Device"
	case o.Shards > 0:
		with = "Options.Shards"
	case o.UnevenInputs:
		with = "Options.UnevenInputs"
	case o.GradientAsBucketView:
		with = "Options.GradientAsBucketView"
	case o.BucketCapMB == AutoBucketCap:
		with = "AutoBucketCap (its later rebuilds would move the shards; give BucketCapMB)"
	case reducer.IsAutoHook(o.CommHook):
		with = "AutoHook (its measured passes rebuild the buckets, which would move the shards)"
	case o.Zero == 2 && o.CommHook != nil && o.CommHook != reducer.AllReduceHook():
		with = "a CommHook at stage 2 (the buckets are reduce-scattered instead)"
	case o.ZeroOverlap && o.ZeroForwardOverlap:
		with = "Options.ZeroForwardOverlap (choose one: the all-gathers follow the reductions during backward, or run during the next forward)"
	case o.ZeroOverlap && o.CommHook != nil && o.CommHook != reducer.AllReduceHook():
		with = "Options.ZeroOverlap and a CommHook (the overlapped step reads the bucket before the hook's Finish)"
	}
	if with != "" {
		return fmt.Errorf("%w: Options.Zero %d cannot be combined with %s", ErrInvalidArgument, o.Zero, with)
	}
	return nil
}

// reduceScatterHook is stage 2's CommHook (Note [ZeRO]): a reduce-scatter of the padded
// bucket in place, into the rank's own block of it (procgroup's in-place ReduceScatter),
// from where the reducer copies it into Param.Grad. Before the first synced Finalize has
// rebuilt the buckets (rebuilt), it all-reduces.
type reduceScatterHook struct {
	rank, size int
	rebuilt    *atomic.Bool
}

func (h reduceScatterHook) Launch(ctx context.Context, pg procgroup.ProcessGroup, b *reducer.BucketView) procgroup.Work {
	buf := b.Buffer.([]float32)
	if !h.rebuilt.Load() {
		return pg.AllReduce(ctx, buf, procgroup.Sum)
	}
	blk := len(buf) / h.size
	return pg.ReduceScatter(ctx, buf[h.rank*blk:(h.rank+1)*blk], buf, procgroup.Sum)
}

// Finish has nothing to do: the reduction is in the bucket either way.
func (h reduceScatterHook) Finish(*reducer.BucketView) error { return nil }

func (reduceScatterHook) Describe() string { return "reduce-scatter (Options.Zero 2)" }

// zeroLine is what the model check compares of the ranks' Zero stage, beside the hook.
func zeroLine(o *Options) string {
	if o.Zero == 0 {
		return ""
	}
	switch {
	case o.ZeroOverlap:
		return fmt.Sprintf(" (Options.Zero %d, ZeroOverlap)", o.Zero)
	case o.ZeroForwardOverlap:
		return fmt.Sprintf(" (Options.Zero %d, ZeroForwardOverlap)", o.Zero)
	}
	return fmt.Sprintf(" (Options.Zero %d)", o.Zero)
}

// zeroOverlapName names the overlap option set, for the errors of checkZero.
func zeroOverlapName(o *Options) string {
	if o.ZeroOverlap {
		return "Options.ZeroOverlap"
	}
	return "Options.ZeroForwardOverlap"
}

// newZero sets up Options.Zero for the checked parameters: stage 2's hook and padding go
// into the reducer's options.
func newZero(o *Options, params []Param, rank, size int, ro *reducer.Options) (*zeroState, error) {
	z := &zeroState{stage: o.Zero, factory: o.Optimizer}
	z.starts, z.lens = make([]int, len(params)), make([]int, len(params))
	for i, p := range params {
		v, ok := p.Data.([]float32)
		if !ok {
			return nil, fmt.Errorf("%w: Options.Zero: parameter %d (%s) is %T; ZeRO takes float32 parameters", ErrInvalidArgument, i, p.Name, p.Data)
		}
		z.starts[i], z.lens[i] = z.elems, len(v)
		z.elems += len(v)
	}
	if o.Zero == 2 && size > 1 {
		ro.CommHook = reduceScatterHook{rank: rank, size: size, rebuilt: &z.rebuilt}
		ro.PadBuckets, ro.Scattered = size, true
	}
	z.forward = o.ZeroForwardOverlap && size > 1 // Note [ZeRO forward overlap] in zero_forward.go
	if o.ZeroOverlap && size > 1 {
		// Note [ZeRO overlap]
		z.overlap, z.inner = true, ro.CommHook
		if z.inner == nil {
			z.inner = reducer.AllReduceHook()
		}
		ro.CommHook = overlapHook{inner: z.inner, z: z}
	}
	return z, nil
}

// layout makes the shard and the optimizer from the current buckets, at the first Step.
func (z *zeroState) layout(buckets []bucket.Bucket, rank, size int) error {
	z.segs = make([]zeroSeg, len(buckets))
	total := 0
	for b, bk := range buckets {
		blk := (bk.Len + size - 1) / size
		lo := min(rank*blk, bk.Len)
		z.segs[b] = zeroSeg{bk: bk, blk: blk, lo: lo, hi: min(lo+blk, bk.Len), off: total}
		if z.forward || z.overlap { // their all-gathers outlive the bucket's next use
			z.segs[b].all = make([]float32, size*blk)
		}
		total += blk
	}
	z.shardP, z.shardG = make([]float32, total), make([]float32, total)
	lens := []int{total}
	if z.overlap { // one optimizer per bucket's block: Note [ZeRO overlap]
		lens = lens[:0]
		for b := range z.segs {
			lens = append(lens, z.segs[b].blk)
		}
	}
	opts := make([]optim.Optimizer, len(lens))
	for k, n := range lens {
		opt, err := z.factory(n)
		if err != nil {
			return fmt.Errorf("%w: Options.Optimizer(%d): %w", ErrInvalidArgument, n, err)
		}
		if opt == nil || opt.Len() != n {
			return fmt.Errorf("%w: Options.Optimizer(%d) returned an optimizer of %d elements", ErrInvalidArgument, n, lenOf(opt))
		}
		opts[k] = opt
	}
	z.opts = opts
	if z.pending != nil {
		err := z.setState(*z.pending)
		z.pending = nil
		return err
	}
	return nil
}

// optFor returns the optimizer of bucket b's block and the shard offset of its element 0.
func (z *zeroState) optFor(b int) (optim.Optimizer, int) {
	if len(z.opts) == 1 {
		return z.opts[0], 0
	}
	return z.opts[b], z.segs[b].off
}

// stepSeg steps bucket b's block of the shard with its own optimizer (overlap only).
func (z *zeroState) stepSeg(b int) error {
	seg := &z.segs[b]
	if err := z.opts[b].Step(z.shardP[seg.off:seg.off+seg.blk], z.shardG[seg.off:seg.off+seg.blk]); err != nil {
		return fmt.Errorf("zero: optimizer step of bucket %d's block: %w", b, err)
	}
	return nil
}

// stepAll steps the whole shard.
func (z *zeroState) stepAll() error {
	if len(z.opts) == 1 {
		if err := z.opts[0].Step(z.shardP, z.shardG); err != nil {
			return fmt.Errorf("zero: optimizer step: %w", err)
		}
		return nil
	}
	for b := range z.segs {
		if err := z.stepSeg(b); err != nil {
			return err
		}
	}
	return nil
}

// stateVector returns the shard's state vector k, flattened over the shard (a copy with
// one optimizer per block).
func (z *zeroState) stateVector(k int) []float32 {
	if len(z.opts) == 1 {
		return z.opts[0].State().Vectors[k].Data
	}
	flat := make([]float32, len(z.shardP))
	for b := range z.segs {
		copy(flat[z.segs[b].off:], z.opts[b].State().Vectors[k].Data)
	}
	return flat
}

func lenOf(o optim.Optimizer) int {
	if o == nil {
		return 0
	}
	return o.Len()
}

// owned calls f for each piece of parameter p (at offset off of its bucket, n elements)
// that lies in this rank's block of seg: k is the piece's start in the parameter, s in the
// shard.
func (seg *zeroSeg) owned(off, n int, f func(k, s, l int)) {
	a, b := max(off, seg.lo), min(off+n, seg.hi)
	if a < b {
		f(a-off, seg.off+a-seg.lo, b-a)
	}
}

// Step steps the sharded optimizer, with Options.Zero, after a synced Finalize that
// succeeded: this rank's shard of the parameters moves against its shard of the averaged
// gradients, and every bucket's shards are then all-gathered into every rank's Param.Data
// (Note [ZeRO]). Every rank must call it after the same Finalize; it returns when the
// parameters are in place (with Options.ZeroForwardOverlap, once their all-gathers are
// issued: WaitParams waits for them). The optimizer is made (Options.Optimizer) at the first Step.
// Without Zero, or without a synced Finalize since the last Step, it returns ErrPhase and
// leaves the DDP usable; an error of the optimizer or of a collective, or ctx's, fails the
// DDP, and leaves Param.Data undefined (some buckets may have been copied in, from buffers
// the failure's abort released). Close waits for a Step at work; ctx, or the group's Abort,
// is what ends one stuck on a stalled peer before the group's timeout.
func (d *DDP) Step(ctx context.Context) error {
	d.mu.Lock()
	switch {
	case d.phase == phaseFailed:
		err, run := d.err, (*overlapRun)(nil)
		if d.zero != nil {
			run, d.zero.run = d.zero.run, nil
		}
		d.mu.Unlock()
		if run != nil { // the failure stopped it: wait for it to exit
			<-run.done
			d.zero.cur.Store(nil)
		}
		return err
	case d.phase == phaseClosed || d.closing:
		d.mu.Unlock()
		return ErrClosed
	case d.zero == nil:
		d.mu.Unlock()
		return fmt.Errorf("%w: Step without Options.Zero: step the optimizer yourself", ErrPhase)
	case d.phase != phaseIdle || !d.zero.ready:
		d.mu.Unlock()
		return fmt.Errorf("%w: Step without a synced Finalize since the last Step", ErrPhase)
	}
	d.zero.ready = false
	d.phase = phaseStepping
	run := d.zero.run
	d.steps.Add(1)
	defer d.steps.Done() // after the settling below: Close waits for it (DDP.steps)
	d.mu.Unlock()

	var err error // without d.mu: Stats, Err and Close stay responsive
	if run != nil {
		err = d.waitOverlap(ctx, run) // the step was taken during backward: Note [ZeRO overlap]
		if err == nil {
			err = d.checkStepGrads()
		}
	} else {
		err = d.zeroStep(ctx)
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	if run != nil && d.zero.run == run {
		d.zero.run = nil
		d.zero.cur.Store(nil)
	}
	if err := d.settleLocked(err); err != nil {
		return err
	}
	d.phase = phaseIdle
	return nil
}

func (d *DDP) zeroStep(ctx context.Context) error {
	z := d.zero
	if z.opts == nil {
		if err := z.layout(d.r.Buckets(), d.pg.Rank(), d.pg.Size()); err != nil {
			return err
		}
	}
	for b := range z.segs {
		seg := &z.segs[b]
		for j, i := range seg.bk.Params {
			p, g := d.params[i].Data.([]float32), d.params[i].Grad.([]float32)
			seg.owned(seg.bk.Offsets[j], len(p), func(k, s, l int) {
				copy(z.shardP[s:s+l], p[k:k+l])
				copy(z.shardG[s:s+l], g[k:k+l])
			})
		}
	}
	if err := z.stepAll(); err != nil {
		return err
	}
	if z.forward { // the next forward waits for them: Note [ZeRO forward overlap]
		d.issueGathers()
		return nil
	}
	if d.pg.Size() == 1 {
		for b := range z.segs {
			d.scatterParams(&z.segs[b], z.shardP[z.segs[b].off:])
		}
		return nil
	}
	return d.gatherEach(ctx, z.shardP, "parameters", d.scatterParams)
}

// gatherEach all-gathers every bucket's block of v (bucket by bucket, all launched at
// once, each in place in gatherOut's buffer) and calls use with each bucket's gathered
// elements, in bucket order, as they arrive.
func (d *DDP) gatherEach(ctx context.Context, v []float32, what string, use func(seg *zeroSeg, all []float32)) error {
	z := d.zero
	rank := d.pg.Rank()
	outs := make([][]float32, len(z.segs))
	lent := make([]bool, len(z.segs))
	for b := range z.segs {
		seg := &z.segs[b]
		outs[b], lent[b] = d.gatherOut(b)
		own := outs[b][rank*seg.blk : (rank+1)*seg.blk : (rank+1)*seg.blk]
		copy(own, v[seg.off:seg.off+seg.blk])
		seg.work = d.pg.AllGather(ctx, outs[b], own)
	}
	var err error
	for b := range z.segs {
		seg := &z.segs[b]
		if werr := seg.work.Wait(ctx); werr != nil && err == nil {
			err = fmt.Errorf("zero: all-gather of bucket %d's %s: %w", b, what, werr)
		}
		seg.work = nil
		if err == nil && beforeCopyOut != nil {
			beforeCopyOut(d, b)
		}
		if err == nil {
			use(seg, outs[b])
		}
		switch {
		case lent[b]:
			clear(outs[b][seg.bk.Len:]) // the padding, given back as zeros
		case d.opts.Zero == 2 && !z.forward && !z.overlap:
			seg.all = nil // made for want of a lent bucket this once (gatherOut)
		}
	}
	return err
}

// beforeCopyOut, nil outside tests, runs in gatherEach before bucket b's gathered elements
// are used.
var beforeCopyOut func(d *DDP, b int)

// gatherOut is where bucket b's all-gather goes in gatherEach: between passes at stage 2,
// the reducer's own bucket (reducer.ScratchBucket, lent: padded to n blocks, and not read
// again before the next backward overwrites it), so that ZeRO holds no second copy of the
// model; elsewhere seg.all, made at first use: at stage 1, whose buckets are not padded, and
// at stage 2 where Accumulate passes left gradients in the buckets (let go after that use).
// Close waits for a gatherEach at work (DDP.steps) before the reducer gives the buckets back.
func (d *DDP) gatherOut(b int) (out []float32, lent bool) {
	seg := &d.zero.segs[b]
	n := d.pg.Size() * seg.blk
	if d.opts.Zero == 2 {
		if buf, ok := d.r.ScratchBucket(b); ok && len(buf) == n {
			return buf, true
		}
	}
	if seg.all == nil {
		seg.all = make([]float32, n)
	}
	return seg.all, false
}

// scatterParams copies a bucket's gathered parameters into Param.Data.
func (d *DDP) scatterParams(seg *zeroSeg, all []float32) {
	for j, i := range seg.bk.Params {
		p := d.params[i].Data.([]float32)
		off := seg.bk.Offsets[j]
		copy(p, all[off:off+len(p)])
	}
}

// OptimizerStateBytes is the size of this rank's optimizer state with Options.Zero (its
// shard's vectors), 0 before the first Step or without Zero.
func (d *DDP) OptimizerStateBytes() int64 {
	if d.zero == nil || d.zero.opts == nil {
		return 0
	}
	var n int64
	for _, o := range d.zero.opts {
		n += o.State().Bytes()
	}
	return n
}

// GatherOptimizerState fills full with the whole optimizer state, with Options.Zero: the
// step count, and each of the shard optimizer's vectors as one optimizer over every
// parameter would hold it, the parameters' elements in index order (the length of all the
// parameters together). full's vectors must have the optimizer's names, in its order. It
// is a collective (an all-gather per bucket and vector), after the first Step: every rank
// calls it at the same point, between steps, and every rank gets the state (a checkpoint
// then writes rank 0's).
func (d *DDP) GatherOptimizerState(ctx context.Context, full optim.State) error {
	d.mu.Lock()
	switch {
	case d.phase == phaseFailed:
		defer d.mu.Unlock()
		return d.err
	case d.phase == phaseClosed || d.closing:
		d.mu.Unlock()
		return ErrClosed
	case d.zero == nil || d.zero.opts == nil || d.phase != phaseIdle || d.zero.run != nil:
		d.mu.Unlock()
		return fmt.Errorf("%w: GatherOptimizerState needs Options.Zero, between steps, after the first Step", ErrPhase)
	}
	z := d.zero
	own := z.opts[0].State()
	if err := z.matches(full, own); err != nil {
		d.mu.Unlock()
		return err
	}
	d.phase = phaseStepping
	d.steps.Add(1)
	defer d.steps.Done() // after the settling below: Close waits for it (DDP.steps)
	d.mu.Unlock()

	*full.Steps = *own.Steps
	err := d.completeGathers(ctx) // Note [ZeRO forward overlap]: gatherEach may reuse their seg.all
	for k := 0; k < len(own.Vectors) && err == nil; k++ {
		dst, src := full.Vectors[k].Data, z.stateVector(k)
		if d.pg.Size() == 1 {
			for b := range z.segs {
				z.unflatten(&z.segs[b], src[z.segs[b].off:], dst)
			}
			continue
		}
		err = d.gatherEach(ctx, src, own.Vectors[k].Name, func(seg *zeroSeg, all []float32) {
			z.unflatten(seg, all, dst)
		})
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.settleLocked(err); err != nil {
		return err
	}
	d.phase = phaseIdle
	return nil
}

// unflatten copies a bucket's elements (in bucket order) into a vector in index order.
func (z *zeroState) unflatten(seg *zeroSeg, all, dst []float32) {
	for j, i := range seg.bk.Params {
		off, n := seg.bk.Offsets[j], z.lens[i]
		copy(dst[z.starts[i]:z.starts[i]+n], all[off:off+n])
	}
}

// SetOptimizerState sets this rank's shard of the optimizer state, with Options.Zero, from
// full, a whole state in GatherOptimizerState's form (read from a checkpoint, which may
// come from another world size or from one optimizer over every parameter). Before the
// first Step it keeps full, which must not change until then, and applies it when the
// optimizer is made. It is not a collective.
func (d *DDP) SetOptimizerState(full optim.State) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.phase == phaseFailed:
		return d.err
	case d.phase == phaseClosed:
		return ErrClosed
	case d.zero == nil || d.phase != phaseIdle || d.zero.run != nil:
		return fmt.Errorf("%w: SetOptimizerState needs Options.Zero, between steps", ErrPhase)
	}
	z := d.zero
	if z.opts == nil {
		if full.Steps == nil {
			return fmt.Errorf("%w: SetOptimizerState: nil Steps", ErrInvalidArgument)
		}
		for _, v := range full.Vectors {
			if len(v.Data) != z.elems {
				return fmt.Errorf("%w: SetOptimizerState: vector %s holds %d elements, the parameters %d", ErrInvalidArgument, v.Name, len(v.Data), z.elems)
			}
		}
		z.pending = &full
		return nil
	}
	return z.setState(full)
}

// setState copies this rank's blocks of full into the optimizers' state.
func (z *zeroState) setState(full optim.State) error {
	if err := z.matches(full, z.opts[0].State()); err != nil {
		return err
	}
	for _, o := range z.opts {
		*o.State().Steps = *full.Steps
	}
	for k := range full.Vectors {
		src := full.Vectors[k].Data
		for b := range z.segs {
			seg := &z.segs[b]
			opt, base := z.optFor(b)
			v := opt.State().Vectors[k].Data
			for j, i := range seg.bk.Params {
				seg.owned(seg.bk.Offsets[j], z.lens[i], func(e, s, l int) {
					copy(v[s-base:s-base+l], src[z.starts[i]+e:][:l])
				})
			}
		}
	}
	return nil
}

// matches checks that full has own's vectors, by name and order, each of every parameter's
// elements.
func (z *zeroState) matches(full, own optim.State) error {
	if full.Steps == nil || len(full.Vectors) != len(own.Vectors) {
		return fmt.Errorf("%w: optimizer state of %d vectors (steps %v), the optimizer has %d", ErrInvalidArgument, len(full.Vectors), full.Steps != nil, len(own.Vectors))
	}
	for k, v := range full.Vectors {
		if v.Name != own.Vectors[k].Name || len(v.Data) != z.elems {
			return fmt.Errorf("%w: optimizer state vector %d is %s of %d elements, want %s of %d (every parameter's)", ErrInvalidArgument, k, v.Name, len(v.Data), own.Vectors[k].Name, z.elems)
		}
	}
	return nil
}
