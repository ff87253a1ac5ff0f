package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/ddp/observe"
	"github.com/goddp/goddp/ddp/tracefile"
	"github.com/goddp/goddp/examples/transformer/model"
	"github.com/goddp/goddp/procgroup"
)

// TestObservability: two ranks with every observability flag on. Rank 1 sleeps 150 ms per
// step (--straggle_ms; far above the steps' own noise under -race on 2 cores, where 20 ms
// once let rank 0 arrive last in 2 of 8 steps): the straggler report (from the ranks'
// exchanged arrivals) and the merged trace (from the launch events) both name it. The overlap report comes every
// --report_every steps, the trace holds each step's spans and collectives, and the metrics
// endpoint, scraped mid-run, counts the steps and bytes reduced so far.
func TestObservability(t *testing.T) {
	dir := t.TempDir()
	const steps = 8
	args := fmt.Sprintf("%s --batch_size 2 --warmup_steps 1 --bench_steps %d --report_every 4 --straggle_ms 1:150 --trace %s --metrics_addr 127.0.0.1:0",
		tinyDDPFlags, steps-1, filepath.Join(dir, "tr.{rank}.json"))
	f, err := parseFlags(strings.Fields(args), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	m, err := model.New(modelConfig(f))
	if err != nil {
		t.Fatal(err)
	}
	var scraped [2]string
	var scrapeErr [2]error
	_, outs := trainRanksWith(t, 2, args, func(rank int, _ procgroup.ProcessGroup, f *flags) {
		var addr string
		f.onServe = func(a string) { addr = a }
		f.onGrads = func(step int, _ []float32) {
			if step == 2 { // after the third Finalize, before the third step ends
				scraped[rank], scrapeErr[rank] = scrape("http://" + addr + "/metrics")
			}
		}
	})
	out := outs[0]
	if n := strings.Count(out, "\nddp: 4 passes: "); n != 2 {
		t.Errorf("%d overlap reports of 4 passes, want 2 (every 4 of 8 steps):\n%s", n, out)
	}
	if !regexp.MustCompile(`(?m)^ddp stragglers: 8 collectives, .*rank 1 arrived last most often \(8 of 8`).MatchString(out) {
		t.Errorf("the straggler report does not name rank 1 for all 8 collectives:\n%s", out)
	}
	if !regexp.MustCompile(`(?m)^step 1 loss [0-9.]+  [0-9.]+ ms/step  ETA \d+m?s$`).MatchString(out) {
		t.Errorf("no plain progress line with ms/step and ETA:\n%s", out)
	}
	if strings.Contains(outs[1], "ddp") || strings.Contains(outs[1], "loss") {
		t.Errorf("rank 1 prints rank 0's reports:\n%s", outs[1])
	}

	// Metrics, scraped during step 2: 2 steps done, 3 buckets of all the parameters reduced.
	for r := range 2 {
		if scrapeErr[r] != nil {
			t.Fatalf("rank %d: scrape: %v", r, scrapeErr[r])
		}
		for _, want := range []string{
			fmt.Sprintf("goddp_steps_total{rank=\"%d\"} 2\n", r),
			fmt.Sprintf("goddp_bytes_reduced_total{rank=\"%d\"} %d\n", r, 3*4*m.NumParams()),
			fmt.Sprintf("goddp_collective_seconds_count{rank=\"%d\"} 3\n", r),
			"go_goroutines ",
		} {
			if !strings.Contains(scraped[r], want) {
				t.Errorf("rank %d's metrics lack %q:\n%s", r, want, scraped[r])
			}
		}
	}

	// The trace: per rank, every step's spans and all-reduce; rank 1's sleeps.
	var files []*tracefile.File
	for r := range 2 {
		tf, err := tracefile.ReadFile(filepath.Join(dir, fmt.Sprintf("tr.%d.json", r)))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, tf)
		count := map[string]int{}
		for _, e := range tf.TraceEvents {
			if e.Ph == "X" {
				count[e.Cat+"/"+strings.TrimRight(e.Name, "0123456789 ")]++
			}
		}
		sleeps := 0
		if r == 1 {
			sleeps = steps
		}
		for name, want := range map[string]int{
			"compute/forward+backward": steps, "compute/optimizer": steps, "comm/all-reduce": steps,
			"backward/backward pass": steps, "step/step": steps, "compute/straggle (--straggle_ms)": sleeps,
		} {
			if count[name] != want {
				t.Errorf("rank %d's trace: %d %q events, want %d (all: %v)", r, count[name], name, want, count)
			}
		}
	}
	merged, err := tracefile.Merge(files...)
	if err != nil {
		t.Fatal(err)
	}
	if rep := observe.AnalyzeArrivals(observe.ArrivalsFromTrace(merged)); rep.Straggler != 1 || rep.Collectives != steps {
		t.Errorf("the merged trace's straggler report: %v", rep)
	}
}

func scrape(url string) (string, error) {
	resp, err := http.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s: %s", url, resp.Status)
	}
	return string(b), err
}

// TestTraceNoDDP: --no_ddp writes a trace of the trainer's spans; the flags off write none.
func TestTraceNoDDP(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "t.json")
	_, out := trainArgs(t, tinyFlags+" --batch_size 2 --warmup_steps 0 --bench_steps 3 --trace "+path)
	tf, err := tracefile.ReadFile(path)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	n := 0
	for _, e := range tf.TraceEvents {
		if e.Name == "forward+backward" {
			n++
		}
	}
	if n != 3 {
		t.Errorf("%d forward+backward spans, want 3", n)
	}
	before, _ := os.ReadDir(dir)
	trainArgs(t, tinyFlags+" --batch_size 2 --warmup_steps 0 --bench_steps 1")
	if after, _ := os.ReadDir(dir); len(after) != len(before) {
		t.Errorf("a run without --trace wrote files")
	}
}

func TestObsFlags(t *testing.T) {
	for _, args := range []string{
		"--no_ddp --straggle_ms 1", "--no_ddp --straggle_ms x:3", "--no_ddp --straggle_ms -1:3", "--no_ddp --straggle_ms 1:-3",
		"--no_ddp --report_every 0", "--no_ddp --checkpoint_every 0",
	} {
		if _, err := parseFlags(strings.Fields(args), io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	f, err := parseFlags(strings.Fields("--no_ddp --straggle_ms 1:2.5"), io.Discard)
	if err != nil || f.straggleRank != 1 || f.straggle.Microseconds() != 2500 {
		t.Errorf("--straggle_ms 1:2.5: %d %v %v", f.straggleRank, f.straggle, err)
	}
	for _, c := range []struct {
		addr string
		lr   int
		want string
	}{{"127.0.0.1:9400", 1, "127.0.0.1:9401"}, {":0", 3, ":0"}, {"[::1]:80", 0, "[::1]:80"}} {
		if got, err := rankAddr(c.addr, c.lr); err != nil || got != c.want {
			t.Errorf("rankAddr(%q, %d) = %q, %v; want %q", c.addr, c.lr, got, err, c.want)
		}
	}
	for _, bad := range []string{"9400", "h:x", "h:65535"} {
		if _, err := rankAddr(bad, 1); err == nil {
			t.Errorf("rankAddr(%q) accepted", bad)
		}
	}
	if _, _, err := trainEdit(t, tinyFlags+" --batch_size 2 --bench_steps 1 --metrics_addr nope", nil); err == nil {
		t.Error("--metrics_addr nope: no error")
	}
}

// TestObserverOffAllocs: with the flags off (no trace, no metrics) and without ddp, the
// per-step observability calls allocate nothing.
func TestObserverOffAllocs(t *testing.T) {
	o := &observer{every: 1, firstStep: -1}
	ctx := context.Background()
	if n := testing.AllocsPerRun(100, func() {
		o.tr.BeginStep(3)
		end := o.tr.Span("forward+backward")
		end()
		if err := o.afterFinalize(ctx, nil); err != nil {
			t.Fatal(err)
		}
		o.endStep(3, time.Millisecond, 1.5)
		o.showLoss(3, 1.5)
	}); n != 0 {
		t.Errorf("%v allocations per step with observability off", n)
	}
	if err := o.close(ctx); err != nil {
		t.Fatal(err)
	}
}
