package ddp

import (
	"context"
	"errors"
	"fmt"

	"github.com/goddp/goddp/procgroup"
)

// Note [Join]: with Options.UnevenInputs, ranks may run different numbers of synced
// steps (PyTorch's Join context manager with DDP's join hook). Every synced step opens
// with one AllReduce (Sum) of two int64s, each rank's "in a synced step" flag and its "in
// BroadcastBuffers" flag (below): an active rank issues it with 1, 0 in
// BeginBackward(Sync), before any bucket of the pass can launch, and waits for it in
// Finalize; a rank in Join issues it with 0, 0. So it holds the same place
// in every rank's collective sequence, and every rank learns, in every step, how many
// ranks are still training.
//
// A rank whose data has run out calls Join. While the count is positive, Join runs one
// synced pass for each step of the others with zero gradients: the same reducer, so the
// same collectives in the same order (the buckets through the CommHook, which gets zero
// buckets; the rebuild's broadcast and the automatic bucket sizing at the first steps; the
// non-finite check's AllGather, which runs when the reduced buckets, the same bits on every
// rank, hold a non-finite value). NoSync passes issue no collective, so a joined rank has
// nothing to shadow for them; FindUnusedParameters changes which slots the active ranks
// zero, not their collectives. When the count is 0, every rank is in Join at that same
// AllReduce, and leaves: one more AllReduce (Max) picks the highest rank among those that
// joined last (their first count was 0: they ran every step), and its parameters and
// buffers are broadcast to every rank, since the joined ranks' optimizer did not step.
//
// The average divides by the world size by default (PyTorch's
// divide_by_initial_world_size=True): every sample weighs the same in every step, a step
// with fewer ranks is a smaller batch, and the averages are the reducer's own bits.
// Options.JoinDivideByActive divides by the count of the step instead: Finalize multiplies
// the averaged gradients by world size / count, one pass over them in the steps where a
// rank has joined (the bits then differ from a division by the count by rounding).
//
// Join does not compose with Options.Shards (the shards fix the global batch, so every
// rank runs its shards in every step) nor with Options.Device (the shadow passes would
// need device zero buffers); New refuses both.
//
// BroadcastBuffers opens with the same AllReduce, its flag in the second element, so that
// a joined rank takes part in it too. It copies rank 0's buffers while every rank
// broadcasts; once a rank has joined, its buffers are stale, and the highest rank still
// training is the source instead (one more AllReduce, Max, as PyTorch's authoritative
// rank). Collectives of the trainer's own, such as a loss's all-reduce, cannot be
// shadowed: they must not run while a rank may be in Join.

// joinState is the per-step count of Note [Join]: two int64s, the ranks that begin a
// synced step and those that broadcast buffers.
type joinState struct {
	buf  []int64
	work procgroup.Work
}

// launch issues the count's AllReduce with this rank's flags.
func (j *joinState) launch(pg procgroup.ProcessGroup, step, buffers int64) error {
	if j.work != nil {
		return fmt.Errorf("%w: a synced pass began before the last one's count of active ranks was waited for", ErrPhase)
	}
	if j.buf == nil {
		j.buf = make([]int64, 2)
	}
	j.buf[0], j.buf[1] = step, buffers
	j.work = pg.AllReduce(context.Background(), j.buf, procgroup.Sum)
	return nil
}

// wait waits for the count launch issued and returns it: the ranks in a synced step and
// those in BroadcastBuffers. Both positive is an error: the active ranks are at different
// points of their loop.
func (j *joinState) wait(ctx context.Context) (steps, buffers int, err error) {
	w := j.work
	j.work = nil
	if w == nil {
		return 0, 0, fmt.Errorf("%w: no count of active ranks in flight", ErrPhase)
	}
	if err := w.Wait(ctx); err != nil {
		return 0, 0, fmt.Errorf("Options.UnevenInputs: the count of the ranks still training: %w", err)
	}
	steps, buffers = int(j.buf[0]), int(j.buf[1])
	if steps > 0 && buffers > 0 {
		return 0, 0, fmt.Errorf("%w: Options.UnevenInputs: %d ranks began a synced step while %d called BroadcastBuffers", ErrPhase, steps, buffers)
	}
	return steps, buffers, nil
}

// bufferRoot is the rank BroadcastBuffers copies from, when active of the world's ranks
// broadcast (Note [Join]): rank 0 while every rank does, else the highest active rank (a
// rank in Join passes active false), found with one AllReduce (Max).
func bufferRoot(ctx context.Context, pg procgroup.ProcessGroup, active int, me bool) (int, error) {
	if active == pg.Size() {
		return 0, nil
	}
	r := []int64{-1}
	if me {
		r[0] = int64(pg.Rank())
	}
	if err := pg.AllReduce(ctx, r, procgroup.Max).Wait(ctx); err != nil {
		return 0, fmt.Errorf("choosing the rank whose buffers are broadcast: %w", err)
	}
	if r[0] < 0 || r[0] >= int64(pg.Size()) { // cannot happen: active > 0
		return 0, fmt.Errorf("the rank whose buffers are broadcast is %d, outside [0, %d)", r[0], pg.Size())
	}
	return int(r[0]), nil
}

// checkJoinOptions refuses the options Join does not compose with (Note [Join]).
func checkJoinOptions(o *Options) error {
	switch {
	case o.JoinDivideByActive && !o.UnevenInputs:
		return fmt.Errorf("%w: Options.JoinDivideByActive needs Options.UnevenInputs", ErrInvalidArgument)
	case !o.UnevenInputs:
		return nil
	case o.Shards > 0:
		return fmt.Errorf("%w: Options.UnevenInputs with Options.Shards: the shards fix the global batch, so every rank runs its shards in every step and none joins early", ErrInvalidArgument)
	case o.Device:
		return fmt.Errorf("%w: Options.UnevenInputs with Options.Device is not supported: a joined rank's zero gradients would need device buffers", ErrInvalidArgument)
	}
	return nil
}

// Join is what a rank whose data has run out calls, with Options.UnevenInputs, in place of
// more steps (Note [Join]). It shadows the synced steps that the other ranks still run,
// contributing zero gradients to their averages, and returns once every rank has called
// Join; then every rank holds the parameters and buffers of a rank that ran every step
// (the optimizer's state stays each rank's own). Every rank must call it, once its own
// steps are done, between steps: after a synced Finalize (ErrPhase, leaving the DDP
// usable, during a backward pass or with NoSync gradients accumulated since the last
// synced step). Options.AfterSync does not run for the shadowed steps. The DDP stays
// usable after it, for more steps on every rank.
//
// It returns the DDP's error, ErrInvalidArgument without Options.UnevenInputs (which
// fails the DDP, so that the peers fail at once), or the error of a collective or of ctx,
// which fail the DDP too.
func (d *DDP) Join(ctx context.Context) error {
	d.mu.Lock()
	switch d.phase {
	case phaseFailed:
		defer d.mu.Unlock()
		return d.err
	case phaseClosed:
		d.mu.Unlock()
		return ErrClosed
	case phaseSync, phaseFinalizing, phaseJoined:
		d.mu.Unlock()
		return fmt.Errorf("%w: Join during a synced backward pass: call it after the step's Finalize", ErrPhase)
	}
	if !d.opts.UnevenInputs {
		defer d.mu.Unlock()
		return d.failLocked(fmt.Errorf("%w: Join needs Options.UnevenInputs, on every rank", ErrInvalidArgument))
	}
	if d.r.Accumulated() {
		d.mu.Unlock()
		return fmt.Errorf("%w: Join with gradients accumulated by NoSync passes since the last synced step: finish the step with a synced pass first", ErrPhase)
	}
	d.phase = phaseJoined
	d.mu.Unlock()

	err := d.shadow(ctx) // without d.mu: Stats, Err and Close stay responsive

	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.settleLocked(err); err != nil {
		return err
	}
	d.phase = phaseIdle
	return nil
}

// shadow runs Join's loop (Note [Join]).
func (d *DDP) shadow(ctx context.Context) error {
	var n32, n64 int
	for _, p := range d.params {
		switch g := p.Data.(type) {
		case []float32:
			n32 = max(n32, len(g))
		case []float64:
			n64 = max(n64, len(g))
		}
	}
	zero32, zero64 := make([]float32, n32), make([]float64, n64)
	last := true // this rank joined in the last step: it ran every step
	for {
		if err := d.join.launch(d.pg, 0, 0); err != nil {
			return err
		}
		active, buffers, err := d.join.wait(ctx)
		if err != nil {
			return fmt.Errorf("Join: %w", err)
		}
		if active == 0 && buffers == 0 {
			break
		}
		last = false
		if buffers > 0 { // the active ranks broadcast their buffers: take part
			root, err := bufferRoot(ctx, d.pg, buffers, false)
			if err != nil {
				return fmt.Errorf("Join: %w", err)
			}
			if err := broadcastFrom(ctx, d.pg, d.tensors(false), chunkBytes(d.opts.BroadcastChunkMB), root); err != nil {
				return fmt.Errorf("Join: broadcast of rank %d's buffers: %w", root, err)
			}
			continue
		}
		if err := d.r.BeginBackward(Sync); err != nil {
			return fmt.Errorf("Join: %w", err)
		}
		for i := len(d.params) - 1; i >= 0; i-- { // the initial buckets' order
			switch g := d.params[i].Data.(type) {
			case []float32:
				err = d.r.GradReady(i, zero32[:len(g)])
			case []float64:
				err = d.r.GradReady64(i, zero64[:len(g)])
			}
			if err != nil {
				return fmt.Errorf("Join: %w", err)
			}
		}
		if err := d.r.Finalize(ctx); err != nil {
			if nf := (*NonFiniteError)(nil); errors.As(err, &nf) {
				continue // every rank got it after the same collectives: the step is over
			}
			return fmt.Errorf("Join: %w", err)
		}
	}
	src := []int64{-1}
	if last {
		src[0] = int64(d.pg.Rank())
	}
	if err := d.pg.AllReduce(ctx, src, procgroup.Max).Wait(ctx); err != nil {
		return fmt.Errorf("Join: choosing the rank that ran every step: %w", err)
	}
	if src[0] < 0 || src[0] >= int64(d.pg.Size()) { // cannot happen: some rank joined last
		return fmt.Errorf("Join: the rank that ran every step is %d, outside [0, %d)", src[0], d.pg.Size())
	}
	if err := broadcastFrom(ctx, d.pg, d.tensors(true), chunkBytes(d.opts.BroadcastChunkMB), int(src[0])); err != nil {
		return fmt.Errorf("Join: broadcast of rank %d's parameters and buffers: %w", src[0], err)
	}
	return nil
}

// rescale multiplies the averaged gradients by f (Options.JoinDivideByActive).
func (d *DDP) rescale(f float64) {
	for i := range d.params {
		switch g := d.Grad(i).(type) {
		case []float32:
			f32 := float32(f)
			for k := range g {
				g[k] *= f32
			}
		case []float64:
			for k := range g {
				g[k] *= f
			}
		}
	}
}
