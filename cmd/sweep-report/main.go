// Command sweep-report turns the raw results of a bucket_cap_mb sweep (scripts/sweep.sh) into
// the seed article's table (bucket_cap_mb | ms/step | relative to best), a summary CSV and a
// plot of ms/step against bucket size with the compute-only time drawn as a line.
//
// # Usage
//
//	sweep-report -in out/sweep/raw.csv -out out/sweep
//	sweep-report -trace merged.json -rate 1gbit -from_step 5   # link use of one traced run
//	sweep-report -rounds out/a/raw.csv,out/b/raw.csv,out/c/raw.csv  # sweeps of one configuration pooled
//
// The input CSV has the header system,kind,bucket_cap_mb,repeat,ms_step where kind is "ddp"
// (bucket_cap_mb set), "auto" (--bucket_cap_mb auto) or "compute" (compute-only: --no_ddp
// processes, bucket_cap_mb empty), and optionally a last column, layout: the bucket sizes in
// MB that the launch ran, space-separated (Note [Same layout]). Every system (goddp, torch)
// gets its own columns; medians are over repeats.
//
// With -trace, it reads instead a merged trace of a run with one rank per host (ddprun
// --trace_merge) and prints the link's use while the buckets were in flight: the bytes each
// rank must send each way, 2(n−1)/n of each bucket as in a bus-bandwidth figure, over the
// time the buckets were on the wire, counted from the last rank's start of each collective
// (tracefile.LinkUse), as a fraction of -rate.
//
// With -rounds, it reads several raw CSVs of one configuration, swept at different times,
// and prints one table of the layouts they ran, pooled (Note [Rounds pooled]): each launch
// over its round's median, and auto against the best layout with a resampled interval.
package main

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/goddp/goddp/ddp/tracefile"
	"github.com/goddp/goddp/internal/outpath"
	"github.com/goddp/goddp/internal/sweepcsv"
)

func main() {
	in := flag.String("in", "", "raw sweep CSV (system,kind,bucket_cap_mb,repeat,ms_step)")
	out := flag.String("out", "", "folder for table.md, summary.csv, sweep.svg and sweep.png (default: the input's folder)")
	trace := flag.String("trace", "", "instead: a merged trace (ddprun --trace_merge) whose link use to print")
	rate := flag.String("rate", "", "with -trace: the link's rate, tc style (1gbit, 10gbit, 100mbit)")
	fromStep := flag.Int("from_step", 0, "with -trace: the first step counted (skip the warm-up)")
	rounds := flag.String("rounds", "", "instead: raw sweep CSVs of one configuration swept at different times, comma-separated, to pool by layout (Note [Rounds pooled])")
	flag.Parse()
	if *rounds != "" {
		if *in != "" || *trace != "" || flag.NArg() > 0 {
			fmt.Fprintln(os.Stderr, "usage: sweep-report -rounds A/raw.csv,B/raw.csv[,...]")
			os.Exit(2)
		}
		if err := roundsPooled(strings.Split(*rounds, ","), os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "sweep-report:", err)
			os.Exit(1)
		}
		return
	}
	if *trace != "" {
		if *in != "" || flag.NArg() > 0 {
			fmt.Fprintln(os.Stderr, "usage: sweep-report -trace MERGED.json -rate RATE [-from_step N]")
			os.Exit(2)
		}
		if err := linkUse(*trace, *rate, *fromStep, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "sweep-report:", err)
			os.Exit(1)
		}
		return
	}
	if *in == "" || flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "usage: sweep-report -in RAW.csv [-out DIR]")
		os.Exit(2)
	}
	if *out == "" {
		*out = filepath.Dir(*in)
	}
	if err := outpath.Dir("-out", *out); err != nil {
		fmt.Fprintln(os.Stderr, "sweep-report:", err)
		os.Exit(1)
	}
	if err := run(*in, *out, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "sweep-report:", err)
		os.Exit(1)
	}
}

// series holds one system's results: ms/step samples per bucket cap, and compute-only samples.
type series struct {
	ddp     map[float64][]float64
	compute []float64
	auto    []float64 // --bucket_cap_mb auto
	// the same by repeat: ms/step per cap and repeat, and auto's per repeat
	ddpRep  map[float64]map[string]float64
	autoRep map[string]float64
	// the bucket layout each launch ran (the raw CSV's layout column, where it has one), per
	// cap and repeat, and auto's per repeat (Note [Same layout])
	layoutRep map[float64]map[string]string
	autoLay   map[string]string
}

func read(path string) (map[string]*series, error) {
	t, err := sweepcsv.Read(path, "sweep.sh raw.csv", sweepcsv.Raw, sweepcsv.RawLayout)
	if err != nil {
		return nil, err
	}
	withLayout := t.Header == sweepcsv.RawLayout
	all := map[string]*series{}
	for i, rec := range t.Rows {
		line := t.Lines[i]
		ms, err := strconv.ParseFloat(rec[4], 64)
		if err != nil || ms <= 0 {
			return nil, fmt.Errorf("%s:%d: bad ms_step %q", path, line, rec[4])
		}
		s := all[rec[0]]
		if s == nil {
			s = &series{ddp: map[float64][]float64{}, ddpRep: map[float64]map[string]float64{}, autoRep: map[string]float64{},
				layoutRep: map[float64]map[string]string{}, autoLay: map[string]string{}}
			all[rec[0]] = s
		}
		lay := ""
		if withLayout {
			lay = strings.Join(strings.Fields(rec[5]), " ")
		}
		switch rec[1] {
		case "ddp":
			c, err := strconv.ParseFloat(rec[2], 64)
			if err != nil || c <= 0 {
				return nil, fmt.Errorf("%s:%d: bad bucket_cap_mb %q", path, line, rec[2])
			}
			s.ddp[c] = append(s.ddp[c], ms)
			if s.ddpRep[c] == nil {
				s.ddpRep[c] = map[string]float64{}
			}
			s.ddpRep[c][rec[3]] = ms
			if lay != "" {
				if s.layoutRep[c] == nil {
					s.layoutRep[c] = map[string]string{}
				}
				s.layoutRep[c][rec[3]] = lay
			}
		case "compute":
			s.compute = append(s.compute, ms)
		case "auto":
			s.auto = append(s.auto, ms)
			s.autoRep[rec[3]] = ms
			if lay != "" {
				s.autoLay[rec[3]] = lay
			}
		default:
			return nil, fmt.Errorf("%s:%d: kind %q, want ddp, auto or compute", path, line, rec[1])
		}
	}
	if len(all) == 0 {
		return nil, fmt.Errorf("%s: no results", path)
	}
	return all, nil
}

// paired is the median over the repeats that a and b share of a's ms/step over b's in the
// same repeat (NaN if none). The sweep runs every kind once per repeat, one after the other,
// so a drift of the machine between repeats moves both sides of each ratio alike.
func paired(a, b map[string]float64) float64 {
	var rs []float64
	for k, x := range a {
		if y, ok := b[k]; ok {
			rs = append(rs, x/y)
		}
	}
	return sweepcsv.Median(rs)
}

// Note [Resolved best]: where several caps measure within a few percent of each other, which
// of them has the least median is decided by a handful of slow or fast launches. To show how
// firmly a sweep resolves its best cap, pBest resamples the repeats with replacement (the
// same draw of repeats for every cap, so that a drift of the machine between repeats moves
// all caps alike, as in paired) and counts, for each cap, the fraction of draws in which
// its median over the drawn repeats is the least (ties shared). A cap with P(best) near 1
// is the best beyond the noise; several caps with P(best) well above 0 are not told apart.
// The draws come from a fixed seed, so a summary is the same on every run.

// pBest is Note [Resolved best]'s fraction of draws won by each of caps, with rep[c] the
// ms/step of cap c by repeat. Repeats missing for a cap are skipped in its medians.
func pBest(rep map[float64]map[string]float64, caps []float64, draws int) map[float64]float64 {
	ms := make([]map[string]float64, len(caps))
	for i, c := range caps {
		ms[i] = rep[c]
	}
	won := map[float64]float64{}
	resample(ms, draws, rand.New(rand.NewPCG(1, 2)), func(med func(map[string]float64) float64) {
		least, winners := math.Inf(1), []float64(nil)
		for _, c := range caps {
			switch m := med(rep[c]); { // NaN, for a cap none of whose repeats was drawn, is neither
			case m < least:
				least, winners = m, append(winners[:0], c)
			case m == least:
				winners = append(winners, c)
			}
		}
		for _, c := range winners {
			won[c] += 1 / float64(len(winners)*draws)
		}
	})
	return won
}

// resample draws the repeats, the union of the keys of ms, with replacement (as many as
// there are), draws times from rng (after sorting them, so that a seed gives the same draws
// on every run), and calls f with each draw's median: a map's median over the drawn repeats
// it has, NaN if it has none of them.
func resample(ms []map[string]float64, draws int, rng *rand.Rand, f func(med func(map[string]float64) float64)) {
	var keys []string
	seen := map[string]bool{}
	for _, m := range ms {
		for k := range m {
			if !seen[k] {
				seen[k] = true
				keys = append(keys, k)
			}
		}
	}
	if len(keys) == 0 {
		return
	}
	sort.Strings(keys)
	drawn := make([]string, len(keys))
	var xs []float64
	med := func(m map[string]float64) float64 {
		xs = xs[:0]
		for _, k := range drawn {
			if v, ok := m[k]; ok {
				xs = append(xs, v)
			}
		}
		return sweepcsv.Median(xs)
	}
	for range draws {
		for i := range drawn {
			drawn[i] = keys[rng.IntN(len(keys))]
		}
		f(med)
	}
}

// pBestDraws is the number of resamples behind P(best).
const pBestDraws = 4000

// Note [Same layout]: several caps can give the same buckets. At a model of 6.5 MB every cap
// from 10 MB up puts all the gradients after the first bucket in one bucket. Launches of those
// caps run one and the same job, so how far apart their medians lie is this sweep's noise,
// measured directly, and which of them measures best is decided by that noise alone. The
// least median of several runs of one job is also below what that job typically takes, so a
// best cap among them flatters the best. With the raw CSV's layout column (rank 0's bucket
// sizes, as the trainer's end-of-run summary prints them after "rebuilt"), the report groups
// the caps whose every launch ran one layout and pools each group: in each repeat, the median
// of the group's launches in that repeat, so that a layout counts once per repeat, as a single
// cap does. It then ranks the layouts as it ranks the caps, with P(best) over the same
// resampling (Note [Resolved best]), and pairs auto with the best layout.

// layoutGroup is one bucket layout of a sweep and the caps that ran it.
type layoutGroup struct {
	layout string             // the bucket sizes in MB; empty for a cap whose launches did not all report one layout
	caps   []float64          // ascending
	rep    map[string]float64 // by repeat: the median of the caps' ms/step in that repeat
}

// buckets is the number of buckets of g's layout (0 if unknown).
func (g layoutGroup) buckets() int { return len(strings.Fields(g.layout)) }

// capsText lists g's caps, separated by sep.
func (g layoutGroup) capsText(sep string) string {
	parts := make([]string, len(g.caps))
	for i, c := range g.caps {
		parts[i] = strconv.FormatFloat(c, 'g', -1, 64)
	}
	return strings.Join(parts, sep)
}

// capLayout is the layout that every launch of cap c ran, or "" if one of them reported none
// or two differ.
func capLayout(s *series, c float64) string {
	lay := ""
	for k := range s.ddpRep[c] {
		l := s.layoutRep[c][k]
		if l == "" || (lay != "" && l != lay) {
			return ""
		}
		lay = l
	}
	return lay
}

// layoutGroups groups caps by the layout their launches ran (Note [Same layout]), in the
// order of each group's least cap; a cap of unknown layout is a group of its own.
func layoutGroups(s *series, caps []float64) []layoutGroup {
	var gs []layoutGroup
	at := map[string]int{}
	for _, c := range caps {
		if len(s.ddpRep[c]) == 0 {
			continue
		}
		lay := capLayout(s, c)
		if i, ok := at[lay]; ok && lay != "" {
			gs[i].caps = append(gs[i].caps, c)
			continue
		}
		at[lay] = len(gs)
		gs = append(gs, layoutGroup{layout: lay, caps: []float64{c}})
	}
	for i := range gs {
		byRep := map[string][]float64{}
		for _, c := range gs[i].caps {
			for k, v := range s.ddpRep[c] {
				byRep[k] = append(byRep[k], v)
			}
		}
		gs[i].rep = map[string]float64{}
		for k, xs := range byRep {
			gs[i].rep[k] = sweepcsv.Median(xs)
		}
	}
	return gs
}

// repValues are the values of a by-repeat map.
func repValues(m map[string]float64) []float64 {
	xs := make([]float64, 0, len(m))
	for _, v := range m {
		xs = append(xs, v)
	}
	return xs
}

// writeLayouts appends Note [Same layout]'s lines to md, and system's layouts to csv (the
// rows of layouts.csv), if two caps or more ran one layout.
func writeLayouts(md, csv *strings.Builder, system string, s *series, caps []float64) {
	gs := layoutGroups(s, caps)
	shared := false
	for _, g := range gs {
		if len(g.caps) > 1 {
			shared = true
			meds := make([]float64, len(g.caps))
			for i, c := range g.caps {
				meds[i] = sweepcsv.Median(s.ddp[c])
			}
			lo, hi := minMax(meds)
			fmt.Fprintf(md, "\nsame layout (Note [Same layout] in cmd/sweep-report): caps %s ran the same %d buckets (%s MB); their medians lie %.1f..%.1f ms/step, %.1f%% apart, a difference between runs of one job\n",
				g.capsText(", "), g.buckets(), g.layout, lo, hi, 100*(hi/lo-1))
		}
	}
	if !shared {
		return
	}
	rep := map[float64]map[string]float64{}
	keys := make([]float64, len(gs))
	ms := make([]float64, len(gs)) // each layout's median over repeats
	bestAt := 0
	for i, g := range gs {
		keys[i] = g.caps[0]
		rep[keys[i]] = g.rep
		if ms[i] = sweepcsv.Median(repValues(g.rep)); ms[i] < ms[bestAt] {
			bestAt = i
		}
	}
	best := ms[bestAt]
	pb := pBest(rep, keys, pBestDraws)
	fmt.Fprintf(md, "\nby layout (the caps of one layout pooled: in each repeat, the median of their launches):\n\n")
	fmt.Fprintf(md, "| caps | buckets | ms/step | relative to best | P(best) |\n|---|---:|---:|---:|---:|\n")
	for i, g := range gs {
		nb := "" // unknown: "?" in the table, empty in the CSV
		if g.layout != "" {
			nb = strconv.Itoa(g.buckets())
		}
		fmt.Fprintf(md, "| %s | %s | %.1f | %.2fx | %.2f |\n", g.capsText(", "), cmp.Or(nb, "?"), ms[i], ms[i]/best, pb[keys[i]])
		fmt.Fprintf(csv, "%s,%s,%s,%.3f,%.4f,%.4f\n", system, g.capsText(" "), nb, ms[i], ms[i]/best, pb[keys[i]])
	}
	if len(s.auto) == 0 {
		return
	}
	g := gs[bestAt]
	fmt.Fprintf(md, "\nauto against the best layout (caps %s): %.2fx by the medians, paired %.3fx", g.capsText(", "), sweepcsv.Median(s.auto)/best, paired(s.autoRep, g.rep))
	// the layout of the caps that most auto launches ran, and those launches against them
	for _, o := range gs {
		if o.layout == "" {
			continue
		}
		same := map[string]float64{}
		for k, v := range s.autoRep {
			if s.autoLay[k] == o.layout {
				same[k] = v
			}
		}
		if 2*len(same) > len(s.autoRep) {
			fmt.Fprintf(md, "; %d of %d auto launches ran the layout of caps %s: paired %.3fx against them", len(same), len(s.autoRep), o.capsText(", "), paired(same, o.rep))
		}
	}
	md.WriteString("\n")
}

// timeAgainst says how much less (or more) time per step auto's ms/step a takes than the
// default's d, in percent of d: with the ratio d/a, which the column "relative to best"
// uses, both ways of saying it.
func timeAgainst(a, d float64) string {
	less := "less"
	if a > d {
		less = "more"
	}
	return fmt.Sprintf("%.1f%% %s time per step", 100*math.Abs(d-a)/d, less)
}

func minMax(xs []float64) (float64, float64) {
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, x := range xs {
		lo, hi = math.Min(lo, x), math.Max(hi, x)
	}
	return lo, hi
}

func run(in, out string, stdout io.Writer) error {
	all, err := read(in)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	systems := slices.Sorted(maps.Keys(all)) // goddp before torch
	capSet := map[float64]bool{}
	for _, s := range all {
		for c := range s.ddp {
			capSet[c] = true
		}
	}
	caps := slices.Sorted(maps.Keys(capSet))

	var md strings.Builder
	var sum, lays strings.Builder
	sum.WriteString(sweepcsv.Summary + "\n")
	for _, name := range systems {
		s := all[name]
		best := math.Inf(1)
		for _, c := range caps {
			if v := sweepcsv.Median(s.ddp[c]); v < best {
				best = v
			}
		}
		comp := sweepcsv.Median(s.compute)
		pb := pBest(s.ddpRep, caps, pBestDraws)
		fmt.Fprintf(&md, "\n%s (world size 2; median over repeats, min..max; P(best): the fraction of resamples of the repeats in which the cap measured best)\n\n", name)
		fmt.Fprintf(&md, "| bucket_cap_mb | ms/step | min..max | relative to best | exposed comm ms | exposed fraction | P(best) |\n")
		fmt.Fprintf(&md, "|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, c := range caps {
			xs := s.ddp[c]
			if len(xs) == 0 {
				continue
			}
			m := sweepcsv.Median(xs)
			lo, hi := minMax(xs)
			exp, frac := m-comp, (m-comp)/m
			fmt.Fprintf(&md, "| %g | %.1f | %.1f..%.1f | %.2fx | %.1f | %.1f%% | %.2f |\n", c, m, lo, hi, m/best, exp, 100*frac, pb[c])
			fmt.Fprintf(&sum, "%s,%g,%.3f,%.3f,%.3f,%d,%.4f,%.3f,%.3f,%.4f,%.4f\n", name, c, m, lo, hi, len(xs), m/best, comp, exp, frac, pb[c])
		}
		if len(s.auto) > 0 {
			m := sweepcsv.Median(s.auto)
			lo, hi := minMax(s.auto)
			def := sweepcsv.Median(s.ddp[25])
			fmt.Fprintf(&md, "| auto | %.1f | %.1f..%.1f | %.2fx | %.1f | %.1f%% | |\n", m, lo, hi, m/best, m-comp, 100*(m-comp)/m)
			fmt.Fprintf(&sum, "%s,auto,%.3f,%.3f,%.3f,%d,%.4f,%.3f,%.3f,%.4f,\n", name, m, lo, hi, len(s.auto), m/best, comp, m-comp, (m-comp)/m)
			if !math.IsNaN(def) {
				fmt.Fprintf(&md, "\nauto: %.2fx the best cap's ms/step; %s than the default 25 MB, which takes %.2fx auto's\n", m/best, timeAgainst(m, def), def/m)
			}
			fmt.Fprintf(&md, "\nauto paired by repeat (the median over repeats of auto's ms/step over the cap's in the same repeat):")
			rlo, rhi := math.Inf(1), math.Inf(-1)
			for _, c := range caps {
				if r := paired(s.autoRep, s.ddpRep[c]); !math.IsNaN(r) {
					if sweepcsv.Median(s.ddp[c]) == best {
						fmt.Fprintf(&md, " %.3fx the best cap (%g MB);", r, c)
					}
					rlo, rhi = math.Min(rlo, r), math.Max(rhi, r)
				}
			}
			if r := paired(s.autoRep, s.ddpRep[25]); !math.IsNaN(r) {
				fmt.Fprintf(&md, " %.3fx the default 25 MB;", r)
			}
			fmt.Fprintf(&md, " %.3f..%.3fx over all the caps\n", rlo, rhi)
		}
		writeLayouts(&md, &lays, name, s, caps)
		if len(s.compute) > 0 {
			lo, hi := minMax(s.compute)
			fmt.Fprintf(&md, "\ncompute only (--no_ddp, two processes at once): %.1f ms/step (%.1f..%.1f, %d repeats)\n", comp, lo, hi, len(s.compute))
		}
	}
	if len(systems) > 1 {
		fmt.Fprintf(&md, "\nratio %s / %s (ms/step, median):\n\n| bucket_cap_mb |", systems[0], systems[1])
		md.WriteString(" ratio |\n|---:|---:|\n")
		a, b := all[systems[0]], all[systems[1]]
		for _, c := range caps {
			if len(a.ddp[c]) > 0 && len(b.ddp[c]) > 0 {
				fmt.Fprintf(&md, "| %g | %.2f |\n", c, sweepcsv.Median(a.ddp[c])/sweepcsv.Median(b.ddp[c]))
			}
		}
		if len(a.compute) > 0 && len(b.compute) > 0 {
			fmt.Fprintf(&md, "| compute only | %.2f |\n", sweepcsv.Median(a.compute)/sweepcsv.Median(b.compute))
		}
	}
	if err := os.WriteFile(filepath.Join(out, "table.md"), []byte(md.String()), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(out, "summary.csv"), []byte(sum.String()), 0o644); err != nil {
		return err
	}
	if lays.Len() > 0 {
		if err := os.WriteFile(filepath.Join(out, "layouts.csv"), []byte(sweepcsv.Layouts+"\n"+lays.String()), 0o644); err != nil {
			return err
		}
	} else if err := os.Remove(filepath.Join(out, "layouts.csv")); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err // a layouts.csv of an earlier report, which this one's caps do not bear out
	}
	if err := drawPlot(all, systems, caps, out); err != nil {
		return err
	}
	fmt.Fprint(stdout, md.String())
	fmt.Fprintf(stdout, "\nwrote %s, %s, %s, %s\n", filepath.Join(out, "table.md"), filepath.Join(out, "summary.csv"),
		filepath.Join(out, "sweep.svg"), filepath.Join(out, "sweep.png"))
	return nil
}

func drawPlot(all map[string]*series, systems []string, caps []float64, out string) error {
	p := plot.New()
	p.Title.Text = "bucket_cap_mb sweep, world size 2"
	p.X.Label.Text = "bucket_cap_mb (log scale)"
	p.Y.Label.Text = "ms/step (median)"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = capTicks(caps)
	p.Legend.Top = false // the curves sit high above the zero baseline: keep the legend below them
	p.Legend.XOffs = -vg.Points(10)
	p.Legend.YOffs = vg.Points(10)
	for i, name := range systems {
		s := all[name]
		var pts plotter.XYs
		for _, c := range caps {
			if len(s.ddp[c]) > 0 {
				pts = append(pts, plotter.XY{X: c, Y: sweepcsv.Median(s.ddp[c])})
			}
		}
		if len(pts) > 0 {
			line, points, err := plotter.NewLinePoints(pts)
			if err != nil {
				return err
			}
			line.Color = plotutil.Color(i)
			points.Color = plotutil.Color(i)
			points.Shape = plotutil.Shape(i)
			p.Add(line, points)
			p.Legend.Add(name+" DDP", line, points)
		}
		if len(s.compute) > 0 && len(caps) > 0 {
			comp := sweepcsv.Median(s.compute)
			l, err := plotter.NewLine(plotter.XYs{{X: caps[0], Y: comp}, {X: caps[len(caps)-1], Y: comp}})
			if err != nil {
				return err
			}
			l.Color = plotutil.Color(i)
			l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
			p.Add(l)
			p.Legend.Add(name+" compute only (--no_ddp)", l)
		}
	}
	p.Y.Min = 0
	for _, ext := range []string{"svg", "png"} {
		if err := p.Save(7*vg.Inch, 4.5*vg.Inch, filepath.Join(out, "sweep."+ext)); err != nil {
			return err
		}
	}
	return nil
}

// capTicks labels exactly the swept caps on the log axis.
type capTicks []float64

func (c capTicks) Ticks(lo, hi float64) []plot.Tick {
	t := make([]plot.Tick, 0, len(c))
	for _, v := range c {
		if v >= lo && v <= hi {
			t = append(t, plot.Tick{Value: v, Label: strconv.FormatFloat(v, 'g', -1, 64)})
		}
	}
	return t
}

// parseRate reads a tc-style rate ("1gbit", "10gbit", "100mbit", "500kbit") in bits/s.
func parseRate(s string) (float64, error) {
	l := strings.ToLower(strings.TrimSpace(s))
	for _, u := range []struct {
		suffix string
		scale  float64
	}{{"gbit", 1e9}, {"mbit", 1e6}, {"kbit", 1e3}, {"bit", 1}} {
		if num, ok := strings.CutSuffix(l, u.suffix); ok {
			v, err := strconv.ParseFloat(num, 64)
			if err != nil || !(v > 0) {
				break
			}
			return v * u.scale, nil
		}
	}
	return 0, fmt.Errorf("-rate %q: want a positive rate such as 1gbit, 10gbit or 100mbit", s)
}

// linkUse prints the link use of the merged trace at path (see the package doc).
func linkUse(path, rate string, fromStep int, w io.Writer) error {
	bps, err := parseRate(rate)
	if err != nil {
		return err
	}
	tf, err := tracefile.ReadFile(path)
	if err != nil {
		return err
	}
	u, err := tracefile.LinkUse(tf, fromStep)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	n := float64(u.Ranks)
	wire := float64(u.Bytes) * 2 * (n - 1) / n // bytes each rank sends (and receives)
	busy := u.Busy.Seconds()
	if !(busy > 0) {
		return fmt.Errorf("%s: the collectives took no time", path)
	}
	fmt.Fprintf(w, "link_util=%.3f  %d collectives of %d ranks from step %d: %.2f MiB on the wire each way per rank in %.1f ms in flight = %.3f Gbit/s of %s\n",
		wire*8/busy/bps, u.Collectives, u.Ranks, fromStep, wire/(1<<20), busy*1e3, wire*8/busy/1e9, rate)
	return nil
}
