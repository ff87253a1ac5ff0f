package main

import (
	"fmt"
	"image/color"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// hookStyle gives each hook one colour in every panel, PowerSGD's by rank; a variant
// with another start (powersgd-rR-startK) is dashed in its rank's colour.
func hookStyle(h string) (color.Color, []vg.Length) {
	if base, _, ok := strings.Cut(h, "-start"); ok {
		return hookColor(base), []vg.Length{vg.Points(5), vg.Points(2)}
	}
	return hookColor(h), nil
}

func hookColor(h string) color.Color {
	switch h {
	case "none":
		return color.RGBA{A: 255}
	case "bf16":
		return color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 255}
	case "fp16":
		return color.RGBA{R: 0x17, G: 0xbe, B: 0xcf, A: 255}
	case "powersgd-r1":
		return color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 255}
	case "powersgd-r2":
		return color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 255}
	case "powersgd-r4":
		return color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 255}
	case "powersgd-r8":
		return color.RGBA{R: 0x8c, G: 0x56, B: 0x4b, A: 255}
	}
	return color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 255}
}

// plots draws, for each task, a panel per system side by side: the median over seeds of
// each hook's smoothed loss against the step, on a log scale, with the target dashed;
// into loss_TASK.svg and loss_TASK.png.
func plots(groups []*group, tg map[string]float64, out string) error {
	var tasks []string
	for _, g := range groups {
		if !slices.Contains(tasks, g.task) {
			tasks = append(tasks, g.task)
		}
	}
	for _, task := range tasks {
		var row []*plot.Plot
		var systems []string
		for _, g := range groups {
			if g.task == task && !slices.Contains(systems, g.system) {
				systems = append(systems, g.system)
			}
		}
		for _, s := range systems {
			p := plot.New()
			p.Title.Text = fmt.Sprintf("%s: %s (median of seeds)", s, task)
			p.X.Label.Text = "step"
			p.Y.Label.Text = "loss (trailing mean)"
			p.Y.Scale, p.Y.Tick.Marker = plot.LogScale{}, plot.LogTicks{Prec: -1}
			p.X.Tick.Marker = plainTicks{}
			steps := 0
			for _, g := range groups {
				if g.task != task || g.system != s {
					continue
				}
				pts := make(plotter.XYs, 0, len(g.curve))
				for i, l := range g.curve {
					if l > 0 && !math.IsInf(l, 0) && !math.IsNaN(l) {
						pts = append(pts, plotter.XY{X: float64(i), Y: l})
					}
				}
				if len(pts) == 0 {
					continue
				}
				steps = max(steps, len(g.curve))
				l, err := plotter.NewLine(pts)
				if err != nil {
					return err
				}
				l.Color, l.Dashes = hookStyle(g.hook)
				l.Width = vg.Points(1.2)
				p.Add(l)
				p.Legend.Add(g.hook, l)
			}
			t, err := plotter.NewLine(plotter.XYs{{X: 0, Y: tg[task]}, {X: float64(max(steps-1, 1)), Y: tg[task]}})
			if err != nil {
				return err
			}
			t.Color, t.Dashes = color.Gray{Y: 0x80}, []vg.Length{vg.Points(4), vg.Points(3)}
			p.Add(t)
			p.Legend.Add(fmt.Sprintf("target %g", tg[task]), t)
			p.Legend.Top = true
			row = append(row, p)
		}
		w, h := vg.Length(len(row))*5*vg.Inch, 3.8*vg.Inch
		tiles := draw.Tiles{Rows: 1, Cols: len(row), PadX: vg.Millimeter * 4, PadTop: vg.Millimeter * 2, PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 2}
		svg, png := vgsvg.New(w, h), vgimg.New(w, h)
		for _, c := range []vg.CanvasSizer{svg, png} {
			dc := draw.New(c)
			cs := plot.Align([][]*plot.Plot{row}, tiles, dc)
			for j, p := range row {
				p.Draw(cs[0][j])
			}
		}
		for ext, wt := range map[string]io.WriterTo{"svg": svg, "png": vgimg.PngCanvas{Canvas: png}} {
			if err := writeTo(filepath.Join(out, "loss_"+task+"."+ext), wt); err != nil {
				return err
			}
		}
	}
	return nil
}

func writeTo(path string, wt io.WriterTo) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := wt.WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// plainTicks are gonum's default ticks labelled as the shortest number ("250", not
// "250.00").
type plainTicks struct{}

func (plainTicks) Ticks(lo, hi float64) []plot.Tick {
	t := plot.DefaultTicks{}.Ticks(lo, hi)
	for i := range t {
		if t[i].Label != "" {
			t[i].Label = strconv.FormatFloat(t[i].Value, 'g', -1, 64)
		}
	}
	return t
}
