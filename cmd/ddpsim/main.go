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
//	ddpsim -seed                                            # the seed article's cluster
//
// A profile is what a run with --bucket_cap_mb auto --auto_profile F measured on rank 0: the
// gradients' sizes and ready times, the all-reduce cost curve, the reducer's overheads and
// the slowdowns under overlap. Several profiles (repeat launches) are combined field by
// field, by the median. -measured compares the prediction with a sweep's summary.csv
// (sweep-report), point by point. -world, -algo, -latency and -gbit replace the measured
// all-reduce curve with a ring or tree over that many ranks and that link, keeping the
// rest: what the same ranks would see elsewhere.
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
	world    int
	algo     string
	latency  time.Duration
	gbit     float64
	seed     bool
	compute  string // -compute_ms: "", a number, or "sweep"
	perf     string // -allreduce: allreduce-perf --json output
	trace    string // -trace: a goddp trace whose grad-ready times replace the profile's
	rank     int    // -trace_rank
	from     int    // -trace_from
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
	fs.IntVar(&c.world, "world", 0, "with -gbit: ranks of the all-reduce to model instead of the measured curve")
	fs.StringVar(&c.algo, "algo", "ring", "with -gbit: ring or tree")
	fs.DurationVar(&c.latency, "latency", 5*time.Microsecond, "with -gbit: latency of one hop")
	fs.Float64Var(&c.gbit, "gbit", 0, "link bandwidth in Gbit/s each way: replaces the measured all-reduce curve with -algo over -world ranks")
	fs.StringVar(&c.compute, "compute_ms", "", "rescale the profile's compute so that a step without communication takes this many ms; "+
		"sweep: the compute-only ms/step of -measured (two --no_ddp processes, steady state, where the profile's first steps may be slower)")
	fs.StringVar(&c.perf, "allreduce", "", "replace the profile's all-reduce curve with allreduce-perf --json output (one JSON object per size)")
	fs.StringVar(&c.trace, "trace", "", "take the grad-ready times, backward compute, the rest of the step and the skew from this goddp trace (--trace) instead: the medians over its passes; trace a run with one bucket (--bucket_cap_mb and --first_bucket_cap_mb above the model's size), so that no collective runs during backward")
	fs.IntVar(&c.rank, "trace_rank", 0, "with -trace: the rank whose passes to read")
	fs.IntVar(&c.from, "trace_from", 3, "with -trace: the first backward pass (counted from 1) to read; the first ones warm up")
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
	if c.compute == "sweep" && c.measured == "" {
		return c, errors.New("-compute_ms sweep needs -measured")
	}
	if v, err := strconv.ParseFloat(c.compute, 64); c.compute != "" && c.compute != "sweep" && (err != nil || !(v > 0)) {
		return c, fmt.Errorf("-compute_ms %q: want a positive number of ms or sweep", c.compute)
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
	if c.perf != "" {
		if p.Comm, err = readPerf(c.perf); err != nil {
			return err
		}
	}
	if c.trace != "" {
		if err := readyFromTrace(p, c.trace, c.rank, c.from); err != nil {
			return err
		}
	}
	if c.gbit > 0 {
		algo := sim.Ring
		if c.algo == "tree" {
			algo = sim.Tree
		}
		p.Comm = algo(c.world, c.latency.Seconds(), c.gbit*1e9/8)
		p.World = c.world
	}
	var meas map[float64]float64
	var measAuto, measCompute float64
	if c.measured != "" {
		if meas, measAuto, measCompute, err = readSummary(c.measured); err != nil {
			return err
		}
	}
	if c.compute != "" {
		ms := measCompute
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
	return predictTable(stdout, p, c, meas, measAuto)
}

func mib(mb float64) int64 { return max(int64(mb*(1<<20)), 1) }

// predictTable prints the prediction for each cap, with the measurements if any.
func predictTable(w io.Writer, p *sim.Profile, c config, meas map[float64]float64, measAuto float64) error {
	fmt.Fprintf(w, "profile: %d gradients, %.2f MB; backward compute %.2f ms, rest of the step %.2f ms; slowdown under overlap: compute %.2f, all-reduce %.2f; skew %.2f ms\n",
		len(p.Params), float64(p.TotalBytes())/(1<<20), p.Backward*1e3, p.Other*1e3, p.Slowdown, p.CommSlowdown, p.Skew*1e3)
	fmt.Fprintf(w, "all-reduce: %.1f µs + %.3f ns/byte (%.2f ms for all the gradients at once)\n\n",
		p.Comm.Alpha*1e6, p.Comm.Beta*1e9, p.Comm.Seconds(p.TotalBytes())*1e3)
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
	out.Comm = comm
	return &out, nil
}

// readyFromTrace replaces p's ready times and backward compute with the medians, over rank's
// passes from iteration from on, of each gradient's ready time ("grad" instants) and the
// backward pass's length ("backward" spans) in a goddp trace, less the reducer's copies
// before each (p.CopyPerByte). Where the trainer traced its steps ("step" spans), the rest
// of the step (p.Other) is replaced too: the median of each step's length less its pass,
// from the pass's start to the end of its Finalize wait. Where every pass ran one bucket,
// so did the skew (p.Skew): the median of how much longer its collective took than the
// all-reduce curve (p.Comm) gives for its bytes.
func readyFromTrace(p *sim.Profile, path string, rank, from int) error {
	tf, err := tracefile.ReadFile(path)
	if err != nil {
		return err
	}
	start := map[int64]float64{} // iteration → the backward pass's start, µs
	length := map[int64]float64{}
	end := map[int64]float64{} // iteration → the end of its Finalize wait, µs
	var steps [][2]float64     // rank's step spans, µs
	comms := map[int64][]tracefile.Event{}
	for _, e := range tf.TraceEvents {
		if e.PID != rank || e.Ph != "X" {
			continue
		}
		iter, ok := e.Arg("iter")
		switch {
		case e.Cat == observe.CatStep:
			steps = append(steps, [2]float64{e.TS, e.End()})
		case ok && e.Cat == observe.CatBackward && iter >= int64(from):
			start[iter], length[iter] = e.TS, e.Dur
			end[iter] = max(end[iter], e.End())
		case ok && e.Cat == observe.CatWait && iter >= int64(from):
			end[iter] = max(end[iter], e.End())
		case ok && e.Cat == observe.CatComm && iter >= int64(from):
			comms[iter] = append(comms[iter], e)
		}
	}
	if len(start) == 0 {
		return fmt.Errorf("%s: no backward passes of rank %d from iteration %d (a trace written with --trace?)", path, rank, from)
	}
	at := make([][]float64, len(p.Params))
	for _, e := range tf.TraceEvents {
		iter, ok1 := e.Arg("iter")
		i, ok2 := e.Arg("param")
		s, ok3 := start[iter]
		if !ok1 || !ok2 || !ok3 || e.PID != rank || e.Cat != observe.CatGrad {
			continue
		}
		if i < 0 || int(i) >= len(p.Params) {
			return fmt.Errorf("%s: gradient of parameter %d; the profile has %d", path, i, len(p.Params))
		}
		at[i] = append(at[i], (e.TS-s)/1e6)
	}
	order := make([]int, len(p.Params))
	for i := range at {
		if len(at[i]) == 0 {
			return fmt.Errorf("%s: rank %d never reported parameter %d (%s) ready", path, rank, i, p.Params[i].Name)
		}
		p.Ready[i] = median(at[i])
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(p.Ready[a], p.Ready[b]) })
	var copies float64
	for _, i := range order {
		p.Ready[i] = math.Max(p.Ready[i]-copies, 0)
		copies += p.CopyPerByte * float64(p.Params[i].Bytes())
	}
	lens := make([]float64, 0, len(length))
	for _, l := range length {
		lens = append(lens, l/1e6)
	}
	p.Backward = math.Max(median(lens)-copies, 0)
	var rest []float64
	for iter, s := range start {
		for _, st := range steps {
			if st[0] <= s && end[iter] <= st[1] {
				rest = append(rest, (st[1]-st[0]-(end[iter]-s))/1e6)
				break
			}
		}
	}
	if len(rest) > 0 {
		p.Other = math.Max(median(rest), 0)
	}
	// With one bucket a pass, its collective ran alone after backward: how much longer it
	// took than the all-reduce curve says is the wait for the later rank, the skew.
	var skews []float64
	for iter := range start {
		if c := comms[iter]; len(c) == 1 {
			if b, ok := c[0].Arg("bytes"); ok && b > 0 {
				skews = append(skews, c[0].Dur/1e6-p.Comm.Seconds(b))
			}
		}
	}
	if len(skews) > 0 && len(skews) == len(start) {
		p.Skew = math.Max(median(skews), 0)
	}
	return p.Check()
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

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// readSummary reads, from sweep-report's summary.csv, goddp's median ms/step per cap, with
// auto, and the compute-only ms/step (0 where missing).
func readSummary(path string) (caps map[float64]float64, auto, compute float64, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, 0, 0, err
	}
	defer f.Close()
	recs, err := csv.NewReader(f).ReadAll()
	if err != nil {
		return nil, 0, 0, fmt.Errorf("%s: %w", path, err)
	}
	if len(recs) == 0 || len(recs[0]) < 8 || recs[0][0] != "system" || recs[0][1] != "bucket_cap_mb" || recs[0][2] != "median_ms_step" || recs[0][7] != "compute_ms_step" {
		return nil, 0, 0, fmt.Errorf("%s: not a sweep-report summary.csv (system,bucket_cap_mb,median_ms_step,...,compute_ms_step,...)", path)
	}
	caps = map[float64]float64{}
	for _, r := range recs[1:] {
		if r[0] != "goddp" {
			continue
		}
		ms, err := strconv.ParseFloat(r[2], 64)
		if err != nil {
			return nil, 0, 0, fmt.Errorf("%s: ms/step %q: %w", path, r[2], err)
		}
		if v, err := strconv.ParseFloat(r[7], 64); err == nil && v > 0 {
			compute = v
		}
		if r[1] == "auto" {
			auto = ms
			continue
		}
		c, err := strconv.ParseFloat(r[1], 64)
		if err != nil {
			return nil, 0, 0, fmt.Errorf("%s: bucket_cap_mb %q: %w", path, r[1], err)
		}
		caps[c] = ms
	}
	if len(caps) == 0 {
		return nil, 0, 0, fmt.Errorf("%s: no goddp rows", path)
	}
	return caps, auto, compute, nil
}

// bucketParams is a helper for the seed's models: float32 parameters of the given lengths.
func bucketParams(names []string, lens []int) []bucket.Param {
	ps := make([]bucket.Param, len(lens))
	for i := range lens {
		ps[i] = bucket.Param{Name: names[i], DType: bucket.Float32, Len: lens[i]}
	}
	return ps
}
