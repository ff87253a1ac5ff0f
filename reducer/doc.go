// Package reducer averages gradients across ranks the way PyTorch DDP's Reducer does:
// gradients are packed into size-capped buckets (package bucket) in reverse parameter order,
// each bucket is all-reduced asynchronously the moment its last gradient is ready while
// backward goes on, buckets launch in the same order on every rank, and after backward the
// averaged gradients are in place.
//
// The scheduling logic is Machine, a pure state machine (events in, actions out, no I/O);
// Reducer is the thin driver that performs its actions on a procgroup.ProcessGroup.
// It knows nothing of models: a caller reports each gradient with GradReady.
//
// # Usage
//
//	r, err := reducer.New(pg, []reducer.Param{{Name: "w1", Grad: w1grad}, ...}, reducer.Options{
//		BucketCapMB: 25,
//	})
//	defer r.Close()
//	for step := 0; ; step++ {
//		mode := reducer.Sync
//		if step%accum != accum-1 {
//			mode = reducer.Accumulate // NoSync: add gradients up locally
//		}
//		if err := r.BeginBackward(mode); err != nil { ... }
//		// backward: as each parameter's gradient is computed (reverse layer order):
//		//	if err := r.GradReady(i, grad); err != nil { ... }   // never blocks
//		if err := r.Finalize(ctx); err != nil { ... }            // waits for the buckets
//		if mode == reducer.Sync {
//			// every Param.Grad holds the gradient averaged over ranks (summed over the
//			// accumulated passes); step the optimizer.
//			log(r.Stats()) // timestamps per gradient and bucket, overlap
//		}
//	}
//
// With Options.GradientAsBucketView the averaged gradients are read from GradView(i), the
// bucket slots themselves (no copy back); take the views again after the first synced
// Finalize (Note [Rebuild]).
//
// Design notes: Note [Bucket order] and Note [Accumulation window] (Machine), Note
// [Rebuild] (Reducer.rebuild), Note [Bucket assignment] (package bucket).
package reducer
