// Package gloo is goddp's pure-Go CPU backend: collectives over a full mesh of Unix domain
// socket (same host) or TCP (between hosts) connections, set up through the rendezvous
// store. It registers itself as "gloo".
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
// GODDP_GLOO_TRANSPORT (auto, tcp, unix) and GODDP_GLOO_ALGO (auto, ring, direct) override
// the Config.
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
// large ones a pipelined ring, reduce-scatter then all-gather, in segments of
// Config.SegmentSize handed to per-peer writer goroutines (Note [Ring]). Broadcast is
// direct or a pipelined chain; AllGather and ReduceScatter are ring or direct; Barrier is
// an empty direct exchange. Every rank ends with bit-identical results.
//
// Threads: one worker goroutine per group runs works in issue order and does all reads;
// each peer has one writer goroutine (Note [Threads] on group). Reductions and copies are
// typed loops (internal/kernels) on reused buffers: a collective allocates nothing in
// steady state (the Work handle is the only per-call allocation).
//
// Failures: a read blocked longer than Config.PollInterval checks the group's abort, the
// ctx and the timeout of the collective, and probes every peer's socket (Note [Stalls]), so
// a dead peer fails the pending work within about a second with a *PeerLostError naming it
// (errors.Is procgroup.ErrPeerLost). The rank that first sees a loss tells the others in an
// abort frame, so they name the dead rank rather than the messenger. Timeouts fail with
// procgroup.ErrTimeout naming the op and sequence number; any failure aborts the group.
package gloo
