// Command trace-plot draws one training step of a goddp trace (observe.Tracer's Chrome trace
// event files, one per rank or merged by ddprun) as a Gantt chart without a browser: a row
// pair per rank, compute on top (the trainer's spans and the finalize wait) and
// communication below (each bucket's all-reduce, with a tick at its launch), so the overlap
// of the all-reduces with backward, or its absence, shows at a glance.
//
// Usage:
//
//	trace-plot -in trace.json -iter 5 -out step5.png   # .png, .svg or .pdf
//	trace-plot -in trace.rank0.json,trace.rank1.json -merge merged.json -stragglers
//
// -iter is the trainer's step (default: the last step every rank finished). -stragglers
// prints which rank arrives last at the collectives, from the whole trace; -merge writes
// the inputs merged into one trace.
package main

import (
	"errors"
	"flag"
	"fmt"
	"image/color"
	"io"
	"os"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/goddp/goddp/ddp/observe"
	"github.com/goddp/goddp/ddp/tracefile"
	"github.com/goddp/goddp/internal/outpath"
)

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("trace-plot", flag.ContinueOnError)
	fs.SetOutput(stderr)
	in := fs.String("in", "", "trace file(s), comma separated (one merged file, or one per rank)")
	iter := fs.Int("iter", -1, "the training step to draw (default: the last step every rank finished)")
	out := fs.String("out", "", "the picture: FILE.png, FILE.svg or FILE.pdf")
	width := fs.Float64("width", 24, "picture width in cm")
	merge := fs.String("merge", "", "also write the inputs merged into one trace to this file")
	strag := fs.Bool("stragglers", false, "print the straggler report of the whole trace")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *in == "" || fs.NArg() > 0 || (*out == "" && *merge == "" && !*strag) {
		fmt.Fprintln(stderr, "trace-plot: want -in FILES and at least one of -out, -merge, -stragglers")
		return 2
	}
	for _, o := range []struct{ flag, path string }{{"-out", *out}, {"-merge", *merge}} {
		if err := outpath.File(o.flag, o.path); err != nil { // before the work, not after it
			fmt.Fprintf(stderr, "trace-plot: %v\n", err)
			return 1
		}
	}
	tf, err := load(strings.Split(*in, ","))
	if err != nil {
		fmt.Fprintf(stderr, "trace-plot: %v\n", err)
		return 1
	}
	if *merge != "" {
		if err := writeTrace(*merge, tf); err != nil {
			fmt.Fprintf(stderr, "trace-plot: %v\n", err)
			return 1
		}
	}
	if *strag {
		rep := observe.AnalyzeArrivals(observe.ArrivalsFromTrace(tf))
		rep.Hosts = tf.OtherData.Hosts
		fmt.Fprintln(stdout, rep)
	}
	if *out == "" {
		return 0
	}
	step := *iter
	if step < 0 {
		if step, err = lastCompleteStep(tf); err != nil {
			fmt.Fprintf(stderr, "trace-plot: %v\n", err)
			return 1
		}
	}
	g, err := gantt(tf, step)
	if err != nil {
		fmt.Fprintf(stderr, "trace-plot: %v\n", err)
		return 1
	}
	for _, l := range g.summary() {
		fmt.Fprintln(stdout, l)
	}
	if err := g.save(*out, vg.Length(*width)*vg.Centimeter); err != nil {
		fmt.Fprintf(stderr, "trace-plot: %v\n", err)
		return 1
	}
	return 0
}

func load(paths []string) (*tracefile.File, error) {
	var files []*tracefile.File
	for _, p := range paths {
		tf, err := tracefile.ReadFile(strings.TrimSpace(p))
		if err != nil {
			return nil, err
		}
		files = append(files, tf)
	}
	return tracefile.Merge(files...)
}

func writeTrace(path string, tf *tracefile.File) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := tracefile.Write(f, tf); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// ranksOf lists the ranks (pids) with events, ascending.
func ranksOf(tf *tracefile.File) []int {
	var rs []int
	for _, e := range tf.TraceEvents {
		if e.Ph != "M" && !slices.Contains(rs, e.PID) {
			rs = append(rs, e.PID)
		}
	}
	slices.Sort(rs)
	return rs
}

// lastCompleteStep is the highest step for which every rank has a finalize wait (the end of
// a synced pass), or failing that any event.
func lastCompleteStep(tf *tracefile.File) (int, error) {
	ranks := ranksOf(tf)
	best := map[int]int64{}
	for _, e := range tf.TraceEvents {
		if e.Cat != observe.CatWait {
			continue
		}
		if s, ok := e.Arg("step"); ok {
			if b, seen := best[e.PID]; !seen || s > b {
				best[e.PID] = s
			}
		}
	}
	if len(best) == 0 || len(best) < len(ranks) {
		return 0, errors.New("no step that every rank finished (no finalize wait events): give -iter")
	}
	step := int64(-1)
	for _, r := range ranks {
		if step < 0 || best[r] < step {
			step = best[r]
		}
	}
	return int(step), nil
}

// A kind of bar: its legend label and colour.
type kind struct {
	label string
	color color.Color
}

var (
	kForward   = kind{"forward", color.RGBA{0x4c, 0x72, 0xb0, 0xff}}
	kBackward  = kind{"backward", color.RGBA{0x55, 0xa8, 0x68, 0xff}}
	kFwdBwd    = kind{"forward+backward", color.RGBA{0x3b, 0x8f, 0x8a, 0xff}}
	kOptimizer = kind{"optimizer", color.RGBA{0x81, 0x72, 0xb2, 0xff}}
	kOther     = kind{"other compute", color.RGBA{0x93, 0x78, 0x60, 0xff}}
	kReducer   = kind{"backward (reducer)", color.RGBA{0x8c, 0xc0, 0x8f, 0xff}}
	kWait      = kind{"finalize wait", color.RGBA{0xb0, 0xb0, 0xb0, 0xff}}
	kComm      = kind{"bucket all-reduce", color.RGBA{0xdd, 0x55, 0x2b, 0xff}}
	kinds      = []kind{kForward, kBackward, kFwdBwd, kOptimizer, kOther, kReducer, kWait, kComm}
)

func computeKind(name string) kind {
	n := strings.ToLower(name)
	fwd, bwd := strings.Contains(n, "forward"), strings.Contains(n, "backward")
	switch {
	case fwd && bwd:
		return kFwdBwd
	case fwd:
		return kForward
	case bwd:
		return kBackward
	case strings.Contains(n, "optim"):
		return kOptimizer
	}
	return kOther
}

type bar struct {
	x0, x1, y float64 // ms; row
}

// chart is one step of a trace, ready to draw.
type chart struct {
	step   int
	ranks  []int
	bars   map[kind][]bar
	ticks  []bar // launch instants (x0 only)
	lines  []string
	maxEnd float64
}

// row returns the y of rank index i's compute (comm false) or communication row; rank 0 is
// at the top.
func row(n, i int, comm bool) float64 {
	y := float64(2 * (n - 1 - i))
	if !comm {
		y++
	}
	return y
}

// gantt collects the bars of step.
func gantt(tf *tracefile.File, step int) (*chart, error) {
	ranks := ranksOf(tf)
	var sel []tracefile.Event
	origin := 0.0
	for _, e := range tf.TraceEvents {
		if e.Ph == "M" || e.Cat == observe.CatStep || e.Cat == observe.CatGrad {
			continue
		}
		if s, ok := e.Arg("step"); ok && int(s) == step {
			if len(sel) == 0 || e.TS < origin {
				origin = e.TS
			}
			sel = append(sel, e)
		}
	}
	if len(sel) == 0 {
		return nil, fmt.Errorf("no events of step %d in the trace", step)
	}
	c := &chart{step: step, ranks: ranks, bars: map[kind][]bar{}}
	hasCompute := map[int]bool{}
	for _, e := range sel {
		if e.Cat == observe.CatCompute {
			hasCompute[e.PID] = true
		}
	}
	type acc struct{ compute, comm, commAfter, wait, end, bwdEnd float64 }
	per := map[int]*acc{}
	for _, r := range ranks {
		per[r] = &acc{}
	}
	for _, e := range sel {
		i := slices.Index(ranks, e.PID)
		n := len(ranks)
		x0, x1 := (e.TS-origin)/1e3, (e.End()-origin)/1e3
		a := per[e.PID]
		a.end = max(a.end, x1)
		switch e.Cat {
		case observe.CatCompute:
			k := computeKind(e.Name)
			c.bars[k] = append(c.bars[k], bar{x0, x1, row(n, i, false)})
			a.compute += x1 - x0
		case observe.CatBackward:
			a.bwdEnd = max(a.bwdEnd, x1)
			if !hasCompute[e.PID] {
				c.bars[kReducer] = append(c.bars[kReducer], bar{x0, x1, row(n, i, false)})
				a.compute += x1 - x0
			}
		case observe.CatWait:
			c.bars[kWait] = append(c.bars[kWait], bar{x0, x1, row(n, i, false)})
			a.wait += x1 - x0
		case observe.CatComm:
			c.bars[kComm] = append(c.bars[kComm], bar{x0, x1, row(n, i, true)})
			a.comm += x1 - x0
		case observe.CatLaunch:
			c.ticks = append(c.ticks, bar{x0, x0, row(n, i, true)})
		}
		c.maxEnd = max(c.maxEnd, x1)
	}
	// The all-reduce time after the end of backward: what the step waited for.
	for _, e := range sel {
		if e.Cat == observe.CatComm {
			a := per[e.PID]
			x0, x1 := (e.TS-origin)/1e3, (e.End()-origin)/1e3
			a.commAfter += max(0, x1-max(x0, a.bwdEnd))
		}
	}
	for _, r := range ranks {
		a := per[r]
		c.lines = append(c.lines, fmt.Sprintf("step %d rank %d: compute %.2f ms, all-reduce %.2f ms (%.2f ms after backward), finalize wait %.2f ms, span %.2f ms",
			step, r, a.compute, a.comm, a.commAfter, a.wait, a.end))
	}
	return c, nil
}

func (c *chart) summary() []string { return c.lines }

// barPlotter draws bars of one kind as rectangles.
type barPlotter struct {
	bars  []bar
	color color.Color
	h     float64 // bar height in rows
}

func (b *barPlotter) Plot(cv draw.Canvas, p *plot.Plot) {
	trX, trY := p.Transforms(&cv)
	for _, r := range b.bars {
		x0, x1 := trX(r.x0), trX(r.x1)
		if x1-x0 < 0.6 { // keep a very short collective visible
			x1 = x0 + 0.6
		}
		y0, y1 := trY(r.y-b.h/2), trY(r.y+b.h/2)
		cv.FillPolygon(b.color, []vg.Point{{X: x0, Y: y0}, {X: x1, Y: y0}, {X: x1, Y: y1}, {X: x0, Y: y1}})
	}
}

func (b *barPlotter) DataRange() (xmin, xmax, ymin, ymax float64) {
	xmin, ymin = 0, 0
	for _, r := range b.bars {
		xmax, ymax = max(xmax, r.x1), max(ymax, r.y)
	}
	return xmin, xmax, ymin - 0.5, ymax + 0.5
}

func (b *barPlotter) Thumbnail(cv *draw.Canvas) {
	r := cv.Rectangle
	cv.FillPolygon(b.color, []vg.Point{r.Min, {X: r.Max.X, Y: r.Min.Y}, r.Max, {X: r.Min.X, Y: r.Max.Y}})
}

// tickPlotter draws the launch instants as short vertical lines.
type tickPlotter struct{ ticks []bar }

func (t *tickPlotter) Plot(cv draw.Canvas, p *plot.Plot) {
	trX, trY := p.Transforms(&cv)
	sty := draw.LineStyle{Color: color.Black, Width: vg.Points(0.8)}
	for _, k := range t.ticks {
		cv.StrokeLine2(sty, trX(k.x0), trY(k.y-0.45), trX(k.x0), trY(k.y+0.45))
	}
}

func (t *tickPlotter) Thumbnail(cv *draw.Canvas) {
	r := cv.Rectangle
	mid := (r.Min.X + r.Max.X) / 2
	cv.StrokeLine2(draw.LineStyle{Color: color.Black, Width: vg.Points(0.8)}, mid, r.Min.Y, mid, r.Max.Y)
}

// save draws the chart to file (its extension picks the format).
func (c *chart) save(file string, width vg.Length) error {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("step %d: compute (upper row) and bucket all-reduces (lower row) per rank", c.step)
	p.X.Label.Text = "ms since the step's first event"
	p.X.Min, p.X.Max = 0, c.maxEnd*1.32 // the right band holds the legend, clear of the bars
	n := len(c.ranks)
	p.Y.Min, p.Y.Max = -0.6, float64(2*n)-0.4
	var ticks []plot.Tick
	for i, r := range c.ranks {
		ticks = append(ticks, plot.Tick{Value: row(n, i, false), Label: fmt.Sprintf("rank %d compute", r)},
			plot.Tick{Value: row(n, i, true), Label: fmt.Sprintf("rank %d comm", r)})
	}
	p.Y.Tick.Marker = plot.ConstantTicks(ticks)
	p.Legend.Top = true
	p.Legend.Left = false
	for _, k := range kinds {
		bs := c.bars[k]
		if len(bs) == 0 {
			continue
		}
		bp := &barPlotter{bars: bs, color: k.color, h: 0.8}
		p.Add(bp)
		p.Legend.Add(k.label, bp)
	}
	if len(c.ticks) > 0 {
		tp := &tickPlotter{ticks: c.ticks}
		p.Add(tp)
		p.Legend.Add("all-reduce launch", tp)
	}
	height := vg.Length(4+1.6*float64(n)) * vg.Centimeter
	if err := p.Save(width, height, file); err != nil {
		return fmt.Errorf("save %s: %w", file, err)
	}
	return nil
}
