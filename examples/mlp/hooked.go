package main

import (
	"context"
	"fmt"

	"github.com/goddp/goddp/ddp"
)

// With --global_batch_size and a --comm_hook (powersgd, fp16, bf16), ddp cannot sum the
// shards in shard order (ddp.Options.Shards takes no hook: the hook is what reduces). The
// step's batch is still the L shards: rank r of n runs shards [r·L/n, (r+1)·L/n), adds up
// their gradients (every pass but the last under NoSync), each scaled by n/L, and the
// hook reduces the mean over the ranks, which is the mean over the shards. The bits then
// depend on the world size, as a hook's rounding does, but the data of a step do not: a
// checkpoint resumes at another world size, and an elastic job may change it
// (a comm hook's state goes with it: its checkpoint.PerRank and elastic Attach).

// ddpShards is ddp.Options.Shards for the flags: none with a comm hook.
func (f flags) ddpShards() int {
	if f.commHook != "" && f.commHook != "none" {
		return 0
	}
	return f.shards()
}

// localShards returns the shards [lo, hi) this rank of d runs, of L.
func localShards(d *ddp.DDP, L int) (lo, hi int, err error) {
	if lo, hi = d.LocalShards(); hi > lo {
		return lo, hi, nil
	}
	n, r := d.Size(), d.Rank()
	if L%n != 0 {
		return 0, 0, fmt.Errorf("--global_batch_size / --micro_batch_size: the %d shards of a step do not divide among %d ranks", L, n)
	}
	return r * L / n, (r + 1) * L / n, nil
}

// backwardShards runs this rank's shards [lo, hi) of a step through d: BackwardShards
// with ddp.Options.Shards, otherwise (a comm hook) a pass per shard, synced at the last.
func backwardShards(ctx context.Context, d *ddp.DDP, lo, hi int, shard func(s int) error) error {
	if l, h := d.LocalShards(); h > l {
		return d.BackwardShards(ctx, shard)
	}
	for s := lo; s < hi; s++ {
		mode := ddp.Accumulate
		if s == hi-1 {
			mode = ddp.Sync
		}
		d.BeginBackward(mode)
		if err := shard(s); err != nil {
			return d.Fail(fmt.Errorf("shard %d: %w", s, err))
		}
	}
	return d.Finalize(ctx)
}
