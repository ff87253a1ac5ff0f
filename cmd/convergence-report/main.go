// Command convergence-report turns the loss logs of a convergence study
// (scripts/convergence.sh for goddp, scripts/torch_convergence.py for PyTorch) into steps
// to a target loss: one row per run, the median over seeds with its ratio to the plain
// all-reduce (hook none) of the same system and task, as CSV and a markdown table, and
// the loss curves of each task plotted side by side per system.
//
// # Usage
//
//	convergence-report -in out/conv -target copy=0.01,teacher=0.03 -smooth 10 -out out/conv
//
// -in holds one log per run, named SYSTEM.TASK.HOOK.sSEED.log (e.g.
// goddp.copy.powersgd-r2.s1.log); its lines "step N loss L" (ddprun's "[rank0]: " prefix
// allowed; other ranks' lines are skipped) are the loss of every step, from step 0 on.
//
// A run's steps to the target is the first step s at which the mean of the losses of
// steps s−W+1 … s (W = -smooth; fewer at the start) is at most the task's target: the
// steps' own losses are those of one global batch, too noisy to cross a line once. A run
// that never gets there has none; the median over seeds counts it as infinite, so a
// median is missing where half the seeds or more miss the target.
//
// -out gets runs.csv (system,task,hook,seed,steps,final_loss,steps_to_target),
// summary.csv (system,task,hook,seeds,reached,median_steps,ratio_to_none), summary.md
// (a table per task, the systems side by side) and loss_TASK.svg and .png: the median over
// seeds of the smoothed loss of each hook, one panel per system, on a log scale.
package main

import (
	"bufio"
	"cmp"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("convergence-report", flag.ContinueOnError)
	fs.SetOutput(stderr)
	in := fs.String("in", "", "the folder of logs, SYSTEM.TASK.HOOK.sSEED.log")
	out := fs.String("out", "", "where the CSVs, the markdown table and the plots go (default: -in)")
	targets := fs.String("target", "", "the target loss of each task, TASK=LOSS,… (e.g. copy=0.01,teacher=0.03)")
	smooth := fs.Int("smooth", 10, "steps in the trailing mean that must reach the target")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	tg, err := parseTargets(*targets)
	if err == nil && *in == "" {
		err = errors.New("-in: want the folder of logs")
	}
	if err == nil && *smooth < 1 {
		err = fmt.Errorf("-smooth %d: want 1 or more", *smooth)
	}
	if err != nil {
		fmt.Fprintln(stderr, "convergence-report:", err)
		return 2
	}
	if *out == "" {
		*out = *in
	}
	runs, err := readRuns(*in)
	if err == nil {
		err = report(runs, tg, *smooth, *out, stdout)
	}
	if err != nil {
		fmt.Fprintln(stderr, "convergence-report:", err)
		return 1
	}
	return 0
}

// parseTargets reads TASK=LOSS,….
func parseTargets(s string) (map[string]float64, error) {
	if s == "" {
		return nil, errors.New("-target: want TASK=LOSS,… (e.g. copy=0.01,teacher=0.03)")
	}
	tg := map[string]float64{}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		l, err := strconv.ParseFloat(v, 64)
		if !ok || k == "" || err != nil || !(l > 0) || math.IsInf(l, 0) {
			return nil, fmt.Errorf("-target %q: %q is not TASK=LOSS with a positive loss", s, kv)
		}
		tg[k] = l
	}
	return tg, nil
}

// A runLog is one run's losses, step by step from 0.
type runLog struct {
	system, task, hook string
	seed               int
	loss               []float64
}

// parseName splits SYSTEM.TASK.HOOK.sSEED.log.
func parseName(name string) (runLog, error) {
	parts := strings.Split(strings.TrimSuffix(name, ".log"), ".")
	bad := fmt.Errorf("log %q: want the name SYSTEM.TASK.HOOK.sSEED.log (e.g. goddp.copy.powersgd-r2.s1.log)", name)
	if len(parts) != 4 || !strings.HasSuffix(name, ".log") || !strings.HasPrefix(parts[3], "s") || slices.Contains(parts[:3], "") {
		return runLog{}, bad
	}
	seed, err := strconv.Atoi(parts[3][1:])
	if err != nil {
		return runLog{}, bad
	}
	return runLog{system: parts[0], task: parts[1], hook: parts[2], seed: seed}, nil
}

// parseLosses reads the lines "step N loss L" of r (rank 0's, or unprefixed ones), which
// must be the steps 0, 1, 2, … in order.
func parseLosses(r io.Reader, name string) ([]float64, error) {
	var loss []float64
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if p, rest, ok := strings.Cut(line, "]: "); ok && strings.HasPrefix(p, "[rank") {
			if p != "[rank0" {
				continue
			}
			line = rest
		}
		f := strings.Fields(line)
		if len(f) < 4 || f[0] != "step" || f[2] != "loss" {
			continue
		}
		step, err1 := strconv.Atoi(f[1])
		l, err2 := strconv.ParseFloat(f[3], 64)
		switch {
		case err1 != nil || err2 != nil:
			return nil, fmt.Errorf("%s:%d: %q: want \"step N loss L\"", name, n, line)
		case step != len(loss):
			return nil, fmt.Errorf("%s:%d: step %d after %d steps: want the loss of every step, in order (--log_every 1)", name, n, step, len(loss))
		}
		loss = append(loss, l)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if len(loss) == 0 {
		return nil, fmt.Errorf("%s: no \"step N loss L\" line", name)
	}
	return loss, nil
}

// readRuns reads every *.log of dir.
func readRuns(dir string) ([]runLog, error) {
	names, err := filepath.Glob(filepath.Join(dir, "*.log"))
	if err != nil {
		return nil, err
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("-in %s: no *.log file", dir)
	}
	var runs []runLog
	for _, path := range names {
		r, err := parseName(filepath.Base(path))
		if err != nil {
			return nil, err
		}
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		r.loss, err = parseLosses(f, path)
		f.Close()
		if err != nil {
			return nil, err
		}
		runs = append(runs, r)
	}
	return runs, nil
}

// smoothed is the trailing mean of loss over w steps (fewer at the start).
func smoothed(loss []float64, w int) []float64 {
	out := make([]float64, len(loss))
	var sum float64
	for s, l := range loss {
		sum += l
		if s >= w {
			sum -= loss[s-w]
		}
		out[s] = sum / float64(min(s+1, w))
	}
	return out
}

// stepsTo is the first step whose trailing mean over w steps is at most target, or -1.
func stepsTo(loss []float64, w int, target float64) int {
	for s, l := range smoothed(loss, w) {
		if l <= target {
			return s
		}
	}
	return -1
}

// medianSteps is the median of steps (-1: not reached, counted as infinite), or -1 where
// that median is not reached.
func medianSteps(steps []int) float64 {
	v := make([]float64, len(steps))
	for i, s := range steps {
		v[i] = math.Inf(1)
		if s >= 0 {
			v[i] = float64(s)
		}
	}
	slices.Sort(v)
	n := len(v)
	m := v[n/2]
	if n%2 == 0 {
		m = (v[n/2-1] + v[n/2]) / 2
	}
	if math.IsInf(m, 0) {
		return -1
	}
	return m
}

// hookOrder sorts the hooks as the tables show them: none first, then the casts, then
// PowerSGD by rank, then any other.
func hookOrder(a, b string) int {
	rank := func(h string) int {
		if i := slices.Index([]string{"none", "bf16", "fp16"}, h); i >= 0 {
			return i
		}
		if strings.HasPrefix(h, "powersgd") {
			return 3
		}
		return 4
	}
	return cmp.Or(cmp.Compare(rank(a), rank(b)), cmp.Compare(a, b))
}

// A group is the runs of one system, task and hook, and their summary.
type group struct {
	system, task, hook string
	seeds              []int
	steps              []int // per seed: steps to the target, -1 if not reached
	median, ratio      float64
	curve              []float64 // the median over seeds of the smoothed loss
}

// summarize groups the runs and computes their steps to the target.
func summarize(runs []runLog, tg map[string]float64, w int) ([]*group, error) {
	byKey := map[[3]string]*group{}
	var groups []*group
	slices.SortFunc(runs, func(a, b runLog) int {
		return cmp.Or(cmp.Compare(a.task, b.task), cmp.Compare(a.system, b.system), hookOrder(a.hook, b.hook), cmp.Compare(a.seed, b.seed))
	})
	curves := map[*group][][]float64{}
	for _, r := range runs {
		target, ok := tg[r.task]
		if !ok {
			return nil, fmt.Errorf("task %q (%s.%s.%s.s%d.log) has no -target", r.task, r.system, r.task, r.hook, r.seed)
		}
		k := [3]string{r.system, r.task, r.hook}
		g := byKey[k]
		if g == nil {
			g = &group{system: r.system, task: r.task, hook: r.hook}
			byKey[k] = g
			groups = append(groups, g)
		}
		g.seeds = append(g.seeds, r.seed)
		g.steps = append(g.steps, stepsTo(r.loss, w, target))
		curves[g] = append(curves[g], smoothed(r.loss, w))
	}
	for _, g := range groups {
		g.median = medianSteps(g.steps)
		g.curve = medianCurve(curves[g])
	}
	for _, g := range groups {
		g.ratio = math.NaN()
		if none := byKey[[3]string{g.system, g.task, "none"}]; none != nil && none.median > 0 && g.median >= 0 {
			g.ratio = g.median / none.median
		}
	}
	return groups, nil
}

// medianCurve is, step by step, the median of the curves (as long as the shortest).
func medianCurve(cs [][]float64) []float64 {
	n := len(cs[0])
	for _, c := range cs {
		n = min(n, len(c))
	}
	out := make([]float64, n)
	v := make([]float64, len(cs))
	for s := range out {
		for i, c := range cs {
			v[i] = c[s]
		}
		slices.Sort(v)
		out[s] = v[len(v)/2]
		if len(v)%2 == 0 {
			out[s] = (v[len(v)/2-1] + v[len(v)/2]) / 2
		}
	}
	return out
}

// report writes the CSVs, the markdown and the plots into out and the markdown to stdout.
func report(runs []runLog, tg map[string]float64, w int, out string, stdout io.Writer) error {
	groups, err := summarize(runs, tg, w)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	var rc, sc strings.Builder
	rc.WriteString("system,task,hook,seed,steps,final_loss,steps_to_target\n")
	for _, r := range runs { // sorted by summarize
		s := stepsTo(r.loss, w, tg[r.task])
		fmt.Fprintf(&rc, "%s,%s,%s,%d,%d,%g,%s\n", r.system, r.task, r.hook, r.seed, len(r.loss), r.loss[len(r.loss)-1], stepsCell(float64(s)))
	}
	sc.WriteString("system,task,hook,seeds,reached,median_steps,ratio_to_none\n")
	for _, g := range groups {
		fmt.Fprintf(&sc, "%s,%s,%s,%d,%d,%s,%s\n", g.system, g.task, g.hook, len(g.steps), reached(g.steps), stepsCell(g.median), ratioCell(g.ratio))
	}
	md := markdown(groups, tg, w)
	for name, text := range map[string]string{"runs.csv": rc.String(), "summary.csv": sc.String(), "summary.md": md} {
		if err := os.WriteFile(filepath.Join(out, name), []byte(text), 0o644); err != nil {
			return err
		}
	}
	if err := plots(groups, tg, out); err != nil {
		return err
	}
	_, err = io.WriteString(stdout, md)
	return err
}

func reached(steps []int) int {
	n := 0
	for _, s := range steps {
		if s >= 0 {
			n++
		}
	}
	return n
}

// stepsCell is a step count, or empty where not reached.
func stepsCell(s float64) string {
	if s < 0 {
		return ""
	}
	return strconv.FormatFloat(s, 'f', -1, 64)
}

func ratioCell(r float64) string {
	if math.IsNaN(r) {
		return ""
	}
	return strconv.FormatFloat(r, 'f', 2, 64)
}

// markdown is a table per task: a row per hook, each system's median steps, its ratio
// to none and the steps of each seed.
func markdown(groups []*group, tg map[string]float64, w int) string {
	var b strings.Builder
	var tasks, systems, hooks []string
	at := map[[3]string]*group{}
	for _, g := range groups {
		at[[3]string{g.task, g.system, g.hook}] = g
		for _, p := range []struct {
			s    *[]string
			v    string
			sort func(a, b string) int
		}{{&tasks, g.task, strings.Compare}, {&systems, g.system, strings.Compare}, {&hooks, g.hook, hookOrder}} {
			if !slices.Contains(*p.s, p.v) {
				*p.s = append(*p.s, p.v)
				slices.SortFunc(*p.s, p.sort)
			}
		}
	}
	for _, task := range tasks {
		fmt.Fprintf(&b, "Task %s, target loss %g (mean of %d steps):\n\n| hook |", task, tg[task], w)
		for _, s := range systems {
			fmt.Fprintf(&b, " %s steps | %s × none | %s per seed |", s, s, s)
		}
		b.WriteString("\n| --- |" + strings.Repeat(" ---: | ---: | --- |", len(systems)) + "\n")
		for _, h := range hooks {
			row := "| " + h + " |"
			any := false
			for _, s := range systems {
				g := at[[3]string{task, s, h}]
				if g == nil {
					row += " – | – | – |"
					continue
				}
				any = true
				per := make([]string, len(g.steps))
				for i, st := range g.steps {
					per[i] = cmp.Or(stepsCell(float64(st)), "not reached")
				}
				row += fmt.Sprintf(" %s | %s | %s |", cmp.Or(stepsCell(g.median), "not reached"), cmp.Or(ratioCell(g.ratio), "–"), strings.Join(per, ", "))
			}
			if any {
				b.WriteString(row + "\n")
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}
