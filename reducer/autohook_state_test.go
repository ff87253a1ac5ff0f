package reducer

import (
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/bucket/sim"
	"github.com/goddp/goddp/procgroup"
)

// TestAutoHookState: a run with AutoHook stopped two steps after its decision, its hooks'
// states saved and restored into new Reducers with new hooks, ends the remaining steps with
// the bits of the run that never stopped, on every rank and for each mix of hooks, and the
// resumed run measures nothing (no probe, no rebuild: it issues no broadcast). Resumed
// through UnmarshalResized, the errors are averaged over the ranks: the results stay within
// float32 rounding of the uninterrupted run's.
func TestAutoHookState(t *testing.T) {
	const steps, stop = 8, autoPasses + 2
	opts := Options{BucketCapMB: 0.04, FirstBucketCapMB: 0.01} // two buckets: a matrix each
	r2, r4 := sim.Hook{Kind: "powersgd", Rank: 2}, sim.Hook{Kind: "powersgd", Rank: 4}
	none, bf := sim.Hook{Kind: "none"}, sim.Hook{Kind: "bf16"}
	for _, force := range [][]sim.Hook{{r2, r4}, {bf, r2}, {none, none}} {
		mk := func() CommHook {
			h := AutoHook(AutoHookOptions{}).(*autoHook)
			h.force = force
			return h
		}
		whole := runHook(t, mk, opts, 0, 0, steps, 21)
		first := runHookFrom(t, mk, opts, 0, 0, 0, stop, 21, nil)
		rest := runHookFrom(t, mk, opts, 0, 0, stop, steps, 21, func(rank int, h CommHook) error {
			return h.(*autoHook).UnmarshalBinary(first.saved[rank])
		})
		resized := runHookFrom(t, mk, opts, 0, 0, stop, steps, 21, func(rank int, h CommHook) error {
			return h.(*autoHook).UnmarshalResized(first.saved, rank, 2)
		})
		for w := range rest.out {
			if p := rest.plans[w]; p == nil || !p.Restored || p.Hooks == nil || !slices.Equal(p.Hooks.Hooks, force) {
				t.Fatalf("%v: rank %d's plan after the restore: %v", force, w, p)
			}
			if !slices.EqualFunc(rest.buckets[w], whole.buckets[w], func(a, b bucket.Bucket) bool { return slices.Equal(a.Params, b.Params) }) {
				t.Fatalf("%v: rank %d's layout after the restore differs", force, w)
			}
			for _, rec := range rest.issued[w] {
				if rec.Op == procgroup.OpBroadcast {
					t.Fatalf("%v: rank %d: the resumed run issued a broadcast (%+v): it measured again", force, w, rec)
				}
			}
			for k := range steps - stop {
				for i := range autoShapes {
					if !slices.Equal(rest.out[w][k][i], whole.out[w][stop+k][i]) {
						t.Fatalf("%v: rank %d, step %d, parameter %d after the restore: not the uninterrupted run's bits", force, w, stop+k, i)
					}
					for j, v := range resized.out[w][k][i] {
						want := float64(whole.out[w][stop+k][i][j])
						if d := math.Abs(float64(v) - want); d > 1e-4*(1+math.Abs(want)) {
							t.Fatalf("%v: rank %d, step %d, parameter %d[%d] after a resized restore: %v, want about %v", force, w, stop+k, i, j, v, want)
						}
					}
				}
			}
		}
	}
}

// TestAutoHookStateEdges: a state saved before the decision restores to a hook that
// measures and decides as a new one does; a state is refused before New, after the first
// step, over other parameters, truncated, or where the ranks' states disagree.
func TestAutoHookStateEdges(t *testing.T) {
	opts := Options{BucketCapMB: 0.04, FirstBucketCapMB: 0.01}
	mk := func() CommHook { return AutoHook(AutoHookOptions{}) }
	early := runHookFrom(t, mk, opts, 0, 0, 0, 2, 22, nil)
	fresh := runHookFrom(t, mk, opts, 0, 0, 2, 7, 22, func(rank int, h CommHook) error {
		return h.(*autoHook).UnmarshalBinary(early.saved[rank])
	})
	for w, p := range fresh.plans {
		if p == nil || p.Restored || p.DecidedAfter != autoPasses {
			t.Fatalf("rank %d: after restoring an undecided state, plan %v: want one decided anew", w, p)
		}
	}
	psgd := func() CommHook { // PowerSGD in one bucket: the state holds a PowerSGD state
		h := AutoHook(AutoHookOptions{}).(*autoHook)
		h.force = []sim.Hook{{Kind: "powersgd", Rank: 2}, {Kind: "none"}}
		return h
	}
	decided := runHookFrom(t, psgd, opts, 0, 0, 0, autoPasses+1, 22, nil).saved
	setup := func(shapes [][]int) *autoHook {
		h := AutoHook(AutoHookOptions{}).(*autoHook)
		hp := make([]HookParam, len(shapes))
		for p, sh := range shapes {
			hp[p] = HookParam{Name: "p", DType: procgroup.Float32, Shape: sh}
		}
		if err := h.Setup(HookSetup{Params: hp, WorldSize: 2}); err != nil {
			t.Fatal(err)
		}
		return h
	}
	launched := setup(autoShapes)
	launched.launched = true
	other := slices.Clone(decided[1])
	other[len(autoMagic)+8] ^= 1 // rank 1's first cap
	for _, tc := range []struct {
		h     *autoHook
		saved [][]byte
		want  string
	}{
		{AutoHook(AutoHookOptions{}).(*autoHook), decided[:1], "restore its state after New"},
		{launched, decided[:1], "before the first step"},
		{setup(autoShapes[:2]), decided[:1], "an order of 3 parameters, want 2"},
		{setup(autoShapes), [][]byte{decided[0][:len(decided[0])-1]}, "truncated in the PowerSGD states"},
		{setup(autoShapes), [][]byte{decided[0][:len(autoMagic)+5*8]}, "truncated"},
		{setup(autoShapes), [][]byte{append(slices.Clone(decided[0]), 0)}, "1 bytes after the last PowerSGD state"},
		{setup(autoShapes), [][]byte{[]byte("nope")}, "no \"goddp-autohook-1\" header"},
		{setup(autoShapes), [][]byte{decided[0], other}, "ranks 0 and 1 disagree on the decision"},
	} {
		err := tc.h.restore(tc.saved, func(p *powerSGD, st [][]byte) error { return p.UnmarshalResized(st, 0, 1) })
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("restore: %v, want %q", err, tc.want)
		}
		if tc.h.restored != nil {
			t.Errorf("restore failed with %v, yet left a decision to adopt", err)
		}
	}
}
