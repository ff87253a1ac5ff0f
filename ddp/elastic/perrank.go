package elastic

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"github.com/goddp/goddp/ddp/internal/blobs"
	"github.com/goddp/goddp/procgroup"
)

// Note [Elastic per-rank state]: a per-rank state (PerRank), such as PowerSGD's error
// feedback, differs between the ranks, so no survivor's copy can stand for the others'.
// Each member commits its own copy with the rest of the state. When an epoch forms, the
// copies of the step it resumes from are kept (a survivor one step ahead has none of that
// step); the trainer makes the epoch's object (a comm hook is made with its DDP) and
// gives it to Attach, which gathers the kept copies of every member and restores from
// them: each member its own if every member kept one (the same ranks), and otherwise
// UnmarshalResized over the copies there are, in the order of the old ranks. The state of
// a member that was lost is lost with it: for PowerSGD (Note [PowerSGD checkpoints] in
// package reducer) the error feedback of the survivors is kept whole, spread over the new
// world, and what the lost rank's error still owed is dropped, once. A member that joins
// brings no copy. With no copy anywhere (the job's first epoch) the object keeps its own
// state.

// Attach gives the per-rank state name its object for this epoch (made after the epoch's
// ddp.New: its state exists) and restores it from the members' copies of the step the
// epoch resumes from (Note [Elastic per-rank state]). Every member calls it, inside Run's
// body, before the epoch's first step; the commits copy s from then on. It returns the
// number of members' copies it restored from (0: s keeps its state). Outside an elastic
// launcher it only attaches s.
func (j *Job) Attach(ctx context.Context, name string, s RankState) (int, error) {
	var slot *rankSlot
	for _, r := range j.state.ranks {
		if r.name == name {
			slot = r
		}
	}
	if slot == nil || s == nil {
		return 0, fmt.Errorf("elastic: Attach %q: not a registered per-rank state (State.PerRank), or a nil state", name)
	}
	if j.static != nil {
		return 0, j.state.attach(slot, s)
	}
	var mine []byte
	if slot.usable {
		mine = slot.snap
	}
	all, err := blobs.AllGather(ctx, j.pg, mine)
	if err != nil {
		return 0, fmt.Errorf("elastic: per-rank state %q: gathering the members' copies: %w", name, err)
	}
	var kept [][]byte
	for _, b := range all {
		if b != nil {
			kept = append(kept, b)
		}
	}
	rank, world := j.rank, j.pg.Size()
	var rerr error
	switch {
	case len(kept) == 0: // a new job
	case len(kept) == world:
		rerr = s.UnmarshalBinary(all[rank])
	default:
		rerr = s.UnmarshalResized(kept, rank, world)
	}
	failed := []int64{0}
	if rerr != nil {
		failed[0] = 1
	}
	if err := j.pg.AllReduce(ctx, failed, procgroup.Sum).Wait(ctx); err != nil {
		return 0, fmt.Errorf("elastic: per-rank state %q: %w", name, err)
	}
	switch {
	case rerr != nil:
		return 0, fmt.Errorf("elastic: rank %d: per-rank state %q (%s), from %d members' copies: %w", rank, name, slot.desc, len(kept), rerr)
	case failed[0] > 0:
		return 0, fmt.Errorf("elastic: rank %d: per-rank state %q: %d other member(s) could not restore it (see their errors)", rank, name, failed[0])
	}
	if rank == 0 && len(kept) > 0 && len(kept) < world {
		j.log.Info("elastic: a per-rank state restored from some members' copies", zap.String("state", name), zap.Int("copies", len(kept)), zap.Int("world", world))
	}
	return len(kept), j.state.attach(slot, s)
}

// attach makes s slot's live object and copies it as of the last commit's step.
func (s *State) attach(slot *rankSlot, st RankState) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	snap, err := appendState(st, slot.snap[:0])
	if err != nil {
		return fmt.Errorf("elastic: per-rank state %q: %w", slot.name, err)
	}
	slot.live, slot.snap, slot.step, slot.usable = st, snap, s.step, true
	return nil
}
