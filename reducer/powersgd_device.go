package reducer

import (
	"context"
	"fmt"

	"github.com/goddp/goddp/procgroup"
)

// Note [PowerSGD on the device]: with Options.Device the buckets are procgroup.DeviceBuffers
// and the hook runs the algorithm of Note [PowerSGD] on the device, all of it enqueued on
// the compute stream (BucketView.Stream), with the group's procgroup.DeviceBLAS
// (backends/nccl: cuBLAS and a kernel of its own); Setup refuses a group without it. The
// state is the host path's, per parameter: E (n×m), P (n×r) and Q (m×r), in float32 device
// memory allocated at Setup (after PrepareBLAS, which creates the cuBLAS handle there rather
// than in the first Launch; E and P zeroed, Q the host path's draws from the seed, rounded
// to float32, uploaded once: the one host synchronisation, at New). So on the device only
// float32 matrices are compressed (Setup refuses float64 ones; 1-D float64 parameters go
// uncompressed). A launch enqueues, for each compressed matrix:
//
//	E += M (ScaleAsync);
//	even steps: Q̂ = orth(Q); P_w = M'·Q̂ into the message; E −= P_w·Q̂ᵀ (two SGEMMs);
//	odd steps:  P̂ = orth(P); Q_w = M'ᵀ·P̂ into the message; E −= P̂·Q_wᵀ (two SGEMMs);
//
// and copies the uncompressed parameters into the message first, as on the host; the
// all-reduce of the message (its even or odd length, boxed once) then waits on the device
// for all of it. Finish copies the summed factor into P (even) or Q (odd) and enqueues
// out = P·Qᵀ (one SGEMM) into the bucket, and the uncompressed parameters back. The host
// never waits inside a step: the only allocation on the device is the message, at a
// layout's first launch (freed by the reducer at the rebuild and at Close, as a
// DeviceBuffer in Scratch is), and Close releases the state (DeviceStateHook).
//
// The matrices are row-major n×m in the bucket, which column-major cuBLAS sees as their
// m×n transposes with leading dimension m; P (n×r) and Q (m×r) are column-major with
// leading dimensions n and m, as on the host. So, in cuBLAS's terms (C = α·op(A)·op(B) +
// βC, cublasSgemm's arguments in order from transa):
//
//	P_w = M'·Q̂:   sgemm(T, N, n, r, m, 1, E, m, Q̂, m, 0, P_w, n)
//	Q_w = M'ᵀ·P̂:  sgemm(N, N, m, r, n, 1, E, m, P̂, n, 0, Q_w, m)
//	Eᵀ −= Q·Pᵀ:   sgemm(N, T, m, n, r, −1, Q, m, P, n, 1, E, m)  (Q̂, P_w or Q_w, P̂)
//	outᵀ = Q·Pᵀ:  sgemm(N, T, m, n, r, 1, Q, m, P, n, 0, out, m)
//
// Orthonormalisation is DeviceBLAS.OrthonormalizeAsync: on the nccl backend one kernel
// thread runs modified Gram-Schmidt in float64 on the float32 factor, twice over per
// column, since float32 storage leaves about 1e-7 of the projections behind (a degenerate
// column is one left with under 1e-5 of its length, replaced by the same seed's draws as
// on the host). It costs about 4·rows·r² dependent float64 operations per matrix and
// step, serialised on the stream: at rows = 4096 and r = 4 some 260 thousand, a few
// hundred microseconds on one GPU thread; the cost grows with rows, so a factor of 25088
// rows at r = 8 takes milliseconds, and a block-wide kernel (a reduction per dot product)
// is the next step where that matters. A device→host→device round trip instead would need
// the host to wait inside Launch (or a host callback on the stream) and cost two
// transfers' latency. Its bits are the same on every device (no fused multiply-add,
// correctly rounded square root and division, one summation order), so every rank
// computes the same factor from the same all-reduced one.
//
// The device path computes in float32 (the factors, and the SGEMMs' sums) where the host
// path computes in float64 (its dot products in four float64 partial sums), and cuBLAS
// sums in an order of its own (the fake's cublasSgemm_v2 in index order, in float32), so
// the two paths do not give the same bits, on the fakes or on a GPU: the tests compare
// them within a stated tolerance, and both with a float64 reference. The checkpoint format is the host path's: MarshalBinary copies the
// device state to the host (a host synchronisation: between steps only), UnmarshalBinary
// and UnmarshalResized copy it back, so a state saved on either path restores on the other
// (the factors rounded to float32 on the device).

// psgdDevBucket is a device bucket's message (BucketView.Scratch).
type psgdDevBucket struct {
	msg       procgroup.DeviceBuffer
	even, odd any  // msg cut to an even and an odd step's length, on the stream, boxed once
	plain     bool // this step all-reduced the bucket as it is (StartIter)
	empty     bool // this step's message is empty: nothing was issued
}

func (s *psgdDevBucket) deviceBuffers() []procgroup.DeviceBuffer {
	return []procgroup.DeviceBuffer{s.msg}
}

// setupDevice readies the group's device linear algebra (PrepareBLAS), allocates every
// compressed parameter's device state and uploads Q (Setup).
func (h *powerSGD) setupDevice() error {
	if err := h.dev.PrepareBLAS(); err != nil {
		return err
	}
	for _, mt := range h.mats {
		if mt == nil {
			continue
		}
		for _, x := range []struct {
			d *procgroup.DeviceBuffer
			n int
		}{{&mt.de, mt.n * mt.m}, {&mt.dp, mt.n * mt.r}, {&mt.dq, mt.m * mt.r}} {
			d, err := h.dev.AllocDevice(procgroup.Float32, x.n)
			if err != nil {
				return fmt.Errorf("parameter %d: %w", mt.index, err)
			}
			*x.d = d.On(h.stream)
			if err := h.dev.ZeroAsync(h.stream, *x.d); err != nil {
				return fmt.Errorf("parameter %d: %w", mt.index, err)
			}
		}
	}
	return h.upload()
}

// ReleaseDevice implements DeviceStateHook: it frees the device state.
func (h *powerSGD) ReleaseDevice() {
	if h.dev == nil {
		return
	}
	for _, mt := range h.mats {
		if mt == nil {
			continue
		}
		for _, d := range []*procgroup.DeviceBuffer{&mt.de, &mt.dp, &mt.dq} {
			if d.Ptr != 0 {
				_ = h.dev.FreeDevice(*d)
			}
			*d = procgroup.DeviceBuffer{}
		}
	}
}

// hostCopies allocates the host copies of the device state that checkpoints use.
func (h *powerSGD) hostCopies() {
	if h.dev == nil {
		return
	}
	for _, mt := range h.mats {
		if mt != nil && mt.e == nil {
			mt.e = make([]float32, mt.n*mt.m)
		}
	}
}

// download copies the device state into the host copies (after the work queued on the
// stream); nothing on the host path.
func (h *powerSGD) download() error {
	if h.dev == nil {
		return nil
	}
	h.hostCopies()
	for _, mt := range h.mats {
		if mt == nil {
			continue
		}
		if mt.de.Ptr == 0 {
			return fmt.Errorf("reducer: PowerSGD hook: parameter %d: the device state is released (the Reducer is closed)", mt.index)
		}
		if err := h.dev.CopyOut(mt.e, mt.de); err != nil {
			return fmt.Errorf("reducer: PowerSGD hook: parameter %d: %w", mt.index, err)
		}
		for _, f := range []struct {
			host []float64
			dev  procgroup.DeviceBuffer
		}{{mt.p, mt.dp}, {mt.q, mt.dq}} {
			tmp := make([]float32, len(f.host))
			if err := h.dev.CopyOut(tmp, f.dev); err != nil {
				return fmt.Errorf("reducer: PowerSGD hook: parameter %d: %w", mt.index, err)
			}
			for k, v := range tmp {
				f.host[k] = float64(v)
			}
		}
	}
	return nil
}

// upload copies the host copies (P and Q, and E where allocated) into the device state;
// nothing on the host path.
func (h *powerSGD) upload() error {
	if h.dev == nil {
		return nil
	}
	for _, mt := range h.mats {
		if mt == nil {
			continue
		}
		if mt.de.Ptr == 0 {
			return fmt.Errorf("reducer: PowerSGD hook: parameter %d: the device state is released (the Reducer is closed)", mt.index)
		}
		if e, ok := mt.e.([]float32); ok {
			if err := h.dev.CopyIn(mt.de, e); err != nil {
				return fmt.Errorf("reducer: PowerSGD hook: parameter %d: %w", mt.index, err)
			}
		}
		for _, f := range []struct {
			host []float64
			dev  procgroup.DeviceBuffer
		}{{mt.p, mt.dp}, {mt.q, mt.dq}} {
			tmp := make([]float32, len(f.host))
			for k, v := range f.host {
				tmp[k] = float32(v)
			}
			if err := h.dev.CopyIn(f.dev, tmp); err != nil {
				return fmt.Errorf("reducer: PowerSGD hook: parameter %d: %w", mt.index, err)
			}
		}
	}
	return nil
}

// orthSeed is the seed of a degenerate column's replacement (orthonormalize's, less the
// column and try, which OrthonormalizeAsync mixes in).
func (h *powerSGD) orthSeed(param, step int) uint64 {
	return h.o.Seed ^ uint64(param+1)*0xbf58476d1ce4e5b9 ^ uint64(step+1)*0x94d049bb133111eb
}

// devScratch returns b's device message, allocated at the layout's first launch.
func (h *powerSGD) devScratch(b *BucketView, buf procgroup.DeviceBuffer) (*psgdDevBucket, error) {
	if s, ok := b.Scratch.(*psgdDevBucket); ok {
		return s, nil
	}
	even, odd := h.msgLens(b)
	d, err := b.Device.AllocDevice(buf.Type, max(even, odd))
	if err != nil {
		return nil, err
	}
	d = d.On(b.Stream)
	s := &psgdDevBucket{msg: d, even: d.Slice(0, even), odd: d.Slice(0, odd)}
	b.Scratch = s
	return s, nil
}

// launchDevice is Launch for a device bucket (Note [PowerSGD on the device]).
func (h *powerSGD) launchDevice(ctx context.Context, pg procgroup.ProcessGroup, b *BucketView, buf procgroup.DeviceBuffer) procgroup.Work {
	fail := func(err error) procgroup.Work {
		return procgroup.Completed(fmt.Errorf("reducer: PowerSGD hook: device bucket %d: %w", b.Index, err))
	}
	if h.dev == nil {
		return procgroup.Completed(fmt.Errorf("%w: PowerSGD hook: device bucket %d, but the hook was set up for host buckets", ErrInvalidArgument, b.Index))
	}
	s, err := h.devScratch(b, buf)
	if err != nil {
		return fail(err)
	}
	step := h.step(b)
	s.plain = step < h.o.StartIter
	if s.plain {
		return pg.AllReduce(ctx, b.Buffer, procgroup.Sum)
	}
	even := (step-h.o.StartIter)%2 == 0
	st, dev := b.Stream, h.dev
	off, err := h.eachPlain(b, func(at, off, n int) error { // the uncompressed elements first
		return copyDevice(dev, st, s.msg.Slice(off, off+n), buf.Slice(at, at+n))
	})
	if err != nil {
		return fail(err)
	}
	for k, i := range b.Params {
		mt := h.mats[i]
		if mt == nil {
			continue
		}
		n, m, r := mt.n, mt.m, mt.r
		at := b.Offsets[k]
		if err := dev.ScaleAsync(st, mt.de, buf.Slice(at, at+n*m), 1, true); err != nil { // M' = M + E
			return fail(err)
		}
		if even {
			out := s.msg.Slice(off, off+n*r)
			err = dev.OrthonormalizeAsync(st, mt.dq, m, r, h.orthSeed(mt.index, step))
			if err == nil {
				err = dev.GemmAsync(st, true, false, n, r, m, 1, mt.de, m, mt.dq, m, 0, out, n)
			}
			if err == nil {
				err = dev.GemmAsync(st, false, true, m, n, r, -1, mt.dq, m, out, n, 1, mt.de, m)
			}
			off += n * r
		} else {
			out := s.msg.Slice(off, off+m*r)
			err = dev.OrthonormalizeAsync(st, mt.dp, n, r, h.orthSeed(mt.index, step))
			if err == nil {
				err = dev.GemmAsync(st, false, false, m, r, n, 1, mt.de, m, mt.dp, n, 0, out, m)
			}
			if err == nil {
				err = dev.GemmAsync(st, false, true, m, n, r, -1, out, m, mt.dp, n, 1, mt.de, m)
			}
			off += m * r
		}
		if err != nil {
			return fail(fmt.Errorf("parameter %d: %w", mt.index, err))
		}
	}
	s.empty = off == 0
	if s.empty {
		return procgroup.Completed(nil)
	}
	if even {
		return pg.AllReduce(ctx, s.even, procgroup.Sum)
	}
	return pg.AllReduce(ctx, s.odd, procgroup.Sum)
}

// copyDevice enqueues dst = src on st; an empty copy enqueues nothing.
func copyDevice(dev procgroup.Device, st procgroup.Stream, dst, src procgroup.DeviceBuffer) error {
	if src.Count == 0 {
		return nil
	}
	return dev.ScaleAsync(st, dst, src, 1, false)
}

// finishDevice is Finish for a device bucket: it enqueues the result into the bucket.
func (h *powerSGD) finishDevice(b *BucketView, buf procgroup.DeviceBuffer) error {
	s, _ := b.Scratch.(*psgdDevBucket)
	if s == nil || s.plain || s.empty {
		return nil
	}
	fail := func(err error) error {
		return fmt.Errorf("reducer: PowerSGD hook: device bucket %d: %w", b.Index, err)
	}
	even := (h.step(b)-h.o.StartIter)%2 == 0
	st, dev := b.Stream, h.dev
	off, err := h.eachPlain(b, func(at, off, n int) error {
		return copyDevice(dev, st, buf.Slice(at, at+n), s.msg.Slice(off, off+n))
	})
	if err != nil {
		return fail(err)
	}
	for k, i := range b.Params {
		mt := h.mats[i]
		if mt == nil {
			continue
		}
		n, m, r := mt.n, mt.m, mt.r
		var err error
		if even { // P = the sum of the P_w
			err = dev.ScaleAsync(st, mt.dp, s.msg.Slice(off, off+n*r), 1, false)
			off += n * r
		} else { // Q = the sum of the Q_w
			err = dev.ScaleAsync(st, mt.dq, s.msg.Slice(off, off+m*r), 1, false)
			off += m * r
		}
		if err == nil { // the result P·Qᵀ, row-major: its transpose Q·Pᵀ column-major
			at := b.Offsets[k]
			err = dev.GemmAsync(st, false, true, m, n, r, 1, mt.dq, m, mt.dp, n, 0, buf.Slice(at, at+n*m), m)
		}
		if err != nil {
			return fail(fmt.Errorf("parameter %d: %w", mt.index, err))
		}
	}
	return nil
}
