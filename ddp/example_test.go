package ddp_test

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"

	_ "github.com/goddp/goddp/backends/gloo" // registers the "gloo" backend (ddp.InitProcessGroup(ctx, "gloo", ...))
	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/procgroup"
)

// A trainer that computes its own gradients: a linear model pred = w·x + b, trained on 2
// ranks with 2 micro-batches per step (the first under NoSync). Each rank lists its
// parameters as Params, reports each micro-batch's gradient with GradReady in the order
// backward produces it, calls Finalize, then steps the optimizer on Param.Grad, which holds
// the gradient of the whole global batch.
//
// The ranks are goroutines over a real gloo group here; in a job each rank is a process
// started by ddprun, and train's pg comes from
//
//	pg, err := ddp.InitProcessGroup(ctx, "gloo", ddp.InitOptions{})
//	if err != nil { ... }
//	defer pg.Close()
func Example_ownGradients() {
	ctx := context.Background()
	store := procgroup.NewMemStore()
	defer store.Close()
	const world = 2
	logs := make([]string, world)
	params := make([][]float32, world)
	var wg sync.WaitGroup
	for rank := range world {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pg, err := procgroup.New(ctx, "gloo", procgroup.Options{
				Rank: rank, Size: world, Store: store, Prefix: "example", Token: "example-token",
			})
			if err != nil {
				logs[rank] = err.Error()
				return
			}
			defer pg.Close()
			logs[rank], params[rank], err = train(ctx, pg)
			if err != nil {
				logs[rank] += err.Error()
			}
		}()
	}
	wg.Wait()
	fmt.Print(logs[0], logs[1])
	fmt.Println("ranks agree bit for bit:", slices.Equal(params[0], params[1]))
	// Output:
	// step 0: loss 1.8041
	// step 15: loss 0.0080
	// step 30: loss 0.0001
	// step 45: loss 0.0000
	// w=[2.000 -1.000 0.500] b=1.000
	// ranks agree bit for bit: true
}

// train is one rank's training loop: it returns rank 0's log lines and the final parameters.
func train(ctx context.Context, pg procgroup.ProcessGroup) (string, []float32, error) {
	const steps, accum, lr = 60, 2, 0.3
	w, b := make([]float32, 3), make([]float32, 1)   // the model's parameters
	gw, gb := make([]float32, 3), make([]float32, 1) // where Finalize leaves their gradients
	d, err := ddp.New(ctx, pg, []ddp.Param{
		{Name: "w", Data: w, Grad: gw}, // index 0
		{Name: "b", Data: b, Grad: gb}, // index 1
	}, ddp.Options{})
	if err != nil {
		return "", nil, err
	}
	defer d.Close()

	var log string
	mw, mb := make([]float32, 3), make([]float32, 1) // one micro-batch's gradients
	for step := range steps {
		var loss float32
		for micro := range accum {
			mode := ddp.Accumulate // NoSync for all but the last micro-batch
			if micro == accum-1 {
				mode = ddp.Sync
			}
			d.BeginBackward(mode)
			xs, ys := shard(step*accum+micro, pg.Rank(), pg.Size())
			// Forward and backward of this micro-batch's mean loss, scaled by 1/accum:
			// the DDP sums the micro-batches' gradients, the scaling is the trainer's.
			loss += forwardBackward(w, b, xs, ys, 1/float32(accum), mw, mb)
			// Report each gradient as backward produces it: b's first, then w's. Errors
			// also come back from Finalize.
			d.GradReady(1, mb)
			d.GradReady(0, mw)
		}
		// Wait for the all-reduces: gw and gb now hold the global batch's mean gradient.
		if err := d.Finalize(ctx); err != nil {
			return log, nil, err
		}
		for i := range w {
			w[i] -= lr * gw[i]
		}
		b[0] -= lr * gb[0]
		if step%15 == 0 { // every rank takes part in the loss's all-reduce
			l := []float32{loss / float32(pg.Size())}
			if err := pg.AllReduce(ctx, l, procgroup.Sum).Wait(ctx); err != nil {
				return log, nil, err
			}
			if pg.Rank() == 0 {
				log += fmt.Sprintf("step %d: loss %.4f\n", step, l[0])
			}
		}
	}
	if pg.Rank() == 0 {
		log += fmt.Sprintf("w=[%.3f %.3f %.3f] b=%.3f\n", w[0], w[1], w[2], b[0])
	}
	// Leave together: no rank closes its connections while a peer may still be finishing.
	if err := pg.Barrier(ctx).Wait(ctx); err != nil {
		return log, nil, err
	}
	return log, append(w, b...), nil
}

// forwardBackward sets gw, gb to scale times the gradient of the mean over the samples of
// ½(w·x + b − y)², and returns scale times that loss.
func forwardBackward(w, b []float32, xs [][3]float32, ys []float32, scale float32, gw, gb []float32) float32 {
	clear(gw)
	clear(gb)
	var loss float32
	n := float32(len(xs))
	for k, x := range xs {
		r := w[0]*x[0] + w[1]*x[1] + w[2]*x[2] + b[0] - ys[k]
		loss += scale * r * r / (2 * n)
		for i := range gw {
			gw[i] += scale * r * x[i] / n
		}
		gb[0] += scale * r / n
	}
	return loss
}

// shard is rank's part of global micro-batch mb: 4 samples of y = 2x₀ − x₁ + x₂/2 + 1.
func shard(mb, rank, size int) ([][3]float32, []float32) {
	const per = 4
	xs, ys := make([][3]float32, per), make([]float32, per)
	for k := range per {
		s := float64((mb*size+rank)*per + k) // the sample's index in the run
		x := [3]float32{float32(math.Sin(1.3 * s)), float32(math.Cos(0.7 * s)), float32(math.Sin(0.4*s + 1))}
		xs[k], ys[k] = x, 2*x[0]-x[1]+x[2]/2+1
	}
	return xs, ys
}

// Ranks with uneven data (Options.UnevenInputs): rank r of 3 has 0, 3 or 5 batches. Each
// runs its own, then calls Join, which shadows the others' steps with zero gradients until
// every rank has joined; then every rank holds the parameters of the rank that ran all 5.
func Example_join() {
	ctx := context.Background()
	store := procgroup.NewMemStore()
	defer store.Close()
	batches := []int{0, 3, 5}
	world := len(batches)
	params := make([][]float32, world)
	errs := make([]error, world)
	var wg sync.WaitGroup
	for rank := range world {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pg, err := procgroup.New(ctx, "gloo", procgroup.Options{
				Rank: rank, Size: world, Store: store, Prefix: "example-join", Token: "example-token",
			})
			if err != nil {
				errs[rank] = err
				return
			}
			defer pg.Close()
			params[rank], errs[rank] = trainUneven(ctx, pg, batches[rank])
		}()
	}
	wg.Wait()
	for rank, err := range errs {
		if err != nil {
			fmt.Println("rank", rank, err)
		}
	}
	fmt.Println("ranks agree bit for bit:", slices.Equal(params[0], params[1]) && slices.Equal(params[0], params[2]))
	fmt.Printf("w=%.3f b=%.3f\n", params[0][:3], params[0][3])
	// Output:
	// ranks agree bit for bit: true
	// w=[0.750 -0.340 0.206] b=0.617
}

// trainUneven is one rank's loop over its own batches, then Join.
func trainUneven(ctx context.Context, pg procgroup.ProcessGroup, batches int) ([]float32, error) {
	const lr = 0.3
	w, b := make([]float32, 3), make([]float32, 1)
	gw, gb := make([]float32, 3), make([]float32, 1)
	d, err := ddp.New(ctx, pg, []ddp.Param{{Name: "w", Data: w, Grad: gw}, {Name: "b", Data: b, Grad: gb}},
		ddp.Options{UnevenInputs: true})
	if err != nil {
		return nil, err
	}
	defer d.Close()
	for step := range batches {
		xs, ys := shard(step, pg.Rank(), pg.Size())
		err := d.Backward(ctx, func() error {
			forwardBackward(w, b, xs, ys, 1, gw, gb)
			d.GradReady(1, gb)
			return d.GradReady(0, gw)
		})
		if err != nil {
			return nil, err
		}
		for k := range w {
			w[k] -= lr * gw[k]
		}
		b[0] -= lr * gb[0]
	}
	if err := d.Join(ctx); err != nil { // this rank's data has run out
		return nil, err
	}
	return append(slices.Clone(w), b...), nil
}
