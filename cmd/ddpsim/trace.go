package main

import (
	"cmp"
	"fmt"
	"maps"
	"math"
	"slices"

	"github.com/goddp/goddp/bucket/sim"
	"github.com/goddp/goddp/ddp/observe"
	"github.com/goddp/goddp/ddp/tracefile"
	"github.com/goddp/goddp/internal/sweepcsv"
)

// Note [The pacing rank]: a collective starts when the last rank launches it, so each pass
// of a job goes at the pace of whichever rank was slower in it. Two ranks that share a
// machine's cores differ by up to 20% in backward, and which of them is slower changes from
// launch to launch (docs/results/2026-12-04-step-model-sweeps.md). A single rank's timeline
// accounts for the other only through the skew, its wait for the other, which varies from
// launch to launch and does not move with the layout as the slower rank's compute does.
// With -trace_rank -1 every pass is read from the rank whose collectives took least from
// launch to end: the last to launch them, which waited for no one.

// readyFromTrace replaces p's ready times and backward compute with each gradient's ready
// time ("grad" instants) and the backward pass's length ("backward" spans) in goddp traces,
// less the reducer's copies before each (p.CopyPerByte): the mean over a trace's passes
// from iteration from on (of rank; -1: Note [The pacing rank]), then the median over the
// traces (one launch each). Where the trainer traced its steps ("step" spans), the rest of
// the step (p.Other) is replaced too, from each step's length less its pass (from the
// pass's start to the end of its Finalize wait). Where every pass ran one bucket, so is the
// skew (p.Skew), from how much longer the collective took than the all-reduce curve (p.Comm)
// gives for its bytes.
func readyFromTrace(p *sim.Profile, paths []string, rank, from int) error {
	// Each trace's means, then the median over the traces: the sweep's own statistic (the
	// mean ms/step of a launch, the median over launches).
	n := len(p.Params)
	ready := make([][]float64, n)
	var lens, rest, skews []float64
	for _, path := range paths {
		var s traceSamples
		if err := s.read(p, path, rank, from); err != nil {
			return err
		}
		for i := range s.at {
			if len(s.at[i]) == 0 {
				return fmt.Errorf("%s: the passes read (from iteration %d) never reported parameter %d (%s) ready", path, from, i, p.Params[i].Name)
			}
			ready[i] = append(ready[i], mean(s.at[i]))
		}
		lens = append(lens, mean(s.lens))
		if len(s.rest) > 0 {
			rest = append(rest, mean(s.rest))
		}
		if len(s.skews) > 0 && len(s.skews) == len(s.lens) {
			skews = append(skews, mean(s.skews))
		}
	}
	order := make([]int, n)
	for i := range ready {
		p.Ready[i] = sweepcsv.Median(ready[i])
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(p.Ready[a], p.Ready[b]) })
	var copies float64
	for _, i := range order {
		p.Ready[i] = math.Max(p.Ready[i]-copies, 0)
		copies += p.CopyPerByte * float64(p.Params[i].Bytes())
	}
	p.Backward = math.Max(sweepcsv.Median(lens)-copies, 0)
	if len(rest) == len(paths) {
		p.Other = math.Max(sweepcsv.Median(rest), 0)
	}
	if len(skews) == len(paths) {
		p.Skew = math.Max(sweepcsv.Median(skews), 0)
	}
	return p.Check()
}

// Note [Overlap from traces]: the auto sizing measures the slowdowns under overlap in one
// pass with eight buckets (Note [Auto buckets] in package reducer), and one pass is at the
// mercy of the other rank and of the machine: the profiles of one sweep measured the
// compute slowdown anywhere from 0.22 to 1.00 and the all-reduce's from 0 to 3.4, and their
// median made the overlap look cheap (docs/results/2026-12-05-round-s37-same-layout.md,
// docs/results/2026-12-06-overlap-from-traces.md). A traced launch whose collectives run
// during backward gives the same figures as means over its steady passes, each from its
// pacing rank, and a sweep's launches their median: with B its backward, T the time with a
// collective in flight inside it and W the collectives' work done there (their time alone),
// against the one-bucket launches' backward B1 (both less the reducer's copies, launches
// and the collectives' own CPU, Note [A collective's CPU] in package bucket/sim), compute
// did T − (B − B1) of its work in T, and the collectives W: s = (B − B1) / (T − (B − B1))
// and c = T/W − 1, each at most 9. They are not bounded as one resource shared (Note
// [Shared speed] in package bucket/sim): these are steady means, not one pass's, and where
// the two ranks' collectives cost the cores more than they take (a kernel's network stack
// on the same two cores as both ranks' compute), s·c > 1 is what happens.

// overlapStats is what overlapFromTrace measured: the median over the traces of each
// trace's mean over its passes, in seconds.
type overlapStats struct {
	backward, inflight, work, buckets float64
}

// overlapFromTrace sets p.Slowdown and p.CommSlowdown from traces of launches whose
// collectives ran during backward, against p.Backward (Note [Overlap from traces]), read as
// readyFromTrace reads: passes from iteration from on, of rank or each pass's pacing rank.
func overlapFromTrace(p *sim.Profile, paths []string, rank, from int) (overlapStats, error) {
	var bw, in, work, nb []float64
	for _, path := range paths {
		var s traceSamples
		if err := s.read(p, path, rank, from); err != nil {
			return overlapStats{}, err
		}
		bw, in, work, nb = append(bw, mean(s.lens)), append(in, mean(s.inflight)), append(work, mean(s.work)), append(nb, mean(s.buckets))
	}
	o := overlapStats{inflight: sweepcsv.Median(in), work: sweepcsv.Median(work), buckets: sweepcsv.Median(nb)}
	o.backward = math.Max(sweepcsv.Median(bw)-p.CopyPerByte*float64(p.TotalBytes())-(p.Launch+p.CollectiveCPU)*o.buckets, 0)
	if !(o.inflight > 0 && o.work > 0) {
		return o, fmt.Errorf("-overlap_trace: no collective ran during backward in the passes read (from iteration %d); trace a launch with a small cap", from)
	}
	lost := math.Max(o.backward-p.Backward, 0)
	p.Slowdown = 9
	if lost < o.inflight {
		p.Slowdown = min(lost/(o.inflight-lost), 9)
	}
	p.CommSlowdown = min(math.Max(o.inflight/o.work-1, 0), 9)
	return o, p.Check()
}

// traceSamples holds what readyFromTrace takes from one trace's passes, in seconds.
type traceSamples struct {
	at    [][]float64 // parameter → its ready times, from the start of backward
	lens  []float64   // the backward passes' lengths
	rest  []float64   // each traced step's length less its pass
	skews []float64   // each one-collective pass's collective beyond the curve
	// Each pass's time with a collective in flight during backward, the part of the
	// collectives' work (their time alone, by the curve) done in it, and its collectives.
	inflight, work, buckets []float64
}

// read adds one trace's passes from iteration from on: those of rank, or with rank -1 those
// of the last rank to launch each pass's collectives (Note [The pacing rank]).
func (s *traceSamples) read(p *sim.Profile, path string, rank, from int) error {
	if s.at == nil {
		s.at = make([][]float64, len(p.Params))
	}
	tf, err := tracefile.ReadFile(path)
	if err != nil {
		return err
	}
	type key struct {
		rank int
		iter int64
	}
	passes := map[key]*tracePass{}
	steps := map[int][][2]float64{} // rank → its step spans, µs
	for _, e := range tf.TraceEvents {
		if (rank >= 0 && e.PID != rank) || e.Ph != "X" {
			continue
		}
		if e.Cat == observe.CatStep {
			steps[e.PID] = append(steps[e.PID], [2]float64{e.TS, e.End()})
		}
		if iter, ok := e.Arg("iter"); ok && iter >= int64(from) && e.Cat == observe.CatBackward {
			passes[key{e.PID, iter}] = &tracePass{start: e.TS, length: e.Dur, end: e.End()}
		}
	}
	if len(passes) == 0 {
		what := fmt.Sprintf("rank %d", rank)
		if rank < 0 {
			what = "any rank"
		}
		return fmt.Errorf("%s: no backward passes of %s from iteration %d (a trace written with --trace?)", path, what, from)
	}
	for _, e := range tf.TraceEvents {
		iter, ok := e.Arg("iter")
		ps := passes[key{e.PID, iter}]
		if !ok || ps == nil {
			continue
		}
		switch {
		case e.Ph == "X" && e.Cat == observe.CatWait:
			ps.end = max(ps.end, e.End())
		case e.Ph == "X" && e.Cat == observe.CatComm:
			ps.comms = append(ps.comms, e)
		case e.Cat == observe.CatGrad:
			ps.grads = append(ps.grads, e)
		}
	}
	// The passes to read: rank's, or each iteration's pacing rank's.
	pick := map[int64]key{}
	for k, ps := range passes {
		q, ok := pick[k.iter]
		if !ok || ps.commTime() < passes[q].commTime() || (ps.commTime() == passes[q].commTime() && k.rank < q.rank) {
			pick[k.iter] = k
		}
	}
	// In iteration order, so that the means (sums of floats) come out the same every run.
	iters := slices.Sorted(maps.Keys(pick))
	for _, it := range iters {
		k := pick[it]
		ps := passes[k]
		for _, e := range ps.grads {
			i, ok := e.Arg("param")
			if !ok {
				continue
			}
			if i < 0 || int(i) >= len(p.Params) {
				return fmt.Errorf("%s: gradient of parameter %d; the profile has %d", path, i, len(p.Params))
			}
			s.at[i] = append(s.at[i], (e.TS-ps.start)/1e6)
		}
		s.lens = append(s.lens, ps.length/1e6)
		in, work := ps.overlap(p.Comm)
		s.inflight = append(s.inflight, in)
		s.work = append(s.work, work)
		s.buckets = append(s.buckets, float64(len(ps.comms)))
		for _, sp := range steps[k.rank] {
			if sp[0] <= ps.start && ps.end <= sp[1] {
				s.rest = append(s.rest, (sp[1]-sp[0]-(ps.end-ps.start))/1e6)
				break
			}
		}
		// With one bucket a pass, its collective ran alone after backward: how much longer
		// it took than the all-reduce curve says is the wait for the later rank, the skew.
		if len(ps.comms) == 1 {
			if b, ok := ps.comms[0].Arg("bytes"); ok && b > 0 {
				s.skews = append(s.skews, ps.comms[0].Dur/1e6-p.Comm.Seconds(b))
			}
		}
	}
	return nil
}

// tracePass is one rank's backward pass in a trace.
type tracePass struct {
	start, length, end float64           // the backward pass's start and length, the end of its Finalize wait (µs)
	comms, grads       []tracefile.Event // its collectives, its gradients' ready instants
}

// commTime is the time the pass's collectives took on its rank, from launch to end.
func (ps *tracePass) commTime() float64 {
	var t float64
	for _, e := range ps.comms {
		t += e.Dur
	}
	return t
}

// overlap returns the time, in seconds, with a collective in flight during the backward
// pass, and the part of the collectives' work done in it: each collective's time alone (by
// curve) times the fraction of its span inside backward. A collective's span starts at its
// launch or its predecessor's end, whichever is later (package observe); on the pacing rank
// (Note [The pacing rank]) it runs from there.
func (ps *tracePass) overlap(curve sim.Comm) (inflight, work float64) {
	lo, hi := ps.start, ps.start+ps.length
	for _, e := range ps.comms {
		in := max(min(e.End(), hi)-max(e.TS, lo), 0)
		inflight += in / 1e6
		if b, ok := e.Arg("bytes"); ok && b > 0 && e.Dur > 0 {
			work += curve.Seconds(b) * in / e.Dur
		}
	}
	return inflight, work
}
