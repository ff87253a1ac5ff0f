package ddp

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestNonFiniteFinalize: a NaN in rank 1's gradient of one parameter at step 1 makes
// Finalize return, on both ranks, the same *NonFiniteError (no rank prefix: it is the
// same everywhere) naming rank 1, the step and the parameter; AfterSync is not called for
// that step; the DDP is not failed, the group not aborted, and the next step's averages
// are right (element by element against the mean of the random inputs).
func TestNonFiniteFinalize(t *testing.T) {
	const size, steps = 2, 3
	c := pgtest.NewCluster(size)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	lens := []int{6, 3, 9}
	rng := rand.New(rand.NewPCG(5, 49))
	in := make([][][][]float32, steps) // [step][rank][param]
	for s := range in {
		in[s] = make([][][]float32, size)
		for r := range size {
			for _, l := range lens {
				g := make([]float32, l)
				for k := range g {
					g[k] = float32(rng.NormFloat64())
				}
				in[s][r] = append(in[s][r], g)
			}
		}
	}
	in[1][1][2][4] = float32(math.NaN())
	errs := make([][]error, size)
	afterSync := make([][]int, size)
	got := make([][][][]float32, size) // [rank][step][param]
	if err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		params := make([]Param, len(lens))
		for p, l := range lens {
			params[p] = Param{Name: fmt.Sprintf("fc%d.weight", p), Data: make([]float32, l), Grad: make([]float32, l)}
		}
		step := 0
		d, err := New(ctx, pg, params, Options{FirstBucketCapMB: 16.0 / (1 << 20), BucketCapMB: 16.0 / (1 << 20),
			AfterSync: func(*DDP) error { afterSync[rank] = append(afterSync[rank], step); return nil }})
		if err != nil {
			return err
		}
		defer d.Close()
		for ; step < steps; step++ {
			err := d.Backward(ctx, func() error {
				for p := len(lens) - 1; p >= 0; p-- {
					if err := d.GradReady(p, in[step][rank][p]); err != nil {
						return err
					}
				}
				return nil
			})
			errs[rank] = append(errs[rank], err)
			var gs [][]float32
			for p := range lens {
				gs = append(gs, append([]float32(nil), d.Grad32(p)...))
			}
			got[rank] = append(got[rank], gs)
		}
		return d.Err()
	}); err != nil {
		t.Fatal(err)
	}
	const want = "reducer: step 1: non-finite local gradient: rank 1: parameter 2 (fc2.weight)"
	for rank := range size {
		for s, err := range errs[rank] {
			var nf *NonFiniteError
			switch {
			case s != 1 && err != nil:
				t.Errorf("rank %d step %d: %v", rank, s, err)
			case s == 1 && (err == nil || err.Error() != want || !errors.Is(err, ErrNonFinite) || !errors.As(err, &nf)):
				t.Errorf("rank %d step 1: %v, want %q (a *NonFiniteError)", rank, err, want)
			case s == 1 && (len(nf.Local) != 1 || nf.Local[0] != NonFiniteGrad{Rank: 1, Param: 2, Name: "fc2.weight"}):
				t.Errorf("rank %d: Local %+v", rank, nf.Local)
			}
		}
		if fmt.Sprint(afterSync[rank]) != "[0 2]" {
			t.Errorf("rank %d: AfterSync ran at steps %v, want [0 2]", rank, afterSync[rank])
		}
		for s := range steps {
			for p, l := range lens {
				for k := range l {
					ref := (float64(in[s][0][p][k]) + float64(in[s][1][p][k])) / size
					x := float64(got[rank][s][p][k])
					if s == 1 && p == 2 && k == 4 {
						if !math.IsNaN(x) {
							t.Errorf("rank %d: poisoned element %v, want NaN (left as reduced)", rank, x)
						}
						continue
					}
					if math.Abs(x-ref) > 1e-6*(1+math.Abs(ref)) {
						t.Errorf("rank %d step %d param %d [%d]: %v, want %v", rank, s, p, k, x, ref)
					}
				}
			}
		}
	}
}

// TestNoFiniteCheckMismatch: at a non-finite step only the ranks that check would issue the
// collective that names the sources, so ranks that disagree on Options.NoFiniteCheck are
// refused at New on every rank, naming both values.
func TestNoFiniteCheckMismatch(t *testing.T) {
	c := pgtest.NewCluster(3)
	defer c.Close()
	errs := make([]error, 3)
	_ = c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		_, errs[rank] = New(context.Background(), pg, []Param{{Name: "w", Data: make([]float32, 4), Grad: make([]float32, 4)}}, Options{NoFiniteCheck: rank == 1})
		return nil
	})
	const msg = "ddp: ranks disagree on the model: Options.NoFiniteCheck is false on rank 0 but true on rank 1"
	for rank, err := range errs {
		if !errors.Is(err, ErrMismatch) || err.Error() != msg {
			t.Errorf("rank %d: %v, want %q", rank, err, msg)
		}
	}
}
