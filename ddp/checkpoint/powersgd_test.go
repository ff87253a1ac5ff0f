package checkpoint_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/checkpoint"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// psgdJob is a teacher-student linear regression y = T·x (T 8×6) trained with a DDP
// under PowerSGD of rank 1, each rank drawing its own batch of 4 from (rank, step).
type psgdJob struct {
	teacher []float32
}

const psgdRows, psgdCols, psgdBatch = 8, 6, 4

// train runs steps [from, to) on world ranks, restoring from dir first (if from > 0) and
// saving there at to; it returns rank 0's loss of each step and each rank's parameters.
func (j psgdJob) train(t *testing.T, world, from, to int, dir string) ([]float64, [][]float32) {
	t.Helper()
	ctx := context.Background()
	cl := pgtest.NewCluster(world)
	defer cl.Close()
	losses := make([]float64, to-from)
	params := make([][]float32, world)
	err := cl.Each(func(rank int, pg procgroup.ProcessGroup) error {
		w, g := make([]float32, psgdRows*psgdCols), make([]float32, psgdRows*psgdCols)
		hook := ddp.PowerSGDHook(ddp.PowerSGDOptions{Rank: 1, MinCompressionRate: 1, Seed: 4})
		d, err := ddp.New(ctx, pg, []ddp.Param{{Name: "w", Data: w, Grad: g, Shape: []int{psgdRows, psgdCols}}}, ddp.Options{CommHook: hook})
		if err != nil {
			return err
		}
		defer d.Close()
		c, err := checkpoint.New(pg, checkpoint.Options{Dir: dir, Resume: from > 0})
		if err != nil {
			return err
		}
		c.Float32("w", w, psgdRows, psgdCols)
		c.PerRank("comm_hook", ddp.DescribeHook(d.CommHook()), d.CommHook().(checkpoint.RankState))
		start, err := c.Restore(ctx)
		if err != nil {
			return err
		}
		if int(start) != from {
			return fmt.Errorf("resumed from step %d, want %d", start, from)
		}
		mg := make([]float32, len(w))
		for step := from; step < to; step++ {
			rng := rand.New(rand.NewPCG(uint64(rank), uint64(step)))
			clear(mg)
			var loss float64
			for range psgdBatch {
				x := make([]float32, psgdCols)
				for k := range x {
					x[k] = float32(rng.NormFloat64())
				}
				for i := range psgdRows {
					var r float32
					for k := range psgdCols {
						r += (w[i*psgdCols+k] - j.teacher[i*psgdCols+k]) * x[k]
					}
					loss += float64(r*r) / 2 / psgdBatch
					for k := range psgdCols {
						mg[i*psgdCols+k] += r * x[k] / psgdBatch
					}
				}
			}
			if err := d.Backward(ctx, func() error { return d.GradReady(0, mg) }); err != nil {
				return err
			}
			for k := range w {
				w[k] -= 0.1 * g[k]
			}
			l := []float64{loss / float64(world)}
			if err := pg.AllReduce(ctx, l, procgroup.Sum).Wait(ctx); err != nil {
				return err
			}
			if rank == 0 {
				losses[step-from] = l[0]
			}
		}
		params[rank] = w
		return c.SaveContext(ctx, int64(to))
	})
	if err != nil {
		t.Fatal(err)
	}
	return losses, params
}

// TestPowerSGDResumeAtAnotherWorldSize: a PowerSGD job of 3 ranks checkpoints after 15
// steps; 2 ranks resume it (each taking the 3 ranks' summed error over 2, the shared
// factors and step) and train on: the ranks agree bit for bit, and the loss goes on
// falling, to below a fifth of the loss at the checkpoint. A resume at 3 ranks ends
// bit for bit with the run that did not stop.
func TestPowerSGDResumeAtAnotherWorldSize(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	j := psgdJob{teacher: make([]float32, psgdRows*psgdCols)}
	for k := range j.teacher {
		j.teacher[k] = float32(rng.NormFloat64())
	}
	dir := t.TempDir()
	first, _ := j.train(t, 3, 0, 15, dir)
	after, params := j.train(t, 2, 15, 60, dir)
	if !slices.Equal(params[0], params[1]) {
		t.Fatal("the 2 ranks' parameters differ after the resume")
	}
	at := first[len(first)-1]
	end := mean(after[len(after)-5:])
	t.Logf("loss: step 0 %.4f, step 14 (3 ranks) %.4f, step 15 (2 ranks) %.4f, steps 55-59 %.5f", first[0], at, after[0], end)
	if !(end < at/5) || !(at < first[0]) || math.IsNaN(end) {
		t.Errorf("the loss did not fall after the resume at 2 ranks: %.4f at the checkpoint, %.4f at the end", at, end)
	}

	whole, wp := j.train(t, 3, 0, 25, t.TempDir())
	same := t.TempDir()
	j.train(t, 3, 0, 15, same)
	rest, rp := j.train(t, 3, 15, 25, same)
	if !slices.Equal(wp[0], rp[0]) || !slices.Equal(whole[15:], rest) {
		t.Errorf("resumed at 3 ranks: losses %v, want the uninterrupted %v", rest, whole[15:])
	}
}

func mean(v []float64) float64 {
	var s float64
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}
