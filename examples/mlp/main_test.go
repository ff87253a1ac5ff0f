package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goddp/goddp/internal/launchtest"
	"github.com/goddp/goddp/procgroup"
)

// asMainEnv makes the test binary act as the trainer (TestDDPRunEqualsOneProcess launches
// it under ddprun).
const asMainEnv = "GODDP_MLP_TEST_AS_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(asMainEnv) == "1" {
		killHook() // GODDP_MLP_TEST_KILL: a rank's kill -9 at a step
		main()
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

// tolerance bounds |DDP − one process| for every parameter after the runs below: the two
// differ only in the order float32 sums are taken (per-rank means, then the mean over
// ranks, against one mean over the global batch).
const tolerance = 1e-6

// small is a model and run small enough for -race: 97 parameters, 30 steps.
const small = "--hidden_size 16 --steps 30 --log_every 10 --lr 0.3"

func mustParse(t *testing.T, args string) flags {
	t.Helper()
	f, err := parseFlags(strings.Fields(args), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// alone trains one process (--no_ddp) and returns its parameters and output.
func alone(t *testing.T, args string) ([]float32, string) {
	t.Helper()
	var out bytes.Buffer
	m, err := train(context.Background(), mustParse(t, args+" --no_ddp"), nil, &out)
	if err != nil {
		t.Fatal(err)
	}
	return m.flat(), out.String()
}

// maxDiff is max_k |a[k] − b[k]|.
func maxDiff(t *testing.T, a, b []float32) float64 {
	t.Helper()
	if len(a) != len(b) {
		t.Fatalf("%d parameters vs %d", len(a), len(b))
	}
	var d float64
	for k := range a {
		d = math.Max(d, math.Abs(float64(a[k])-float64(b[k])))
	}
	return d
}

// TestDDPRunEqualsOneProcess launches 2 ranks of this trainer (this test binary) under the
// real ddprun (its store, the environment, gloo over sockets), with 2 micro-batches of 4
// per rank and buckets of about 100 bytes, and checks that: both ranks print the same
// params_crc32 last; rank 0's --save_params file (into a folder that does not exist yet)
// holds those parameters; they equal a one-process run with the global batch (16) within
// tolerance; and that run is far (> 100× tolerance) from one on rank 0's data alone, so the
// comparison can tell.
func TestDDPRunEqualsOneProcess(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	dir := t.TempDir()
	ddprun := launchtest.DDPRun(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	saved := filepath.Join(dir, "out", "params.bin")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	args := small + " --batch_size 4 --accum_steps 2 --bucket_cap_mb 0.0001 --first_bucket_cap_mb 0.0001 --save_params " + saved
	cmd := exec.CommandContext(ctx, ddprun, append([]string{"--standalone", "--nproc_per_node", "2", exe, "--"}, strings.Fields(args)...)...)
	cmd.Env = append(os.Environ(), asMainEnv+"=1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("ddprun: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	last := map[string]string{} // each rank's last line
	for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
		if rank, rest, ok := strings.Cut(line, "]: "); ok {
			last[rank] = rest
		}
	}
	if len(last) != 2 || last["[rank0"] != last["[rank1"] || !strings.HasPrefix(last["[rank0"], "params_crc32=") {
		t.Fatalf("last lines per rank %q; stdout:\n%s", last, stdout.String())
	}
	b, err := os.ReadFile(saved)
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprintf("params_crc32=%08x", crc32.ChecksumIEEE(b)); got != last["[rank0"] {
		t.Errorf("--save_params file: %s, printed %s", got, last["[rank0"])
	}
	ddpParams := make([]float32, len(b)/4)
	for k := range ddpParams {
		ddpParams[k] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*k:]))
	}
	ref, refOut := alone(t, small+" --batch_size 16")
	if d := maxDiff(t, ref, ddpParams); d > tolerance {
		t.Errorf("2 ranks × 2 micro-batches × 4 vs one process × 16: max |Δparam| = %g > %g", d, tolerance)
	} else {
		t.Logf("2 ranks × 2 micro-batches × 4 vs one process × 16: max |Δparam| = %g", d)
	}
	if !strings.Contains(stdout.String(), "[rank0]: "+strings.Split(refOut, "\n")[0]) {
		t.Errorf("rank 0's first loss line differs from the one process's %q:\n%s", strings.Split(refOut, "\n")[0], stdout.String())
	}
	rank0Only, _ := alone(t, small+" --batch_size 4 --accum_steps 2")
	if d := maxDiff(t, ref, rank0Only); d < 100*tolerance {
		t.Errorf("one process on rank 0's data only is within %g of the global batch's run: the test cannot tell", d)
	}
}

// TestRanksInProcess: 2 ranks as goroutines over gloo, with and without NoSync
// accumulation and with one bucket or many, end bit-identical and within tolerance of one
// process with the global batch of 16.
func TestRanksInProcess(t *testing.T) {
	ref, _ := alone(t, small+" --batch_size 16")
	for _, args := range []string{
		"--batch_size 8",
		"--batch_size 8 --bucket_cap_mb 0.0001 --first_bucket_cap_mb 0.0001",
		"--batch_size 2 --accum_steps 4 --bucket_cap_mb 0.0002 --first_bucket_cap_mb 0.0001",
	} {
		t.Run(args, func(t *testing.T) {
			ps := trainRanks(t, 2, small+" "+args)
			if maxDiff(t, ps[0], ps[1]) != 0 {
				t.Errorf("ranks differ")
			}
			if d := maxDiff(t, ref, ps[0]); d > tolerance {
				t.Errorf("max |Δparam| vs one process = %g > %g", d, tolerance)
			}
		})
	}
}

// trainRanks trains size ranks as goroutines over one gloo group and returns each rank's
// final parameters.
func trainRanks(t *testing.T, size int, args string) [][]float32 {
	t.Helper()
	f := mustParse(t, args)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	store := procgroup.NewMemStore()
	defer store.Close()
	params := make([][]float32, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range size {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pg, err := procgroup.New(ctx, "gloo", procgroup.Options{Rank: r, Size: size, Store: store, Token: "test-token"})
			if err != nil {
				errs[r] = err
				return
			}
			defer pg.Close()
			m, err := train(ctx, f, pg, &bytes.Buffer{})
			if err != nil {
				pg.Abort(err)
				errs[r] = err
				return
			}
			params[r] = m.flat()
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return params
}

// buildDDPRun builds the real ddprun into a temporary folder.
func buildDDPRun(t *testing.T) string { return launchtest.DDPRun(t) }

// ddprunTrainer runs n ranks of this trainer (this test binary) under ddprun with args, and
// returns each rank's last line of stdout ("rank0" → line), and its stdout and stderr.
func ddprunTrainer(t *testing.T, ddprun string, n int, args string) (last map[string]string, stdout, stderr string, err error) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return launchtest.Ranks(t, ddprun, n, exe, []string{asMainEnv + "=1"}, 2*time.Minute, args)
}

// shardArgs: 6 logical shards of 4 samples (a global batch of 24), buckets of about 100
// bytes (so that each step gathers several), 8 steps.
const shardArgs = "--hidden_size 16 --steps 8 --log_every 7 --lr 0.3 --global_batch_size 24 --micro_batch_size 4 --bucket_cap_mb 0.0001 --first_bucket_cap_mb 0.0001"

// TestShardsSameBitsAtEveryWorldSize launches this trainer under the real ddprun with 6
// logical shards at world sizes 1, 2, 3 and 6, and checks that every rank of every run
// ends with one params_crc32 and prints the same losses, and that it is the crc of one
// process (--no_ddp) that runs the 6 shards and sums their gradients in shard order itself.
// The same global batch with today's all-reduce (3 ranks, --batch_size 4 --accum_steps 2:
// the same samples in each step) ends with another crc, so the comparison can tell.
func TestShardsSameBitsAtEveryWorldSize(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	ddprun := buildDDPRun(t)
	var out bytes.Buffer
	m, err := train(context.Background(), mustParse(t, shardArgs+" --no_ddp"), nil, &out)
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("params_crc32=%08x", crc32.ChecksumIEEE(paramBytes(m.flat())))
	losses := strings.TrimSpace(out.String())
	for _, n := range []int{1, 2, 3, 6} {
		last, stdout, stderr, err := ddprunTrainer(t, ddprun, n, shardArgs)
		if err != nil {
			t.Fatalf("world %d: ddprun: %v\nstdout:\n%s\nstderr:\n%s", n, err, stdout, stderr)
		}
		if len(last) != n {
			t.Fatalf("world %d: last lines of %d ranks: %q", n, len(last), last)
		}
		for rank, line := range last {
			if line != want {
				t.Errorf("world %d: %s ends with %q; one process with the same 6 shards: %q", n, rank, line, want)
			}
		}
		for _, l := range strings.Split(losses, "\n") {
			if !strings.Contains(stdout, "[rank0]: "+l+"\n") {
				t.Errorf("world %d: rank 0 does not print the one process's %q:\n%s", n, l, stdout)
			}
		}
	}
	last, stdout, stderr, err := ddprunTrainer(t, ddprun, 3, strings.ReplaceAll(shardArgs, "--global_batch_size 24 --micro_batch_size 4", "--batch_size 4 --accum_steps 2"))
	if err != nil {
		t.Fatalf("today's all-reduce: ddprun: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	if last["rank0"] == want || !strings.HasPrefix(last["rank0"], "params_crc32=") {
		t.Errorf("today's all-reduce over 3 ranks ends with %q, the shards' crc %q: the comparison cannot tell\nstdout:\n%s", last["rank0"], want, stdout)
	}
}

// TestShardsWorldSizeRefused: 4 ranks cannot share 6 shards; every rank fails at start
// with an error that says which world sizes work.
func TestShardsWorldSizeRefused(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	_, stdout, stderr, err := ddprunTrainer(t, buildDDPRun(t), 4, shardArgs)
	const msg = "mlp: --global_batch_size 24 / --micro_batch_size 4: ddp: invalid argument: Options.Shards: 6 shards cannot be spread over a world of 4 ranks: every rank runs the same number of shards, so the world size must divide 6; world sizes that work: 1, 2, 3, 6"
	if err == nil || !strings.Contains(stdout+stderr, msg) || strings.Contains(stdout, "params_crc32=") {
		t.Fatalf("ddprun: %v, want a failure saying %q\nstdout:\n%s\nstderr:\n%s", err, msg, stdout, stderr)
	}
}

func goTool() string { return launchtest.GoTool() }

// TestShardFlags: --global_batch_size and --micro_batch_size are checked together, and
// refuse --batch_size and --accum_steps beside them.
func TestShardFlags(t *testing.T) {
	if f := mustParse(t, "--global_batch_size 24 --micro_batch_size 4"); f.shards() != 6 {
		t.Errorf("24 / 4: %d shards", f.shards())
	}
	if f := mustParse(t, "--batch_size 4"); f.shards() != 0 {
		t.Errorf("without --global_batch_size: %d shards", f.shards())
	}
	for args, want := range map[string]string{
		"--global_batch_size 24":                                      "--global_batch_size 24, --micro_batch_size 0: want both positive",
		"--micro_batch_size 4":                                        "--global_batch_size 0, --micro_batch_size 4: want both positive",
		"--global_batch_size 25 --micro_batch_size 4":                 "the global batch a multiple of the micro-batch",
		"--global_batch_size 24 --micro_batch_size 4 --batch_size 8":  "drop --batch_size and --accum_steps",
		"--global_batch_size 24 --micro_batch_size 4 --accum_steps 2": "drop --batch_size and --accum_steps",
	} {
		if _, err := parseFlags(strings.Fields(args), &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error saying %q", args, err, want)
		}
	}
}

// TestNonFiniteNamedUnderDDPRun launches 2 ranks of this trainer under the real ddprun with
// a NaN put into rank 1's gradient of w2 (parameter 2) at step 5, with NoSync micro-batches
// and with logical shards: every rank prints the same error naming rank 1, step 5 and the
// parameter, the job exits non-zero, and no rank went on training (no loss after step 4,
// none of them NaN, no params_crc32). Without the check the job trains on with NaN losses
// and exits 0.
func TestNonFiniteNamedUnderDDPRun(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	ddprun := buildDDPRun(t)
	const want = "mlp: reducer: step 5: non-finite local gradient: rank 1: parameter 2 (w2)"
	for _, args := range []string{
		"--hidden_size 16 --steps 12 --log_every 1 --batch_size 4 --accum_steps 2 --bucket_cap_mb 0.0001 --first_bucket_cap_mb 0.0001 --inject_nan 1:5:w2",
		"--hidden_size 16 --steps 12 --log_every 1 --global_batch_size 8 --micro_batch_size 2 --inject_nan 1:5:2",
	} {
		_, stdout, stderr, err := ddprunTrainer(t, ddprun, 2, args)
		if err == nil {
			t.Errorf("%s: ddprun exited 0, want the job to fail", args)
		}
		for _, rank := range []string{"[rank0]: ", "[rank1]: "} {
			if !strings.Contains(stderr, rank+want+"\n") {
				t.Errorf("%s: %sdoes not say %q\nstderr:\n%s", args, rank, want, stderr)
			}
		}
		var steps []string
		for _, line := range strings.Split(stdout, "\n") {
			if _, rest, ok := strings.Cut(line, "]: "); ok && strings.HasPrefix(rest, "step ") {
				var step int
				var loss float64
				if _, err := fmt.Sscanf(rest, "step %d loss %g", &step, &loss); err != nil || math.IsNaN(loss) || math.IsInf(loss, 0) {
					t.Errorf("%s: %q", args, line)
				}
				steps = append(steps, fmt.Sprint(step))
			}
		}
		if got := strings.Join(steps, " "); got != "0 1 2 3 4" || strings.Contains(stdout, "params_crc32") {
			t.Errorf("%s: losses of steps %q, want 0 to 4 only, and no params_crc32\nstdout:\n%s", args, got, stdout)
		}
	}
}

// TestInjectNaNFlag: --inject_nan takes RANK:STEP:PARAM, the parameter by index or name.
func TestInjectNaNFlag(t *testing.T) {
	for args, want := range map[string]injection{
		"--inject_nan 1:5:2":  {on: true, rank: 1, step: 5, param: 2},
		"--inject_nan 0:0:w1": {on: true, rank: 0, step: 0, param: 0},
		"--inject_nan 3:7:b2": {on: true, rank: 3, step: 7, param: 3},
		"":                    {},
	} {
		if f := mustParse(t, args); f.inject != want {
			t.Errorf("%q: %+v, want %+v", args, f.inject, want)
		}
	}
	for _, v := range []string{"1:5", "1:5:2:0", "x:5:2", "1:-1:2", "-1:5:2", "1:5:4", "1:5:w9", "1:5:"} {
		_, err := parseFlags([]string{"--inject_nan", v}, &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), "inject_nan") || !strings.Contains(err.Error(), "want RANK:STEP:PARAM") {
			t.Errorf("--inject_nan %s: %v, want an error naming the flag and its form", v, err)
		}
	}
}

// TestCommHookFlag launches this trainer under the real ddprun on 2 ranks with each
// --comm_hook: every rank ends with the same params_crc32, the loss falls to under a
// quarter of its first value, and the compressed runs end elsewhere than the plain
// all-reduce (the flag reaches the hook). PowerSGD also runs with NoSync micro-batches,
// and with a bucket per parameter.
func TestCommHookFlag(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	ddprun := buildDDPRun(t)
	const base = "--hidden_size 32 --steps 200 --log_every 199 --lr 0.3"
	crcs := map[string]string{}
	for _, hook := range []string{"none", "bf16", "powersgd --powersgd_rank 1", "powersgd --powersgd_rank 2 --powersgd_min_compression_rate 1", "powersgd --powersgd_rank 1 --accum_steps 2 --batch_size 8", "powersgd --powersgd_rank 1 --bucket_cap_mb 0.0001 --first_bucket_cap_mb 0.0001"} {
		last, stdout, stderr, err := ddprunTrainer(t, ddprun, 2, base+" --comm_hook "+hook)
		if err != nil {
			t.Fatalf("%s: ddprun: %v\nstdout:\n%s\nstderr:\n%s", hook, err, stdout, stderr)
		}
		if last["rank0"] != last["rank1"] || !strings.HasPrefix(last["rank0"], "params_crc32=") {
			t.Fatalf("%s: the ranks end with %q and %q\nstdout:\n%s", hook, last["rank0"], last["rank1"], stdout)
		}
		crcs[hook] = last["rank0"]
		var first, final float64
		if _, err := fmt.Sscanf(stdout[strings.Index(stdout, "step 0 loss"):], "step 0 loss %g", &first); err != nil {
			t.Fatalf("%s: no first loss: %v\n%s", hook, err, stdout)
		}
		if _, err := fmt.Sscanf(stdout[strings.Index(stdout, "step 199 loss"):], "step 199 loss %g", &final); err != nil {
			t.Fatalf("%s: no last loss: %v\n%s", hook, err, stdout)
		}
		t.Logf("%s: loss %v → %v, %s", hook, first, final, last["rank0"])
		if !(final < first/4) {
			t.Errorf("%s: loss %v → %v", hook, first, final)
		}
		if hook != "none" && crcs[hook] == crcs["none"] {
			t.Errorf("%s ends with the plain all-reduce's %s: the hook did not run", hook, crcs[hook])
		}
	}
	// auto, on one host: it measures three steps and keeps the plain all-reduce, whose two
	// ranks' sums have the same bits whatever the bucket layout.
	last, stdout, stderr, err := ddprunTrainer(t, ddprun, 2, base+" --comm_hook auto")
	if err != nil {
		t.Fatalf("auto: ddprun: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	if last["rank0"] != crcs["none"] || last["rank1"] != crcs["none"] {
		t.Errorf("auto ends with %q and %q, want the plain all-reduce's %s\nstdout:\n%s", last["rank0"], last["rank1"], crcs["none"], stdout)
	}
	if !strings.Contains(stdout, "auto hook after 3 synced steps, with the caps as set") || !strings.Contains(stdout, "; hooks none ×1: predicted") {
		t.Errorf("auto: no plan keeping the plain all-reduce in\n%s", stdout)
	}
	_, err = parseFlags([]string{"--comm_hook", "powersdg"}, io.Discard)
	if want := `--comm_hook: ddp: invalid argument: comm hook "powersdg", want one of none, fp16, bf16, powersgd, auto`; err == nil || err.Error() != want {
		t.Errorf("--comm_hook powersdg: %v, want %q", err, want)
	}
}

// TestUnevenStepsUnderDDPRun launches 3 ranks of this trainer under the real ddprun with
// --steps_per_rank 0,3,5: rank 0 has no data at all, rank 1 three steps, rank 2 five. The
// job finishes (without Join, rank 0 would leave at once and its peers fail with peer
// lost), every rank ends with the same params_crc32, and that is not the crc of the
// initial parameters (the steps did change them).
func TestUnevenStepsUnderDDPRun(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	const args = "--hidden_size 16 --log_every 0 --steps_per_rank 0,3,5 --bucket_cap_mb 0.0001 --first_bucket_cap_mb 0.0001"
	ddprun := buildDDPRun(t)
	last, stdout, stderr, err := ddprunTrainer(t, ddprun, 3, args)
	if err != nil {
		t.Fatalf("ddprun: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	p0, _ := alone(t, "--hidden_size 16 --steps 0 --log_every 0")
	initial := fmt.Sprintf("params_crc32=%08x", crc32.ChecksumIEEE(paramBytes(p0)))
	for r := range 3 {
		got := last[fmt.Sprint("rank", r)]
		if !strings.HasPrefix(got, "params_crc32=") || got != last["rank0"] {
			t.Fatalf("rank %d ends with %q, rank 0 with %q, want the same params_crc32\nstdout:\n%s", r, got, last["rank0"], stdout)
		}
		if got == initial {
			t.Fatalf("rank %d ends with the initial parameters' %s", r, got)
		}
	}
}
