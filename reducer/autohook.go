package reducer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"

	"go.uber.org/zap"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/bucket/sim"
	"github.com/goddp/goddp/procgroup"
)

// AutoHookOptions configure AutoHook.
type AutoHookOptions struct {
	// Ranks are the PowerSGD ranks it may choose (default 2 and 4). Rank 1 is left out of
	// the default: with half a power iteration per step (Note [PowerSGD]) a rank-1 factor
	// follows a gradient that is not near rank 1 slowly, and it took 2.2–3× the steps to
	// the target loss where ranks 2 and 4 took 1.00–1.14× (docs/results, the convergence
	// study). It is still there for the asking.
	Ranks []int
	// PowerSGD holds the other settings of the buckets it compresses with PowerSGD
	// (MinCompressionRate, StartIter, Seed); its Rank is ignored.
	PowerSGD PowerSGDOptions
	// MinGain and Accuracy: sim.HookOptions (defaults sim.DefaultMinGain and
	// sim.DefaultHookAccuracy).
	MinGain, Accuracy float64
}

// AutoHook returns a CommHook that chooses, for each bucket, the plain all-reduce, bf16 or
// PowerSGD at one of o.Ranks, from the step model (Note [Auto hook]). It all-reduces every
// bucket as it is until the reducer's decision, three synced steps in. Like PowerSGDHook it
// keeps per-parameter state: give every DDP its own. Host buckets only.
func AutoHook(o AutoHookOptions) CommHook {
	if len(o.Ranks) == 0 {
		o.Ranks = []int{2, 4}
	}
	o.Ranks = slices.Clone(o.Ranks)
	slices.Sort(o.Ranks)
	o.Ranks = slices.Compact(o.Ranks)
	if o.PowerSGD.MinCompressionRate == 0 {
		o.PowerSGD.MinCompressionRate = 2
	}
	if o.MinGain == 0 {
		o.MinGain = sim.DefaultMinGain
	}
	if o.Accuracy == 0 {
		o.Accuracy = sim.DefaultHookAccuracy
	}
	return &autoHook{o: o}
}

// IsAutoHook reports whether h is an AutoHook, whose measured passes rebuild the buckets as
// AutoBucketCap's do (package ddp's ZeRO refuses it, as it refuses AutoBucketCap).
func IsAutoHook(h CommHook) bool {
	_, ok := h.(*autoHook)
	return ok
}

// Note [Auto hook]: compression pays only where the wire is slower than the compression's
// own compute (Agarwal et al., MLSys 2022, found it beat well-tuned synchronous training
// in few set-ups), so AutoHook leaves the choice to the step model (Note [Step model] in
// package bucket/sim), with the measurements the auto bucket sizing takes (Note [Auto
// buckets]): with an AutoHook the reducer runs that sizing's three measured passes even
// when the caps are fixed, and keeps the caps it was given then.
//
// At the decision, every rank times the hooks' own kernels on a matrix of the model's (the
// largest that PowerSGD at rank 1 compresses, cut to about 2^20 elements, a row being the
// unit of their work, but kept to more rows than the highest rank so that every rank
// compresses it): PowerSGD's launch and finish at each rank, an even and an odd step, and the
// casts to and from bfloat16, the least of two tries (measureCompression). The step model
// prices each hook on each bucket (Note [Hooks in the model]), and rank 0 chooses
// (sim.Profile.BestHooks): for each level of compression it allows (bf16; PowerSGD at the
// highest rank; ... at rank 1), it searches the buckets' hooks one bucket at a time;
// of the sets found it takes the most accurate whose step is within 2% of the fastest
// (PowerSGD's error feedback recovers what a low rank drops, but slower), and it keeps the
// plain all-reduce everywhere unless that set is predicted at least 5% faster (the auto
// sizing's margin, within which the model cannot vouch for a gain) and at least 1 ms a
// step: on a step of a tenth of a millisecond (examples/mlp), 5% is a few microseconds,
// and three measured steps chose bf16 there for a predicted 0.11 against 0.12 ms. Rank 0 broadcasts the
// choice, every rank logs it with its prediction, and from the next step each bucket runs
// its hook. A bucket's PowerSGD state starts there, with its StartIter counted from the
// decision. The choice is not revisited, and a checkpoint keeps it (Note [Auto hook
// checkpoints]).
//
// On one host the shared-memory all-reduce moves a gigabyte in tens of milliseconds, less
// than PowerSGD's products cost, so the model keeps the plain all-reduce; over a 1 Gbit/s
// link the wire's hundreds of milliseconds decide for compression.

type autoHook struct {
	o      AutoHookOptions
	setup  HookSetup
	ready  bool
	bf16   CommHook
	choice []sim.Hook        // by bucket; nil until the decision
	psgd   map[int]*powerSGD // by rank, for the buckets that chose it
	comp   *sim.Compression  // this rank's measurements
	force  []sim.Hook        // tests: rank 0's choice, instead of the model's
	plan   *sim.HookPlan     // rank 0's choice, as this rank predicts it
	// The decision's layout, for checkpoints: the agreed order and the caps.
	order    []int
	caps     [2]int64
	restored *autoRestore // a checkpoint's decision, until the reducer adopts it
	launched bool         // a bucket has been launched: too late to restore
}

func (h *autoHook) Describe() string {
	return fmt.Sprintf("auto(powersgd ranks %v, min_compression_rate %v, start_iter %d, seed %d)", h.o.Ranks, h.o.PowerSGD.MinCompressionRate, h.o.PowerSGD.StartIter, h.o.PowerSGD.Seed)
}

// Setup implements ShapedHook.
func (h *autoHook) Setup(s HookSetup) error {
	switch {
	case h.ready:
		return errors.New("already set up by another Reducer: give each DDP its own hook")
	case s.Device:
		return errors.New("device buckets (Options.Device) are not supported: use a host bucket or another hook")
	case !(h.o.PowerSGD.MinCompressionRate >= 1) || math.IsInf(h.o.PowerSGD.MinCompressionRate, 0):
		return fmt.Errorf("MinCompressionRate %v, want at least 1 (and finite)", h.o.PowerSGD.MinCompressionRate)
	case h.o.PowerSGD.StartIter < 0:
		return fmt.Errorf("StartIter %d, want 0 or more", h.o.PowerSGD.StartIter)
	case !(h.o.MinGain > 0 && h.o.MinGain < 1) || !(h.o.Accuracy > 0 && h.o.Accuracy < 1):
		return fmt.Errorf("margins %v and %v, want each in (0, 1)", h.o.MinGain, h.o.Accuracy)
	}
	for _, r := range h.o.Ranks {
		if r < 1 {
			return fmt.Errorf("PowerSGD rank %d, want at least 1", r)
		}
	}
	h.setup, h.ready = s, true
	h.setup.Params = slices.Clone(s.Params)
	h.bf16 = BF16CompressHook()
	return nil
}

// hookFor is the hook that reduces bucket b.
func (h *autoHook) hookFor(b int) CommHook {
	if b >= len(h.choice) {
		return allReduceHook{}
	}
	switch c := h.choice[b]; c.Kind {
	case "bf16":
		return h.bf16
	case "powersgd":
		return h.psgd[c.Rank]
	}
	return allReduceHook{}
}

func (h *autoHook) Launch(ctx context.Context, pg procgroup.ProcessGroup, b *BucketView) procgroup.Work {
	if !h.ready {
		return procgroup.Completed(fmt.Errorf("%w: auto hook: bucket %d launched before Setup (the hook was not given to New)", ErrInvalidArgument, b.Index))
	}
	h.launched = true
	return h.hookFor(b.Index).Launch(ctx, pg, b)
}

func (h *autoHook) Finish(b *BucketView) error { return h.hookFor(b.Index).Finish(b) }

// hookCode encodes a sim.Hook for the broadcast of rank 0's choice.
func hookCode(x sim.Hook) int64 {
	switch x.Kind {
	case "bf16":
		return 1
	case "powersgd":
		return 100 + int64(x.Rank)
	}
	return 0
}

func hookOfCode(c int64) (sim.Hook, error) {
	switch {
	case c == 0:
		return sim.Hook{Kind: "none"}, nil
	case c == 1:
		return sim.Hook{Kind: "bf16"}, nil
	case c > 100:
		return sim.Hook{Kind: "powersgd", Rank: int(c - 100)}, nil
	}
	return sim.Hook{}, fmt.Errorf("reducer: auto hook: unknown hook code %d from rank 0", c)
}

// compression returns this rank's measurements for prof's model (measured once).
func (h *autoHook) compression() (*sim.Compression, error) {
	if h.comp != nil {
		return h.comp, nil
	}
	c, err := measureCompression(h.setup.Params, h.o.Ranks, h.o.PowerSGD.MinCompressionRate)
	if err != nil {
		return nil, err
	}
	h.comp = c
	return c, nil
}

// decide is the auto sizing's part for the hook (Note [Auto hook]), on every rank with the
// layout the ranks are about to build: rank 0 chooses with its profile (nil if it could not
// model the step: then the plain all-reduce everywhere), broadcasts the choice, and every
// rank sets it up.
func (h *autoHook) decide(ctx context.Context, r *Reducer, prof *sim.Profile, bs []bucket.Bucket) error {
	codes := make([]int64, len(bs))
	if prof != nil {
		comp, err := h.compression()
		prof.Compression = comp
		if err == nil && r.pg.Rank() == 0 {
			var plan sim.HookPlan
			if plan, err = prof.BestHooks(bs, sim.HookOptions{MinGain: h.o.MinGain, Accuracy: h.o.Accuracy, MinSaving: sim.DefaultHookMinSaving}); err == nil {
				if h.force != nil {
					plan.Hooks = h.force
				}
				for b, x := range plan.Hooks {
					codes[b] = hookCode(x)
				}
			}
		}
		if err != nil {
			r.log.Warn("reducer: auto hook could not price the hooks; keeping the plain all-reduce", zap.Int("rank", r.pg.Rank()), zap.Error(err))
			prof.Compression, prof = nil, nil
		}
	}
	if len(codes) > 0 {
		if err := r.pg.Broadcast(ctx, codes, 0).Wait(ctx); err != nil {
			return fmt.Errorf("reducer: auto hook: broadcast of rank 0's choice: %w", err)
		}
	}
	choice, err := h.choiceOf(codes, "rank 0")
	if err != nil {
		return err
	}
	psgd, err := h.setupPowerSGD(choice, bs)
	if err != nil {
		return err
	}
	h.choice, h.psgd = choice, psgd
	h.order, h.caps = slices.Clone(r.auto.order), [2]int64{r.firstCap, r.capBytes}
	if prof != nil {
		h.plan = describe(prof, bs, choice)
	}
	return nil
}

// describe is this rank's prediction for rank 0's choice (nil if its profile cannot price
// it).
func describe(prof *sim.Profile, bs []bucket.Bucket, choice []sim.Hook) *sim.HookPlan {
	costs := make([]sim.HookCost, len(bs))
	for b, x := range choice {
		var err error
		if costs[b], err = prof.Compression.Cost(prof, bs[b], x); err != nil {
			return nil
		}
	}
	pred, err := prof.SimulateHooks(bs, costs)
	none, err2 := prof.Simulate(bs)
	if err != nil || err2 != nil {
		return nil
	}
	return &sim.HookPlan{Hooks: choice, Predicted: pred, None: none, Gain: 1 - pred.Step/none.Step}
}

// choiceOf decodes the buckets' hook codes that from (rank 0, or a saved state) chose,
// refusing a PowerSGD rank this hook does not offer.
func (h *autoHook) choiceOf(codes []int64, from string) ([]sim.Hook, error) {
	choice := make([]sim.Hook, len(codes))
	for b, c := range codes {
		x, err := hookOfCode(c)
		if err != nil {
			return nil, err
		}
		if x.Kind == "powersgd" && !slices.Contains(h.o.Ranks, x.Rank) {
			return nil, fmt.Errorf("reducer: auto hook: %s chose PowerSGD at rank %d, not one of this hook's %v", from, x.Rank, h.o.Ranks)
		}
		choice[b] = x
	}
	return choice, nil
}

// setupPowerSGD sets up the PowerSGD hooks that choice needs for the buckets bs: a state
// per rank chosen, over the parameters of the buckets that chose it.
func (h *autoHook) setupPowerSGD(choice []sim.Hook, bs []bucket.Bucket) (map[int]*powerSGD, error) {
	psgd := map[int]*powerSGD{}
	for _, rank := range h.o.Ranks {
		var mine bool
		s := h.setup
		s.Params = slices.Clone(h.setup.Params)
		in := make([]bool, len(s.Params))
		for b, x := range choice {
			if x.Kind == "powersgd" && x.Rank == rank {
				mine = true
				for _, i := range bs[b].Params {
					in[i] = true
				}
			}
		}
		if !mine {
			continue
		}
		for i := range s.Params {
			if !in[i] { // not this state's: no error buffer for it
				s.Params[i].Shape = []int{lenOf(s.Params[i].Shape)}
			}
		}
		o := h.o.PowerSGD
		o.Rank = rank
		p := PowerSGDHook(o).(*powerSGD)
		if err := p.Setup(s); err != nil {
			return nil, fmt.Errorf("reducer: auto hook: PowerSGD at rank %d: %w", rank, err)
		}
		psgd[rank] = p
	}
	return psgd, nil
}

func lenOf(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}
