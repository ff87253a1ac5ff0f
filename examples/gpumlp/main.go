// Command gpumlp trains a two-layer MLP on the GPU with ddp: forward, backward and the SGD
// step run on the device (cuBLAS SGEMM and five PTX kernels, gpu.go), the gradients stay in
// device memory, and ddp's reducer averages them in device buckets over NCCL, stream-ordered
// (reducer Note [Device buckets]). One GPU per rank:
//
//	ddprun --nproc_per_node 2 ./examples/gpumlp -- --steps 100
//	ddprun --nproc_per_node 1 ./examples/gpumlp -- --bench_steps 50   # ms/step
//
// The model: Y = relu(X·W1 + b1)·W2 + b2, loss ½·mean over the global batch of ‖Y − T‖², on a
// synthetic regression set (uploaded to the device once). Every rank takes its contiguous
// shard of each global batch, so the DDP run follows the one-process big-batch run (the
// test checks it at world sizes 1 to 4). Nothing in a step waits on the host; the loss is
// read back (a synchronisation) only every --log_every steps and at the end.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/goddp/goddp/backends/nccl" // registers --backend nccl
	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/procgroup"
)

type flags struct {
	backend    string
	in, hidden int
	out        int
	batch      int // global
	samples    int
	steps      int
	benchSteps int
	lr         float64
	seed       uint64
	logEvery   int
	bucketMB   float64
	bucketView bool
	timeout    time.Duration
}

func parseFlags(args []string, out io.Writer) (*flags, error) {
	f := &flags{}
	fs := flag.NewFlagSet("gpumlp", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.StringVar(&f.backend, "backend", "nccl", "process group backend (a GPU one: nccl)")
	fs.IntVar(&f.in, "in", 64, "input features")
	fs.IntVar(&f.hidden, "hidden", 256, "hidden units")
	fs.IntVar(&f.out, "out", 16, "outputs")
	fs.IntVar(&f.batch, "batch", 64, "global batch size (divided among the ranks)")
	fs.IntVar(&f.samples, "samples", 1024, "training set size (a multiple of --batch)")
	fs.IntVar(&f.steps, "steps", 20, "training steps")
	fs.IntVar(&f.benchSteps, "bench_steps", 0, "after --steps, time this many steps and print ms/step")
	fs.Float64Var(&f.lr, "lr", 0.01, "SGD learning rate")
	fs.Uint64Var(&f.seed, "seed", 1, "seed of the data and the initial parameters")
	fs.IntVar(&f.logEvery, "log_every", 0, "print the loss every N steps (a host synchronisation each time; 0: at the end only)")
	fs.Float64Var(&f.bucketMB, "bucket_cap_mb", 25, "DDP bucket cap, MiB")
	fs.BoolVar(&f.bucketView, "gradient_as_bucket_view", false, "gradients are views of the device buckets")
	fs.DurationVar(&f.timeout, "timeout", 0, "collective timeout (0: GODDP_COLLECTIVE_TIMEOUT or the default)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	switch {
	case f.in < 1 || f.hidden < 1 || f.out < 1 || f.batch < 1 || f.steps < 0 || f.benchSteps < 0:
		return nil, fmt.Errorf("gpumlp: --in, --hidden, --out and --batch must be positive, --steps and --bench_steps not negative")
	case f.samples < f.batch || f.samples%f.batch != 0:
		return nil, fmt.Errorf("gpumlp: --samples %d must be a positive multiple of --batch %d", f.samples, f.batch)
	}
	return f, nil
}

func main() {
	f, err := parseFlags(os.Args[1:], os.Stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		return
	case err != nil:
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	log, _ := zap.NewProduction()
	ctx := context.Background()
	pg, err := ddp.InitProcessGroup(ctx, f.backend, ddp.InitOptions{Timeout: f.timeout, Logger: log})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	res, err := train(ctx, pg, f, os.Stdout)
	if cerr := pg.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("rank %d: final loss %.6f params_crc32 %08x\n", pg.Rank(), res.loss, res.crc)
}

// result is what a run ends with.
type result struct {
	params    [][]float32 // W1, b1, W2, b2
	loss      float64     // of the last global batch, before the last step's update
	crc       uint32
	msPerStep float64 // --bench_steps
}

// data is the synthetic regression set: T = tanh(X·A)·B plus noise, from seed.
func data(f *flags) (x, t []float32) {
	rng := rand.New(rand.NewPCG(f.seed, 7))
	a := make([]float64, f.in*8)
	b := make([]float64, 8*f.out)
	for i := range a {
		a[i] = rng.NormFloat64() / math.Sqrt(float64(f.in))
	}
	for i := range b {
		b[i] = rng.NormFloat64()
	}
	x = make([]float32, f.samples*f.in)
	t = make([]float32, f.samples*f.out)
	for s := 0; s < f.samples; s++ {
		for i := 0; i < f.in; i++ {
			x[s*f.in+i] = float32(rng.NormFloat64())
		}
		var h [8]float64
		for j := range h {
			for i := 0; i < f.in; i++ {
				h[j] += float64(x[s*f.in+i]) * a[i*8+j]
			}
			h[j] = math.Tanh(h[j])
		}
		for o := 0; o < f.out; o++ {
			v := 0.1 * rng.NormFloat64()
			for j := range h {
				v += h[j] * b[j*f.out+o]
			}
			t[s*f.out+o] = float32(v)
		}
	}
	return x, t
}

// initParams returns W1 [in×hidden], b1, W2 [hidden×out], b2 (He-style scale).
func initParams(f *flags) [][]float32 {
	rng := rand.New(rand.NewPCG(f.seed, 11))
	shapes := []int{f.in * f.hidden, f.hidden, f.hidden * f.out, f.out}
	scale := []float64{math.Sqrt(2 / float64(f.in)), 0, math.Sqrt(1 / float64(f.hidden)), 0}
	ps := make([][]float32, len(shapes))
	for p, n := range shapes {
		ps[p] = make([]float32, n)
		for k := range ps[p] {
			ps[p][k] = float32(scale[p] * rng.NormFloat64())
		}
	}
	return ps
}

// train runs f on pg (one rank) and returns its final parameters. The device is the nccl
// group's (found through the wrappers of ddp.InitProcessGroup).
func train(ctx context.Context, pg procgroup.ProcessGroup, f *flags, out io.Writer) (*result, error) {
	g, ok := procgroup.Find[*nccl.Group](pg)
	if !ok {
		return nil, fmt.Errorf("gpumlp: the %q group has no GPU (run with --backend nccl)", f.backend)
	}
	n, rank := pg.Size(), pg.Rank()
	if f.batch%n != 0 {
		return nil, fmt.Errorf("gpumlp: --batch %d is not divisible by the world size %d", f.batch, n)
	}
	bl := f.batch / n // local batch
	s, err := g.NewStream()
	if err != nil {
		return nil, err
	}
	defer g.DestroyStream(s)
	gp, err := openGPU(g.Device(), s, g)
	if err != nil {
		return nil, err
	}
	var bufs []procgroup.DeviceBuffer
	defer func() {
		g.SyncStream(s)
		for _, b := range bufs {
			g.Free(b)
		}
	}()
	alloc := func(v []float32, count int) (procgroup.DeviceBuffer, error) {
		b, err := g.Alloc(procgroup.Float32, count)
		if err != nil {
			return b, err
		}
		bufs = append(bufs, b)
		b.Stream = s
		if v != nil {
			err = g.CopyIn(b, v)
		}
		return b, err
	}
	xs, ts := data(f)
	X, err := alloc(xs, len(xs))
	if err != nil {
		return nil, err
	}
	T, err := alloc(ts, len(ts))
	if err != nil {
		return nil, err
	}
	host := initParams(f)
	params := make([]ddp.Param, len(host))
	names := []string{"w1", "b1", "w2", "b2"}
	shapes := [][]int{{f.in, f.hidden}, {f.hidden}, {f.hidden, f.out}, {f.out}}
	W := make([]procgroup.DeviceBuffer, len(host))
	G := make([]procgroup.DeviceBuffer, len(host)) // backward's gradients
	for p, v := range host {
		if W[p], err = alloc(v, len(v)); err != nil {
			return nil, err
		}
		if G[p], err = alloc(nil, len(v)); err != nil {
			return nil, err
		}
		params[p] = ddp.Param{Name: names[p], Data: W[p], Shape: shapes[p]}
		if !f.bucketView {
			o, err := alloc(nil, len(v))
			if err != nil {
				return nil, err
			}
			params[p].Grad = o
		}
	}
	H, err := alloc(nil, bl*f.hidden)
	if err != nil {
		return nil, err
	}
	Y, err := alloc(nil, bl*f.out)
	if err != nil {
		return nil, err
	}
	dY, err := alloc(nil, bl*f.out)
	if err != nil {
		return nil, err
	}
	dH, err := alloc(nil, bl*f.hidden)
	if err != nil {
		return nil, err
	}
	d, err := ddp.New(ctx, pg, params, ddp.Options{BucketCapMB: f.bucketMB, GradientAsBucketView: f.bucketView, Device: true, Stream: s})
	if err != nil {
		return nil, err
	}
	defer d.Close()
	dev := procgroup.Device(g)
	batches := f.samples / f.batch
	loss := func(step int) (float64, error) { // the local shard's ½‖Y−T‖² sum (host sync)
		yv := make([]float32, bl*f.out)
		if err := g.CopyOut(yv, Y); err != nil {
			return 0, err
		}
		row := (step%batches)*f.batch + rank*bl
		tv := ts[row*f.out : (row+bl)*f.out]
		sum := 0.0
		for k, v := range yv {
			e := float64(v) - float64(tv[k])
			sum += 0.5 * e * e
		}
		return sum, nil
	}
	var lastLoss float64
	stepFn := func(step int) error {
		row := (step%batches)*f.batch + rank*bl
		x := X.Slice(row*f.in, (row+bl)*f.in)
		t := T.Slice(row*f.out, (row+bl)*f.out)
		// forward
		if err := gp.gemm(false, false, bl, f.hidden, f.in, x, W[0], H, 0); err != nil {
			return err
		}
		if err := gp.launch("gpumlp_add_bias", bl*f.hidden, 0, false, ptr(H), ptr(W[1]), uint64(bl), uint64(f.hidden)); err != nil {
			return err
		}
		if err := gp.launch("gpumlp_relu", bl*f.hidden, 0, false, ptr(H), uint64(bl*f.hidden)); err != nil {
			return err
		}
		if err := gp.gemm(false, false, bl, f.out, f.hidden, H, W[2], Y, 0); err != nil {
			return err
		}
		if err := gp.launch("gpumlp_add_bias", bl*f.out, 0, false, ptr(Y), ptr(W[3]), uint64(bl), uint64(f.out)); err != nil {
			return err
		}
		// backward: dY = (Y − T)/local batch; the reducer averages over ranks.
		d.BeginBackward(ddp.Sync)
		if err := gp.launch("gpumlp_sub_scale", bl*f.out, 1/float32(bl), true, ptr(dY), ptr(Y), ptr(t), uint64(bl*f.out)); err != nil {
			return err
		}
		if err := gp.gemm(true, false, f.hidden, f.out, bl, H, dY, G[2], 0); err != nil { // dW2 = Hᵀ·dY
			return err
		}
		if err := d.GradReadyDevice(2, G[2]); err != nil {
			return err
		}
		if err := gp.launch("gpumlp_colsum", f.out, 0, false, ptr(G[3]), ptr(dY), uint64(bl), uint64(f.out)); err != nil {
			return err
		}
		if err := d.GradReadyDevice(3, G[3]); err != nil {
			return err
		}
		if err := gp.gemm(false, true, bl, f.hidden, f.out, dY, W[2], dH, 0); err != nil { // dH = dY·W2ᵀ
			return err
		}
		if err := gp.launch("gpumlp_relu_bwd", bl*f.hidden, 0, false, ptr(dH), ptr(H), uint64(bl*f.hidden)); err != nil {
			return err
		}
		if err := gp.gemm(true, false, f.in, f.hidden, bl, x, dH, G[0], 0); err != nil { // dW1 = Xᵀ·dH
			return err
		}
		if err := d.GradReadyDevice(0, G[0]); err != nil {
			return err
		}
		if err := gp.launch("gpumlp_colsum", f.hidden, 0, false, ptr(G[1]), ptr(dH), uint64(bl), uint64(f.hidden)); err != nil {
			return err
		}
		if err := d.GradReadyDevice(1, G[1]); err != nil {
			return err
		}
		if err := d.Finalize(ctx); err != nil {
			return err
		}
		// SGD on the device, stream-ordered after the all-reduces.
		for p := range W {
			if err := dev.ScaleAsync(s, W[p], d.GradDevice(p), -f.lr, true); err != nil {
				return err
			}
		}
		return nil
	}
	for step := 0; step < f.steps; step++ {
		if err := stepFn(step); err != nil {
			return nil, err
		}
		if f.logEvery > 0 && (step+1)%f.logEvery == 0 || step == f.steps-1 {
			l, err := loss(step)
			if err != nil {
				return nil, err
			}
			lastLoss = l / float64(bl)
			if f.logEvery > 0 && out != nil {
				fmt.Fprintf(out, "rank %d step %d: local loss %.6f\n", rank, step+1, lastLoss)
			}
		}
	}
	res := &result{loss: lastLoss}
	if f.benchSteps > 0 {
		if err := g.SyncStream(s); err != nil {
			return nil, err
		}
		t0 := time.Now()
		for k := 0; k < f.benchSteps; k++ {
			if err := stepFn(f.steps + k); err != nil {
				return nil, err
			}
		}
		if err := g.SyncStream(s); err != nil {
			return nil, err
		}
		res.msPerStep = float64(time.Since(t0).Microseconds()) / 1e3 / float64(f.benchSteps)
		if out != nil {
			fmt.Fprintf(out, "rank %d: %.3f ms/step over %d steps (world size %d, batch %d, %d-%d-%d)\n",
				rank, res.msPerStep, f.benchSteps, n, f.batch, f.in, f.hidden, f.out)
		}
	}
	h := crc32.NewIEEE()
	for p := range W {
		v := make([]float32, W[p].Count)
		if err := g.CopyOut(v, W[p]); err != nil {
			return nil, err
		}
		res.params = append(res.params, v)
		h.Write(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(v))), 4*len(v)))
	}
	res.crc = h.Sum32()
	return res, nil
}
