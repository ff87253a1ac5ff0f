package ddp

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestCommHookMismatch: ranks that disagree on the CommHook, or on PowerSGD's rank, would
// all-reduce messages of different lengths; New refuses them on every rank, naming both
// sides.
func TestCommHookMismatch(t *testing.T) {
	for _, tc := range []struct {
		hooks []func() CommHook
		msg   string
	}{{
		hooks: []func() CommHook{
			func() CommHook { return PowerSGDHook(PowerSGDOptions{Rank: 2}) },
			func() CommHook { return PowerSGDHook(PowerSGDOptions{Rank: 1}) },
			BF16CompressHook,
		},
		msg: "ddp: ranks disagree on the model: Options.CommHook is powersgd(rank 2, min_compression_rate 2, start_iter 0, seed 0) on rank 0 but powersgd(rank 1, min_compression_rate 2, start_iter 0, seed 0) on rank 1 (rank 2 also differs from rank 0)",
	}, {
		hooks: []func() CommHook{func() CommHook { return nil }, func() CommHook { return PowerSGDHook(PowerSGDOptions{Rank: 4}) }},
		msg:   "ddp: ranks disagree on the model: Options.CommHook is allreduce on rank 0 but powersgd(rank 4, min_compression_rate 2, start_iter 0, seed 0) on rank 1",
	}, {
		hooks: []func() CommHook{
			func() CommHook { h, _ := CommHookNamed("auto", PowerSGDOptions{}); return h },
			func() CommHook { h, _ := CommHookNamed("auto", PowerSGDOptions{Rank: 4}); return h },
		},
		msg: "ddp: ranks disagree on the model: Options.CommHook is auto(powersgd ranks [2 4], min_compression_rate 2, start_iter 0, seed 0) on rank 0 but auto(powersgd ranks [4], min_compression_rate 2, start_iter 0, seed 0) on rank 1",
	}, {
		hooks: []func() CommHook{FP16CompressHook, FP16CompressHook, func() CommHook { return PowerSGDHook(PowerSGDOptions{Rank: 1, StartIter: 10}) }},
		msg:   "ddp: ranks disagree on the model: Options.CommHook is fp16 on rank 0 but powersgd(rank 1, min_compression_rate 2, start_iter 10, seed 0) on rank 2",
	}} {
		n := len(tc.hooks)
		c := pgtest.NewCluster(n)
		errs := make([]error, n)
		_ = c.Each(func(rank int, pg procgroup.ProcessGroup) error {
			p := []Param{{Name: "w", Data: make([]float32, 60), Grad: make([]float32, 60), Shape: []int{10, 6}}}
			_, errs[rank] = New(context.Background(), pg, p, Options{CommHook: tc.hooks[rank]()})
			return nil
		})
		c.Close()
		for rank, err := range errs {
			if !errors.Is(err, ErrMismatch) || err.Error() != tc.msg {
				t.Errorf("rank %d: %v, want %q", rank, err, tc.msg)
			}
		}
	}
}

// TestPowerSGDShapes: New hands the parameters' shapes to the hook, which compresses the
// matrices: a 32×24 weight is sent as rank-1 factors (32, then 24 elements), the bias as
// it is, and the ranks end with the same gradients, near the mean on the second step (the
// first two steps' results sum to twice the mean through error feedback, exactly for a
// rank-1 mean).
func TestPowerSGDShapes(t *testing.T) {
	const n, m, ranks = 32, 24, 2
	c := pgtest.NewCluster(ranks)
	defer c.Close()
	rng := rand.New(rand.NewPCG(3, 4))
	u, v := make([]float64, n), make([]float64, m)
	for k := range u {
		u[k] = rng.NormFloat64()
	}
	for k := range v {
		v[k] = rng.NormFloat64()
	}
	grads := make([][]float32, ranks) // rank w: (w+1)·u·vᵀ, rank 1 overall
	for w := range grads {
		grads[w] = make([]float32, n*m)
		for i := range n {
			for j := range m {
				grads[w][i*m+j] = float32(float64(w+1) * u[i] * v[j])
			}
		}
	}
	outs := make([][][]float32, ranks)
	errs := make([]error, ranks)
	_ = c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		errs[rank] = func() error {
			ps := []Param{
				{Name: "w", Data: make([]float32, n*m), Grad: make([]float32, n*m), Shape: []int{n, m}},
				{Name: "b", Data: make([]float32, 5), Grad: make([]float32, 5)},
			}
			d, err := New(context.Background(), pg, ps, Options{CommHook: PowerSGDHook(PowerSGDOptions{Rank: 1, Seed: 1})})
			if err != nil {
				return err
			}
			defer d.Close()
			for range 2 {
				d.BeginBackward(Sync)
				d.GradReady(1, []float32{1, 2, 3, 4, float32(rank)})
				d.GradReady(0, grads[rank])
				if err := d.Finalize(context.Background()); err != nil {
					return err
				}
				outs[rank] = append(outs[rank], append([]float32(nil), ps[0].Grad.([]float32)...), append([]float32(nil), ps[1].Grad.([]float32)...))
			}
			return nil
		}()
		return nil
	})
	for rank, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", rank, err)
		}
	}
	if fmt.Sprint(outs[0]) != fmt.Sprint(outs[1]) {
		t.Fatal("the ranks' gradients differ")
	}
	if got := fmt.Sprint(outs[0][1]); got != "[1 2 3 4 0.5]" {
		t.Errorf("bias: %s", got)
	}
	for k := range n * m {
		mean := 1.5 * float64(grads[0][k])
		if sum := float64(outs[0][0][k]) + float64(outs[0][2][k]); math.Abs(sum-2*mean) > 1e-5*(1+math.Abs(mean)) {
			t.Fatalf("[%d]: steps 0+1 give %v, want 2×%v", k, sum, mean)
		}
	}
	var counts []int
	for _, rec := range c.Issued(0) {
		if rec.Op == procgroup.OpAllReduce {
			counts = append(counts, rec.Count)
		}
	}
	if got := fmt.Sprint(counts); got != "[37 29]" {
		t.Errorf("all-reduce counts %s, want [37 29] (5 + 32×1, then 5 + 24×1)", got)
	}
}
