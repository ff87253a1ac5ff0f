// Package ddp is the library a Go trainer imports to train one model replica per process
// with averaged gradients: the Go counterpart of PyTorch's DistributedDataParallel.
//
// New checks that every rank wraps the same model (Note [Model check]) and copies rank 0's
// parameters and buffers to every rank. During each backward pass, every parameter's
// gradient is reported as soon as it is computed (Hook, fired by a grad-ready tap, or
// GradReady); the reducer (package reducer) packs the gradients into buckets and
// all-reduces each bucket the moment it is complete, overlapping with the rest of backward.
// Finalize waits for the buckets and leaves the averaged gradients in place.
//
// # Usage
//
// Create the group from the launcher's environment (ddprun, torchrun-style variables, srun,
// mpirun), wrap the model, then train. With a gorgonia model whose graph takes a grad hook
// (Tap each learnable right where it is consumed, Note [Tap placement], or let WrapNodes
// hand out Taps that do so):
//
//	pg, closePG, err := ddp.InitProcessGroup(ctx, "gloo", ddp.InitOptions{Logger: log})
//	if err != nil { ... }
//	defer closePG()
//	d, err := ddp.New(ctx, pg, params, ddp.Options{BucketCapMB: 25, Logger: log})
//	if err != nil { ... }  // e.g. "ddp: parameter 3 (w1) has shape [256 1024] on rank 0 but [256 512] on rank 1"
//	defer d.Close()
//	g, err := m.NewGraph(model.GraphOptions{Hook: d.Hook, ...}) // the hook feeds d during backward
//
//	for step := 0; step < steps; step++ {
//		for mb := 0; mb < accum; mb++ {
//			load(g, step, mb, pg.Rank())     // this rank's shard of the batch
//			d.BeginBackward(mb == accum-1)   // all but the last micro-batch: NoSync
//			if _, err := g.Run(); err != nil { return err } // forward+backward; hooks fire
//		}
//		if err := d.Finalize(ctx); err != nil { // the step's first error, if any
//			return err
//		}
//		opt.Step(weights, grads)  // each Param.Grad holds the gradient averaged over ranks
//		log(d.Stats())            // per-bucket timeline, communication/compute overlap
//	}
//
// The closure forms do the same for one micro-batch each:
//
//	err := d.NoSync(func() error { _, err := g.Run(); return err })        // accumulate
//	err := d.Backward(ctx, func() error { _, err := g.Run(); return err }) // sync + Finalize
//
// A trainer that computes its own gradients lists them as Params ({Name, Data, Grad,
// Shape}: Data and Grad are []float32 or []float64 of the same length) and calls
// d.GradReady(i, grad) for each parameter during backward, in the order the gradients
// become ready, instead of the hook.
//
// # Errors
//
// BeginBackward and Hook return nothing: their errors (and GradReady's) fail the DDP and
// are returned by Finalize, so checking Finalize's error is enough. Failure is final: the
// process group is aborted so that the other ranks fail too, instead of hanging (see DDP).
// A mismatch between the ranks' models at New is a *MismatchError, the same on every rank.
package ddp
