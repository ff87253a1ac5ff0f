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
//	ddpsim -profile p.json -hooks -gbit 1                   # each comm hook, and auto's choice, at 1 Gbit/s
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
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/goddp/goddp/bucket/sim"
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
	profiles   []string
	caps       []float64
	firstMB    float64
	minGain    float64 // -min_gain
	measured   string
	layouts    string // -layouts: a sweep's layouts.csv
	world      int
	algo       string
	latency    time.Duration
	gbit       float64
	seed       bool
	perf       string        // -allreduce: allreduce-perf --json output
	traces     []string      // -trace: goddp traces whose grad-ready times replace the profile's
	overlap    []string      // -overlap_trace: goddp traces whose slowdowns under overlap replace the profile's
	rank       int           // -trace_rank
	from       int           // -trace_from
	collCPU    time.Duration // -collective_cpu; negative: the profiles'
	cpuCSV     string        // -collective_cpu_csv: a sweep's cpu.csv to fit it from
	hooks      bool          // -hooks
	hooksCapMB float64       // -hooks_cap_mb
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
	fs.IntVar(&c.world, "world", 0, "with -gbit: ranks of the all-reduce to model instead of the measured curve (0: the profile's world size)")
	fs.StringVar(&c.algo, "algo", "ring", "with -gbit: ring or tree")
	fs.DurationVar(&c.latency, "latency", 5*time.Microsecond, "with -gbit: latency of one hop")
	fs.Float64Var(&c.gbit, "gbit", 0, "link bandwidth in Gbit/s each way: replaces the measured all-reduce curve with -algo over -world ranks")
	fs.StringVar(&c.perf, "allreduce", "", "replace the profile's all-reduce curve with allreduce-perf --json output (one JSON object per size)")
	traces := fs.String("trace", "", "take the grad-ready times, backward compute, the rest of the step and the skew from these goddp traces (--trace; comma-separated) instead: the mean over the passes of each trace, then the median over the traces; trace a run with one bucket (--bucket_cap_mb and --first_bucket_cap_mb above the model's size), so that no collective runs during backward")
	overlap := fs.String("overlap_trace", "", "with -trace: take the slowdowns under overlap from these goddp traces of launches whose collectives run during backward (a small cap for every bucket; comma-separated), against -trace's one-bucket compute (Note [Overlap from traces])")
	fs.IntVar(&c.rank, "trace_rank", -1, "with -trace: the rank whose passes to read; -1: each pass from whichever rank in the trace launched its collectives last (with every rank's: ddprun --trace_merge)")
	fs.IntVar(&c.from, "trace_from", 3, "with -trace: the first backward pass (counted from 1) to read; the first ones warm up")
	fs.DurationVar(&c.collCPU, "collective_cpu", -1, "each collective's own CPU time, charged as compute at its launch (Note [A collective's CPU] in package bucket/sim), instead of the profiles' (negative: theirs)")
	fs.StringVar(&c.cpuCSV, "collective_cpu_csv", "", "instead of -collective_cpu: fit it from a sweep's cpu.csv (rank 0's CPU per step against the buckets of each launch, Note [CPU per collective from a sweep])")
	fs.BoolVar(&c.hooks, "hooks", false, "also predict each communication hook (none, bf16, fp16, PowerSGD at each measured rank) and --comm_hook auto's choice, from the profile's compression costs (a profile from --comm_hook auto)")
	fs.Float64Var(&c.hooksCapMB, "hooks_cap_mb", 25, "with -hooks: the bucket cap in MB of the layout the hooks are predicted on (first bucket: -first_cap_mb)")
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
	if !(c.hooksCapMB > 0) || c.hooksCapMB > 1<<30 {
		return c, fmt.Errorf("-hooks_cap_mb %v: want a size in MB between 0 and 2^30", c.hooksCapMB)
	}
	if !(c.minGain >= 0 && c.minGain < 1) {
		return c, fmt.Errorf("-min_gain %v: want a fraction in [0, 1)", c.minGain)
	}
	if c.gbit < 0 || c.world < 0 || c.world == 1 {
		return c, fmt.Errorf("-gbit %v -world %d: want a bandwidth of 0 or more and a world of 2 or more (0: the profile's)", c.gbit, c.world)
	}
	if c.layouts != "" && c.measured == "" {
		return c, errors.New("-layouts needs -measured")
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
		world := c.world
		if world == 0 {
			world = p.World
		}
		if world < 2 {
			return fmt.Errorf("-gbit %v: the profile's world size is %d: give -world, of 2 or more", c.gbit, p.World)
		}
		p.Comm = algo(world, c.latency.Seconds(), c.gbit*1e9/8)
		p.World = world
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
	if err := predictTable(stdout, p, c, meas); err != nil {
		return err
	}
	if c.hooks {
		return hookTable(stdout, p, c)
	}
	return nil
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
