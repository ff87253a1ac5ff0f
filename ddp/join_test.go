package ddp

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// joinCase is one uneven-inputs run: rank r runs counts[r] synced steps, then Join.
type joinCase struct {
	counts   []int
	accum    int  // micro-batches per step (accum-1 NoSync passes, then the synced one)
	unused   bool // FindUnusedParameters, with parameter 1 unused on some ranks' steps
	hook     bool // a CommHook that records whether each bucket it gets is all zeros
	byActive bool // JoinDivideByActive
	gloo     bool // gloo over loopback instead of pgtest
	auto     bool // AutoBucketCap: layouts chosen from measurements, with collectives of their own
	buffers  bool // BroadcastBuffers before each step, of buffers each rank sets to its own values
}

func (jc joinCase) String() string {
	s := fmt.Sprint("counts", jc.counts, "_accum", jc.accum)
	if jc.unused {
		s += "_unused"
	}
	if jc.hook {
		s += "_hook"
	}
	if jc.byActive {
		s += "_byactive"
	}
	if jc.gloo {
		s += "_gloo"
	}
	if jc.auto {
		s += "_auto"
	}
	if jc.buffers {
		s += "_buffers"
	}
	return strings.ReplaceAll(s, " ", ",")
}

// The model of the Join tests: a float32 parameter of 7 elements, one of 3 and a float64
// one of 4, with the loss ½‖w − x‖² of each micro-batch x, so the gradient w − x depends
// on the parameters and a wrong average in any step changes every later one.
var joinLens = []int{7, 3, 4}

const joinLR = 0.25

// joinData is micro-batch (rank, step, micro)'s x for parameter p.
func joinData(rank, step, micro, p int) []float64 {
	rng := rand.New(rand.NewPCG(uint64(rank*1000+step*10+micro), uint64(p)))
	x := make([]float64, joinLens[p])
	for k := range x {
		x[k] = rng.Float64()*4 - 2
	}
	return x
}

// joinUnused says whether rank leaves parameter 1 unused in step (jc.unused).
func (jc joinCase) joinUnused(rank, step, p int) bool {
	return jc.unused && p == 1 && (rank+step)%3 == 0
}

func joinInit(p int) []float64 {
	x := joinData(99, 99, 0, p)
	return x
}

// joinReference runs the same batches in one process: in each step, the mean over the
// world size (or with byActive over the active ranks) of the active ranks' gradients,
// summed in rank order as the pgtest group does, a joined rank contributing nothing.
func joinReference(jc joinCase) (w32 [2][]float32, w64 []float64) {
	n := len(jc.counts)
	for p := range 2 {
		w32[p] = make([]float32, joinLens[p])
		for k, v := range joinInit(p) {
			w32[p][k] = float32(v)
		}
	}
	w64 = joinInit(2)
	inv32, inv64 := 1/float32(n), 1/float64(n)
	for step := 0; step < slices.Max(jc.counts); step++ {
		active := 0
		for _, c := range jc.counts {
			if c > step {
				active++
			}
		}
		for p := range 3 {
			acc32 := make([]float32, joinLens[p])
			acc64 := make([]float64, joinLens[p])
			for r := range n {
				if jc.counts[r] <= step || jc.joinUnused(r, step, p) {
					continue
				}
				c32 := make([]float32, joinLens[p])
				c64 := make([]float64, joinLens[p])
				for mb := range jc.accum {
					x := joinData(r, step, mb, p)
					for k := range x {
						if p < 2 {
							c32[k] += (w32[p][k] - float32(x[k])) * inv32
						} else {
							c64[k] += (w64[k] - x[k]) * inv64
						}
					}
				}
				for k := range acc32 {
					acc32[k] += c32[k]
					acc64[k] += c64[k]
				}
			}
			f := float64(n) / float64(active)
			for k := range acc32 {
				if jc.byActive && active < n {
					acc32[k] *= float32(f)
					acc64[k] *= f
				}
				if p < 2 {
					w32[p][k] -= joinLR * acc32[k]
				} else {
					w64[k] -= joinLR * acc64[k]
				}
			}
		}
	}
	return w32, w64
}

// zeroHook all-reduces like the default hook and records, per launch, whether the bucket
// it got was all zeros.
type zeroHook struct{ zero []bool }

func (h *zeroHook) Launch(ctx context.Context, pg procgroup.ProcessGroup, b *BucketView) procgroup.Work {
	z := true
	switch buf := b.Buffer.(type) {
	case []float32:
		for _, v := range buf {
			z = z && v == 0
		}
	case []float64:
		for _, v := range buf {
			z = z && v == 0
		}
	}
	h.zero = append(h.zero, z)
	return pg.AllReduce(ctx, b.Buffer, procgroup.Sum)
}

func (h *zeroHook) Finish(*BucketView) error { return nil }

// activeAt lists the ranks that run step.
func activeAt(counts []int, step int) []int {
	var a []int
	for r, c := range counts {
		if c > step {
			a = append(a, r)
		}
	}
	return a
}

// runJoin runs jc and returns every rank's final parameters, and the pgtest cluster's
// records of the collectives each rank issued (nil on gloo).
func runJoin(t *testing.T, jc joinCase) ([][4][]float64, [][]pgtest.Record, error) {
	n := len(jc.counts)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	final := make([][4][]float64, n)
	body := func(rank int, pg procgroup.ProcessGroup) error {
		w0, w1, w2 := make([]float32, 7), make([]float32, 3), joinInit(2)
		for k, v := range joinInit(0) {
			w0[k] = float32(v)
		}
		for k, v := range joinInit(1) {
			w1[k] = float32(v)
		}
		if rank > 0 { // New copies rank 0's: start the others elsewhere
			w0[0], w2[1] = 50, 50
		}
		params := []Param{
			{Name: "w0", Data: w0, Grad: make([]float32, 7)},
			{Name: "w1", Data: w1, Grad: make([]float32, 3)},
			{Name: "w2", Data: w2, Grad: make([]float64, 4)},
		}
		opts := Options{UnevenInputs: true, JoinDivideByActive: jc.byActive, FindUnusedParameters: jc.unused,
			BucketCapMB: 16 / float64(1<<20), FirstBucketCapMB: 16 / float64(1<<20)} // several buckets
		if jc.auto {
			opts.BucketCapMB = AutoBucketCap
		}
		bufI, bufF := make([]int64, 2), make([]float32, 3)
		if jc.buffers {
			opts.Buffers = []Buffer{{Name: "steps", Data: bufI}, {Name: "stats", Data: bufF}}
		}
		var hook *zeroHook
		if jc.hook {
			hook = &zeroHook{}
			opts.CommHook = hook
		}
		d, err := New(ctx, pg, params, opts)
		if err != nil {
			return err
		}
		defer d.Close()
		initial := len(d.BucketParams()) // the layout of the first synced step, before the rebuild
		g32, g64 := make([]float32, 7), make([]float64, 4)
		for step := range jc.counts[rank] {
			if jc.buffers { // each rank's own values, then the source's everywhere
				bufI[0], bufI[1], bufF[2] = int64(rank), int64(step), float32(rank)+0.5
				if err := d.BroadcastBuffers(ctx); err != nil {
					return err
				}
				src := 0 // rank 0 while every rank trains, else the highest one still training
				if active := activeAt(jc.counts, step); len(active) < n {
					src = slices.Max(active)
				}
				if bufI[0] != int64(src) || bufI[1] != int64(step) || bufF[2] != float32(src)+0.5 {
					return fmt.Errorf("rank %d step %d: buffers %v %v after BroadcastBuffers, want rank %d's", rank, step, bufI, bufF, src)
				}
			}
			for mb := range jc.accum {
				mode := Accumulate
				if mb == jc.accum-1 {
					mode = Sync
				}
				d.BeginBackward(mode)
				for p := 2; p >= 0; p-- {
					if jc.joinUnused(rank, step, p) {
						continue
					}
					x := joinData(rank, step, mb, p)
					if p == 2 {
						for k := range x {
							g64[k] = w2[k] - x[k]
						}
						err = d.GradReady64(p, g64)
					} else {
						w := params[p].Data.([]float32)
						for k := range w {
							g32[k] = w[k] - float32(x[k])
						}
						err = d.GradReady(p, g32[:len(w)])
					}
					if err != nil {
						return err
					}
				}
			}
			if err := d.Finalize(ctx); err != nil {
				return err
			}
			for p := range 2 {
				w, g := params[p].Data.([]float32), params[p].Grad.([]float32)
				for k := range w {
					w[k] -= joinLR * g[k]
				}
			}
			for k, g := range params[2].Grad.([]float64) {
				w2[k] -= joinLR * g
			}
		}
		before := 0
		if hook != nil {
			before = len(hook.zero)
		}
		if err := d.Join(ctx); err != nil {
			return err
		}
		if hook != nil {
			for k, z := range hook.zero[before:] {
				if !z {
					return fmt.Errorf("rank %d: bucket launch %d in Join: the hook got a bucket that is not all zeros", rank, before+k)
				}
			}
			want := (slices.Max(jc.counts) - jc.counts[rank]) * len(d.BucketParams())
			if jc.counts[rank] == 0 && want > 0 { // it shadowed the first step too
				want += initial - len(d.BucketParams())
			}
			if len(hook.zero)-before != want {
				return fmt.Errorf("rank %d: %d bucket launches in Join, want %d", rank, len(hook.zero)-before, want)
			}
		}
		if jc.buffers { // the last joiner's buffers
			final[rank][3] = []float64{float64(bufI[0]), float64(bufI[1]), float64(bufF[2])}
		}
		for p := range 3 {
			switch w := params[p].Data.(type) {
			case []float32:
				for _, v := range w {
					final[rank][p] = append(final[rank][p], float64(v))
				}
			case []float64:
				final[rank][p] = slices.Clone(w)
			}
		}
		return nil
	}
	rankBody := body
	body = func(rank int, pg procgroup.ProcessGroup) error {
		err := rankBody(rank, pg)
		if err != nil { // the peers fail at once instead of waiting in Join
			pg.Abort(err)
		}
		return err
	}
	if jc.gloo {
		return final, nil, glooWorld(n, body)
	}
	c := pgtest.NewCluster(n)
	defer c.Close()
	err := c.Each(body)
	recs := make([][]pgtest.Record, n)
	for r := range n {
		recs[r] = c.Issued(r)
	}
	return final, recs, err
}

// TestJoinUneven: ranks with 0, 3 and 5 batches (and other counts) at n = 2, 3 and 4,
// through New on pgtest (and on gloo over loopback), with NoSync micro-batches,
// FindUnusedParameters, a CommHook, JoinDivideByActive and AutoBucketCap. Every rank's final parameters
// equal, element by element, those of the same batches run in one process
// (joinReference); on pgtest bit for bit, since it sums in rank order as the reference
// does, on gloo within 1e-6 (float32) and 1e-13 (float64). On pgtest every rank issued the
// same collectives; with the hook, a joined rank's buckets are all zeros. With buffers,
// BroadcastBuffers before each step copies rank 0's while every rank trains and the
// highest active rank's once one has joined, the joined ranks taking part.
func TestJoinUneven(t *testing.T) {
	cases := []joinCase{
		{counts: []int{3, 5}, accum: 1},
		{counts: []int{5, 3}, accum: 1},
		{counts: []int{0, 5}, accum: 1},
		{counts: []int{0, 3, 5}, accum: 1},
		{counts: []int{5, 0, 3}, accum: 2},
		{counts: []int{3, 5, 0, 5}, accum: 1},
		{counts: []int{0, 3, 5, 3}, accum: 2, unused: true},
		{counts: []int{5, 3, 0}, accum: 1, hook: true},
		{counts: []int{3, 0, 5, 5}, accum: 2, unused: true, hook: true},
		{counts: []int{0, 3, 5}, accum: 1, byActive: true},
		{counts: []int{3, 5, 0, 5}, accum: 2, byActive: true, unused: true},
		{counts: []int{3, 3, 3}, accum: 1},
		{counts: []int{0, 0}, accum: 1},
		{counts: []int{0, 3, 5}, accum: 2, gloo: true},
		{counts: []int{0, 5, 3}, accum: 1, auto: true},
		{counts: []int{3, 5, 0, 5}, accum: 1, buffers: true},
		{counts: []int{5, 3}, accum: 2, buffers: true, gloo: true},
		{counts: []int{5, 3, 0, 5}, accum: 2, auto: true, unused: true},
	}
	for _, jc := range cases {
		t.Run(jc.String(), func(t *testing.T) {
			final, recs, err := runJoin(t, jc)
			if err != nil {
				t.Fatal(err)
			}
			ref32, ref64 := joinReference(jc)
			for r := range jc.counts {
				for p := range 3 {
					for k, got := range final[r][p] {
						want, tol := ref64[min(k, len(ref64)-1)], 1e-13
						if p < 2 {
							want, tol = float64(ref32[p][k]), 1e-6
						}
						if !jc.gloo {
							tol = 0
						}
						if math.Abs(got-want) > tol*math.Max(1, math.Abs(want)) {
							t.Fatalf("rank %d: parameter %d[%d] = %v, want %v (one process)", r, p, k, got, want)
						}
					}
				}
			}
			if jc.buffers && slices.Max(jc.counts) > 0 {
				last := slices.Max(jc.counts) - 1
				src := 0
				if active := activeAt(jc.counts, last); len(active) < len(jc.counts) {
					src = slices.Max(active)
				}
				want := []float64{float64(src), float64(last), float64(src) + 0.5}
				for r := range jc.counts {
					if !slices.Equal(final[r][3], want) {
						t.Fatalf("rank %d: buffers %v after Join, want %v (the last step's source's)", r, final[r][3], want)
					}
				}
			}
			for r := 1; r < len(recs); r++ {
				if !slices.Equal(recs[r], recs[0]) {
					t.Fatalf("rank %d issued %v\nrank 0 issued %v", r, recs[r], recs[0])
				}
			}
		})
	}
}

// TestJoinRefused: Join without Options.UnevenInputs fails the DDP (and its peers, at
// once, instead of leaving them in a collective); the options Join does not compose with
// are refused at New; Join after NoSync passes is ErrPhase; ranks that disagree on
// UnevenInputs are a mismatch at New.
func TestJoinRefused(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	mk := func() []Param { return []Param{{Name: "w", Data: make([]float32, 4), Grad: make([]float32, 4)}} }
	c := pgtest.NewCluster(2)
	defer c.Close()
	err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		d, err := New(ctx, pg, mk(), Options{})
		if err != nil {
			return err
		}
		defer d.Close()
		if rank == 1 {
			if err := d.Join(ctx); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "UnevenInputs") {
				return fmt.Errorf("Join without UnevenInputs: %v, want ErrInvalidArgument naming UnevenInputs", err)
			}
			return nil
		}
		d.BeginBackward(Sync)
		d.GradReady(0, make([]float32, 4))
		if err := d.Finalize(ctx); err == nil {
			return fmt.Errorf("rank 0's step after its peer's refused Join: no error")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	for _, o := range []Options{{JoinDivideByActive: true}, {UnevenInputs: true, Shards: 2}} {
		c := pgtest.NewCluster(1)
		_, err := New(ctx, c.Group(0), mk(), o)
		c.Close()
		if !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("New(%+v): %v, want ErrInvalidArgument", o, err)
		}
	}

	c2 := pgtest.NewCluster(2)
	defer c2.Close()
	err = c2.Each(func(rank int, pg procgroup.ProcessGroup) error {
		_, err := New(ctx, pg, mk(), Options{UnevenInputs: rank == 0})
		if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "UnevenInputs") {
			return fmt.Errorf("New with UnevenInputs on rank 0 only: %v, want ErrMismatch naming it", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	c3 := pgtest.NewCluster(1)
	defer c3.Close()
	d, err := New(ctx, c3.Group(0), mk(), Options{UnevenInputs: true})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.NoSync(func() error { return d.GradReady(0, []float32{1, 2, 3, 4}) }); err != nil {
		t.Fatal(err)
	}
	if err := d.Join(ctx); !errors.Is(err, ErrPhase) {
		t.Fatalf("Join after a NoSync pass: %v, want ErrPhase", err)
	}
	if err := d.Backward(ctx, func() error { return d.GradReady(0, []float32{1, 2, 3, 4}) }); err != nil {
		t.Fatalf("a step after the refused Join: %v", err)
	}
	if err := d.Join(ctx); err != nil {
		t.Fatalf("Join of the only rank: %v", err)
	}
}

// TestLeaveEarlyWithoutJoin: without Options.UnevenInputs, a rank that runs out of data
// and leaves (its group closed) makes its peer's next step fail with an error, on gloo
// over loopback, instead of hanging: the failure mode the per-step count must not change.
func TestLeaveEarlyWithoutJoin(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := glooWorld(2, func(rank int, pg procgroup.ProcessGroup) error {
		d, err := New(ctx, pg, []Param{{Name: "w", Data: make([]float32, 4), Grad: make([]float32, 4)}}, Options{})
		if err != nil {
			return err
		}
		defer d.Close()
		step := func() error {
			return d.Backward(ctx, func() error { return d.GradReady(0, []float32{1, 2, 3, 4}) })
		}
		if err := step(); err != nil {
			return err
		}
		if rank == 1 {
			return nil // out of data: glooWorld closes its group
		}
		for range 3 {
			if err := step(); err != nil {
				return nil // the peer's departure is an error, not a hang
			}
		}
		return fmt.Errorf("rank 0: three steps after rank 1 left, and no error")
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestCloseDuringJoin: Close from another goroutine while a rank waits in Join (its peer
// still training, slowly) ends Join with ErrClosed at once and aborts the group, so the
// peer's step fails too instead of waiting.
func TestCloseDuringJoin(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := pgtest.NewCluster(2)
	defer c.Close()
	start := time.Now()
	err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		d, err := New(ctx, pg, []Param{{Name: "w", Data: make([]float32, 4), Grad: make([]float32, 4)}}, Options{UnevenInputs: true})
		if err != nil {
			return err
		}
		defer d.Close()
		if rank == 1 {
			done := make(chan struct{})
			go func() {
				defer close(done)
				time.Sleep(100 * time.Millisecond)
				d.Close()
			}()
			err := d.Join(ctx)
			<-done
			if !errors.Is(err, ErrClosed) {
				return fmt.Errorf("Join closed meanwhile: %v, want ErrClosed", err)
			}
			return nil
		}
		time.Sleep(300 * time.Millisecond) // a slow step: rank 1 is closed meanwhile
		err = d.Backward(ctx, func() error { return d.GradReady(0, []float32{1, 2, 3, 4}) })
		if err == nil {
			return fmt.Errorf("rank 0's step after its peer closed in Join: no error")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el > 10*time.Second {
		t.Fatalf("took %v: Close did not end Join at once", el)
	}
}

// TestJoinNonFinite: a NaN in an active rank's gradient while another rank is in Join.
// The reduced bucket is not finite on every rank alike, so the joined rank issues the
// non-finite check's AllGather with the others and goes on shadowing; the active ranks get
// the *NonFiniteError naming rank 2 and skip that step; Join ends with every rank equal.
func TestJoinNonFinite(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	counts := []int{1, 4, 4}
	c := pgtest.NewCluster(3)
	defer c.Close()
	finals := make([][]float32, 3)
	err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		w := []float32{1, 2, 3, 4}
		d, err := New(ctx, pg, []Param{{Name: "w", Data: w, Grad: make([]float32, 4)}}, Options{UnevenInputs: true})
		if err != nil {
			pg.Abort(err)
			return err
		}
		defer d.Close()
		for step := range counts[rank] {
			g := []float32{w[0], w[1], w[2], w[3]}
			if rank == 2 && step == 2 {
				g[1] = float32(math.NaN())
			}
			err := d.Backward(ctx, func() error { return d.GradReady(0, g) })
			var nf *NonFiniteError
			switch {
			case step == 2 && errors.As(err, &nf):
				if !strings.Contains(err.Error(), "rank 2") {
					return fmt.Errorf("rank %d: %v, want it to name rank 2", rank, err)
				}
				continue // skip the optimizer step
			case step == 2:
				return fmt.Errorf("rank %d step 2: %v, want a *NonFiniteError", rank, err)
			case err != nil:
				return err
			}
			for k := range w {
				w[k] -= 0.5 * d.Grad32(0)[k]
			}
		}
		if err := d.Join(ctx); err != nil {
			return err
		}
		finals[rank] = w
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// Steps 0, 1 and 3 step w by 0.5 × (sum over the active ranks of w)/3: 1.5 the first
	// time with 3 ranks, then 1 with 2.
	want := []float32{1, 2, 3, 4}
	for _, f := range []float32{0.5 * 3 / 3, 0.5 * 2 / 3, 0.5 * 2 / 3} {
		for k := range want {
			want[k] -= f * want[k]
		}
	}
	for r, f := range finals {
		for k := range f {
			if math.Abs(float64(f[k]-want[k])) > 1e-6 {
				t.Fatalf("rank %d: w = %v, want %v", r, f, want)
			}
		}
	}
}
