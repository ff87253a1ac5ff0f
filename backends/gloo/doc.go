// Package gloo is goddp's pure-Go CPU backend: collectives over a full mesh of Unix domain
// socket (same host) or TCP (between hosts) connections, set up through the rendezvous
// store, with shared memory for the all-reduce data of same-host ranks. It registers
// itself as "gloo".
//
// # Usage
//
//	import _ "github.com/goddp/goddp/backends/gloo"
//
//	pg, err := procgroup.New(ctx, "gloo", procgroup.Options{
//		Rank: rank, Size: size, Store: store, Token: token,
//		Backend: &gloo.Config{Transport: "auto", Algorithm: "auto"}, // optional
//	})
//	defer pg.Close()
//	w := pg.AllReduce(ctx, grads, procgroup.Sum)
//	err = w.Wait(ctx)
//
// GODDP_GLOO_TRANSPORT (auto, tcp, unix), GODDP_GLOO_ALGO (auto, ring, direct),
// GODDP_GLOO_SHM (auto, off) and GODDP_GLOO_VMREADV (auto, off) override the Config.
//
// # Design
//
// Setup: each rank listens (an abstract Unix socket and/or TCP), publishes its addresses
// and host id under "<prefix>/gloo/<rank>", dials every lower rank and accepts every higher
// one. Each connection is authenticated both ways with the job token before anything else
// is read (Note [Handshake]); frames are length-bounded (Note [Wire format]). Strangers are
// refused and logged; the listener keeps refusing them for the group's life.
//
// Algorithms: small messages use direct exchange (every rank sends its buffer to every
// other and reduces all of them in rank order), written inline by the worker goroutine;
// large ones a pipelined ring, reduce-scatter then all-gather, in segments of about a
// quarter chunk (at most Config.SegmentSize) handed to per-peer writer goroutines
// (Note [Ring]). Two ranks joined by a socket (TCP, or Unix without shared memory) instead
// exchange their whole buffers, run inline by the worker with non-blocking sendmsg/recvmsg
// and poll(2), no goroutine hand-off (Note [Inline exchange], Linux). Broadcast is direct
// or a pipelined chain; AllGather and ReduceScatter are ring or direct; Barrier is an
// empty direct exchange. Every rank ends with bit-identical results.
//
// Shared memory (Linux): after the mesh is authenticated, each host's lowest rank creates
// one memfd region and passes it over its Unix sockets (SCM_RIGHTS) to the same-host ranks.
// The all-reduce then moves its data through per-pair slot rings in that region, run
// inline by the worker with no goroutine hand-off: the sender copies a segment into a slot,
// the receiver reduces straight out of it, and a futex doorbell wakes a rank that sleeps
// (Note [Shared memory] in shm_linux.go). Where the kernel lets every rank read the others
// (process_vm_readv), the collectives on the user's own buffers read the peers' buffers
// straight instead, one copy by the kernel (Note [Single copy] in cma_linux.go). The
// sockets still carry the small collectives, aborts and liveness, so the failure rules
// below are unchanged.
//
// Threads: one worker goroutine per group runs works in issue order and does all reads;
// each peer has one writer goroutine (Note [Threads] on group), idle on the inline paths
// (small direct messages, the two-rank exchange, shared memory). Reductions and copies are
// typed loops (internal/kernels; AVX2 for float32/float64 sums on amd64) on reused
// buffers: a collective allocates nothing in steady state (the Work handle is the only
// per-call allocation).
//
// Failures: a read blocked longer than Config.PollInterval checks the group's abort, the
// ctx and the timeout of the collective, and probes every peer's socket (Note [Stalls]), so
// a dead peer fails the pending work within about a second with a *PeerLostError naming it
// (errors.Is procgroup.ErrPeerLost). The rank that first sees a loss tells the others in an
// abort frame, so they name the dead rank rather than the messenger. Timeouts fail with
// procgroup.ErrTimeout naming the op and sequence number; any failure aborts the group.
package gloo
