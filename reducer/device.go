package reducer

import (
	"fmt"
	"time"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/procgroup"
)

// devView is bucket.View for a device bucket.
func devView(b procgroup.DeviceBuffer, loc bucket.Loc) procgroup.DeviceBuffer {
	return b.Slice(loc.Offset, loc.Offset+loc.Len)
}

// freeDevice releases every device bucket (Close), the device scratch of the comm hooks
// (BucketView.Scratch holding a procgroup.DeviceBuffer, or a deviceScratch) and the
// hook's own device state (DeviceStateHook).
func (r *Reducer) freeDevice() {
	if r.dev == nil {
		return
	}
	for _, d := range r.retired {
		_ = r.dev.FreeDevice(d)
	}
	r.retired = nil
	for b := range r.slots {
		if ds := scratchDevice(r.slots[b].view.Scratch); ds != nil {
			for _, d := range ds {
				_ = r.dev.FreeDevice(d)
			}
			r.slots[b].view.Scratch = nil
		}
	}
	if r.hookDev != nil {
		r.hookDev.ReleaseDevice()
	}
}

// deviceScratch is a BucketView.Scratch of this package's hooks that holds device
// buffers of its own (PowerSGD's device message): the reducer treats them as it treats a
// procgroup.DeviceBuffer in Scratch.
type deviceScratch interface {
	deviceBuffers() []procgroup.DeviceBuffer
}

// scratchDevice returns the device buffers a BucketView.Scratch holds (nil if none).
func scratchDevice(s any) []procgroup.DeviceBuffer {
	switch s := s.(type) {
	case procgroup.DeviceBuffer:
		return []procgroup.DeviceBuffer{s}
	case deviceScratch:
		return s.deviceBuffers()
	}
	return nil
}

// GradViewDevice is GradView with Options.Device: parameter i's slot in its device bucket,
// on Options.Stream. The caller's kernels may read and write it on that stream between
// Finalize and the next BeginBackward.
func (r *Reducer) GradViewDevice(i int) (procgroup.DeviceBuffer, error) {
	v, err := r.GradView(i)
	if err != nil {
		return procgroup.DeviceBuffer{}, err
	}
	d, ok := v.(procgroup.DeviceBuffer)
	if !ok {
		return procgroup.DeviceBuffer{}, fmt.Errorf("%w: GradViewDevice(%d): the buckets are in host memory (Options.Device is off)", ErrInvalidArgument, i)
	}
	return d, nil
}

// GradReadyDevice is GradReady with Options.Device: grad is parameter i's gradient in device
// memory, produced on Options.Stream. It enqueues, on that stream, the copy of grad divided
// by the world size into the bucket slot (or its addition there, after an Accumulate pass)
// and launches every bucket this completes, in bucket order: the collective's stream waits,
// on the device, for the copies queued before it (Note [Device buckets]). It never waits on
// the host. grad may be overwritten by kernels queued on the stream after this call.
func (r *Reducer) GradReadyDevice(i int, grad procgroup.DeviceBuffer) error {
	t0 := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dev == nil {
		if r.closed {
			return ErrClosed
		}
		return r.failLocked(fmt.Errorf("%w: GradReadyDevice(%d) without Options.Device", ErrInvalidArgument, i))
	}
	if err := r.checkGrad(i, grad.Type, grad.Count); err != nil {
		return err
	}
	acts, err := r.m.GradReady(i)
	if err != nil {
		return r.afterMachineErr(err)
	}
	a := acts[0]
	inv := r.inv64
	if err := r.dev.ScaleAsync(r.opts.Stream, devView(r.slots[a.Bucket].dev, r.lay.Where[i]), grad, inv, a.Add); err != nil {
		return r.failLocked(fmt.Errorf("reducer: GradReadyDevice(%d): %w", i, err))
	}
	r.afterCopy(i, acts[1:], t0)
	return nil
}

// lateWork is a device bucket's collective that was still in flight when a later pass
// began (Note [Late failures]).
type lateWork struct {
	w      procgroup.Work
	iter   int // the backward pass that launched it
	bucket int
}

// Note [Late failures]: on the device path Finalize does not wait for the buckets'
// collectives (Note [Device buckets]), so those of synced pass k may still be in flight
// when pass k+1 begins, and fail later. BeginBackward moves the ones still in flight to
// Reducer.late before it clears the slots, and every BeginBackward and device Finalize
// after that checks them: one that has failed fails the Reducer with its error, one that
// has succeeded is dropped. So a failure reaches the trainer at the first such call after
// it happens (and the group's watchdog aborts the group meanwhile); Close waits for them
// too before it frees the buckets. The list is reused: no allocation once it has grown to
// the buckets in flight. The host path needs none of this: its Finalize waits for every
// bucket's collective and reports its error.

// checkLate drops the collectives of Reducer.late that have completed, and returns the
// error of the first that failed. r.mu must be held.
func (r *Reducer) checkLate() error {
	kept := r.late[:0]
	for _, l := range r.late {
		if !isDone(l.w) {
			kept = append(kept, l)
			continue
		}
		if err := l.w.Err(); err != nil {
			return fmt.Errorf("reducer: backward %d: bucket %d (found at backward %d): %w", l.iter, l.bucket, r.m.Iter(), err)
		}
	}
	clear(r.late[len(kept):])
	r.late = kept
	return nil
}

func isDone(w procgroup.Work) bool {
	select {
	case <-w.Done():
		return true
	default:
		return false
	}
}
