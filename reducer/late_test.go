package reducer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// lateGroup is one rank of a device group whose collectives on device buckets complete only
// when the test says (Complete), as NCCL's do on the communication stream, long after the
// host enqueued them: its Device enqueues nothing and WaitWork orders nothing, returning a
// Work's error only if it has already failed, as procgroup.Device promises.
type lateGroup struct {
	nopGroup
	mu      sync.Mutex
	works   []*procgroup.Future // the device all-reduces, in issue order
	pool    []*procgroup.Future // futures made beforehand, for the allocation count
	next    procgroup.DevicePtr
	frees   int
	aborted error
}

func newLateGroup() *lateGroup {
	return &lateGroup{nopGroup: *newNopGroup(2), next: 1 << 20}
}

func (g *lateGroup) AllReduce(ctx context.Context, buf any, op procgroup.ReduceOp) procgroup.Work {
	if _, ok := buf.(procgroup.DeviceBuffer); !ok {
		return g.done
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	var f *procgroup.Future
	if n := len(g.pool); n > 0 {
		f, g.pool = g.pool[n-1], g.pool[:n-1]
	} else {
		f = procgroup.NewFuture()
	}
	g.works = append(g.works, f)
	return f
}

// issued is the number of device all-reduces so far.
func (g *lateGroup) issued() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.works)
}

// complete completes the device all-reduces [from, to) with err.
func (g *lateGroup) complete(from, to int, err error) {
	g.mu.Lock()
	ws := g.works[from:to]
	g.mu.Unlock()
	for _, f := range ws {
		f.Complete(err)
	}
}

func (g *lateGroup) Abort(err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.aborted == nil {
		g.aborted = err
	}
}

func (g *lateGroup) AllocDevice(dt procgroup.DType, n int) (procgroup.DeviceBuffer, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	b := procgroup.DeviceBuffer{Ptr: g.next, Type: dt, Count: n}
	g.next += procgroup.DevicePtr(b.Bytes() + 256)
	return b, nil
}

func (g *lateGroup) FreeDevice(procgroup.DeviceBuffer) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.frees++
	return nil
}

func (g *lateGroup) freed() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.frees
}

func (g *lateGroup) ScaleAsync(procgroup.Stream, procgroup.DeviceBuffer, procgroup.DeviceBuffer, float64, bool) error {
	return nil
}
func (g *lateGroup) ConvertAsync(procgroup.Stream, procgroup.DeviceBuffer, procgroup.DeviceBuffer) error {
	return nil
}
func (g *lateGroup) ZeroAsync(procgroup.Stream, procgroup.DeviceBuffer) error { return nil }
func (g *lateGroup) NewEvent() (procgroup.Event, error)                       { return 1, nil }
func (g *lateGroup) DestroyEvent(procgroup.Event) error                       { return nil }
func (g *lateGroup) RecordEvent(procgroup.Event, procgroup.Stream) error      { return nil }
func (g *lateGroup) WaitEvent(procgroup.Stream, procgroup.Event) error        { return nil }
func (g *lateGroup) SyncStream(procgroup.Stream) error                        { return nil }
func (g *lateGroup) WaitWork(_ procgroup.Stream, w procgroup.Work) error {
	if isDone(w) {
		return w.Err()
	}
	return nil
}

var _ procgroup.Device = (*lateGroup)(nil)

// TestDeviceLateFailure: on the device path Finalize does not wait for the buckets'
// collectives, so the all-reduces of synced step k may still be in flight when step k+1
// begins. One of them fails later: right after step k+1's BeginBackward, after its
// Finalize, after step k+2's BeginBackward, or after step k+2's Finalize. The failure must
// reach the trainer by the next call that returns an error (BeginBackward or Finalize),
// fail the Reducer (every later call returns it) and abort the group; it used to be
// dropped, since BeginBackward checked only the collectives already complete, and only
// those of the step just before.
func TestDeviceLateFailure(t *testing.T) {
	boom := errors.New("peer lost mid all-reduce")
	for when := range 4 {
		t.Run(fmt.Sprint(when), func(t *testing.T) {
			ctx := testCtx(t)
			g := newLateGroup()
			grads := make([]procgroup.DeviceBuffer, 3)
			params := make([]Param, len(grads))
			for i := range grads {
				grads[i], _ = g.AllocDevice(procgroup.Float32, 1000)
				params[i] = Param{Name: fmt.Sprintf("w%d", i), Grad: grads[i]}
			}
			// 4000-byte caps: one bucket per parameter.
			red, err := New(g, params, Options{Device: true, Stream: 7, BucketCapMB: 4000.0 / (1 << 20), FirstBucketCapMB: 4000.0 / (1 << 20)})
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				g.complete(0, g.issued(), nil) // let Close drain
				red.Close()
			}()
			begin := func() error { return red.BeginBackward(Sync) }
			backward := func() error {
				for i := len(grads) - 1; i >= 0; i-- {
					if err := red.GradReadyDevice(i, grads[i]); err != nil {
						return err
					}
				}
				return red.Finalize(ctx)
			}
			// Step 1 (and its rebuild): its collectives complete at once.
			if err := begin(); err != nil {
				t.Fatal(err)
			}
			if err := backward(); err != nil {
				t.Fatal(err)
			}
			g.complete(0, g.issued(), nil)
			// Step k = 2: its collectives stay in flight.
			from := g.issued()
			if err := begin(); err != nil {
				t.Fatal(err)
			}
			if err := backward(); err != nil {
				t.Fatal(err)
			}
			to := g.issued()
			if to-from != len(grads) {
				t.Fatalf("step 2 issued %d all-reduces, want %d", to-from, len(grads))
			}
			// Steps k+1 and k+2, with the failure of one of step k's all-reduces injected
			// after the call numbered when; the rest of step k's complete fine.
			calls := []func() error{begin, backward, begin, backward, begin}
			var got error
			for k, call := range calls {
				if err := call(); err != nil {
					got = err
					if k != when+1 {
						t.Fatalf("failure after call %d: call %d returned %v, want the next call to report it", when, k, err)
					}
					break
				}
				if k == when {
					g.complete(from+1, from+2, boom)
					g.complete(from, from+1, nil)
					g.complete(from+2, to, nil)
				}
			}
			if !errors.Is(got, boom) {
				t.Fatalf("failure after call %d: the steps after returned %v, want the collective's error", when, got)
			}
			t.Logf("failure after call %d reported: %v", when, got)
			if err := red.BeginBackward(Sync); !errors.Is(err, boom) {
				t.Fatalf("the call after: %v, want the same error", err)
			}
			g.mu.Lock()
			aborted := g.aborted
			g.mu.Unlock()
			if !errors.Is(aborted, boom) {
				t.Fatalf("group aborted with %v, want the collective's error", aborted)
			}
		})
	}
}

// TestDeviceCloseWaitsLate: Close frees the device buckets only once every collective
// that may still use them has completed, those of earlier steps too.
func TestDeviceCloseWaitsLate(t *testing.T) {
	ctx := testCtx(t)
	g := newLateGroup()
	grad, _ := g.AllocDevice(procgroup.Float32, 1000)
	red, err := New(g, []Param{{Name: "w", Grad: grad}}, Options{Device: true, Stream: 7})
	if err != nil {
		t.Fatal(err)
	}
	step := func() error {
		if err := red.BeginBackward(Sync); err != nil {
			return err
		}
		if err := red.GradReadyDevice(0, grad); err != nil {
			return err
		}
		return red.Finalize(ctx)
	}
	if err := step(); err != nil { // the rebuild's step
		t.Fatal(err)
	}
	g.complete(0, g.issued(), nil)
	if err := step(); err != nil { // its all-reduce stays in flight
		t.Fatal(err)
	}
	late := g.issued()
	if err := red.BeginBackward(Accumulate); err != nil { // no collective
		t.Fatal(err)
	}
	closed := make(chan struct{})
	go func() {
		red.Close()
		close(closed)
	}()
	time.Sleep(50 * time.Millisecond)
	if n := g.freed(); n != 0 {
		g.complete(0, late, nil)
		<-closed
		t.Fatalf("Close freed %d device buffers while step 2's all-reduce was in flight", n)
	}
	g.complete(0, late, nil)
	<-closed
	if g.freed() == 0 {
		t.Fatal("Close freed no device buffer")
	}
}

// TestDeviceSteadyStateAllocs: on the device path, with every step's collectives still in
// flight when the next step begins (and completing during it), a step allocates nothing
// once the list of late collectives has grown (Note [Late failures]).
func TestDeviceSteadyStateAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are not meaningful under the race detector")
	}
	ctx := context.Background()
	g := newLateGroup()
	grads := make([]procgroup.DeviceBuffer, 8)
	params := make([]Param, len(grads))
	for i := range grads {
		grads[i], _ = g.AllocDevice(procgroup.Float32, 1000)
		params[i] = Param{Name: fmt.Sprintf("w%d", i), Grad: grads[i]}
	}
	red, err := New(g, params, Options{Device: true, Stream: 7, BucketCapMB: 8000.0 / (1 << 20), FirstBucketCapMB: 4000.0 / (1 << 20)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		g.complete(0, g.issued(), nil)
		red.Close()
	}()
	prev := 0
	step := func() {
		if err := red.BeginBackward(Sync); err != nil {
			t.Fatal(err)
		}
		for i := len(grads) - 1; i >= 0; i-- {
			if err := red.GradReadyDevice(i, grads[i]); err != nil {
				t.Fatal(err)
			}
		}
		if err := red.Finalize(ctx); err != nil {
			t.Fatal(err)
		}
		g.complete(prev, g.issued()-len(red.Buckets()), nil) // the step before's, now
		prev = g.issued() - len(red.Buckets())
	}
	for range 3 {
		step()
	}
	g.mu.Lock()
	for range 40 * len(grads) {
		g.pool = append(g.pool, procgroup.NewFuture())
	}
	g.works = append(make([]*procgroup.Future, 0, len(g.works)+50*len(grads)), g.works...)
	g.mu.Unlock()
	if a := testing.AllocsPerRun(20, step); a != 0 {
		t.Errorf("%v allocations per step", a)
	}
	red.mu.Lock()
	n := len(red.late)
	red.mu.Unlock()
	if n != len(red.slots) {
		t.Fatalf("%d late collectives after a step, want the %d of the step before: the count did not cover them", n, len(red.slots))
	}
}
