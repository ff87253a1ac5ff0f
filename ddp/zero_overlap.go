package ddp

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/reducer"
)

// Note [ZeRO overlap]: with Options.ZeroOverlap the shard's step and the parameters'
// all-gather of each bucket run during the rest of backward, as soon as that bucket's
// reduction completes, instead of in Step after it (PyTorch's ZeroRedundancyOptimizer with
// overlap_with_ddp). Every rank must issue the collectives of a group in the same order,
// and a reduction's completion is noticed at a moment that depends on timing, so no
// collective is issued "when a reduction is seen done". Instead one goroutine per
// overlapped pass, the issuer, issues all of the pass's collectives in a fixed program
// order: the reductions R(k), which the reducer hands it through the CommHook (overlapHook)
// as backward completes bucket k, and the all-gathers AG(k):
//
//	R(0), R(1), AG(0), R(2), AG(1), …, R(B−1), AG(B−2), AG(B−1)
//
// For k = 1 … B−1 it takes bucket k's hand-over, issues R(k), then waits for R(k−1),
// steps shard k−1 (its own optimizer: below) and issues AG(k−1); after the last it does
// the same for B−1. The order depends on the bucket count alone, so it is the same on
// every rank, and AG(k−1) queues on the link right behind R(k), while backward produces
// the later buckets. R(k+1) is issued only once R(k−1) has completed and shard k−1 is
// stepped: the link then still carries R(k), so the wire does not idle. The reducer's Work
// for bucket k (zeroWork) completes once AG(k) is issued, so when Finalize has seen every
// bucket complete the issuer has issued all it will in the pass, and what Finalize issues
// afterwards (the non-finite check's all-gather), and the trainer after it, is ordered
// after it on every rank.
//
// The step of bucket k reads this rank's block of Param.Data and of the reduced bucket
// (stage 1: the all-reduced buffer; stage 2: the reduce-scatter's block), during backward;
// nobody writes either then. The gathered parameters are written into Param.Data only once
// Finalize has begun, when the trainer's backward is over whatever the model's order of
// reads (an autograd engine may still read a layer's weight after reporting its gradient),
// and Step waits for the last of them. So the condition on the trainer is that it neither
// reads nor writes Param.Data between Finalize and Step's return (AfterSync included),
// and does not write it between BeginBackward and Step. The result is the bits of the
// step in Step: the same optimizer (one per bucket's block, made by Options.Optimizer for
// blk_b elements each, which an element-wise optimizer steps to the same bits as one over
// the whole shard; checkpoints see the same gathered state) on the same blocks.
//
// Semantics that change, hence the option: the step takes the reduced buckets, not
// Param.Grad, so a change the trainer makes to Param.Grad between Finalize and Step
// (clipping, scaling) would be lost; Step compares this rank's blocks of it with what the
// step took and fails the DDP if they differ (checkStepGrads). Step must follow every
// synced Finalize (a BeginBackward before it fails the DDP with ErrPhase); the step is
// taken before the non-finite check, so a *NonFiniteError from Finalize fails the DDP instead of letting
// the trainer skip the step; Close between Finalize and Step aborts the group if the
// all-gathers are still running. The first synced pass and any pass before the first Step
// are not overlapped (the rebuild at the first one moves the shards, which the first Step
// lays out), nor are the passes of one rank. It takes the default all-reduce at stage 1
// (a CommHook's Finish would have to run before the step) and none of what Options.Zero
// refuses.
//
// Failure: an error of a collective or of the optimizer in the issuer aborts the group,
// completes the bucket's Work with it (Finalize returns it) and Step returns it; the DDP's
// failure, Close, or Step's ctx ending stop the issuer, which waits for its collectives
// (bounded by the abort and the group's timeout) and completes every Work it handed out,
// so Finalize and the reducer's Close never wait on it. Step and Close wait for the issuer
// to exit.

// overlapHook is the CommHook with Options.ZeroOverlap: in an overlapped pass it hands each
// bucket to the pass's issuer, otherwise it launches it with inner.
type overlapHook struct {
	inner reducer.CommHook
	z     *zeroState
}

func (h overlapHook) Launch(ctx context.Context, pg procgroup.ProcessGroup, b *reducer.BucketView) procgroup.Work {
	if run := h.z.cur.Load(); run != nil {
		return run.submit(b)
	}
	return h.inner.Launch(ctx, pg, b)
}

func (h overlapHook) Finish(b *reducer.BucketView) error { return h.inner.Finish(b) }

func (h overlapHook) Describe() string { return reducer.DescribeHook(h.inner) + " (ZeRO overlap)" }

// zeroWork is the Work the reducer gets for a bucket of an overlapped pass: it completes
// once the bucket's reduction has completed, its shard is stepped and its all-gather
// issued (or with the error that stopped that).
type zeroWork struct {
	*procgroup.Future
	real procgroup.Work // the reduction, set before the Future completes
}

// CompletedAt is the reduction's completion, for the reducer's bucket timings.
func (w *zeroWork) CompletedAt() time.Time {
	select {
	case <-w.Done():
		if w.real != nil {
			if t, ok := procgroup.CompletedAt(w.real); ok {
				return t
			}
		}
	default:
	}
	return w.Future.CompletedAt()
}

// zeroReq is one bucket handed to the issuer.
type zeroReq struct {
	view *reducer.BucketView
	work *zeroWork
}

// overlapRun is one overlapped pass: its issuer goroutine and what it shares.
type overlapRun struct {
	d     *DDP
	inner reducer.CommHook
	ctx   context.Context // the collectives', cancelled by halt
	stop  context.CancelFunc

	mu     sync.Mutex
	closed bool // the issuer takes no more buckets: submit completes them with err
	err    error
	sent   int
	reqs   chan zeroReq // capacity: the bucket count

	backward     chan struct{} // closed when Finalize begins: Param.Data may be written
	backwardOnce sync.Once
	done         chan struct{} // closed when the issuer has exited
	result       error         // the issuer's error, read after done
}

// startOverlapLocked starts the issuer of an overlapped synced pass. d.mu must be held.
func (d *DDP) startOverlapLocked() {
	z := d.zero
	ctx, cancel := context.WithCancel(context.Background())
	run := &overlapRun{d: d, inner: z.inner, ctx: ctx, stop: cancel, reqs: make(chan zeroReq, len(z.segs)),
		backward: make(chan struct{}), done: make(chan struct{})}
	z.run = run
	z.passes++
	z.cur.Store(run)
	go run.issue()
}

// submit hands bucket b to the issuer (from the reducer's launch, under its lock): it never
// blocks.
func (run *overlapRun) submit(b *reducer.BucketView) procgroup.Work {
	w := &zeroWork{Future: procgroup.NewFuture()}
	run.mu.Lock()
	defer run.mu.Unlock()
	switch {
	case run.closed:
		w.Complete(run.err)
	case run.sent == cap(run.reqs):
		w.Complete(fmt.Errorf("zero overlap: bucket %d launched after the pass's %d buckets", b.Index, cap(run.reqs)))
	default:
		run.sent++
		run.reqs <- zeroReq{view: b, work: w}
	}
	return w
}

// backwardOver lets the issuer write Param.Data (Finalize has begun).
func (run *overlapRun) backwardOver() { run.backwardOnce.Do(func() { close(run.backward) }) }

// halt stops the issuer (the DDP failed or closed, which aborts the group); it never
// blocks.
func (run *overlapRun) halt() { run.stop() }

// issue is the issuer goroutine (Note [ZeRO overlap]).
func (run *overlapRun) issue() {
	defer close(run.done)
	defer run.stop()
	var taken []zeroReq
	err := run.steps(&taken)
	if err != nil {
		if run.ctx.Err() == nil { // not halted: the peers wait for this rank's collectives
			run.d.pg.Abort(err)
		}
	}
	run.mu.Lock()
	run.closed, run.err = true, err
	if err == nil {
		run.err = errors.New("zero overlap: the pass's step is over")
	}
	for len(run.reqs) > 0 {
		r := <-run.reqs
		taken = append(taken, r)
	}
	run.mu.Unlock()
	z := run.d.zero
	for _, r := range taken {
		if r.work.real != nil {
			<-r.work.real.Done() // bounded: the abort, or the group's timeout
		}
		r.work.Complete(err)
	}
	for b := range z.segs {
		if w := z.segs[b].work; w != nil {
			<-w.Done()
			z.segs[b].work = nil
		}
	}
	run.result = err
}

// steps issues the pass's collectives in the fixed order, steps the shards and, once
// backward is over, copies the gathered parameters into Param.Data.
func (run *overlapRun) steps(taken *[]zeroReq) error {
	z, pg := run.d.zero, run.d.pg
	for k := range z.segs {
		var r zeroReq
		select {
		case r = <-run.reqs:
		case <-run.ctx.Done():
			return fmt.Errorf("zero overlap: stopped waiting for bucket %d: %w", k, context.Cause(run.ctx))
		}
		*taken = append(*taken, r)
		if r.view.Index != k {
			return fmt.Errorf("zero overlap: bucket %d launched where bucket %d was due", r.view.Index, k)
		}
		r.work.real = run.inner.Launch(run.ctx, pg, r.view)
		if k > 0 {
			if err := run.stepBucket(k-1, (*taken)[k-1]); err != nil {
				return err
			}
		}
	}
	if last := len(z.segs) - 1; last >= 0 { // none without parameters
		if err := run.stepBucket(last, (*taken)[last]); err != nil {
			return err
		}
	}
	select {
	case <-run.backward:
	case <-run.ctx.Done():
		return fmt.Errorf("zero overlap: stopped before the parameters' copy: %w", context.Cause(run.ctx))
	}
	for b := range z.segs {
		seg := &z.segs[b]
		if err := seg.work.Wait(run.ctx); err != nil {
			return fmt.Errorf("zero overlap: all-gather of bucket %d's parameters: %w", b, err)
		}
		seg.work = nil
		run.d.scatterParams(seg, seg.all)
	}
	return nil
}

// stepBucket waits for bucket b's reduction, steps this rank's block of it and issues its
// all-gather, then completes the reducer's Work for it.
func (run *overlapRun) stepBucket(b int, r zeroReq) error {
	d, z := run.d, run.d.zero
	if err := r.work.real.Wait(run.ctx); err != nil {
		return fmt.Errorf("zero overlap: reduction of bucket %d: %w", b, err)
	}
	seg := &z.segs[b]
	// The reduced gradients, in the bucket: stage 1's all-reduced buffer, or stage 2's
	// block, reduce-scattered in place (reduceScatterHook).
	src := r.view.Buffer.([]float32)
	for j, i := range seg.bk.Params {
		p, off := d.params[i].Data.([]float32), seg.bk.Offsets[j]
		seg.owned(off, len(p), func(k, s, l int) {
			copy(z.shardP[s:s+l], p[k:k+l])
			copy(z.shardG[s:s+l], src[off+k:][:l])
		})
	}
	if err := z.stepSeg(b); err != nil {
		return err
	}
	seg.work = d.pg.AllGather(run.ctx, seg.all, z.shardP[seg.off:seg.off+seg.blk])
	r.work.Complete(nil)
	return nil
}

// checkStepGrads reports an error if this rank's blocks of Param.Grad are no longer the
// reduced gradients the overlapped step took (the trainer changed them after Finalize, to
// clip or scale them, say): without Options.ZeroOverlap Step would have stepped on the
// changed ones, so the bits would differ. The issuer has exited.
func (d *DDP) checkStepGrads() error {
	z := d.zero
	for b := range z.segs {
		seg := &z.segs[b]
		for j, i := range seg.bk.Params {
			g, bad := d.params[i].Grad.([]float32), -1
			seg.owned(seg.bk.Offsets[j], len(g), func(k, s, l int) {
				for e := range l {
					if bad < 0 && math.Float32bits(g[k+e]) != math.Float32bits(z.shardG[s+e]) {
						bad = k + e
					}
				}
			})
			if bad >= 0 {
				return fmt.Errorf("zero overlap: Step: parameter %d (%s): Param.Grad[%d] changed after Finalize, but the overlapped step had taken the reduced gradient during backward (change the gradients before their GradReady, or scale the loss, instead)",
					i, d.params[i].Name, bad)
			}
		}
	}
	return nil
}

// waitOverlap waits for the issuer of the pass being stepped to exit, or for ctx, and
// returns its error (ctx's fails the DDP, which stops the issuer). d.mu must not be held.
func (d *DDP) waitOverlap(ctx context.Context, run *overlapRun) error {
	select {
	case <-run.done: // done already: whatever ctx says
		return run.result
	default:
	}
	select {
	case <-run.done:
	case <-ctx.Done():
		err := d.fail(fmt.Errorf("zero overlap: Step: waiting for the all-gathers: %w", ctx.Err()))
		<-run.done
		return err
	}
	return run.result
}
