package reducer

import (
	"fmt"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/procgroup"
)

// Note [Bucket memory]: a layout's host buckets of one element type are slices of one
// buffer (hostMem), each from a 64-byte boundary, so that the buffer's size is the same for
// every layout: the type's gradients plus 64 bytes per parameter. A rebuild needs the new
// buffer while it copies from the old one; the one before the old one is free by then, and
// while the Machine owes another rebuild it is kept and reused (cleared) instead of
// allocated, so that after the second rebuild no bucket memory is new. Under the auto
// sizing's three rebuilds (Note [Auto buckets]) fresh buckets meant fresh pages: at L=4
// h=512, two ranks on one host, three launches each (2026-12-04), steps 2 and 3 took
// 734–880 ms with new buffers and 507–679 ms reusing them, and the first step with the
// chosen layout took 37–139 ms longer than the median of the later ones (26–80 ms reusing
// them). Once no rebuild is owed the spare is dropped, so a job holds one layout's buckets,
// as before. The auto sizing's probe (before its first rebuild) runs on the memory that the
// rebuild then takes, held meanwhile as the spare. It used to run on a buffer of its own.
// At L=4 h=512 that buffer left each rank 50 MB larger for the rest of the job, and on
// the testbed at 10 Gbit/s auto's steps ran 1.03-1.04x those of cap 25 in the same layout
// (docs/results/2026-12-06-auto-probe-memory.md).

// hostMem is one layout's host memory for the buckets of one element type: from the group's
// BufferAllocator (shared), or an ordinary slice.
type hostMem struct {
	f32    []float32
	f64    []float64
	shared bool
}

// release gives shared memory back to the group; an ordinary slice is left to the collector.
func (m *hostMem) release(alloc procgroup.BufferAllocator) {
	if m.shared {
		if m.f32 != nil {
			alloc.FreeBuffer(m.f32)
		} else {
			alloc.FreeBuffer(m.f64)
		}
	}
	*m = hostMem{}
}

// bucketAlign is the boundary, in bytes, at which Note [Bucket memory] starts each bucket.
const bucketAlign = 64

// setLayout allocates the flat buffers of lay; in bucket-view mode it carries the gradients
// over from the old buffers, so that the views hold the same values after the rebuild.
// Device buckets are zeroed and carried over on the compute stream; the old ones are kept
// until Close (queued work may still use them, and freeing them now would need a host
// synchronisation).
func (r *Reducer) setLayout(lay *bucket.Layout) error {
	slots := make([]slot, len(lay.Buckets))
	var mem [2]hostMem
	var used [2]int // elements of mem handed out
	if r.dev == nil {
		n := r.hostElems()
		for t := range mem {
			if n[t] > 0 {
				mem[t] = r.hostMemFor(t, n[t])
			}
		}
	}
	for b, bk := range lay.Buckets {
		s := &slots[b]
		s.view = BucketView{Index: b, DType: procgroup.DType(bk.DType), Params: bk.Params, Offsets: bk.Offsets}
		switch {
		case r.dev != nil:
			d, err := r.dev.AllocDevice(procgroup.DType(bk.DType), bk.Len)
			if err == nil {
				d.Stream = r.opts.Stream
				err = r.dev.ZeroAsync(r.opts.Stream, d)
				r.retired = append(r.retired, d) // freed at Close
			}
			if err != nil {
				return fmt.Errorf("reducer: bucket %d (%d bytes) on the device: %w", b, bk.Bytes(), err)
			}
			s.dev = d
			s.view.Buffer, s.view.Device, s.view.Stream = d, r.dev, r.opts.Stream
		case bk.DType == procgroup.Float32:
			u, n := &used[0], r.padded(bk.Len)
			s.f32 = mem[0].f32[*u : *u+n : *u+n]
			*u += (n + bucketAlign/4 - 1) &^ (bucketAlign/4 - 1)
			s.view.Buffer = s.f32
		default:
			u, n := &used[1], r.padded(bk.Len)
			s.f64 = mem[1].f64[*u : *u+n : *u+n]
			*u += (n + bucketAlign/8 - 1) &^ (bucketAlign/8 - 1)
			s.view.Buffer = s.f64
		}
		if r.sh != nil {
			s.sh = r.sh.newShardBufs(bk.Len, bk.DType == procgroup.Float64, r.pg.Size())
		}
	}
	if r.lay != nil {
		for b := range r.slots {
			r.retired = append(r.retired, scratchDevice(r.slots[b].view.Scratch)...)
		}
		for i, from := range r.lay.Where {
			to, old, neu := lay.Where[i], &r.slots[r.lay.Where[i].Bucket], &slots[lay.Where[i].Bucket]
			switch {
			case r.dev != nil:
				if err := r.dev.ScaleAsync(r.opts.Stream, devView(neu.dev, to), devView(old.dev, from), 1, false); err != nil {
					return fmt.Errorf("reducer: rebuild: %w", err)
				}
			case old.f32 != nil:
				copy(bucket.View(neu.f32, to), bucket.View(old.f32, from))
			default:
				copy(bucket.View(neu.f64, to), bucket.View(old.f64, from))
			}
		}
	}
	// No collective uses the old buffers now; their views expire with the generation.
	for t := range r.mem {
		if r.m.rebuilds > 0 {
			r.spare[t] = r.mem[t]
		} else {
			r.mem[t].release(r.alloc)
		}
	}
	r.mem = mem
	r.lay, r.slots = lay, slots
	return nil
}

// hostElems is the number of elements of each type (float32, float64) of a layout's host
// bucket memory (Note [Bucket memory]): the same for every layout. With
// Options.PadBuckets each bucket (at most one per parameter) may take up to PadBuckets−1
// elements more.
func (r *Reducer) hostElems() [2]int {
	var n [2]int
	for _, p := range r.bparams {
		t := typeIndex(p.DType)
		n[t] += p.Len + bucketAlign/p.DType.Size() + max(r.opts.PadBuckets-1, 0)
	}
	return n
}

// padded is a bucket's buffer length for n elements of gradients (Options.PadBuckets).
func (r *Reducer) padded(n int) int {
	if k := r.opts.PadBuckets; k > 1 {
		return (n + k - 1) / k * k
	}
	return n
}

// typeIndex is a host element type's index in Reducer.mem.
func typeIndex(dt procgroup.DType) int {
	if dt == procgroup.Float32 {
		return 0
	}
	return 1
}

// hostMemFor returns n elements of type t (0: float32, 1: float64) for a layout's buckets:
// the spare if it has them (cleared), else new memory (Note [Bucket memory]).
func (r *Reducer) hostMemFor(t, n int) hostMem {
	if sp := r.spare[t]; len(sp.f32) == n || len(sp.f64) == n {
		r.spare[t] = hostMem{}
		clear(sp.f32)
		clear(sp.f64)
		return sp
	}
	r.spare[t].release(r.alloc)
	var m hostMem
	if t == 0 {
		m.f32, m.shared = hostBuf[float32](r, procgroup.Float32, n)
	} else {
		m.f64, m.shared = hostBuf[float64](r, procgroup.Float64, n)
	}
	return m
}

// hostBuf returns n elements for a host buffer that is all-reduced (a bucket): from the
// group's allocator when it gives them (gloo: its shared arena, all-reduced in place; every
// rank allocates the same buckets in the same order), an ordinary slice otherwise; shared
// says which.
func hostBuf[T float32 | float64](r *Reducer, dt procgroup.DType, n int) (buf []T, shared bool) {
	if r.alloc != nil {
		if b, err := r.alloc.AllocBuffer(dt, n); err == nil && b != nil {
			if s, ok := b.([]T); ok {
				return s, true
			}
			r.alloc.FreeBuffer(b)
		}
	}
	return make([]T, n), false
}

// freeShared gives the buckets' shared memory back to the group, and the spare's.
func (r *Reducer) freeShared() {
	for t := range r.mem {
		r.mem[t].release(r.alloc)
		r.spare[t].release(r.alloc)
	}
}

// GradView returns parameter i's slot in its bucket: with GradientAsBucketView, the
// parameter's gradient itself (averaged after Finalize). It is a []float32 or []float64,
// valid until the Generation changes (in the first synced Finalize, and with AutoBucketCap
// in the second and third too); take it again after such a Finalize. The caller may read and write it between Finalize and the next
// BeginBackward only. After Close it fails with ErrClosed.
func (r *Reducer) GradView(i int) (any, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, ErrClosed
	}
	if i < 0 || i >= len(r.params) {
		return nil, fmt.Errorf("%w: GradView(%d): parameter index outside [0, %d)", ErrInvalidArgument, i, len(r.params))
	}
	loc := r.lay.Where[i]
	switch s := &r.slots[loc.Bucket]; {
	case r.dev != nil:
		return devView(s.dev, loc), nil
	case s.f32 != nil:
		return bucket.View(s.f32, loc), nil
	default:
		return bucket.View(s.f64, loc), nil
	}
}

// ScratchBucket lends bucket b's host buffer of float32 elements (padded as
// Options.PadBuckets asks) as scratch memory, between passes: ok only when no backward is
// running, no Accumulate pass left gradients in a bucket since the last synced Finalize, and
// the buffer is the reducer's own (host buckets, without GradientAsBucketView or Shards).
// The next pass's gradients overwrite every slot before anything reads it (Note
// [Accumulation window] in machine.go), so what the borrower writes is never reduced; it
// must give the padding back as zeros, and stop using the buffer before the next
// BeginBackward. Package ddp's ZeRO gathers the stepped parameters into it, so as not to
// hold a second copy of the model.
func (r *Reducer) ScratchBucket(b int) (buf []float32, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed || r.dev != nil || r.opts.GradientAsBucketView || r.sh != nil || b < 0 || b >= len(r.slots) ||
		r.m.phase != phaseIdle || r.m.Accumulated() {
		return nil, false
	}
	s := &r.slots[b]
	return s.f32, s.f32 != nil
}

// scaleInto sets dst to src·inv, or adds src·inv to it. With one rank inv is exactly 1.
func scaleInto[T float32 | float64](dst, src []T, inv T, add bool) {
	src = src[:len(dst)]
	switch {
	case add:
		for k, v := range src {
			dst[k] += v * inv
		}
	case inv == 1:
		copy(dst, src)
	default:
		for k, v := range src {
			dst[k] = v * inv
		}
	}
}
