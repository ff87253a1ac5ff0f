package ddp

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goddp/goddp/ddp/optim"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestZeroOverlapEqualsStep: on gloo over loopback at n = 1, 2 and 3, with AdamW and SGD
// with momentum, at stages 1 and 2, Options.ZeroOverlap gives the bits of the same stage
// without it (parameters and the gathered optimizer state, after 6 steps of random data
// whose gradients each rank reports in its own random order), and so the bits of the
// plain loop where the stage has them (stage 1; stage 2 at n ≤ 2).
func TestZeroOverlapEqualsStep(t *testing.T) { checkEqualsStep(t, zeroOverlap, 3) }

// checkEqualsStep runs zeroRunWith's how at n = 1 to maxN, stages 1 and 2, AdamW and SGD
// with momentum, for 6 steps, against Step (the same bits and optimizer state bytes) and the
// plain loop (the same bits at stage 1, and at stage 2 with n ≤ 2).
func checkEqualsStep(t *testing.T, how zeroHow, maxN int) {
	const steps = 6
	name := map[zeroHow]string{zeroOverlap: "overlapped", zeroForward: "forward overlap"}[how]
	for _, opt := range []string{"adamw", "momentum"} {
		for n := 1; n <= maxN; n++ {
			plain := zeroRun(t, n, 0, opt, steps, nil)
			for zero := 1; zero <= 2; zero++ {
				step := zeroRun(t, n, zero, opt, steps, nil)
				got := zeroRunWith(t, n, zero, how, opt, steps, nil)
				if got.params[0][0] == 0.5 {
					t.Fatalf("%s n=%d zero %d: the %s run did not move the parameters", opt, n, zero, name)
				}
				if d := snapDiff(step, got); d != "" {
					t.Errorf("%s n=%d zero %d: %s vs Step: %s", opt, n, zero, name, d)
				}
				if d := snapDiff(plain, got); (zero == 1 || n <= 2) && d != "" {
					t.Errorf("%s n=%d zero %d: %s vs plain: %s", opt, n, zero, name, d)
				}
				for r, b := range got.bytes {
					if b != step.bytes[r] {
						t.Errorf("%s n=%d zero %d: rank %d holds %d bytes of optimizer state (%s), %d without", opt, n, zero, r, b, name, step.bytes[r])
					}
				}
			}
		}
	}
}

// TestZeroOverlapOrder: on pgtest at 2 ranks, with one rank's collectives delayed and each
// rank reporting its gradients in its own random order, an overlapped step issues, on
// every rank, R(0), R(1), AG(0), R(2), AG(1), …, AG(B−1) (R the reduce-scatter at stage
// 2, the all-reduce at stage 1), all of them by the time Finalize returns and none in
// Step; the first step (the rebuild's, before the first Step has laid out the shards)
// issues its all-gathers in Step. pgtest fails any collective whose ranks disagree.
func TestZeroOverlapOrder(t *testing.T) {
	for zero := 1; zero <= 2; zero++ {
		c := pgtest.NewCluster(2)
		c.SetDelay(1, 200*time.Microsecond)
		red := procgroup.OpAllReduce
		if zero == 2 {
			red = procgroup.OpReduceScatter
		}
		var buckets int
		type mark struct{ begin, fin, step int }
		marks := make([][]mark, 2)
		err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
			ctx := context.Background()
			params := zeroParams()
			d, err := New(ctx, pg, params, Options{BucketCapMB: zeroCap, FirstBucketCapMB: zeroFirst, Zero: zero, ZeroOverlap: true,
				Optimizer: zeroOpts["adamw"], NoFiniteCheck: true})
			if err != nil {
				return err
			}
			defer d.Close()
			for s := range 5 {
				m := mark{begin: len(c.Issued(rank))}
				d.BeginBackward(Sync)
				for _, p := range rand.New(rand.NewPCG(uint64(rank), uint64(s))).Perm(len(params)) {
					if s == 3 {
						time.Sleep(100 * time.Microsecond)
					}
					_ = d.GradReady(p, zeroX(rank, s, p, zeroLens[p]))
				}
				if err := d.Finalize(ctx); err != nil {
					return err
				}
				m.fin = len(c.Issued(rank))
				if err := d.Step(ctx); err != nil {
					return err
				}
				m.step = len(c.Issued(rank))
				marks[rank] = append(marks[rank], m)
			}
			if rank == 0 {
				buckets = len(d.BucketParams())
			}
			return nil
		})
		if err != nil {
			t.Fatalf("zero %d: %v", zero, err)
		}
		if buckets < 3 {
			t.Fatalf("zero %d: %d buckets: the test wants at least 3", zero, buckets)
		}
		want := []procgroup.CollectiveOp{red}
		for k := 1; k < buckets; k++ {
			want = append(want, red, procgroup.OpAllGather)
		}
		want = append(want, procgroup.OpAllGather)
		for rank := range 2 {
			issued := c.Issued(rank)
			for s, m := range marks[rank] {
				var ops []procgroup.CollectiveOp
				for _, rec := range issued[m.begin:m.fin] {
					ops = append(ops, rec.Op)
				}
				inStep := m.step - m.fin
				switch {
				case s == 0 && inStep != buckets:
					t.Errorf("zero %d rank %d step %d (not overlapped): %d collectives in Step, want %d all-gathers", zero, rank, s, inStep, buckets)
				case s > 0 && (inStep != 0 || fmt.Sprint(ops) != fmt.Sprint(want)):
					t.Errorf("zero %d rank %d step %d: issued %v by Finalize and %d in Step, want %v and 0", zero, rank, s, ops, inStep, want)
				}
			}
		}
		c.Close()
	}
}

// gatedPG, once held, holds the completion of every AllGather until Abort: so Step must
// wait.
type gatedPG struct {
	procgroup.ProcessGroup
	held atomic.Bool
	gate chan struct{}
	once sync.Once
}

func (g *gatedPG) AllGather(ctx context.Context, out, in any) procgroup.Work {
	w := g.ProcessGroup.AllGather(ctx, out, in)
	if !g.held.Load() {
		return w
	}
	f := procgroup.NewFuture()
	go func() {
		<-w.Done()
		<-g.gate
		f.Complete(w.Err())
	}()
	return f
}

func (g *gatedPG) Abort(cause error) {
	g.once.Do(func() { close(g.gate) })
	g.ProcessGroup.Abort(cause)
}

// TestZeroOverlapFailures: an overlapped step whose peer dies mid-backward fails
// Finalize and Step with the peer's loss; one whose peer never starts its backward fails
// Finalize with its ctx's error; one whose all-gathers do not complete fails Step with
// its ctx's error; in each the issuer goroutine exits, and nothing hangs.
func TestZeroOverlapFailures(t *testing.T) {
	newDDP := func(pg procgroup.ProcessGroup) (*DDP, []Param, error) {
		params := zeroParams()
		d, err := New(context.Background(), pg, params, Options{BucketCapMB: zeroCap, FirstBucketCapMB: zeroFirst, Zero: 2, ZeroOverlap: true,
			Optimizer: zeroOpts["adamw"], NoFiniteCheck: true})
		return d, params, err
	}
	step := func(d *DDP, rank, s int, ctx context.Context) error {
		d.BeginBackward(Sync)
		for p := range zeroLens {
			if err := d.GradReady(p, zeroX(rank, s, p, zeroLens[p])); err != nil {
				return err
			}
		}
		if err := d.Finalize(ctx); err != nil {
			return err
		}
		return d.Step(ctx)
	}
	// exited waits for the issuer of d's uncollected pass (or none) to be gone.
	exited := func(t *testing.T, run *overlapRun) {
		t.Helper()
		if run == nil {
			t.Fatal("no overlapped pass was started")
		}
		select {
		case <-run.done:
		case <-time.After(10 * time.Second):
			t.Fatal("the issuer goroutine did not exit")
		}
	}
	current := func(d *DDP) *overlapRun {
		d.mu.Lock()
		defer d.mu.Unlock()
		return d.zero.run
	}

	for _, how := range []string{"killed", "paused", "gathers held"} {
		t.Run(how, func(t *testing.T) {
			c := pgtest.NewCluster(2)
			defer c.Close()
			gated := &gatedPG{ProcessGroup: c.Group(0), gate: make(chan struct{})}
			var run *overlapRun
			errs := make([]error, 2)
			var wg sync.WaitGroup
			for rank := range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					var pg procgroup.ProcessGroup = c.Group(rank)
					if rank == 0 && how == "gathers held" {
						pg = gated
					}
					d, _, err := newDDP(pg)
					if err != nil {
						errs[rank] = err
						return
					}
					defer d.Close()
					for s := range 2 {
						if err := step(d, rank, s, context.Background()); err != nil {
							errs[rank] = fmt.Errorf("step %d: %w", s, err)
							return
						}
					}
					ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
					defer cancel()
					switch {
					case rank == 1 && how == "killed":
						c.Kill(1)
						return
					case rank == 1 && how == "paused":
						c.Pause(1)
						<-ctx.Done()
						return
					case rank == 1:
						errs[1] = step(d, rank, 2, context.Background())
						return
					case how == "gathers held":
						gated.held.Store(true)
					}
					d.BeginBackward(Sync)
					run = current(d)
					for p := range zeroLens {
						_ = d.GradReady(p, zeroX(rank, 2, p, zeroLens[p]))
					}
					ferr := d.Finalize(ctx)
					serr := d.Step(ctx)
					if ferr == nil && how != "gathers held" {
						errs[0] = fmt.Errorf("Finalize returned nil")
						return
					}
					switch how {
					case "killed":
						if !errors.Is(ferr, procgroup.ErrPeerLost) || !errors.Is(serr, procgroup.ErrPeerLost) {
							errs[0] = fmt.Errorf("Finalize: %v; Step: %v; want both to wrap ErrPeerLost", ferr, serr)
						}
					case "paused":
						if !errors.Is(ferr, context.DeadlineExceeded) || serr == nil {
							errs[0] = fmt.Errorf("Finalize: %v; Step: %v; want ctx's deadline, then an error", ferr, serr)
						}
					case "gathers held":
						if ferr != nil || !errors.Is(serr, context.DeadlineExceeded) || !strings.Contains(serr.Error(), "waiting for the all-gathers") {
							errs[0] = fmt.Errorf("Finalize: %v; Step: %v; want nil, then ctx's deadline waiting for the all-gathers", ferr, serr)
						}
					}
					if d.Err() == nil {
						errs[0] = errors.Join(errs[0], errors.New("the DDP did not fail"))
					}
				}()
			}
			wg.Wait()
			if how == "paused" {
				c.Resume(1)
			}
			if errs[0] != nil {
				t.Fatalf("rank 0: %v", errs[0])
			}
			if how == "gathers held" && errs[1] != nil {
				t.Errorf("rank 1: %v", errs[1])
			}
			exited(t, run)
		})
	}
}

// TestZeroOverlapRefusals: ZeroOverlap without Zero, or with a CommHook at stage 1, is
// refused at New; ranks that disagree on it fail New with a mismatch; a BeginBackward
// between an overlapped Finalize and its Step fails the DDP with ErrPhase, and
// GatherOptimizerState there is ErrPhase.
func TestZeroOverlapRefusals(t *testing.T) {
	f := zeroOpts["adamw"]
	one := func() []Param { return []Param{{Name: "w", Data: make([]float32, 4), Grad: make([]float32, 4)}} }
	c := pgtest.NewCluster(1)
	defer c.Close()
	ctx := context.Background()
	for _, tc := range []struct {
		o    Options
		want string
	}{
		{Options{ZeroOverlap: true}, "ZeroOverlap without Options.Zero"},
		{Options{Zero: 1, Optimizer: f, ZeroOverlap: true, CommHook: FP16CompressHook()}, "Options.ZeroOverlap and a CommHook"},
	} {
		_, err := New(ctx, c.Group(0), one(), tc.o)
		if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.o, err, tc.want)
		}
	}

	c2 := pgtest.NewCluster(2)
	defer c2.Close()
	errs := make([]error, 2)
	_ = c2.Each(func(r int, pg procgroup.ProcessGroup) error {
		d, err := New(ctx, pg, one(), Options{Zero: 1, Optimizer: f, ZeroOverlap: r == 1})
		if err == nil {
			d.Close()
		}
		errs[r] = err
		return nil
	})
	for r, err := range errs {
		if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "ZeroOverlap") {
			t.Errorf("rank %d: overlap on rank 1 only: %v", r, err)
		}
	}

	c3 := pgtest.NewCluster(2)
	defer c3.Close()
	err := c3.Each(func(r int, pg procgroup.ProcessGroup) error {
		params := zeroParams()
		d, err := New(ctx, pg, params, Options{BucketCapMB: zeroCap, FirstBucketCapMB: zeroFirst, Zero: 1, ZeroOverlap: true, Optimizer: f})
		if err != nil {
			return err
		}
		defer d.Close()
		for s := range 2 {
			d.BeginBackward(Sync)
			for p := range params {
				_ = d.GradReady(p, zeroX(r, s, p, zeroLens[p]))
			}
			if err := d.Finalize(ctx); err != nil {
				return err
			}
			if s == 0 {
				if err := d.Step(ctx); err != nil {
					return err
				}
			}
		}
		if err := d.GatherOptimizerState(ctx, f0State(len(params))); !errors.Is(err, ErrPhase) {
			return fmt.Errorf("GatherOptimizerState before Step: %v, want ErrPhase", err)
		}
		d.BeginBackward(Sync)
		if err := d.Err(); !errors.Is(err, ErrPhase) || !strings.Contains(err.Error(), "followed by Step") {
			return fmt.Errorf("BeginBackward before Step: %v, want ErrPhase naming Step", err)
		}
		if err := d.Step(ctx); err == nil {
			return errors.New("Step after the failure: nil")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// f0State is an AdamW state over the first n of zeroLens (for a refusal: its vectors'
// names and lengths).
func f0State(n int) optim.State {
	total := 0
	for _, l := range zeroLens[:n] {
		total += l
	}
	st := optim.State{Steps: new(int64)}
	for _, name := range []string{"adamw.m", "adamw.v"} {
		st.Vectors = append(st.Vectors, optim.Vector{Name: name, Data: make([]float32, total)})
	}
	return st
}

// TestZeroOverlapGlooPeerDies: on gloo over loopback, a rank whose peer aborts its group
// before an overlapped step's backward gets an error from Finalize and from Step, well
// before its ctx ends, and its issuer goroutine exits.
func TestZeroOverlapGlooPeerDies(t *testing.T) {
	var run *overlapRun
	var ferr, serr error
	var took time.Duration
	err := glooWorld(2, func(rank int, pg procgroup.ProcessGroup) error {
		params := zeroParams()
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		d, err := New(ctx, pg, params, Options{BucketCapMB: zeroCap, FirstBucketCapMB: zeroFirst, Zero: 1, ZeroOverlap: true, Optimizer: zeroOpts["adamw"]})
		if err != nil {
			return err
		}
		defer d.Close()
		for s := range 3 {
			if rank == 1 && s == 2 {
				pg.Abort(errors.New("rank 1 dies"))
				return nil
			}
			t0 := time.Now()
			d.BeginBackward(Sync)
			if s == 2 {
				d.mu.Lock()
				run = d.zero.run
				d.mu.Unlock()
			}
			for p := range params {
				_ = d.GradReady(p, zeroX(rank, s, p, zeroLens[p]))
			}
			fe := d.Finalize(ctx)
			se := d.Step(ctx)
			if s < 2 && (fe != nil || se != nil) {
				return fmt.Errorf("step %d: Finalize %v, Step %v", s, fe, se)
			}
			if rank == 0 {
				ferr, serr, took = fe, se, time.Since(t0)
			}
		}
		return nil
	})
	if err != nil {
		t.Logf("the world's own error (after the abort): %v", err)
	}
	if ferr == nil || serr == nil || errors.Is(ferr, context.DeadlineExceeded) {
		t.Fatalf("Finalize: %v; Step: %v; want errors from the lost peer, not the deadline", ferr, serr)
	}
	if took > 15*time.Second {
		t.Errorf("the failed step took %v", took)
	}
	if run == nil {
		t.Fatal("no overlapped pass was started")
	}
	select {
	case <-run.done:
	case <-time.After(10 * time.Second):
		t.Fatal("the issuer goroutine did not exit")
	}
	t.Logf("Finalize: %v (after %v)", ferr, took)
}

// TestZeroOverlapNoParams: a DDP without parameters has no buckets; its overlapped
// passes issue nothing, and neither index the missing last bucket (which panicked
// the issuer goroutine, and so the process) nor hang.
func TestZeroOverlapNoParams(t *testing.T) {
	c := pgtest.NewCluster(2)
	defer c.Close()
	err := c.Each(func(r int, pg procgroup.ProcessGroup) error {
		ctx := context.Background()
		d, err := New(ctx, pg, nil, Options{Zero: 1, Optimizer: zeroOpts["adamw"], ZeroOverlap: true})
		if err != nil {
			return err
		}
		defer d.Close()
		for s := range 3 {
			d.BeginBackward(Sync)
			if err := d.Finalize(ctx); err != nil {
				return fmt.Errorf("step %d: Finalize: %w", s, err)
			}
			if err := d.Step(ctx); err != nil {
				return fmt.Errorf("step %d: Step: %w", s, err)
			}
		}
		if r == 0 && d.zero.passes != 2 {
			return fmt.Errorf("%d overlapped passes, want 2", d.zero.passes)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestZeroOverlapGradsChanged: without Options.ZeroOverlap, Step steps on Param.Grad as
// the trainer leaves it after Finalize (clipped or scaled, say); the overlapped step has
// already taken the reduced gradients during backward, so a trainer that changes its
// rank's blocks of Param.Grad between Finalize and Step gets an error from Step, not
// silently other bits.
func TestZeroOverlapGradsChanged(t *testing.T) {
	for zero := 1; zero <= 2; zero++ {
		c := pgtest.NewCluster(2)
		errs := make([]error, 2)
		_ = c.Each(func(rank int, pg procgroup.ProcessGroup) error {
			ctx := context.Background()
			params := zeroParams()
			d, err := New(ctx, pg, params, Options{BucketCapMB: zeroCap, FirstBucketCapMB: zeroFirst, Zero: zero, ZeroOverlap: true,
				Optimizer: zeroOpts["momentum"]})
			if err != nil {
				errs[rank] = err
				return nil
			}
			defer d.Close()
			for s := range 3 {
				d.BeginBackward(Sync)
				for p := range params {
					_ = d.GradReady(p, zeroX(rank, s, p, zeroLens[p]))
				}
				if err := d.Finalize(ctx); err != nil {
					errs[rank] = fmt.Errorf("step %d: Finalize: %w", s, err)
					return nil
				}
				if s == 2 { // the trainer clips: every gradient halved
					for _, p := range params {
						for k, g := range p.Grad.([]float32) {
							p.Grad.([]float32)[k] = g / 2
						}
					}
				}
				if err := d.Step(ctx); err != nil {
					errs[rank] = fmt.Errorf("step %d: Step: %w", s, err)
					return nil
				}
			}
			return nil
		})
		c.Close()
		for rank, err := range errs {
			if err == nil || !strings.Contains(err.Error(), "step 2: Step") || !strings.Contains(err.Error(), "changed after Finalize") {
				t.Errorf("zero %d rank %d: %v, want Step 2 to fail on the changed Param.Grad", zero, rank, err)
			}
		}
	}
}

// TestZeroOverlapUnusedNoSync: on pgtest at 2 ranks, with FindUnusedParameters (each rank
// leaving its own parameters unused, pass by pass) and a NoSync pass before each synced
// one, Options.ZeroOverlap gives the bits of the same stage without it.
func TestZeroOverlapUnusedNoSync(t *testing.T) {
	run := func(zero int, overlap bool) [][][]float32 {
		out := make([][][]float32, 2)
		c := pgtest.NewCluster(2)
		defer c.Close()
		err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
			ctx := context.Background()
			params := make([]Param, len(zeroLens))
			for p, l := range zeroLens {
				w := make([]float32, l)
				for k := range w {
					w[k] = 0.5
				}
				params[p] = Param{Name: fmt.Sprint("w", p), Data: w, Grad: make([]float32, l)}
			}
			d, err := New(ctx, pg, params, Options{BucketCapMB: zeroCap, FirstBucketCapMB: zeroFirst, Zero: zero, ZeroOverlap: overlap,
				Optimizer: zeroOpts["adamw"], FindUnusedParameters: true})
			if err != nil {
				return err
			}
			defer d.Close()
			for s := range 6 {
				for a := range 2 {
					mode := Accumulate
					if a == 1 {
						mode = Sync
					}
					d.BeginBackward(mode)
					for _, p := range rand.New(rand.NewPCG(uint64(rank), uint64(s*2+a))).Perm(len(params)) {
						if (p+s+rank)%3 == 0 {
							continue // unused this pass
						}
						if err := d.GradReady(p, zeroX(rank, s*2+a, p, zeroLens[p])); err != nil {
							return err
						}
					}
					if err := d.Finalize(ctx); err != nil {
						return err
					}
				}
				if err := d.Step(ctx); err != nil {
					return err
				}
			}
			for _, p := range params {
				out[rank] = append(out[rank], append([]float32(nil), p.Data.([]float32)...))
			}
			return nil
		})
		if err != nil {
			t.Fatalf("zero %d overlap %v: %v", zero, overlap, err)
		}
		return out
	}
	for zero := 1; zero <= 2; zero++ {
		a, b := run(zero, false), run(zero, true)
		if fmt.Sprint(a) != fmt.Sprint(b) {
			t.Errorf("zero %d: overlapped differs", zero)
		}
	}
}

// TestZeroOverlapResume: a checkpoint of non-overlapped ZeRO (GatherOptimizerState after
// 3 steps), restored with SetOptimizerState into an overlapped run, continues with the
// bits of the same restore without the overlap, at the same world size (and then the bits
// of 6 steps without a break) and at another one: the per-bucket optimizers take their
// blocks, and their step counts, from the whole state.
func TestZeroOverlapResume(t *testing.T) {
	for zero := 1; zero <= 2; zero++ {
		for _, nn := range [][2]int{{2, 2}, {3, 2}, {2, 3}} {
			from, to := nn[0], nn[1]
			half := zeroRun(t, from, zero, "adamw", 3, nil)
			step := zeroRun(t, to, zero, "adamw", 3, &half)
			over := zeroRunWith(t, to, zero, zeroOverlap, "adamw", 3, &half)
			if d := snapDiff(step, over); d != "" {
				t.Errorf("zero %d, %d→%d ranks: resumed overlapped vs resumed Step: %s", zero, from, to, d)
			}
			if from == to {
				if d := snapDiff(zeroRun(t, to, zero, "adamw", 6, nil), over); d != "" {
					t.Errorf("zero %d, %d ranks: resumed overlapped vs uninterrupted: %s", zero, to, d)
				}
			}
		}
	}
}

// TestZeroOverlapClose: Close in the middle of an overlapped pass's backward (rank 0 has
// handed over only some buckets) and between Finalize and Step returns, stops the issuer
// before it returns, and Step then says ErrClosed.
func TestZeroOverlapClose(t *testing.T) {
	for _, when := range []string{"backward", "before step"} {
		c := pgtest.NewCluster(2)
		err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
			ctx := context.Background()
			params := zeroParams()
			d, err := New(ctx, pg, params, Options{BucketCapMB: zeroCap, FirstBucketCapMB: zeroFirst, Zero: 2, ZeroOverlap: true,
				Optimizer: zeroOpts["adamw"]})
			if err != nil {
				return err
			}
			for s := range 2 {
				d.BeginBackward(Sync)
				for p := range params {
					if s == 1 && when == "backward" && p == 4 && rank == 0 {
						break
					}
					_ = d.GradReady(p, zeroX(rank, s, p, zeroLens[p]))
				}
				if s == 1 && when == "backward" {
					break
				}
				if err := d.Finalize(ctx); err != nil {
					return err
				}
				if s == 1 {
					break
				}
				if err := d.Step(ctx); err != nil {
					return err
				}
			}
			d.mu.Lock()
			run := d.zero.run
			d.mu.Unlock()
			if run == nil {
				return errors.New("no overlapped pass to close")
			}
			ch := make(chan struct{})
			go func() { d.Close(); close(ch) }()
			select {
			case <-ch:
			case <-time.After(10 * time.Second):
				return errors.New("Close hangs")
			}
			select {
			case <-run.done:
			default:
				return errors.New("the issuer outlives Close")
			}
			if err := d.Step(ctx); err != ErrClosed {
				return fmt.Errorf("Step after Close: %v", err)
			}
			return nil
		})
		c.Close()
		if err != nil {
			t.Errorf("%s: %v", when, err)
		}
	}
}
