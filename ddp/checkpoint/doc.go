// Package checkpoint saves a trainer's state to disk and restores it, at any world size:
// what ddprun --max_restarts and torchrun --max_restarts need, since they restart every
// worker on a failure or a change of membership.
//
// A trainer registers its state once: the parameters and the optimizer's state as float32
// tensors (Float32, with their shapes), scalars such as the optimizer's step count and the
// data position (Int64; an RNG's state too, if the trainer has any not keyed by the step),
// and the settings the state depends on (Config). Restore, a collective, loads the newest
// checkpoint into that state and returns the step to continue from; Save writes it:
//
//	ck, err := checkpoint.New(pg, checkpoint.Options{Dir: dir, Logger: log})
//	for _, p := range params {
//		ck.Float32(p.Name, p.Data, p.Shape...)
//	}
//	ck.Float32("adamw.m", m)
//	ck.Float32("adamw.v", v)
//	ck.Int64("adamw.step", &optStep)
//	ck.Int64("data.next_sample", &next) // in global samples, not per rank
//	ck.Config("--seed", strconv.FormatUint(seed, 10))
//	start, err := ck.Restore(ctx) // 0: a fresh start
//	for step := start; step < steps; step++ {
//		// forward, backward, d.Finalize (or d.BackwardShards), the optimizer
//		next += globalBatch
//		if (step+1)%every == 0 || step+1 == steps {
//			if err := ck.Save(step + 1); err != nil { … }
//		}
//	}
//
// # At any world size
//
// A file holds no world size and no rank (but for a per-rank state, below, which holds a
// copy per saving rank): with ddp.Options.Shards the replicas hold the same bits at every
// world size, and the data position counts global steps or samples, so a checkpoint
// written by 3 ranks is resumed by 2, or by 1, and the run ends with the bits of the
// uninterrupted one. (A trainer whose data do depend on the world size registers it with
// Config, and a resume at another size is refused.)
//
// Rank 0 alone writes: after a synced step every replica holds the same state (a per-rank
// state is gathered to it), so one copy is enough, and n ranks on a shared file system do not write it n times. Every rank reads:
// each finds the newest file of its own Options.Dir whose CRC is right, the ranks exchange
// their steps (an all-gather), the newest wins, and if some rank lacks that file (a host
// without a shared file system, a new host) the lowest rank holding it broadcasts the state
// over the process group. So the files need be on rank 0's host only, and a restart that
// places rank 0 elsewhere still resumes.
//
// # Per-rank state
//
// A state that each rank holds its own of, such as PowerSGD's error feedback, is
// registered with PerRank (a RankState, with a description such as ddp.DescribeHook's
// line). Save is then a collective: the ranks' states are gathered into rank 0's file of
// the step, so they are written in its one atomic write. Restore gives each rank its own
// back at the world size that saved them (the run goes on bit for bit), and at another
// world size hands all of them to the state's UnmarshalResized (Resizer), which decides
// what each new rank takes; a state that cannot resize is refused there. A checkpoint with
// another description, or without the state, is refused naming both.
//
// # Files
//
// Options.Dir holds step<S>.ckpt, the state after steps 0 … S−1. A write is atomic: a
// temporary file, fsync, rename, then an fsync of the directory, so a crash mid-write
// leaves the earlier files intact (and the next Restore removes its temporary file). After
// a write, the files beyond the Keep (2) newest, and any of a later step (left by an
// abandoned attempt), are removed. A file ends with a CRC-32 of its bytes; a newest file
// that is corrupt or cut short is skipped with a warning (to Options.Logger) and the one
// before is used. A checkpoint of another run (a Config differs) or another model (a
// tensor missing, extra or of another shape) is refused with an error naming the setting
// or the tensor. A first attempt (no $TORCHELASTIC_RESTART_COUNT, or 0) without
// Options.Resume refuses a directory that holds checkpoints (ErrExists) rather than mix
// two runs.
package checkpoint
