package ddp

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestShardsWorldSizeRefused: 6 shards over 4 ranks are refused by New on every rank,
// before any collective, with a *ShardsError that lists the world sizes that work.
func TestShardsWorldSizeRefused(t *testing.T) {
	c := pgtest.NewCluster(4)
	defer c.Close()
	errs := make([]error, 4)
	_ = c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		_, errs[rank] = New(context.Background(), pg, []Param{{Name: "w", Data: make([]float32, 4), Grad: make([]float32, 4)}}, Options{Shards: 6})
		return nil
	})
	const msg = "ddp: invalid argument: Options.Shards: 6 shards cannot be spread over a world of 4 ranks: every rank runs the same number of shards, so the world size must divide 6; world sizes that work: 1, 2, 3, 6"
	for rank, err := range errs {
		var se *ShardsError
		if !errors.As(err, &se) || !errors.Is(err, ErrInvalidArgument) || err.Error() != msg || !slices.Equal(se.Fit, []int{1, 2, 3, 6}) {
			t.Errorf("rank %d: %v, want %q", rank, err, msg)
		}
		if iss := c.Issued(rank); len(iss) != 0 {
			t.Errorf("rank %d issued %v before refusing", rank, iss)
		}
	}
}

// TestBackwardShards: 3 ranks over 6 shards, each shard's gradient reported in
// BackwardShards, leave in Param.Grad the fold ((g0 + g1) + … + g5)·(1/6) computed here, bit
// for bit, on every rank, for two steps; BeginBackward is refused with Shards.
func TestBackwardShards(t *testing.T) {
	const L, n, size = 6, 3, 50
	rng := rand.New(rand.NewPCG(45, 6))
	g := make([][][]float32, 2) // [step][shard]
	for step := range g {
		g[step] = make([][]float32, L)
		for s := range g[step] {
			g[step][s] = make([]float32, size)
			for k := range g[step][s] {
				g[step][s][k] = float32(rng.NormFloat64() * math.Pow(10, float64(rng.IntN(5)-2)))
			}
		}
	}
	c := pgtest.NewCluster(n)
	defer c.Close()
	err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		grad := make([]float32, size)
		d, err := New(context.Background(), pg, []Param{{Name: "w", Data: make([]float32, size), Grad: grad}}, Options{Shards: L})
		if err != nil {
			return err
		}
		defer d.Close()
		if lo, hi := d.LocalShards(); lo != rank*2 || hi != rank*2+2 {
			t.Errorf("rank %d: LocalShards %d, %d", rank, lo, hi)
		}
		for step := range g {
			if err := d.BackwardShards(context.Background(), func(s int) error { return d.GradReady(0, g[step][s]) }); err != nil {
				return err
			}
			for k := range grad {
				want := g[step][0][k]
				for s := 1; s < L; s++ {
					want += g[step][s][k]
				}
				want *= 1 / float32(L)
				if math.Float32bits(grad[k]) != math.Float32bits(want) {
					t.Errorf("rank %d, step %d, element %d: %v, the shard-order fold %v", rank, step, k, grad[k], want)
					break
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	one := pgtest.NewCluster(1)
	defer one.Close()
	d, err := New(context.Background(), one.Group(0), []Param{{Name: "w", Data: make([]float32, 2), Grad: make([]float32, 2)}}, Options{Shards: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	d.BeginBackward(Sync)
	if err := d.Finalize(context.Background()); err == nil || !strings.Contains(err.Error(), "begin each shard's pass with BeginShard") {
		t.Errorf("BeginBackward with Shards: Finalize says %v", err)
	}
}

// TestShardsMismatch: ranks that disagree on Options.Shards would issue different
// collectives; New refuses them on every rank, naming both values.
func TestShardsMismatch(t *testing.T) {
	c := pgtest.NewCluster(3)
	defer c.Close()
	errs := make([]error, 3)
	_ = c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		shards := []int{6, 3, 0}[rank]
		_, errs[rank] = New(context.Background(), pg, []Param{{Name: "w", Data: make([]float32, 4), Grad: make([]float32, 4)}}, Options{Shards: shards})
		return nil
	})
	const msg = "ddp: ranks disagree on the model: Options.Shards is 6 on rank 0 but 3 on rank 1 (rank 2 also differs from rank 0)"
	for rank, err := range errs {
		if !errors.Is(err, ErrMismatch) || err.Error() != msg {
			t.Errorf("rank %d: %v, want %q", rank, err, msg)
		}
	}
}
