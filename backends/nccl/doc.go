// Package nccl is the GPU backend of goddp: NCCL collectives on CUDA streams, registered
// as procgroup backend "nccl".
//
// NCCL (libnccl.so.2) and the CUDA driver (libcuda.so.1) are loaded with dlopen when the
// first group is created, through a small C shim whose prototypes live in shim.h: the
// package builds with any C compiler, without CUDA headers, and on a machine without a GPU
// New fails with an error wrapping ErrUnavailable that names the missing library or device
// and the variable that points at it (GODDP_NCCL_LIB, GODDP_CUDA_LIB). New logs NCCL's
// version.
//
// Each rank uses device Options.LocalRank (one GPU per rank: NCCL refuses two ranks on one
// device). Rank 0 creates the ncclUniqueId and publishes it through Options.Store; the
// communicator is created once. Collectives accept host slices (staged through pinned
// memory and device scratch; bfloat16 and float16 reduced natively by NCCL) or
// DeviceBuffers; Avg is ncclAvg (NCCL 2.10 or later).
//
// Note [Stream order]: the group has one communication stream. A collective on a
// DeviceBuffer records an event on the buffer's Stream and makes the comm stream wait for
// it (on the GPU, no host synchronisation), so it sees everything queued on the compute
// stream before it was issued; AllGather and ReduceScatter do the same with the output
// buffer's Stream where it differs from the input's, so that nothing queued there before
// overwrites the result. Its Work completes (Wait, Done) once its end event has
// completed; (*Work).WaitStream instead makes another stream wait for that event, without
// blocking the host.
//
// A watchdog goroutine per group completes works in order, polls ncclCommGetAsyncError and
// the collective timeout (Options.Timeout); on an error it calls ncclCommAbort and fails
// every pending work with an error naming the rank, op and sequence number, wrapping
// procgroup.ErrAborted (and procgroup.ErrTimeout for a timeout).
//
// A collective's ctx bounds the whole collective, queueing included: collectives are issued
// one at a time, in order, so one may wait for the one before it, even a healthy one that
// is copying a large host buffer into its staging area. A ctx that ends at any point
// before the work completes, there too, aborts the group rather than skip the collective:
// a rank that skips a collective its peers make desynchronises every later one. So give
// collectives a ctx that outlasts the slowest issue and collective (Options.Timeout already
// bounds them), and use a short one only to abort the group.
//
// # Usage
//
//	import _ "github.com/goddp/goddp/backends/nccl" // in package main
//
//	pg, err := procgroup.New(ctx, "nccl", procgroup.Options{Rank: rank, Size: size,
//		LocalRank: localRank, LocalSize: localSize, Store: store})
//	// host buffers, as with gloo:
//	err = pg.AllReduce(ctx, grads, procgroup.Sum).Wait(ctx)
//	// device buffers, stream-ordered. ddp.InitProcessGroup wraps the group (its ddp.Group,
//	// the watchdog, and debug with GODDP_DEBUG=detail): reach the backend through the
//	// wrappers with procgroup.Find / FindWork, and issue collectives on the outer group.
//	g, _ := procgroup.Find[*nccl.Group](pg)
//	buf, _ := g.Alloc(procgroup.Float32, n) // or nccl.DeviceBuffer{Ptr: ..., Stream: computeStream}
//	buf.Stream = computeStream
//	w := pg.AllReduce(ctx, buf, procgroup.Avg)
//	_ = g.WaitWork(computeStream, w) // later kernels on computeStream see the result; or:
//	nw, _ := procgroup.FindWork[*nccl.Work](w)
//	_ = nw.WaitStream(computeStream)
//
// The group uses the primary context of its device. Every entry point makes it current
// for its own driver calls only and then restores the calling thread's context (Note
// [Caller's context] in shim.c), so a caller with a context of its own keeps it. Device
// memory and streams must belong to that primary context: a collective on another
// context's memory or stream fails at once with an error wrapping
// procgroup.ErrInvalidArgument that names both contexts. CU_STREAM_PER_THREAD is refused
// (goroutines move between OS threads), as procgroup.ErrInvalidArgument too.
//
// Group implements procgroup.Device (memory, ScaleAsync and ConvertAsync kernels, events,
// WaitWork), which the reducer uses for device-resident buckets (reducer Note [Device
// buckets]). Its kernels are PTX (kernels/kernels.ptx, generated from kernels/kernels.ll by
// kernels/gen.sh), JIT-compiled by the driver when first used.
//
// With the cuda build tag, FromCU and (*Work).WaitCU accept gorgonia.org/cu's DevicePtr
// and Stream (see scripts/cuda_headers.sh for building without a CUDA install).
//
// Tests run the whole backend against fake libcuda/libnccl libraries written in C
// (testdata/fake), compiled in TestMain; scripts/gpu_check.sh runs the GPU tests on a real
// device. The fakes act like the real libraries where bugs hide: a collective blocks in its
// host call until the peers arrive, the current context is per thread, and the legacy
// default stream synchronises with blocking streams.
package nccl
