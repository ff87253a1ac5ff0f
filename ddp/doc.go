// Package ddp is the library a Go trainer imports to train one model replica per process
// with averaged gradients: the Go counterpart of PyTorch's DistributedDataParallel.
//
// New checks that every rank wraps the same model (Note [Model check]) and copies rank 0's
// parameters and buffers to every rank. During each backward pass, every parameter's
// gradient is reported as soon as it is computed (GradReady, called by the trainer or by an
// adapter's hook); the reducer (package reducer) packs the gradients into buckets and
// all-reduces each bucket the moment it is complete, overlapping with the rest of backward.
// Finalize waits for the buckets and leaves the averaged gradients in place.
//
// The core links no tensor library and no metrics client. Around it:
//
//   - gorgoniaddp trains a gorgonia model: grad-ready taps in the graph report each
//     gradient, and the averages land in the learnables' gradients;
//   - observe writes a per-rank timeline (Chrome trace format), overlap and straggler
//     reports and a progress line; tracefile reads and merges the traces;
//   - metrics exports a rank's metrics to Prometheus.
//
// # Usage
//
// A trainer is a main package that links in a backend with a blank import (package
// procgroup imports none; without it every rank fails with procgroup: unknown backend
// "gloo": not linked into this program; add import _ "github.com/goddp/goddp/backends/gloo"):
//
//	import (
//		_ "github.com/goddp/goddp/backends/gloo" // the "gloo" backend (CPU)
//		"github.com/goddp/goddp/ddp"
//	)
//
// Create the group from the launcher's environment (ddprun, torchrun-style variables, srun,
// mpirun), wrap the model, then train.
//
// A trainer that computes its own gradients lists its parameters as Params ({Name, Data,
// Grad, Shape}: Data and Grad are []float32 or []float64 of the same length) and reports
// each gradient with GradReady during backward, in the order backward produces them (the
// last layer's first); Finalize leaves the gradients averaged over the ranks in each
// Param.Grad, and then the optimizer steps (Example_ownGradients runs this loop;
// examples/mlp is a whole trainer):
//
//	pg, err := ddp.InitProcessGroup(ctx, "gloo", ddp.InitOptions{Logger: log})
//	if err != nil { ... }
//	defer pg.Close() // the group, then the rendezvous store
//	d, err := ddp.New(ctx, pg, []ddp.Param{
//		{Name: "w1", Data: w1, Grad: gw1}, // index 0
//		{Name: "w2", Data: w2, Grad: gw2}, // index 1
//	}, ddp.Options{BucketCapMB: 25, Logger: log})
//	if err != nil { ... }  // e.g. "ddp: parameter 1 (w2) has shape [256 1024] on rank 0 but [256 512] on rank 1"
//	defer d.Close()
//
//	for step := 0; step < steps; step++ {
//		for mb := 0; mb < accum; mb++ {
//			mode := ddp.Accumulate           // all but the last micro-batch: NoSync
//			if mb == accum-1 {
//				mode = ddp.Sync
//			}
//			d.BeginBackward(mode)
//			forward(x[step][mb])             // this rank's shard of the micro-batch
//			backward2(mw2, 1/float32(accum)) // w2's gradient first (scaled: see NoSync below)
//			d.GradReady(1, mw2)              // never blocks; mw2 may be reused at once
//			backward1(mw1, 1/float32(accum))
//			d.GradReady(0, mw1)
//		}
//		if err := d.Finalize(ctx); err != nil { // the step's first error, if any
//			return err
//		}
//		sgd(w1, gw1); sgd(w2, gw2) // gw1, gw2: the global batch's gradient
//	}
//
// A gorgonia model is wrapped by gorgoniaddp.WrapNodes, whose taps call GradReady from
// inside the graph's backward (see package gorgoniaddp); the loop is the same, with the
// graph's run in place of forward and backward. After Finalize, d.Stats() holds the pass's
// measurements (per-bucket timeline, communication/compute overlap), which package observe
// turns into traces and reports.
//
// The closure forms do the same for one micro-batch each:
//
//	err := d.NoSync(func() error { return forwardBackward(mb) })        // accumulate
//	err := d.Backward(ctx, func() error { return forwardBackward(mb) }) // sync + Finalize
//
// # NoSync (gradient accumulation)
//
// What accumulates, and where (Note [Accumulation window] in package reducer):
//
//   - GradReady copies the gradient it is given into the DDP's own bucket buffers,
//     multiplied by 1/world size, and after the first pass of a step adds it to what is
//     there. Pass each micro-batch's own gradient, not a running sum: the DDP keeps the
//     sum. The slice may be Param.Grad itself, and may be overwritten once GradReady
//     returns.
//   - So the synced Finalize leaves in Param.Grad the sum over the step's micro-batches
//     (the NoSync passes and the synced one) of their gradients, averaged over the ranks.
//     It is a sum, not a mean, over micro-batches: scaling each micro-batch's loss or
//     gradient by 1/accum is the trainer's job (as with PyTorch's no_sync).
//   - Param.Grad is not written before the synced Finalize: not by GradReady, not by a
//     NoSync pass or its (optional) Finalize, not by a synced pass before its Finalize.
//     Finalize writes every Param.Grad (with GradientAsBucketView, nothing is copied: read
//     Grad32/Grad64 after it).
//   - A parameter that gets no gradient in the synced pass keeps what the step's NoSync
//     passes left for it (with FindUnusedParameters; without it, that fails Finalize).
//
// The GradReady order does not have to be right, or the same on every rank. Buckets hold
// parameters in reverse index order at first, and a bucket's all-reduce starts only once
// it is full and every lower-index bucket has started, so every rank issues the buckets'
// all-reduces in index order whatever order its gradients come in (Note [Bucket order] in
// package reducer). After the first synced Finalize the buckets are rebuilt, on every rank
// alike, from the order rank 0 reported (Note [Rebuild]). A wrong order costs overlap (a
// bucket waits for its predecessors), not correctness. Reporting a parameter twice in one
// pass fails the DDP (ErrMarkedTwice): report a shared parameter once, after its
// contributions are summed.
//
// # Join (uneven inputs)
//
// With Options.UnevenInputs (on every rank) the ranks may run different numbers of steps,
// as with PyTorch's Join: a rank whose data has run out calls Join in place of more steps.
// Join shadows the synced steps the others still run, with zero gradients (the same
// collectives: the hook gets zero buckets; NoSync passes need no shadow), and returns on
// every rank once all have called it, each rank then holding the parameters of a rank that
// ran every step (Note [Join]). The averages divide by the world size (a joined rank's
// share of the batch is missing, every sample weighs the same, as PyTorch's default
// divide_by_initial_world_size); Options.JoinDivideByActive divides by the ranks still
// training instead. Every synced step costs one more small all-reduce, the count of those
// ranks. The loop of the plain trainer above becomes:
//
//	d, err := ddp.New(ctx, pg, params, ddp.Options{UnevenInputs: true})
//	for batch := range myBatches { // as many as this rank has: 0, 3 or 5
//		d.BeginBackward(ddp.Sync)
//		forwardBackward(batch)     // GradReady for each gradient
//		if err := d.Finalize(ctx); err != nil {
//			return err
//		}
//		sgd(w1, gw1); sgd(w2, gw2)
//	}
//	if err := d.Join(ctx); err != nil { // until every rank's data has run out
//		return err
//	}
//
// Join comes between steps (after a synced Finalize, not after NoSync passes of an
// unfinished step). BroadcastBuffers is shadowed too (its source is then the highest
// rank still training), but collectives of the trainer's own (a loss's all-reduce) are
// not, so they must not run while a rank may be in Join. Options.Shards and
// Options.Device are refused with UnevenInputs.
//
// # ZeRO (a sharded optimizer)
//
// With Options.Zero the DDP steps the optimizer, sharded over the ranks as PyTorch's
// ZeroRedundancyOptimizer does (Note [ZeRO]): each rank owns about 1/n of every bucket's
// elements and keeps the optimizer state of those alone. Stage 1 all-reduces the gradients
// as before; stage 2 reduce-scatters each bucket as backward completes it, so that a rank
// receives only its shard's averages. Options.Optimizer makes the shard's optimizer
// (package ddp/optim: AdamW, SGD with momentum, or the trainer's own, element by element),
// and Step, in place of the trainer's optimizer, steps the shard and all-gathers the
// parameters into every Param.Data:
//
//	d, err := ddp.New(ctx, pg, params, ddp.Options{Zero: 2,
//		Optimizer: func(n int) (optim.Optimizer, error) {
//			return optim.NewAdamW(n, optim.AdamWOptions{LR: 1e-3})
//		}})
//	for step := 0; step < steps; step++ {
//		d.BeginBackward(ddp.Sync)
//		forwardBackward(x[step])         // GradReady for each gradient, as above
//		if err := d.Finalize(ctx); err != nil {
//			return err
//		}
//		if err := d.Step(ctx); err != nil { // every rank: the shard's step, then the all-gather
//			return err
//		}
//	}
//
// Stage 1 ends with the bits of the plain loop stepping the same optimizer over every
// parameter; stage 2 too with two ranks, and within float32 rounding with more. At stage 2
// only the rank's shard of Param.Grad holds averages. A checkpoint holds the whole state:
// GatherOptimizerState (every rank, before Save) fills vectors of every parameter's
// elements, and SetOptimizerState (after Restore) takes this rank's shard from them, at
// any world size or stage.
//
// With Options.ZeroOverlap (Note [ZeRO overlap]) each bucket's shard is stepped as soon as
// its reduction completes and its all-gather issued then, while backward goes on; Step
// waits for the last of them. The loop is the same and so are the bits, but the trainer
// must not read Param.Data between Finalize and Step's return, nor change Param.Grad
// then (the step has taken the reduced gradients: Step fails if they changed), and must
// call Step after every synced Finalize.
//
// With Options.ZeroForwardOverlap (Note [ZeRO forward overlap]) Step returns once it has
// issued the all-gathers, which then run during the next forward: the trainer calls
// WaitParams for a parameter before forward first reads it (gorgoniaddp's taps do), and
// WaitParams with no index before it reads them all (an evaluation, a checksum). The bits
// are the same; a Param.Data must be neither read nor written before its wait:
//
//	for step := 0; step < steps; step++ {
//		d.BeginBackward(ddp.Sync)
//		wait := func(i int) error { return d.WaitParams(ctx, i) }
//		forward(x[step], wait) // calls wait(i) where it first reads params[i]
//		backward()             // GradReady for each gradient, as above
//		if err := d.Finalize(ctx); err != nil {
//			return err
//		}
//		if err := d.Step(ctx); err != nil { // returns with the all-gathers in flight
//			return err
//		}
//	}
//
// # Shards (the same bits at every world size)
//
// With Options.Shards = L the global batch is fixed, not the per-rank batch: each step's
// batch is L logical shards, rank r of a world of n runs shards [r·L/n, (r+1)·L/n)
// (LocalShards), and Finalize leaves the mean over the L shards of their gradients, summed
// in shard order, the same bits at every world size that divides L (New refuses another
// with a *ShardsError listing the sizes that work; reducer Note [Shards]). BackwardShards
// runs one step's backward, a pass per shard, then Finalize; BeginShard does it pass by
// pass, for adapters:
//
//	for step := 0; step < steps; step++ {
//		err := d.BackwardShards(ctx, func(shard int) error {
//			forward(x[step][shard])          // the shard's micro-batch: keyed by (step, shard), never the rank
//			backward2(mw2)                   // the shard's own mean gradient, unscaled
//			d.GradReady(1, mw2)
//			backward1(mw1)
//			return d.GradReady(0, mw1)
//		})
//		if err != nil {
//			return err
//		}
//		sgd(w1, gw1); sgd(w2, gw2) // the mean over the L shards
//	}
//
// Every pass must report every parameter (there is no FindUnusedParameters with Shards),
// and random numbers (dropout, say) are the trainer's to key by (step, shard) too.
//
// With package ddp/checkpoint the trainer registers its state once (parameters, optimizer
// state, the data position in global samples) and saves it after synced steps; a restart by
// ddprun or torchrun --max_restarts, at this world size or another that divides L, resumes
// from it with the same bits as the uninterrupted run:
//
//	ck, err := checkpoint.New(pg, checkpoint.Options{Dir: dir})
//	ck.Float32("w1", w1, hidden, in) // … every parameter, and the optimizer's state
//	ck.Int64("data.next_sample", &next)
//	start, err := ck.Restore(ctx) // every rank; 0: a fresh start
//	for step := start; step < steps; step++ {
//		// d.BackwardShards(ctx, …), the optimizer, next += globalBatch
//		if (step+1)%every == 0 {
//			err = ck.Save(int64(step + 1)) // rank 0 writes
//		}
//	}
//
// # Elastic jobs (nodes that leave and join)
//
// Under ddprun --nnodes MIN:MAX a job's nodes may leave and join while it trains, and the
// survivors go on without a restart. Package ddp/elastic forms each epoch's group and hands
// the state from a survivor to every member; the trainer registers its state once and runs
// the loop above inside elastic's Run, committing after each step:
//
//	job, err := elastic.Start(ctx, elastic.Options{Shards: L})
//	job.State().Float32("w1", w1, hidden, in) // … the parameters, the optimizer's state
//	job.State().Int64("data.next_sample", &next)
//	err = job.Run(ctx, func(ctx context.Context, pg procgroup.ProcessGroup, start int64) error {
//		d, err := ddp.New(ctx, pg, params, ddp.Options{Shards: L})
//		// … defer d.Close(); for step := start; … { d.BackwardShards; sgd; next += B
//		//	if err := job.Commit(ctx, step+1); err != nil { return err } }
//	})
//
// A lost peer fails the step (or Commit) with an error that body returns; Run then forms
// the next epoch at the new size and calls body again from the last step every survivor
// committed. With Shards the run ends with the same bits however its membership changed.
//
// # Errors
//
// BeginBackward returns nothing, and an adapter's hook cannot return an error: their errors
// (and GradReady's) fail the DDP (an adapter calls Fail) and are returned by Finalize, so
// checking Finalize's error is enough. Failure is final: the process group is aborted so
// that the other ranks fail too, instead of hanging (see DDP). A mismatch between the
// ranks' models at New is a *MismatchError, the same on every rank. A NaN or an infinity
// in any rank's gradient makes Finalize return a *NonFiniteError on every rank, the same,
// naming the step, the ranks and the parameters, for instance
//
//	reducer: step 5: non-finite local gradient: rank 1: parameter 2 (w2)
//
// It is not a failure: the ranks agree, so they may stop, or skip the optimizer step and
// go on.
package ddp
