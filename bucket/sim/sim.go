// Package sim predicts the time of one DDP training step for a bucket layout, from measured
// inputs: when each gradient becomes ready in backward, what a bucket's all-reduce costs
// against its size, the reducer's per-byte and per-bucket overheads, and how much compute and
// communication slow each other down while they overlap. The reducer's automatic bucket sizing
// (reducer.AutoBucketCap) and cmd/ddpsim both use it: one model, one piece of code.
//
// # Usage
//
//	p := &sim.Profile{Params: params, Order: order, Ready: ready, Backward: 0.120, Other: 0.050,
//		Comm: sim.Ring(2, 50e-6, 1e9/8)}
//	r, err := p.SimulateCaps(1<<20, 25<<20)     // r.Step, r.Exposed, r.Buckets
//	plan, err := p.Best(sim.SearchOptions{})    // the layout with the least predicted step
//
// Note [Step model]: backward is a sequence of compute segments, one per gradient in the
// order they become ready: the pure compute up to that gradient (Ready), then the reducer's
// copy of it into its bucket (CopyPerByte), then, for every bucket this completes (in index
// order, Note [Bucket order] in package reducer), a launch (Launch) and the collective's
// own CPU time (CollectiveCPU, Note [A collective's CPU]). Collectives run one at a time in
// bucket order, each taking Comm.Seconds(bytes) when alone. While a collective is in flight
// during backward, compute runs at 1/(1+Slowdown) of its speed and the collective at
// 1/(1+CommSlowdown) of its own: on a CPU backend both want the same cores and memory
// bandwidth. A collective starts at the earliest Skew after its launch, when the slowest
// rank launches it too; waiting for it costs no compute. After backward, Finalize waits for
// each bucket in order and copies it back (UnpackPerByte) while later ones are still
// reducing. The step is Other (forward, optimizer, data: what no layout changes) plus that
// backward-and-Finalize time.
package sim

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"

	"github.com/goddp/goddp/bucket"
)

// ErrInvalid is wrapped by every error about a bad profile or layout.
var ErrInvalid = errors.New("sim: invalid argument")

// Point is one measured all-reduce: its size in bytes and its time in seconds.
type Point struct {
	Bytes   int64   `json:"bytes"`
	Seconds float64 `json:"seconds"`
}

// Comm is the time of one bucket's all-reduce against its size: Alpha + Beta·bytes, or, when
// Points are given (ascending by size, as Fit leaves them), the piecewise-linear curve
// through them, or with Lower the lowest non-decreasing convex curve on or under them (Note
// [Lower curve]). The curve is continued past the largest point with the slope of its last
// segment (or Beta, if steeper) and below the smallest point straight down to Alpha (or the
// curve's time there, if less) at zero bytes.
type Comm struct {
	Alpha  float64 `json:"alpha_s"`          // seconds per collective
	Beta   float64 `json:"beta_s_per_byte"`  // seconds per byte
	Points []Point `json:"points,omitempty"` // measured, ascending by Bytes
	// Lower: each point is the least of a few tries, which a disturbance can leave far
	// above the curve (the auto sizing's probe); the curve passes under such a point.
	Lower bool `json:"lower,omitempty"`
}

// Note [Lower curve]: the auto sizing's probe times each size twice and keeps the faster
// (Note [Probe twice over] in package reducer). A disturbance only ever slows an
// all-reduce, so such a point can lie above the true curve but not below it, and two tries
// do not always get past it; through every point, a size left high looks expensive, and on
// the two-host testbed such points led auto to layouts 1.09-1.10x the best. So a curve with
// Lower set is the lowest one under the points that two properties allow. It does not
// decrease: each point counts at most the least time measured at its size or a larger one.
// And it is convex, its cost per added byte not falling as the size grows: a point above
// the chord between two others counts as the chord. Between the points the curve is the
// least chord over a pair of points around the size (the lower convex hull). Convexity
// holds on CPU links, a latency floor or a burst and then the line rate, but not
// everywhere: a GPU library's bandwidth rises over a range of sizes, and there the curve is
// concave (the RCCL curve of cmd/ddpsim's seed tables lies 17% above the chord from 4 to
// 64 MB at 16 MB). That is why the curves of many tries each (allreduce-perf, published
// tables) go through their points. The measurements:
// docs/results/2026-12-06-probe-lower-curve.md.

// Seconds is the time of one all-reduce of the given size.
func (c Comm) Seconds(bytes int64) float64 {
	if len(c.Points) == 0 {
		return c.Alpha + c.Beta*float64(bytes)
	}
	ps := c.Points
	if c.Lower {
		var buf [32]Point // no allocation for a probe's few points
		ps = lowerHull(buf[:0], ps)
	}
	x := float64(bytes)
	k := sort.Search(len(ps), func(k int) bool { return ps[k].Bytes >= bytes })
	switch {
	case k == 0:
		p := ps[0]
		if p.Bytes <= 0 {
			return p.Seconds
		}
		a := math.Min(c.Alpha, p.Seconds)
		return a + (p.Seconds-a)*x/float64(p.Bytes)
	case k == len(ps):
		last := ps[len(ps)-1]
		slope := c.Beta
		if k > 1 {
			prev := ps[k-2]
			slope = math.Max(slope, (last.Seconds-prev.Seconds)/float64(last.Bytes-prev.Bytes))
		}
		return last.Seconds + slope*(x-float64(last.Bytes))
	}
	lo, hi := ps[k-1], ps[k]
	return lo.Seconds + (hi.Seconds-lo.Seconds)*(x-float64(lo.Bytes))/float64(hi.Bytes-lo.Bytes)
}

// lowerHull appends to dst, ascending by size, the vertices of the lowest non-decreasing
// convex curve on or under ps (ascending by size; Note [Lower curve]). From the largest
// point down, each point counts at most the least time seen so far, and a vertex that lies
// on or above the chord from the new point to the vertex before it goes.
func lowerHull(dst, ps []Point) []Point {
	least := math.Inf(1)
	for k := len(ps) - 1; k >= 0; k-- {
		least = math.Min(least, ps[k].Seconds)
		p := Point{Bytes: ps[k].Bytes, Seconds: least}
		for n := len(dst); n >= 2; n-- {
			a, b := dst[n-2], dst[n-1] // a is the larger
			if (b.Seconds-p.Seconds)*float64(a.Bytes-p.Bytes) < (a.Seconds-p.Seconds)*float64(b.Bytes-p.Bytes) {
				break
			}
			dst = dst[:n-1]
		}
		dst = append(dst, p)
	}
	slices.Reverse(dst)
	return dst
}

// Fit returns the least-squares line α + β·bytes through pts, with α and β clamped at zero,
// and pts (sorted, the fastest of equal sizes kept) as the points of the curve.
func Fit(pts []Point) (Comm, error) {
	if len(pts) == 0 {
		return Comm{}, fmt.Errorf("%w: no all-reduce measurements to fit", ErrInvalid)
	}
	ps := append([]Point(nil), pts...)
	sort.Slice(ps, func(a, b int) bool { return ps[a].Bytes < ps[b].Bytes })
	// Keep the fastest of equal sizes: the others met a disturbance.
	out := ps[:0]
	for _, p := range ps {
		if p.Seconds < 0 || math.IsNaN(p.Seconds) || math.IsInf(p.Seconds, 0) || p.Bytes < 0 {
			return Comm{}, fmt.Errorf("%w: all-reduce of %d bytes in %v s", ErrInvalid, p.Bytes, p.Seconds)
		}
		if n := len(out); n > 0 && out[n-1].Bytes == p.Bytes {
			out[n-1].Seconds = math.Min(out[n-1].Seconds, p.Seconds)
			continue
		}
		out = append(out, p)
	}
	var sx, sy, sxx, sxy float64
	n := float64(len(out))
	for _, p := range out {
		x := float64(p.Bytes)
		sx, sy, sxx, sxy = sx+x, sy+p.Seconds, sxx+x*x, sxy+x*p.Seconds
	}
	c := Comm{Points: out}
	if d := n*sxx - sx*sx; len(out) > 1 && d > 0 {
		c.Beta = (n*sxy - sx*sy) / d
		c.Alpha = (sy - c.Beta*sx) / n
	} else if out[0].Bytes > 0 {
		c.Beta = out[0].Seconds / float64(out[0].Bytes)
	}
	if c.Beta < 0 {
		c.Beta = 0
	}
	if c.Alpha < 0 {
		c.Alpha = 0
	}
	return c, nil
}

// Ring is the ring all-reduce's cost on n ranks whose slowest hop has the given latency
// (seconds) and bandwidth (bytes per second each way): 2(n−1) steps, each moving 1/n of the
// buffer (reduce-scatter, then all-gather).
func Ring(n int, latency, bytesPerSec float64) Comm {
	if n < 2 {
		return Comm{}
	}
	return Comm{Alpha: 2 * float64(n-1) * latency, Beta: 2 * float64(n-1) / float64(n) / bytesPerSec}
}

// Tree is the double binary tree all-reduce's cost on n ranks (NCCL's tree): a reduce up
// and a broadcast down, each ⌈log2 n⌉ hops deep, pipelined so that each rank sends and
// receives about the buffer twice, as the ring does.
func Tree(n int, latency, bytesPerSec float64) Comm {
	if n < 2 {
		return Comm{}
	}
	depth := math.Ceil(math.Log2(float64(n)))
	return Comm{Alpha: 2 * depth * latency, Beta: 2 / bytesPerSec}
}

// Profile is everything the model needs about one rank's step. Times are in seconds;
// Ready[i] and Backward are pure compute, without the reducer's own time and without the
// slowdown of overlapping collectives.
type Profile struct {
	// Params are the gradients, in registration order.
	Params []bucket.Param `json:"params"`
	// Order is the order their gradients become ready in (a permutation of the indices).
	Order []int `json:"order"`
	// Ready[i]: when parameter i's gradient is ready, from the start of backward.
	Ready []float64 `json:"ready_s"`
	// Backward: when backward's compute ends (at or after every Ready).
	Backward float64 `json:"backward_s"`
	// Other: the rest of the step, the same for every layout (forward, optimizer, data).
	Other float64 `json:"other_s"`
	// CopyPerByte: the reducer's copy of a gradient into its bucket, per byte.
	CopyPerByte float64 `json:"copy_s_per_byte"`
	// Launch: a bucket's launch, on the backward's thread.
	Launch float64 `json:"launch_s"`
	// CollectiveCPU: the compute time each collective costs beyond what its bytes do, for
	// the CPU its own goroutines and the kernel spend on it where they share the cores with
	// compute (Note [A collective's CPU]).
	CollectiveCPU float64 `json:"collective_cpu_s,omitempty"`
	// UnpackPerByte: Finalize's copy of a reduced bucket back to the gradients, per byte
	// (0 with gradient-as-bucket-view).
	UnpackPerByte float64 `json:"unpack_s_per_byte"`
	// Slowdown: compute runs 1/(1+Slowdown) as fast while a collective is in flight.
	Slowdown float64 `json:"slowdown"`
	// CommSlowdown: a collective runs 1/(1+CommSlowdown) as fast while backward computes.
	CommSlowdown float64 `json:"comm_slowdown"`
	// Skew: how long after this rank launches a collective the last rank launches it; a
	// collective starts no earlier (the ranks' compute differs from step to step).
	Skew float64 `json:"skew_s"`
	// Comm is one all-reduce's time against its size, alone.
	Comm Comm `json:"comm"`
	// World is the number of ranks the measurements were taken with (informative).
	World int `json:"world,omitempty"`
	// Compression prices the communication hooks (Note [Hooks in the model]); nil where
	// they were not measured.
	Compression *Compression `json:"compression,omitempty"`
}

// Note [Shared speed]: while they overlap, compute runs at 1/(1+Slowdown) of its speed and a
// collective at 1/(1+CommSlowdown) of its own. Where the two slow each other down by
// competing for one resource (the cores, memory bandwidth), a scheduler that wastes none of
// it gives them fractions of it that add up to at least one: 1/(1+s) + 1/(1+c) ≥ 1, which
// is s·c ≤ 1 (s = c = 1 for two that each need the whole resource and get half). A measured
// pair beyond that is inflated by what the measurement also caught (a one-off stall, a wait
// for another rank), and the model then charges an overlapped collective twice: on the
// two-host testbed such profiles predicted the caps that overlap most 15-39% slower than
// measured (docs/results/2026-12-04-step-model-sweeps.md). SharedSpeed brings such a pair
// back to s·c = 1, dividing both by the same factor, since nothing tells which of the two
// was inflated.

// Note [A collective's CPU]: on a CPU backend a collective costs CPU time of its own beyond
// the bytes it moves: waking goroutines, system calls, a shared-memory waiter's polls, the
// ring's steps. Where the ranks' compute already takes every core, that time comes out of
// compute, whether the collective overlaps backward or not, so each extra bucket lengthens
// the step (0.77 ms per collective and rank, two ranks on two cores:
// docs/results/2026-12-06-collective-cpu.md). The slowdown under overlap does not hold it:
// it scales with the time a collective is in flight, which on one host is tens of
// microseconds. The model charges CollectiveCPU as compute at each launch. The auto sizing
// leaves it at zero: its passes are too few to measure it (Note [CPU per collective from a
// sweep] in cmd/ddpsim, which fits it from a sweep's launches).

// SharedSpeed returns the slowdowns s and c (Profile.Slowdown, CommSlowdown) bounded so that
// s·c ≤ 1 (Note [Shared speed]).
func SharedSpeed(s, c float64) (float64, float64) {
	if prod := s * c; prod > 1 {
		k := math.Sqrt(prod)
		return s / k, c / k
	}
	return s, c
}

// Result is one simulated step.
type Result struct {
	Step     float64 // Other + BackwardEnd + the Finalize wait and copies
	Backward float64 // when backward's compute ended, slowed by overlap and the reducer's hooks
	Exposed  float64 // Finalize's wait for collectives after backward
	Comm     float64 // time with a collective in flight
	Buckets  int
}

// Check reports what is inconsistent in p.
func (p *Profile) Check() error {
	n := len(p.Params)
	if len(p.Order) != n || len(p.Ready) != n {
		return fmt.Errorf("%w: %d parameters, %d in the order, %d ready times", ErrInvalid, n, len(p.Order), len(p.Ready))
	}
	seen := make([]bool, n)
	for _, i := range p.Order {
		if i < 0 || i >= n || seen[i] {
			return fmt.Errorf("%w: the order is not a permutation of the %d parameters (at %d)", ErrInvalid, n, i)
		}
		seen[i] = true
	}
	for _, v := range []float64{p.Backward, p.Other, p.CopyPerByte, p.Launch, p.CollectiveCPU, p.UnpackPerByte, p.Slowdown, p.CommSlowdown, p.Skew, p.Comm.Alpha, p.Comm.Beta} {
		if v < 0 || math.IsNaN(v) || math.IsInf(v, 0) {
			return fmt.Errorf("%w: negative or non-finite time or factor %v", ErrInvalid, v)
		}
	}
	for i, v := range p.Ready {
		if v < 0 || math.IsNaN(v) || math.IsInf(v, 0) {
			return fmt.Errorf("%w: parameter %d ready at %v s", ErrInvalid, i, v)
		}
	}
	for k, pt := range p.Comm.Points {
		if pt.Bytes < 0 || pt.Seconds < 0 || math.IsNaN(pt.Seconds) || math.IsInf(pt.Seconds, 0) || (k > 0 && pt.Bytes <= p.Comm.Points[k-1].Bytes) {
			return fmt.Errorf("%w: all-reduce point %d (%d bytes, %v s): want finite times at strictly ascending sizes", ErrInvalid, k, pt.Bytes, pt.Seconds)
		}
	}
	return nil
}

// TotalBytes is the size of all the gradients.
func (p *Profile) TotalBytes() int64 {
	var t int64
	for _, q := range p.Params {
		t += q.Bytes()
	}
	return t
}

// Layout assigns the buckets for the caps in p's order (bucket.AssignOrdered).
func (p *Profile) Layout(firstCapBytes, capBytes int64) ([]bucket.Bucket, error) {
	bs, err := bucket.AssignOrdered(p.Params, p.Order, firstCapBytes, capBytes)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return bs, nil
}

// SimulateCaps is Simulate of the layout of the given caps.
func (p *Profile) SimulateCaps(firstCapBytes, capBytes int64) (Result, error) {
	bs, err := p.Layout(firstCapBytes, capBytes)
	if err != nil {
		return Result{}, err
	}
	return p.Simulate(bs)
}

// Simulate predicts one step with the given buckets (Note [Step model]).
func (p *Profile) Simulate(buckets []bucket.Bucket) (Result, error) {
	return p.simulate(buckets, nil)
}

// simulate is Simulate with the hooks' costs by bucket (Note [Hooks in the model]; nil:
// the plain all-reduce).
func (p *Profile) simulate(buckets []bucket.Bucket, hooks []HookCost) (Result, error) {
	if err := p.Check(); err != nil {
		return Result{}, err
	}
	lay, err := bucket.NewLayout(p.Params, buckets)
	if err != nil {
		return Result{}, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	nb := len(buckets)
	pending := make([]int, nb)
	for b := range buckets {
		pending[b] = len(buckets[b].Params)
	}
	s := state{p: p, commOf: make([]float64, nb), finish: make([]float64, nb), earliest: make([]float64, nb)}
	for b := range buckets {
		wire := buckets[b].Bytes()
		if hooks != nil {
			wire = hooks[b].Wire
		}
		s.commOf[b] = p.Comm.Seconds(wire)
		s.finish[b] = -1
	}
	next, prev := 0, 0.0
	for _, i := range p.Order {
		work := math.Max(p.Ready[i]-prev, 0) + p.CopyPerByte*float64(p.Params[i].Bytes())
		prev = math.Max(prev, p.Ready[i])
		s.compute(work)
		pending[lay.Where[i].Bucket]--
		for next < nb && pending[next] == 0 {
			pre := 0.0
			if hooks != nil {
				pre = hooks[next].Pre
			}
			s.compute(p.Launch + p.CollectiveCPU + pre)
			s.earliest[next] = s.t + p.Skew
			s.queue = append(s.queue, next)
			if len(s.queue) == 1 {
				s.headLeft = s.commOf[next]
			}
			next++
		}
	}
	s.compute(math.Max(p.Backward-prev, 0))
	bwd := s.t
	// Finalize: the queue drains at full speed; each bucket is copied back in order once done.
	fin := bwd
	var unpack float64
	s.drain()
	for b := range buckets {
		u := p.UnpackPerByte * float64(buckets[b].Bytes())
		if hooks != nil {
			u += hooks[b].Post
		}
		fin = math.Max(fin, s.finish[b]) + u
		unpack += u
	}
	return Result{Step: p.Other + fin, Backward: bwd, Exposed: math.Max(fin-bwd-unpack, 0), Comm: s.busy, Buckets: nb}, nil
}

// state is Simulate's clock: compute advances t; the collectives in queue progress alongside.
type state struct {
	p        *Profile
	t        float64
	queue    []int     // launched buckets not finished, in order; queue[0] is running once t ≥ its earliest
	headLeft float64   // the head collective's remaining time, alone
	commOf   []float64 // each bucket's collective alone
	earliest []float64 // when each launched bucket may start: its launch plus Skew
	finish   []float64
	busy     float64
}

// compute advances the clock by work seconds of compute, at reduced speed while a collective
// runs, and the collectives by the time that passes.
func (s *state) compute(work float64) {
	sc, cc := 1+s.p.Slowdown, 1+s.p.CommSlowdown
	for work > 0 {
		if len(s.queue) == 0 {
			s.t += work
			return
		}
		if e := s.earliest[s.queue[0]]; s.t < e { // waiting for the last rank: compute at full speed
			if s.t+work <= e {
				s.t += work
				return
			}
			work -= e - s.t
			s.t = e
		}
		dtWork, dtComm := work*sc, s.headLeft*cc
		if dtWork < dtComm {
			s.t += dtWork
			s.busy += dtWork
			s.headLeft -= dtWork / cc
			return
		}
		s.t += dtComm
		s.busy += dtComm
		work -= dtComm / sc
		s.pop()
	}
}

// pop ends the running collective at s.t and starts the next.
func (s *state) pop() {
	s.finish[s.queue[0]] = s.t
	s.queue = s.queue[1:]
	if len(s.queue) > 0 {
		s.headLeft = s.commOf[s.queue[0]]
	}
}

// drain runs the queued collectives to the end at full speed, from s.t.
func (s *state) drain() {
	for len(s.queue) > 0 {
		s.t = max(s.t, s.earliest[s.queue[0]])
		s.t += s.headLeft
		s.busy += s.headLeft
		s.pop()
	}
}

// SearchOptions bound Best's search.
type SearchOptions struct {
	// Steps is the number of caps tried per factor of 2, from 64 KiB to the size of all
	// the gradients (default 4).
	Steps int
	// KeepFirstCapBytes and KeepCapBytes, when both are set, are the caps of the layout in
	// use (Note [Keep the default]): Best returns their layout unless the least predicted
	// step is at least MinGain (a fraction of the kept layout's step) shorter.
	KeepFirstCapBytes, KeepCapBytes int64
	MinGain                         float64
}

// DefaultMinGain is the auto sizing's margin (Note [Keep the default]): the reducer, and
// cmd/ddpsim for its choice, keep the default caps unless another layout is predicted at
// least this much faster.
const DefaultMinGain = 0.05

// AutoOptions are the auto sizing's search options: the layout to keep is the first cap
// given (FirstBucketCapMB's) and bucket.DefaultCapBytes, with the margin DefaultMinGain.
// The reducer decides with them, and cmd/ddpsim predicts its choice with them.
func AutoOptions(firstCapBytes int64) SearchOptions {
	return SearchOptions{KeepFirstCapBytes: firstCapBytes, KeepCapBytes: bucket.DefaultCapBytes, MinGain: DefaultMinGain}
}

// Note [Keep the default]: where the predicted steps of many layouts lie within a few
// percent of each other, which of them a profile finds best is decided by the noise in its
// few measured steps, not by the layouts: six launches of one configuration chose five
// layouts, which measured from 6% faster to 24% slower than the best cap, where the default
// caps measured as the best (docs/results/2026-12-03-auto-keep-the-default.md). With a
// layout to keep and a MinGain, Best prefers the kept layout (for the reducer, the default
// caps that a DDP user would otherwise run) unless another is predicted to beat it by at
// least the margin. The reducer's margin is 5% (DefaultMinGain): the tolerance within which
// its validation counts a layout as good as the best, so that a layout predicted within it
// gains nothing the model can vouch for.

// Plan is a chosen layout and its prediction.
type Plan struct {
	FirstCapBytes, CapBytes int64
	Buckets                 []bucket.Bucket
	Predicted               Result
	// Gain is how much shorter the least predicted step is than the kept layout's, as a
	// fraction of the latter (0 without SearchOptions.KeepCapBytes), and Kept whether Best
	// returned the kept layout because Gain fell short of MinGain.
	Gain float64
	Kept bool
}

// Caps returns the caps Best tries for gradients of total bytes: geometric from 64 KiB to
// total (at least 64 KiB), Steps per factor of 2, and that last size itself.
func (o SearchOptions) Caps(total int64) []int64 {
	const lo = 64 << 10
	// beyond a petabyte the float steps below lose their precision
	hi, steps := min(max(total, lo), 1<<50), o.Steps
	if steps <= 0 {
		steps = 4
	}
	var caps []int64
	for k := 0; ; k++ {
		c := int64(math.Round(float64(lo) * math.Pow(2, float64(k)/float64(steps))))
		if c >= hi || c <= 0 {
			break
		}
		if len(caps) == 0 || c != caps[len(caps)-1] {
			caps = append(caps, c)
		}
	}
	return append(caps, hi)
}

// Best returns the layout with the least predicted step among the pairs (first cap, cap) of
// caps from o.Caps, the first cap at most the other. Among the layouts within 0.1% of the
// least, it takes the one with the fewest buckets (then the first found: smaller caps
// first). With a layout to keep (o.KeepCapBytes), it returns that one instead unless the
// least step is at least o.MinGain shorter (Note [Keep the default]). The search is
// deterministic: every rank given the same profile finds the same plan.
func (p *Profile) Best(o SearchOptions) (Plan, error) {
	if err := p.Check(); err != nil {
		return Plan{}, err
	}
	if (o.KeepFirstCapBytes > 0) != (o.KeepCapBytes > 0) || o.KeepFirstCapBytes < 0 || o.KeepCapBytes < 0 || !(o.MinGain >= 0 && o.MinGain < 1) {
		return Plan{}, fmt.Errorf("%w: layout to keep: first cap %d, cap %d bytes, margin %v (want both caps or neither, and a margin in [0, 1))",
			ErrInvalid, o.KeepFirstCapBytes, o.KeepCapBytes, o.MinGain)
	}
	best, err := p.least(o)
	if err != nil || o.KeepCapBytes == 0 {
		return best, err
	}
	bs, err := p.Layout(o.KeepFirstCapBytes, o.KeepCapBytes)
	if err != nil {
		return Plan{}, err
	}
	r, err := p.Simulate(bs)
	if err != nil {
		return Plan{}, err
	}
	best.Gain = math.Max(1-best.Predicted.Step/r.Step, 0)
	if best.Gain >= o.MinGain {
		return best, nil
	}
	return Plan{FirstCapBytes: o.KeepFirstCapBytes, CapBytes: o.KeepCapBytes, Buckets: bs, Predicted: r, Gain: best.Gain, Kept: true}, nil
}

// least is Best's search, without the layout to keep.
func (p *Profile) least(o SearchOptions) (Plan, error) {
	caps := o.Caps(p.TotalBytes())
	var plans []Plan
	least := math.Inf(1)
	for j, c := range caps {
		for _, f := range caps[:j+1] {
			bs, err := p.Layout(f, c)
			if err != nil {
				return Plan{}, err
			}
			r, err := p.Simulate(bs)
			if err != nil {
				return Plan{}, err
			}
			plans = append(plans, Plan{FirstCapBytes: f, CapBytes: c, Buckets: bs, Predicted: r})
			least = math.Min(least, r.Step)
		}
	}
	var best *Plan
	for k := range plans {
		q := &plans[k]
		if q.Predicted.Step <= least*(1+1e-3) && (best == nil || q.Predicted.Buckets < best.Predicted.Buckets) {
			best = q
		}
	}
	return *best, nil
}
