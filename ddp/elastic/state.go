package elastic

import (
	"context"
	"crypto/sha256"
	"encoding"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"

	"github.com/goddp/goddp/procgroup"
)

// State is the training state a trainer registers once (Job.State): what a survivor
// hands over when the group forms again, and what each commit copies. Its methods are
// for set-up, before Job.Run.
type State struct {
	mu      sync.Mutex
	tensors []tensorState
	ints    []intState
	ranks   []*rankSlot
	config  []string // "key=value", in registration order
	names   map[string]bool
	err     error // the first bad registration, reported by Run

	step   int64 // the step of the snapshot; -1: none
	frozen bool  // a change has begun: no more commits in this epoch
}

type tensorState struct {
	name  string
	shape []int
	live  []float32 // the trainer's
	snap  []float32 // the last commit's copy
}

type intState struct {
	name string
	p    *int64
	snap int64
}

func newState() *State { return &State{names: map[string]bool{}, step: -1} }

func (s *State) register(kind, name string) bool {
	switch {
	case s.err != nil:
		return false
	case name == "" || strings.ContainsAny(name, "\n="):
		s.err = fmt.Errorf("elastic: %s name %q: want a non-empty name without '=' or a newline", kind, name)
		return false
	case s.names[name]:
		s.err = fmt.Errorf("elastic: %s %q registered twice", kind, name)
		return false
	}
	s.names[name] = true
	return true
}

// Float32 registers a tensor (parameters, optimizer moments) of the given shape (none: one
// of len(data)). A commit copies it; a restore overwrites it in place.
func (s *State) Float32(name string, data []float32, shape ...int) {
	if !s.register("tensor", name) {
		return
	}
	if len(shape) == 0 {
		shape = []int{len(data)}
	}
	n := 1
	for _, d := range shape {
		n *= max(d, 0)
	}
	if n != len(data) {
		s.err = fmt.Errorf("elastic: tensor %q: shape %v does not hold its %d values", name, shape, len(data))
		return
	}
	s.tensors = append(s.tensors, tensorState{name: name, shape: append([]int(nil), shape...), live: data, snap: make([]float32, len(data))})
}

// Int64 registers a scalar: the data position, an optimizer's step count, an RNG's state.
func (s *State) Int64(name string, p *int64) {
	if !s.register("value", name) {
		return
	}
	s.ints = append(s.ints, intState{name: name, p: p})
}

// RankState is a state each rank holds its own of, such as a comm hook's error feedback
// (ddp.PowerSGDHook): its bytes, back, and, since an epoch may have another world size
// and lose members, UnmarshalResized, which restores rank of world from the states of the
// members that held one (in rank order).
type RankState interface {
	encoding.BinaryMarshaler
	encoding.BinaryUnmarshaler
	UnmarshalResized(saved [][]byte, rank, world int) error
}

// rankSlot is a registered per-rank state.
type rankSlot struct {
	name, desc string
	live       RankState // this epoch's (Job.Attach); nil before
	snap       []byte    // its copy at the last commit
	step       int64     // snap's step; -1: none
	usable     bool      // snap is of the step this epoch resumes from
}

// PerRank registers a state that each rank holds its own of, described by desc (a comm
// hook's settings: ddp.DescribeHook's line; a process with another is refused when it
// tries to join). Its object may change each epoch (a comm hook serves one DDP): give it
// to Job.Attach in each epoch, after ddp.New, and the commits copy it from then on. See
// Note [Elastic per-rank state].
func (s *State) PerRank(name, desc string) {
	if !s.register("per-rank state", name) {
		return
	}
	if strings.Contains(desc, "\n") {
		s.err = fmt.Errorf("elastic: per-rank state %q: a description without a newline, not %q", name, desc)
		return
	}
	s.ranks = append(s.ranks, &rankSlot{name: name, desc: desc, step: -1})
}

// Config registers a setting the state depends on (a seed, the global batch): a process
// whose settings differ is refused when it tries to join (Note [Elastic rounds]).
func (s *State) Config(key, value string) {
	if !s.register("config", key) {
		return
	}
	s.config = append(s.config, key+"="+value)
}

// describe is the model's description: one line per tensor (name and shape), value and
// setting. Two processes may train together only if theirs are equal.
func (s *State) describe() string {
	var b strings.Builder
	for _, t := range s.tensors {
		fmt.Fprintf(&b, "tensor %s %v\n", t.name, t.shape)
	}
	for _, v := range s.ints {
		fmt.Fprintf(&b, "value %s\n", v.name)
	}
	for _, r := range s.ranks {
		fmt.Fprintf(&b, "per-rank %s %s\n", r.name, r.desc)
	}
	for _, c := range s.config {
		fmt.Fprintf(&b, "config %s\n", c)
	}
	return b.String()
}

// fingerprint is a short hash of describe.
func fingerprint(desc string) string {
	sum := sha256.Sum256([]byte(desc))
	return hex.EncodeToString(sum[:8])
}

// firstDifference names the first line on which two descriptions differ.
func firstDifference(mine, theirs string) string {
	a, b := strings.Split(mine, "\n"), strings.Split(theirs, "\n")
	for i := 0; i < max(len(a), len(b)); i++ {
		var x, y string
		if i < len(a) {
			x = a[i]
		}
		if i < len(b) {
			y = b[i]
		}
		if x != y {
			switch {
			case x == "":
				return fmt.Sprintf("the job has %q, this process has nothing in its place", y)
			case y == "":
				return fmt.Sprintf("this process has %q, which the job has not", x)
			}
			return fmt.Sprintf("this process has %q where the job has %q", x, y)
		}
	}
	return "none"
}

// commit copies the live state as the state after step, unless a change has frozen it
// (false). A per-rank state not attached in this epoch keeps its copy.
func (s *State) commit(step int64) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.frozen {
		return false, nil
	}
	for _, r := range s.ranks {
		if r.live == nil {
			continue
		}
		snap, err := appendState(r.live, r.snap[:0])
		if err != nil {
			return false, fmt.Errorf("elastic: per-rank state %q: %w", r.name, err)
		}
		r.snap, r.step = snap, step
	}
	for i := range s.tensors {
		copy(s.tensors[i].snap, s.tensors[i].live)
	}
	for i := range s.ints {
		s.ints[i].snap = *s.ints[i].p
	}
	s.step = step
	return true, nil
}

// appendState appends st's bytes to b, without a new buffer if st can append.
func appendState(st RankState, b []byte) ([]byte, error) {
	if a, ok := st.(interface{ AppendBinary([]byte) ([]byte, error) }); ok {
		return a.AppendBinary(b)
	}
	m, err := st.MarshalBinary()
	return append(b, m...), err
}

// detach forgets the last epoch's per-rank objects, keeping their copies that are of
// step, the step the next epoch resumes from.
func (s *State) detach(step int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range s.ranks {
		r.live = nil
		r.usable = r.snap != nil && r.step == step
	}
}

// freeze stops the commits of this epoch and returns the step of the last one.
func (s *State) freeze() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.frozen = true
	return s.step
}

// thaw allows commits again, in a new epoch.
func (s *State) thaw() {
	s.mu.Lock()
	s.frozen = false
	s.mu.Unlock()
}

// rollback puts the last commit back into the live state.
func (s *State) rollback() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range s.tensors {
		copy(s.tensors[i].live, s.tensors[i].snap)
	}
	for i := range s.ints {
		*s.ints[i].p = s.ints[i].snap
	}
}

// broadcast sends src's live state to every rank of pg.
func (s *State) broadcast(ctx context.Context, pg procgroup.ProcessGroup, src int) error {
	if len(s.ints) > 0 {
		ints := make([]int64, len(s.ints))
		for i, v := range s.ints {
			ints[i] = *v.p
		}
		if err := pg.Broadcast(ctx, ints, src).Wait(ctx); err != nil {
			return fmt.Errorf("the values: %w", err)
		}
		for i, v := range s.ints {
			*v.p = ints[i]
		}
	}
	for _, t := range s.tensors {
		if len(t.live) == 0 {
			continue
		}
		if err := pg.Broadcast(ctx, t.live, src).Wait(ctx); err != nil {
			return fmt.Errorf("tensor %q: %w", t.name, err)
		}
	}
	return nil
}
