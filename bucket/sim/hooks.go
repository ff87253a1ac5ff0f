package sim

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/goddp/goddp/bucket"
)

// Note [Hooks in the model]: a communication hook changes three things about one bucket in
// the step model (Note [Step model]): the bytes its collective moves, the compute it does on
// backward's thread before it launches the collective (a cast to bfloat16, PowerSGD's
// products with the factors and the error feedback), and the compute it does at Finalize to
// turn the reduced message back into gradients. The model charges the first through the
// all-reduce curve, Comm.Seconds of the message's bytes, and the other two as compute: the
// launch's at the launch, slowed down like any compute while a collective is in flight, and
// the finish's in Finalize, after the bucket's collective, like the copy back.
//
// The bytes come from the parameters' shapes and the hook's own rule (PowerSGD's
// min_compression_rate). The compute comes from Compression's costs per element, which the
// reducer measures at its decision by running the hooks' own kernels on a matrix of the
// model's (Note [Auto hook] in package reducer). PowerSGD alternates its P and Q steps, so a
// matrix of n×m sends n·r elements one step and m·r the next: the model takes the mean of
// the two.

// Hook is one hook the model knows: "none" (the plain all-reduce), "bf16", "fp16" (priced
// with bf16's casts: the same bytes, and casts of the same kind), or "powersgd" of a Rank.
type Hook struct {
	Kind string `json:"kind"`
	Rank int    `json:"rank,omitempty"`
}

func (h Hook) String() string {
	if h.Kind == "powersgd" {
		return fmt.Sprintf("powersgd(r=%d)", h.Rank)
	}
	return h.Kind
}

// HookCost is what a hook makes of one bucket in the model (Note [Hooks in the model]).
type HookCost struct {
	Wire       int64   // the bytes of the bucket's collective
	Pre, Post  float64 // compute before the launch and at Finalize, in seconds
	Compressed int     // the parameters sent in compressed form
}

// RankCost is PowerSGD's measured compute at one rank, per element of a compressed matrix.
type RankCost struct {
	Rank int     `json:"rank"`
	Pre  float64 `json:"pre_s_per_elem"`  // the launch: the error feedback and the product with a factor
	Post float64 `json:"post_s_per_elem"` // Finalize: the product of the two factors
}

// Compression is what the model needs to price the hooks of a profile's model: the
// parameters' shapes, and the measured compute per element (Note [Hooks in the model]).
type Compression struct {
	// Shapes are the parameters' shapes, in Profile.Params' order (nil for a 1-D one).
	Shapes [][]int `json:"shapes"`
	// MinCompressionRate is PowerSGD's rule: a matrix n×m is compressed at rank r only if
	// (n+m)·r·MinCompressionRate < n·m.
	MinCompressionRate float64 `json:"min_compression_rate"`
	// Cast16Pre and Cast16Post: the casts to and from a 16-bit float, per element.
	Cast16Pre  float64 `json:"cast16_pre_s_per_elem"`
	Cast16Post float64 `json:"cast16_post_s_per_elem"`
	// PowerSGD: the measured ranks.
	PowerSGD []RankCost `json:"powersgd"`
}

// Candidates returns the hooks c prices, from the most accurate to the least: none, bf16,
// then PowerSGD from its highest rank down.
func (c *Compression) Candidates() []Hook {
	hs := []Hook{{Kind: "none"}, {Kind: "bf16"}}
	rs := slices.Clone(c.PowerSGD)
	slices.SortFunc(rs, func(a, b RankCost) int { return b.Rank - a.Rank })
	for _, r := range rs {
		hs = append(hs, Hook{Kind: "powersgd", Rank: r.Rank})
	}
	return hs
}

// Check reports what is inconsistent in c for p's model.
func (c *Compression) Check(p *Profile) error {
	if len(c.Shapes) != len(p.Params) {
		return fmt.Errorf("%w: compression: %d shapes for %d parameters", ErrInvalid, len(c.Shapes), len(p.Params))
	}
	for i, s := range c.Shapes {
		size := 1
		for _, d := range s {
			size *= d
		}
		if s != nil && size != p.Params[i].Len {
			return fmt.Errorf("%w: compression: parameter %d (%s): shape %v for %d elements", ErrInvalid, i, p.Params[i].Name, s, p.Params[i].Len)
		}
	}
	if !(c.MinCompressionRate >= 1) {
		return fmt.Errorf("%w: compression: min_compression_rate %v, want at least 1", ErrInvalid, c.MinCompressionRate)
	}
	for _, v := range []float64{c.Cast16Pre, c.Cast16Post} {
		if !(v >= 0) || math.IsInf(v, 0) {
			return fmt.Errorf("%w: compression: cast cost %v", ErrInvalid, v)
		}
	}
	for _, r := range c.PowerSGD {
		if r.Rank < 1 || !(r.Pre >= 0) || !(r.Post >= 0) || math.IsInf(r.Pre+r.Post, 0) {
			return fmt.Errorf("%w: compression: PowerSGD rank %d costs %v and %v per element", ErrInvalid, r.Rank, r.Pre, r.Post)
		}
	}
	return nil
}

// matrix is parameter i as PowerSGD sees it: n rows of m, and whether rank r compresses it.
func (c *Compression) matrix(i, r int) (n, m int, ok bool) {
	s := c.Shapes[i]
	if len(s) < 2 {
		return 0, 0, false
	}
	n, m = s[0], 1
	for _, d := range s[1:] {
		m *= d
	}
	return n, m, float64(n+m)*float64(r)*c.MinCompressionRate < float64(n)*float64(m)
}

// Cost prices hook h on bucket b of p's model (Note [Hooks in the model]).
func (c *Compression) Cost(p *Profile, b bucket.Bucket, h Hook) (HookCost, error) {
	var out HookCost
	if len(c.Shapes) != len(p.Params) {
		return out, fmt.Errorf("%w: compression: %d shapes for %d parameters", ErrInvalid, len(c.Shapes), len(p.Params))
	}
	for _, i := range b.Params {
		if i < 0 || i >= len(p.Params) {
			return out, fmt.Errorf("%w: bucket parameter %d of %d", ErrInvalid, i, len(p.Params))
		}
	}
	switch h.Kind {
	case "none":
		for _, i := range b.Params {
			out.Wire += p.Params[i].Bytes()
		}
		return out, nil
	case "bf16", "fp16":
		for _, i := range b.Params {
			n := float64(p.Params[i].Len)
			out.Wire += 2 * int64(p.Params[i].Len)
			out.Pre += n * c.Cast16Pre
			out.Post += n * c.Cast16Post
		}
		return out, nil
	case "powersgd":
		k := slices.IndexFunc(c.PowerSGD, func(r RankCost) bool { return r.Rank == h.Rank })
		if k < 0 {
			return out, fmt.Errorf("%w: no measured cost for PowerSGD at rank %d", ErrInvalid, h.Rank)
		}
		rc := c.PowerSGD[k]
		var wire float64
		for _, i := range b.Params {
			q := p.Params[i]
			size := float64(q.Bytes()) / float64(max(q.Len, 1)) // bytes per element
			n, m, ok := c.matrix(i, h.Rank)
			if !ok { // sent as it is, copied into the message and back
				wire += float64(q.Bytes())
				out.Pre += p.CopyPerByte * float64(q.Bytes())
				out.Post += p.UnpackPerByte * float64(q.Bytes())
				continue
			}
			out.Compressed++
			wire += size * float64((n+m)*h.Rank) / 2
			out.Pre += rc.Pre * float64(n*m)
			out.Post += rc.Post * float64(n*m)
		}
		out.Wire = int64(math.Ceil(wire))
		return out, nil
	}
	return out, fmt.Errorf("%w: hook %q", ErrInvalid, h.Kind)
}

// SimulateHooks is Simulate with each bucket's hook priced by costs (one per bucket;
// nil: the plain all-reduce everywhere).
func (p *Profile) SimulateHooks(buckets []bucket.Bucket, costs []HookCost) (Result, error) {
	if costs != nil && len(costs) != len(buckets) {
		return Result{}, fmt.Errorf("%w: %d hook costs for %d buckets", ErrInvalid, len(costs), len(buckets))
	}
	return p.simulate(buckets, costs)
}

// HookOptions bound BestHooks' choice.
type HookOptions struct {
	// MinGain: the plain all-reduce everywhere is kept unless the chosen hooks are
	// predicted at least this much faster (a fraction of its step; DefaultMinGain).
	MinGain float64
	// Accuracy: among the sets of hooks tried, the most accurate one whose predicted step
	// is within this fraction of the fastest's is chosen (DefaultHookAccuracy).
	Accuracy float64
	// MinSaving: and at least this many seconds shorter (DefaultHookMinSaving).
	MinSaving float64
}

// DefaultHookMinSaving is the least predicted saving per step, 1 ms, for which the auto hook
// compresses (Note [Auto hook] in package reducer): on a step of a tenth of a millisecond,
// 5% is a few microseconds, below what three measured steps resolve.
const DefaultHookMinSaving = 1e-3

// DefaultHookAccuracy is the auto hook's tolerance for accuracy (Note [Auto hook] in
// package reducer): a more accurate set of hooks is preferred while it is predicted within
// 2% of the fastest.
const DefaultHookAccuracy = 0.02

// HookPlan is BestHooks' choice.
type HookPlan struct {
	Hooks     []Hook // by bucket
	Predicted Result // with Hooks
	None      Result // with the plain all-reduce everywhere
	// Fastest is the least step found with any of the hooks (Predicted is within
	// HookOptions.Accuracy of it, or None is kept).
	Fastest Result
	// Gain is 1 − Predicted.Step/None.Step; Kept: the plain all-reduce was kept because the
	// gain of the fastest set fell short of HookOptions.MinGain.
	Gain float64
	Kept bool
}

// Summary counts the plan's buckets by hook: "none ×3, powersgd(r=2) ×5".
func (h HookPlan) Summary() string {
	var order []Hook
	count := map[Hook]int{}
	for _, x := range h.Hooks {
		if count[x] == 0 {
			order = append(order, x)
		}
		count[x]++
	}
	parts := make([]string, len(order))
	for k, x := range order {
		parts[k] = fmt.Sprintf("%v ×%d", x, count[x])
	}
	return strings.Join(parts, ", ")
}

// BestHooks chooses a hook for each of the buckets, priced by p.Compression (Note [Auto
// hook] in package reducer). For each candidate from Candidates after the first, it searches the buckets' hooks
// among the candidates at least that accurate (bucket by bucket, each taking the one that
// makes the step least with the others fixed, until no bucket changes); of those sets it
// takes the most accurate whose step is within o.Accuracy of the fastest and shorter than
// the plain all-reduce's everywhere by at least o.MinGain of it and o.MinSaving, and keeps
// the plain all-reduce if no set is. The search is
// deterministic: every rank given the same inputs finds the same plan.
func (p *Profile) BestHooks(buckets []bucket.Bucket, o HookOptions) (HookPlan, error) {
	if err := p.Check(); err != nil {
		return HookPlan{}, err
	}
	c := p.Compression
	if c == nil {
		return HookPlan{}, fmt.Errorf("%w: the profile has no compression costs", ErrInvalid)
	}
	if err := c.Check(p); err != nil {
		return HookPlan{}, err
	}
	if !(o.MinGain >= 0 && o.MinGain < 1) || !(o.Accuracy >= 0 && o.Accuracy < 1) || !(o.MinSaving >= 0) {
		return HookPlan{}, fmt.Errorf("%w: hook margins %v and %v, want each in [0, 1), and a saving %v s, want 0 or more", ErrInvalid, o.MinGain, o.Accuracy, o.MinSaving)
	}
	cands := c.Candidates()
	// cost[b][k]: candidate k on bucket b.
	cost := make([][]HookCost, len(buckets))
	for b, bk := range buckets {
		cost[b] = make([]HookCost, len(cands))
		for k, h := range cands {
			var err error
			if cost[b][k], err = c.Cost(p, bk, h); err != nil {
				return HookPlan{}, err
			}
		}
	}
	pick := make([]int, len(buckets))
	costs := make([]HookCost, len(buckets))
	sim := func() (Result, error) {
		for b, k := range pick {
			costs[b] = cost[b][k]
		}
		return p.simulate(buckets, costs)
	}
	none, err := sim()
	if err != nil {
		return HookPlan{}, err
	}
	type set struct {
		pick []int
		r    Result
	}
	var sets []set
	fastest := none
	for top := 1; top < len(cands); top++ {
		clear(pick)
		cur := none
		for range 8 { // passes over the buckets, until none changes
			changed := false
			for b := range buckets {
				was, bestK, best := pick[b], pick[b], cur
				for k := 0; k <= top; k++ {
					if k == was {
						continue
					}
					pick[b] = k
					r, err := sim()
					if err != nil {
						return HookPlan{}, err
					}
					if r.Step < best.Step*(1-1e-9) {
						bestK, best = k, r
					}
				}
				pick[b] = bestK
				if bestK != was {
					changed, cur = true, best
				}
			}
			if !changed {
				break
			}
		}
		sets = append(sets, set{slices.Clone(pick), cur})
		if cur.Step < fastest.Step {
			fastest = cur
		}
	}
	plan := HookPlan{None: none, Fastest: fastest, Predicted: none, Hooks: make([]Hook, len(buckets))}
	for b := range plan.Hooks {
		plan.Hooks[b] = cands[0]
	}
	pays := func(r Result) bool { return 1-r.Step/none.Step >= o.MinGain && none.Step-r.Step >= o.MinSaving }
	if none.Step <= 0 || !pays(fastest) {
		plan.Kept = len(sets) > 0
		return plan, nil
	}
	for _, s := range sets { // the most accurate first
		if s.r.Step <= fastest.Step*(1+o.Accuracy) && pays(s.r) {
			for b, k := range s.pick {
				plan.Hooks[b] = cands[k]
			}
			plan.Predicted = s.r
			break
		}
	}
	plan.Gain = 1 - plan.Predicted.Step/none.Step
	return plan, nil
}
