package hookshards

import (
	"context"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestBackward: 6 shards with random gradients, run by 1, 2, 3 and 6 ranks through a DDP
// with a comm hook (fp16, and the plain all-reduce without Options.Shards): every rank
// ends with the mean over the 6 shards, element by element (to the hook's rounding),
// each shard run once, by the rank Local names; 4 ranks are refused, naming the counts.
func TestBackward(t *testing.T) {
	const L, size = 6, 50
	rng := rand.New(rand.NewPCG(3, 4))
	grads := make([][]float32, L)
	want := make([]float64, size)
	for s := range grads {
		grads[s] = make([]float32, size)
		for k := range grads[s] {
			grads[s][k] = float32(rng.NormFloat64())
			want[k] += float64(grads[s][k]) / L
		}
	}
	for _, hook := range []struct {
		name string
		h    func() ddp.CommHook
		tol  float64
	}{{"allreduce", ddp.AllReduceHook, 1e-6}, {"fp16", ddp.FP16CompressHook, 2e-3}} {
		for _, n := range []int{1, 2, 3, 6} {
			c := pgtest.NewCluster(n)
			ran := make([][]int, n)
			err := c.Each(func(r int, pg procgroup.ProcessGroup) error {
				data, g := make([]float32, size), make([]float32, size)
				d, err := ddp.New(context.Background(), pg, []ddp.Param{{Name: "w", Data: data, Grad: g}}, ddp.Options{CommHook: hook.h()})
				if err != nil {
					return err
				}
				defer d.Close()
				lo, hi, err := Local(d, L)
				if err != nil {
					return err
				}
				scale := float32(Scale(d, lo, hi))
				mg := make([]float32, size)
				if err := Backward(context.Background(), d, lo, hi, func(s int) error {
					ran[r] = append(ran[r], s)
					for k, v := range grads[s] {
						mg[k] = scale * v
					}
					return d.GradReady(0, mg)
				}); err != nil {
					return err
				}
				for k, v := range g {
					if math.Abs(float64(v)-want[k]) > hook.tol*(1+math.Abs(want[k])) {
						t.Errorf("%s, %d ranks, rank %d, element %d: %v, the mean over the shards %v", hook.name, n, r, k, v, want[k])
						break
					}
				}
				return nil
			})
			c.Close()
			if err != nil {
				t.Fatalf("%s, %d ranks: %v", hook.name, n, err)
			}
			seen := map[int]int{}
			for _, ss := range ran {
				for _, s := range ss {
					seen[s]++
				}
			}
			for s := range L {
				if seen[s] != 1 {
					t.Errorf("%s, %d ranks: shard %d ran %d times: %v", hook.name, n, s, seen[s], ran)
				}
			}
		}
	}
	c := pgtest.NewCluster(4)
	defer c.Close()
	errs := make([]error, 4)
	c.Each(func(r int, pg procgroup.ProcessGroup) error {
		d, err := ddp.New(context.Background(), pg, []ddp.Param{{Name: "w", Data: make([]float32, 2), Grad: make([]float32, 2)}}, ddp.Options{CommHook: ddp.FP16CompressHook()})
		if err != nil {
			return err
		}
		defer d.Close()
		_, _, errs[r] = Local(d, L)
		return nil
	})
	for r, err := range errs {
		if err == nil || !strings.Contains(err.Error(), "the 6 shards of a step do not divide among 4 ranks") {
			t.Errorf("rank %d of 4: %v", r, err)
		}
	}
	if Options("none", L) != L || Options("", L) != L || Options("powersgd", L) != 0 {
		t.Error("Options: want the shards without a hook, none with one")
	}
}
