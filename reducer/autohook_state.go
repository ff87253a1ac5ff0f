package reducer

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	"go.uber.org/zap"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/bucket/sim"
)

// Note [Auto hook checkpoints]: once AutoHook has decided, its state is the decision (the
// agreed grad-ready order and the caps that built the layout, and each bucket's hook) and
// the PowerSGD states of the buckets that chose it (Note [PowerSGD checkpoints]). A resumed
// job that measured and chose again would run three more plain steps, might choose
// otherwise, and would start PowerSGD's error feedback from zero, dropping what it still
// owed. So MarshalBinary saves both, and a hook restored before its first step skips the
// measured passes: at the first BeginBackward the reducer builds the saved layout from the
// saved order and caps, and the hook takes the saved choice and PowerSGD states (adopt).
// At the world size that saved it the run goes on bit for bit; at another the PowerSGD
// errors are resized as PowerSGDHook's are, and the choice, made for the old world size,
// stands: that is also how an elastic job's next membership takes it over (ddp/elastic's
// Attach calls UnmarshalResized with the survivors' copies). A checkpoint saved before the decision holds no decision, and the resumed job
// measures and decides as a new one does.

// autoMagic starts AutoHook's saved state (version 1).
const autoMagic = "goddp-autohook-1"

// autoRestore is a decision read back from a checkpoint, checked and waiting for the
// reducer to adopt it.
type autoRestore struct {
	order              []int
	firstCap, capBytes int64
	buckets            []bucket.Bucket
	choice             []sim.Hook
	psgd               map[int]*powerSGD // set up over the buckets, their states restored
}

// MarshalBinary returns the hook's state between two steps: autoMagic, then 0 before the
// decision, or 1, the caps, the order, the buckets' hook codes and each PowerSGD state
// (rank, length, MarshalBinary's bytes) in increasing rank, little-endian.
func (h *autoHook) MarshalBinary() ([]byte, error) {
	if !h.ready {
		return nil, errors.New("reducer: auto hook: no state before New")
	}
	b := []byte(autoMagic)
	if h.choice == nil {
		return binary.LittleEndian.AppendUint64(b, 0), nil
	}
	b = binary.LittleEndian.AppendUint64(b, 1)
	b = binary.LittleEndian.AppendUint64(b, uint64(h.caps[0]))
	b = binary.LittleEndian.AppendUint64(b, uint64(h.caps[1]))
	b = binary.LittleEndian.AppendUint64(b, uint64(len(h.order)))
	for _, i := range h.order {
		b = binary.LittleEndian.AppendUint64(b, uint64(i))
	}
	b = binary.LittleEndian.AppendUint64(b, uint64(len(h.choice)))
	for _, x := range h.choice {
		b = binary.LittleEndian.AppendUint64(b, uint64(hookCode(x)))
	}
	ranks := make([]int, 0, len(h.psgd))
	for r := range h.psgd {
		ranks = append(ranks, r)
	}
	slices.Sort(ranks)
	b = binary.LittleEndian.AppendUint64(b, uint64(len(ranks)))
	for _, r := range ranks {
		st, err := h.psgd[r].MarshalBinary()
		if err != nil {
			return nil, err
		}
		b = binary.LittleEndian.AppendUint64(b, uint64(r))
		b = binary.LittleEndian.AppendUint64(b, uint64(len(st)))
		b = append(b, st...)
	}
	return b, nil
}

// autoSaved is MarshalBinary's state, parsed (decided false: saved before the decision).
type autoSaved struct {
	decided            bool
	firstCap, capBytes int64
	order              []int
	codes              []int64
	psgd               map[int][]byte
}

func parseAuto(d []byte, params int) (*autoSaved, error) {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("reducer: auto hook: not a saved state of this model: "+format, a...)
	}
	if len(d) < len(autoMagic) || string(d[:len(autoMagic)]) != autoMagic {
		return nil, bad("no %q header", autoMagic)
	}
	rd := &savedReader{d[len(autoMagic):]}
	u64 := rd.u64
	s := &autoSaved{psgd: map[int][]byte{}}
	flag, ok := u64()
	switch {
	case !ok:
		return nil, bad("truncated")
	case flag == 0:
		if len(rd.d) != 0 {
			return nil, bad("%d bytes after an undecided state", len(rd.d))
		}
		return s, nil
	case flag != 1:
		return nil, bad("decision flag %d", flag)
	}
	s.decided = true
	c0, ok0 := u64()
	c1, ok1 := u64()
	n, ok2 := u64()
	if !ok0 || !ok1 || !ok2 || n != uint64(params) {
		return nil, bad("an order of %d parameters, want %d", n, params)
	}
	s.firstCap, s.capBytes = int64(c0), int64(c1)
	s.order = make([]int, params)
	for k := range s.order {
		v, ok := u64()
		switch {
		case !ok:
			return nil, bad("truncated in the order")
		case v >= uint64(params):
			return nil, bad("order entry %d is parameter %d of %d", k, v, params)
		}
		s.order[k] = int(v)
	}
	nb, ok := u64()
	switch {
	case !ok:
		return nil, bad("truncated after the order")
	case nb > uint64(params)+2:
		return nil, bad("%d buckets", nb)
	}
	s.codes = make([]int64, nb)
	for k := range s.codes {
		v, ok := u64()
		if !ok {
			return nil, bad("truncated in the buckets' hooks")
		}
		s.codes[k] = int64(v)
	}
	ns, ok := u64()
	switch {
	case !ok:
		return nil, bad("truncated after the buckets' hooks")
	case ns > nb:
		return nil, bad("%d PowerSGD states", ns)
	}
	for range ns {
		r, ok1 := u64()
		l, ok2 := u64()
		if !ok1 || !ok2 || l > uint64(len(rd.d)) {
			return nil, bad("truncated in the PowerSGD states")
		}
		s.psgd[int(r)] = rd.d[:l]
		rd.d = rd.d[l:]
	}
	if len(rd.d) != 0 {
		return nil, bad("%d bytes after the last PowerSGD state", len(rd.d))
	}
	return s, nil
}

// UnmarshalBinary restores the state MarshalBinary saved, on this rank of a job of the
// world size that saved it. It must come after New and before the first step; the reducer
// adopts the decision at the first BeginBackward (Note [Auto hook checkpoints]).
func (h *autoHook) UnmarshalBinary(d []byte) error {
	return h.restore([][]byte{d}, func(p *powerSGD, st [][]byte) error { return p.UnmarshalBinary(st[0]) })
}

// UnmarshalResized restores this hook, rank of world, from the states that every rank of a
// job of another world size saved after one step (ddp/checkpoint's Resizer). They must
// agree on the decision; each PowerSGD state is resized as PowerSGDHook's is.
func (h *autoHook) UnmarshalResized(saved [][]byte, rank, world int) error {
	return h.restore(saved, func(p *powerSGD, st [][]byte) error { return p.UnmarshalResized(st, rank, world) })
}

// restore checks the saved states (one per saving rank) and readies the decision for the
// reducer; load restores a PowerSGD state from the saving ranks' copies of it. It changes
// the hook only once everything has been checked.
func (h *autoHook) restore(saved [][]byte, load func(*powerSGD, [][]byte) error) error {
	switch {
	case !h.ready:
		return errors.New("reducer: auto hook: restore its state after New")
	case h.choice != nil || h.launched:
		return errors.New("reducer: auto hook: restore its state before the first step")
	case len(saved) == 0:
		return errors.New("reducer: auto hook: no saved states to restore from")
	}
	var first *autoSaved
	states := map[int][][]byte{}
	for w, st := range saved {
		s, err := parseAuto(st, len(h.setup.Params))
		if err != nil {
			return fmt.Errorf("saved rank %d: %w", w, err)
		}
		if first == nil {
			first = s
		} else if s.decided != first.decided || s.firstCap != first.firstCap || s.capBytes != first.capBytes ||
			!slices.Equal(s.order, first.order) || !slices.Equal(s.codes, first.codes) || len(s.psgd) != len(first.psgd) {
			return fmt.Errorf("reducer: auto hook: the saved states of ranks 0 and %d disagree on the decision, which every rank of a job shares: not the states of one job and step", w)
		}
		for r, b := range s.psgd {
			states[r] = append(states[r], b)
		}
	}
	if !first.decided {
		h.restored = nil // saved before the decision: decide as a new job does
		return nil
	}
	params := make([]bucket.Param, len(h.setup.Params))
	for i, p := range h.setup.Params {
		params[i] = bucket.Param{Name: p.Name, DType: p.DType, Len: lenOf(p.Shape)}
	}
	bs, err := bucket.AssignOrdered(params, first.order, first.firstCap, first.capBytes)
	if err != nil {
		return fmt.Errorf("reducer: auto hook: the saved layout: %w", err)
	}
	if len(bs) != len(first.codes) {
		return fmt.Errorf("reducer: auto hook: the saved order and caps make %d buckets, and the state has hooks for %d", len(bs), len(first.codes))
	}
	choice, err := h.choiceOf(first.codes, "the saved state")
	if err != nil {
		return err
	}
	psgd, err := h.setupPowerSGD(choice, bs)
	if err != nil {
		return err
	}
	if len(psgd) != len(states) {
		return fmt.Errorf("reducer: auto hook: the saved state holds %d PowerSGD states for a choice that needs %d", len(states), len(psgd))
	}
	for r, p := range psgd {
		st, ok := states[r]
		if !ok {
			return fmt.Errorf("reducer: auto hook: no saved PowerSGD state at rank %d", r)
		}
		if err := load(p, st); err != nil {
			return fmt.Errorf("reducer: auto hook: PowerSGD at rank %d: %w", r, err)
		}
	}
	h.restored = &autoRestore{order: first.order, firstCap: first.firstCap, capBytes: first.capBytes, buckets: bs, choice: choice, psgd: psgd}
	return nil
}

// adopt takes the restored decision, for the layout bs that the reducer built from it.
func (h *autoHook) adopt(bs []bucket.Bucket) error {
	s := h.restored
	if !sameBuckets(bs, s.buckets) {
		return errors.New("reducer: auto hook: the reducer's layout from the saved order and caps is not the hook's (a bug)")
	}
	h.restored = nil
	h.choice, h.psgd = s.choice, s.psgd
	h.order, h.caps = s.order, [2]int64{s.firstCap, s.capBytes}
	return nil
}

// adopt is the reducer's part of a restored decision (Note [Auto hook checkpoints]), at the
// first BeginBackward: it builds the saved layout, owes no more rebuilds, and hands the
// hook the layout. r.mu must be held.
func (a *autoTuner) adopt(r *Reducer) error {
	s := a.hook.restored
	bs, err := bucket.AssignOrdered(r.bparams, s.order, s.firstCap, s.capBytes)
	if err != nil {
		return fmt.Errorf("reducer: auto hook: the restored layout: %w", err)
	}
	if err := a.hook.adopt(bs); err != nil {
		return err
	}
	r.m.SkipRebuilds()
	a.order, a.rebuilds, a.decided = s.order, autoPasses, true
	r.firstCap, r.capBytes = s.firstCap, s.capBytes
	if !sameBuckets(bs, r.lay.Buckets) {
		if err := r.m.SetBuckets(bs); err != nil {
			return fmt.Errorf("reducer: auto hook: the restored layout: %w", err)
		}
		if err := r.setLayout(r.m.Layout()); err != nil {
			return fmt.Errorf("reducer: auto hook: the restored layout: %w", err)
		}
		r.gen++
	}
	for t := range r.spare {
		r.spare[t].release(r.alloc)
	}
	a.plan = &AutoPlan{FirstCapBytes: s.firstCap, CapBytes: s.capBytes, Buckets: len(bs), Fixed: a.fixed, Restored: true,
		Hooks: &sim.HookPlan{Hooks: s.choice}}
	r.log.Info("reducer: "+a.plan.String(), zap.Int("rank", r.pg.Rank()))
	return nil
}
