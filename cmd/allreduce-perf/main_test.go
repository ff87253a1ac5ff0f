package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goddp/goddp/procgroup"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestMedian: the middle value of an odd count, the mean of the middle two of an even one,
// whatever the order; 0 for none.
func TestMedian(t *testing.T) {
	for _, c := range []struct {
		xs   []float64
		want float64
	}{
		{nil, 0}, {[]float64{7}, 7}, {[]float64{9, 1, 5}, 5}, {[]float64{4, 100, 1, 2}, 3}, {[]float64{3, 3, 1, 3000}, 3},
	} {
		if got := median(slices.Clone(c.xs)); got != c.want {
			t.Errorf("median(%v) = %v, want %v", c.xs, got, c.want)
		}
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{
		"1": 1, "4096": 4096, "4K": 4096, "4k": 4096, "4KB": 4096, "4KiB": 4096, "1M": 1 << 20,
		"256M": 256 << 20, "1G": 1 << 30, " 2m ": 2 << 20, "1T": 1 << 40,
	} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "0", "-4K", "K", "4X", "1.5M", "2T", "99999999999999999999"} {
		if got, err := parseSize(in); err == nil {
			t.Errorf("parseSize(%q) = %d; want an error", in, got)
		}
	}
}

func TestParseFlags(t *testing.T) {
	c, err := parseFlags(strings.Fields("-b 1K -e 1M -f 4 -n 3 -w 0 -c 0 -d bf16 --op max --backend store --nproc 3 --json --transport unix --algo ring --reset --min_time 300ms -w 2 --collective reducescatter"), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	want := config{minBytes: 1024, maxBytes: 1 << 20, factor: 4, iters: 3, warmup: 2, check: false,
		dtype: procgroup.BFloat16, op: procgroup.Max, backend: "store", nproc: 3, json: true,
		transport: "unix", algo: "ring", timeout: 5 * time.Minute, reset: true, minTime: 300 * time.Millisecond,
		collective: collReduceScatter}
	if c != want {
		t.Fatalf("parseFlags =\n%+v\nwant\n%+v", c, want)
	}
	for _, args := range []string{
		"-b 0", "-b 1 -d float32", "-b 1M -e 4K", "-f 1", "-n 0", "-w -1", "-c 2", "-d int8",
		"--op mean", "--nproc -1", "--transport rdma", "--algo tree", "--bogus", "extra", "--timeout 0s", "-e lots",
		"--min_time -1s", "--min_time 1s -w 0", "--min_time 5", "--collective alltoall", "--collective allgather --ceiling",
	} {
		_, err := parseFlags(strings.Fields(args), &bytes.Buffer{})
		var u errUsage
		if !errors.As(err, &u) {
			t.Errorf("parseFlags(%q) = %v; want a usage error", args, err)
		}
	}
	if code := run([]string{"-f", "1"}, &bytes.Buffer{}, &bytes.Buffer{}); code != 2 {
		t.Errorf("run with a bad flag: exit %d, want 2", code)
	}
	if code := run([]string{"-h"}, &bytes.Buffer{}, &bytes.Buffer{}); code != 0 {
		t.Errorf("run -h: exit %d, want 0", code)
	}
}

// newStoreGroups makes a world of store-backend groups whose ranks are goroutines.
func newStoreGroups(t *testing.T, n int) []procgroup.ProcessGroup {
	t.Helper()
	st := procgroup.NewMemStore()
	pgs := make([]procgroup.ProcessGroup, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pgs[r], errs[r] = procgroup.New(context.Background(), "store", procgroup.Options{Rank: r, Size: n, Store: st})
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	return pgs
}

// benchAll runs bench on every rank and returns rank 0's rows.
func benchAll(t *testing.T, pgs []procgroup.ProcessGroup, cfg config) []row {
	t.Helper()
	var rows []row
	errs := make([]error, len(pgs))
	var wg sync.WaitGroup
	for r, pg := range pgs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = bench(context.Background(), pg, cfg, func(x row) {
				if r == 0 {
					rows = append(rows, x)
				}
			})
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return rows
}

func TestBenchEveryTypeAndOp(t *testing.T) {
	for _, world := range []int{1, 3} {
		pgs := newStoreGroups(t, world)
		for _, dt := range procgroup.DTypes {
			for _, op := range procgroup.ReduceOps {
				cfg := config{minBytes: 100, maxBytes: 1000, factor: 3, iters: 2, warmup: 1, check: true, dtype: dt, op: op}
				rows := benchAll(t, pgs, cfg)
				// 100, 300, 900 bytes, rounded down to whole elements.
				if len(rows) != 3 {
					t.Fatalf("world %d %v %v: %d rows, want 3", world, dt, op, len(rows))
				}
				for i, r := range rows {
					size := int64(100 * math.Pow(3, float64(i)))
					wantCount := int(size) / dt.Size()
					if r.Count != wantCount || r.SizeBytes != int64(wantCount*dt.Size()) || r.DType != dt.String() || r.Ranks != world {
						t.Errorf("world %d %v %v row %d: %+v; want count %d", world, dt, op, i, r, wantCount)
					}
					if r.Wrong != 0 || r.OK == nil || !*r.OK {
						t.Errorf("world %d %v %v row %d: %d wrong elements", world, dt, op, i, r.Wrong)
					}
					wantBus := r.AlgBW * 2 * float64(world-1) / float64(world)
					if r.TimeUS <= 0 || r.AlgBW <= 0 || math.Abs(r.BusBW-wantBus) > 1e-12 {
						t.Errorf("row %+v: time/bandwidth inconsistent (busbw want %g)", r, wantBus)
					}
					wantMed := float64(r.SizeBytes) / (r.TimeUSMedian * 1e3) * 2 * float64(world-1) / float64(world)
					if r.TimeUSMedian <= 0 || math.Abs(r.BusBWMedian-wantMed) > 1e-9*wantMed {
						t.Errorf("row %+v: median time/busbw inconsistent (busbw want %g)", r, wantMed)
					}
				}
			}
		}
		for _, pg := range pgs {
			pg.Close()
		}
	}
}

// verify must catch a wrong element, for every type and op.
func TestVerifyDetectsCorruption(t *testing.T) {
	const world, bytes = 3, 96
	pgs := newStoreGroups(t, world)
	defer func() {
		for _, pg := range pgs {
			pg.Close()
		}
	}()
	for _, dt := range procgroup.DTypes {
		for _, op := range procgroup.ReduceOps {
			count := bytes / dt.Size()
			bufs := make([]any, world)
			var wg sync.WaitGroup
			for r := range world {
				bufs[r] = procgroup.NewBuffer(dt, count)
				fill(bufs[r], newGen(r, world, bytes, dt, op))
				wg.Add(1)
				go func() {
					defer wg.Done()
					if err := pgs[r].AllReduce(context.Background(), bufs[r], op).Wait(context.Background()); err != nil {
						t.Error(err)
					}
				}()
			}
			wg.Wait()
			if w := verify(bufs[1], world, bytes, dt, op); w != 0 {
				t.Fatalf("%v %v: %d wrong in a correct result", dt, op, w)
			}
			// Corrupt two elements: a small relative change and a sign flip.
			vals := make([]float64, count)
			load(vals, bufs[1], 0)
			vals[3] = vals[3]*1.05 + 1
			vals[count-1] = -vals[count-1] - 1
			store(bufs[1], vals)
			if w := verify(bufs[1], world, bytes, dt, op); w != 2 {
				t.Errorf("%v %v: verify found %d wrong elements, want 2", dt, op, w)
			}
			// A rank whose data came from another seed is wrong too.
			if w := verify(bufs[2], world, bytes+1, dt, op); w == 0 {
				t.Errorf("%v %v: verify against another size's data found nothing wrong", dt, op)
			}
		}
	}
}

func TestReporter(t *testing.T) {
	ok, bad := true, false
	rows := []row{
		{SizeBytes: 4096, Count: 1024, DType: "float32", Op: "sum", Ranks: 2, TimeUS: 10, AlgBW: 0.4096, BusBW: 0.4096, OK: &ok},
		{SizeBytes: 8192, Count: 2048, DType: "float32", Op: "sum", Ranks: 2, TimeUS: 20, AlgBW: 0.4096, BusBW: 0.4096, OK: &bad, Wrong: 3},
	}
	var table bytes.Buffer
	rep := newReporter(&table, config{check: true, backend: "gloo", dtype: procgroup.Float32, op: procgroup.Sum}, 2)
	rep.header()
	for _, r := range rows {
		rep.row(r)
	}
	rep.footer()
	lines := strings.Split(strings.TrimSpace(table.String()), "\n")
	var data []string
	for _, l := range lines {
		if !strings.HasPrefix(l, "#") {
			data = append(data, l)
		}
	}
	if len(data) != 2 || !strings.Contains(table.String(), "Out of bounds values : 3 FAILED") {
		t.Fatalf("table:\n%s", table.String())
	}
	if f := strings.Fields(data[1]); len(f) != 8 || f[0] != "8192" || f[1] != "2048" || f[4] != "20.00" || f[7] != "3" {
		t.Errorf("row fields %q", f)
	}

	var js bytes.Buffer
	rep = newReporter(&js, config{json: true}, 2)
	rep.header()
	for _, r := range rows {
		rep.row(r)
	}
	rep.footer()
	jl := strings.Split(strings.TrimSpace(js.String()), "\n")
	if len(jl) != 2 {
		t.Fatalf("JSON output has %d lines:\n%s", len(jl), js.String())
	}
	var m map[string]any
	if err := json.Unmarshal([]byte(jl[1]), &m); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"size_bytes", "count", "dtype", "time_us", "algbw_gbs", "busbw_gbs", "ok"} {
		if _, found := m[k]; !found {
			t.Errorf("JSON object lacks %q: %s", k, jl[1])
		}
	}
	if m["ok"] != false || m["size_bytes"] != 8192.0 {
		t.Errorf("JSON object %s", jl[1])
	}
}

// buildCommand builds allreduce-perf into a temporary directory, with the test hooks, and
// without gloo when gloo does not build (yet); it reports whether gloo is in.
func buildCommand(t *testing.T) (string, bool) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds the command: skipped with -short")
	}
	bin := filepath.Join(t.TempDir(), "allreduce-perf")
	build := func(tags string) error {
		out, err := exec.Command("go", "build", "-tags", tags, "-o", bin, ".").CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v\n%s", err, out)
		}
		return nil
	}
	if err := build("allreduceperf_testhooks"); err == nil {
		return bin, true
	} else {
		t.Logf("building with gloo failed, testing the store backend only: %v", err)
	}
	if err := build("allreduceperf_testhooks,allreduceperf_nogloo"); err != nil {
		t.Fatal(err)
	}
	return bin, false
}

// runCommand runs the binary with a marker in its environment and checks, once it has
// exited, that no process carrying the marker (a rank) is left.
func runCommand(t *testing.T, bin string, extraEnv []string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	marker := fmt.Sprintf("GODDP_PERF_TEST_MARKER=%d-%d", os.Getpid(), time.Now().UnixNano())
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(append(os.Environ(), marker), extraEnv...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		code = ee.ExitCode()
	default:
		t.Fatalf("run %v: %v", args, err)
	}
	if left := processesWith(marker); len(left) > 0 {
		t.Errorf("processes left behind after %v: %v", args, left)
	}
	return out.String(), errb.String(), code
}

// processesWith lists the pids whose environment holds kv (Linux /proc; none elsewhere).
func processesWith(kv string) []int {
	entries, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", e.Name(), "environ"))
		if err != nil {
			continue
		}
		for _, v := range bytes.Split(env, []byte{0}) {
			if string(v) == kv {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

func dataRows(out string) [][]string {
	var rows [][]string
	for _, l := range strings.Split(out, "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			rows = append(rows, strings.Fields(l))
		}
	}
	return rows
}

func TestCommandEndToEnd(t *testing.T) {
	bin, haveGloo := buildCommand(t)
	backends := []string{"store"}
	if haveGloo {
		backends = append(backends, "gloo")
	}
	for _, backend := range backends {
		t.Run(backend, func(t *testing.T) {
			stdout, stderr, code := runCommand(t, bin, nil, "--nproc", "2", "-b", "4K", "-e", "64K", "-n", "2", "-w", "1", "--backend", backend)
			if code != 0 {
				t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
			}
			rows := dataRows(stdout)
			if len(rows) != 5 {
				t.Fatalf("%d rows, want 5 (4K..64K):\n%s", len(rows), stdout)
			}
			for i, f := range rows {
				size := 4096 << i
				// gloo adds the algorithm it takes for the size (shared memory: one host).
				wantLen, algo := 8, ""
				if backend == "gloo" {
					wantLen, algo = 9, "shm-direct"
				}
				if len(f) != wantLen || f[0] != strconv.Itoa(size) || f[1] != strconv.Itoa(size/4) || f[2] != "float32" || f[7] != "0" || (algo != "" && f[8] != algo) {
					t.Errorf("row %d: %q", i, f)
				}
			}
			if !strings.Contains(stdout, "Out of bounds values : 0 OK") {
				t.Errorf("no OK verdict:\n%s", stdout)
			}

			stdout, stderr, code = runCommand(t, bin, nil, "--nproc", "3", "-b", "1K", "-e", "4K", "-n", "1", "-w", "0", "-d", "bf16", "--op", "avg", "--json", "--backend", backend)
			if code != 0 {
				t.Fatalf("--json: exit %d\n%s\n%s", code, stdout, stderr)
			}
			lines := strings.Split(strings.TrimSpace(stdout), "\n")
			if len(lines) != 3 {
				t.Fatalf("--json: %d lines, want 3:\n%s", len(lines), stdout)
			}
			for i, l := range lines {
				var r row
				if err := json.Unmarshal([]byte(l), &r); err != nil {
					t.Fatalf("line %q: %v", l, err)
				}
				if r.SizeBytes != int64(1024<<i) || r.DType != "bfloat16" || r.Ranks != 3 || r.OK == nil || !*r.OK {
					t.Errorf("line %d: %+v", i, r)
				}
			}

			// -c 0 checks nothing: it must not report a failure.
			stdout, stderr, code = runCommand(t, bin, nil, "--nproc", "2", "-b", "4K", "-e", "8K", "-n", "1", "-w", "0", "-c", "0", "--backend", backend)
			if code != 0 || !strings.Contains(stdout, "not checked") {
				t.Errorf("-c 0: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
			}
		})
	}
}

func TestCommandRankDies(t *testing.T) {
	bin, _ := buildCommand(t)
	// Rank 1 exits (status 7) after its 3rd all-reduce; rank 0 waits for it in the next
	// one, and the launcher must kill it and fail.
	stdout, stderr, code := runCommand(t, bin, []string{"GODDP_ALLREDUCE_PERF_TEST_EXIT=1:3"},
		"--nproc", "3", "-b", "4K", "-e", "16K", "-n", "2", "-w", "1", "--backend", "store")
	if code != 7 {
		t.Fatalf("exit %d, want 7 (the dead rank's)\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	if !strings.Contains(stderr, "rank 1 failed") {
		t.Errorf("stderr does not name the failed rank:\n%s", stderr)
	}
}

func TestCommandBadFlags(t *testing.T) {
	bin, _ := buildCommand(t)
	for _, args := range [][]string{{"-b", "lots"}, {"--nproc", "2", "--op", "mean"}, {"--nproc", "2", "--backend", "nope"}} {
		_, stderr, code := runCommand(t, bin, nil, args...)
		if code != 2 || !strings.Contains(stderr, "allreduce-perf:") {
			t.Errorf("%v: exit %d, want 2; stderr:\n%s", args, code, stderr)
		}
	}
	// No --nproc and only some of a launcher's variables: an error that names a missing one.
	cmd := exec.Command(bin, "--backend", "store")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "MASTER_ADDR=127.0.0.1"}
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(string(out), "RANK") {
		t.Errorf("with MASTER_ADDR only: %v\n%s", err, out)
	}
	// No launcher variable at all: a world of one rank.
	cmd = exec.Command(bin, "--backend", "store", "-b", "4K", "-e", "8K", "-n", "2", "-w", "1")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	if out, err = cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "1 ranks") || !strings.Contains(string(out), "Out of bounds values : 0 OK") {
		t.Errorf("without a launcher: %v\n%s", err, out)
	}
}

// TestCeilingArithmetic: Note [Ceiling]'s bound from a rate and a traffic.
func TestCeilingArithmetic(t *testing.T) {
	for _, tc := range []struct {
		n             int
		traffic, rate float64
		want          float64
	}{
		{2, 2.5, 10, 4},   // algbw 4, busbw = algbw at n = 2
		{4, 3.75, 30, 12}, // algbw 8, busbw 8·2·3/4
		{1, 2.5, 10, 0},   // no busbw for one rank
		{2, 0, 10, 0},     // traffic unknown
		{2, 2.5, 0, 0},    // no rate
		{3, singleCopyTraffic(3), 8, 8 / (8.0 / 3) * 4 / 3},
	} {
		if got := ceilingBusBW(tc.n, tc.traffic, tc.rate); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("ceilingBusBW(%d, %g, %g) = %g, want %g", tc.n, tc.traffic, tc.rate, got, tc.want)
		}
	}
	if got := singleCopyTraffic(2); got != 2.5 {
		t.Errorf("singleCopyTraffic(2) = %g, want 2.5 (read both halves of your chunk, write it, copy the other half)", got)
	}
}

// TestCommandCeiling: --ceiling adds the algorithm, the memory rate and the ceilings to
// every row, consistently with the row's busbw.
func TestCommandCeiling(t *testing.T) {
	bin, haveGloo := buildCommand(t)
	if !haveGloo {
		t.Skip("the gloo backend is not built in")
	}
	stdout, stderr, code := runCommand(t, bin, nil, "--nproc", "2", "-b", "4K", "-e", "1M", "-f", "16", "-n", "2", "-w", "1", "--ceiling", "--json")
	if code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	lines := strings.Split(strings.TrimSpace(stdout), "\n")
	if len(lines) != 3 {
		t.Fatalf("%d lines, want 3 (4K, 64K, 1M):\n%s", len(lines), stdout)
	}
	// The 1 MiB buffer, passed to its second collective by the warm-up, is adopted into
	// the arena and all-reduced in place (gloo's Note [Adopted buffers]).
	wantAlgo := []string{"shm-direct", "shm-direct", "shm-inplace"}
	for i, l := range lines {
		var r row
		if err := json.Unmarshal([]byte(l), &r); err != nil {
			t.Fatalf("line %q: %v", l, err)
		}
		wantTraffic := map[string]float64{"shm-direct": 3, "shm-inplace": 2}[wantAlgo[i]]
		if r.MemGBs != max(r.CopyGBs, r.ReduceGBs, r.ExchangeGBs) || r.CopyGBs <= 0 || r.ReduceGBs <= 0 || r.ExchangeGBs <= 0 {
			t.Errorf("row %d: memory rate %g GB/s, want the fastest of copy %g, reduce %g and exchange %g, all positive", i, r.MemGBs, r.CopyGBs, r.ReduceGBs, r.ExchangeGBs)
		}
		if r.Algo != wantAlgo[i] || r.Traffic != wantTraffic || r.MemGBs <= 0 {
			t.Errorf("row %d: algo %q traffic %g memory %g GB/s; want %q, %g, a positive rate", i, r.Algo, r.Traffic, r.MemGBs, wantAlgo[i], wantTraffic)
		}
		if want := ceilingBusBW(2, r.Traffic, r.MemGBs); math.Abs(r.CeilBusBW-want) > 1e-9*want || want <= 0 {
			t.Errorf("row %d: ceiling %g, want %g from its own rate and traffic", i, r.CeilBusBW, want)
		}
		if want := 100 * r.BusBWMedian / r.CeilBusBW; math.Abs(r.PctCeilMedian-want) > 1e-9*want {
			t.Errorf("row %d: median at %g%% of the ceiling, want %g", i, r.PctCeilMedian, want)
		}
		if want := 100 * r.BusBW / r.CeilBusBW; math.Abs(r.PctCeil-want) > 1e-9*want {
			t.Errorf("row %d: %g%% of the ceiling, want %g", i, r.PctCeil, want)
		}
		if want := ceilingBusBW(2, 2.5, r.MemGBs); math.Abs(r.SingleCopyBusBW-want) > 1e-9*want {
			t.Errorf("row %d: single-copy ceiling %g, want %g", i, r.SingleCopyBusBW, want)
		}
	}
	// --shared: the 1 MiB buffer comes from the arena and is all-reduced in place (each
	// timed iteration from the input, --reset).
	stdout, stderr, code = runCommand(t, bin, nil, "--nproc", "2", "-b", "1M", "-e", "1M", "-n", "2", "-w", "1", "--ceiling", "--shared", "--reset", "--json")
	var r row
	if err := json.Unmarshal([]byte(strings.TrimSpace(stdout)), &r); code != 0 || err != nil || r.Algo != "shm-inplace" || r.OK == nil || !*r.OK {
		t.Errorf("--shared: exit %d, row %+v (%v); want shm-inplace, checked OK\n%s", code, r, err, stderr)
	}
	// The table form has the extra columns. With adoption off the buffer stays the
	// program's, and takes the slot ring.
	stdout, stderr, code = runCommand(t, bin, []string{"GODDP_GLOO_ADOPT=off"}, "--nproc", "2", "-b", "1M", "-e", "1M", "-n", "1", "-w", "0", "--ceiling")
	if code != 0 {
		t.Fatalf("table: exit %d\n%s\n%s", code, stdout, stderr)
	}
	rows := dataRows(stdout)
	if len(rows) != 1 || len(rows[0]) != 14 || rows[0][8] != "shm-ring" || !strings.HasSuffix(rows[0][12], "%") {
		t.Errorf("table rows %q, want one of 14 fields (algo shm-ring, a %% of the ceiling):\n%s", rows, stdout)
	}
}

// inputLog records a copy of every float32 buffer of count elements that rank's
// all-reduces are given, before they run.
type inputLog struct {
	procgroup.ProcessGroup
	count int
	in    [][]float32
}

func (l *inputLog) AllReduce(ctx context.Context, buf any, op procgroup.ReduceOp) procgroup.Work {
	if b, ok := buf.([]float32); ok && len(b) == l.count {
		l.in = append(l.in, slices.Clone(b))
	}
	return l.ProcessGroup.AllReduce(ctx, buf, op)
}

// TestTimedIterationsBackToBack: the timed all-reduces run back to back on the buffer (the
// second sums the first's result, the third twice that), and with --reset, or for
// products, each starts from the rank's input again (that of the checked one).
func TestTimedIterationsBackToBack(t *testing.T) {
	const count = 96
	for _, c := range []struct {
		op    procgroup.ReduceOp
		reset bool
	}{{procgroup.Sum, false}, {procgroup.Sum, true}, {procgroup.Prod, false}} {
		pgs := newStoreGroups(t, 2)
		logs := []*inputLog{{ProcessGroup: pgs[0], count: count}, {ProcessGroup: pgs[1], count: count}}
		cfg := config{minBytes: 4 * count, maxBytes: 4 * count, factor: 2, iters: 3, warmup: 1, check: true,
			dtype: procgroup.Float32, op: c.op, reset: c.reset}
		benchAll(t, []procgroup.ProcessGroup{logs[0], logs[1]}, cfg)
		for r, l := range logs {
			// warm-up, checked, three timed
			if len(l.in) != 5 {
				t.Fatalf("%v reset=%v rank %d: %d all-reduces of the buffer, want 5", c.op, c.reset, r, len(l.in))
			}
			src := l.in[1]
			if !slices.Equal(l.in[0], src) {
				t.Errorf("%v reset=%v rank %d: the warm-up and the checked all-reduce start from different inputs", c.op, c.reset, r)
			}
			for i := range 3 {
				want := slices.Clone(src)
				if !c.reset && c.op == procgroup.Sum && i > 0 {
					for k := range want {
						want[k] = logs[0].in[1][k] + logs[1].in[1][k]
						if i == 2 {
							want[k] *= 2
						}
					}
				}
				if got := l.in[2+i]; !slices.Equal(got, want) {
					t.Errorf("%v reset=%v rank %d: timed all-reduce %d started from %v..., want %v...", c.op, c.reset, r, i, got[:3], want[:3])
				}
			}
		}
	}
}

// TestMinTime: --min_time raises the timed count above -n, the same on every rank (they
// agree on the slowest pace), and the row says how many ran; without it -n holds.
func TestMinTime(t *testing.T) {
	pgs := newStoreGroups(t, 2)
	base := config{minBytes: 1 << 10, maxBytes: 1 << 10, factor: 2, iters: 3, warmup: 2, check: true,
		dtype: procgroup.Float32, op: procgroup.Sum}
	if rows := benchAll(t, pgs, base); len(rows) != 1 || rows[0].Iters != 3 {
		t.Fatalf("without --min_time: rows %+v, want one of 3 iterations", rows)
	}
	cfg := base
	cfg.minTime = 50 * time.Millisecond
	rows := benchAll(t, pgs, cfg)
	if len(rows) != 1 || rows[0].Iters <= 3 || rows[0].Iters > maxIters || rows[0].OK == nil || !*rows[0].OK {
		t.Fatalf("--min_time 50ms: rows %+v, want one checked row of more than 3 iterations", rows)
	}
}

// TestCommandCollectives: --collective through the command, 3 spawned ranks: every
// collective's table is checked OK and its header names it.
func TestCommandCollectives(t *testing.T) {
	bin, haveGloo := buildCommand(t)
	if !haveGloo {
		t.Skip("built without gloo")
	}
	for _, coll := range collectives[1:] {
		stdout, stderr, code := runCommand(t, bin, nil, "--nproc", "3", "-b", "64K", "-e", "4M", "-f", "64", "-n", "2", "-w", "1", "--collective", coll)
		if code != 0 || len(dataRows(stdout)) != 2 || !strings.Contains(stdout, "--collective "+coll) || !strings.Contains(stdout, "Out of bounds values : 0 OK") {
			t.Errorf("--collective %s: exit %d, want two checked rows under a header naming it\nstdout:\n%s\nstderr:\n%s", coll, code, stdout, stderr)
		}
	}
}
