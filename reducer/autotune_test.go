package reducer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"sync"
	"testing"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/bucket/sim"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/dtype"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestAutoEquivalence is TestEquivalence with AutoBucketCap: the gradients are right at
// every step, through the three rebuilds of Note [Auto buckets] (a probe, one bucket, eight,
// then the chosen caps), and every rank issues the same collectives in the same order.
func TestAutoEquivalence(t *testing.T) {
	rng := rand.New(rand.NewPCG(77, 1))
	for n := 1; n <= 3; n++ {
		for _, view := range []bool{false, true} {
			for _, noSync := range []bool{false, true} {
				for trial := 0; trial < 3; trial++ {
					seed := rng.Uint64()
					t.Run(fmt.Sprintf("n=%d/view=%v/nosync=%v/seed=%d", n, view, noSync, seed), func(t *testing.T) {
						checkEquivalence(t, n, view, noSync, true, n%2 == 0, seed, 12)
					})
				}
			}
		}
	}
}

// TestAutoRebuilds follows Note [Auto buckets] pass by pass on 2 ranks and 16 gradients of
// 256 KiB: one bucket after pass 1, eight after pass 2, the plan's layout after pass 3, the
// measured step after pass 9; every average exact, every collective the same on both ranks.
// The buckets come from the group's allocator (allocGroup): two buffers in all, since the
// probe runs on the one the next layout takes and later layouts reuse them (Note [Bucket
// memory]).
func TestAutoRebuilds(t *testing.T) {
	const n, nParams, length, passes = 2, 16, 1 << 16, 9
	ctx := testCtx(t)
	c := pgtest.NewCluster(n)
	defer c.Close()
	errs := runRanks(n, func(rank int) (err error) {
		params := make([]Param, nParams)
		for i := range params {
			params[i] = Param{Name: fmt.Sprintf("w%d", i), Grad: make([]float32, length)}
		}
		pg := &allocGroup{ProcessGroup: c.Group(rank), live: map[*byte]int{}}
		r, err := New(pg, params, Options{BucketCapMB: AutoBucketCap})
		if err != nil {
			return err
		}
		defer r.Close()
		defer func() {
			if pg.allocs != 2 {
				err = errors.Join(err, fmt.Errorf("%d buffers allocated, want 2 (layouts 0 and 1; the probe and the later layouts reuse them)", pg.allocs))
			}
		}()
		// Note [Bucket memory]: the buffer of layout k is that of layout k-2 from the
		// second rebuild on, and no spare is held once no rebuild is owed.
		mems := []*float32{&r.mem[0].f32[0]}
		grad := make([]float32, length)
		for pass := 1; pass <= passes; pass++ {
			if pass > 1 && pass <= 4 {
				mems = append(mems, &r.mem[0].f32[0])
				k := len(mems) - 1
				unchanged := pass == 4 && r.Generation() == 2 // the plan's layout is pass 3's
				if same := mems[k] == mems[k-1]; !unchanged && (same || (k >= 2 && mems[k] != mems[k-2])) {
					return fmt.Errorf("layout %d's bucket memory: the same as layout %d's: %v, as layout %d's: %v; want a new buffer, then the one before", k, k-1, same, k-2, k >= 2 && mems[k] == mems[k-2])
				}
				if spare := r.spare[0].f32 != nil; spare != (pass < 4) {
					return fmt.Errorf("after rebuild %d: a spare buffer held: %v, want %v", pass-1, spare, pass < 4)
				}
			}
			if err := r.BeginBackward(Sync); err != nil {
				return err
			}
			for i := nParams - 1; i >= 0; i-- {
				for k := range grad {
					grad[k] = float32((rank + 1) * (i + 1) * pass)
				}
				if err := r.GradReady(i, grad); err != nil {
					return err
				}
			}
			if err := r.Finalize(ctx); err != nil {
				return err
			}
			for i, p := range params {
				want := float32(3*(i+1)*pass) / 2 // the mean of 1× and 2×
				for k, v := range p.Grad.([]float32) {
					if v != want {
						return fmt.Errorf("pass %d: gradient %d [%d] = %v, want %v", pass, i, k, v, want)
					}
				}
			}
			nb, gen, plan := len(r.Buckets()), r.Generation(), r.AutoPlan()
			switch pass {
			case 1:
				if nb != 1 || gen != 1 || plan != nil {
					return fmt.Errorf("after pass 1: %d buckets, generation %d, plan %v; want one bucket, 1, none", nb, gen, plan)
				}
			case 2:
				if nb != 8 || gen != 2 || plan != nil {
					return fmt.Errorf("after pass 2: %d buckets, generation %d, plan %v; want 8, 2, none", nb, gen, plan)
				}
			case 3:
				if err := checkAutoPlan(r); err != nil {
					return err
				}
			case passes - 1:
				if plan.Measured != 0 {
					return fmt.Errorf("measured %v after %d passes with the plan's layout, want it after %d", plan.Measured, passes-4, autoMeasured+1)
				}
			case passes:
				if plan.Measured <= 0 {
					return fmt.Errorf("no measured step after %d passes with the plan's layout", passes-3)
				}
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	if !reflect.DeepEqual(c.Issued(1), c.Issued(0)) {
		t.Fatalf("the ranks issued different collectives:\n%v\n%v", c.Issued(0), c.Issued(1))
	}
	// Note [Probe twice over]: right after the broadcast of pass 1's order, the probe's
	// sizes (64 KiB, 512 KiB, and all 4 MiB of the gradients) in turn, then again.
	issued := c.Issued(0)
	var got []int
	for k, rec := range issued {
		if rec.Op == procgroup.OpBroadcast {
			for _, p := range issued[k+1:] {
				if p.Op != procgroup.OpAllReduce || len(got) == 6 {
					break
				}
				got = append(got, p.Count*p.DType.Size())
			}
			break
		}
	}
	if want := []int{64 << 10, 512 << 10, 4 << 20, 64 << 10, 512 << 10, 4 << 20}; !reflect.DeepEqual(got, want) {
		t.Fatalf("the all-reduces after the first broadcast: %v bytes, want the probe's sizes twice over %v (issued: %v)", got, want, issued)
	}
}

// checkAutoPlan: after the steps of checkEquivalence, the plan exists and the layout is the
// one its caps give from the agreed order.
func checkAutoPlan(r *Reducer) error {
	p := r.AutoPlan()
	if p == nil {
		return errors.New("no AutoPlan after 6 synced steps")
	}
	if p.DecidedAfter != autoPasses || p.Profile == nil || p.Measured != 0 {
		return fmt.Errorf("plan %+v: want decided after %d passes, a profile, and no measured time before 6 more steps", p, autoPasses)
	}
	if c := p.Profile.Comm; !c.Lower || len(c.Points) == 0 {
		return fmt.Errorf("plan's all-reduce curve %+v: want the probe's points, as a lower curve (Note [Lower curve] in package sim)", c)
	}
	// Note [Keep the default]: the default caps unless rank 0 predicted a gain of 5% or more
	if keep := [2]int64{mib(r.opts.FirstBucketCapMB), bucket.DefaultCapBytes}; [2]int64{p.DefaultFirstCapBytes, p.DefaultCapBytes} != keep ||
		p.Kept != (p.Gain < autoMinGain) || p.Gain < 0 || p.Gain >= 1 || (p.Kept && [2]int64{p.FirstCapBytes, p.CapBytes} != keep) {
		return fmt.Errorf("plan: caps %d/%d, default %d/%d, gain %v, kept %v; want the default caps %v kept exactly when the gain is under %v",
			p.FirstCapBytes, p.CapBytes, p.DefaultFirstCapBytes, p.DefaultCapBytes, p.Gain, p.Kept, keep, autoMinGain)
	}
	want, err := bucket.AssignOrdered(r.bparams, r.auto.order, p.FirstCapBytes, p.CapBytes)
	if err != nil {
		return err
	}
	if got := r.Buckets(); !sameBuckets(got, want) || p.Buckets != len(want) {
		return fmt.Errorf("layout of %d buckets (plan says %d), want the %d of caps %d/%d", len(got), p.Buckets, len(want), p.FirstCapBytes, p.CapBytes)
	}
	return nil
}

// TestAutoOneRank: with one rank there is nothing to tune: PyTorch's default layout, no plan.
func TestAutoOneRank(t *testing.T) {
	_, r, _ := newSingle(t, []int{300000, 10, 300000}, Options{BucketCapMB: AutoBucketCap})
	ctx := testCtx(t)
	for range 4 {
		if err := r.BeginBackward(Sync); err != nil {
			t.Fatal(err)
		}
		for _, i := range []int{2, 1, 0} {
			if err := r.GradReady(i, make([]float32, []int{300000, 10, 300000}[i])); err != nil {
				t.Fatal(err)
			}
		}
		if err := r.Finalize(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if p := r.AutoPlan(); p != nil {
		t.Errorf("AutoPlan with one rank: %v", p)
	}
	if got := len(r.Buckets()); got != 2 { // 1 MiB first cap: {2}, then {1, 0} under 25 MiB
		t.Errorf("%d buckets, want the default caps' 2", got)
	}
}

func TestAutoBadOptions(t *testing.T) {
	c := pgtest.NewCluster(2)
	defer c.Close()
	params := []Param{{Name: "w", Grad: make([]float32, 4)}}
	if _, err := New(c.Group(0), params, Options{BucketCapMB: AutoBucketCap, Device: true}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("AutoBucketCap with Device: %v, want ErrInvalidArgument", err)
	}
	if _, err := New(c.Group(0), params, Options{BucketCapMB: -2}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("BucketCapMB -2: %v, want ErrInvalidArgument", err)
	}
}

func ms(x float64) time.Duration { return time.Duration(x * float64(time.Millisecond)) }

// TestAutoProfile turns hand-made measurements into the model's inputs, every figure worked
// out on paper: three gradients of 400 bytes, ready in the order 2, 1, 0.
func TestAutoProfile(t *testing.T) {
	c := pgtest.NewCluster(2)
	defer c.Close()
	r := &Reducer{pg: c.Group(0), log: zap.NewNop(), bparams: []bucket.Param{
		{Name: "a", DType: dtype.Float32, Len: 100}, {Name: "b", DType: dtype.Float32, Len: 100}, {Name: "c", DType: dtype.Float32, Len: 100}}}
	t0 := time.Unix(1000, 0)
	// Pass 2: one bucket, launched with the last gradient at 30 ms and done at 43 ms, as long
	// as the probe's all-reduce of that size alone: no skew.
	s2 := &IterStats{Start: t0.Add(ms(100)),
		GradReady:   []time.Duration{ms(30), ms(20), ms(10)},
		BucketBytes: []int64{1200}, BucketLaunched: []time.Duration{ms(30)}, BucketFinished: []time.Duration{ms(43)},
		BackwardEnd: ms(40), CopyTime: ms(1.2), HookTime: ms(1.3), UnpackTime: ms(0.6)}
	// Pass 3: one bucket per gradient. Stretches of backward against pass 2's: 10→12 ms with
	// 10 ms in flight (a fraction 0.2), 10→14.5 ms with 5 ms in flight (0.9, an outlier),
	// 10→12 ms with 10 ms in flight (0.2).
	s3 := &IterStats{Start: t0.Add(ms(200)),
		GradReady:      []time.Duration{ms(36.5), ms(22), ms(10)},
		BucketBytes:    []int64{400, 400, 400},
		BucketLaunched: []time.Duration{ms(10), ms(22), ms(36.5)},
		BucketFinished: []time.Duration{ms(20), ms(27), ms(46.5)},
		BackwardEnd:    ms(48.5), CopyTime: ms(1.2), HookTime: ms(1.5)}
	a := &autoTuner{total: 1200, order: []int{2, 1, 0}, passes: []*IterStats{s2, s3},
		probe: []sim.Point{{Bytes: 400, Seconds: 5e-3}, {Bytes: 1200, Seconds: 13e-3}},
		ends:  []time.Time{t0.Add(ms(60)), t0.Add(ms(150))}}
	p, err := a.profile(r, nil)
	if err != nil {
		t.Fatal(err)
	}
	near := func(what string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 1e-6*math.Max(1e-3, math.Abs(want)) {
			t.Errorf("%s = %v, want %v", what, got, want)
		}
	}
	near("CopyPerByte", p.CopyPerByte, 1.2e-3/1200)
	near("UnpackPerByte", p.UnpackPerByte, 0.6e-3/1200)
	// each ready time less the copies before it (0.4 ms per gradient)
	near("Ready[2]", p.Ready[2], 10e-3)
	near("Ready[1]", p.Ready[1], 19.6e-3)
	near("Ready[0]", p.Ready[0], 29.2e-3)
	near("Backward", p.Backward, 38.7e-3)             // 40 ms less 1.3 ms in the hooks
	near("Other", p.Other, 50e-3)                     // pass 2's Finalize ended at 150 ms, pass 3 began at 200
	near("Launch", p.Launch, 0.1e-3)                  // (1.5 − 1.2) ms over 3 buckets
	near("Slowdown", p.Slowdown, 0.25)                // the weighted median fraction 0.2 = s/(1+s)
	near("CommSlowdown", p.CommSlowdown, 25.0/15.0-1) // 25 ms in flight inside backward for 3 × 5 ms alone
	near("Comm(1200)", p.Comm.Seconds(1200), 13e-3)   // the probe's
	near("Skew", p.Skew, 0)
	if p.World != 2 || len(p.Order) != 3 || p.Order[0] != 2 {
		t.Errorf("World %d, Order %v", p.World, p.Order)
	}

	// Pass 2's bucket 2 ms slower than alone: the last rank launched it 2 ms late. The
	// collectives of pass 3 count from 2 ms after their launch: 8, 3 and 8 ms inside
	// backward for 3 × 5 ms alone; the stretches' fractions become 2/8, 4.5/3 and 2/8.
	s2.BucketFinished[0] = ms(45)
	if p, err = a.profile(r, nil); err != nil {
		t.Fatal(err)
	}
	near("Skew", p.Skew, 2e-3)
	near("CommSlowdown with skew", p.CommSlowdown, 19.0/15.0-1)
	near("Slowdown with skew", p.Slowdown, 0.25/0.75)

	// Pass 2's wait inflated to 20 ms, while pass 3's last bucket ran alone after backward
	// (48.5 ms, the bucket before it done at 27) for 6 ms, 1 ms beyond the curve's 5: the
	// smaller sample, 1 ms, is the skew. Under backward, pass 3's bucket is no sample.
	s2.BucketFinished[0] = ms(63)
	s3.BucketLaunched[2], s3.BucketFinished[2] = ms(48.5), ms(54.5)
	if p, err = a.profile(r, nil); err != nil {
		t.Fatal(err)
	}
	near("Skew from pass 3", p.Skew, 1e-3)
	s2.BucketFinished[0] = ms(45) // 2 ms, now below pass 3's
	s3.BucketFinished[2] = ms(57.5)
	if p, err = a.profile(r, nil); err != nil {
		t.Fatal(err)
	}
	near("Skew from pass 2, the smaller", p.Skew, 2e-3)
	s2.BucketFinished[0] = ms(63)
	s3.BucketLaunched[2], s3.BucketFinished[2] = ms(36.5), ms(46.5)
	if p, err = a.profile(r, nil); err != nil {
		t.Fatal(err)
	}
	near("Skew with pass 3's bucket under backward", p.Skew, 20e-3)
	s2.BucketFinished[0] = ms(45)

	// Note [Last rank's start]: the other rank launched each of pass 3's collectives later,
	// so that each ran for only its last 5 ms, the curve's time: [15, 20], [22, 27] and
	// [41.5, 46.5]. No comm slowdown is left; the stretches' fractions become (12−10)/5,
	// (14.5−10)/5 and (12−10)/5, of equal weights, whose median 0.4 is s = 2/3.
	if p, err = a.profile(r, []time.Duration{ms(5), ms(5), ms(5)}); err != nil {
		t.Fatal(err)
	}
	near("CommSlowdown from the last rank's start", p.CommSlowdown, 0)
	near("Slowdown from the last rank's start", p.Slowdown, 0.4/0.6)
	// A bucket no rank timed (-1) counts from skew after this rank's launch: with pass 2's
	// 2 ms of skew, bucket 0 then runs [12, 20], 18 ms in flight inside backward for 15 alone.
	if p, err = a.profile(r, []time.Duration{-1, ms(5), ms(5)}); err != nil {
		t.Fatal(err)
	}
	near("CommSlowdown with bucket 0 untimed", p.CommSlowdown, 18.0/15.0-1)

	// A gradient pass 2 never got: no model.
	s2.GradReady[1] = -1
	if _, err := a.profile(r, nil); err == nil {
		t.Error("profile with a missing gradient: no error")
	}
	// The old estimate, extra compute over the whole in-flight time, would have taken the
	// outlier in: (48.5 − 1.5 − (40 − 1.3)) / 25 = 0.332, s = 0.497.
	s2.GradReady[1] = ms(20)
	if got := slowdown(s2, s3, []int{2, 1, 0}, 0, nil); math.Abs(got-0.25) > 1e-9 {
		t.Errorf("slowdown %v, want 0.25", got)
	}

	// Note [Shared speed]: the stretches 10→25 and 25→40 ms each take 5 ms more than pass
	// 2's 10 with 15 ms in flight (f = 1/3) and 40→50 none more with 10 (f = 0): s = 0.5 by
	// the weighted median. The buckets run 40 ms inside backward (and 5 after) for 3 × 5 ms
	// alone: c = 40/(15−5) − 1 = 3. The pair 0.5, 3 is beyond s·c ≤ 1, so both are divided by
	// √1.5.
	s2.BucketFinished[0] = ms(43) // no skew
	a.passes[1] = &IterStats{Start: t0.Add(ms(200)),
		GradReady:      []time.Duration{ms(40), ms(25), ms(10)},
		BucketBytes:    []int64{400, 400, 400},
		BucketLaunched: []time.Duration{ms(10), ms(25), ms(40)},
		BucketFinished: []time.Duration{ms(25), ms(40), ms(55)},
		BackwardEnd:    ms(50), CopyTime: ms(1.2), HookTime: ms(1.5)}
	if p, err = a.profile(r, nil); err != nil {
		t.Fatal(err)
	}
	near("Slowdown, shared", p.Slowdown, 0.5/math.Sqrt(1.5))
	near("CommSlowdown, shared", p.CommSlowdown, 3/math.Sqrt(1.5))
}

// TestSlowdownNotOverlap: a pass 3 uniformly 1.5× slower than pass 2, collectives in flight
// or not, is a slower machine, not a slowdown under overlap; an overlapped stretch slowed
// beyond that counts, up to s = 1.
func TestSlowdownNotOverlap(t *testing.T) {
	s2 := &IterStats{GradReady: []time.Duration{ms(40), ms(30), ms(20)}, BackwardEnd: ms(50)}
	s3 := &IterStats{GradReady: []time.Duration{ms(60), ms(45), ms(30)}, BackwardEnd: ms(75),
		BucketLaunched: []time.Duration{ms(30), ms(45)}, BucketFinished: []time.Duration{ms(45), ms(60)}}
	order := []int{2, 1, 0}
	if got := slowdown(s2, s3, order, 0, nil); got != 0 {
		t.Errorf("uniformly slower pass 3: slowdown %v, want 0", got)
	}
	// The stretch 30→48 ms takes 3 ms more than 1.5 × 10 ms, with 15 ms in flight
	// (f = 0.2), and so does 48→66: the weighted median is 0.2, s = 0.25.
	s3 = &IterStats{GradReady: []time.Duration{ms(66), ms(48), ms(30)}, BackwardEnd: ms(81),
		BucketLaunched: []time.Duration{ms(30), ms(48)}, BucketFinished: []time.Duration{ms(45), ms(63)}}
	if got := slowdown(s2, s3, order, 0, nil); math.Abs(got-0.25) > 1e-9 {
		t.Errorf("slowdown %v, want 0.25", got)
	}
	// Far slower stretches are capped at s = 1.
	s3.GradReady = []time.Duration{ms(130), ms(80), ms(30)}
	s3.BackwardEnd = ms(145)
	s3.BucketFinished = []time.Duration{ms(80), ms(130)}
	s3.BucketLaunched = []time.Duration{ms(30), ms(80)}
	if got := slowdown(s2, s3, order, 0, nil); got != 1 {
		t.Errorf("slowdown %v, want the cap 1", got)
	}
}

// TestAutoPlanString: the line the trainer prints.
func TestAutoPlanString(t *testing.T) {
	p := &AutoPlan{FirstCapBytes: 1 << 19, CapBytes: 5 << 20, Buckets: 7, DecidedAfter: 3,
		Predicted: sim.Result{Step: 0.1234}, Default: sim.Result{Step: 0.2, Buckets: 2}, Measured: ms(130.5),
		DefaultFirstCapBytes: 1 << 20, DefaultCapBytes: 25 << 20, Gain: 0.383}
	want := "auto bucket layout after 3 synced steps: first cap 0.5 MB, cap 5 MB, 7 buckets; predicted 123.40 ms/step (default 1/25 MB: 200.00, 2 buckets), measured 130.50 ms/step"
	if got := p.String(); got != want {
		t.Errorf("String:\n got %s\nwant %s", got, want)
	}
	kept := &AutoPlan{FirstCapBytes: 1 << 20, CapBytes: 25 << 20, Buckets: 2, DecidedAfter: 3,
		Predicted: sim.Result{Step: 0.2, Buckets: 2}, Default: sim.Result{Step: 0.2, Buckets: 2},
		DefaultFirstCapBytes: 1 << 20, DefaultCapBytes: 25 << 20, Gain: 0.0312, Kept: true}
	want = "auto bucket layout after 3 synced steps: first cap 1 MB, cap 25 MB, 2 buckets; predicted 200.00 ms/step (default 1/25 MB: 200.00, 2 buckets); kept: the best layout found was predicted 3.1% faster, under the 5% margin"
	if got := kept.String(); got != want {
		t.Errorf("String, kept:\n got %s\nwant %s", got, want)
	}
}

// TestLastStarts: each rank gives its pass 3 times from launch (or the previous bucket's
// end, if later) to the end; every rank gets the least over the ranks, bucket by bucket,
// and -1 where a rank did not time a bucket.
func TestLastStarts(t *testing.T) {
	c := pgtest.NewCluster(2)
	defer c.Close()
	s3 := []*IterStats{
		// rank 0 launched early: 12, 5 (from bucket 0's end at 20) and 9 ms; buckets 3 and 4
		// untimed
		{BucketBytes: []int64{4, 4, 4, 4, 4}, BucketLaunched: []time.Duration{ms(8), ms(18), ms(30), ms(40), ms(41)},
			BucketFinished: []time.Duration{ms(20), ms(25), ms(39), -1, -1}},
		// rank 1 launched late: 4, 5 and 3 ms, and 2 ms for bucket 3; bucket 4 untimed
		{BucketBytes: []int64{4, 4, 4, 4, 4}, BucketLaunched: []time.Duration{ms(16), ms(19), ms(36), ms(41), -1},
			BucketFinished: []time.Duration{ms(20), ms(25), ms(39), ms(43), -1}},
	}
	want := []time.Duration{ms(4), ms(5), ms(3), ms(2), -1}
	var wg sync.WaitGroup
	got := make([][]time.Duration, 2)
	errs := make([]error, 2)
	for rank := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := &Reducer{pg: c.Group(rank), log: zap.NewNop()}
			a := &autoTuner{passes: []*IterStats{{}, s3[rank]}}
			got[rank], errs[rank] = a.lastStarts(context.Background(), r)
		}()
	}
	wg.Wait()
	for rank := range 2 {
		if errs[rank] != nil {
			t.Fatalf("rank %d: %v", rank, errs[rank])
		}
		if len(got[rank]) != len(want) {
			t.Fatalf("rank %d: %v, want %v", rank, got[rank], want)
		}
		for b := range want {
			if d := got[rank][b] - want[b]; d < -time.Microsecond || d > time.Microsecond {
				t.Errorf("rank %d bucket %d: %v, want %v", rank, b, got[rank][b], want[b])
			}
		}
	}
}

// TestBucketMemoryOneRebuild: without auto, the one rebuild (Note [Rebuild]) keeps no spare
// buffer (Note [Bucket memory]), and the new layout's buckets lie in one buffer, each from
// a 64-byte boundary.
func TestBucketMemoryOneRebuild(t *testing.T) {
	const n = 2
	ctx := testCtx(t)
	c := pgtest.NewCluster(n)
	defer c.Close()
	lens := []int{1000, 3, 70000, 17, 200000}
	errs := runRanks(n, func(rank int) error {
		params := make([]Param, len(lens))
		for i, l := range lens {
			params[i] = Param{Name: fmt.Sprintf("w%d", i), Grad: make([]float32, l)}
		}
		r, err := New(c.Group(rank), params, Options{BucketCapMB: 0.3, FirstBucketCapMB: 0.3})
		if err != nil {
			return err
		}
		defer r.Close()
		for pass := 1; pass <= 2; pass++ {
			if err := r.BeginBackward(Sync); err != nil {
				return err
			}
			for _, i := range []int{1, 3, 0, 4, 2} { // not the reverse order: the rebuild changes the layout
				g := make([]float32, lens[i])
				for k := range g {
					g[k] = float32((rank + 1) * (i + 1))
				}
				if err := r.GradReady(i, g); err != nil {
					return err
				}
			}
			if err := r.Finalize(ctx); err != nil {
				return err
			}
			for i, p := range params {
				for k, v := range p.Grad.([]float32) {
					if want := float32(3*(i+1)) / 2; v != want {
						return fmt.Errorf("pass %d: gradient %d [%d] = %v, want %v", pass, i, k, v, want)
					}
				}
			}
		}
		if r.Generation() != 1 {
			return fmt.Errorf("generation %d after the rebuild, want 1", r.Generation())
		}
		if r.spare[0].f32 != nil {
			return errors.New("a spare buffer held with no rebuild owed")
		}
		base := uintptr(unsafe.Pointer(&r.mem[0].f32[0]))
		end := base + 4*uintptr(len(r.mem[0].f32))
		for b, s := range r.slots {
			p := uintptr(unsafe.Pointer(&s.f32[0]))
			if p < base || p+4*uintptr(len(s.f32)) > end || (p-base)%bucketAlign != 0 {
				return fmt.Errorf("bucket %d at %#x (%d elements): outside the buffer [%#x, %#x) or off a %d-byte boundary", b, p, len(s.f32), base, end, bucketAlign)
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
}
