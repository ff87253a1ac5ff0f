package sim

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/procgroup/dtype"
)

func TestCommLinearAndCurve(t *testing.T) {
	lin := Comm{Alpha: 1e-4, Beta: 1e-9}
	if got, want := lin.Seconds(1e6), 1e-4+1e-3; math.Abs(got-want) > 1e-12 {
		t.Errorf("linear: %v, want %v", got, want)
	}
	c := Comm{Alpha: 1e-4, Beta: 1e-9, Points: []Point{{1000, 2e-4}, {11000, 4e-4}, {21000, 5e-4}}}
	for _, tc := range []struct {
		bytes int64
		want  float64
	}{
		{0, 1e-4},     // down to Alpha at zero
		{500, 1.5e-4}, // halfway from Alpha to the first point
		{1000, 2e-4},  // on a point
		{6000, 3e-4},  // between points
		{11000, 4e-4}, // through a point above the chord of its neighbours
		{16000, 4.5e-4},
		{31000, 6e-4}, // past the last: the last segment's slope (1e-8 > Beta)
	} {
		if got := c.Seconds(tc.bytes); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("curve at %d bytes: %v, want %v", tc.bytes, got, tc.want)
		}
	}
}

// TestCommLowerCurve: with Lower, a point above the chord of its neighbours, or slower than
// a larger size, does not count (Note [Lower curve]).
func TestCommLowerCurve(t *testing.T) {
	// 11000 bytes above the chord from 1000 to 21000 (3.5e-4 there).
	c := Comm{Lower: true, Points: []Point{{1000, 2e-4}, {11000, 4e-4}, {21000, 5e-4}}}
	for _, tc := range []struct {
		bytes int64
		want  float64
	}{
		{11000, 3.5e-4},
		{6000, 2.75e-4},
		{16000, 4.25e-4},
		{31000, 6.5e-4}, // past the last: the chord's slope 1.5e-8, not the last pair's 1e-8
	} {
		if got := c.Seconds(tc.bytes); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("over a convex point, at %d bytes: %v, want %v", tc.bytes, got, tc.want)
		}
	}
	// The probe of round s43's launch 7 (10 Gbit/s): 33.5 MB slower than 52.5 MB.
	s43 := Comm{Alpha: 4e-3, Lower: true, Points: []Point{{64 << 10, 1.5e-3}, {512 << 10, 0.3e-3}, {4 << 20, 4.3e-3}, {32 << 20, 74.2e-3}, {52538368, 46.4e-3}}}
	// 4 MiB at 4.3 ms lies above the chord from 512 KiB to the last point too.
	chord := 0.3e-3 + (46.4e-3-0.3e-3)*float64(32<<20-512<<10)/float64(52538368-512<<10)
	if got := s43.Seconds(32 << 20); math.Abs(got-chord) > 1e-12 {
		t.Errorf("s43 at 32 MiB: %v, want the chord %v", got, chord)
	}
	// 64 KiB slower than 512 KiB counts as 512 KiB's time, down to that at zero.
	if got := s43.Seconds(64 << 10); math.Abs(got-0.3e-3) > 1e-15 {
		t.Errorf("s43 at 64 KiB: %v, want 0.3 ms", got)
	}
	if got := s43.Seconds(0); math.Abs(got-0.3e-3) > 1e-15 {
		t.Errorf("s43 at 0: %v, want 0.3 ms (Alpha is larger)", got)
	}
}

// TestCommLowerCurveRandom checks the Lower curve, on random points, against the lower
// convex hull computed another way: over the points made non-decreasing, the least of the
// chords between two points on either side of the size (the curve's definition; Seconds
// builds the hull's vertices instead).
func TestCommLowerCurveRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for trial := range 500 {
		n := 1 + rng.IntN(12)
		var pts []Point
		size := int64(0)
		for range n {
			size += 1 + rng.Int64N(1<<20)
			pts = append(pts, Point{Bytes: size, Seconds: rng.Float64() * 1e-2})
		}
		c := Comm{Points: pts, Lower: true}
		// Reference: running minimum from the right, then the least chord around x.
		q := slices.Clone(pts)
		for k := len(q) - 2; k >= 0; k-- {
			q[k].Seconds = math.Min(q[k].Seconds, q[k+1].Seconds)
		}
		ref := func(x int64) float64 {
			v := math.Inf(1)
			for i, lo := range q {
				if lo.Bytes == x {
					v = math.Min(v, lo.Seconds)
				}
				for _, hi := range q[i+1:] {
					if lo.Bytes <= x && x <= hi.Bytes {
						v = math.Min(v, lo.Seconds+(hi.Seconds-lo.Seconds)*float64(x-lo.Bytes)/float64(hi.Bytes-lo.Bytes))
					}
				}
			}
			return v
		}
		prev := 0.0
		for range 50 {
			x := pts[0].Bytes + rng.Int64N(size-pts[0].Bytes+1)
			got, want := c.Seconds(x), ref(x)
			if math.Abs(got-want) > 1e-12 {
				t.Fatalf("trial %d, %d points, at %d bytes: %v, want %v (points %v)", trial, n, x, got, want, pts)
			}
		}
		// Non-decreasing, and under every point.
		for x := int64(0); x <= size+size/4; x += size/64 + 1 {
			got := c.Seconds(x)
			if got < prev-1e-15 {
				t.Fatalf("trial %d: %v at %d bytes, less than %v before it", trial, got, x, prev)
			}
			prev = got
		}
		through := Comm{Points: pts}
		for _, p := range pts {
			if got := c.Seconds(p.Bytes); got > p.Seconds+1e-15 {
				t.Fatalf("trial %d: %v at %d bytes, above the point's %v", trial, got, p.Bytes, p.Seconds)
			}
			if got := through.Seconds(p.Bytes); math.Abs(got-p.Seconds) > 1e-15 {
				t.Fatalf("trial %d, without Lower: %v at %d bytes, not the point's %v", trial, got, p.Bytes, p.Seconds)
			}
		}
	}
}

// TestCommPastTheLastPoint: past the largest point the curve goes on from it, with Beta when
// that is steeper than the last segment; with no jump at the point.
func TestCommPastTheLastPoint(t *testing.T) {
	c := Comm{Beta: 1e-8, Points: []Point{{1000, 1e-3}, {2000, 1.001e-3}}} // last slope 1e-9
	if got := c.Seconds(2000); math.Abs(got-1.001e-3) > 1e-15 {
		t.Errorf("at the last point: %v", got)
	}
	if got, want := c.Seconds(3000), 1.001e-3+1e-5; math.Abs(got-want) > 1e-15 {
		t.Errorf("past it: %v, want %v", got, want)
	}
	one := Comm{Beta: 1e-9, Points: []Point{{1000, 1e-3}}}
	if got, want := one.Seconds(2000), 1e-3+1e-6; math.Abs(got-want) > 1e-15 {
		t.Errorf("one point, past it: %v, want %v", got, want)
	}
	p := &Profile{Params: []bucket.Param{{Name: "a", DType: dtype.Float32, Len: 1}}, Order: []int{0}, Ready: []float64{0},
		Comm: Comm{Points: []Point{{2000, 1}, {1000, 2}}}}
	if err := p.Check(); !errors.Is(err, ErrInvalid) {
		t.Errorf("points out of order: %v, want ErrInvalid", err)
	}
}

func TestFitRecoversLine(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	alpha, beta := 3e-5, 8e-10
	var pts []Point
	for k := range 8 {
		b := int64(64<<10) << k
		pts = append(pts, Point{b, alpha + beta*float64(b)})
		// a slower repeat of the same size must be ignored
		pts = append(pts, Point{b, (alpha + beta*float64(b)) * (1.5 + rng.Float64())})
	}
	c, err := Fit(pts)
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(c.Alpha-alpha) > 1e-9 || math.Abs(c.Beta-beta)/beta > 1e-9 {
		t.Errorf("Fit: α %v β %v, want %v %v", c.Alpha, c.Beta, alpha, beta)
	}
	if len(c.Points) != 8 {
		t.Errorf("Fit kept %d points, want the 8 distinct sizes", len(c.Points))
	}
	if _, err := Fit(nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("Fit(nil): %v, want ErrInvalid", err)
	}
	if _, err := Fit([]Point{{1, math.Inf(1)}}); !errors.Is(err, ErrInvalid) {
		t.Errorf("Fit(+Inf): %v, want ErrInvalid", err)
	}
}

func TestRingTree(t *testing.T) {
	r := Ring(8, 1e-6, 1e9)
	if math.Abs(r.Alpha-14e-6) > 1e-15 || math.Abs(r.Beta-1.75e-9) > 1e-18 {
		t.Errorf("Ring(8): %+v", r)
	}
	tr := Tree(8, 1e-6, 1e9)
	if math.Abs(tr.Alpha-6e-6) > 1e-15 || math.Abs(tr.Beta-2e-9) > 1e-18 {
		t.Errorf("Tree(8): %+v", tr)
	}
	if r1 := Ring(1, 1, 1); r1.Alpha != 0 || r1.Beta != 0 {
		t.Error("Ring(1) should cost nothing")
	}
}

// TestSimulateByHand: two parameters, two buckets, every number worked out on paper.
func TestSimulateByHand(t *testing.T) {
	p := &Profile{
		Params:   []bucket.Param{{Name: "a", DType: dtype.Float32, Len: 250}, {Name: "b", DType: dtype.Float32, Len: 250}},
		Order:    []int{1, 0},
		Ready:    []float64{3, 1}, // b ready at 1, a at 3
		Backward: 4,
		Other:    10,
		Comm:     Comm{Alpha: 1, Beta: 0.002}, // 1000 bytes: 3 s
		Slowdown: 1,                           // compute at half speed while comm runs
	}
	bs, err := bucket.AssignOrdered(p.Params, p.Order, 1000, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if len(bs) != 2 {
		t.Fatalf("%d buckets, want 2", len(bs))
	}
	r, err := p.Simulate(bs)
	if err != nil {
		t.Fatal(err)
	}
	// t=1: b ready, bucket 0 launches, its collective runs 1..4. Compute from 1 to a's
	// ready (2 s of work) at half speed: done at 5, but the collective ends at 4: 3 s
	// pass for 1.5 s of work, the remaining 0.5 s at full speed: a ready at 4.5; bucket 1
	// runs 4.5..7.5 alongside the last 1 s of compute, at half speed: backward ends at
	// 6.5. Finalize waits to 7.5. Step 10 + 7.5.
	want := Result{Step: 17.5, Backward: 6.5, Exposed: 1, Comm: 6, Buckets: 2}
	if !closeTo(r, want) {
		t.Errorf("Simulate: %+v, want %+v", r, want)
	}
	// With the last rank 0.5 s behind: bucket 0 waits to 1.5 (compute at full speed meanwhile,
	// 0.5 s of a's 2 s done), then runs 1.5..4.5 while the other 1.5 s of compute take 3 s;
	// a is ready at 4.5, bucket 1 waits to 5.0 (0.5 s of the last 1 s of compute), then the
	// last 0.5 s take 1 s: backward ends at 6.0 with 2 s of bucket 1 left, done at 8.0.
	p.Skew = 0.5
	r, err = p.Simulate(bs)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Result{Step: 18, Backward: 6, Exposed: 2, Comm: 6, Buckets: 2}); !closeTo(r, want) {
		t.Errorf("with skew: %+v, want %+v", r, want)
	}
	p.Skew = 0
	// One bucket: it launches at 3 and runs 5 s, to 8, alongside the last 1 s of compute,
	// done at half speed by 5.
	r, err = p.SimulateCaps(2000, 2000)
	if err != nil {
		t.Fatal(err)
	}
	want = Result{Step: 18, Backward: 5, Exposed: 3, Comm: 5, Buckets: 1}
	if !closeTo(r, want) {
		t.Errorf("one bucket: %+v, want %+v", r, want)
	}
}

// TestCollectiveCPU: each collective's own CPU time is compute at its launch (Note [A
// collective's CPU]): with free collectives, four buckets take 3 CollectiveCPU longer than
// one, and a collective that overlaps compute still costs it.
func TestCollectiveCPU(t *testing.T) {
	p := &Profile{Other: 0.01, Backward: 0.04, CollectiveCPU: 0.001}
	for i := range 4 {
		p.Params = append(p.Params, bucket.Param{Name: "p", DType: dtype.Float32, Len: 250})
		p.Order = append(p.Order, 3-i)
		p.Ready = append(p.Ready, 0)
	}
	for k, i := range p.Order {
		p.Ready[i] = 0.01 * float64(k+1)
	}
	one, err := p.SimulateCaps(4000, 4000)
	if err != nil {
		t.Fatal(err)
	}
	four, err := p.SimulateCaps(1000, 1000)
	if err != nil {
		t.Fatal(err)
	}
	// one bucket: 40 ms of compute, then its collective's 1 ms; four: 40 + 4 ms
	if !closeTo(one, Result{Step: 0.051, Backward: 0.041, Buckets: 1}) || !closeTo(four, Result{Step: 0.054, Backward: 0.044, Buckets: 4}) {
		t.Errorf("one bucket %+v, four %+v", one, four)
	}
	// Collectives of 5 ms each, with compute at half speed beside them: the CPU term is
	// compute, slowed like the rest where it overlaps, so the four cost at least 4 ms more
	// than without it.
	p.Comm, p.Slowdown = Comm{Alpha: 0.005}, 1
	withCPU, _ := p.SimulateCaps(1000, 1000)
	p.CollectiveCPU = 0
	without, _ := p.SimulateCaps(1000, 1000)
	if d := withCPU.Step - without.Step; d < 0.004-1e-9 {
		t.Errorf("four overlapped collectives: %.4f s with their CPU, %.4f s without: want at least 4 ms more", withCPU.Step, without.Step)
	}
}

func closeTo(a, b Result) bool {
	near := func(x, y float64) bool { return math.Abs(x-y) <= 1e-9*math.Max(1, math.Abs(y)) }
	return near(a.Step, b.Step) && near(a.Backward, b.Backward) && near(a.Exposed, b.Exposed) && near(a.Comm, b.Comm) && a.Buckets == b.Buckets
}

// tickSim is the step model again, computed another way: time advances in fixed ticks, and
// in each tick compute and the running collective each do their share of work.
func tickSim(p *Profile, bs []bucket.Bucket, dt float64) float64 {
	lay, _ := bucket.NewLayout(p.Params, bs)
	// the compute work, as a list of (work, then: the gradient it makes ready, or -1)
	type seg struct {
		work  float64
		param int
	}
	var segs []seg
	prev := 0.0
	for _, i := range p.Order {
		segs = append(segs, seg{math.Max(p.Ready[i]-prev, 0) + p.CopyPerByte*float64(p.Params[i].Bytes()), i})
		prev = math.Max(prev, p.Ready[i])
	}
	segs = append(segs, seg{math.Max(p.Backward-prev, 0), -1})
	pending := make([]int, len(bs))
	for b := range bs {
		pending[b] = len(bs[b].Params)
	}
	left := make([]float64, len(bs))
	for b := range bs {
		left[b] = p.Comm.Seconds(bs[b].Bytes())
	}
	finish := make([]float64, len(bs))
	start := make([]float64, len(bs)) // launch + Skew
	complete := 0                     // buckets whose gradients are all ready, in order
	launched, running := 0, 0         // launched: their launch work done
	t, k := 0.0, 0
	segLeft, launchLeft := segs[0].work, 0.0
	bwdEnd := -1.0
	for running < len(bs) || bwdEnd < 0 {
		computing := bwdEnd < 0
		commBusy := running < launched && t >= start[running]-1e-12
		cr, mr := 1.0, 1.0
		if computing && commBusy {
			cr, mr = 1/(1+p.Slowdown), 1/(1+p.CommSlowdown)
		}
		if commBusy {
			left[running] -= dt * mr
			if left[running] <= 1e-12 {
				finish[running] = t + dt
				running++
			}
		}
		if computing {
			w := dt * cr
			for w > 1e-15 && bwdEnd < 0 {
				if launched < complete { // a launch's work comes first
					if launchLeft <= 0 {
						launchLeft = p.Launch + p.CollectiveCPU
					}
					d := math.Min(w, launchLeft)
					launchLeft -= d
					w -= d
					if launchLeft <= 1e-12 {
						launchLeft = 0
						start[launched] = t + dt + p.Skew
						launched++
					}
					continue
				}
				d := math.Min(w, segLeft)
				segLeft -= d
				w -= d
				if segLeft > 1e-12 {
					break
				}
				if i := segs[k].param; i >= 0 {
					pending[lay.Where[i].Bucket]--
					for complete < len(bs) && pending[complete] == 0 {
						complete++
					}
				}
				k++
				if k == len(segs) { // the tail after the last gradient, whose launches came first
					bwdEnd = t + dt
					break
				}
				segLeft = segs[k].work
			}
		}
		t += dt
	}
	fin := bwdEnd
	for b := range bs {
		fin = math.Max(fin, finish[b]) + p.UnpackPerByte*float64(bs[b].Bytes())
	}
	return p.Other + fin
}

func randomProfile(rng *rand.Rand, n int) *Profile {
	p := &Profile{Other: rng.Float64() * 0.05, Backward: 0}
	t := 0.0
	for i := range n {
		p.Params = append(p.Params, bucket.Param{Name: "p", DType: dtype.Float32, Len: 1000 + rng.IntN(200000)})
		p.Order = append(p.Order, n-1-i)
		p.Ready = append(p.Ready, 0)
	}
	for _, i := range p.Order {
		t += rng.Float64() * 0.01
		p.Ready[i] = t
	}
	p.Backward = t + rng.Float64()*0.01
	p.CopyPerByte = rng.Float64() * 1e-10
	p.UnpackPerByte = rng.Float64() * 1e-10
	p.Launch = rng.Float64() * 1e-4
	p.CollectiveCPU = rng.Float64() * 1e-3
	p.Slowdown = rng.Float64()
	p.CommSlowdown = rng.Float64() * 2
	p.Comm = Comm{Alpha: rng.Float64() * 1e-3, Beta: rng.Float64() * 2e-8}
	p.Skew = rng.Float64() * 0.01
	return p
}

// TestSimulateAgainstTicks checks Simulate against tickSim on random profiles and caps.
func TestSimulateAgainstTicks(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	for trial := range 40 {
		p := randomProfile(rng, 5+rng.IntN(20))
		c := int64(64<<10) << rng.IntN(5)
		bs, err := p.Layout(c/2, c)
		if err != nil {
			t.Fatal(err)
		}
		r, err := p.Simulate(bs)
		if err != nil {
			t.Fatal(err)
		}
		const dt = 2e-6
		ref := tickSim(p, bs, dt)
		// each tick can overshoot an event by dt; a few per segment and bucket
		if tol := dt * float64(4*len(p.Params)+4*len(bs)+4); math.Abs(r.Step-ref) > tol {
			t.Errorf("trial %d (%d params, %d buckets): Simulate %.6f s, ticks %.6f s (tolerance %.6f)", trial, len(p.Params), len(bs), r.Step, ref, tol)
		}
	}
}

// TestBestIsTheLeastOnItsGrid: Best's step is no more than any (first, cap) pair's on the
// grid it searches, and it is deterministic.
func TestBestIsTheLeastOnItsGrid(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 5))
	for range 5 {
		p := randomProfile(rng, 30)
		o := SearchOptions{Steps: 2}
		best, err := p.Best(o)
		if err != nil {
			t.Fatal(err)
		}
		caps := o.Caps(p.TotalBytes())
		for j, c := range caps {
			for _, f := range caps[:j+1] {
				r, err := p.SimulateCaps(f, c)
				if err != nil {
					t.Fatal(err)
				}
				if r.Step < best.Predicted.Step/(1+1e-3)-1e-12 {
					t.Errorf("caps %d/%d: %.6f s beats Best's %d/%d at %.6f s", f, c, r.Step, best.FirstCapBytes, best.CapBytes, best.Predicted.Step)
				}
			}
		}
		again, _ := p.Best(o)
		if again.FirstCapBytes != best.FirstCapBytes || again.CapBytes != best.CapBytes {
			t.Error("Best is not deterministic")
		}
	}
}

// TestBestKeepsTheDefault: with a layout to keep, Best returns the least layout only when it
// is predicted at least MinGain faster than the kept one, and reports the gain either way.
func TestBestKeepsTheDefault(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 6))
	for trial := range 10 {
		p := randomProfile(rng, 30)
		free, err := p.Best(SearchOptions{})
		if err != nil {
			t.Fatal(err)
		}
		kf, kc := int64(64<<10)<<rng.IntN(3), int64(256<<10)<<rng.IntN(4)
		keep, err := p.SimulateCaps(kf, kc)
		if err != nil {
			t.Fatal(err)
		}
		gain := math.Max(1-free.Predicted.Step/keep.Step, 0) // the gain computed from the two steps
		for _, margin := range []float64{0, gain / 2, gain + 0.01, 0.5} {
			got, err := p.Best(SearchOptions{KeepFirstCapBytes: kf, KeepCapBytes: kc, MinGain: margin})
			if err != nil {
				t.Fatal(err)
			}
			if math.Abs(got.Gain-gain) > 1e-12 {
				t.Errorf("trial %d, margin %.3f: gain %.6f, want %.6f", trial, margin, got.Gain, gain)
			}
			wantKept := gain < margin
			if got.Kept != wantKept {
				t.Errorf("trial %d, margin %.3f (gain %.4f): kept %v, want %v", trial, margin, gain, got.Kept, wantKept)
			}
			want, wantStep := [2]int64{free.FirstCapBytes, free.CapBytes}, free.Predicted.Step
			if wantKept {
				want, wantStep = [2]int64{kf, kc}, keep.Step
			}
			if g := [2]int64{got.FirstCapBytes, got.CapBytes}; g != want || got.Predicted.Step != wantStep || got.Predicted.Buckets != len(got.Buckets) {
				t.Errorf("trial %d, margin %.3f: caps %v at %.6f s (%d buckets, %d listed), want %v at %.6f s",
					trial, margin, g, got.Predicted.Step, got.Predicted.Buckets, len(got.Buckets), want, wantStep)
			}
		}
	}
	p := randomProfile(rng, 5)
	for _, o := range []SearchOptions{{KeepCapBytes: 1 << 20}, {KeepFirstCapBytes: 1 << 20}, {KeepFirstCapBytes: 1, KeepCapBytes: 1, MinGain: 1}, {KeepFirstCapBytes: 1, KeepCapBytes: 1, MinGain: -0.1}} {
		if _, err := p.Best(o); !errors.Is(err, ErrInvalid) {
			t.Errorf("%+v: %v, want ErrInvalid", o, err)
		}
	}
}

// TestSharedSpeed: a pair within s·c ≤ 1 is kept; one beyond comes back to s·c = 1 with
// the ratio s/c kept.
func TestSharedSpeed(t *testing.T) {
	for _, tc := range []struct{ s, c, ws, wc float64 }{
		{0, 9, 0, 9}, {0.5, 2, 0.5, 2}, {0.25, 0.5, 0.25, 0.5}, {1, 1, 1, 1},
		{1, 4, 0.5, 2}, {1, 9, 1.0 / 3, 3}, {2, 2, 1, 1},
	} {
		s, c := SharedSpeed(tc.s, tc.c)
		if math.Abs(s-tc.ws) > 1e-12 || math.Abs(c-tc.wc) > 1e-12 {
			t.Errorf("SharedSpeed(%v, %v) = %v, %v; want %v, %v", tc.s, tc.c, s, c, tc.ws, tc.wc)
		}
	}
}

// TestOverlapPays: with slow links and no slowdown, small buckets beat one bucket by about
// the communication they hide; with a large launch cost, one bucket wins.
func TestOverlapPays(t *testing.T) {
	p := randomProfile(rand.New(rand.NewPCG(9, 9)), 40)
	p.Slowdown, p.CommSlowdown, p.Launch = 0, 0, 0
	p.Comm = Comm{Alpha: 0, Beta: p.Backward / float64(p.TotalBytes())} // comm as long as backward
	one, _ := p.SimulateCaps(p.TotalBytes(), p.TotalBytes())
	best, err := p.Best(SearchOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !(best.Predicted.Step < one.Step-0.5*p.Backward) {
		t.Errorf("best %.4f s with %d buckets, one bucket %.4f s: want overlap to hide most of %.4f s", best.Predicted.Step, best.Predicted.Buckets, one.Step, p.Backward)
	}
	p.Comm.Alpha = p.Backward // each collective costs a whole backward
	best, _ = p.Best(SearchOptions{})
	if best.Predicted.Buckets != 1 {
		t.Errorf("with a huge per-collective cost Best chose %d buckets, want 1", best.Predicted.Buckets)
	}
}

func TestCheck(t *testing.T) {
	p := &Profile{Params: []bucket.Param{{Name: "a", DType: dtype.Float32, Len: 1}}, Order: []int{0}, Ready: []float64{0}}
	if err := p.Check(); err != nil {
		t.Fatal(err)
	}
	p.Order = []int{1}
	if err := p.Check(); !errors.Is(err, ErrInvalid) {
		t.Errorf("bad order: %v", err)
	}
	p.Order, p.Slowdown = []int{0}, -1
	if _, err := p.SimulateCaps(4, 4); !errors.Is(err, ErrInvalid) {
		t.Errorf("negative slowdown: %v", err)
	}
}
