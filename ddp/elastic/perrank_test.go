package elastic

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// fakeState is a RankState: its bytes, and the arguments of its last UnmarshalResized.
type fakeState struct {
	b       []byte
	resized [][]byte
	world   int
}

func (f *fakeState) MarshalBinary() ([]byte, error)    { return slices.Clone(f.b), nil }
func (f *fakeState) UnmarshalBinary(data []byte) error { f.b = slices.Clone(data); return nil }
func (f *fakeState) UnmarshalResized(saved [][]byte, rank, world int) error {
	f.resized, f.world = saved, world
	f.b = []byte(fmt.Sprintf("resized for %d of %d", rank, world))
	return nil
}

// attachAll forms an epoch of len(states) members, member r holding states[r] (as begin
// leaves it), and attaches fresh[r] on each, which must restore from copies copies; it
// returns their errors.
func attachAll(t *testing.T, states []*State, fresh []*fakeState, copies int) []error {
	t.Helper()
	n := len(states)
	c := pgtest.NewCluster(n)
	defer c.Close()
	errs := make([]error, n)
	c.Each(func(r int, pg procgroup.ProcessGroup) error {
		j := &Job{state: states[r], pg: pg, rank: r, log: zap.NewNop()}
		var kept int
		kept, errs[r] = j.Attach(context.Background(), "hook", fresh[r])
		if errs[r] == nil && kept != copies {
			errs[r] = fmt.Errorf("restored from %d copies, want %d", kept, copies)
		}
		return nil
	})
	return errs
}

func newHookState() *State {
	s := newState()
	s.PerRank("hook", "powersgd(rank 1)")
	return s
}

// TestElasticPerRank: each member commits its own copy of a per-rank state. An epoch
// whose members all kept a copy of the step it resumes from gives each its own back; one
// that lost a member (or whose member was a step ahead) restores every member through
// UnmarshalResized from the copies there are, in the old ranks' order; a new member
// brings none; the first epoch leaves the objects as they are. A description goes into
// the model's description, which a joining process must match.
func TestElasticPerRank(t *testing.T) {
	// Epoch 0: 3 members, fresh; each attaches and commits steps 1 and 2.
	states := []*State{newHookState(), newHookState(), newHookState()}
	hooks := []*fakeState{{b: []byte("a0")}, {b: []byte("b0")}, {b: []byte("c0")}}
	for _, s := range states {
		s.detach(-1)
		if _, err := s.commit(0); err != nil {
			t.Fatal(err)
		}
	}
	for r, err := range attachAll(t, states, hooks, 0) {
		if err != nil || hooks[r].resized != nil || !bytes.HasSuffix(hooks[r].b, []byte("0")) {
			t.Fatalf("rank %d, first epoch: %v, state %q (resized %q): want its own, untouched", r, err, hooks[r].b, hooks[r].resized)
		}
	}
	for step := int64(1); step <= 2; step++ {
		for r, s := range states {
			hooks[r].b = []byte(fmt.Sprintf("%c%d", 'a'+r, step))
			if ok, err := s.commit(step); !ok || err != nil {
				t.Fatalf("commit: %v %v", ok, err)
			}
		}
	}
	hooks[2].b = []byte("c3") // rank 2 is a step ahead when the epoch ends
	states[2].commit(3)

	// Epoch 1 resumes from step 2 with all 3: ranks 0 and 1 kept step 2, rank 2 did not.
	for _, s := range states {
		s.detach(2)
	}
	next := []*fakeState{{}, {}, {}}
	for r, err := range attachAll(t, states, next, 2) {
		want := [][]byte{[]byte("a2"), []byte("b2")}
		if err != nil || next[r].world != 3 || !slices.EqualFunc(next[r].resized, want, bytes.Equal) {
			t.Errorf("rank %d, a member a step ahead: %v; resized from %q at world %d, want %q at 3", r, err, next[r].resized, next[r].world, want)
		}
	}

	// Epoch 2 resumes from step 2 (no commit since): 2 survivors, each with its copy, and a
	// new member.
	survivors := []*State{states[1], states[0], newHookState()}
	for _, s := range survivors {
		s.detach(2)
	}
	joined := []*fakeState{{}, {}, {b: []byte("new")}}
	errs := attachAll(t, survivors, joined, 2)
	for r, err := range errs {
		if err != nil || len(joined[r].resized) != 2 {
			t.Errorf("rank %d, with a new member: %v, resized from %q", r, err, joined[r].resized)
		}
	}

	// Epoch 3: the same two survivors alone, both with the copy of step 2 made by Attach:
	// each its own.
	two := []*State{survivors[0], survivors[1]}
	for _, s := range two {
		s.detach(2)
	}
	own := []*fakeState{{}, {}}
	for r, err := range attachAll(t, two, own, 2) {
		if want := fmt.Sprintf("resized for %d of 3", r); err != nil || own[r].resized != nil || string(own[r].b) != want {
			t.Errorf("rank %d, every member with its copy: %v, state %q (resized %q), want its own %q", r, err, own[r].b, own[r].resized, want)
		}
	}

	if d := newHookState().describe(); !strings.Contains(d, "per-rank hook powersgd(rank 1)\n") {
		t.Errorf("the description lacks the per-rank state:\n%s", d)
	}
	j := &Job{state: newHookState()}
	if _, err := j.Attach(context.Background(), "other", &fakeState{}); err == nil || !strings.Contains(err.Error(), `"other": not a registered per-rank state`) {
		t.Errorf("Attach of an unregistered state: %v", err)
	}
}
