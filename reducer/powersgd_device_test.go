package reducer

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/goddp/goddp/internal/gpufake"
	"github.com/goddp/goddp/procgroup"
)

// psgdDevRun is what runPSGDDevice saw: each rank's gradients after each synced step, and
// the hooks.
type psgdDevRun struct {
	out     [][][][]float64 // rank, step (from the first run), param
	hooks   []*powerSGD
	layouts [][][]int
	saved   [][]byte // by rank
}

// runPSGDDevice is runPSGD on device buckets (Note [PowerSGD on the device]) over the nccl
// backend and the fakes: the same gradients (psgdGrads), copied to the device and reported
// with GradReadyDevice in reverse order, so that the first synced Finalize rebuilds.
// layouts[step] are the buckets each step ran with (their parameters), as runPSGD's.
func runPSGDDevice(t *testing.T, tc psgdCase) psgdDevRun {
	return runPSGDDeviceFrom(t, tc, 0, nil, -1)
}

// runPSGDDeviceFrom is runPSGDDevice from synced step from on, each rank's hook restored
// (UnmarshalBinary) from restore[rank] unless it is nil; with save ≥ 0 it returns each
// rank's state (MarshalBinary) after that many synced steps in saved.
func runPSGDDeviceFrom(t *testing.T, tc psgdCase, from int, restore [][]byte, save int) psgdDevRun {
	t.Helper()
	ctx := testCtx(t)
	np := len(tc.shapes)
	grads := psgdGrads(tc)
	ws := startDevice(t, tc.ranks, false)
	run := psgdDevRun{out: make([][][][]float64, tc.ranks), hooks: make([]*powerSGD, tc.ranks), saved: make([][]byte, tc.ranks)}
	errs := runRanks(tc.ranks, func(rank int) error {
		w := ws[rank]
		params := make([]Param, np)
		in := make([]procgroup.DeviceBuffer, np)
		for p, sh := range tc.shapes {
			for _, d := range []*procgroup.DeviceBuffer{&in[p], nil} {
				b, err := w.g.Alloc(procgroup.Float32, psgdSize(sh))
				if err != nil {
					return err
				}
				defer w.g.Free(b)
				if d != nil {
					*d = b.On(w.stream)
				} else {
					params[p] = Param{Name: fmt.Sprintf("p%d", p), Shape: sh, Grad: b.On(w.stream)}
				}
			}
		}
		hook := PowerSGDHook(tc.opts).(*powerSGD)
		run.hooks[rank] = hook
		r, err := New(w.pg, params, Options{CommHook: hook, BucketCapMB: tc.capMB, FirstBucketCapMB: tc.capMB, Device: true, Stream: w.stream})
		if err != nil {
			return err
		}
		defer r.Close()
		if restore != nil {
			if err := hook.UnmarshalBinary(restore[rank]); err != nil {
				return err
			}
		}
		pass := from
		if tc.accum {
			pass += from / 2
		}
		backward := func(mode Mode) error {
			if err := r.BeginBackward(mode); err != nil {
				return err
			}
			for p := range np {
				if err := w.g.CopyIn(in[p], to32(grads[rank][pass][p])); err != nil {
					return err
				}
				if err := r.GradReadyDevice(p, in[p]); err != nil {
					return err
				}
			}
			pass++
			return nil
		}
		for s := from; s < tc.steps; s++ {
			if s == save {
				if run.saved[rank], err = hook.MarshalBinary(); err != nil {
					return err
				}
			}
			if tc.accum && s%2 == 1 {
				if err := backward(Accumulate); err != nil {
					return err
				}
			}
			if rank == 0 {
				var l [][]int
				for _, b := range r.Buckets() {
					l = append(l, b.Params)
				}
				run.layouts = append(run.layouts, l)
			}
			if err := backward(Sync); err != nil {
				return err
			}
			if err := r.Finalize(ctx); err != nil {
				return err
			}
			got := make([][]float64, np)
			for p, prm := range params {
				v, err := download(w.g, prm.Grad.(procgroup.DeviceBuffer), w.stream)
				if err != nil {
					return err
				}
				got[p] = to64(v)
			}
			run.out[rank] = append(run.out[rank], got)
		}
		_, err = hook.MarshalBinary() // copies the device state to the hook's host copies
		return err
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return run
}

// psgdClose compares got with want element by element: |got − want| ≤ tol·(1 + max|want|)
// over the parameter, the scale of its result. It returns the largest ratio
// |got − want| / (1 + scale) too.
func psgdClose(got, want [][][]float64, tol float64) (float64, error) {
	worst := 0.0
	for s := range want {
		for p := range want[s] {
			scale := 0.0
			for _, v := range want[s][p] {
				scale = max(scale, math.Abs(v))
			}
			for k, v := range want[s][p] {
				d := math.Abs(got[s][p][k] - v)
				if d > tol*(1+scale) {
					return worst, fmt.Errorf("step %d param %d [%d]: %v, want %v (difference %.3g of the scale %.3g)", s, p, k, got[s][p][k], v, d, scale)
				}
				worst = max(worst, d/(1+scale))
			}
		}
	}
	return worst, nil
}

// TestPowerSGDDevice: PowerSGD on device buckets (the fakes' cuBLAS and kernels; with
// GODDP_GPU=1 a GPU's, at world size 1 only) at world sizes 1, 2 and 3, several synced
// steps, with one bucket, several, or one parameter a bucket, NoSync passes, the rebuild of the first synced Finalize and StartIter: every
// rank's averaged gradients after each step match the host path's on the same gradients
// (pgtest) and the float64 reference's (refPSGD), within 2e-5 of each parameter's scale,
// 1 + its largest |element| (the device path computes its factors in float32, the host
// path in float64: Note [PowerSGD on the device]; about 1e-6 is seen); the ranks agree bit
// for bit; the layouts, the rebuild's included, are the host run's; and the steps,
// factors and errors the hooks end with are the host hooks' within 1e-3.
func TestPowerSGDDevice(t *testing.T) {
	shapes := [][]int{
		{12, 9},    // compressed at rank 2
		{7},        // a bias: as it is
		{6, 4, 5},  // a 6×20 matrix: compressed
		{3, 4},     // too small to gain
		{0, 5},     // empty
		{16, 10},   // compressed
		{1, 1, 30}, // a 1×30 matrix: as it is
	}
	for _, tc := range []psgdCase{
		{name: "several buckets", shapes: shapes, dtype: procgroup.Float32, opts: PowerSGDOptions{Rank: 2, Seed: 4}, capMB: 600.0 / (1 << 20), ranks: 2, steps: 8, accum: true, random: true},
		{name: "one bucket start iter", shapes: shapes, dtype: procgroup.Float32, opts: PowerSGDOptions{Rank: 3, Seed: 6, StartIter: 2, MinCompressionRate: 1}, ranks: 3, steps: 7, accum: true, random: true},
		{name: "one param a bucket", shapes: shapes, dtype: procgroup.Float32, opts: PowerSGDOptions{Rank: 1, Seed: 5, MinCompressionRate: 1}, capMB: 1.0 / (1 << 20), ranks: 3, steps: 6, random: true},
		{name: "same gradients", shapes: shapes, dtype: procgroup.Float32, opts: PowerSGDOptions{Rank: 2, Seed: 8}, capMB: 600.0 / (1 << 20), ranks: 2, steps: 8},
		{name: "one rank", shapes: shapes, dtype: procgroup.Float32, opts: PowerSGDOptions{Rank: 2, Seed: 9}, capMB: 600.0 / (1 << 20), ranks: 1, steps: 8, accum: true, random: true},
	} {
		if gpuMode && tc.ranks > 1 { // one GPU holds one NCCL rank
			continue
		}
		t.Run(tc.name, func(t *testing.T) {
			host := runPSGD(t, tc)
			dev := runPSGDDevice(t, tc)
			ref := reference(tc, host, initialQ(t, tc))
			if fmt.Sprint(dev.layouts) != fmt.Sprint(host.layouts) {
				t.Fatalf("device layouts %v, host layouts %v", dev.layouts, host.layouts)
			}
			if len(dev.layouts[0]) > 1 && fmt.Sprint(dev.layouts[0]) == fmt.Sprint(dev.layouts[1]) {
				t.Fatalf("no rebuild: layouts %v then %v", dev.layouts[0], dev.layouts[1])
			}
			for w := range tc.ranks {
				dh, err := psgdClose(dev.out[w], host.out[w], 2e-5)
				if err != nil {
					t.Fatalf("rank %d against the host path: %v", w, err)
				}
				dr, err := psgdClose(dev.out[w], ref, 2e-5)
				if err != nil {
					t.Fatalf("rank %d against the reference: %v", w, err)
				}
				if w == 0 {
					t.Logf("largest difference over the scale: %.2g from the host path, %.2g from the reference", dh, dr)
				}
				for s := range dev.out[w] {
					for p := range dev.out[w][s] {
						for k, v := range dev.out[w][s][p] {
							if math.Float64bits(v) != math.Float64bits(dev.out[0][s][p][k]) {
								t.Fatalf("step %d param %d [%d]: rank %d has %v, rank 0 %v", s, p, k, w, v, dev.out[0][s][p][k])
							}
						}
					}
				}
			}
			// The state, copied from the device as MarshalBinary does, is the host
			// hooks' state.
			for w := range tc.ranks {
				hh, dh := host.hooks[w], dev.hooks[w]
				if fmt.Sprint(hh.steps) != fmt.Sprint(dh.steps) {
					t.Fatalf("rank %d: steps %v, the host hook's %v", w, dh.steps, hh.steps)
				}
				for i, mt := range hh.mats {
					if mt == nil {
						continue
					}
					for _, f := range []struct {
						name      string
						host, dev []float64
					}{{"P", mt.p, dh.mats[i].p}, {"Q", mt.q, dh.mats[i].q}, {"E", to64(mt.e.([]float32)), to64(dh.mats[i].e.([]float32))}} {
						for k := range f.host {
							if math.Abs(f.host[k]-f.dev[k]) > 1e-3*(1+math.Abs(f.host[k])) {
								t.Fatalf("rank %d param %d: %s[%d] = %v, the host hook's %v", w, i, f.name, k, f.dev[k], f.host[k])
							}
						}
					}
				}
			}
		})
	}
}

// TestPowerSGDDeviceRefused: on device buckets, a group whose Device offers no
// DeviceBLAS, and float64 matrices, are refused at New with ErrInvalidArgument, naming
// what is missing; 1-D float64 parameters are not compressed, and go through.
func TestPowerSGDDeviceRefused(t *testing.T) {
	ws := startDevice(t, 1, false)
	g := ws[0].g
	alloc := func(dt procgroup.DType, n int) procgroup.DeviceBuffer {
		d, err := g.Alloc(dt, n)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { g.Free(d) })
		return d.On(ws[0].stream)
	}
	m32 := Param{Name: "w", Shape: []int{16, 10}, Grad: alloc(procgroup.Float32, 160)}
	_, err := New(noBLAS{ws[0].pg, g}, []Param{m32}, Options{CommHook: PowerSGDHook(PowerSGDOptions{Rank: 2}), Device: true, Stream: ws[0].stream})
	if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "procgroup.DeviceBLAS") {
		t.Errorf("a Device without BLAS: %v", err)
	}
	m64 := Param{Name: "w64", Shape: []int{16, 10}, Grad: alloc(procgroup.Float64, 160)}
	_, err = New(ws[0].pg, []Param{m64}, Options{CommHook: PowerSGDHook(PowerSGDOptions{Rank: 2}), Device: true, Stream: ws[0].stream})
	if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "float32 matrices only") {
		t.Errorf("a float64 matrix: %v", err)
	}
	b64 := Param{Name: "b64", Shape: []int{7}, Grad: alloc(procgroup.Float64, 7)}
	r, err := New(ws[0].pg, []Param{m32, b64}, Options{CommHook: PowerSGDHook(PowerSGDOptions{Rank: 2}), Device: true, Stream: ws[0].stream})
	if err != nil {
		t.Fatalf("float32 matrix and a float64 bias: %v", err)
	}
	r.Close()
}

// noBLAS is a group whose device operations are the nccl group's less DeviceBLAS.
type noBLAS struct {
	procgroup.ProcessGroup
	procgroup.Device
}

func to64(v []float32) []float64 {
	out := make([]float64, len(v))
	for k, x := range v {
		out[k] = float64(x)
	}
	return out
}

// TestPowerSGDDeviceNoHostSync: New creates each rank's cuBLAS handle (PrepareBLAS at
// Setup), and steady PowerSGD steps on device buckets (gradients written by a kernel on
// the compute stream, both parities, several buckets) make no call to cuStreamSynchronize
// or cuEventSynchronize (the fake driver counts them), issue one collective per bucket per
// step, and leave results that are nonzero and the same bits on both ranks.
func TestPowerSGDDeviceNoHostSync(t *testing.T) {
	const n = 2
	shapes := [][]int{{16, 10}, {7}, {12, 9}, {20, 6}}
	ws := startDevice(t, n, false)
	rng := rand.New(rand.NewPCG(9, 9))
	type rankState struct {
		red              *Reducer
		grads, next, out []procgroup.DeviceBuffer
	}
	rs := make([]*rankState, n)
	handles := gpufake.Knob("blas_handles", 0)
	for r := range rs {
		g, st := ws[r].g, ws[r].stream
		d := &rankState{}
		params := make([]Param, len(shapes))
		for p, sh := range shapes {
			v := make([]float32, psgdSize(sh))
			for k := range v {
				v[k] = float32(rng.NormFloat64())
			}
			d.grads = append(d.grads, upload(t, g, st, make([]float32, len(v))))
			d.next = append(d.next, upload(t, g, st, v))
			d.out = append(d.out, upload(t, g, st, make([]float32, len(v))))
			params[p] = Param{Name: fmt.Sprint(p), Shape: sh, Grad: d.out[p]}
		}
		red, err := New(ws[r].pg, params, Options{CommHook: PowerSGDHook(PowerSGDOptions{Rank: 2, Seed: 1}), BucketCapMB: 800.0 / (1 << 20), FirstBucketCapMB: 800.0 / (1 << 20), Device: true, Stream: st})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { red.Close() })
		d.red = red
		rs[r] = d
	}
	// Setup created each rank's cuBLAS handle (PrepareBLAS), not the first Launch.
	if got := gpufake.Knob("blas_handles", 0) - handles; got != n {
		t.Fatalf("%d cuBLAS handles after New, want %d", got, n)
	}
	step := func(s int) error {
		return firstErr(runRanks(n, func(r int) error {
			d, dev := rs[r], procgroup.Device(ws[r].g)
			if err := d.red.BeginBackward(Sync); err != nil {
				return err
			}
			for p := range shapes {
				if err := dev.ScaleAsync(ws[r].stream, d.grads[p], d.next[p], float64(s%3+1), false); err != nil {
					return err
				}
				if err := d.red.GradReadyDevice(p, d.grads[p]); err != nil {
					return err
				}
			}
			return d.red.Finalize(testCtx(t))
		}))
	}
	for s := 0; s < 2; s++ { // the rebuild, and every bucket's first launch
		if err := step(s); err != nil {
			t.Fatal(err)
		}
	}
	if nb := len(rs[0].red.Buckets()); nb < 2 {
		t.Fatalf("%d buckets, want several", nb)
	}
	for r := range rs { // the first steps' collectives have run (the stream waited for them)
		if err := ws[r].g.SyncStream(ws[r].stream); err != nil {
			t.Fatal(err)
		}
	}
	before, coll := gpufake.Knob("syncs", 0), gpufake.Knob("nccl_collectives", 0)
	for s := 2; s < 8; s++ {
		if err := step(s); err != nil {
			t.Fatal(err)
		}
	}
	if syncs := gpufake.Knob("syncs", 0) - before; syncs != 0 {
		t.Fatalf("%d host synchronisations in 6 steady steps, want 0", syncs)
	}
	nb := len(rs[0].red.Buckets())
	for _, d := range rs { // Close drains the streams: every collective has run
		if err := d.red.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := gpufake.Knob("nccl_collectives", 0)-coll, int64(6*nb); got != want {
		t.Fatalf("%d collectives in 6 steady steps, want one per bucket per step, %d", got, want)
	}
	for p := range shapes {
		a, err := download(ws[0].g, rs[0].out[p], ws[0].stream)
		if err != nil {
			t.Fatal(err)
		}
		b, err := download(ws[1].g, rs[1].out[p], ws[1].stream)
		if err != nil {
			t.Fatal(err)
		}
		nonzero := false
		for k := range a {
			if math.Float32bits(a[k]) != math.Float32bits(b[k]) {
				t.Fatalf("param %d [%d]: rank 0 has %v, rank 1 %v", p, k, a[k], b[k])
			}
			nonzero = nonzero || a[k] != 0
		}
		if !nonzero {
			t.Fatalf("param %d: all zeros", p)
		}
	}
}

// TestPowerSGDDeviceState: device hooks' states saved after 3 synced steps (MarshalBinary
// copies them from the device) and restored into new device hooks (UnmarshalBinary copies
// them back) go on with the uninterrupted run's bits; and a device hook's state restores
// into a host hook (one format for both paths).
func TestPowerSGDDeviceState(t *testing.T) {
	shapes := [][]int{{12, 9}, {7}, {6, 4, 5}, {16, 10}}
	tc := psgdCase{name: "device state", shapes: shapes, dtype: procgroup.Float32, opts: PowerSGDOptions{Rank: 2, Seed: 11}, capMB: 600.0 / (1 << 20), ranks: 2, steps: 7, accum: true, random: true}
	const at = 3
	whole := runPSGDDeviceFrom(t, tc, 0, nil, at)
	resumed := runPSGDDeviceFrom(t, tc, at, whole.saved, -1)
	for w := range tc.ranks {
		for s := at; s < tc.steps; s++ {
			for p := range shapes {
				for k, v := range whole.out[w][s][p] {
					if g := resumed.out[w][s-at][p][k]; math.Float64bits(g) != math.Float64bits(v) {
						t.Fatalf("rank %d step %d param %d [%d]: resumed %v, uninterrupted %v", w, s, p, k, g, v)
					}
				}
			}
		}
	}
	// A host hook restored from a device hook's state: the same steps and factors.
	h := PowerSGDHook(tc.opts).(*powerSGD)
	hp := make([]HookParam, len(shapes))
	for p, sh := range shapes {
		hp[p] = HookParam{Name: fmt.Sprint(p), DType: procgroup.Float32, Shape: sh}
	}
	if err := h.Setup(HookSetup{Params: hp, WorldSize: tc.ranks}); err != nil {
		t.Fatal(err)
	}
	if err := h.UnmarshalBinary(whole.saved[0]); err != nil {
		t.Fatalf("a device state into a host hook: %v", err)
	}
	if h.steps[0] != at {
		t.Fatalf("restored step %d, want %d", h.steps[0], at)
	}
}
