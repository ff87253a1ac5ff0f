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
// On the GPU (Options.Device, Options.Stream; Note [Device buckets]) the loop is the same
// with GradReadyDevice(i, deviceGrad); after Finalize, kernels queued on the stream see the
// averaged gradients.
//
// With Options.GradientAsBucketView the averaged gradients are read from GradView(i), the
// bucket slots themselves (no copy back); take the views again after the first synced
// Finalize (Note [Rebuild]).
//
// Note [Device buckets]: with Options.Device the gradients live on a GPU and so do the
// buckets, allocated once per layout through the group's procgroup.Device (found through
// the watchdog and debug wrappers by procgroup.FindDevice). Everything the reducer does in
// a step is enqueued on the trainer's compute stream (Options.Stream), in stream order,
// and the host never waits:
//   - GradReadyDevice enqueues the copy of the gradient, pre-scaled by 1/world size, into
//     its bucket slot (an addition after NoSync passes), one kernel.
//   - When the bucket's last gradient has been enqueued, its collective is issued at once
//     on the group with the bucket as a procgroup.DeviceBuffer on the compute stream: the
//     backend records an event on the compute stream after that last copy and makes its
//     communication stream wait for it (nccl: Note [Stream order]), so the all-reduce
//     reads the bucket only after every kernel that wrote into it.
//   - Finalize makes the compute stream wait for each bucket's end event
//     (Device.WaitWork) and enqueues the copies back into Param.Grad (none with
//     GradientAsBucketView: GradViewDevice is the gradient); kernels the trainer queues on
//     the stream afterwards (the optimizer) see the averaged gradients.
//   - The fp16/bf16 compression hooks convert on the device, on the compute stream, and
//     PowerSGD compresses there too, with the group's procgroup.DeviceBLAS (Note
//     [PowerSGD on the device]); its state is uploaded once, at New.
//
// Since Finalize does not wait, a collective's failure is reported by the first
// BeginBackward or Finalize after it, however many passes later (Note [Late failures]),
// and, as always, by the group's watchdog, which aborts the group.
// Two steps wait on the host by design: the first synced Finalize (the rebuild's broadcast
// of rank 0's order, a host buffer), and Close (which drains the stream before freeing the
// buckets).
//
// With Options.Shards = L the step's batch is L logical shards, and the result is the same
// bits at every world size that divides L: each rank runs its shards (LocalShards), one
// pass each begun with BeginShard instead of BeginBackward; the last pass's buckets are
// gathered, and Finalize sums the shards in shard order and divides by L (Note [Shards]).
//
// With Options.BucketCapMB = AutoBucketCap the reducer chooses the caps itself from its
// first three synced passes and the step model of package bucket/sim (Note [Auto buckets]);
// AutoPlan says what it chose.
//
// A synced Finalize whose averaged gradients hold a NaN or an infinity returns a
// *NonFiniteError on every rank, naming the ranks, the step and the parameters whose local
// gradient was not finite; it costs no collective when they are finite (Note [Non-finite
// gradients]).
//
// Design notes: Note [Bucket order] and Note [Accumulation window] (Machine), Note
// [Rebuild] (Reducer.rebuild), Note [Auto buckets] (autotune.go), Note [Shards]
// (shards.go), Note [Non-finite gradients] (finite.go), Note [Bucket assignment]
// (package bucket), Note [Step model] (package bucket/sim).
package reducer
