package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/bucket/sim"
	"github.com/goddp/goddp/ddp/tracefile"
	"github.com/goddp/goddp/procgroup/dtype"
)

// TestSeedModel checks the seed's models against counts worked out separately (from the
// layer's tensor shapes, by hand and in a Python script): parameters, sizes and PyTorch's
// buckets per cap.
func TestSeedModel(t *testing.T) {
	for _, tc := range []struct {
		layers, hidden int
		params         int64
		buckets        map[float64]int // cap MB → PyTorch's bucket count
	}{
		{6, 2048, 310_542_336, map[float64]int{1: 27, 5: 27, 10: 27, 25: 20, 50: 20, 100: 11, 200: 7}},
		{24, 4096, 4_866_678_784, map[float64]int{1: 99, 50: 99, 100: 74, 200: 74}},
	} {
		m := newSeedModel(tc.layers, tc.hidden)
		if got := m.bytes() / 4; got != tc.params {
			t.Errorf("%dL h%d: %d parameters, want %d", tc.layers, tc.hidden, got, tc.params)
		}
		p := m.profile(sim.Comm{}, 8)
		if err := p.Check(); err != nil {
			t.Fatal(err)
		}
		for c, want := range tc.buckets {
			bs := torchBuckets(p, 1<<20, mib(c))
			if len(bs) != want {
				t.Errorf("%dL h%d cap %g: %d buckets, want %d", tc.layers, tc.hidden, c, len(bs), want)
			}
			if _, err := bucket.NewLayout(p.Params, bs); err != nil {
				t.Errorf("cap %g: %v", c, err)
			}
		}
	}
	if h := stated(6, 88); h != 544 {
		t.Errorf("6 layers of 88 MB: hidden %d, want 544", h)
	}
	if h := stated(24, 1628); h != 1184 {
		t.Errorf("24 layers of 1628 MB: hidden %d, want 1184", h)
	}
	// Forward and backward of the small script model: 7.7 TFLOP (6·P·T plus attention).
	m := newSeedModel(6, 2048)
	p := m.profile(sim.Comm{}, 8)
	if tf := (m.forward + p.Backward*mi300xFP32) / 1e12; tf < 7.6 || tf > 7.8 {
		t.Errorf("small model: %.3f TFLOP per step, want about 7.71", tf)
	}
}

func TestSeedReport(t *testing.T) {
	var out strings.Builder
	if err := run([]string{"-seed"}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"| 50 | 6.18 | ", // the article's figure beside the prediction
		"The script builds 6 layers × 2048 hidden: 1242 MB of fp32 parameters, not 88 MB. 6 layers × 544 hidden is 88 MB.",
		"| 64 | 512 | 400 |",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("ddpsim -seed lacks %q", want)
		}
	}
}

// profileFile writes a profile of 8 gradients of 1 MiB, ready every 10 ms, on a link of
// 10 ms per MiB.
func profileFile(t *testing.T, dir, name string, backward float64) string {
	t.Helper()
	p := sim.Profile{Backward: backward, Other: 0.02, Comm: sim.Comm{Alpha: 1e-4, Beta: 0.01 / (1 << 20)}, World: 2}
	for i := range 8 {
		p.Params = append(p.Params, bucket.Param{Name: "w", DType: dtype.Float32, Len: 1 << 18})
		p.Order = append(p.Order, 7-i)
		p.Ready = append(p.Ready, 0)
	}
	for k, i := range p.Order {
		p.Ready[i] = 0.01 * float64(k+1)
	}
	return writeJSON(t, dir, name, p)
}

// writeJSON writes v as JSON to dir/name and returns the path.
func writeJSON(t *testing.T, dir, name string, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestPredictAgainstMeasured(t *testing.T) {
	dir := t.TempDir()
	a := profileFile(t, dir, "a.json", 0.080)
	b := profileFile(t, dir, "b.json", 0.090)
	c := profileFile(t, dir, "c.json", 0.200) // an outlier the median ignores
	sum := filepath.Join(dir, "summary.csv")
	csv := "system,bucket_cap_mb,median_ms_step,min_ms_step,max_ms_step,repeats,relative_to_best,compute_ms_step,exposed_ms,exposed_fraction\n" +
		"goddp,1,125,1,1,3,1,55,1,1\ngoddp,8,180,1,1,3,1,55,1,1\ngoddp,auto,120,1,1,3,1,55,1,1\ntorch,1,1,1,1,3,1,1,1,1\n"
	if err := os.WriteFile(sum, []byte(csv), 0o644); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	if err := run([]string{"-profile", a + "," + b + "," + c, "-caps", "1,8", "-measured", sum}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	// Median backward 90 ms. Cap 1 MiB: a bucket per gradient (ready every 10 ms), each
	// all-reduce 10.1 ms, queued behind the one before: the last ends at 10 + 8·10.1 =
	// 90.8 ms, 0.8 ms after backward; step 20 + 90.8. Cap 8 MiB (first 1 MiB): the first
	// gradient alone, then seven in one bucket launched at 80 ms and done 70.1 ms later.
	for _, want := range []string{
		"backward compute 90.00 ms, rest of the step 20.00 ms",
		"| 1 | 8 | 110.8 | 0.8 | 125.0 | -11.4% |",
		"| 8 | 2 | 170.1 | 60.1 | 180.0 | -5.5% |",
		"best predicted of these caps: 1 MB; best measured: 1 MB (0 step(s) apart); largest error 11.4%; the best predicted cap measured +0.0% against the best measured",
		"(measured with --bucket_cap_mb auto: 120.0 ms/step",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	// A sweep where the other cap measured faster: cap 1, the best predicted, is 200/180 − 1
	// above it.
	other := filepath.Join(dir, "other.csv")
	if err := os.WriteFile(other, []byte(strings.Replace(csv, "goddp,1,125,", "goddp,1,200,", 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if err := run([]string{"-profile", a, "-caps", "1,8", "-measured", other}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	if want := "best measured: 8 MB (1 step(s) apart); largest error 44.6%; the best predicted cap measured +11.1% against the best measured\n"; !strings.Contains(out.String(), want) {
		t.Errorf("output lacks %q (a summary without p_best prints none):\n%s", want, out.String())
	}
	// With sweep-report's p_best column, the line gives both caps' P(best).
	withP := filepath.Join(dir, "pbest.csv")
	pcsv := "system,bucket_cap_mb,median_ms_step,min_ms_step,max_ms_step,repeats,relative_to_best,compute_ms_step,exposed_ms,exposed_fraction,p_best\n" +
		"goddp,1,200,1,1,3,1,55,1,1,0.3125\ngoddp,8,180,1,1,3,1,55,1,1,0.6875\ngoddp,auto,120,1,1,3,1,55,1,1,\n"
	if err := os.WriteFile(withP, []byte(pcsv), 0o644); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if err := run([]string{"-profile", a, "-caps", "1,8", "-measured", withP}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	if want := "against the best measured; P(best) over resampled repeats: 0.69 for the best measured, 0.31 for the best predicted\n"; !strings.Contains(out.String(), want) {
		t.Errorf("output lacks %q:\n%s", want, out.String())
	}
	if err := os.WriteFile(withP, []byte(strings.Replace(pcsv, ",0.3125", ",x", 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := run([]string{"-profile", a, "-caps", "1,8", "-measured", withP}, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), `p_best "x"`) {
		t.Errorf("a bad p_best: %v", err)
	}
	// With a layouts.csv: where the best predicted cap, 1 MB, stands among the pooled layouts.
	lays := filepath.Join(dir, "layouts.csv")
	const layHead = "system,caps,buckets,median_ms_step,relative_to_best,p_best\n"
	for rows, want := range map[string]string{
		"goddp,8 16,2,150.000,1.0000,0.7000\ngoddp,1,8,160.000,1.0667,0.3000\ntorch,1,1,1,1,1\n": "by layout (-layouts): best measured: caps 8, 16, P(best) 0.70; the best predicted cap, 1 MB, ran a layout that measured +6.7% against it, P(best) 0.30 (1 step(s) apart)\n",
		"goddp,8,2,170.000,1.1333,0.0100\ngoddp,1 16,3,150.000,1.0000,0.9900\n":                  "by layout (-layouts): best measured: caps 1, 16, P(best) 0.99; the best predicted cap, 1 MB, is one of them (0 steps apart)\n",
		"goddp,8 16,2,150.000,1.0000,1.0000\n":                                                   "by layout (-layouts): best measured: caps 8, 16, P(best) 1.00; the best predicted cap, 1 MB, is in no measured layout (1 step(s) apart)\n",
	} {
		if err := os.WriteFile(lays, []byte(layHead+rows), 0o644); err != nil {
			t.Fatal(err)
		}
		out.Reset()
		if err := run([]string{"-profile", a, "-caps", "1,8", "-measured", sum, "-layouts", lays}, &out, io.Discard); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	for rows, want := range map[string]string{
		"goddp,8,2,150.000,1.0000,x\n": `p_best "x"`,
		"goddp,,2,150.000,1.0000,1\n":  "a row with no caps",
		"torch,8,2,150.000,1.0000,1\n": "no goddp rows",
	} {
		if err := os.WriteFile(lays, []byte(layHead+rows), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := run([]string{"-profile", a, "-caps", "1,8", "-measured", sum, "-layouts", lays}, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("layouts %q: %v, want an error with %q", rows, err, want)
		}
	}
	// allreduce-perf's curve instead of the profile's: 1 ms + 1 ns/byte.
	perf := filepath.Join(dir, "perf.jsonl")
	rows := `{"size_bytes":1048576,"count":262144,"time_us":2048.576}` + "\n" + `{"size_bytes":4194304,"count":1048576,"time_us":5194.304}` + "\n"
	if err := os.WriteFile(perf, []byte(rows), 0o644); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if err := run([]string{"-profile", a, "-allreduce", perf}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "all-reduce: 1000.0 µs + 1.000 ns/byte") {
		t.Errorf("-allreduce:\n%s", out.String())
	}
	// Another link: a ring of 16 at 100 Gbit/s.
	out.Reset()
	if err := run([]string{"-profile", a, "-world", "16", "-gbit", "100", "-latency", "5us"}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "all-reduce: 150.0 µs + 0.150 ns/byte") { // 2·15·5 µs; 2·15/16 / 12.5 GB/s
		t.Errorf("ring of 16:\n%s", out.String())
	}
}

func TestBadInput(t *testing.T) {
	dir := t.TempDir()
	good := profileFile(t, dir, "p.json", 0.08)
	other := filepath.Join(dir, "other.json")
	if err := os.WriteFile(other, []byte(`{"params":[{"Name":"x","DType":1,"Len":3}],"order":[0],"ready_s":[0]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	sum := filepath.Join(dir, "sum.csv")
	if err := os.WriteFile(sum, []byte("system,bucket_cap_mb,median_ms_step,min_ms_step,max_ms_step,repeats,relative_to_best,compute_ms_step,exposed_ms,exposed_fraction\ngoddp,1,125,1,1,3,1,55,1,1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for name, args := range map[string][]string{
		"nothing":       {},
		"bad cap":       {"-profile", good, "-caps", "1,x"},
		"huge cap":      {"-profile", good, "-caps", "1e300"},
		"missing":       {"-profile", filepath.Join(dir, "none.json")},
		"gbit world 1":  {"-profile", good, "-gbit", "100", "-world", "1"},
		"algo":          {"-profile", good, "-gbit", "100", "-world", "4", "-algo", "star"},
		"two models":    {"-profile", good + "," + other},
		"not a summary": {"-profile", good, "-measured", good},
		"extra arg":     {"-profile", good, "x"},
		"allreduce":     {"-profile", good, "-allreduce", good},
		"layouts alone": {"-profile", good, "-layouts", good},
		"not layouts":   {"-profile", good, "-measured", sum, "-layouts", sum},
	} {
		if err := run(args, io.Discard, io.Discard); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

// TestReadyFromTrace: the ready times and backward length are the medians over the passes
// from -trace_from on, of the chosen rank only.
func TestReadyFromTrace(t *testing.T) {
	dir := t.TempDir()
	prof := profileFile(t, dir, "p.json", 0.090)
	var tf tracefile.File
	jitter := []float64{0, 1e3, 10e3}                      // µs: passes 2, 3, 4; the mean is +11/3 ms
	curve := sim.Comm{Alpha: 1e-4, Beta: 0.01 / (1 << 20)} // profileFile's
	for rank := range 2 {
		for iter := 1; iter <= 4; iter++ {
			base := float64(iter) * 1e6
			extra := 50e3 // pass 1 (before -trace_from) and rank 1: far off
			if iter > 1 && rank == 0 {
				extra = jitter[iter-2]
			}
			args := map[string]any{"iter": float64(iter)}
			tf.TraceEvents = append(tf.TraceEvents, tracefile.Event{Name: "backward pass", Cat: "backward", Ph: "X", TS: base, Dur: 50e3 + extra, PID: rank, Args: args})
			// The Finalize wait ends 4 ms after backward; the step starts 20 ms before the
			// pass and ends 10+iter ms after the wait: the rest is 32, 33, 34 ms from pass 2.
			wait := base + 50e3 + extra
			tf.TraceEvents = append(tf.TraceEvents,
				tracefile.Event{Name: "finalize wait", Cat: "wait", Ph: "X", TS: wait, Dur: 4e3, PID: rank, Args: args},
				tracefile.Event{Name: "step", Cat: "step", Ph: "X", TS: base - 20e3, Dur: 20e3 + 50e3 + extra + 4e3 + (10+float64(iter))*1e3, PID: rank},
				// One bucket of 1 MB a pass; its collective takes the curve's time plus
				// 2, 3, 4 ms of skew from pass 2.
				tracefile.Event{Name: "all-reduce 0", Cat: "comm", Ph: "X", TS: wait, Dur: 1e6*curve.Seconds(1e6) + (float64(iter))*1e3, PID: rank,
					Args: map[string]any{"iter": float64(iter), "bucket": 0.0, "bytes": 1e6}})
			for i := range 8 {
				tf.TraceEvents = append(tf.TraceEvents, tracefile.Event{Name: "w", Cat: "grad", Ph: "i", TS: base + float64(8-i)*5e3 + extra, PID: rank,
					Args: map[string]any{"iter": float64(iter), "param": float64(i)}})
			}
		}
	}
	trace := writeJSON(t, dir, "trace.json", tf)
	p, err := loadProfiles([]string{prof})
	if err != nil {
		t.Fatal(err)
	}
	if err := readyFromTrace(p, []string{trace}, 0, 2); err != nil {
		t.Fatal(err)
	}
	for i := range 8 {
		if want := (float64(8-i)*5 + 11.0/3) / 1e3; math.Abs(p.Ready[i]-want) > 1e-12 {
			t.Errorf("Ready[%d] = %v, want %v", i, p.Ready[i], want)
		}
	}
	if want := 0.050 + 11.0/3/1e3; math.Abs(p.Backward-want) > 1e-12 {
		t.Errorf("Backward = %v, want %v", p.Backward, want)
	}
	if math.Abs(p.Skew-0.003) > 1e-9 {
		t.Errorf("Skew = %v, want 0.003 (the mean wait beyond the curve from pass 2)", p.Skew)
	}
	if math.Abs(p.Other-0.033) > 1e-9 {
		t.Errorf("Other = %v, want 0.033 (the mean rest of the steps from pass 2)", p.Other)
	}
	if err := readyFromTrace(p, []string{trace}, 5, 2); err == nil {
		t.Error("a rank with no passes: no error")
	}
	// Three launches, one of them slower in backward by 20 ms (its clock shifted, as
	// another launch's is): the median over the launches ignores it; two slow ones are the
	// median.
	var slow tracefile.File
	for _, e := range tf.TraceEvents {
		e.TS += 7e6
		switch e.Cat {
		case "backward", "step":
			e.Dur += 20e3
		case "wait", "comm":
			e.TS += 20e3
		}
		slow.TraceEvents = append(slow.TraceEvents, e)
	}
	slowTrace := writeJSON(t, dir, "slow.json", slow)
	for _, c := range []struct {
		paths []string
		want  float64
	}{
		{[]string{trace, slowTrace, trace}, p.Backward},
		{[]string{slowTrace, trace, slowTrace}, p.Backward + 0.020},
	} {
		pooled, err := loadProfiles([]string{prof})
		if err != nil {
			t.Fatal(err)
		}
		if err := readyFromTrace(pooled, c.paths, 0, 2); err != nil {
			t.Fatal(err)
		}
		same := math.Abs(pooled.Other-p.Other) < 1e-12
		for i := range p.Ready {
			same = same && math.Abs(pooled.Ready[i]-p.Ready[i]) < 1e-12
		}
		if math.Abs(pooled.Backward-c.want) > 1e-12 || !same {
			t.Errorf("%d of 3 launches slow: backward %v ready %v rest %v; want %v %v %v", strings.Count(strings.Join(c.paths, " "), "slow"),
				pooled.Backward, pooled.Ready, pooled.Other, c.want, p.Ready, p.Other)
		}
	}
	pooled, err := loadProfiles([]string{prof})
	if err != nil {
		t.Fatal(err)
	}
	if err := readyFromTrace(pooled, []string{trace, filepath.Join(dir, "missing.json")}, 0, 2); err == nil {
		t.Error("a missing trace among several: no error")
	}
	var out strings.Builder
	if err := run([]string{"-profile", prof, "-trace", trace, "-trace_from", "2", "-trace_rank", "0"}, &out, io.Discard); err != nil || !strings.Contains(out.String(), "backward compute 53.67 ms, rest of the step 33.00 ms") {
		t.Errorf("ddpsim -trace: %v\n%s", err, out.String())
	}
}

// TestPacingRank: with -trace_rank -1 each pass is read from the rank that launched its
// collective last (Note [The pacing rank]), which changes from pass to pass; a single rank's
// passes mix its slow ones with its fast ones.
func TestPacingRank(t *testing.T) {
	dir := t.TempDir()
	prof := profileFile(t, dir, "p.json", 0.090)
	curve := sim.Comm{Alpha: 1e-4, Beta: 0.01 / (1 << 20)} // profileFile's
	slowRank := map[int]int{2: 1, 3: 0, 4: 1}              // pass 1 is before -trace_from
	var tf tracefile.File
	for iter := 1; iter <= 4; iter++ {
		for rank := range 2 {
			base := float64(iter) * 1e6
			bw, gap, wait := 50e3, 5e3, 10.5e3 // µs: the faster rank waits 10 ms more than the slower
			if slowRank[iter] == rank {
				bw, gap, wait = 60e3, 6e3, 0.5e3
			}
			args := map[string]any{"iter": float64(iter)}
			comm := 1e6*curve.Seconds(1e6) + wait
			tf.TraceEvents = append(tf.TraceEvents,
				tracefile.Event{Name: "backward pass", Cat: "backward", Ph: "X", TS: base, Dur: bw, PID: rank, Args: args},
				tracefile.Event{Name: "finalize wait", Cat: "wait", Ph: "X", TS: base + bw, Dur: comm, PID: rank, Args: args},
				tracefile.Event{Name: "all-reduce 0", Cat: "comm", Ph: "X", TS: base + bw, Dur: comm, PID: rank,
					Args: map[string]any{"iter": float64(iter), "bucket": 0.0, "bytes": 1e6}})
			for i := range 8 {
				tf.TraceEvents = append(tf.TraceEvents, tracefile.Event{Name: "w", Cat: "grad", Ph: "i", TS: base + float64(8-i)*gap, PID: rank,
					Args: map[string]any{"iter": float64(iter), "param": float64(i)}})
			}
		}
	}
	trace := writeJSON(t, dir, "merged.json", tf)
	for _, c := range []struct {
		rank                 int
		backward, skew, last float64 // s; last: Ready[0], the last gradient
	}{
		{-1, 0.060, 0.0005, 0.048},            // every pass the slower rank's
		{0, 0.160 / 3, 0.0215 / 3, 0.128 / 3}, // rank 0: fast, slow, fast (the means)
		{1, 0.170 / 3, 0.0115 / 3, 0.136 / 3}, // rank 1: slow, fast, slow
	} {
		p, err := loadProfiles([]string{prof})
		if err != nil {
			t.Fatal(err)
		}
		if err := readyFromTrace(p, []string{trace}, c.rank, 2); err != nil {
			t.Fatal(err)
		}
		if math.Abs(p.Backward-c.backward) > 1e-9 || math.Abs(p.Skew-c.skew) > 1e-9 || math.Abs(p.Ready[0]-c.last) > 1e-9 {
			t.Errorf("rank %d: backward %v skew %v last ready %v, want %v %v %v", c.rank, p.Backward, p.Skew, p.Ready[0], c.backward, c.skew, c.last)
		}
	}
	var out strings.Builder
	if err := run([]string{"-profile", prof, "-trace", trace, "-trace_from", "2"}, &out, io.Discard); err != nil || !strings.Contains(out.String(), "backward compute 60.00 ms") {
		t.Errorf("ddpsim -trace (-trace_rank -1 by default): %v\n%s", err, out.String())
	}
	if err := run([]string{"-profile", prof, "-trace", trace, "-trace_rank", "-2"}, io.Discard, io.Discard); err == nil {
		t.Error("-trace_rank -2: no error")
	}
}

// TestAutoChoiceKeepsTheDefault: ddpsim's "auto's choice" is the reducer's (Note [Keep the
// default] in package bucket/sim): a layout other than the default caps' only if it is
// predicted at least -min_gain faster.
func TestAutoChoiceKeepsTheDefault(t *testing.T) {
	a := profileFile(t, t.TempDir(), "a.json", 0.080)
	choice := func(args ...string) string {
		t.Helper()
		var out strings.Builder
		if err := run(append([]string{"-profile", a, "-caps", "1,25"}, args...), &out, io.Discard); err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(out.String(), "\n") {
			if strings.HasPrefix(l, "auto's choice") {
				return l
			}
		}
		t.Fatalf("no auto's choice in:\n%s", out.String())
		return ""
	}
	// The default caps 1/25 MB give two buckets, the second launched when backward ends:
	// 170.1 ms/step against 110.8 for a bucket per gradient (TestPredictAgainstMeasured), a
	// gain of at least 35%.
	if got := choice(); strings.Contains(got, "kept") || strings.Contains(got, "cap 25 MB") {
		t.Errorf("default margin: %s; want another layout than the default's", got)
	}
	if got, want := choice("-min_gain", "0.5"), "first cap 1 MB, cap 25 MB, 2 buckets, predicted 170.1 ms/step; the default caps, kept: the best layout found was predicted "; !strings.Contains(got, want) {
		t.Errorf("margin 0.5: %s\nwant %s...", got, want)
	}
	for _, bad := range []string{"1", "-0.1", "x"} {
		if err := run([]string{"-profile", a, "-min_gain", bad}, io.Discard, io.Discard); err == nil {
			t.Errorf("-min_gain %s: no error", bad)
		}
	}
}

// TestOverlapFromTrace: the slowdowns under overlap from a launch whose collectives ran
// during backward, against the one-bucket launches' backward (Note [Overlap from traces]).
func TestOverlapFromTrace(t *testing.T) {
	dir := t.TempDir()
	prof := profileFile(t, dir, "p.json", 0.090)
	const mib = 1 << 20
	alone := 1e3 * (sim.Comm{Alpha: 1e-4, Beta: 0.01 / mib}).Seconds(mib) // ms, profileFile's curve
	// trace writes rank 0's passes 1-4: backward of bwd ms, 8 gradients, and collectives of
	// 1 MiB at the given [start, end] ms from the pass's start. Pass 1 is before -trace_from.
	trace := func(name string, bwd float64, comms [][2]float64) string {
		var tf tracefile.File
		for iter := 1; iter <= 4; iter++ {
			base, b := float64(iter)*1e6, bwd
			if iter == 1 {
				b += 100 // warming up: not read
			}
			args := map[string]any{"iter": float64(iter)}
			tf.TraceEvents = append(tf.TraceEvents, tracefile.Event{Name: "backward pass", Cat: "backward", Ph: "X", TS: base, Dur: b * 1e3, PID: 0, Args: args})
			for k, c := range comms {
				tf.TraceEvents = append(tf.TraceEvents, tracefile.Event{Name: "all-reduce", Cat: "comm", Ph: "X", TS: base + c[0]*1e3, Dur: (c[1] - c[0]) * 1e3, PID: 0,
					Args: map[string]any{"iter": float64(iter), "bucket": float64(k), "bytes": float64(mib)}})
			}
			for i := range 8 {
				tf.TraceEvents = append(tf.TraceEvents, tracefile.Event{Name: "w", Cat: "grad", Ph: "i", TS: base + float64(8-i)*5e3, PID: 0,
					Args: map[string]any{"iter": float64(iter), "param": float64(i)}})
			}
		}
		return writeJSON(t, dir, name, tf)
	}
	one := trace("one.json", 50, [][2]float64{{50, 50 + alone}})
	// Two collectives: 20 ms in flight inside backward, then 20 of 30 ms inside it.
	over := trace("over.json", 60, [][2]float64{{5, 25}, {40, 70}})
	slow := trace("slow.json", 90, [][2]float64{{5, 25}, {40, 70}}) // one launch of three off: the median ignores it
	inflight, work, lost := 40.0, alone+alone*20/30, 10.0
	wantS, wantC := lost/(inflight-lost), inflight/work-1
	p, err := loadProfiles([]string{prof})
	if err != nil {
		t.Fatal(err)
	}
	if err := readyFromTrace(p, []string{one}, 0, 2); err != nil {
		t.Fatal(err)
	}
	o, err := overlapFromTrace(p, []string{over, slow, over}, 0, 2)
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(p.Slowdown-wantS) > 1e-9 || math.Abs(p.CommSlowdown-wantC) > 1e-9 {
		t.Errorf("slowdowns %v, %v; want %v, %v", p.Slowdown, p.CommSlowdown, wantS, wantC)
	}
	if math.Abs(o.backward-0.060) > 1e-12 || math.Abs(o.inflight-inflight/1e3) > 1e-12 || math.Abs(o.work-work/1e3) > 1e-12 || o.buckets != 2 {
		t.Errorf("measured %+v; want backward 0.060, in flight %v, work %v, 2 buckets", o, inflight/1e3, work/1e3)
	}
	// Compute slower than the collectives' time in flight can explain: the bound.
	stalled := trace("stalled.json", 100, [][2]float64{{5, 25}, {40, 70}})
	if _, err := overlapFromTrace(p, []string{stalled}, 0, 2); err != nil || p.Slowdown != 9 {
		t.Errorf("50 ms lost in 50 ms in flight: slowdown %v (%v), want 9", p.Slowdown, err)
	}
	if _, err := overlapFromTrace(p, []string{one}, 0, 2); err == nil {
		t.Error("no collective during backward: no error")
	}
	var out strings.Builder
	err = run([]string{"-profile", prof, "-trace", one, "-trace_from", "2", "-trace_rank", "0", "-overlap_trace", over}, &out, io.Discard)
	if err != nil || !strings.Contains(out.String(), fmt.Sprintf("slowdown under overlap: compute %.2f, all-reduce %.2f", wantS, wantC)) ||
		!strings.Contains(out.String(), "backward 60.00 ms with 2.0 buckets, 50.00 ms with one") {
		t.Errorf("ddpsim -overlap_trace: %v\n%s", err, out.String())
	}
	if err := run([]string{"-profile", prof, "-overlap_trace", over}, io.Discard, io.Discard); err == nil {
		t.Error("-overlap_trace without -trace: no error")
	}
}

// TestCollectiveCPUFromSweep: rank 0's CPU per step rises 0.5 ms a bucket within each repeat,
// over repeats on machines 10 ms apart (Note [CPU per collective from a sweep]); the model
// charges it at every launch.
func TestCollectiveCPUFromSweep(t *testing.T) {
	dir := t.TempDir()
	rows := "system,kind,bucket_cap_mb,repeat,buckets,cpu_ms_step\n"
	// The repeat on the slowest machine ran the most buckets: a slope over all the rows
	// would take its 10 ms for the buckets' (2.2 ms a bucket, not 0.5).
	for rep, r := range []struct {
		base float64
		nbs  []int
	}{{60, []int{2, 3, 7}}, {70, []int{3, 7}}, {50, []int{2, 3}}} {
		for _, nb := range r.nbs {
			rows += fmt.Sprintf("goddp,ddp,1,%d,%d,%g\n", rep+1, nb, r.base+0.5*float64(nb))
		}
	}
	rows += "torch,ddp,1,1,1,999\n" // not goddp's: ignored
	cpu := filepath.Join(dir, "cpu.csv")
	if err := os.WriteFile(cpu, []byte(rows), 0o644); err != nil {
		t.Fatal(err)
	}
	fit, err := collectiveCPUFromSweep(cpu)
	if err != nil || math.Abs(fit.perBucket-0.5e-3) > 1e-12 || fit.launches != 7 || fit.minBuckets != 2 || fit.maxBuckets != 7 {
		t.Fatalf("fit %+v, err %v; want 0.5 ms over 7 launches of 2 to 7 buckets", fit, err)
	}
	a := profileFile(t, dir, "a.json", 0.090)
	var out strings.Builder
	if err := run([]string{"-profile", a, "-caps", "1,8", "-collective_cpu_csv", cpu}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	// Cap 1 MiB: every launch 0.5 ms of compute, so bucket k launches at 10.5k ms and its
	// 10.1 ms all-reduce ends before the next: the last at 94.1 ms, backward's end at 94.0.
	// Cap 8 MiB: the second bucket launches at 81 ms and ends 70.1 ms later.
	for _, want := range []string{
		"CPU per collective (-collective_cpu_csv): 0.500 ms",
		"CPU per collective 0.50 ms",
		"| 1 | 8 | 114.1 | 0.1 |",
		"| 8 | 2 | 171.1 | 60.1 |",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if err := run([]string{"-profile", a, "-collective_cpu", "1ms", "-collective_cpu_csv", cpu}, io.Discard, io.Discard); err == nil {
		t.Error("-collective_cpu and -collective_cpu_csv together: no error")
	}
	flat := filepath.Join(dir, "flat.csv")
	if err := os.WriteFile(flat, []byte("system,kind,bucket_cap_mb,repeat,buckets,cpu_ms_step\ngoddp,ddp,1,1,2,60\ngoddp,ddp,5,2,3,61\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := collectiveCPUFromSweep(flat); err == nil || !strings.Contains(err.Error(), "no repeat with launches of different bucket counts") {
		t.Errorf("one launch per repeat: err %v", err)
	}
}
