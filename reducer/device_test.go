package reducer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goddp/goddp/backends/nccl"
	"github.com/goddp/goddp/internal/gpufake"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// The device path (Note [Device buckets]) over the nccl backend and the fake CUDA driver
// and NCCL of internal/gpufake (built in TestMain): "device memory" is host memory, each
// stream a thread running its queue in order, so stream order is real and can be held
// back (the fakes' gates).

var devPrefix atomic.Int64

// devWorld is one rank of a device test: the group as ddp.InitProcessGroup would give it
// (the backend inside the watchdog, and with debug also the debug wrapper), the nccl group
// underneath and a compute stream.
type devWorld struct {
	pg     procgroup.ProcessGroup
	g      *nccl.Group
	stream procgroup.Stream
}

// startDevice starts n nccl ranks on the fakes, wrapped, each with a compute stream. A
// cleanup closes them.
func startDevice(t *testing.T, n int, debug bool) []devWorld {
	t.Helper()
	store := procgroup.NewMemStore()
	prefix := fmt.Sprintf("dev%d", devPrefix.Add(1))
	ws := make([]devWorld, n)
	errs := runRanks(n, func(r int) error {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		pg, err := procgroup.New(ctx, "nccl", procgroup.Options{Rank: r, Size: n, LocalRank: r, LocalSize: n, Store: store, Prefix: prefix})
		if err != nil {
			return err
		}
		ws[r].g = pg.(*nccl.Group)
		if debug {
			if pg, err = procgroup.WithDebug(pg, procgroup.DebugOptions{}); err != nil {
				return err
			}
		}
		if pg, err = procgroup.WithWatchdog(pg, procgroup.PrefixStore{Prefix: prefix + "/wd", Store: store}, procgroup.WatchdogOptions{Timeout: time.Minute}); err != nil {
			return err
		}
		ws[r].pg = pg
		ws[r].stream, err = ws[r].g.NewStream()
		return err
	})
	t.Cleanup(func() {
		for _, w := range ws {
			if w.g != nil && w.stream != 0 {
				w.g.DestroyStream(w.stream)
			}
		}
		runRanks(n, func(r int) error {
			if ws[r].pg != nil {
				return ws[r].pg.Close()
			} else if ws[r].g != nil {
				ws[r].g.Abort(nil)
			}
			return nil
		})
		store.Close()
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return ws
}

// upload returns a device copy of v on s (a host synchronisation: test set-up only).
func upload(t *testing.T, g *nccl.Group, s procgroup.Stream, v []float32) procgroup.DeviceBuffer {
	t.Helper()
	d, err := g.Alloc(procgroup.Float32, len(v))
	if err != nil {
		t.Fatal(err)
	}
	d.Stream = s
	t.Cleanup(func() { g.Free(d) })
	if err := g.CopyIn(d, v); err != nil {
		t.Fatal(err)
	}
	return d
}

func download(g *nccl.Group, d procgroup.DeviceBuffer, s procgroup.Stream) ([]float32, error) {
	out := make([]float32, d.Count)
	return out, g.CopyOut(out, d.On(s))
}

// TestDeviceEquivalence is TestEquivalence on the device path: N ranks (1 to 4) over the
// nccl backend, each with its shard of every batch, gradients in device memory reported
// with GradReadyDevice in a random order per rank and step; after Finalize the gradients
// read back on the compute stream equal the float64 gradient of the whole batch within
// 1e-5·(1+|ref|) (fp16/bf16 compression: 2e-3 and 2e-2 relative, plus the same absolute
// part), with and without GradientAsBucketView and a NoSync micro-step, with the debug
// wrapper too. Three steps, so the rebuilt layout is checked as well.
func TestDeviceEquivalence(t *testing.T) {
	rng := rand.New(rand.NewPCG(2026, 12))
	for n := 1; n <= 4; n++ {
		for _, view := range []bool{false, true} {
			for _, noSync := range []bool{false, true} {
				for _, hook := range []string{"allreduce", "fp16", "bf16"} {
					seed := rng.Uint64()
					debug := n == 2 && hook == "allreduce"
					name := fmt.Sprintf("n=%d/view=%v/nosync=%v/%s/seed=%d", n, view, noSync, hook, seed)
					t.Run(name, func(t *testing.T) { checkDeviceEquivalence(t, n, view, noSync, hook, debug, seed) })
				}
			}
		}
	}
}

func checkDeviceEquivalence(t *testing.T, n int, view, noSync bool, hook string, debug bool, seed uint64) {
	ctx := testCtx(t)
	rng := rand.New(rand.NewPCG(seed, 1))
	m := newModel(rng, 1+rng.IntN(10))
	capBytes := int64(4 * (1 + rng.IntN(120)))
	firstBytes := int64(4 * (1 + rng.IntN(120)))
	const steps, batch = 3, 12
	micro := 1
	if noSync {
		micro = 2
	}
	batches := make([][][]sample, steps)
	orders := make([][][][]int, steps)
	for s := range batches {
		batches[s] = make([][]sample, micro)
		orders[s] = make([][][]int, micro)
		for u := range batches[s] {
			batches[s][u] = randomBatch(rng, batch)
			orders[s][u] = make([][]int, n)
			for r := range orders[s][u] {
				orders[s][u][r] = rng.Perm(len(m.lens))
			}
		}
	}
	var commHook CommHook
	tol := 1e-5
	switch hook {
	case "fp16":
		commHook, tol = FP16CompressHook(), 2e-3
	case "bf16":
		commHook, tol = BF16CompressHook(), 2e-2
	}
	ws := startDevice(t, n, debug)
	got := make([][][][]float32, n)
	errs := runRanks(n, func(rank int) error {
		w := ws[rank]
		params := make([]Param, len(m.lens))
		grads := make([]procgroup.DeviceBuffer, len(m.lens)) // where "backward" leaves each gradient
		for p := range params {
			d, err := w.g.Alloc(procgroup.Float32, m.lens[p])
			if err != nil {
				return err
			}
			defer w.g.Free(d)
			grads[p] = d.On(w.stream)
			params[p] = Param{Name: fmt.Sprintf("w%d", p), DType: procgroup.Float32, Len: m.lens[p]}
			if !view {
				o, err := w.g.Alloc(procgroup.Float32, m.lens[p])
				if err != nil {
					return err
				}
				defer w.g.Free(o)
				params[p].Grad = o.On(w.stream)
			}
		}
		red, err := New(w.pg, params, Options{
			BucketCapMB: float64(capBytes) / (1 << 20), FirstBucketCapMB: float64(firstBytes) / (1 << 20),
			GradientAsBucketView: view, CommHook: commHook, Device: true, Stream: w.stream,
		})
		if err != nil {
			return err
		}
		defer red.Close()
		shard := batch / n
		for s := 0; s < steps; s++ {
			for u := 0; u < micro; u++ {
				mode := Sync
				if u < micro-1 {
					mode = Accumulate
				}
				if err := red.BeginBackward(mode); err != nil {
					return err
				}
				local := batches[s][u][rank*shard : (rank+1)*shard]
				for _, p := range orders[s][u][rank] {
					if err := w.g.CopyIn(grads[p], to32(m.meanGrad(p, local))); err != nil {
						return err
					}
					if err := red.GradReadyDevice(p, grads[p]); err != nil {
						return err
					}
				}
				if err := red.Finalize(ctx); err != nil {
					return err
				}
			}
			out := make([][]float32, len(params))
			for p := range params {
				src, _ := params[p].Grad.(procgroup.DeviceBuffer)
				if view {
					if src, err = red.GradViewDevice(p); err != nil {
						return err
					}
				}
				if out[p], err = download(w.g, src, w.stream); err != nil {
					return err
				}
			}
			got[rank] = append(got[rank], out)
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	for s := 0; s < steps; s++ {
		for p := range m.lens {
			ref := make([]float64, m.lens[p])
			for u := 0; u < micro; u++ {
				for k, v := range m.meanGrad(p, batches[s][u]) {
					ref[k] += v
				}
			}
			for r := 0; r < n; r++ {
				for k, want := range ref {
					if g := float64(got[r][s][p][k]); math.Abs(g-want) > tol*(1+math.Abs(want)) {
						t.Fatalf("step %d rank %d param %d [%d]: got %v, want %v", s, r, p, k, g, want)
					}
				}
			}
		}
	}
}

// devRank is one rank of the ordering tests: a reducer over three device parameters.
type devRank struct {
	w     devWorld
	red   *Reducer
	grads []procgroup.DeviceBuffer // backward's output, read by GradReadyDevice
	next  []procgroup.DeviceBuffer // the values the "gradient kernel" writes into grads
	outs  []procgroup.DeviceBuffer // Param.Grad
	probe []procgroup.DeviceBuffer // what the trainer's next kernel reads out of outs
}

var ordLens = []int{37, 1000, 5}

// setupOrdering gives every rank random gradients (different per rank) and runs one step,
// the one that rebuilds the buckets, so that the steps the tests look at are steady; then
// it sets new values for the gradient kernels (newValues) and returns them.
func setupOrdering(t *testing.T, n int, rng *rand.Rand) ([]*devRank, [][][]float32) {
	t.Helper()
	ws := startDevice(t, n, false)
	rs := make([]*devRank, n)
	for r := range rs {
		d := &devRank{w: ws[r]}
		params := make([]Param, len(ordLens))
		for p, l := range ordLens {
			d.grads = append(d.grads, upload(t, d.w.g, d.w.stream, make([]float32, l)))
			d.next = append(d.next, upload(t, d.w.g, d.w.stream, make([]float32, l)))
			d.outs = append(d.outs, upload(t, d.w.g, d.w.stream, make([]float32, l)))
			d.probe = append(d.probe, upload(t, d.w.g, d.w.stream, make([]float32, l)))
			params[p] = Param{Name: fmt.Sprintf("p%d", p), Grad: d.outs[p]}
		}
		red, err := New(d.w.pg, params, Options{FirstBucketCapMB: 1e-3, BucketCapMB: 3e-3, Device: true, Stream: d.w.stream})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { red.Close() })
		d.red = red
		rs[r] = d
	}
	newValues(t, rs, rng)
	if err := firstErr(runRanks(n, func(r int) error { return rs[r].step(context.Background()) })); err != nil {
		t.Fatal(err)
	}
	if nb := len(rs[0].red.Buckets()); nb < 2 {
		t.Fatalf("%d buckets, want several", nb)
	}
	return rs, newValues(t, rs, rng)
}

// newValues writes new random values (different on every rank) into every rank's next
// buffers, the output of its gradient kernels, zeroes the outputs and the probes, and waits
// for all of it (test set-up, between steps). So a collective or kernel that read too early
// would see the previous step's values, or zeros.
func newValues(t *testing.T, rs []*devRank, rng *rand.Rand) [][][]float32 {
	t.Helper()
	vals := make([][][]float32, len(rs)) // [rank][param]
	for r, d := range rs {
		vals[r] = make([][]float32, len(ordLens))
		for p, l := range ordLens {
			vals[r][p] = make([]float32, l)
			for k := range vals[r][p] {
				vals[r][p][k] = float32(rng.NormFloat64())
			}
			if err := d.w.g.CopyIn(d.next[p], vals[r][p]); err != nil {
				t.Fatal(err)
			}
			if err := d.w.g.ZeroAsync(d.w.stream, d.outs[p]); err != nil {
				t.Fatal(err)
			}
			if err := d.w.g.ZeroAsync(d.w.stream, d.probe[p]); err != nil {
				t.Fatal(err)
			}
		}
		if err := d.w.g.SyncStream(d.w.stream); err != nil {
			t.Fatal(err)
		}
	}
	return vals
}

func firstErr(errs []error) error {
	for r, err := range errs {
		if err != nil {
			return fmt.Errorf("rank %d: %w", r, err)
		}
	}
	return nil
}

// step is one synced step whose "backward" is a kernel per parameter writing next into
// grads on the compute stream, followed by the trainer's next kernel (copying the
// averaged gradients into probe): all on the device, nothing waited for on the host.
func (d *devRank) step(ctx context.Context) error {
	dev := procgroup.Device(d.w.g)
	if err := d.red.BeginBackward(Sync); err != nil {
		return err
	}
	for p := len(d.grads) - 1; p >= 0; p-- {
		if err := dev.ScaleAsync(d.w.stream, d.grads[p], d.next[p], 1, false); err != nil {
			return err
		}
		if err := d.red.GradReadyDevice(p, d.grads[p]); err != nil {
			return err
		}
	}
	if err := d.red.Finalize(ctx); err != nil {
		return err
	}
	for p := range d.outs {
		if err := dev.ScaleAsync(d.w.stream, d.probe[p], d.outs[p], 1, false); err != nil {
			return err
		}
	}
	return nil
}

// checkProbes reads every rank's probes back (a host synchronisation, after the step) and
// compares them with the average of vals over ranks.
func checkProbes(t *testing.T, rs []*devRank, vals [][][]float32) {
	t.Helper()
	n := len(rs)
	for r, d := range rs {
		for p, l := range ordLens {
			got, err := download(d.w.g, d.probe[p], d.w.stream)
			if err != nil {
				t.Fatal(err)
			}
			for k := 0; k < l; k++ {
				want := 0.0
				for q := range n {
					want += float64(vals[q][p][k] / float32(n))
				}
				if math.Abs(float64(got[k])-want) > 1e-6*(1+math.Abs(want)) {
					t.Fatalf("rank %d param %d [%d]: the next kernel read %v, want the average %v", r, p, k, got[k], want)
				}
			}
		}
	}
}

// TestDeviceSlowGradientKernel: every rank's compute stream is held back (the fake's gate)
// before the kernels that write this step's gradients. The reducer's copies, the buckets'
// all-reduces, Finalize and the trainer's next kernel are all enqueued and return while
// the gate is closed — the host never waits — and not one collective runs meanwhile; once
// the gate opens, the all-reduces have read the gradients those kernels wrote (the
// average of the new values on every rank, not the stale ones the buffers held).
func TestDeviceSlowGradientKernel(t *testing.T) {
	for _, n := range []int{2, 3} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			rs, vals := setupOrdering(t, n, rand.New(rand.NewPCG(uint64(n), 1)))
			before := gpufake.Knob("nccl_collectives", 0)
			for _, d := range rs {
				gpufake.Knob("gate_close", int64(d.w.stream))
			}
			done := make(chan []error, 1)
			go func() { done <- runRanks(n, func(r int) error { return rs[r].step(testCtx(t)) }) }()
			var errs []error
			select {
			case errs = <-done:
			case <-time.After(20 * time.Second): // a hang guard, not a measurement
				gpufake.Knob("gate_open", 0)
				<-done
				t.Fatal("the step did not return while the gradient kernels were held back: the host waited for the device")
			}
			during := gpufake.Knob("nccl_collectives", 0)
			gpufake.Knob("gate_open", 0)
			if err := firstErr(errs); err != nil {
				t.Fatal(err)
			}
			if during != before {
				t.Fatalf("%d collectives ran while the gradient kernels were held back", during-before)
			}
			checkProbes(t, rs, vals)
		})
	}
}

// TestDeviceNextKernelWaits: the all-reduces are held back (the fake NCCL's gate); the
// step, Finalize included, returns on every rank, and the trainer's next kernel (a copy of
// each averaged gradient, queued on the compute stream after Finalize) runs only once the
// all-reduced results are in place: with the gate open it has read the averages, not the
// pre-reduction values.
func TestDeviceNextKernelWaits(t *testing.T) {
	for _, n := range []int{2, 3} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			rs, vals := setupOrdering(t, n, rand.New(rand.NewPCG(uint64(n), 2)))
			before := gpufake.Knob("nccl_collectives", 0)
			gpufake.Knob("nccl_gate_close", 0)
			errs := runRanks(n, func(r int) error { return rs[r].step(testCtx(t)) })
			during := gpufake.Knob("nccl_collectives", 0)
			// While the all-reduces are held, the probes must still be zero: read them on
			// another stream (the compute stream is blocked behind the all-reduces).
			early := make([][]float32, n)
			for r, d := range rs {
				early[r], _ = download(d.w.g, d.probe[1], 0)
			}
			gpufake.Knob("nccl_gate_open", 0)
			if err := firstErr(errs); err != nil {
				t.Fatal(err)
			}
			if during != before {
				t.Fatalf("%d collectives ran while held", during-before)
			}
			for r := range early {
				for k, v := range early[r] {
					if v != 0 {
						t.Fatalf("rank %d: the next kernel wrote %v at [%d] before the all-reduce ran", r, v, k)
					}
				}
			}
			checkProbes(t, rs, vals)
		})
	}
}

// TestDeviceNoHostSync: ten steady steps on every rank (device gradients, reducer copies,
// all-reduces, Finalize, the trainer's next kernel) make zero calls to cuStreamSynchronize
// or cuEventSynchronize (counted by the fake driver), and the results are right.
func TestDeviceNoHostSync(t *testing.T) {
	for _, n := range []int{1, 2, 4} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			rs, vals := setupOrdering(t, n, rand.New(rand.NewPCG(uint64(n), 3)))
			const steps = 10
			before := gpufake.Knob("syncs", 0)
			perStep := make([]int64, 0, steps)
			for s := 0; s < steps; s++ {
				s0 := gpufake.Knob("syncs", 0)
				if err := firstErr(runRanks(n, func(r int) error { return rs[r].step(testCtx(t)) })); err != nil {
					t.Fatal(err)
				}
				perStep = append(perStep, gpufake.Knob("syncs", 0)-s0)
			}
			total := gpufake.Knob("syncs", 0) - before
			t.Logf("world size %d: host synchronisations per step %v", n, perStep)
			if total != 0 {
				t.Fatalf("%d host synchronisations in %d steps (per step %v), want 0", total, steps, perStep)
			}
			checkProbes(t, rs, vals)
		})
	}
}

// TestDeviceBadInput: clear errors for device gradients without Options.Device, host
// gradients with it, a group without device memory, and GradReady on device buckets.
func TestDeviceBadInput(t *testing.T) {
	ws := startDevice(t, 1, false)
	d := upload(t, ws[0].g, ws[0].stream, make([]float32, 4))
	if _, err := New(ws[0].pg, []Param{{Name: "a", Grad: d}}, Options{}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("device Grad without Options.Device: %v", err)
	}
	if _, err := New(ws[0].pg, []Param{{Name: "a", Grad: make([]float32, 4)}}, Options{Device: true}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("host Grad with Options.Device: %v", err)
	}
	c := pgtest.NewCluster(1)
	defer c.Close()
	if _, err := New(c.Group(0), []Param{{Name: "a", Grad: d}}, Options{Device: true}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Options.Device on a host group: %v", err)
	}
	red, err := New(ws[0].pg, []Param{{Name: "a", Grad: d}}, Options{Device: true, Stream: ws[0].stream})
	if err != nil {
		t.Fatal(err)
	}
	defer red.Close()
	if err := red.BeginBackward(Sync); err != nil {
		t.Fatal(err)
	}
	if err := red.GradReady(0, make([]float32, 4)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("GradReady on device buckets: %v", err)
	}
}
