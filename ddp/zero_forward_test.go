package ddp

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/goddp/goddp/ddp/optim"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestZeroForwardEqualsStep: on gloo over loopback at n = 1 to 4, with AdamW and SGD with
// momentum, at stages 1 and 2, Options.ZeroForwardOverlap gives the bits of the same stage
// without it (parameters and the gathered optimizer state after 6 steps, each rank waiting
// for its parameters in its own random order, and leaving the last step's all-gathers in
// flight to GatherOptimizerState: zeroRunWith checks they were), and so the plain loop's
// where the stage has them.
func TestZeroForwardEqualsStep(t *testing.T) { checkEqualsStep(t, zeroForward, 4) }

// TestZeroForwardOrder: on pgtest at 2 ranks, Step issues every bucket's all-gather, last
// bucket first, and returns before any completes (one rank's collectives are delayed);
// WaitParams of a parameter copies out its bucket only; Finalize completes the rest (the
// parameters of buckets nobody waited for) before the next step's reductions are waited
// for; the next Step finds nothing left. pgtest fails any collective whose ranks disagree.
func TestZeroForwardOrder(t *testing.T) {
	for zero := 1; zero <= 2; zero++ {
		c := pgtest.NewCluster(2)
		c.SetDelay(1, 2*time.Millisecond)
		err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
			ctx := context.Background()
			params := zeroParams()
			d, err := New(ctx, pg, params, Options{BucketCapMB: zeroCap, FirstBucketCapMB: zeroFirst, Zero: zero, ZeroForwardOverlap: true,
				Optimizer: zeroOpts["adamw"], NoFiniteCheck: true})
			if err != nil {
				return err
			}
			defer d.Close()
			for s := range 4 {
				d.BeginBackward(Sync)
				for p := range params {
					_ = d.GradReady(p, zeroX(rank, s, p, zeroLens[p]))
				}
				if err := d.Finalize(ctx); err != nil {
					return err
				}
				if p := d.zero.gather.pending.Load(); p != 0 {
					return fmt.Errorf("step %d: Finalize left %d all-gathers", s, p)
				}
				before := len(c.Issued(rank))
				if err := d.Step(ctx); err != nil {
					return err
				}
				z := d.zero
				issued := c.Issued(rank)[before:]
				var want, got []string
				for b := len(z.segs) - 1; b >= 0; b-- {
					want = append(want, fmt.Sprint(procgroup.OpAllGather, z.segs[b].blk))
				}
				for _, rec := range issued {
					got = append(got, fmt.Sprint(rec.Op, rec.Count))
				}
				if len(z.segs) < 3 || fmt.Sprint(got) != fmt.Sprint(want) {
					return fmt.Errorf("step %d: Step issued %v, want %v (at least 3 buckets)", s, got, want)
				}
				if p := z.gather.pending.Load(); p != int32(len(z.segs)) {
					return fmt.Errorf("step %d: %d all-gathers pending after Step, want %d", s, p, len(z.segs))
				}
				// Waiting for one parameter collects its bucket alone.
				if err := d.WaitParams(ctx, 0); err != nil {
					return err
				}
				b := z.gather.segOf[0]
				if z.segs[b].work != nil || z.gather.pending.Load() != int32(len(z.segs)-1) {
					return fmt.Errorf("step %d: after WaitParams(0): parameter 0's bucket %d still in flight or %d pending of %d", s, b, z.gather.pending.Load(), len(z.segs))
				}
			}
			return nil
		})
		c.Close()
		if err != nil {
			t.Fatalf("zero %d: %v", zero, err)
		}
	}
}

// TestZeroForwardRefusals: (TestZeroErrors refuses ZeroForwardOverlap without Zero, or
// with ZeroOverlap, at New.) Ranks that disagree on it fail New with a mismatch naming it; WaitParams
// of an index out of range is ErrInvalidArgument and leaves the DDP working, and without
// the option it returns at once.
func TestZeroForwardRefusals(t *testing.T) {
	f := zeroOpts["adamw"]
	one := oneZeroParam
	c := pgtest.NewCluster(1)
	defer c.Close()
	ctx := context.Background()
	d, err := New(ctx, c.Group(0), one(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.WaitParams(ctx, 1); !errors.Is(err, ErrInvalidArgument) || d.Err() != nil {
		t.Errorf("WaitParams(1) of 1 parameter: %v (DDP: %v), want ErrInvalidArgument and a working DDP", err, d.Err())
	}
	if err := d.WaitParams(ctx, 0); err != nil {
		t.Errorf("WaitParams(0) without the option: %v", err)
	}
	d.Close()

	c2 := pgtest.NewCluster(2)
	defer c2.Close()
	errs := make([]error, 2)
	_ = c2.Each(func(r int, pg procgroup.ProcessGroup) error {
		d, err := New(ctx, pg, one(), Options{Zero: 1, Optimizer: f, ZeroForwardOverlap: r == 0})
		if err == nil {
			d.Close()
		}
		errs[r] = err
		return nil
	})
	for r, err := range errs {
		if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "ZeroForwardOverlap") {
			t.Errorf("rank %d: forward overlap on rank 0 only: %v", r, err)
		}
	}
}

// TestZeroForwardFailures: with the all-gathers of a Step in flight, a peer that is killed
// fails WaitParams with ErrPeerLost and the DDP with it; a peer that stalls makes
// WaitParams end with its ctx's deadline and fail the DDP; a peer that never steps makes
// Finalize fail the same way. Nothing hangs, and Close returns.
func TestZeroForwardFailures(t *testing.T) {
	for _, how := range []string{"killed", "paused", "finalize"} {
		t.Run(how, func(t *testing.T) {
			c := pgtest.NewCluster(2)
			defer c.Close()
			errs := make([]error, 2)
			var wg sync.WaitGroup
			for rank := range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					params := zeroParams()
					d, err := New(context.Background(), c.Group(rank), params, Options{BucketCapMB: zeroCap, FirstBucketCapMB: zeroFirst, Zero: 2,
						ZeroForwardOverlap: true, Optimizer: zeroOpts["adamw"], NoFiniteCheck: true})
					if err != nil {
						errs[rank] = err
						return
					}
					defer d.Close()
					for s := range 2 {
						d.BeginBackward(Sync)
						for p := range params {
							_ = d.GradReady(p, zeroX(rank, s, p, zeroLens[p]))
						}
						if err := d.Finalize(context.Background()); err != nil {
							errs[rank] = err
							return
						}
						if rank == 1 && s == 1 {
							break // its second Step's all-gathers never come
						}
						if err := d.Step(context.Background()); err != nil {
							errs[rank] = err
							return
						}
					}
					ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
					defer cancel()
					if rank == 1 {
						switch how {
						case "killed":
							c.Kill(1)
						case "paused", "finalize":
							c.Pause(1)
							<-ctx.Done()
						}
						return
					}
					var werr error
					if how == "finalize" {
						d.BeginBackward(Sync)
						for p := range params {
							_ = d.GradReady(p, zeroX(rank, 2, p, zeroLens[p]))
						}
						werr = d.Finalize(ctx)
					} else {
						werr = d.WaitParams(ctx, 0)
					}
					switch {
					case how == "killed" && !errors.Is(werr, procgroup.ErrPeerLost):
						errs[0] = fmt.Errorf("WaitParams: %v, want ErrPeerLost", werr)
					case how != "killed" && !errors.Is(werr, context.DeadlineExceeded):
						errs[0] = fmt.Errorf("%s: %v, want ctx's deadline", how, werr)
					case d.Err() == nil:
						errs[0] = errors.New("the DDP did not fail")
					case !errors.Is(d.WaitParams(context.Background(), 1), d.Err()):
						errs[0] = fmt.Errorf("a later WaitParams: %v, want the DDP's error", d.WaitParams(context.Background(), 1))
					}
				}()
			}
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				t.Fatal("a rank hung")
			}
			if how != "killed" {
				c.Resume(1)
			}
			if errs[0] != nil {
				t.Fatalf("rank 0: %v", errs[0])
			}
		})
	}
}

// zeroForwardDDPs makes a DDP at stage 1 with Options.ZeroForwardOverlap on each rank of c.
func zeroForwardDDPs(t *testing.T, c *pgtest.Cluster) ([]*DDP, [][]Param) {
	t.Helper()
	n := c.Size()
	ds, ps := make([]*DDP, n), make([][]Param, n)
	if err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		ps[rank] = zeroParams()
		var err error
		ds[rank], err = New(context.Background(), pg, ps[rank], Options{BucketCapMB: zeroCap, FirstBucketCapMB: zeroFirst, Zero: 1,
			ZeroForwardOverlap: true, Optimizer: zeroOpts["adamw"], NoFiniteCheck: true})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return ds, ps
}

// zeroForwardStep runs one synced pass of rank's step s and Step, which leaves the
// all-gathers in flight.
func zeroForwardStep(d *DDP, rank, s int, params []Param) error {
	d.BeginBackward(Sync)
	for p := range params {
		_ = d.GradReady(p, zeroX(rank, s, p, zeroLens[p]))
	}
	if err := d.Finalize(context.Background()); err != nil {
		return err
	}
	return d.Step(context.Background())
}

// TestZeroForwardCloseAborts: with a step's all-gathers in flight behind a peer that has
// stopped, Close in the next synced pass aborts the group and returns at once, with
// nothing waiting (the trainer's own goroutine) or with a forward blocked in WaitParams on
// another goroutine, which then fails; between steps Close waits for the all-gathers, which
// the peer completes once it goes on.
func TestZeroForwardCloseAborts(t *testing.T) {
	for _, how := range []string{"synced", "synced, forward waiting", "idle"} {
		t.Run(how, func(t *testing.T) {
			c := pgtest.NewCluster(2)
			defer c.Close()
			ds, ps := zeroForwardDDPs(t, c)
			defer ds[1].Close()
			if err := c.Each(func(rank int, _ procgroup.ProcessGroup) error {
				if err := zeroForwardStep(ds[rank], rank, 0, ps[rank]); err != nil {
					return err
				}
				return ds[rank].WaitParams(context.Background())
			}); err != nil {
				t.Fatal(err)
			}
			// Step 1: rank 1 stops just before its all-gathers run.
			if err := c.Each(func(rank int, _ procgroup.ProcessGroup) error {
				if rank == 1 {
					ds[1].BeginBackward(Sync)
					for p := range ps[1] {
						_ = ds[1].GradReady(p, zeroX(1, 1, p, zeroLens[p]))
					}
					if err := ds[1].Finalize(context.Background()); err != nil {
						return err
					}
					c.Pause(1)
					return ds[1].Step(context.Background())
				}
				return zeroForwardStep(ds[0], 0, 1, ps[0])
			}); err != nil {
				t.Fatal(err)
			}
			d := ds[0]
			forward := make(chan error, 1)
			if how != "idle" {
				d.BeginBackward(Sync)
			}
			if how == "synced, forward waiting" {
				go func() { forward <- d.WaitParams(context.Background(), 0) }()
				time.Sleep(50 * time.Millisecond) // into the wait
			}
			closed := make(chan struct{})
			go func() { d.Close(); close(closed) }()
			if how == "idle" {
				select {
				case <-closed:
					t.Fatal("Close between steps returned before the all-gathers completed")
				case <-time.After(100 * time.Millisecond):
				}
				c.Resume(1)
			}
			select {
			case <-closed:
			case <-time.After(10 * time.Second):
				c.Resume(1)
				t.Fatalf("Close has not returned after 10 s, %d all-gathers pending", d.zero.gather.pending.Load())
			}
			if how == "idle" {
				if p := d.zero.gather.pending.Load(); p != 0 {
					t.Errorf("after Close, %d all-gathers pending", p)
				}
				return
			}
			c.Resume(1)
			if how == "synced, forward waiting" {
				if err := <-forward; err == nil {
					t.Error("the waiting forward's WaitParams returned nil after the abort")
				}
			}
		})
	}
}

// TestZeroForwardConcurrentWait: a WaitParams on one goroutine that finds every all-gather
// counted done (another goroutine's WaitParams collected them) reads the copied values:
// each step's parameter equals what the collecting goroutine left, and the race detector
// sees the copy ordered before the read.
func TestZeroForwardConcurrentWait(t *testing.T) {
	c := pgtest.NewCluster(2)
	defer c.Close()
	ds, ps := zeroForwardDDPs(t, c)
	if err := c.Each(func(rank int, _ procgroup.ProcessGroup) error {
		d, params := ds[rank], ps[rank]
		defer d.Close()
		for s := range 10 {
			if err := zeroForwardStep(d, rank, s, params); err != nil {
				return err
			}
			i := d.zero.segs[0].bk.Params[0] // bucket 0: the last that WaitParams() collects
			var wg sync.WaitGroup
			var all, late error
			var seen []float32
			wg.Go(func() { all = d.WaitParams(context.Background()) })
			wg.Go(func() {
				for d.zero.gather.pending.Load() != 0 { // arrives once the counter is down
					time.Sleep(10 * time.Microsecond)
				}
				late = d.WaitParams(context.Background(), i)
				seen = append(seen, params[i].Data.([]float32)...)
			})
			wg.Wait()
			if all != nil || late != nil {
				return fmt.Errorf("step %d: WaitParams: %v, %v", s, all, late)
			}
			for k, v := range params[i].Data.([]float32) {
				if seen[k] != v {
					return fmt.Errorf("step %d: element %d of parameter %d read %v, then %v", s, k, i, seen[k], v)
				}
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// hookOptimizer runs hook before each step of the optimizer it wraps.
type hookOptimizer struct {
	optim.Optimizer
	hook func()
}

func (o hookOptimizer) Step(p, g []float32) error {
	if o.hook != nil {
		o.hook()
	}
	return o.Optimizer.Step(p, g)
}

// TestZeroForwardCloseDuringStep: a Close from another goroutine while Step steps the
// shard, before Step has issued its all-gathers, waits for Step and then for the
// all-gathers it issued: none is left in flight when Close returns.
func TestZeroForwardCloseDuringStep(t *testing.T) {
	c := pgtest.NewCluster(2)
	defer c.Close()
	ds, ps := make([]*DDP, 2), make([][]Param, 2)
	closed := make(chan struct{})
	if err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		ps[rank] = zeroParams()
		factory := func(n int) (optim.Optimizer, error) {
			o, err := zeroOpts["adamw"](n)
			h := hookOptimizer{Optimizer: o}
			if rank == 0 {
				h.hook = func() {
					go func() { ds[0].Close(); close(closed) }()
					time.Sleep(100 * time.Millisecond) // Close is under way
				}
			}
			return h, err
		}
		var err error
		ds[rank], err = New(context.Background(), pg, ps[rank], Options{BucketCapMB: zeroCap, FirstBucketCapMB: zeroFirst, Zero: 1,
			ZeroForwardOverlap: true, Optimizer: factory, NoFiniteCheck: true})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer ds[1].Close()
	if err := c.Each(func(rank int, _ procgroup.ProcessGroup) error {
		if err := zeroForwardStep(ds[rank], rank, 0, ps[rank]); err != nil {
			return err
		}
		if rank == 0 {
			<-closed
			return nil
		}
		return ds[rank].WaitParams(context.Background())
	}); err != nil {
		t.Fatal(err)
	}
	if p := ds[0].zero.gather.pending.Load(); p != 0 {
		t.Errorf("Close returned with %d of Step's all-gathers in flight", p)
	}
}
