package checkpoint

import (
	"context"
	"encoding"
	"errors"
	"fmt"
	"slices"
	"strings"

	"go.uber.org/zap"

	"github.com/goddp/goddp/ddp/internal/blobs"
	"github.com/goddp/goddp/procgroup"
)

// RankState is state that each rank holds its own of, such as a comm hook's error
// feedback (ddp.PowerSGDHook): its bytes between two steps, and back.
type RankState interface {
	encoding.BinaryMarshaler
	encoding.BinaryUnmarshaler
}

// Resizer is a RankState that can resume at another world size: UnmarshalResized
// restores the state of rank of world from the states that the ranks of the saving job
// (len(saved) of them, in rank order) marshalled after one step. Without it, a checkpoint
// resumes only at the world size that wrote it.
type Resizer interface {
	UnmarshalResized(saved [][]byte, rank, world int) error
}

// perRank is a registered RankState.
type perRank struct {
	name, desc string
	s          RankState
	saved      [][]byte // Save's gathered states, or Restore's read or received ones, by rank
}

// PerRank registers a state that each rank holds its own of, whose desc says what it is
// and with which settings (for a comm hook, ddp.DescribeHook's line). With one registered,
// Save is a collective: every rank calls it, and rank 0's file holds every rank's state.
// Restore gives each rank back its own when the world size is the one that saved it, and
// calls the state's UnmarshalResized (Resizer) at another (a state without it is refused
// there, naming it). A checkpoint written with another desc, or without this state, is
// refused with an error naming both; so is one holding a per-rank state that this run has
// not registered. See Note [PowerSGD checkpoints] in package reducer.
func (c *Checkpointer) PerRank(name, desc string, s RankState) {
	if !c.register("per-rank state", name) {
		return
	}
	if s == nil || len(desc) > maxName {
		c.regErr = fmt.Errorf("checkpoint: per-rank state %q: want a state and a description of at most %d bytes", name, maxName)
		return
	}
	c.ranks = append(c.ranks, &perRank{name: name, desc: desc, s: s})
}

// world is the size of c's group (1 alone).
func (c *Checkpointer) world() int {
	if c.pg == nil {
		return 1
	}
	return c.pg.Size()
}

// gatherRanks collects every rank's per-rank states into saved on rank 0 (Save's part, a
// collective). A rank whose state does not marshal still takes part, and every rank
// returns an error naming the ranks that failed.
func (c *Checkpointer) gatherRanks(ctx context.Context) error {
	var merr error
	var bad []int
	for _, p := range c.ranks {
		b, err := p.s.MarshalBinary()
		switch {
		case err != nil:
			merr, b = errors.Join(merr, fmt.Errorf("checkpoint: per-rank state %q: %w", p.name, err)), nil
		case b == nil:
			b = []byte{}
		}
		if c.pg == nil {
			p.saved = [][]byte{b}
			continue
		}
		all, err := blobs.AllGather(ctx, c.pg, b) // a nil b: this rank failed
		if err != nil {
			return fmt.Errorf("rank %d: checkpoint: gathering per-rank state %q: %w", c.rank, p.name, err)
		}
		for r, b := range all {
			if b == nil && !slices.Contains(bad, r) {
				bad = append(bad, r)
			}
		}
		if c.rank == 0 {
			p.saved = all
		}
	}
	switch {
	case merr != nil && c.pg != nil:
		return fmt.Errorf("rank %d: %w", c.rank, merr)
	case merr != nil:
		return merr
	case len(bad) > 0:
		slices.Sort(bad)
		return fmt.Errorf("rank %d: checkpoint: ranks %v could not save their per-rank states (see their errors)", c.rank, bad)
	}
	return nil
}

// rankRecord is a per-rank state as a file holds it.
type rankRecord struct {
	name, desc string
	lens       []int64 // by saving rank
}

// checkRanks compares the file's per-rank states with the registration (decode's part):
// the error names both sides.
func (c *Checkpointer) checkRanks(recs []rankRecord, path string, step int64) error {
	byName := map[string]rankRecord{}
	for _, r := range recs {
		byName[r.name] = r
	}
	for _, p := range c.ranks {
		r, ok := byName[p.name]
		switch {
		case !ok:
			return fmt.Errorf("checkpoint %s of step %d holds no %s state (this run has %s %s)", path, step, p.name, p.name, p.desc)
		case r.desc != p.desc:
			return fmt.Errorf("checkpoint %s of step %d was written with %s %s (this run has %s %s)", path, step, p.name, r.desc, p.name, p.desc)
		}
		if _, ok := p.s.(Resizer); !ok && len(r.lens) != c.world() {
			return fmt.Errorf("checkpoint %s of step %d: %s %s was saved by %d ranks and cannot resume at %d", path, step, p.name, p.desc, len(r.lens), c.world())
		}
		delete(byName, p.name)
	}
	for _, r := range recs {
		if _, ok := byName[r.name]; ok {
			return fmt.Errorf("checkpoint %s of step %d holds the %s state of %s (this run keeps no %s state)", path, step, r.name, r.desc, r.name)
		}
	}
	return nil
}

// broadcastRanks sends src's per-rank states (read from its file) to every rank.
func (c *Checkpointer) broadcastRanks(ctx context.Context, src int) error {
	for _, p := range c.ranks {
		saved, err := blobs.Broadcast(ctx, c.pg, p.saved, src)
		if err != nil {
			return fmt.Errorf("per-rank state %q: %w", p.name, err)
		}
		if len(saved) == 0 {
			return fmt.Errorf("per-rank state %q: saved by no rank", p.name)
		}
		p.saved = saved
	}
	return nil
}

// restoreRanks restores each per-rank state from the saved ones (Restore's last part,
// a collective with a group: the ranks agree that all of them succeeded).
func (c *Checkpointer) restoreRanks(ctx context.Context) error {
	if len(c.ranks) == 0 {
		return nil
	}
	rank, world := c.rank, c.world()
	var errs []string
	for _, p := range c.ranks {
		var err error
		if saved := len(p.saved); saved == world {
			err = p.s.UnmarshalBinary(p.saved[rank])
		} else if rs, ok := p.s.(Resizer); ok {
			err = rs.UnmarshalResized(p.saved, rank, world)
			if err == nil && rank == 0 {
				c.log.Info("checkpoint: a per-rank state resumed at another world size", zap.String("state", p.name), zap.Int("saved_by", saved), zap.Int("world", world))
			}
		} else {
			err = fmt.Errorf("saved by %d ranks, resumed by %d", saved, world)
		}
		p.saved = nil
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s %s: %v", p.name, p.desc, err))
		}
	}
	failed := int64(len(errs))
	if c.pg != nil {
		all := []int64{failed}
		if err := c.pg.AllReduce(ctx, all, procgroup.Sum).Wait(ctx); err != nil {
			return fmt.Errorf("rank %d: checkpoint: agreeing on the per-rank states: %w", c.rank, err)
		}
		if all[0] > 0 && failed == 0 {
			return fmt.Errorf("rank %d: checkpoint: other ranks could not restore their per-rank states (see their errors)", c.rank)
		}
	}
	if failed > 0 {
		return fmt.Errorf("rank %d: checkpoint: restoring %s", c.rank, strings.Join(errs, "; "))
	}
	return nil
}
