// Package procgroup defines the collective layer of goddp: the ProcessGroup and Work
// interfaces, the open backend registry, the rendezvous Store (in memory, served over gRPC,
// or a client of PyTorch's c10d TCPStore, such as torchrun's agent store: DialTCPStore) and
// rank discovery from the environment (torchrun, srun, mpirun, Kubernetes; a single process
// when no launcher variable is set).
//
// # Usage
//
//	env, err := procgroup.InitFromEnv()                      // RANK, WORLD_SIZE, MASTER_ADDR, ...
//	store, closer, err := procgroup.Rendezvous(ctx, env, logger) // the job's rendezvous store
//	defer closer.Close()
//	pg, err := procgroup.New(ctx, "gloo", procgroup.Options{
//		Rank: env.Rank, Size: env.WorldSize, LocalRank: env.LocalRank,
//		LocalSize: env.LocalWorldSize, Store: store, Token: env.Token,
//	})
//	defer pg.Close()
//	w := pg.AllReduce(ctx, grads, procgroup.Sum) // returns at once
//	// ... other work ...
//	if err := w.Wait(ctx); err != nil { ... }     // grads now holds the sum over all ranks
//
// Backends register themselves in init(); a main package imports the ones it wants:
//
//	import _ "github.com/goddp/goddp/backends/gloo"
//
// Without the import, New (and Lookup) fail with an error wrapping ErrUnknownBackend that
// names the import to add (ExampleLookup).
//
// Two wrappers work over any backend (ddp.InitProcessGroup applies both): WithWatchdog
// numbers collectives, publishes each rank's progress through the store, warns which ranks
// have not joined a stalled collective (GODDP_STALL_WARN) and aborts every rank at the
// timeout (GODDP_COLLECTIVE_TIMEOUT); WithDebug (GODDP_DEBUG=detail) compares a fingerprint of
// every collective across ranks before issuing it and fails all ranks on a mismatch.
//
// Note [Collective order]: collectives are matched between ranks by their position in the
// sequence each rank issues, not by any name or tag. Every rank must therefore issue the same
// collectives, with the same element types and counts, in the same order; a group runs its
// works strictly in issue order.
package procgroup
