package reducer

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/bucket/sim"
	"github.com/goddp/goddp/procgroup"
)

// AutoBucketCap, as Options.BucketCapMB, has the reducer choose the bucket layout itself
// (Note [Auto buckets]). It is a value no one types by mistake: a negative cap such as -1
// stays an error.
const AutoBucketCap = -math.MaxFloat64

// autoPasses is the number of synced passes Note [Auto buckets] measures before it decides.
const autoPasses = 3

// autoMinGain is the least predicted gain over the default caps for which the auto sizing
// changes the layout (Note [Keep the default] in package bucket/sim).
const autoMinGain = sim.DefaultMinGain

// autoMeasured is the number of steps after the decision whose median is reported as the
// measured step time.
const autoMeasured = 5

// Note [Auto buckets]: with Options.BucketCapMB = AutoBucketCap the reducer measures its
// first three synced passes and then picks the caps (first bucket and the others) whose
// predicted step is the least, with the step model of package bucket/sim.
//
//  1. Pass 1 runs the layout of FirstBucketCapMB and PyTorch's default 25 MiB and gives the
//     grad-ready order, as without auto (Note [Rebuild]). At its end every rank agrees on
//     rank 0's order and times a few all-reduces alone (the probe: 64 KiB, or 4 KiB with
//     an AutoHook, and every 8× up to the size of all the gradients, at most 256 MiB,
//     twice each, the faster kept, Note [Probe twice over]): the cost curve. The probe holds the reducer's lock, as the
//     rebuild's broadcast does, and runs on the memory that the next layout's buckets then
//     take (Note [Bucket memory]). The next layout is one bucket, launched when the last
//     gradient is ready.
//  2. Pass 2, with that one bucket, runs backward with no collective in flight: it gives the
//     pure compute timeline (each gradient's ready time less the reducer's own time before
//     it), the copy cost per byte, the copy back, the rest of the step (forward, optimizer:
//     the time from its Finalize to the next pass), and the skew: how much longer than
//     alone its bucket took, waiting for the last rank. The next layout has eight
//     buckets of equal caps.
//  3. Pass 3, with eight buckets in flight during backward, gives how much compute and the
//     collectives slow each other down: compute from the stretches of backward with a
//     collective in flight, by how much longer they took than in pass 2 beyond what the
//     stretches with none did (func slowdown); collectives by how much longer the buckets
//     took than the curve says, over their time inside backward. Both count a collective
//     from the last rank's launch of it (Note [Last rank's start]), and the pair is bounded
//     as one resource shared allows (Note [Shared speed] in package bucket/sim).
//
// Rank 0 then searches the caps (package sim, Profile.Best), keeping pass 1's caps unless
// the best layout is predicted at least 5% faster (autoMinGain, Note [Keep the default] in
// package bucket/sim), broadcasts the chosen pair, and every rank rebuilds with it from the
// agreed order, so the layouts are identical. The choice is logged with the predicted step
// time for it and for the default caps, and, five steps later, with the measured median
// (AutoPlan). The layout is not re-tuned later. If rank 0 cannot model the step (a gradient
// missing in pass 2), every rank goes back to the layout of pass 1's caps.
type autoTuner struct {
	hook     *autoHook    // the AutoHook to decide for, or nil
	fixed    bool         // the caps are the options', not chosen (an AutoHook alone)
	total    int64        // the bytes of all the gradients
	rebuilds int          // rebuilds done so far
	order    []int        // rank 0's grad-ready order, agreed by all at rebuild 1
	probe    []sim.Point  // the all-reduces timed at rebuild 1
	passes   []*IterStats // clones of passes 2 and 3
	ends     []time.Time  // when each synced pass's Finalize ended, until the decision
	decided  bool
	fresh    bool        // the pass that decided has not reached passDone yet
	measured bool        // plan.Measured is set
	plan     *AutoPlan   // nil if this rank could not model the step
	after    []time.Time // Start of the synced passes after the decision
}

// AutoPlan is what Note [Auto buckets] measured and chose.
type AutoPlan struct {
	// Profile holds the measurements of the rank that decided (rank 0; on the other ranks,
	// their own, which did not count).
	Profile *sim.Profile
	// FirstCapBytes and CapBytes are the chosen caps; Buckets the number of buckets.
	FirstCapBytes, CapBytes int64
	Buckets                 int
	// Predicted is the model's step for the chosen layout, Default the one for pass 1's caps,
	// DefaultFirstCapBytes and DefaultCapBytes (FirstBucketCapMB and 25 MiB: PyTorch's
	// default 1 and 25 MiB unless FirstBucketCapMB is set).
	Predicted, Default                    sim.Result
	DefaultFirstCapBytes, DefaultCapBytes int64
	// Gain is the best layout's predicted gain over pass 1's caps (a fraction of their step),
	// and Kept whether those caps were kept because Gain was under 5% (autoMinGain).
	Gain float64
	Kept bool
	// DecidedAfter is the number of synced passes measured before the decision.
	DecidedAfter int
	// Measured is the median step time of the first five steps after the decision (0 until
	// they are done).
	Measured time.Duration
	// Fixed: the caps are the options' (an AutoHook with fixed caps: Note [Auto hook]).
	Fixed bool
	// Restored: an AutoHook's decision read back from a checkpoint (Note [Auto hook
	// checkpoints]), with no measurements: only the caps, Buckets and Hooks.Hooks are set.
	Restored bool
	// Hooks is an AutoHook's choice by bucket, predicted with this rank's profile, whose
	// Compression holds the hooks' costs this rank measured (nil without an AutoHook, or
	// if they could not be priced).
	Hooks *sim.HookPlan
}

func (p *AutoPlan) String() string {
	if p.Restored {
		s := fmt.Sprintf("auto decision restored from the saved state: first cap %.3g MB, cap %.3g MB, %d buckets",
			float64(p.FirstCapBytes)/(1<<20), float64(p.CapBytes)/(1<<20), p.Buckets)
		if p.Hooks != nil {
			s += "; hooks " + p.Hooks.Summary()
		}
		return s
	}
	s := fmt.Sprintf("auto bucket layout after %d synced steps: first cap %.3g MB, cap %.3g MB, %d buckets; predicted %.2f ms/step (default %.3g/%.3g MB: %.2f, %d buckets)",
		p.DecidedAfter, float64(p.FirstCapBytes)/(1<<20), float64(p.CapBytes)/(1<<20), p.Buckets,
		p.Predicted.Step*1e3, float64(p.DefaultFirstCapBytes)/(1<<20), float64(p.DefaultCapBytes)/(1<<20), p.Default.Step*1e3, p.Default.Buckets)
	if p.Fixed {
		s = fmt.Sprintf("auto hook after %d synced steps, with the caps as set (first %.3g MB, cap %.3g MB, %d buckets)",
			p.DecidedAfter, float64(p.FirstCapBytes)/(1<<20), float64(p.CapBytes)/(1<<20), p.Buckets)
	}
	if h := p.Hooks; h != nil {
		s += fmt.Sprintf("; hooks %s: predicted %.2f ms/step, %.2f exposed (plain all-reduce: %.2f, %.2f exposed)",
			h.Summary(), h.Predicted.Step*1e3, h.Predicted.Exposed*1e3, h.None.Step*1e3, h.None.Exposed*1e3)
	}
	if p.Measured > 0 {
		s += fmt.Sprintf(", measured %.2f ms/step", float64(p.Measured.Microseconds())/1e3)
	}
	if p.Kept {
		s += fmt.Sprintf("; kept: the best layout found was predicted %.1f%% faster, under the %.0f%% margin", 100*p.Gain, 100*autoMinGain)
	}
	return s
}

// AutoPlan returns a copy of the auto sizing's plan, or nil without AutoBucketCap or an
// AutoHook, or before it decided.
func (r *Reducer) AutoPlan() *AutoPlan {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.auto == nil || r.auto.plan == nil {
		return nil
	}
	c := *r.auto.plan
	return &c
}

// rebuild is the auto sizing's part of a rebuild: it sets r.firstCap and r.capBytes for the
// layout to build (from a.order). agreed is the order the ranks agreed on (rebuild 1 only).
// r.mu must be held.
func (a *autoTuner) rebuild(ctx context.Context, r *Reducer, agreed []int) error {
	a.rebuilds++
	total := a.total
	switch a.rebuilds {
	case 1:
		a.order = agreed
		if err := a.runProbe(ctx, r, total); err != nil {
			return err
		}
		r.firstCap, r.capBytes = total+1, total+1 // one bucket (per element type)
	case 2:
		a.passes = append(a.passes, r.stats[r.cur].Clone())
		c := max(total/8, 64<<10)
		r.firstCap, r.capBytes = c, c
	case autoPasses:
		a.passes = append(a.passes, r.stats[r.cur].Clone())
		return a.decide(ctx, r)
	default:
		return fmt.Errorf("reducer: auto bucket sizing: rebuild %d, after the decision", a.rebuilds)
	}
	return nil
}

// probeMax bounds the probe's largest all-reduce.
const probeMax = 256 << 20

// runProbe times all-reduces of 64 KiB (4 KiB with an AutoHook) and every 8× up to total
// bytes, and total (at most
// probeMax, and at most the bucket memory of one element type), twice each (Note [Probe
// twice over]), on every rank alike. It probes where the buckets live: on the memory that
// the next layout's buckets take, held meanwhile as the spare, which setLayout then hands
// out cleared (Note [Bucket memory]). The probe allocates nothing of its own.
func (a *autoTuner) runProbe(ctx context.Context, r *Reducer, total int64) error {
	n := r.hostElems()
	t := 0 // float32, unless every gradient is a float64
	if n[0] == 0 {
		t = 1
	}
	r.spare[t] = r.hostMemFor(t, n[t])
	m := r.spare[t]
	size := int64(4 << t) // bytes per element
	top := min(max(total, size), probeMax, size*int64(n[t])) / size * size
	var sizes []int64
	lo := int64(64 << 10)
	if a.hook != nil { // PowerSGD's messages are small: the curve must reach down to them
		lo = 4 << 10
	}
	for s := lo; s < top; s *= 8 {
		sizes = append(sizes, s)
	}
	sizes = append(sizes, top)
	best := make([]float64, len(sizes))
	for k := range best {
		best[k] = math.Inf(1)
	}
	// Note [Probe twice over]: the sizes in turn, and then again.
	for range 2 {
		for k, s := range sizes {
			var b any
			if t == 0 {
				b = m.f32[:s/4]
			} else {
				b = m.f64[:s/8]
			}
			t0 := time.Now()
			if err := r.pg.AllReduce(ctx, b, procgroup.Sum).Wait(ctx); err != nil {
				return fmt.Errorf("reducer: auto bucket sizing: all-reduce of %d bytes: %w", s, err)
			}
			best[k] = math.Min(best[k], time.Since(t0).Seconds())
		}
	}
	for k, s := range sizes {
		a.probe = append(a.probe, sim.Point{Bytes: s, Seconds: best[k]})
	}
	return nil
}

// Note [Probe twice over]: the probe times each size twice and keeps the faster, since a
// disturbance only ever slows an all-reduce. It goes through all the sizes, then through
// them again, so that a whole pass of the sizes separates the two tries of one size. Two
// tries in a row can both fall inside one disturbance of a few tens of milliseconds, and
// they did. On the two-host testbed at 10 Gbit/s (L=4 h=512, rounds s38-s42, 31
// launches), the faster of two tries in a row took 60-99 ms for 33.5 or 52.5 MB in 7
// launches, against 28-56 ms in the others. With one of them (33.5 MB at 64 ms), auto
// picked 13 buckets, which ran 1.09x the best layout; that launch's profile, given another
// launch's curve, keeps the default caps (cmd/ddpsim, offline). Two tries a pass apart did
// not always help: in round s43 one launch timed 33.5 MB at 74 ms in both. The curve
// therefore passes under such a point, not through it (Note [Lower curve] in package sim).

// decide builds this rank's profile; rank 0 picks the caps with it, and every rank takes
// rank 0's and describes them with its own profile (AutoPlan).
func (a *autoTuner) decide(ctx context.Context, r *Reducer) error {
	// The caps (0: fall back to pass 1's), rank 0's predicted gain in ppm, and 1 if it kept
	// pass 1's caps.
	choice := []int64{0, 0, 0, 0}
	o := sim.AutoOptions(mib(r.opts.FirstBucketCapMB))
	if a.fixed {
		o.KeepCapBytes = mib(r.opts.BucketCapMB)
	}
	keepFirst, keepCap := o.KeepFirstCapBytes, o.KeepCapBytes
	late, err := a.lastStarts(ctx, r)
	if err != nil {
		return err
	}
	prof, err := a.profile(r, late)
	if err != nil {
		prof = nil
	}
	if prof != nil && r.pg.Rank() == 0 && a.fixed {
		choice = []int64{keepFirst, keepCap, 0, 1}
	} else if prof != nil && r.pg.Rank() == 0 {
		var best sim.Plan
		if best, err = prof.Best(o); err == nil {
			choice = []int64{best.FirstCapBytes, best.CapBytes, int64(math.Round(best.Gain * 1e6)), 0}
			if best.Kept {
				choice[3] = 1
			}
		}
	}
	if err != nil && r.pg.Rank() == 0 {
		r.log.Warn("reducer: auto bucket sizing could not model the step; keeping pass 1's caps", zap.Error(err))
	}
	if err := r.pg.Broadcast(ctx, choice, 0).Wait(ctx); err != nil {
		return fmt.Errorf("reducer: auto bucket sizing: broadcast of rank 0's caps: %w", err)
	}
	a.decided, a.fresh = true, true
	if choice[0] <= 0 || choice[1] <= 0 {
		choice[0], choice[1] = keepFirst, keepCap
		prof = nil // rank 0 could not model the step: nothing to describe
	}
	r.firstCap, r.capBytes = choice[0], choice[1]
	bs, err := bucket.AssignOrdered(r.bparams, a.order, choice[0], choice[1])
	if err != nil {
		return fmt.Errorf("reducer: auto bucket sizing: rank 0's caps: %w", err)
	}
	if a.hook != nil {
		if err := a.hook.decide(ctx, r, prof, bs); err != nil {
			return err
		}
	}
	if prof == nil { // this rank could not model the step; rank 0 could
		return nil
	}
	predicted, _ := prof.Simulate(bs)
	def, _ := prof.SimulateCaps(keepFirst, keepCap)
	a.plan = &AutoPlan{Profile: prof, FirstCapBytes: choice[0], CapBytes: choice[1], Buckets: len(bs),
		Predicted: predicted, Default: def, DefaultFirstCapBytes: keepFirst, DefaultCapBytes: keepCap, Gain: float64(choice[2]) / 1e6, Kept: choice[3] == 1 && !a.fixed, Fixed: a.fixed, DecidedAfter: autoPasses}
	if a.hook != nil {
		a.plan.Hooks = a.hook.plan
	}
	r.log.Info("reducer: "+a.plan.String(), zap.Int("rank", r.pg.Rank()))
	return nil
}

// Note [Last rank's start]: a collective's bytes start to move only once the last rank has
// issued it, so the time a rank sees from its own launch to the end also counts its wait for
// the slowest rank. In pass 3 that wait is not the steady skew of the model: it is whatever
// held one rank back in its third step (on the two-host testbed at 10 Gbit/s, 13 ms at the
// median and up to 104 ms), and counted as the collectives' own time it made them look up to
// ten times slower under overlap than alone, and compute twice as slow beside them (the
// model's caps), so that the predicted steps came out 13-57% long. The ranks finish a
// collective at about the same time, so the least of the ranks' times from launch to end is
// the time from the last rank's launch: lastStarts takes it with one all-reduce Min over
// pass 3's buckets, and running counts each collective from there.

// lastStarts returns, for each of pass 3's buckets, the least over the ranks that timed it of
// the time from when the rank issued the collective (or its previous one ended, if later)
// to its end; -1 for a bucket no rank timed. Every rank calls it at the decision.
func (a *autoTuner) lastStarts(ctx context.Context, r *Reducer) ([]time.Duration, error) {
	if len(a.passes) < 2 {
		return nil, nil
	}
	s3 := a.passes[1]
	d := make([]float64, len(s3.BucketBytes))
	for b := range d {
		d[b] = math.MaxFloat64 // untimed here
	}
	for _, iv := range running(s3, 0, nil) {
		d[iv.b] = (iv.hi - iv.lo).Seconds()
	}
	if err := r.pg.AllReduce(ctx, d, procgroup.Min).Wait(ctx); err != nil {
		return nil, fmt.Errorf("reducer: auto bucket sizing: all-reduce of pass 3's collective times: %w", err)
	}
	late := make([]time.Duration, len(d))
	for b, v := range d {
		late[b] = -1
		if v < math.MaxFloat64 {
			late[b] = time.Duration(v * float64(time.Second))
		}
	}
	return late, nil
}

// profile turns the probe and passes 2 (one bucket) and 3 (eight) into the model's inputs.
// late is lastStarts' result (nil: count each collective from skew after this rank's
// launch).
func (a *autoTuner) profile(r *Reducer, late []time.Duration) (*sim.Profile, error) {
	if len(a.passes) < 2 || len(a.ends) < 2 {
		return nil, fmt.Errorf("reducer: auto bucket sizing: %d passes measured, want 2", len(a.passes))
	}
	s2, s3 := a.passes[0], a.passes[1]
	n := len(r.bparams)
	p := &sim.Profile{Params: slices.Clone(r.bparams), Order: slices.Clone(a.order), Ready: make([]float64, n), World: r.pg.Size()}
	if total := float64(a.total); total > 0 {
		p.CopyPerByte = s2.CopyTime.Seconds() / total
		p.UnpackPerByte = s2.UnpackTime.Seconds() / total
	}
	// Pure compute: each ready time less the reducer's time before it (copies; one launch,
	// at the very end).
	byTime := make([]int, 0, n)
	for i := range n {
		if s2.GradReady[i] < 0 {
			return nil, fmt.Errorf("reducer: auto bucket sizing: parameter %d (%s) got no gradient in pass 2", i, r.bparams[i].Name)
		}
		byTime = append(byTime, i)
	}
	slices.SortStableFunc(byTime, func(x, y int) int { return cmp.Compare(s2.GradReady[x], s2.GradReady[y]) })
	var hooks float64
	for _, i := range byTime {
		p.Ready[i] = math.Max(s2.GradReady[i].Seconds()-hooks, 0)
		hooks += p.CopyPerByte * float64(r.bparams[i].Bytes())
	}
	compute2 := s2.Compute().Seconds()
	p.Backward = compute2
	// The rest of the step: from the end of pass 2's Finalize to pass 3's start.
	p.Other = math.Max(s3.Start.Sub(a.ends[1]).Seconds(), 0)

	// The all-reduce curve: the probe's, each all-reduce alone with the ranks in step, each
	// size the faster of two tries: the lowest curve under them (Note [Lower curve] in
	// package sim).
	comm, err := sim.Fit(a.probe)
	if err != nil {
		return nil, fmt.Errorf("reducer: auto bucket sizing: %w", err)
	}
	comm.Lower = true
	p.Comm = comm
	// The skew: pass 2's last bucket took longer than alone by the time this rank waited for
	// the last one to launch it (zero when this rank was the last): one sample of the wait.
	// Where pass 3's last bucket also ran alone, after backward and after the bucket before
	// it, its time beyond the curve is a second sample, and the smaller counts: a sample is
	// only ever inflated, by whatever else held a rank back in its pass (on one host with
	// two ranks on two cores, pass 2 measured 17–172 ms where the steps later ran in step).
	p.Skew = math.Inf(1)
	for k, st := range []*IterStats{s2, s3} {
		b := len(st.BucketBytes) - 1
		if b < 0 || st.BucketLaunched[b] < 0 || st.BucketFinished[b] < 0 {
			continue
		}
		from := st.BucketLaunched[b]
		if k == 1 {
			if b > 0 && st.BucketFinished[b-1] > from {
				from = st.BucketFinished[b-1]
			}
			if from < st.BackwardEnd {
				continue // it ran under backward's compute: slowed, not only kept waiting
			}
		}
		p.Skew = min(p.Skew, math.Max((st.BucketFinished[b]-from).Seconds()-comm.Seconds(st.BucketBytes[b]), 0))
	}
	if math.IsInf(p.Skew, 1) {
		p.Skew = 0
	}
	skew := time.Duration(p.Skew * float64(time.Second))

	// Pass 3: launches, and the slowdowns under overlap.
	if nb := len(s3.BucketBytes); nb > 0 {
		p.Launch = math.Max((s3.HookTime-s3.CopyTime).Seconds()/float64(nb), 0)
	}
	p.Slowdown = slowdown(s2, s3, byTime, skew, late)
	var inside, outside, alone float64
	for _, iv := range running(s3, skew, late) {
		in := max(min(iv.hi, s3.BackwardEnd)-iv.lo, 0)
		inside += in.Seconds()
		outside += (iv.hi - iv.lo - in).Seconds()
		alone += comm.Seconds(s3.BucketBytes[iv.b])
	}
	if inside > 1e-4 && alone-outside > 0 {
		p.CommSlowdown = min(math.Max(inside/(alone-outside)-1, 0), 9)
	}
	p.Slowdown, p.CommSlowdown = sim.SharedSpeed(p.Slowdown, p.CommSlowdown)
	r.log.Info("reducer: auto bucket sizing: measured", zap.Int("rank", r.pg.Rank()),
		zap.Duration("compute_one_bucket", s2.Compute()), zap.Duration("compute_eight", s3.Compute()),
		zap.Duration("skew", skew), zap.Float64("slowdown", p.Slowdown), zap.Float64("comm_slowdown", p.CommSlowdown))
	return p, p.Check()
}

// passDone records when a finalized synced pass ended; after the decision, it measures the
// steps that follow (from the first pass with the chosen layout). r.mu must be held.
func (a *autoTuner) passDone(r *Reducer, st *IterStats) {
	switch {
	case !a.decided:
		a.ends = append(a.ends, st.Start.Add(st.FinalizeEnd))
		return
	case a.fresh: // the pass that decided ran the eight buckets
		a.fresh = false
		return
	case a.plan == nil || a.measured:
		return
	}
	a.after = append(a.after, st.Start)
	if len(a.after) <= autoMeasured {
		return
	}
	steps := make([]time.Duration, autoMeasured)
	for k := range steps {
		steps[k] = a.after[k+1].Sub(a.after[k])
	}
	slices.Sort(steps)
	a.plan.Measured, a.measured = steps[len(steps)/2], true
	r.log.Info("reducer: "+a.plan.String(), zap.Int("rank", r.pg.Rank()))
}

// slowdown estimates how much slower compute runs while a collective is in flight, from
// pass 2 (no collective during backward) and pass 3 (eight buckets), stretch by stretch of
// backward between two gradients (in pass 2's order). Pass 3 may run slower than pass 2 for
// reasons that have nothing to do with overlap (a collector cycle after the new buckets were
// allocated, a busier machine): that general ratio g is taken from the stretches where no
// collective was in flight (the forward pass and the start of backward, at least), and each
// overlapped stretch's extra time beyond it, as a fraction of the time a collective was in
// flight there, estimates f = s/(1+s) for a compute speed of 1/(1+s). The median of those
// fractions, weighted by the in-flight time, ignores a stretch that a one-off stall made
// long. f is at most 1/2 (s at most 1): one collective at a time runs on one goroutine, and
// a fair scheduler gives the compute thread it competes with at least half of a core.
func slowdown(s2, s3 *IterStats, order []int, skew time.Duration, late []time.Duration) float64 {
	ivs := running(s3, skew, late)
	type stretch struct{ d2, d3, w float64 }
	var ss []stretch
	var prev2, prev3 time.Duration
	for k := 0; k <= len(order); k++ {
		end2, end3 := s2.BackwardEnd, s3.BackwardEnd
		if k < len(order) {
			end2, end3 = s2.GradReady[order[k]], s3.GradReady[order[k]]
		}
		if end3 < prev3 || end2 < prev2 { // another order in pass 3: skip the stretch
			continue
		}
		ss = append(ss, stretch{(end2 - prev2).Seconds(), (end3 - prev3).Seconds(), inflight(ivs, prev3, end3).Seconds()})
		prev2, prev3 = end2, end3
	}
	var base2, base3 float64
	for _, x := range ss {
		if x.w == 0 {
			base2, base3 = base2+x.d2, base3+x.d3
		}
	}
	g := 1.0
	if base2 > 0 {
		g = base3 / base2
	}
	type frac struct{ f, w float64 }
	var fs []frac
	var total float64
	for _, x := range ss {
		if x.w > 0 {
			fs = append(fs, frac{(x.d3 - x.d2*g) / x.w, x.w})
			total += x.w
		}
	}
	if len(fs) == 0 {
		return 0
	}
	slices.SortFunc(fs, func(a, b frac) int { return cmp.Compare(a.f, b.f) })
	f, acc := fs[len(fs)-1].f, 0.0
	for _, x := range fs {
		if acc += x.w; acc >= total/2 {
			f = x.f
			break
		}
	}
	f = min(max(f, 0), 0.5)
	return f / (1 - f)
}

// interval is when bucket b's collective ran, in a pass's offsets.
type interval struct {
	b      int
	lo, hi time.Duration
}

// running lists when st's collectives ran, one at a time in bucket order: each from skew
// after its launch (when the last rank launched it too, as the model has it) or its
// predecessor's end, whichever is later, to its end. Where late[b] ≥ 0 (Note [Last rank's
// start]) bucket b runs instead for the last late[b] before its end, from its
// predecessor's end at the earliest.
func running(st *IterStats, skew time.Duration, late []time.Duration) []interval {
	var out []interval
	prevEnd := time.Duration(-1)
	for b := range st.BucketLaunched {
		lo, hi := st.BucketLaunched[b], st.BucketFinished[b]
		if lo < 0 || hi < 0 {
			continue
		}
		lo += skew
		if b < len(late) && late[b] >= 0 {
			lo = hi - late[b]
		}
		lo = min(max(lo, prevEnd), hi)
		prevEnd = hi
		out = append(out, interval{b, lo, hi})
	}
	return out
}

// inflight is the time within [lo, hi] covered by the intervals (in order, not overlapping).
func inflight(ivs []interval, lo, hi time.Duration) time.Duration {
	var total time.Duration
	for _, iv := range ivs {
		if a, z := max(iv.lo, lo), min(iv.hi, hi); z > a {
			total += z - a
		}
	}
	return total
}
