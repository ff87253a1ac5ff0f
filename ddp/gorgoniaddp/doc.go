// Package gorgoniaddp trains a gorgonia model with package ddp: it describes a graph's
// learnables as ddp.Params, reports each gradient to the DDP the moment gorgonia's backward
// completes it (a grad-ready tap, Note [Grad-ready hooks]), and copies the averaged
// gradients back into the learnables' gradient values after every synced Finalize, where
// gorgonia's solvers read them.
//
// It is a package of its own so that a trainer that brings its own gradients links no
// gorgonia: package ddp imports none.
//
// # Usage
//
// Wrap the learnables, build the model on the taps (Use each learnable right where it is
// consumed, Note [Tap placement]), then train as with package ddp:
//
//	d, taps, err := gorgoniaddp.WrapNodes(ctx, pg, learnables, ddp.Options{Logger: log})
//	if err != nil { ... }
//	defer d.Close()
//	w1, err := taps.Use(0) // at the op that consumes learnables[0]
//	...
//	gorgonia.Grad(loss, learnables...)
//	vm := gorgonia.NewTapeMachine(g)
//
//	for step := 0; step < steps; step++ {
//		for mb := 0; mb < accum; mb++ {
//			load(g, step, mb, pg.Rank()) // this rank's shard of the batch
//			mode := ddp.Accumulate       // all but the last micro-batch: NoSync
//			if mb == accum-1 {
//				mode = ddp.Sync
//			}
//			d.BeginBackward(mode)
//			vm.Reset()
//			if err := vm.RunAll(); err != nil { return err } // forward+backward; hooks fire
//		}
//		if err := d.Finalize(ctx); err != nil { // also the hooks' errors
//			return err
//		}
//		solver.Step(gorgonia.NodesToValueGrads(learnables)) // the averaged gradients
//	}
//
// A model whose graph takes a grad hook option (examples/transformer/model) is given
// Hook(d) and taps its learnables itself; its trainer calls ddp.New (with ParamsFromNodes,
// or Params of its own), and the averages are in each Param.Grad, not in the nodes'
// gradients. A hook cannot return an error: Hook's errors fail the DDP (ddp.DDP.Fail) and
// are returned by the next Finalize.
package gorgoniaddp
