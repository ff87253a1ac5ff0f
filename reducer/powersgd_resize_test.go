package reducer

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/goddp/goddp/procgroup/pgtest"
)

// psgdSteps trains shapes on len(grads) ranks with fresh Reducers and PowerSGD hooks,
// restoring each rank's hook with restore first (if set), one synced step per entry of
// grads[rank] (the gradients, flattened by parameter); it returns each rank's results,
// step by step, and its hook.
func psgdSteps(t *testing.T, shapes [][]int, opts PowerSGDOptions, grads [][][]float32, restore func(rank int, h *powerSGD) error) ([][][]float32, []*powerSGD) {
	t.Helper()
	ranks := len(grads)
	out, hooks := make([][][]float32, ranks), make([]*powerSGD, ranks)
	c := pgtest.NewCluster(ranks)
	defer c.Close()
	ctx := testCtx(t)
	errs := runRanks(ranks, func(rank int) error {
		params := make([]Param, len(shapes))
		for p, sh := range shapes {
			params[p] = Param{Name: fmt.Sprint(p), Shape: sh, Grad: make([]float32, psgdSize(sh))}
		}
		h := PowerSGDHook(opts).(*powerSGD)
		hooks[rank] = h
		r, err := New(c.Group(rank), params, Options{CommHook: h, BucketCapMB: 300.0 / (1 << 20), FirstBucketCapMB: 300.0 / (1 << 20)})
		if err != nil {
			return err
		}
		defer r.Close()
		if restore != nil {
			if err := restore(rank, h); err != nil {
				return err
			}
		}
		for _, g := range grads[rank] {
			_ = r.BeginBackward(Sync)
			at := 0
			for p, sh := range shapes {
				if err := r.GradReady(p, g[at:at+psgdSize(sh)]); err != nil {
					return err
				}
				at += psgdSize(sh)
			}
			if err := r.Finalize(ctx); err != nil {
				return err
			}
			var res []float32
			for _, p := range params {
				res = append(res, p.Grad.([]float32)...)
			}
			out[rank] = append(out[rank], res)
		}
		return nil
	})
	for w, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", w, err)
		}
	}
	return out, hooks
}

// TestPowerSGDResized: the states of 3 ranks after 3 steps (an even and an odd step
// done), restored by UnmarshalResized into 2 ranks, keep the step and the factors, and
// the errors sum, element by element, to what the 3 ranks' errors summed to. A 4th step
// of the 2 ranks, given gradients whose mean is the 3 ranks' mean gradient, then gives
// the result that the 3 ranks give (up to rounding): the results depend on the errors
// only through their sum (Note [PowerSGD checkpoints]). States of different steps, or a
// bad rank, are refused, and leave the hook as it was.
func TestPowerSGDResized(t *testing.T) {
	shapes := [][]int{{12, 9}, {7}, {5, 8}}
	opts := PowerSGDOptions{Rank: 2, Seed: 3, MinCompressionRate: 1}
	size := 0
	for _, sh := range shapes {
		size += psgdSize(sh)
	}
	rng := rand.New(rand.NewPCG(11, 12))
	draw := func() []float32 {
		g := make([]float32, size)
		for k := range g {
			g[k] = float32(rng.NormFloat64())
		}
		return g
	}
	const before = 3
	grads := make([][][]float32, 3)
	for w := range grads {
		for range before + 1 {
			grads[w] = append(grads[w], draw())
		}
	}
	saved := make([][]byte, 3)
	_, hooks := psgdSteps(t, shapes, opts, [][][]float32{grads[0][:before], grads[1][:before], grads[2][:before]}, nil)
	for w, h := range hooks {
		var err error
		if saved[w], err = h.MarshalBinary(); err != nil {
			t.Fatal(err)
		}
	}
	three3, _ := psgdSteps(t, shapes, opts, grads, nil)
	three := three3[0][before]

	// The 4th step at 2 ranks: each rank's gradient is the 3 ranks' mean.
	mean := make([]float32, size)
	for k := range mean {
		mean[k] = float32((float64(grads[0][before][k]) + float64(grads[1][before][k]) + float64(grads[2][before][k])) / 3)
	}
	var resized []*powerSGD
	two, _ := psgdSteps(t, shapes, opts, [][][]float32{{mean}, {mean}}, func(rank int, h *powerSGD) error {
		if err := h.UnmarshalResized(saved, rank, 2); err != nil {
			return err
		}
		if rank == 0 {
			resized = append(resized, h.factors())
		}
		if i := hooks[0].factors().differs(h); i >= 0 {
			return fmt.Errorf("rank %d: parameter %d's step or factors differ from the saved ones", rank, i)
		}
		for i, mt := range h.mats {
			if mt == nil {
				continue
			}
			e := mt.e.([]float32)
			for k := range e {
				var sum float64
				for _, old := range hooks {
					sum += float64(old.mats[i].e.([]float32)[k])
				}
				if got := 2 * float64(e[k]); math.Abs(got-sum) > 1e-6*math.Abs(sum)+1e-12 {
					return fmt.Errorf("rank %d: parameter %d, element %d: the errors sum to %v, the saved ones to %v", rank, i, k, got, sum)
				}
			}
		}
		return nil
	})
	if len(resized) != 1 {
		t.Fatal("rank 0 did not restore")
	}
	for w := range 2 {
		for k, v := range two[w][0] {
			if want := three[k]; math.Abs(float64(v-want)) > 1e-4*(1+math.Abs(float64(want))) {
				t.Fatalf("rank %d, element %d of the 4th step at 2 ranks: %v, at 3 ranks %v", w, k, v, want)
			}
		}
	}

	// Refusals.
	_, later := psgdSteps(t, shapes, opts, [][][]float32{grads[0][:before+1], grads[1][:before+1]}, nil)
	other, err := later[1].MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	h := hooks[0]
	keep, _ := h.MarshalBinary()
	if b, err := h.AppendBinary([]byte("xy")); err != nil || string(b) != "xy"+string(keep) {
		t.Errorf("AppendBinary: %v, want the prefix and MarshalBinary's bytes", err)
	}
	for _, tc := range []struct {
		saved       [][]byte
		rank, world int
		want        string
	}{
		{[][]byte{saved[0], other}, 0, 2, "saved states of ranks 0 and 1 disagree on parameter 0's step or factors"},
		{[][]byte{saved[0], saved[1][:40]}, 0, 2, "saved rank 1: reducer: PowerSGD hook: saved state: truncated"},
		{saved, 2, 2, "rank 2 of a world of 2"},
		{nil, 0, 1, "no saved states"},
	} {
		if err := h.UnmarshalResized(tc.saved, tc.rank, tc.world); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("UnmarshalResized: %v, want %q", err, tc.want)
		}
		if now, _ := h.MarshalBinary(); string(now) != string(keep) {
			t.Errorf("UnmarshalResized (%q) changed the hook's state", tc.want)
		}
	}
}
