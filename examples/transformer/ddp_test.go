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
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/goddp/goddp/bucket/sim"
	"github.com/goddp/goddp/ddp/optim"
	"github.com/goddp/goddp/examples/transformer/model"
	"github.com/goddp/goddp/internal/launchtest"
	"github.com/goddp/goddp/procgroup"
)

// The DDP tests run tiny models (tinyFlags without --no_ddp) so that they stay fast under
// -race. Ranks are goroutines over a real gloo group (sockets, MemStore), except in
// TestDDPRunEndToEnd, which goes through the built ddprun, its gRPC store and processes.

const tinyDDPFlags = "--num_layers 1 --hidden_size 16 --seq_len 4 --log_every 1 --lr 1e-3"

var prefixN sync.Mutex
var prefixCount int

// trainRanks trains size ranks of args as goroutines over one gloo group and returns each
// rank's final parameters and output.
func trainRanks(t *testing.T, size int, args string) ([][]float32, []string) {
	t.Helper()
	return trainRanksWith(t, size, args, nil)
}

// trainRanksWith is trainRanks with each rank's flags passed through edit first.
func trainRanksWith(t *testing.T, size int, args string, edit func(rank int, pg procgroup.ProcessGroup, f *flags)) ([][]float32, []string) {
	t.Helper()
	params, out, errs := runRanks(t, size, args, edit)
	for r := range size {
		if errs[r] != nil {
			t.Fatalf("%s: rank %d: %v\n%s", args, r, errs[r], out[r])
		}
	}
	return params, out
}

// runRanks runs the ranks and returns each one's parameters, output and error.
func runRanks(t *testing.T, size int, args string, edit func(rank int, pg procgroup.ProcessGroup, f *flags)) ([][]float32, []string, []error) {
	t.Helper()
	f0, err := parseFlags(strings.Fields(args), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	store := procgroup.NewMemStore()
	defer store.Close()
	prefixN.Lock()
	prefixCount++
	prefix := fmt.Sprintf("t%d", prefixCount)
	prefixN.Unlock()

	params := make([][]float32, size)
	outs := make([]bytes.Buffer, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range size {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pg, err := procgroup.New(ctx, "gloo", procgroup.Options{
				Rank: r, Size: size, Store: store, Prefix: prefix, Token: "test-token", Timeout: time.Minute,
			})
			if err != nil {
				errs[r] = err
				return
			}
			f := f0
			if edit != nil {
				edit(r, pg, &f)
			}
			m, err := model.New(modelConfig(f))
			if err == nil {
				err = trainWith(ctx, f, m, pg, zap.NewNop(), &outs[r])
			}
			if err != nil {
				pg.Abort(err)
				errs[r] = err
			} else {
				params[r] = append([]float32(nil), m.Data32()...)
			}
			if err := pg.Close(); err != nil && errs[r] == nil {
				errs[r] = err
			}
		}()
	}
	wg.Wait()
	out := make([]string, size)
	for r := range size {
		out[r] = outs[r].String()
	}
	return params, out, errs
}

var crcRE = regexp.MustCompile(`(?m)^params_crc32=([0-9a-f]{8})$`)

// lastCRC returns the params_crc32 of the output's last line, failing if it is not last.
func lastCRC(t *testing.T, out string) string {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	m := crcRE.FindStringSubmatch(lines[len(lines)-1])
	if m == nil {
		t.Fatalf("last line %q is not params_crc32=<8 hex>:\n%s", lines[len(lines)-1], out)
	}
	return m[1]
}

// TestDDPEqualsBigBatch: 2 ranks with batch 2 end with the parameters of one --no_ddp
// process with batch 4 on the same data, for bucket caps that give many buckets, a few,
// and one; the ranks agree bit for bit.
func TestDDPEqualsBigBatch(t *testing.T) {
	steps := " --warmup_steps 1 --bench_steps 3"
	ref, _ := trainArgs(t, tinyFlags+" --batch_size 4"+steps)
	bucketsRE := regexp.MustCompile(`(?m)^overlap: buckets=(\d+) `)
	for _, c := range []struct {
		cap        string
		minBuckets int
		maxBuckets int
	}{
		{"0.001", 5, 1000}, // ~1 KB: the tiny model (~14 KB) in several buckets
		{"0.005", 2, 5},
		{"25", 1, 1},
	} {
		t.Run("cap="+c.cap, func(t *testing.T) {
			ps, outs := trainRanks(t, 2, tinyDDPFlags+" --batch_size 2"+steps+
				" --bucket_cap_mb "+c.cap+" --first_bucket_cap_mb "+c.cap)
			if !strings.HasPrefix(outs[0], "Model: ") || !strings.Contains(outs[0], "bucket_cap_mb="+c.cap+"  ms/step=") {
				t.Errorf("rank 0 output:\n%s", outs[0])
			}
			if strings.Contains(outs[1], "loss") || strings.Contains(outs[1], "Model:") {
				t.Errorf("rank 1 prints rank 0's lines:\n%s", outs[1])
			}
			m := bucketsRE.FindStringSubmatch(outs[0])
			if m == nil {
				t.Fatalf("no overlap line:\n%s", outs[0])
			}
			var nb int
			fmt.Sscan(m[1], &nb)
			if nb < c.minBuckets || nb > c.maxBuckets {
				t.Errorf("%d buckets, want %d..%d", nb, c.minBuckets, c.maxBuckets)
			}
			if a, b := lastCRC(t, outs[0]), lastCRC(t, outs[1]); a != b {
				t.Errorf("ranks' params_crc32 differ: %s vs %s", a, b)
			}
			for i := range ps[0] {
				if ps[0][i] != ps[1][i] {
					t.Fatalf("replicas differ at element %d: %v vs %v", i, ps[0][i], ps[1][i])
				}
			}
			assertClose(t, "2 ranks × batch 2 vs --no_ddp batch 4, cap "+c.cap, ref, ps[0])
		})
	}
}

// TestAutoBuckets: with --bucket_cap_mb auto the 2 ranks still end with the parameters of
// one --no_ddp process on the global batch, the same on both, rank 0 prints the plan, and
// --auto_profile holds a profile the simulator accepts.
func TestAutoBuckets(t *testing.T) {
	steps := " --warmup_steps 1 --bench_steps 3" // the decision comes after step 3 of 4
	ref, _ := trainArgs(t, tinyFlags+" --batch_size 4"+steps)
	prof := filepath.Join(t.TempDir(), "auto.json") // train, as here, skips run's checkOutputs, which makes the folder
	ps, outs := trainRanks(t, 2, tinyDDPFlags+" --batch_size 2"+steps+" --bucket_cap_mb auto --auto_profile "+prof)
	for _, want := range []string{"bucket_cap_mb=auto  ms/step=", "auto bucket layout after 3 synced steps: first cap "} {
		if !strings.Contains(outs[0], want) {
			t.Errorf("rank 0 output lacks %q:\n%s", want, outs[0])
		}
	}
	for i := range ps[0] {
		if ps[0][i] != ps[1][i] {
			t.Fatalf("replicas differ at element %d: %v vs %v", i, ps[0][i], ps[1][i])
		}
	}
	assertClose(t, "auto buckets: 2 ranks × batch 2 vs --no_ddp batch 4", ref, ps[0])
	b, err := os.ReadFile(prof)
	if err != nil {
		t.Fatal(err)
	}
	var p sim.Profile
	if err := json.Unmarshal(b, &p); err != nil {
		t.Fatal(err)
	}
	if err := p.Check(); err != nil || len(p.Params) == 0 || p.World != 2 || len(p.Comm.Points) == 0 {
		t.Errorf("--auto_profile: %v; %d params, world %d, %d all-reduce points", err, len(p.Params), p.World, len(p.Comm.Points))
	}
}

// TestDDPGradsAreAverages: after each synced step every rank holds the gradient of the
// global batch, which is the mean (not the sum) of the ranks' gradients: compared element
// by element with --no_ddp on the global batch. (The parameter tests cannot tell a mean
// from a sum: Adam is invariant to the gradients' scale.)
func TestDDPGradsAreAverages(t *testing.T) {
	const steps = 2
	args := " --warmup_steps 0 --bench_steps 2"
	f, err := parseFlags(strings.Fields(tinyFlags+" --batch_size 4"+args), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	var want [steps][]float32
	f.onGrads = func(step int, g []float32) { want[step] = append([]float32(nil), g...) }
	if _, err := train(context.Background(), f, &bytes.Buffer{}, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	var got [2][steps][]float32
	trainRanksWith(t, 2, tinyDDPFlags+" --batch_size 2 --bucket_cap_mb 0.002 --first_bucket_cap_mb 0.002"+args,
		func(rank int, _ procgroup.ProcessGroup, f *flags) {
			f.onGrads = func(step int, g []float32) { got[rank][step] = append([]float32(nil), g...) }
		})
	for step := range steps {
		if len(want[step]) == 0 {
			t.Fatalf("step %d: --no_ddp run reported no gradients", step)
		}
		var scale float64
		for _, g := range want[step] {
			scale = math.Max(scale, math.Abs(float64(g)))
		}
		for r := range 2 {
			if len(got[r][step]) != len(want[step]) {
				t.Fatalf("rank %d step %d: %d gradients, want %d", r, step, len(got[r][step]), len(want[step]))
			}
			for i, g := range got[r][step] {
				// float32 sums in another order: relative to the largest gradient.
				if d := math.Abs(float64(g - want[step][i])); d > 1e-5*scale {
					t.Fatalf("rank %d step %d grad %d: %v, --no_ddp batch 4: %v (max |g| %g)", r, step, i, g, want[step][i], scale)
				}
			}
		}
	}
}

// TestDDPAccum: 2 ranks × 4 micro-batches (3 under NoSync) × batch 1 give the parameters
// of one process with batch 8, and of the same 2 ranks without accumulation at batch 4.
func TestDDPAccum(t *testing.T) {
	steps := " --warmup_steps 0 --bench_steps 4"
	ref, _ := trainArgs(t, tinyFlags+" --batch_size 8"+steps)
	ps, outs := trainRanks(t, 2, tinyDDPFlags+" --batch_size 1 --accum_steps 4 --bucket_cap_mb 0.004 --first_bucket_cap_mb 0.004"+steps)
	if a, b := lastCRC(t, outs[0]), lastCRC(t, outs[1]); a != b {
		t.Errorf("ranks' params_crc32 differ: %s vs %s", a, b)
	}
	assertClose(t, "2 ranks × accum 4 × batch 1 vs --no_ddp batch 8", ref, ps[0])
}

// TestDDPLossMatchesBigBatch: the loss rank 0 prints is the global batch's.
func TestDDPLossMatchesBigBatch(t *testing.T) {
	steps := " --warmup_steps 0 --bench_steps 1"
	_, ref := trainArgs(t, tinyFlags+" --batch_size 4"+steps)
	_, outs := trainRanks(t, 2, tinyDDPFlags+" --batch_size 2"+steps)
	lossRE := regexp.MustCompile(`(?m)^step 0 loss ([0-9.]+)$`)
	a, b := lossRE.FindStringSubmatch(ref), lossRE.FindStringSubmatch(outs[0])
	if a == nil || b == nil {
		t.Fatalf("no step 0 loss:\n%s\n%s", ref, outs[0])
	}
	var la, lb float64
	fmt.Sscan(a[1], &la)
	fmt.Sscan(b[1], &lb)
	if d := la - lb; d > 1e-5 || d < -1e-5 {
		t.Fatalf("step 0 loss: ddp %v, --no_ddp on the global batch %v", lb, la)
	}
}

// TestDDPRunEndToEnd launches 2 ranks (this test binary acting as the trainer) under the
// real ddprun: its gRPC store, the job token, the environment, gloo over sockets. Both ranks
// must print the same params_crc32, and the checkpointed parameters must equal a --no_ddp
// run on the global batch.
func TestDDPRunEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	dir := t.TempDir()
	ddprun := launchtest.DDPRun(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ckpt := filepath.Join(dir, "ckpt")
	steps := " --warmup_steps 1 --bench_steps 3"
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, ddprun, append([]string{"--standalone", "--nproc_per_node", "2", exe, "--"},
		strings.Fields(tinyDDPFlags+" --batch_size 2 --bucket_cap_mb 0.002 --first_bucket_cap_mb 0.002 --checkpoint_dir "+ckpt+steps)...)...)
	cmd.Env = append(os.Environ(), asMainEnv+"=1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("ddprun: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	crcs := map[string]string{}
	for _, line := range strings.Split(stdout.String(), "\n") {
		for _, r := range []string{"0", "1"} {
			if rest, ok := strings.CutPrefix(line, "[rank"+r+"]: params_crc32="); ok {
				crcs[r] = rest
			}
		}
	}
	if len(crcs) != 2 || crcs["0"] != crcs["1"] {
		t.Fatalf("params_crc32 per rank %v:\n%s", crcs, stdout.String())
	}
	if !strings.Contains(stdout.String(), "[rank0]: Model: ") || !strings.Contains(stdout.String(), "[rank0]: bucket_cap_mb=0.002  ms/step=") {
		t.Errorf("rank 0's output:\n%s", stdout.String())
	}
	ref, _ := trainArgs(t, tinyFlags+" --batch_size 4"+steps)
	// Rank 0's checkpoint of step 4, read as a rank of a world of 2 would.
	f, err := parseFlags(strings.Fields(tinyDDPFlags+" --batch_size 2 --resume --checkpoint_dir "+ckpt), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	m, err := model.New(modelConfig(f))
	if err != nil {
		t.Fatal(err)
	}
	opt, err := optim.NewAdamW(m.NumParams(), optim.AdamWOptions{LR: f.lr})
	if err != nil {
		t.Fatal(err)
	}
	k, err := newCkpt(f, world{0, 2}, nil, m, opt, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	step, err := k.restore(context.Background(), f, world{0, 2})
	if optStep := *opt.State().Steps; err != nil || step != 4 || optStep != 4 {
		t.Fatalf("checkpoint of step 4: step %d, AdamW's step %d, %v", step, optStep, err)
	}
	got := m.Data32()
	if fmt.Sprintf("%08x", paramsCRC32(got)) != crcs["0"] {
		t.Errorf("checkpoint's crc %08x, printed %s", paramsCRC32(got), crcs["0"])
	}
	assertClose(t, "ddprun vs --no_ddp batch 4", ref, got)
}

// TestDDPPeerFailure: when one rank's group dies mid-training, every rank ends with an
// error (no hang) and the survivor's names the lost peer and the collective.
func TestDDPPeerFailure(t *testing.T) {
	dead := errors.New("test: rank 1 dies")
	_, outs, errs := runRanks(t, 2, tinyDDPFlags+" --batch_size 2 --warmup_steps 0 --bench_steps 20",
		func(rank int, pg procgroup.ProcessGroup, f *flags) {
			if rank == 1 {
				f.onGrads = func(step int, _ []float32) {
					if step == 2 {
						pg.Abort(dead)
					}
				}
			}
		})
	if errs[1] == nil || errs[0] == nil {
		t.Fatalf("errors %v; outputs:\n%s\n%s", errs, outs[0], outs[1])
	}
	if !errors.Is(errs[1], procgroup.ErrAborted) {
		t.Errorf("rank 1: %v, want ErrAborted", errs[1])
	}
	if !errors.Is(errs[0], procgroup.ErrPeerLost) && !errors.Is(errs[0], procgroup.ErrAborted) {
		t.Errorf("rank 0: %v, want ErrPeerLost or ErrAborted", errs[0])
	}
	for _, want := range []string{"step ", "rank 1", "allreduce"} {
		if !strings.Contains(errs[0].Error(), want) {
			t.Errorf("rank 0's error %q does not mention %q", errs[0], want)
		}
	}
	t.Logf("rank 0: %v\nrank 1: %v", errs[0], errs[1])
}
