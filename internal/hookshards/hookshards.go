// Package hookshards runs a step of logical shards (a fixed global batch, the example
// trainers' --global_batch_size) through a DDP with a comm hook. ddp.Options.Shards takes
// no hook, since it gathers the shards' gradients and sums them in shard order, whereas a
// hook is what reduces. Here rank r of n runs shards [r·L/n, (r+1)·L/n), adds up their
// gradients (every pass but the last under NoSync), each scaled by n/L (Scale), and the
// hook reduces the mean over the ranks, which is then the mean over the shards. The data
// of a step do not depend on the world size, so a checkpoint resumes at another and an
// elastic job may change it; the bits do depend on it, as a hook's rounding does.
package hookshards

import (
	"context"
	"fmt"

	"github.com/goddp/goddp/ddp"
)

// Local returns the shards [lo, hi) of L that this rank of d runs: d.LocalShards with
// ddp.Options.Shards, otherwise its even share, if the world size divides L.
func Local(d *ddp.DDP, L int) (lo, hi int, err error) {
	if lo, hi = d.LocalShards(); hi > lo {
		return lo, hi, nil
	}
	n, r := d.Size(), d.Rank()
	if L <= 0 || L%n != 0 {
		return 0, 0, fmt.Errorf("--global_batch_size / --micro_batch_size: the %d shards of a step do not divide among %d ranks", L, n)
	}
	return r * L / n, (r + 1) * L / n, nil
}

// Scale is the factor of a shard's gradient (its loss's) for Backward without
// ddp.Options.Shards: 1/(hi−lo), the ranks' count over the shards'. With Options.Shards
// it is 1.
func Scale(d *ddp.DDP, lo, hi int) float64 {
	if l, h := d.LocalShards(); h > l {
		return 1
	}
	return 1 / float64(hi-lo)
}

// Backward runs this rank's shards [lo, hi) of a step through d, pass(s) running shard
// s's forward and backward (its gradient scaled by Scale): d.BackwardShards with
// ddp.Options.Shards, otherwise a pass per shard, synced at the last, and Finalize.
func Backward(ctx context.Context, d *ddp.DDP, lo, hi int, pass func(s int) error) error {
	if l, h := d.LocalShards(); h > l {
		return d.BackwardShards(ctx, pass)
	}
	for s := lo; s < hi; s++ {
		mode := ddp.Accumulate
		if s == hi-1 {
			mode = ddp.Sync
		}
		d.BeginBackward(mode)
		if err := pass(s); err != nil {
			return d.Fail(fmt.Errorf("shard %d: %w", s, err))
		}
	}
	return d.Finalize(ctx)
}

// Options is ddp.Options.Shards for a trainer's --comm_hook and its L shards: L with no
// hook ("none" or ""), 0 with one, which then reduces the shards through Backward.
func Options(commHook string, L int) int {
	if commHook != "" && commHook != "none" {
		return 0
	}
	return L
}
