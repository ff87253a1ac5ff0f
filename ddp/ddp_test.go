package ddp

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/goddp/goddp/ddp/internal/numtest"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
	"github.com/goddp/goddp/reducer"
)

func randF64(r *rand.Rand, n int) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = r.NormFloat64()
	}
	return v
}

// spec is a tensor description for the mismatch tests.
type spec struct {
	name  string
	f64   bool
	shape []int
}

func (s spec) param() Param {
	n := 1
	for _, d := range s.shape {
		n *= d
	}
	if s.f64 {
		return Param{Name: s.name, Data: make([]float64, n), Grad: make([]float64, n), Shape: s.shape}
	}
	return Param{Name: s.name, Data: make([]float32, n), Grad: make([]float32, n), Shape: s.shape}
}

func TestMismatchErrors(t *testing.T) {
	base := []spec{{"embed", false, []int{10, 4}}, {"layers.0.ff.w1", false, []int{4, 8}}, {"layers.0.ff.b1", false, []int{8}}}
	with := func(i int, s spec) []spec {
		c := slices.Clone(base)
		c[i] = s
		return c
	}
	buf := func(name string, n int) Buffer { return Buffer{Name: name, Data: make([]int64, n)} }
	type rankModel struct {
		params  []spec
		buffers []Buffer
	}
	same := rankModel{params: base}
	for _, tc := range []struct {
		name   string
		models []rankModel
		want   string
		index  int
	}{
		{"shape", []rankModel{same, {params: with(1, spec{"layers.0.ff.w1", false, []int{8, 4}})}},
			"ddp: parameter 1 (layers.0.ff.w1) has shape [4 8] on rank 0 but [8 4] on rank 1", 1},
		{"type", []rankModel{same, same, {params: with(2, spec{"layers.0.ff.b1", true, []int{8}})}},
			"ddp: parameter 2 (layers.0.ff.b1) has type float32 on rank 0 but float64 on rank 2", 2},
		{"shape and type", []rankModel{same, {params: with(0, spec{"embed", true, []int{40}})}},
			"ddp: parameter 0 (embed) has shape [10 4] and type float32 on rank 0 but shape [40] and type float64 on rank 1", 0},
		{"name", []rankModel{same, {params: with(1, spec{"layers.0.ff.w2", false, []int{4, 8}})}},
			`ddp: parameter 1 is named "layers.0.ff.w1" on rank 0 but "layers.0.ff.w2" on rank 1`, 1},
		{"count", []rankModel{same, same, {params: base[:2]}},
			"ddp: 3 parameters on rank 0 but 2 on rank 2", -1},
		{"several ranks", []rankModel{same, {params: with(1, spec{"layers.0.ff.w1", false, []int{2, 16}})}, same,
			{params: with(1, spec{"layers.0.ff.w1", false, []int{32}})}},
			"ddp: parameter 1 (layers.0.ff.w1) has shape [4 8] on rank 0 but [2 16] on rank 1 (rank 3 also differs from rank 0)", 1},
		{"buffer shape", []rankModel{{params: base, buffers: []Buffer{buf("running_mean", 4)}}, {params: base, buffers: []Buffer{buf("running_mean", 5)}}},
			"ddp: buffer 0 (running_mean) has shape [4] on rank 0 but [5] on rank 1", 0},
		{"buffer count", []rankModel{{params: base, buffers: []Buffer{buf("running_mean", 4)}}, same},
			"ddp: 1 buffer on rank 0 but 0 on rank 1", -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := pgtest.NewCluster(len(tc.models))
			defer c.Close()
			errs := make([]error, c.Size())
			c.Each(func(rank int, pg procgroup.ProcessGroup) error {
				m := tc.models[rank]
				var ps []Param
				for _, s := range m.params {
					ps = append(ps, s.param())
				}
				d, err := New(context.Background(), pg, ps, Options{Buffers: m.buffers})
				if err == nil {
					d.Close()
				}
				errs[rank] = err
				return nil
			})
			for rank, err := range errs {
				var me *MismatchError
				if !errors.As(err, &me) || !errors.Is(err, ErrMismatch) {
					t.Fatalf("rank %d: err = %v, want a *MismatchError", rank, err)
				}
				if err.Error() != tc.want {
					t.Errorf("rank %d:\n got %s\nwant %s", rank, err, tc.want)
				}
				if me.Index != tc.index {
					t.Errorf("rank %d: Index %d, want %d", rank, me.Index, tc.index)
				}
			}
		})
	}
}

func TestLocalValidation(t *testing.T) {
	c := pgtest.NewCluster(1)
	defer c.Close()
	pg := c.Group(0)
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		p    Param
		opts Options
		want string
	}{
		{"nil data", Param{Name: "w"}, Options{}, "ddp: invalid argument: parameter 0 (w): nil Data"},
		{"int data", Param{Name: "w", Data: []int32{1}, Grad: []int32{0}}, Options{}, "ddp: invalid argument: parameter 0 (w): element type int32, want float32 or float64"},
		{"shape", Param{Name: "w", Data: make([]float32, 6), Grad: make([]float32, 6), Shape: []int{4, 2}}, Options{}, "ddp: invalid argument: parameter 0 (w): shape [4 2] holds 8 elements but Data has 6"},
		{"grad len", Param{Name: "w", Data: make([]float32, 6), Grad: make([]float32, 5)}, Options{}, "ddp: invalid argument: parameter 0 (w): Grad is float32×5 but Data is float32×6"},
		{"grad nil", Param{Name: "w", Data: make([]float32, 6)}, Options{}, "ddp: invalid argument: parameter 0 (w): nil Grad (allowed only with GradientAsBucketView)"},
		{"grad with view", Param{Name: "w", Data: make([]float32, 6), Grad: make([]float32, 6)}, Options{GradientAsBucketView: true}, "ddp: invalid argument: parameter 0 (w): Grad must be nil with GradientAsBucketView (read gradients with Grad32/Grad64)"},
		{"negative cap", Param{Name: "w", Data: make([]float32, 6), Grad: make([]float32, 6)}, Options{BucketCapMB: -1}, "ddp: invalid argument: BucketCapMB -1, FirstBucketCapMB 1, BroadcastChunkMB 64: want all positive (or BucketCapMB AutoBucketCap)"},
	} {
		_, err := New(ctx, pg, []Param{tc.p}, tc.opts)
		if err == nil || err.Error() != tc.want || !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s:\n got %v\nwant %s", tc.name, err, tc.want)
		}
	}
	if _, err := New(ctx, nil, nil, Options{}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("nil group: %v", err)
	}
}

func TestInitialBroadcast(t *testing.T) {
	for _, chunkMB := range []float64{0, 100.0 / (1 << 20)} { // default (one broadcast per type), and 100-byte chunks
		t.Run(fmt.Sprint(chunkMB), func(t *testing.T) {
			const size = 3
			c := pgtest.NewCluster(size)
			defer c.Close()
			type model struct {
				w1, w3 []float32
				w2     []float64
				b1     []int64
				b2     []float32
			}
			newModel := func(rank int) model {
				r := rand.New(rand.NewPCG(uint64(rank), 7))
				m := model{w1: numtest.RandF32(r, 15), w2: randF64(r, 7), w3: numtest.RandF32(r, 1000), b1: make([]int64, 4), b2: numtest.RandF32(r, 2)}
				for i := range m.b1 {
					m.b1[i] = r.Int64()
				}
				return m
			}
			want := newModel(0)
			got := make([]model, size)
			err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
				m := newModel(rank)
				got[rank] = m
				d, err := New(context.Background(), pg, []Param{
					{Name: "w1", Data: m.w1, Grad: make([]float32, 15), Shape: []int{3, 5}},
					{Name: "w2", Data: m.w2, Grad: make([]float64, 7)},
					{Name: "w3", Data: m.w3, Grad: make([]float32, 1000)},
				}, Options{Buffers: []Buffer{{Name: "b1", Data: m.b1}, {Name: "b2", Data: m.b2}}, BroadcastChunkMB: chunkMB})
				if err != nil {
					return err
				}
				d.Close()
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			for rank, m := range got {
				if rank > 0 && slices.Equal(newModel(rank).w1, want.w1) {
					t.Fatalf("rank %d started equal to rank 0", rank)
				}
				if !slices.Equal(m.w1, want.w1) || !slices.Equal(m.w2, want.w2) || !slices.Equal(m.w3, want.w3) ||
					!slices.Equal(m.b1, want.b1) || !slices.Equal(m.b2, want.b2) {
					t.Errorf("rank %d: parameters or buffers differ from rank 0's", rank)
				}
			}
			// Default chunks: one summary all-gather (5 int64s: counts, model hash, Shards, hook
			// hash), then one broadcast per element type.
			if chunkMB == 0 {
				var ops []string
				for _, r := range c.Issued(1) {
					ops = append(ops, r.String())
				}
				wantOps := []string{"allgather int64×7", "broadcast float32×1017 root 0", "broadcast float64×7 root 0", "broadcast int64×4 root 0"}
				if !slices.Equal(ops, wantOps) {
					t.Errorf("collectives %q, want %q", ops, wantOps)
				}
			}
		})
	}
}

// linModel is out = (x·W + b)·v with loss mean_s (out_s − t_s)²: W [din, dout] and b [dout]
// in float32, v [dout] in float64, so that buckets of both types are reduced.
type linModel struct {
	din, dout int
	W, b      []float32
	v         []float64
}

// grads returns the gradient of scale · Σ_s (out_s − t_s)² over the samples xs (rows of
// din), ts, computed in float64.
func (m *linModel) grads(xs, ts []float64, scale float64) (gW, gb, gv []float64) {
	gW, gb, gv = make([]float64, len(m.W)), make([]float64, len(m.b)), make([]float64, len(m.v))
	h := make([]float64, m.dout)
	for s := range ts {
		x := xs[s*m.din : (s+1)*m.din]
		out := 0.0
		for j := range h {
			h[j] = float64(m.b[j])
			for i := range x {
				h[j] += x[i] * float64(m.W[i*m.dout+j])
			}
			out += h[j] * m.v[j]
		}
		e := 2 * (out - ts[s]) * scale
		for j := range h {
			gv[j] += e * h[j]
			gb[j] += e * m.v[j]
			for i := range x {
				gW[i*m.dout+j] += e * x[i] * m.v[j]
			}
		}
	}
	return gW, gb, gv
}

func to32(v []float64) []float32 {
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = float32(x)
	}
	return out
}

// TestAveragedGradients: R ranks, each with A micro-batches of M samples (all but the last
// under NoSync), end every step with the gradient of the mean loss over all R·A·M samples,
// computed in float64 by one process; SGD keeps the replicas identical. Tolerance: 1e-5
// relative for the float32 gradients, 1e-12 for the float64 ones at the first step
// (1e-5 later, once float32-rounded updates have entered them).
func TestAveragedGradients(t *testing.T) {
	const (
		R, A, M   = 3, 2, 4
		din, dout = 6, 5
		steps     = 3
		lr        = 0.05
	)
	for _, view := range []bool{false, true} {
		t.Run(fmt.Sprintf("bucket_view=%v", view), func(t *testing.T) {
			r := rand.New(rand.NewPCG(11, 12))
			N := R * A * M
			xs, ts := randF64(r, steps*N*din), randF64(r, steps*N)
			// The reference: one process, the full batch, rank 0's initial parameters.
			newModel := func(rank int) *linModel {
				r := rand.New(rand.NewPCG(uint64(rank), 99))
				return &linModel{din: din, dout: dout, W: numtest.RandF32(r, din*dout), b: numtest.RandF32(r, dout), v: randF64(r, dout)}
			}
			ref := newModel(0)
			var refG [steps][3][]float64
			for s := 0; s < steps; s++ {
				gW, gb, gv := ref.grads(xs[s*N*din:(s+1)*N*din], ts[s*N:(s+1)*N], 1/float64(N))
				refG[s] = [3][]float64{gW, gb, gv}
				for i := range ref.W {
					ref.W[i] -= float32(lr * gW[i])
				}
				for i := range ref.b {
					ref.b[i] -= float32(lr * gb[i])
				}
				for i := range ref.v {
					ref.v[i] -= lr * gv[i]
				}
			}

			c := pgtest.NewCluster(R)
			defer c.Close()
			finals := make([]*linModel, R)
			err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
				m := newModel(rank)
				finals[rank] = m
				ps := []Param{
					{Name: "W", Data: m.W, Shape: []int{din, dout}},
					{Name: "b", Data: m.b},
					{Name: "v", Data: m.v},
				}
				if !view {
					ps[0].Grad, ps[1].Grad, ps[2].Grad = make([]float32, din*dout), make([]float32, dout), make([]float64, dout)
				}
				// Caps of one byte: every parameter closes its own bucket.
				d, err := New(context.Background(), pg, ps, Options{BucketCapMB: 1.0 / (1 << 20), FirstBucketCapMB: 1.0 / (1 << 20), GradientAsBucketView: view})
				if err != nil {
					return err
				}
				defer d.Close()
				for s := 0; s < steps; s++ {
					for a := 0; a < A; a++ {
						// Micro-batch a of rank r holds samples (a·R + r)·M ….
						first := s*N + (a*R+rank)*M
						gW, gb, gv := m.grads(xs[first*din:(first+M)*din], ts[first:first+M], 1/float64(A*M))
						backward := func() error { // reverse registration order, as backward would
							return errors.Join(d.GradReady64(2, gv), d.GradReady(1, to32(gb)), d.GradReady(0, to32(gW)))
						}
						if a < A-1 {
							err = d.NoSync(backward)
						} else {
							err = d.Backward(context.Background(), backward)
						}
						if err != nil {
							return fmt.Errorf("step %d micro-batch %d: %w", s, a, err)
						}
					}
					for k, g := range []any{d.Grad32(0), d.Grad32(1), d.Grad64(2)} {
						var err error
						switch g := g.(type) {
						case []float32:
							err = numtest.CloseTo(g, refG[s][k], 1e-5)
						case []float64:
							// Exact but for summation order at step 0; later the float32
							// parameters have taken float32-rounded updates.
							tol := 1e-12
							if s > 0 {
								tol = 1e-5
							}
							err = numtest.CloseTo(g, refG[s][k], tol)
						}
						if err != nil {
							return fmt.Errorf("step %d: gradient of %s: %w", s, ps[k].Name, err)
						}
					}
					if st := d.Stats(); st == nil || st.Mode != Sync || len(st.BucketBytes) != 3 {
						return fmt.Errorf("step %d: stats %+v, want a synced pass over 3 buckets", s, st)
					}
					gW, gb, gv := d.Grad32(0), d.Grad32(1), d.Grad64(2)
					for i := range m.W {
						m.W[i] -= lr * gW[i]
					}
					for i := range m.b {
						m.b[i] -= lr * gb[i]
					}
					for i := range m.v {
						m.v[i] -= lr * gv[i]
					}
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			for rank, m := range finals {
				if !slices.Equal(m.W, finals[0].W) || !slices.Equal(m.b, finals[0].b) || !slices.Equal(m.v, finals[0].v) {
					t.Errorf("rank %d: parameters differ from rank 0's after %d steps", rank, steps)
				}
			}
			if err := numtest.CloseTo(finals[0].v, numtest.ToF64(ref.v), 1e-5); err != nil {
				t.Errorf("v after %d steps vs one process: %v", steps, err)
			}
		})
	}
}

// TestFailureReachesEveryRank: a rank whose hook reports a gradient of the wrong length
// fails its Finalize with a clear error, and its peer's Finalize fails instead of hanging.
func TestFailureReachesEveryRank(t *testing.T) {
	c := pgtest.NewCluster(2)
	defer c.Close()
	errs := make([]error, 2)
	c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		d, err := New(context.Background(), pg, []Param{{Name: "w", Data: make([]float32, 4), Grad: make([]float32, 4)}}, Options{})
		if err != nil {
			errs[rank] = err
			return nil
		}
		defer d.Close()
		n := 4
		if rank == 1 {
			n = 3
		}
		d.BeginBackward(Sync)
		d.GradReady(0, make([]float32, n))
		errs[rank] = d.Finalize(context.Background())
		if again := d.Finalize(context.Background()); again == nil || again.Error() != errs[rank].Error() {
			errs[rank] = fmt.Errorf("second Finalize: %v, want the first error %v", again, errs[rank])
		}
		return nil
	})
	want1 := "ddp: rank 1: reducer: invalid argument: GradReady(0): gradient of parameter w is float32×3, want float32×4"
	if errs[1] == nil || errs[1].Error() != want1 || !errors.Is(errs[1], reducer.ErrInvalidArgument) {
		t.Errorf("rank 1: %v\nwant %s", errs[1], want1)
	}
	if !errors.Is(errs[0], procgroup.ErrAborted) {
		t.Errorf("rank 0: %v, want an error wrapping procgroup.ErrAborted", errs[0])
	}
}

func TestOutOfTurn(t *testing.T) {
	c := pgtest.NewCluster(1)
	defer c.Close()
	d, err := New(context.Background(), c.Group(0), []Param{{Name: "w", Data: make([]float32, 4), Grad: make([]float32, 4)}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Finalize(context.Background()); !errors.Is(err, ErrPhase) {
		t.Errorf("Finalize first: %v, want ErrPhase", err)
	}
	// A NoSync pass needs no Finalize; a synced one must get every gradient.
	if err := d.NoSync(func() error { return d.GradReady(0, []float32{1, 2, 3, 4}) }); err != nil {
		t.Fatal(err)
	}
	if err := d.Backward(context.Background(), func() error { return d.GradReady(0, []float32{1, 1, 1, 1}) }); err != nil {
		t.Fatal(err)
	}
	if g := d.Grad32(0); !slices.Equal(g, []float32{2, 3, 4, 5}) {
		t.Errorf("accumulated gradient %v, want [2 3 4 5]", g)
	}
	// A synced pass that misses a gradient: the next BeginBackward's error names it.
	d.BeginBackward(Sync)
	d.BeginBackward(Sync)
	err = d.Finalize(context.Background())
	if !errors.Is(err, ErrUnusedParameters) {
		t.Errorf("unfinished pass: %v, want ErrUnusedParameters", err)
	}
	d.Close()
	d.Close() // idempotent
	if err := d.Finalize(context.Background()); !errors.Is(err, ErrClosed) {
		t.Errorf("Finalize after Close: %v, want ErrClosed", err)
	}
	if err := d.BroadcastBuffers(context.Background()); !errors.Is(err, ErrClosed) {
		t.Errorf("BroadcastBuffers after Close: %v, want ErrClosed", err)
	}
}

// TestUnusedAndBuffers: with FindUnusedParameters a parameter that gets no gradient is
// averaged as zeros; BroadcastBuffers copies rank 0's buffers again.
func TestUnusedAndBuffers(t *testing.T) {
	c := pgtest.NewCluster(2)
	defer c.Close()
	bufs := make([][]float64, 2)
	grads := make([][]float32, 2)
	err := c.Each(func(rank int, pg procgroup.ProcessGroup) error {
		r := rand.New(rand.NewPCG(uint64(rank), 3))
		bufs[rank] = randF64(r, 3)
		grads[rank] = []float32{9, 9}
		d, err := New(context.Background(), pg, []Param{
			{Name: "used", Data: numtest.RandF32(r, 2), Grad: make([]float32, 2)},
			{Name: "unused", Data: numtest.RandF32(r, 2), Grad: grads[rank]},
		}, Options{FindUnusedParameters: true, Buffers: []Buffer{{Name: "stat", Data: bufs[rank]}}})
		if err != nil {
			return err
		}
		defer d.Close()
		if err := d.Backward(context.Background(), func() error {
			return d.GradReady(0, []float32{float32(rank), 2})
		}); err != nil {
			return err
		}
		if g := d.Grad32(0); !slices.Equal(g, []float32{0.5, 2}) {
			return fmt.Errorf("used gradient %v, want [0.5 2]", g)
		}
		if st := d.Stats(); !slices.Equal(st.Unused, []int{1}) {
			return fmt.Errorf("Stats().Unused = %v, want [1]", st.Unused)
		}
		bufs[rank][0] = float64(10 + rank)
		return d.BroadcastBuffers(context.Background())
	})
	if err != nil {
		t.Fatal(err)
	}
	for rank := range 2 {
		if !slices.Equal(grads[rank], []float32{0, 0}) {
			t.Errorf("rank %d: unused gradient %v, want zeros", rank, grads[rank])
		}
		if !slices.Equal(bufs[rank], bufs[0]) || bufs[rank][0] != 10 {
			t.Errorf("rank %d: buffer %v, want rank 0's %v", rank, bufs[rank], bufs[0])
		}
	}
}

// TestAdapterHooks: AfterSync runs after every synced Finalize only, with the averages in
// place, and may call the DDP; its error fails the DDP. Fail ends the DDP from outside a
// call that returns errors (an adapter's hook), and the first error counts.
func TestAdapterHooks(t *testing.T) {
	c := pgtest.NewCluster(1)
	defer c.Close()
	ctx := context.Background()
	var calls int
	var seen []float32
	boom := errors.New("boom")
	d, err := New(ctx, c.Group(0), []Param{{Name: "w", Data: make([]float32, 2), Grad: make([]float32, 2)}}, Options{
		AfterSync: func(d *DDP) error {
			calls++
			seen = slices.Clone(d.Grad32(0))
			if calls == 2 {
				return boom
			}
			return d.Err()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.NoSync(func() error { return d.GradReady(0, []float32{1, 2}) }); err != nil {
		t.Fatal(err)
	}
	if calls != 0 {
		t.Fatalf("AfterSync ran %d times after a NoSync pass", calls)
	}
	if err := d.Backward(ctx, func() error { return d.GradReady(0, []float32{1, 1}) }); err != nil {
		t.Fatal(err)
	}
	if calls != 1 || !slices.Equal(seen, []float32{2, 3}) {
		t.Fatalf("AfterSync: %d calls, saw %v; want 1 call seeing [2 3]", calls, seen)
	}
	if err := d.Fail(nil); err != nil {
		t.Fatalf("Fail(nil) = %v on a healthy DDP", err)
	}
	err = d.Backward(ctx, func() error { return d.GradReady(0, []float32{1, 1}) })
	if !errors.Is(err, boom) || !errors.Is(d.Err(), boom) {
		t.Fatalf("AfterSync's error: Finalize %v, Err %v; want boom", err, d.Err())
	}
	if err := d.Fail(errors.New("later")); !errors.Is(err, boom) {
		t.Errorf("Fail after a failure = %v, want the first error", err)
	}

	// Fail on a healthy DDP: the next Finalize returns its error.
	d2, err := New(ctx, c.Group(0), []Param{{Name: "w", Data: make([]float32, 2), Grad: make([]float32, 2)}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	d2.BeginBackward(Sync)
	if err := d2.Fail(boom); !errors.Is(err, boom) {
		t.Errorf("Fail = %v", err)
	}
	if err := d2.Finalize(ctx); !errors.Is(err, boom) {
		t.Errorf("Finalize after Fail = %v, want boom", err)
	}
}

// TestStatsSnapshotAndMode: Stats is the caller's to keep (later passes do not change it);
// a mode other than Sync and Accumulate fails the DDP.
func TestStatsSnapshotAndMode(t *testing.T) {
	c := pgtest.NewCluster(1)
	defer c.Close()
	ctx := context.Background()
	d, err := New(ctx, c.Group(0), []Param{{Name: "w", Data: make([]float32, 2), Grad: make([]float32, 2)}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if d.Stats() != nil {
		t.Error("Stats before the first pass is not nil")
	}
	pass := func() {
		t.Helper()
		if err := d.Backward(ctx, func() error { return d.GradReady(0, []float32{1, 2}) }); err != nil {
			t.Fatal(err)
		}
	}
	pass()
	first := d.Stats()
	kept := *first
	kept.GradReady = slices.Clone(first.GradReady)
	for range 3 {
		pass()
	}
	if first.Iter != 1 || first.Mode != Sync || first.Iter != kept.Iter || !slices.Equal(first.GradReady, kept.GradReady) {
		t.Errorf("the first pass's stats changed: iter %d mode %v grads %v, kept iter %d grads %v",
			first.Iter, first.Mode, first.GradReady, kept.Iter, kept.GradReady)
	}
	if st := d.Stats(); st == first || st.Iter != 4 {
		t.Errorf("Stats after 4 passes: iter %d (same pointer: %v)", st.Iter, st == first)
	}
	d.BeginBackward(SyncMode(0))
	if err := d.Finalize(ctx); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("BeginBackward(0): Finalize = %v, want ErrInvalidArgument", err)
	}
}
