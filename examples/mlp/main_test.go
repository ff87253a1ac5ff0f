package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goddp/goddp/procgroup"
)

// asMainEnv makes the test binary act as the trainer (TestDDPRunEqualsOneProcess launches
// it under ddprun).
const asMainEnv = "GODDP_MLP_TEST_AS_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(asMainEnv) == "1" {
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
	ddprun := filepath.Join(dir, "ddprun")
	if out, err := exec.Command(goTool(), "build", "-o", ddprun, "github.com/goddp/goddp/cmd/ddprun").CombinedOutput(); err != nil {
		t.Fatalf("building ddprun: %v\n%s", err, out)
	}
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

func goTool() string {
	if p := filepath.Join(os.Getenv("GOROOT"), "bin", "go"); os.Getenv("GOROOT") != "" {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return "go"
}
