// Command ddpsim predicts DDP step times for bucket layouts with the step model of package
// bucket/sim, the one the reducer's automatic bucket sizing (--bucket_cap_mb auto) uses.
//
// # Usage
//
//	ddpsim -profile auto_profile.json                       # the sweep's caps, predicted
//	ddpsim -profile r1.json,r2.json,r3.json -measured out/sweep/summary.csv
//	ddpsim -profile p.json -world 16 -algo tree -latency 5us -gbit 100
//	ddpsim -profile p.json -allreduce perf.jsonl                # allreduce-perf --json's curve
//	ddpsim -profile p.json -trace trace.rank0.json              # a trace's grad-ready times
//	ddpsim -profile p.json -trace one.json -overlap_trace many.json # and its slowdowns under overlap
//	ddpsim -seed                                            # the seed article's cluster
//
// A profile is what a run with --bucket_cap_mb auto --auto_profile F measured on rank 0: the
// gradients' sizes and ready times, the all-reduce cost curve, the reducer's overheads and
// the slowdowns under overlap. Several profiles (repeat launches) are combined field by
// field, by the median. -measured compares the prediction with a sweep's summary.csv
// (sweep-report), point by point. -world, -algo, -latency and -gbit replace the measured
// all-reduce curve with a ring or tree over that many ranks and that link, keeping the
// rest: what the same ranks would see elsewhere. -trace takes the compute timeline from
// traced launches with one bucket, and -overlap_trace the slowdowns under overlap from
// traced launches whose collectives run during backward (Note [Overlap from traces]).
//
// -seed prints the extrapolation to the seed article's experiment (8 MI300X, PyTorch's
// ddp_bench.py): the model shapes its script builds and the sizes it states, with compute
// and link figures whose sources are printed, beside the article's tables; then a what-if
// for 2–64 nodes of 8 GPUs at 100 and 400 Gbit/s.
package main

import (
	"cmp"
	"encoding/csv"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/bucket/sim"
	"github.com/goddp/goddp/ddp/observe"
	"github.com/goddp/goddp/ddp/tracefile"
	"github.com/goddp/goddp/procgroup/dtype"
)

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "ddpsim:", err)
		os.Exit(2)
	}
}

type config struct {
	profiles []string
	caps     []float64
	firstMB  float64
	minGain  float64 // -min_gain
	measured string
	layouts  string // -layouts: a sweep's layouts.csv
	world    int
	algo     string
	latency  time.Duration
	gbit     float64
	seed     bool
	compute  string        // -compute_ms: "", a number, or "sweep"
	perf     string        // -allreduce: allreduce-perf --json output
	traces   []string      // -trace: goddp traces whose grad-ready times replace the profile's
	overlap  []string      // -overlap_trace: goddp traces whose slowdowns under overlap replace the profile's
	rank     int           // -trace_rank
	from     int           // -trace_from
	collCPU  time.Duration // -collective_cpu; negative: the profiles'
	cpuCSV   string        // -collective_cpu_csv: a sweep's cpu.csv to fit it from
}

func parse(args []string, stderr io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("ddpsim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	profiles := fs.String("profile", "", "comma-separated profiles written by --auto_profile (combined by the median)")
	caps := fs.String("caps", "1,5,10,25,50,100,200", "bucket_cap_mb values to predict, comma-separated")
	fs.Float64Var(&c.firstMB, "first_cap_mb", 1, "first bucket's cap in MB for the caps of -caps")
	fs.Float64Var(&c.minGain, "min_gain", sim.DefaultMinGain, "auto's margin: its choice keeps the caps -first_cap_mb and 25 MB unless another layout is predicted at least this fraction faster (0: the least predicted)")
	fs.StringVar(&c.measured, "measured", "", "a sweep's summary.csv (sweep-report) to compare with, point by point (system goddp)")
	fs.StringVar(&c.layouts, "layouts", "", "with -measured: the sweep's layouts.csv (sweep-report; the caps that ran one layout, pooled), to compare the best predicted cap's layout with the best measured layout")
	fs.IntVar(&c.world, "world", 0, "with -gbit: ranks of the all-reduce to model instead of the measured curve")
	fs.StringVar(&c.algo, "algo", "ring", "with -gbit: ring or tree")
	fs.DurationVar(&c.latency, "latency", 5*time.Microsecond, "with -gbit: latency of one hop")
	fs.Float64Var(&c.gbit, "gbit", 0, "link bandwidth in Gbit/s each way: replaces the measured all-reduce curve with -algo over -world ranks")
	fs.StringVar(&c.compute, "compute_ms", "", "rescale the profile's compute so that a step without communication takes this many ms; "+
		"sweep: the compute-only ms/step of -measured (two --no_ddp processes, steady state, where the profile's first steps may be slower)")
	fs.StringVar(&c.perf, "allreduce", "", "replace the profile's all-reduce curve with allreduce-perf --json output (one JSON object per size)")
	traces := fs.String("trace", "", "take the grad-ready times, backward compute, the rest of the step and the skew from these goddp traces (--trace; comma-separated) instead: the mean over the passes of each trace, then the median over the traces; trace a run with one bucket (--bucket_cap_mb and --first_bucket_cap_mb above the model's size), so that no collective runs during backward")
	overlap := fs.String("overlap_trace", "", "with -trace: take the slowdowns under overlap from these goddp traces of launches whose collectives run during backward (a small cap for every bucket; comma-separated), against -trace's one-bucket compute (Note [Overlap from traces])")
	fs.IntVar(&c.rank, "trace_rank", -1, "with -trace: the rank whose passes to read; -1: each pass from whichever rank in the trace launched its collectives last (with every rank's: ddprun --trace_merge)")
	fs.IntVar(&c.from, "trace_from", 3, "with -trace: the first backward pass (counted from 1) to read; the first ones warm up")
	fs.DurationVar(&c.collCPU, "collective_cpu", -1, "each collective's own CPU time, charged as compute at its launch (Note [A collective's CPU] in package bucket/sim), instead of the profiles' (negative: theirs)")
	fs.StringVar(&c.cpuCSV, "collective_cpu_csv", "", "instead of -collective_cpu: fit it from a sweep's cpu.csv (rank 0's CPU per step against the buckets of each launch, Note [CPU per collective from a sweep])")
	fs.BoolVar(&c.seed, "seed", false, "print the extrapolation to the seed article's 8-GPU experiment and the multi-node what-if")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if *profiles == "" && !c.seed {
		return c, errors.New("give -profile FILE[,FILE...] (from --auto_profile) or -seed")
	}
	if *profiles != "" {
		c.profiles = strings.Split(*profiles, ",")
	}
	if *traces != "" {
		c.traces = strings.Split(*traces, ",")
	}
	if *overlap != "" {
		if c.traces == nil {
			return c, errors.New("-overlap_trace needs -trace (the one-bucket launches' compute to measure the slowdown against)")
		}
		c.overlap = strings.Split(*overlap, ",")
	}
	if c.collCPU >= 0 && c.cpuCSV != "" {
		return c, errors.New("give -collective_cpu or -collective_cpu_csv, not both")
	}
	for _, s := range strings.Split(*caps, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
		if err != nil || !(v > 0) || v > 1<<30 {
			return c, fmt.Errorf("-caps: %q is not a size in MB between 0 and 2^30", s)
		}
		c.caps = append(c.caps, v)
	}
	if !(c.firstMB > 0) || c.firstMB > 1<<30 {
		return c, fmt.Errorf("-first_cap_mb %v: want a size in MB between 0 and 2^30", c.firstMB)
	}
	if !(c.minGain >= 0 && c.minGain < 1) {
		return c, fmt.Errorf("-min_gain %v: want a fraction in [0, 1)", c.minGain)
	}
	if c.gbit < 0 || (c.gbit > 0 && c.world < 2) {
		return c, fmt.Errorf("-gbit %v needs -world of 2 or more (got %d)", c.gbit, c.world)
	}
	if c.layouts != "" && c.measured == "" {
		return c, errors.New("-layouts needs -measured")
	}
	if c.compute == "sweep" && c.measured == "" {
		return c, errors.New("-compute_ms sweep needs -measured")
	}
	if v, err := strconv.ParseFloat(c.compute, 64); c.compute != "" && c.compute != "sweep" && (err != nil || !(v > 0)) {
		return c, fmt.Errorf("-compute_ms %q: want a positive number of ms or sweep", c.compute)
	}
	if c.rank < -1 {
		return c, fmt.Errorf("-trace_rank %d: want a rank, or -1 for each pass's last rank", c.rank)
	}
	if c.algo != "ring" && c.algo != "tree" {
		return c, fmt.Errorf("-algo %q: want ring or tree", c.algo)
	}
	return c, nil
}

func run(args []string, stdout, stderr io.Writer) error {
	c, err := parse(args, stderr)
	if err != nil {
		return err
	}
	if c.seed {
		return seedReport(stdout)
	}
	p, err := loadProfiles(c.profiles)
	if err != nil {
		return err
	}
	if c.collCPU >= 0 {
		p.CollectiveCPU = c.collCPU.Seconds()
	}
	if c.cpuCSV != "" {
		fit, err := collectiveCPUFromSweep(c.cpuCSV)
		if err != nil {
			return err
		}
		p.CollectiveCPU = fit.perBucket
		fmt.Fprintf(stdout, "CPU per collective (-collective_cpu_csv): %.3f ms, the slope of rank 0's CPU per step against the buckets within each repeat, over %d launches of %d to %d buckets\n",
			fit.perBucket*1e3, fit.launches, fit.minBuckets, fit.maxBuckets)
	}
	if c.perf != "" {
		if p.Comm, err = readPerf(c.perf); err != nil {
			return err
		}
	}
	if c.traces != nil {
		if err := readyFromTrace(p, c.traces, c.rank, c.from); err != nil {
			return err
		}
	}
	if c.overlap != nil {
		o, err := overlapFromTrace(p, c.overlap, c.rank, c.from)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "overlap (-overlap_trace, %d launches): backward %.2f ms with %.1f buckets, %.2f ms with one (less the reducer's copies); "+
			"collectives in flight for %.2f ms of it, doing %.2f ms of their work alone\n",
			len(c.overlap), o.backward*1e3, o.buckets, p.Backward*1e3, o.inflight*1e3, o.work*1e3)
	}
	if c.gbit > 0 {
		algo := sim.Ring
		if c.algo == "tree" {
			algo = sim.Tree
		}
		p.Comm = algo(c.world, c.latency.Seconds(), c.gbit*1e9/8)
		p.World = c.world
	}
	var meas summary
	if c.measured != "" {
		if meas, err = readSummary(c.measured); err != nil {
			return err
		}
	}
	if c.layouts != "" {
		if meas.layouts, err = readLayouts(c.layouts); err != nil {
			return err
		}
	}
	if c.compute != "" {
		ms := meas.compute
		if c.compute != "sweep" {
			ms, _ = strconv.ParseFloat(c.compute, 64)
		} else if ms <= 0 {
			return fmt.Errorf("-compute_ms sweep: %s has no compute-only figure", c.measured)
		}
		k := ms / 1e3 / (p.Backward + p.Other)
		fmt.Fprintf(stdout, "compute rescaled by %.3f: the profile's step without communication, %.2f ms, to %.2f ms\n",
			k, (p.Backward+p.Other)*1e3, ms)
		for i := range p.Ready {
			p.Ready[i] *= k
		}
		p.Backward *= k
		p.Other *= k
	}
	return predictTable(stdout, p, c, meas)
}

// layoutLine prints where the best predicted cap stands among the measured layouts: the caps
// of one layout are one job, so a best cap among them is the noise's pick, but the best
// layout can be told apart (Note [Same layout] in cmd/sweep-report). Steps apart counts from
// the predicted cap to the nearest cap of the best measured layout, in caps.
func layoutLine(w io.Writer, caps []float64, pred float64, ls []measuredLayout) {
	best := 0
	for i, l := range ls {
		if l.ms < ls[best].ms {
			best = i
		}
	}
	b := ls[best]
	text := make([]string, len(b.caps))
	for i, c := range b.caps {
		text[i] = strconv.FormatFloat(c, 'g', -1, 64)
	}
	fmt.Fprintf(w, "\nby layout (-layouts): best measured: caps %s, P(best) %.2f", strings.Join(text, ", "), b.pBest)
	if slices.Contains(b.caps, pred) {
		fmt.Fprintf(w, "; the best predicted cap, %g MB, is one of them (0 steps apart)", pred)
		return
	}
	at := slices.Index(caps, pred)
	steps := len(caps)
	for _, c := range b.caps {
		if k := slices.Index(caps, c); k >= 0 {
			steps = min(steps, max(k-at, at-k))
		}
	}
	for _, l := range ls {
		if slices.Contains(l.caps, pred) {
			fmt.Fprintf(w, "; the best predicted cap, %g MB, ran a layout that measured %+.1f%% against it, P(best) %.2f (%d step(s) apart)", pred, 100*(l.ms/b.ms-1), l.pBest, steps)
			return
		}
	}
	fmt.Fprintf(w, "; the best predicted cap, %g MB, is in no measured layout (%d step(s) apart)", pred, steps)
}

func mib(mb float64) int64 { return max(int64(mb*(1<<20)), 1) }

// predictTable prints the prediction for each cap, with the measurements if any.
func predictTable(w io.Writer, p *sim.Profile, c config, sm summary) error {
	meas, measAuto := sm.caps, sm.auto
	fmt.Fprintf(w, "profile: %d gradients, %.2f MB; backward compute %.2f ms, rest of the step %.2f ms; slowdown under overlap: compute %.2f, all-reduce %.2f; skew %.2f ms; CPU per collective %.2f ms\n",
		len(p.Params), float64(p.TotalBytes())/(1<<20), p.Backward*1e3, p.Other*1e3, p.Slowdown, p.CommSlowdown, p.Skew*1e3, p.CollectiveCPU*1e3)
	curve := ""
	switch {
	case p.Comm.Lower && len(p.Comm.Points) > 0:
		curve = fmt.Sprintf("; the curve: the lowest under %d points (Note [Lower curve] in package bucket/sim)", len(p.Comm.Points))
	case len(p.Comm.Points) > 0:
		curve = fmt.Sprintf("; the curve: through %d points", len(p.Comm.Points))
	}
	fmt.Fprintf(w, "all-reduce: %.1f µs + %.3f ns/byte (%.2f ms for all the gradients at once)%s\n\n",
		p.Comm.Alpha*1e6, p.Comm.Beta*1e9, p.Comm.Seconds(p.TotalBytes())*1e3, curve)
	head, rule := "| bucket_cap_mb | buckets | predicted ms/step | exposed ms |", "|---:|---:|---:|---:|"
	if meas != nil {
		head, rule = head+" measured ms/step | error |", rule+"---:|---:|"
	}
	fmt.Fprintf(w, "%s\n%s\n", head, rule)
	bestPred, bestMeas := -1, -1
	var preds []float64
	worst := 0.0
	for k, capMB := range c.caps {
		r, err := p.SimulateCaps(mib(c.firstMB), mib(capMB))
		if err != nil {
			return err
		}
		preds = append(preds, r.Step)
		if bestPred < 0 || r.Step < preds[bestPred] {
			bestPred = k
		}
		fmt.Fprintf(w, "| %g | %d | %.1f | %.1f |", capMB, r.Buckets, r.Step*1e3, r.Exposed*1e3)
		if meas != nil {
			if m, ok := meas[capMB]; ok {
				e := (r.Step*1e3 - m) / m
				worst = math.Max(worst, math.Abs(e))
				fmt.Fprintf(w, " %.1f | %+.1f%% |", m, 100*e)
				if bestMeas < 0 || m < meas[c.caps[bestMeas]] {
					bestMeas = k
				}
			} else {
				fmt.Fprintf(w, " | |")
			}
		}
		fmt.Fprintln(w)
	}
	o := sim.AutoOptions(mib(c.firstMB))
	o.MinGain = c.minGain
	plan, err := p.Best(o)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "\nbest predicted of these caps: %g MB", c.caps[bestPred])
	if bestMeas >= 0 {
		d := bestPred - bestMeas
		fmt.Fprintf(w, "; best measured: %g MB (%d step(s) apart); largest error %.1f%%", c.caps[bestMeas], max(d, -d), 100*worst)
		if m, ok := meas[c.caps[bestPred]]; ok {
			fmt.Fprintf(w, "; the best predicted cap measured %+.1f%% against the best measured", 100*(m/meas[c.caps[bestMeas]]-1))
		}
		if sm.pBest != nil {
			fmt.Fprintf(w, "; P(best) over resampled repeats: %.2f for the best measured", sm.pBest[c.caps[bestMeas]])
			if pb, ok := sm.pBest[c.caps[bestPred]]; ok {
				fmt.Fprintf(w, ", %.2f for the best predicted", pb)
			}
		}
	}
	if len(sm.layouts) > 0 {
		layoutLine(w, c.caps, c.caps[bestPred], sm.layouts)
	}
	fmt.Fprintf(w, "\nauto's choice for this profile: first cap %.3g MB, cap %.3g MB, %d buckets, predicted %.1f ms/step",
		float64(plan.FirstCapBytes)/(1<<20), float64(plan.CapBytes)/(1<<20), plan.Predicted.Buckets, plan.Predicted.Step*1e3)
	if measAuto > 0 {
		fmt.Fprintf(w, " (measured with --bucket_cap_mb auto: %.1f ms/step, error %+.1f%%)", measAuto, 100*(plan.Predicted.Step*1e3-measAuto)/measAuto)
	}
	if plan.Kept {
		fmt.Fprintf(w, "; the default caps, kept: the best layout found was predicted %.1f%% faster, under the %g%% margin (-min_gain)", 100*plan.Gain, 100*c.minGain)
	}
	fmt.Fprintln(w)
	return nil
}

// loadProfiles reads the profiles and combines them field by field (the median); the
// all-reduce curve keeps, per size, the median of the repeats.
func loadProfiles(paths []string) (*sim.Profile, error) {
	var ps []*sim.Profile
	for _, path := range paths {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		p := new(sim.Profile)
		if err := json.Unmarshal(b, p); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if err := p.Check(); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if len(ps) > 0 && (len(p.Params) != len(ps[0].Params) || p.TotalBytes() != ps[0].TotalBytes()) {
			return nil, fmt.Errorf("%s: another model than %s (%d gradients, %d bytes; there %d, %d)", path, paths[0], len(p.Params), p.TotalBytes(), len(ps[0].Params), ps[0].TotalBytes())
		}
		ps = append(ps, p)
	}
	if len(ps) == 1 {
		return ps[0], nil
	}
	med := func(get func(*sim.Profile) float64) float64 {
		xs := make([]float64, len(ps))
		for k, p := range ps {
			xs[k] = get(p)
		}
		return median(xs)
	}
	out := *ps[0]
	out.Ready = make([]float64, len(out.Params))
	for i := range out.Ready {
		out.Ready[i] = med(func(p *sim.Profile) float64 { return p.Ready[i] })
	}
	out.Backward = med(func(p *sim.Profile) float64 { return p.Backward })
	out.Other = med(func(p *sim.Profile) float64 { return p.Other })
	out.CopyPerByte = med(func(p *sim.Profile) float64 { return p.CopyPerByte })
	out.UnpackPerByte = med(func(p *sim.Profile) float64 { return p.UnpackPerByte })
	out.Launch = med(func(p *sim.Profile) float64 { return p.Launch })
	out.CollectiveCPU = med(func(p *sim.Profile) float64 { return p.CollectiveCPU })
	out.Slowdown = med(func(p *sim.Profile) float64 { return p.Slowdown })
	out.CommSlowdown = med(func(p *sim.Profile) float64 { return p.CommSlowdown })
	out.Skew = med(func(p *sim.Profile) float64 { return p.Skew })
	bySize := map[int64][]float64{}
	for _, p := range ps {
		for _, pt := range p.Comm.Points {
			bySize[pt.Bytes] = append(bySize[pt.Bytes], pt.Seconds)
		}
	}
	if len(bySize) == 0 { // lines without measured points
		out.Comm = sim.Comm{Alpha: med(func(p *sim.Profile) float64 { return p.Comm.Alpha }), Beta: med(func(p *sim.Profile) float64 { return p.Comm.Beta })}
		return &out, nil
	}
	var pts []sim.Point
	for b, xs := range bySize {
		pts = append(pts, sim.Point{Bytes: b, Seconds: median(xs)})
	}
	comm, err := sim.Fit(pts)
	if err != nil {
		return nil, err
	}
	// The probe's points, each the faster of two tries: its lower curve, if every profile's
	// is (Note [Lower curve] in package bucket/sim).
	comm.Lower = true
	for _, p := range ps {
		comm.Lower = comm.Lower && p.Comm.Lower
	}
	out.Comm = comm
	return &out, nil
}

// Note [The pacing rank]: a collective starts when the last rank launches it, so each pass
// of a job goes at the pace of whichever rank was slower in it. Two ranks that share this
// 2-core machine differ by up to 20% in backward (one core busier than the other, measured
// in the one-bucket launches of a sweep on 2026-12-04), and which of them is slower changes
// from launch to launch. A single rank's timeline accounts for the other only through the
// skew, its wait for the other: 1 ms in one launch and 12 ms in the next, whose median
// describes neither, and which does not move with the layout as the slower rank's compute
// does. With -trace_rank -1 every pass is read from the rank whose collectives took least
// from launch to end: the last to launch them, which waited for no one.

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
		p.Ready[i] = median(ready[i])
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(p.Ready[a], p.Ready[b]) })
	var copies float64
	for _, i := range order {
		p.Ready[i] = math.Max(p.Ready[i]-copies, 0)
		copies += p.CopyPerByte * float64(p.Params[i].Bytes())
	}
	p.Backward = math.Max(median(lens)-copies, 0)
	if len(rest) == len(paths) {
		p.Other = math.Max(median(rest), 0)
	}
	if len(skews) == len(paths) {
		p.Skew = math.Max(median(skews), 0)
	}
	return p.Check()
}

// Note [Overlap from traces]: the auto sizing measures the slowdowns under overlap in one
// pass with eight buckets (Note [Auto buckets] in package reducer), and on this 2-core
// machine one pass is at the mercy of the other rank and of the machine: the two ranks'
// backward differs by up to 10 ms from step to step, and the profiles of one sweep (the
// two-host testbed at 10 Gbit/s, round s37, 2026-12-05) measured the compute slowdown
// anywhere from 0.22 to 1.00 and the all-reduce's from 0 to 3.4. Their median made the
// overlap look cheap (0.46 and 0.25), and the model ranked the layout with the most
// buckets best where it measured 4% slower than two buckets. A traced launch whose
// collectives run during backward gives the same figures as means over its steady passes,
// each from its pacing rank, and a sweep's launches their median: with B its backward,
// T the time with a collective in flight inside it and W the collectives' work done there
// (their time alone), against the one-bucket launches' backward B1 (both less the reducer's
// copies, launches and the collectives' own CPU, Note [A collective's CPU] in package
// bucket/sim), compute did T − (B − B1) of its work in T, and the collectives W:
// s = (B − B1) / (T − (B − B1)) and c = T/W − 1, each at most 9. They are not bounded as one
// resource shared (Note [Shared speed] in package bucket/sim): these are steady means, not
// one pass's, and where the two ranks' collectives cost the cores more than they take (a
// kernel's network stack on the same two cores as both ranks' compute), s·c > 1 is what
// happens.

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
	o := overlapStats{inflight: median(in), work: median(work), buckets: median(nb)}
	o.backward = math.Max(median(bw)-p.CopyPerByte*float64(p.TotalBytes())-(p.Launch+p.CollectiveCPU)*o.buckets, 0)
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

// readPerf reads allreduce-perf --json's rows (size_bytes, time_us) into a curve.
func readPerf(path string) (sim.Comm, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return sim.Comm{}, err
	}
	var pts []sim.Point
	for n, line := range strings.Split(string(b), "\n") {
		if strings.TrimSpace(line) == "" {
			continue
		}
		var r struct {
			SizeBytes int64   `json:"size_bytes"`
			TimeUS    float64 `json:"time_us"`
		}
		if err := json.Unmarshal([]byte(line), &r); err != nil || r.SizeBytes <= 0 || !(r.TimeUS > 0) {
			return sim.Comm{}, fmt.Errorf("%s:%d: not an allreduce-perf --json row: %q", path, n+1, line)
		}
		pts = append(pts, sim.Point{Bytes: r.SizeBytes, Seconds: r.TimeUS / 1e6})
	}
	c, err := sim.Fit(pts)
	if err != nil {
		return sim.Comm{}, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

func mean(xs []float64) float64 {
	var s float64
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// summary is goddp's part of sweep-report's summary.csv: the median ms/step per cap and
// with auto, the compute-only ms/step (0 where missing), and each cap's P(best) (Note
// [Resolved best] in cmd/sweep-report; nil in a summary without the column).
type summary struct {
	caps          map[float64]float64
	auto, compute float64
	pBest         map[float64]float64
	layouts       []measuredLayout // from -layouts
}

// measuredLayout is one row of a sweep's layouts.csv: the caps that ran one bucket layout,
// their pooled median and its P(best) (Note [Same layout] in cmd/sweep-report).
type measuredLayout struct {
	caps  []float64
	ms    float64
	pBest float64
}

// goddpRows reads the CSV at path, whose first row must be header (what names the kind of
// file in the error), and returns goddp's rows and their line numbers.
func goddpRows(path, header, what string) (rows [][]string, lines []int, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	recs, err := csv.NewReader(f).ReadAll()
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(recs) == 0 || strings.Join(recs[0], ",") != header {
		return nil, nil, fmt.Errorf("%s: not a %s (%s)", path, what, header)
	}
	for i, r := range recs[1:] {
		if r[0] == "goddp" {
			rows, lines = append(rows, r), append(lines, i+2)
		}
	}
	return rows, lines, nil
}

// readLayouts reads goddp's rows of a layouts.csv.
func readLayouts(path string) ([]measuredLayout, error) {
	rows, _, err := goddpRows(path, "system,caps,buckets,median_ms_step,relative_to_best,p_best", "sweep-report layouts.csv")
	if err != nil {
		return nil, err
	}
	var ls []measuredLayout
	for _, r := range rows {
		var l measuredLayout
		for _, f := range strings.Fields(r[1]) {
			c, err := strconv.ParseFloat(f, 64)
			if err != nil {
				return nil, fmt.Errorf("%s: caps %q: %w", path, r[1], err)
			}
			l.caps = append(l.caps, c)
		}
		if l.ms, err = strconv.ParseFloat(r[3], 64); err != nil {
			return nil, fmt.Errorf("%s: ms/step %q: %w", path, r[3], err)
		}
		if l.pBest, err = strconv.ParseFloat(r[5], 64); err != nil {
			return nil, fmt.Errorf("%s: p_best %q: %w", path, r[5], err)
		}
		if len(l.caps) == 0 {
			return nil, fmt.Errorf("%s: a row with no caps", path)
		}
		ls = append(ls, l)
	}
	if len(ls) == 0 {
		return nil, fmt.Errorf("%s: no goddp rows", path)
	}
	return ls, nil
}

// readSummary reads goddp's rows of a summary.csv.
func readSummary(path string) (summary, error) {
	f, err := os.Open(path)
	if err != nil {
		return summary{}, err
	}
	defer f.Close()
	recs, err := csv.NewReader(f).ReadAll()
	if err != nil {
		return summary{}, fmt.Errorf("%s: %w", path, err)
	}
	if len(recs) == 0 || len(recs[0]) < 8 || recs[0][0] != "system" || recs[0][1] != "bucket_cap_mb" || recs[0][2] != "median_ms_step" || recs[0][7] != "compute_ms_step" {
		return summary{}, fmt.Errorf("%s: not a sweep-report summary.csv (system,bucket_cap_mb,median_ms_step,...,compute_ms_step,...)", path)
	}
	pcol := slices.Index(recs[0], "p_best")
	s := summary{caps: map[float64]float64{}}
	if pcol >= 0 {
		s.pBest = map[float64]float64{}
	}
	for _, r := range recs[1:] {
		if r[0] != "goddp" {
			continue
		}
		ms, err := strconv.ParseFloat(r[2], 64)
		if err != nil {
			return summary{}, fmt.Errorf("%s: ms/step %q: %w", path, r[2], err)
		}
		if v, err := strconv.ParseFloat(r[7], 64); err == nil && v > 0 {
			s.compute = v
		}
		if r[1] == "auto" {
			s.auto = ms
			continue
		}
		c, err := strconv.ParseFloat(r[1], 64)
		if err != nil {
			return summary{}, fmt.Errorf("%s: bucket_cap_mb %q: %w", path, r[1], err)
		}
		s.caps[c] = ms
		if pcol >= 0 {
			if s.pBest[c], err = strconv.ParseFloat(r[pcol], 64); err != nil {
				return summary{}, fmt.Errorf("%s: p_best %q: %w", path, r[pcol], err)
			}
		}
	}
	if len(s.caps) == 0 {
		return summary{}, fmt.Errorf("%s: no goddp rows", path)
	}
	return s, nil
}

// bucketParams is a helper for the seed's models: float32 parameters of the given lengths.
func bucketParams(names []string, lens []int) []bucket.Param {
	ps := make([]bucket.Param, len(lens))
	for i := range lens {
		ps[i] = bucket.Param{Name: names[i], DType: dtype.Float32, Len: lens[i]}
	}
	return ps
}
