package main

import (
	"context"
	"fmt"
	"math"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goddp/goddp/internal/gpufake"
	"github.com/goddp/goddp/procgroup"
)

// The tests run the trainer on the fake CUDA driver, NCCL and cuBLAS (internal/gpufake):
// the whole GPU path, stream order included, on the CPU. Ranks are goroutines, each with
// its own nccl group on its own fake device, wrapped in the watchdog as
// ddp.InitProcessGroup does.

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "goddp-gpumlp-fakes-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	libs, err := gpufake.Build(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	libs.Setenv()
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) {
		os.RemoveAll(dir)
		os.Exit(code)
	}))
}

var prefixN atomic.Int64

// trainRanks trains n ranks of args and returns each rank's result.
func trainRanks(t *testing.T, n int, args string) []*result {
	t.Helper()
	f, err := parseFlags(strings.Fields(args), os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	store := procgroup.NewMemStore()
	defer store.Close()
	prefix := fmt.Sprintf("mlp%d", prefixN.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res := make([]*result, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Go(func() {
			pg, err := procgroup.New(ctx, "nccl", procgroup.Options{Rank: r, Size: n, LocalRank: r, LocalSize: n, Store: store, Prefix: prefix})
			if err != nil {
				errs[r] = err
				return
			}
			wd, err := procgroup.WithWatchdog(pg, procgroup.PrefixStore{Prefix: prefix + "/wd", Store: store}, procgroup.WatchdogOptions{Timeout: time.Minute})
			if err != nil {
				pg.Abort(err)
				errs[r] = err
				return
			}
			res[r], errs[r] = train(ctx, wd, f, nil)
			if cerr := wd.Close(); errs[r] == nil {
				errs[r] = cerr
			}
		})
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("%s: world size %d rank %d: %v", args, n, r, err)
		}
	}
	return res
}

// reference trains the same model on the host in float64, one process, the whole global
// batch per step: the result computed another way.
func reference(f *flags) [][]float64 {
	xs, ts := data(f)
	init := initParams(f)
	w := make([][]float64, len(init))
	for p, v := range init {
		w[p] = make([]float64, len(v))
		for k, x := range v {
			w[p][k] = float64(x)
		}
	}
	in, hid, out, b := f.in, f.hidden, f.out, f.batch
	batches := f.samples / b
	for step := 0; step < f.steps; step++ {
		row := (step % batches) * b
		g := make([][]float64, len(w))
		for p := range w {
			g[p] = make([]float64, len(w[p]))
		}
		for s := row; s < row+b; s++ {
			h := make([]float64, hid)
			for j := range h {
				v := w[1][j]
				for i := 0; i < in; i++ {
					v += float64(xs[s*in+i]) * w[0][i*hid+j]
				}
				h[j] = math.Max(v, 0)
			}
			dy := make([]float64, out)
			for o := range dy {
				v := w[3][o]
				for j := range h {
					v += h[j] * w[2][j*out+o]
				}
				dy[o] = (v - float64(ts[s*out+o])) / float64(b)
			}
			for o := range dy {
				g[3][o] += dy[o]
				for j := range h {
					g[2][j*out+o] += h[j] * dy[o]
				}
			}
			for j := range h {
				if h[j] <= 0 {
					continue
				}
				dh := 0.0
				for o := range dy {
					dh += dy[o] * w[2][j*out+o]
				}
				g[1][j] += dh
				for i := 0; i < in; i++ {
					g[0][i*hid+j] += float64(xs[s*in+i]) * dh
				}
			}
		}
		for p := range w {
			for k := range w[p] {
				w[p][k] -= f.lr * g[p][k]
			}
		}
	}
	return w
}

const tinyArgs = "--in 8 --hidden 32 --out 4 --batch 24 --samples 96 --steps 12 --lr 0.05 --bucket_cap_mb 0.001"

// TestDDPEquivalence: the DDP run at world sizes 1 to 4 (each rank 24/n samples of every
// global batch of 24, gradients averaged in device buckets) ends with the parameters of
// the one-process big-batch run (world size 1) within 2e-5·(1+|p|), and both with the
// float64 host reference within 1e-4·(1+|p|), element by element; every rank holds the
// same parameters, bit for bit. With and without GradientAsBucketView.
func TestDDPEquivalence(t *testing.T) {
	for _, view := range []string{"", " --gradient_as_bucket_view"} {
		args := tinyArgs + view
		f, _ := parseFlags(strings.Fields(args), os.Stderr)
		ref := reference(f)
		one := trainRanks(t, 1, args)[0]
		for n := 1; n <= 4; n++ {
			res := trainRanks(t, n, args)
			maxRef, maxOne := 0.0, 0.0
			for r := range res {
				for p := range ref {
					for k, want := range ref[p] {
						got := float64(res[r].params[p][k])
						if d := math.Abs(got - want); d > 1e-4*(1+math.Abs(want)) {
							t.Fatalf("%s: world size %d rank %d param %d [%d] = %v, float64 reference %v", args, n, r, p, k, got, want)
						} else {
							maxRef = max(maxRef, d)
						}
						o := float64(one.params[p][k])
						if d := math.Abs(got - o); d > 2e-5*(1+math.Abs(o)) {
							t.Fatalf("%s: world size %d rank %d param %d [%d] = %v, one-process big batch %v", args, n, r, p, k, got, o)
						} else {
							maxOne = max(maxOne, d)
						}
						if g0 := res[0].params[p][k]; res[r].params[p][k] != g0 {
							t.Fatalf("world size %d: rank %d param %d [%d] = %v, rank 0 has %v", n, r, p, k, res[r].params[p][k], g0)
						}
					}
				}
			}
			t.Logf("world size %d%s: max |DDP − one process| %.3g, max |DDP − float64 reference| %.3g", n, view, maxOne, maxRef)
		}
	}
}

// TestTrainingLearns: the loss falls (a sanity check that the model trains at all).
func TestTrainingLearns(t *testing.T) {
	first := trainRanks(t, 2, strings.Replace(tinyArgs, "--steps 12", "--steps 1", 1))[0].loss
	last := trainRanks(t, 2, strings.Replace(tinyArgs, "--steps 12", "--steps 60", 1))[0].loss
	if !(last < 0.7*first) {
		t.Fatalf("loss %v after 1 step, %v after 60: not learning", first, last)
	}
}

// TestBadFlags: clear errors for a batch that does not divide, and a host backend.
func TestBadFlags(t *testing.T) {
	if _, err := parseFlags(strings.Fields("--batch 10 --samples 15"), os.Stderr); err == nil || !strings.Contains(err.Error(), "multiple of --batch") {
		t.Fatalf("--samples not a multiple of --batch: %v", err)
	}
	f, _ := parseFlags(strings.Fields("--backend gloo"), os.Stderr)
	store := procgroup.NewMemStore()
	defer store.Close()
	if _, err := train(context.Background(), hostGroup{}, f, nil); err == nil || !strings.Contains(err.Error(), "no GPU") {
		t.Fatalf("host group: %v", err)
	}
}

// hostGroup is a one-rank group without a device.
type hostGroup struct{ procgroup.ProcessGroup }

func (hostGroup) Size() int { return 1 }
func (hostGroup) Rank() int { return 0 }
