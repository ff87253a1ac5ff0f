package main

import (
	"bytes"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/observe"
)

// synthetic writes a 2-rank trace of 3 steps per rank file: backward of 30 ms with 4
// buckets launched every 6 ms, each all-reduce 4 ms long (rank 1 arrives 1 ms later), then
// a finalize wait and an optimizer span. It returns the files.
func synthetic(t *testing.T, dir string) []string {
	t.Helper()
	msd := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	epoch := time.Now()
	var paths []string
	for rank := range 2 {
		p := filepath.Join(dir, observe.TracePath("trace.json", rank, 2))
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		// Rank 1's process started 2 ms later: a different epoch.
		repoch := epoch.Add(time.Duration(rank) * 2 * time.Millisecond)
		tr, err := observe.NewTracer(f, observe.TraceOptions{Rank: rank, WorldSize: 2, Epoch: repoch})
		if err != nil {
			t.Fatal(err)
		}
		for step := range 3 {
			tr.BeginStep(step)
			start := epoch.Add(msd(100 * float64(step)))
			lag := float64(rank)
			st := &ddp.IterStats{Iter: step + 1, Mode: ddp.Sync, Start: start, GradReady: []time.Duration{msd(2)},
				BackwardEnd: msd(30 + lag), FinalizeEnd: msd(36 + lag)}
			for b := range 4 {
				l := msd(6*float64(b+1) + lag)
				st.BucketReady = append(st.BucketReady, l)
				st.BucketLaunched = append(st.BucketLaunched, l)
				st.BucketFinished = append(st.BucketFinished, l+msd(4+1-lag)) // both finish together
				st.BucketBytes = append(st.BucketBytes, 1<<20)
			}
			tr.Record(st)
		}
		if err := tr.Close(); err != nil {
			t.Fatal(err)
		}
		f.Close()
		paths = append(paths, p)
	}
	return paths
}

func TestPlotSyntheticTrace(t *testing.T) {
	dir := t.TempDir()
	paths := synthetic(t, dir)
	pngOut, svgOut, merged := filepath.Join(dir, "step.png"), filepath.Join(dir, "step.svg"), filepath.Join(dir, "merged.json")
	var stdout, stderr bytes.Buffer
	code := run([]string{"-in", strings.Join(paths, ","), "-out", pngOut, "-merge", merged, "-stragglers"}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	out := stdout.String()
	t.Log(out)
	for _, want := range []string{
		"rank 1 arrived last most often (12 of 12, 100%",
		// The default step is the last one (2); rank 0's four all-reduces take 5 ms each,
		// the last one (24–29 ms) ends before backward's end at 30 ms.
		"step 2 rank 0: compute 30.00 ms, all-reduce 20.00 ms (0.00 ms after backward), finalize wait 6.00 ms",
		"step 2 rank 1: compute 31.00 ms, all-reduce 16.00 ms (0.00 ms after backward), finalize wait 6.00 ms",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	f, err := os.Open(pngOut)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	if b := img.Bounds(); b.Dx() < 500 || b.Dy() < 200 {
		t.Errorf("picture is %v", b)
	}
	// The merged trace plots the same, as SVG.
	stdout.Reset()
	if code := run([]string{"-in", merged, "-iter", "1", "-out", svgOut}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	svg, err := os.ReadFile(svgOut)
	if err != nil || !bytes.Contains(svg, []byte("<svg")) || !bytes.Contains(svg, []byte("bucket all-reduce")) {
		t.Errorf("svg: %v, %d bytes", err, len(svg))
	}
	if !strings.Contains(stdout.String(), "step 1 rank 1:") {
		t.Errorf("output %q", stdout.String())
	}
	if keep := os.Getenv("TRACE_PLOT_KEEP"); keep != "" {
		b, _ := os.ReadFile(pngOut)
		os.WriteFile(keep, b, 0o644)
	}
}

func TestBadUsage(t *testing.T) {
	dir := t.TempDir()
	paths := synthetic(t, dir)
	for _, tc := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{}, 2, "want -in FILES"},
		{[]string{"-in", paths[0]}, 2, "want -in FILES"},
		{[]string{"-in", filepath.Join(dir, "nope.json"), "-stragglers"}, 1, "no such file"},
		{[]string{"-in", paths[0], "-iter", "99", "-out", filepath.Join(dir, "x.png")}, 1, "no events of step 99"},
		{[]string{"-in", paths[0], "-out", filepath.Join(dir, "x.gif")}, 1, "x.gif"},
		{[]string{"-in", paths[0] + "," + paths[0], "-stragglers"}, 1, "rank 0 is in traces 0 and 1"},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(tc.args, &stdout, &stderr); code != tc.code || !strings.Contains(stderr.String(), tc.msg) {
			t.Errorf("%v: exit %d, %q; want %d, %q", tc.args, code, stderr.String(), tc.code, tc.msg)
		}
	}
}
