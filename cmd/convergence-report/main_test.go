package main

import (
	"bytes"
	"encoding/csv"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestStepsToAgainstDirectMean checks stepsTo and smoothed on random curves against the
// trailing mean taken directly, window by window.
func TestStepsToAgainstDirectMean(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := range 200 {
		n, w := 1+rng.IntN(80), 1+rng.IntN(12)
		loss := make([]float64, n)
		for i := range loss {
			loss[i] = 2*math.Exp(-float64(i)/20) + 0.3*rng.Float64()
		}
		target := 0.2 + 2*rng.Float64()
		want := -1
		for s := range n {
			lo := max(0, s-w+1)
			var sum float64
			for _, l := range loss[lo : s+1] {
				sum += l
			}
			if m := sum / float64(s+1-lo); math.Abs(m-smoothed(loss, w)[s]) > 1e-12 {
				t.Fatalf("trial %d: smoothed[%d] %v, direct mean %v", trial, s, smoothed(loss, w)[s], m)
			} else if m <= target && want < 0 {
				want = s
			}
		}
		if got := stepsTo(loss, w, target); got != want {
			t.Fatalf("trial %d (n %d, w %d, target %v): stepsTo %d, want %d", trial, n, w, target, got, want)
		}
	}
}

func TestMedianSteps(t *testing.T) {
	for _, c := range []struct {
		steps []int
		want  float64
	}{{[]int{30, 10, 20}, 20}, {[]int{30, -1, 20}, 30}, {[]int{-1, -1, 20}, -1}, {[]int{10, 20}, 15}, {[]int{10, -1}, -1}, {[]int{7}, 7}} {
		if got := medianSteps(c.steps); got != c.want {
			t.Errorf("medianSteps(%v) = %v, want %v", c.steps, got, c.want)
		}
	}
}

func TestParseLosses(t *testing.T) {
	in := "[rank0]: Model: 1.62 MB\n[rank0]: step 0 loss 3.5  2.7 ms/step  ETA 1s\n[rank1]: step 7 loss 9\nstep 1 loss 2.5\n[rank0]: params_crc32=00\n"
	got, err := parseLosses(strings.NewReader(in), "x.log")
	if err != nil || !slices.Equal(got, []float64{3.5, 2.5}) {
		t.Errorf("parseLosses: %v, %v; want [3.5 2.5]", got, err)
	}
	for in, want := range map[string]string{
		"step 0 loss 1\nstep 2 loss 1\n": "x.log:2: step 2 after 1 steps: want the loss of every step, in order (--log_every 1)",
		"step 0 loss one\n":              `x.log:1: "step 0 loss one": want "step N loss L"`,
		"nothing\n":                      `x.log: no "step N loss L" line`,
	} {
		if _, err := parseLosses(strings.NewReader(in), "x.log"); err == nil || err.Error() != want {
			t.Errorf("%q: %v, want %q", in, err, want)
		}
	}
	for _, name := range []string{"goddp.copy.none.log", "goddp.copy.none.sx.log", "a..b.s1.log", "goddp.copy.none.s1.txt"} {
		if _, err := parseName(name); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("parseName(%q): %v, want an error naming it", name, err)
		}
	}
}

// TestReport writes the logs of two systems, two tasks, two hooks and three seeds, each a
// curve that falls below the target at a step drawn at random, and checks runs.csv,
// summary.csv (medians and ratios computed here from the drawn steps) and the plots.
func TestReport(t *testing.T) {
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(3, 4))
	const n, target = 60, 0.5
	cross := map[string][]int{} // system.task.hook: the drawn step of each seed, -1 none
	for _, sys := range []string{"goddp", "torch"} {
		for _, task := range []string{"copy", "teacher"} {
			for _, hook := range []string{"powersgd-r2", "none"} {
				for seed := 1; seed <= 3; seed++ {
					at := 5 + rng.IntN(50)
					if hook != "none" && seed == 2 && task == "teacher" {
						at = -1 // this seed never gets there
					}
					key := sys + "." + task + "." + hook
					cross[key] = append(cross[key], at)
					var b strings.Builder
					for s := range n {
						l := 1.0 // w = 1: the loss itself crosses
						if at >= 0 && s >= at {
							l = 0.25
						}
						fmt.Fprintf(&b, "[rank0]: step %d loss %g\n", s, l)
					}
					if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("%s.s%d.log", key, seed)), []byte(b.String()), 0o644); err != nil {
						t.Fatal(err)
					}
				}
			}
		}
	}
	var stdout, stderr bytes.Buffer
	if code := run([]string{"-in", dir, "-target", fmt.Sprintf("copy=%g,teacher=%g", target, target), "-smooth", "1"}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	med := func(v []int) float64 { // the middle of three, -1 counted as the largest
		s := slices.Clone(v)
		slices.SortFunc(s, func(a, b int) int { return cmpInf(a) - cmpInf(b) })
		return float64(s[1])
	}
	rows := readCSV(t, filepath.Join(dir, "summary.csv"))
	if len(rows) != 1+8 {
		t.Fatalf("summary.csv: %d rows, want 9: %q", len(rows), rows)
	}
	for _, r := range rows[1:] {
		key := r[0] + "." + r[1] + "." + r[2]
		m, none := med(cross[key]), med(cross[r[0]+"."+r[1]+".none"])
		want := []string{r[0], r[1], r[2], "3", fmt.Sprint(3 - strings.Count(fmt.Sprint(cross[key]), "-1")), stepsCell(m), ratioCell(m / none)}
		if m < 0 {
			want[6] = ""
		}
		if !slices.Equal(r, want) {
			t.Errorf("summary.csv row %q, want %q (drawn %v, none %v)", r, want, cross[key], cross[r[0]+"."+r[1]+".none"])
		}
	}
	if rows[1][2] != "none" {
		t.Errorf("summary.csv: first hook %q, want none first", rows[1][2])
	}
	runs := readCSV(t, filepath.Join(dir, "runs.csv"))
	if len(runs) != 1+24 {
		t.Errorf("runs.csv: %d rows, want 25", len(runs))
	}
	for _, r := range runs[1:] {
		var seed int
		fmt.Sscan(r[3], &seed)
		if want := stepsCell(float64(cross[r[0]+"."+r[1]+"."+r[2]][seed-1])); r[6] != want || r[4] != fmt.Sprint(n) {
			t.Errorf("runs.csv row %q: want %d steps, steps to target %q", r, n, want)
		}
	}
	if !strings.Contains(stdout.String(), "| powersgd-r2 |") || !strings.Contains(stdout.String(), "not reached") {
		t.Errorf("the markdown table lacks a PowerSGD row or a seed not reached:\n%s", stdout.String())
	}
	for _, task := range []string{"copy", "teacher"} {
		png, err := os.ReadFile(filepath.Join(dir, "loss_"+task+".png"))
		if err != nil || !bytes.HasPrefix(png, []byte("\x89PNG")) {
			t.Errorf("loss_%s.png: %v, %d bytes, want a PNG", task, err, len(png))
		}
		svg, err := os.ReadFile(filepath.Join(dir, "loss_"+task+".svg"))
		if err != nil || !bytes.Contains(svg, []byte("<svg")) || !bytes.Contains(svg, []byte("powersgd-r2")) {
			t.Errorf("loss_%s.svg: %v, want an SVG with a powersgd-r2 legend", task, err)
		}
	}
}

func cmpInf(s int) int {
	if s < 0 {
		return math.MaxInt32
	}
	return s
}

func readCSV(t *testing.T, path string) [][]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	rows, err := csv.NewReader(f).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	return rows
}

func TestBadInput(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "goddp.copy.none.s1.log"), []byte("step 0 loss 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for args, want := range map[string]string{
		"-in " + dir:                               "-target: want TASK=LOSS",
		"-in " + dir + " -target copy=-1":          `-target "copy=-1": "copy=-1" is not TASK=LOSS with a positive loss`,
		"-in " + dir + " -target teacher=0.1":      `task "copy" (goddp.copy.none.s1.log) has no -target`,
		"-in " + t.TempDir() + " -target copy=1":   "no *.log file",
		"-target copy=1":                           "-in: want the folder of logs",
		"-in " + dir + " -target copy=1 -smooth 0": "-smooth 0: want 1 or more",
	} {
		var stdout, stderr bytes.Buffer
		if code := run(strings.Fields(args), &stdout, &stderr); code == 0 || !strings.Contains(stderr.String(), want) {
			t.Errorf("%s: exit %d, stderr %q; want an error containing %q", args, code, stderr.String(), want)
		}
	}
}
