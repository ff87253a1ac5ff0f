package main

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// report writes data as a raw CSV in a fresh folder and runs the report into that folder,
// returning the folder and the table printed.
func report(t *testing.T, data string) (dir, table string) {
	t.Helper()
	dir = t.TempDir()
	raw := filepath.Join(dir, "raw.csv")
	if err := os.WriteFile(raw, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	if err := run(raw, dir, &out); err != nil {
		t.Fatal(err)
	}
	return dir, out.String()
}

func TestReport(t *testing.T) {
	data := "system,kind,bucket_cap_mb,repeat,ms_step\n" +
		"goddp,ddp,1,1,120\ngoddp,ddp,1,2,140\ngoddp,ddp,1,3,130\n" +
		"goddp,ddp,25,1,100\ngoddp,ddp,25,2,110\n" +
		"goddp,compute,,1,80\ngoddp,compute,,2,90\n" +
		"goddp,auto,,1,99\ngoddp,auto,,2,101\n" +
		"torch,ddp,1,1,150\ntorch,ddp,25,1,150\ntorch,compute,,1,100\n"
	dir, table := report(t, data)
	for _, want := range []string{
		"| 1 | 130.0 | 120.0..140.0 | 1.24x | 45.0 | 34.6% | 0.0", // median 130, best 105, compute 85
		"| 25 | 105.0 | 100.0..110.0 | 1.00x | 20.0 | 19.0% | 0.9",
		"| 1 | 150.0 | 150.0..150.0 | 1.00x | 50.0 | 33.3% | 0.50 |", // a tie in every draw
		"| 25 | 150.0 | 150.0..150.0 | 1.00x | 50.0 | 33.3% | 0.50 |",
		"| 25 | 0.70 |", // 105/150
		"| compute only | 0.85 |",
		"| auto | 100.0 | 99.0..101.0 | 0.95x | 15.0 | 15.0% |", // median 100 vs best cap 105
		// 5/105 of the default's time saved; it takes 105/100 of auto's
		"auto: 0.95x the best cap's ms/step; 4.8% less time per step than the default 25 MB, which takes 1.05x auto's",
		// by repeat: 99/100 and 101/110 against cap 25, 99/120 and 101/140 against cap 1
		"(the median over repeats of auto's ms/step over the cap's in the same repeat): 0.954x the best cap (25 MB); 0.954x the default 25 MB; 0.773..0.954x over all the caps",
	} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
	sum, err := os.ReadFile(filepath.Join(dir, "summary.csv"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(sum), "goddp,25,105.000,100.000,110.000,2,1.0000,85.000,20.000,0.1905,0.9") ||
		!strings.Contains(string(sum), "goddp,auto,100.000,99.000,101.000,2,0.9524,85.000,15.000,0.1500,\n") {
		t.Errorf("summary.csv:\n%s", sum)
	}
	for _, f := range []string{"sweep.svg", "sweep.png", "table.md"} {
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Size() == 0 {
			t.Errorf("%s missing or empty: %v", f, err)
		}
	}
}

// TestPBest checks Note [Resolved best] against fractions known in closed form.
// TestReportAutoSlower: where auto measured slower than the default, the report says "more
// time", not a negative "less".
func TestReportAutoSlower(t *testing.T) {
	data := "system,kind,bucket_cap_mb,repeat,ms_step\n" +
		"goddp,ddp,1,1,90\ngoddp,ddp,25,1,100\ngoddp,auto,,1,104\n"
	_, table := report(t, data)
	// 104/90 against the best; 4/100 more than the default, which takes 100/104 of it
	want := "auto: 1.16x the best cap's ms/step; 4.0% more time per step than the default 25 MB, which takes 0.96x auto's"
	if !strings.Contains(table, want) {
		t.Errorf("table lacks %q:\n%s", want, table)
	}
}

func TestPBest(t *testing.T) {
	reps := func(ms ...float64) map[string]float64 {
		m := map[string]float64{}
		for i, v := range ms {
			m[fmt.Sprint(i+1)] = v
		}
		return m
	}
	near := func(what string, got, want, tol float64) {
		t.Helper()
		if math.Abs(got-want) > tol {
			t.Errorf("%s: P(best) %.4f, want %.4f ± %g", what, got, want, tol)
		}
	}
	// The repeats drift by 2x, but cap 5 is 1% faster than cap 25 in each: resampled
	// together, cap 5 wins every draw (resampled apart, cap 25 would win about half).
	p := pBest(map[float64]map[string]float64{5: reps(100, 200, 150, 120, 180), 25: reps(101, 202, 151.5, 121.2, 181.8)}, []float64{5, 25}, 2000)
	near("drifting repeats, cap 5", p[5], 1, 1e-9)
	near("drifting repeats, cap 25", p[25], 0, 1e-9)
	// Equal in every repeat: a tie in every draw, shared.
	p = pBest(map[float64]map[string]float64{1: reps(60, 61), 10: reps(60, 61)}, []float64{1, 10}, 2000)
	near("tied, cap 1", p[1], 0.5, 1e-9)
	near("tied, cap 10", p[10], 0.5, 1e-9)
	// Cap 1 has a third repeat that cap 25 lacks, and is slower in the others: it wins only
	// the draws of that repeat alone, 1 in 27.
	p = pBest(map[float64]map[string]float64{1: reps(120, 140, 130), 25: reps(100, 110)}, []float64{1, 25}, 20000)
	near("missing repeat, cap 1", p[1], 1.0/27, 0.005)
	near("missing repeat, cap 25", p[25], 26.0/27, 0.005)
	// One repeat in seven is slow for cap 10; cap 50 is a little slower in the others. Cap 10
	// loses the draws in which the slow repeat is at least four of the seven (the median of
	// seven): P(Bin(7, 1/7) ≥ 4) = 0.01015.
	p = pBest(map[float64]map[string]float64{10: reps(60, 60, 200, 60, 60, 60, 60), 50: reps(61, 61, 61, 61, 61, 61, 61)}, []float64{10, 50}, 20000)
	near("one slow repeat, cap 10", p[10], 1-0.01015, 0.004)
}

// TestSameLayout checks Note [Same layout]: caps 10, 25 and 50 ran one layout (B), cap 1
// another (A), and cap 100 ran B in two repeats and A in one, so it stands alone.
func TestSameLayout(t *testing.T) {
	const a, b = "1.25 1.00 4.27", "1.25  5.27" // the extra space is not part of the layout
	data := "system,kind,bucket_cap_mb,repeat,ms_step,layout\n"
	for _, r := range []struct {
		kind, cap     string
		ms1, ms2, ms3 float64
		l1, l2, l3    string
	}{
		{"ddp", "1", 100, 104, 102, a, a, a},
		{"ddp", "10", 98, 110, 101, b, b, b},
		{"ddp", "25", 99, 103, 109, b, b, b},
		{"ddp", "50", 97, 105, 100, b, b, b},
		{"ddp", "100", 106, 108, 104, b, a, b},
		{"auto", "", 99, 104, 100, b, a, b},
	} {
		for k, ms := range []float64{r.ms1, r.ms2, r.ms3} {
			data += fmt.Sprintf("goddp,%s,%s,%d,%g,%s\n", r.kind, r.cap, k+1, ms, []string{r.l1, r.l2, r.l3}[k])
		}
	}
	data += "torch,ddp,10,1,120,\ntorch,ddp,25,1,121,\n"
	dir, table := report(t, data)
	for _, want := range []string{
		// the medians of caps 10, 25 and 50: 101, 103, 100
		"caps 10, 25, 50 ran the same 2 buckets (1.25 5.27 MB); their medians lie 100.0..103.0 ms/step, 3.0% apart",
		// B by repeat: the medians of 98 99 97, 110 103 105, 101 109 100: 98, 105, 101
		"| 10, 25, 50 | 2 | 101.0 | 1.00x |",
		"| 1 | 3 | 102.0 | 1.01x |",
		"| 100 | ? | 106.0 | 1.05x |",
		// auto's median 100; by repeat 99/98, 104/105, 100/101; in the repeats where it ran B,
		// 99/98 and 100/101
		"auto against the best layout (caps 10, 25, 50): 0.99x by the medians, paired 0.990x; 2 of 3 auto launches ran the layout of caps 10, 25, 50: paired 1.000x against them",
	} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
	if n := strings.Count(table, "same layout ("); n != 1 {
		t.Errorf("%d same-layout lines, want 1 (goddp's; torch's rows have no layout):\n%s", n, table)
	}
	// the layouts' P(best) add up to 1
	sum := 0.0
	for _, line := range strings.Split(table[strings.Index(table, "by layout"):], "\n") {
		if f := strings.Split(line, "|"); len(f) == 7 && strings.HasSuffix(strings.TrimSpace(f[4]), "x") {
			p, err := strconv.ParseFloat(strings.TrimSpace(f[5]), 64)
			if err != nil {
				t.Fatalf("P(best) in %q: %v", line, err)
			}
			sum += p
		}
	}
	if math.Abs(sum-1) > 0.02 {
		t.Errorf("the layouts' P(best) add up to %.3f:\n%s", sum, table)
	}
	lays, err := os.ReadFile(filepath.Join(dir, "layouts.csv"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"system,caps,buckets,median_ms_step,relative_to_best,p_best\n", "\ngoddp,10 25 50,2,101.000,1.0000,", "\ngoddp,100,,106.000,1.0495,"} {
		if !strings.Contains(string(lays), want) {
			t.Errorf("layouts.csv lacks %q:\n%s", want, lays)
		}
	}
}

func TestReportBadInput(t *testing.T) {
	dir := t.TempDir()
	for name, data := range map[string]string{
		"header": "a,b\n",
		"ms":     "system,kind,bucket_cap_mb,repeat,ms_step\ngoddp,ddp,1,1,x\n",
		"kind":   "system,kind,bucket_cap_mb,repeat,ms_step\ngoddp,other,1,1,3\n",
		"empty":  "system,kind,bucket_cap_mb,repeat,ms_step\n",
	} {
		raw := filepath.Join(dir, name+".csv")
		if err := os.WriteFile(raw, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := run(raw, dir, &strings.Builder{}); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

// TestLinkUse: two ranks, two steps of one 1 MiB bucket each, 10 ms on the wire each
// (rank 1 starts 2 ms after rank 0, which does not count): 2 MiB each way in 20 ms.
func TestLinkUse(t *testing.T) {
	path := filepath.Join(t.TempDir(), "merged.json")
	ev := func(rank, step int, ts, dur float64) string {
		return fmt.Sprintf(`{"name":"all-reduce 0","cat":"comm","ph":"X","ts":%g,"dur":%g,"pid":%d,"tid":1,"args":{"step":%d,"iter":%d,"bucket":0,"bytes":1048576}}`,
			ts, dur, rank, step, step+1)
	}
	trace := `{"otherData":{"goddp_epoch_unix_us":1,"goddp_ranks":[0,1]},"traceEvents":[` +
		strings.Join([]string{ev(0, 0, 0, 100), ev(1, 0, 0, 100), // step 0: skipped
			ev(0, 1, 1000, 12000), ev(1, 1, 3000, 10000), ev(0, 2, 20000, 12000), ev(1, 2, 22000, 10000)}, ",") + `]}`
	if err := os.WriteFile(path, []byte(trace), 0o644); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	if err := linkUse(path, "1gbit", 1, &out); err != nil {
		t.Fatal(err)
	}
	// 2 MiB = 16.777 Mbit in 20 ms = 0.839 Gbit/s
	want := "link_util=0.839  2 collectives of 2 ranks from step 1: 2.00 MiB on the wire each way per rank in 20.0 ms in flight = 0.839 Gbit/s of 1gbit"
	if got := strings.TrimSpace(out.String()); got != want {
		t.Errorf("got  %q\nwant %q", got, want)
	}
	for _, bad := range []string{"", "fast", "0gbit", "-1mbit"} {
		if err := linkUse(path, bad, 1, &out); err == nil || !strings.Contains(err.Error(), "-rate") {
			t.Errorf("rate %q: %v", bad, err)
		}
	}
	if err := linkUse(path, "1gbit", 3, &out); err == nil {
		t.Error("a step after the last: no error")
	}
	if v, err := parseRate("10Gbit"); err != nil || v != 1e10 {
		t.Errorf("parseRate(10Gbit) = %v, %v", v, err)
	}
}

// TestRoundsPooled: two rounds of one configuration, the second three times slower (the
// machine's drift), pool into the figures of either round alone (Note [Rounds pooled]).
func TestRoundsPooled(t *testing.T) {
	dir := t.TempDir()
	round := func(name string, k float64) string {
		var b strings.Builder
		b.WriteString("system,kind,bucket_cap_mb,repeat,ms_step,layout\n")
		for _, r := range []struct {
			kind, cap, rep string
			ms             float64
			layout         string
		}{
			{"ddp", "1", "1", 90, "1.00 1.00 1.00"}, {"ddp", "1", "2", 92, "1.00 1.00 1.00"},
			{"ddp", "25", "1", 100, "1.00 2.00"}, {"ddp", "25", "2", 104, "1.00 2.00"},
			{"ddp", "50", "1", 102, "1.00 2.00"}, {"ddp", "50", "2", 100, "1.00 2.00"},
			{"auto", "", "1", 91, "1.00 1.00 1.00"}, {"auto", "", "2", 95, "1.00 1.00 1.00"},
			{"compute", "", "1", 50, ""},
		} {
			fmt.Fprintf(&b, "goddp,%s,%s,%s,%g,%s\n", r.kind, r.cap, r.rep, k*r.ms, r.layout)
		}
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	a, b := round("a.csv", 1), round("b.csv", 3)
	var out strings.Builder
	if err := roundsPooled([]string{a, b}, &out); err != nil {
		t.Fatal(err)
	}
	// Each round's median is 97.5 (times k). Three buckets: per repeat the median of cap 1
	// and auto, 90.5 and 93.5, so 92/97.5; two buckets: 101 and 102, so 101.5/97.5.
	for _, want := range []string{
		"goddp, 2 rounds pooled",
		"| 2 | 1.00 2.00 | 25, 50 | 8 | 1.041 | 1.103x | 0.00 |",
		"| 3 | 1.00 1.00 1.00 | auto, 1 | 8 | 0.944 | 1.000x | 1.00 |",
		// auto's 91 and 95: 93 against 92
		"auto (4 launches): 1.011x the best layout's ms/step",
		"it ran 3 buckets (1.00 1.00 1.00) 4 times\n",
		// the default's 100 and 104: 102 against auto's 93
		"auto against the default 25 MB: 8.8% less time per step; the default takes 1.097x auto's",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, out.String())
		}
	}
	// The interval lies between the ratios of the fast repeats (91/90.5) and of the slow
	// ones (95/93.5), and holds the point figure.
	var lo, hi float64
	if _, err := fmt.Sscanf(out.String()[strings.Index(out.String(), "within ")+len("within "):], "%f..%fx", &lo, &hi); err != nil {
		t.Fatalf("no interval: %v\n%s", err, out.String())
	}
	if lo < 91/90.5-1e-3 || hi > 95/93.5+1e-3 || lo > 93.0/92 || hi < 93.0/92 {
		t.Errorf("interval %.4f..%.4f, want within %.4f..%.4f around %.4f", lo, hi, 91/90.5, 95/93.5, 93.0/92)
	}

	if err := roundsPooled([]string{a}, &out); err == nil || !strings.Contains(err.Error(), "want two or more") {
		t.Errorf("one round: err = %v", err)
	}
	bare := filepath.Join(dir, "bare.csv")
	if err := os.WriteFile(bare, []byte("system,kind,bucket_cap_mb,repeat,ms_step\ngoddp,ddp,25,1,100\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := roundsPooled([]string{a, bare}, &out); err == nil || !strings.Contains(err.Error(), "without a layout") {
		t.Errorf("a round without layouts: err = %v", err)
	}
}

// TestRatioInterval: where auto takes 1.02x the only layout's time in every repeat, every
// resample's ratio is 1.02, whatever the drift between repeats.
func TestRatioInterval(t *testing.T) {
	auto, lay := map[string]float64{}, map[string]float64{}
	for i, v := range []float64{0.9, 1.3, 1.0, 0.95, 1.1} {
		k := strconv.Itoa(i)
		lay[k], auto[k] = v, 1.02*v
	}
	lo, hi := ratioInterval(auto, map[float64]map[string]float64{0: lay}, []float64{0})
	if math.Abs(lo-1.02) > 1e-12 || math.Abs(hi-1.02) > 1e-12 {
		t.Errorf("interval %v..%v, want 1.02..1.02", lo, hi)
	}
}
