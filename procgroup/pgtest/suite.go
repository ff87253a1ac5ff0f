package pgtest

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// NewGroups creates a fresh group of the given size (one ProcessGroup per rank, Group r of
// rank r, all in this process) and returns them; the suite closes them. It reports setup
// failures with t.Fatal. Cleanups it registers with t run when the suite is done with the
// groups.
type NewGroups func(t testing.TB, size int) []procgroup.ProcessGroup

// SuiteOptions tune Run.
type SuiteOptions struct {
	// Sizes are the world sizes to test (default 1, 2, 3, 4, 5).
	Sizes []int
	// Large is the element count of the "large" cases (default 1<<18, or 1<<13 when Short).
	Large int
	// Short drops the larger small counts and shrinks the default Large (for go test -short).
	Short bool
	// Timeout bounds each batch of collectives (default 2 minutes): a work that has not
	// completed by then fails the test (and the groups are aborted) instead of hanging.
	Timeout time.Duration
	// SkipLeakCheck turns off the check, after each world size, that every goroutine the
	// groups started has exited (for backends that keep process-wide goroutines; such a
	// backend should check leaks in its own TestMain).
	SkipLeakCheck bool
}

func (o *SuiteOptions) fill() {
	if len(o.Sizes) == 0 {
		o.Sizes = []int{1, 2, 3, 4, 5}
	}
	if o.Large <= 0 {
		o.Large = 1 << 18
		if o.Short {
			o.Large = 1 << 13
		}
	}
	if o.Timeout <= 0 {
		o.Timeout = 2 * time.Minute
	}
}

// Run is the conformance suite of procgroup.ProcessGroup. For each world size it creates a
// group with newGroups, runs every collective × element type × reduce op over counts 0, 1,
// odd, not a multiple of the world size, and large, on random data, comparing every rank's
// result element by element with a float64 (int64 for integers) reference computed from all
// ranks' inputs; AllGather and ReduceScatter in place too; Broadcast from every root; 50
// mixed works in flight; invalid arguments;
// then, on fresh groups, Close and Abort with works pending. Each rank runs on its own
// goroutine, as it would in its own process.
func Run(t *testing.T, newGroups NewGroups, opts SuiteOptions) {
	opts.fill()
	for _, n := range opts.Sizes {
		if n < 1 {
			t.Fatalf("pgtest: world size %d in SuiteOptions.Sizes", n)
		}
		var leakOpt goleak.Option
		if !opts.SkipLeakCheck {
			leakOpt = goleak.IgnoreCurrent()
		}
		t.Run(fmt.Sprintf("size=%d", n), func(t *testing.T) {
			s := &suite{newGroups: newGroups, opts: opts, n: n}
			s.runCorrectness(t)
			t.Run("close-pending", s.testClosePending)
			t.Run("abort-pending", s.testAbortPending)
		})
		if !opts.SkipLeakCheck {
			if err := goleak.Find(leakOpt); err != nil {
				t.Errorf("size=%d: goroutines left after the groups were closed: %v", n, err)
			}
		}
	}
}

type suite struct {
	newGroups NewGroups
	opts      SuiteOptions
	n         int
}

// start creates a group of s.n ranks whose Close the suite ensures at t's end.
func (s *suite) start(t *testing.T) []procgroup.ProcessGroup {
	t.Helper()
	gs := s.newGroups(t, s.n)
	if len(gs) != s.n {
		t.Fatalf("NewGroups(%d) returned %d groups", s.n, len(gs))
	}
	for r, g := range gs {
		if g == nil {
			t.Fatalf("NewGroups(%d): group %d is nil", s.n, r)
		}
		if g.Rank() != r || g.Size() != s.n {
			t.Fatalf("NewGroups(%d): group %d is rank %d of %d, want rank %d of %d",
				s.n, r, g.Rank(), g.Size(), r, s.n)
		}
	}
	t.Cleanup(func() { s.closeAll(t, gs) })
	return gs
}

// closeAll closes every group concurrently; a Close that does not return in time fails the
// test and the groups are aborted.
func (s *suite) closeAll(t testing.TB, gs []procgroup.ProcessGroup) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	for _, g := range gs {
		wg.Go(func() { _ = g.Close() })
	}
	go func() { wg.Wait(); close(done) }()
	timer := time.NewTimer(s.opts.Timeout)
	defer timer.Stop()
	select {
	case <-done:
	case <-timer.C:
		t.Errorf("Close did not return within %v", s.opts.Timeout)
		for _, g := range gs {
			g.Abort(errors.New("pgtest: Close hung"))
		}
		<-done
	}
}

// rng returns a generator seeded by name, so every run sees the same data.
func rng(name string) *rand.Rand {
	h := fnv.New64a()
	h.Write([]byte(name))
	return rand.New(rand.NewPCG(h.Sum64(), 0x9e3779b97f4a7c15))
}

// coll is one collective with every rank's arguments and the means to check its results.
type coll struct {
	kind  procgroup.CollectiveOp
	dt    procgroup.DType
	op    procgroup.ReduceOp
	root  int
	count int   // as Record.Count
	ins   []any // by rank: the inputs, kept intact for the reference
	bufs  []any // by rank: the buffer the collective writes
	// inPlace (AllGather and ReduceScatter): the input is slot r of the output (AllGather),
	// or the output is block r of the input, work (ReduceScatter), as NCCL allows.
	inPlace bool
	work    []any
}

func (c *coll) String() string {
	return Record{Op: c.kind, DType: c.dt, Count: c.count, Root: c.root, ReduceOp: c.op}.String()
}

// newColl draws every rank's inputs (and fills separate outputs with garbage, to see them
// overwritten).
func newColl(r *rand.Rand, n int, kind procgroup.CollectiveOp, dt procgroup.DType, op procgroup.ReduceOp, root, count int) *coll {
	c := &coll{kind: kind, dt: dt, op: op, root: root, count: count}
	for range n {
		var in, buf any
		switch kind {
		case procgroup.OpAllReduce:
			in = fill(r, dt, op, count)
			buf = clone(in)
		case procgroup.OpBroadcast:
			in = fill(r, dt, 0, count)
			buf = clone(in)
		case procgroup.OpAllGather:
			in = fill(r, dt, 0, count)
			buf = garbage(dt, n*count)
		case procgroup.OpReduceScatter:
			in = fill(r, dt, op, n*count)
			buf = garbage(dt, count)
		}
		c.ins = append(c.ins, in)
		c.bufs = append(c.bufs, buf)
	}
	return c
}

// newCollInPlace is newColl for AllGather and ReduceScatter in place (coll.inPlace).
func newCollInPlace(r *rand.Rand, n int, kind procgroup.CollectiveOp, dt procgroup.DType, op procgroup.ReduceOp, count int) *coll {
	c := newColl(r, n, kind, dt, op, 0, count)
	c.inPlace = true
	for k := range n {
		switch kind {
		case procgroup.OpAllGather:
			copyAt(c.bufs[k], c.ins[k], k*count)
		case procgroup.OpReduceScatter:
			c.work = append(c.work, clone(c.ins[k]))
			c.bufs[k] = procgroup.SliceBuffer(c.work[k], k*count, (k+1)*count)
		}
	}
	return c
}

// copyAt copies src into dst from element at (host buffers of one element type).
func copyAt(dst, src any, at int) {
	_, n, _ := procgroup.DTypeOf(src)
	d, _, _, _ := kernels.Bytes(procgroup.SliceBuffer(dst, at, at+n))
	b, _, _, _ := kernels.Bytes(src)
	copy(d, b)
}

func clone(b any) any {
	switch b := b.(type) {
	case []float32:
		return append([]float32(nil), b...)
	case []float64:
		return append([]float64(nil), b...)
	case []int32:
		return append([]int32(nil), b...)
	case []int64:
		return append([]int64(nil), b...)
	case []procgroup.BF16:
		return append([]procgroup.BF16(nil), b...)
	case []procgroup.F16:
		return append([]procgroup.F16(nil), b...)
	}
	panic(fmt.Sprintf("pgtest: clone of %T", b))
}

func (c *coll) issue(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
	r := pg.Rank()
	switch c.kind {
	case procgroup.OpAllReduce:
		return pg.AllReduce(ctx, c.bufs[r], c.op)
	case procgroup.OpBroadcast:
		return pg.Broadcast(ctx, c.bufs[r], c.root)
	case procgroup.OpAllGather:
		if c.inPlace {
			return pg.AllGather(ctx, c.bufs[r], procgroup.SliceBuffer(c.bufs[r], r*c.count, (r+1)*c.count))
		}
		return pg.AllGather(ctx, c.bufs[r], c.ins[r])
	case procgroup.OpReduceScatter:
		if c.inPlace {
			return pg.ReduceScatter(ctx, c.bufs[r], c.work[r], c.op)
		}
		return pg.ReduceScatter(ctx, c.bufs[r], c.ins[r], c.op)
	}
	return pg.Barrier(ctx)
}

// check compares the results of the ranks in ok (those whose work succeeded) with the
// reference.
func (c *coll) check(ok []bool) error {
	var d diffs
	switch c.kind {
	case procgroup.OpBroadcast:
		want := bits(c.ins[c.root])
		for r, b := range c.bufs {
			if ok[r] {
				checkBits(&d, r, b, want)
			}
		}
	case procgroup.OpAllGather:
		var want []uint64
		for _, in := range c.ins {
			want = append(want, bits(in)...)
		}
		for r, b := range c.bufs {
			if ok[r] {
				checkBits(&d, r, b, want)
			}
		}
	case procgroup.OpAllReduce, procgroup.OpReduceScatter:
		var wantF, tolF []float64
		var wantI []int64
		if isInt(c.dt) {
			ins := make([][]int64, len(c.ins))
			for r, in := range c.ins {
				ins[r] = ints(in)
			}
			wantI = refInt(c.op, ins)
		} else {
			ins := make([][]float64, len(c.ins))
			for r, in := range c.ins {
				ins[r] = floats(in)
			}
			wantF, tolF = refFloat(c.dt, c.op, ins)
		}
		for r, b := range c.bufs {
			off := 0
			if c.kind == procgroup.OpReduceScatter {
				off = r * c.count
			}
			if ok[r] {
				checkReduced(&d, r, b, wantF, tolF, wantI, off)
			}
		}
	}
	return d.err()
}

// runRanks runs f on every rank's goroutine and waits for all of them.
func runRanks(gs []procgroup.ProcessGroup, f func(rank int, pg procgroup.ProcessGroup)) {
	var wg sync.WaitGroup
	for r, pg := range gs {
		wg.Go(func() { f(r, pg) })
	}
	wg.Wait()
}

// batch issues every coll on every rank before waiting on any, waits for them (last first),
// and checks every result. Works that fail are reported; a work that does not complete
// within the timeout aborts the groups, so that nothing hangs.
func (s *suite) batch(t *testing.T, gs []procgroup.ProcessGroup, colls []*coll) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), s.opts.Timeout)
	defer cancel()
	errs := make([][]error, len(gs)) // by rank, by coll
	runRanks(gs, func(rank int, pg procgroup.ProcessGroup) {
		works := make([]procgroup.Work, len(colls))
		for i, c := range colls {
			works[i] = c.issue(context.Background(), pg)
			if works[i] == nil {
				errs[rank] = append(errs[rank], fmt.Errorf("%v returned a nil Work", c))
				return
			}
		}
		errs[rank] = make([]error, len(colls))
		for i := len(works) - 1; i >= 0; i-- {
			if err := works[i].Wait(ctx); err != nil {
				if ctx.Err() != nil {
					err = fmt.Errorf("did not complete within %v (the groups are aborted): %w", s.opts.Timeout, err)
					for _, g := range gs {
						g.Abort(err)
					}
				}
				errs[rank][i] = err
			}
		}
	})
	for rank, es := range errs {
		if len(es) != len(colls) {
			t.Fatalf("rank %d: %v", rank, es)
		}
	}
	for i, c := range colls {
		ok := make([]bool, len(gs))
		for rank := range gs {
			if err := errs[rank][i]; err != nil {
				t.Errorf("rank %d: work %d (%v): %v", rank, i, c, err)
			} else {
				ok[rank] = true
			}
		}
		if err := c.check(ok); err != nil {
			t.Errorf("work %d (%v): %v", i, c, err)
		}
	}
}

// counts are the element counts of the small cases: 0, 1, odd, and not a multiple of any
// world size from 2 to 5 (1003 = 17·59); Short keeps the small ones.
func (s *suite) counts() []int {
	if s.opts.Short {
		return []int{0, 1, 37}
	}
	return []int{0, 1, 37, 1003}
}

// runCorrectness runs the result-checking cases on one group.
func (s *suite) runCorrectness(t *testing.T) {
	gs := s.start(t)
	n := s.n
	for _, dt := range procgroup.DTypes {
		t.Run("allreduce/"+dt.String(), func(t *testing.T) {
			r := rng(t.Name())
			var cs []*coll
			for _, op := range procgroup.ReduceOps {
				for _, count := range s.counts() {
					if count == 0 && op != procgroup.Sum {
						continue
					}
					cs = append(cs, newColl(r, n, procgroup.OpAllReduce, dt, op, 0, count))
				}
			}
			cs = append(cs, newColl(r, n, procgroup.OpAllReduce, dt, procgroup.Sum, 0, 64*n)) // a multiple of n
			s.batch(t, gs, cs)
		})
	}
	for _, dt := range procgroup.DTypes {
		t.Run("broadcast/"+dt.String(), func(t *testing.T) {
			r := rng(t.Name())
			var cs []*coll
			counts := s.counts()
			for root := range n {
				for _, count := range []int{1, counts[len(counts)-1]} {
					cs = append(cs, newColl(r, n, procgroup.OpBroadcast, dt, 0, root, count))
				}
			}
			cs = append(cs, newColl(r, n, procgroup.OpBroadcast, dt, 0, n-1, 0))
			cs = append(cs, newColl(r, n, procgroup.OpBroadcast, dt, 0, n/2, 37))
			s.batch(t, gs, cs)
		})
	}
	for _, dt := range procgroup.DTypes {
		t.Run("allgather/"+dt.String(), func(t *testing.T) {
			r := rng(t.Name())
			var cs []*coll
			for _, count := range s.counts() {
				cs = append(cs, newColl(r, n, procgroup.OpAllGather, dt, 0, 0, count),
					newCollInPlace(r, n, procgroup.OpAllGather, dt, 0, count))
			}
			s.batch(t, gs, cs)
		})
	}
	for _, dt := range procgroup.DTypes {
		t.Run("reducescatter/"+dt.String(), func(t *testing.T) {
			r := rng(t.Name())
			var cs []*coll
			for _, op := range procgroup.ReduceOps {
				for _, count := range []int{1, 37} {
					cs = append(cs, newColl(r, n, procgroup.OpReduceScatter, dt, op, 0, count))
				}
				cs = append(cs, newCollInPlace(r, n, procgroup.OpReduceScatter, dt, op, 37))
			}
			counts := s.counts()
			cs = append(cs, newColl(r, n, procgroup.OpReduceScatter, dt, procgroup.Sum, 0, 0))
			cs = append(cs, newColl(r, n, procgroup.OpReduceScatter, dt, procgroup.Avg, 0, counts[len(counts)-1]))
			s.batch(t, gs, cs)
		})
	}
	t.Run("large", func(t *testing.T) {
		r := rng(t.Name())
		L := s.opts.Large
		s.batch(t, gs, []*coll{
			newColl(r, n, procgroup.OpAllReduce, procgroup.Float32, procgroup.Sum, 0, L),
			newColl(r, n, procgroup.OpAllReduce, procgroup.BFloat16, procgroup.Avg, 0, L+1),
			newColl(r, n, procgroup.OpBroadcast, procgroup.Float32, 0, n-1, L),
			newColl(r, n, procgroup.OpAllGather, procgroup.Float32, 0, 0, L/n+1),
			newColl(r, n, procgroup.OpReduceScatter, procgroup.Float32, procgroup.Sum, 0, L/n+1),
			newCollInPlace(r, n, procgroup.OpAllGather, procgroup.Float32, 0, L/n+1),
			newCollInPlace(r, n, procgroup.OpReduceScatter, procgroup.Float32, procgroup.Avg, L/n+1),
		})
	})
	t.Run("barrier", func(t *testing.T) { s.testBarrier(t, gs) })
	t.Run("in-flight", func(t *testing.T) {
		// 50 works of every kind, element type, op and root, issued before any is waited on.
		r := rng(t.Name())
		kinds := []procgroup.CollectiveOp{procgroup.OpAllReduce, procgroup.OpBroadcast, procgroup.OpAllGather, procgroup.OpReduceScatter, procgroup.OpAllReduce, procgroup.OpBarrier}
		var cs []*coll
		for i := range 50 {
			dt := procgroup.DTypes[i%len(procgroup.DTypes)]
			op := procgroup.ReduceOps[(i/2)%len(procgroup.ReduceOps)]
			count := 1 + (i*37)%101
			cs = append(cs, newColl(r, n, kinds[i%len(kinds)], dt, op, i%n, count))
		}
		s.batch(t, gs, cs)
	})
	t.Run("invalid", func(t *testing.T) { s.testInvalid(t, gs) })
}

// testBarrier checks that a barrier completes only once every rank has entered it.
func (s *suite) testBarrier(t *testing.T, gs []procgroup.ProcessGroup) {
	const rounds = 4
	var entered [rounds]atomic.Int32
	ctx, cancel := context.WithTimeout(context.Background(), s.opts.Timeout)
	defer cancel()
	runRanks(gs, func(rank int, pg procgroup.ProcessGroup) {
		var works [rounds]procgroup.Work
		for k := range rounds {
			entered[k].Add(1)
			works[k] = pg.Barrier(ctx)
		}
		for k, w := range works {
			if err := w.Wait(ctx); err != nil {
				t.Errorf("rank %d: barrier %d: %v", rank, k, err)
				continue
			}
			if got := entered[k].Load(); got != int32(len(gs)) {
				t.Errorf("rank %d: barrier %d completed when %d of %d ranks had entered it", rank, k, got, len(gs))
			}
		}
	})
}

// testInvalid checks that bad arguments fail the Work with ErrInvalidArgument, at once or
// soon, and leave the group usable.
func (s *suite) testInvalid(t *testing.T, gs []procgroup.ProcessGroup) {
	n := s.n
	type call struct {
		name string
		do   func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work
	}
	f32 := func(k int) []float32 { return make([]float32, k) }
	calls := []call{
		{"allreduce nil buffer", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.AllReduce(ctx, nil, procgroup.Sum)
		}},
		{"allreduce []int", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.AllReduce(ctx, []int{1, 2}, procgroup.Sum)
		}},
		{"allreduce []uint8", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.AllReduce(ctx, []uint8{1, 2}, procgroup.Sum)
		}},
		{"allreduce op 0", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.AllReduce(ctx, f32(3), procgroup.ReduceOp(0))
		}},
		{"allreduce op 99", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.AllReduce(ctx, f32(3), procgroup.ReduceOp(99))
		}},
		{"broadcast root -1", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.Broadcast(ctx, f32(3), -1)
		}},
		{"broadcast root size", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.Broadcast(ctx, f32(3), n)
		}},
		{"broadcast nil buffer", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.Broadcast(ctx, nil, 0)
		}},
		{"allgather short out", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.AllGather(ctx, f32(3*n-1), f32(3))
		}},
		{"allgather long out", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.AllGather(ctx, f32(3*n+1), f32(3))
		}},
		{"allgather mixed types", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.AllGather(ctx, make([]float64, 3*n), f32(3))
		}},
		{"allgather nil in", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.AllGather(ctx, f32(3*n), nil)
		}},
		{"reducescatter short in", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.ReduceScatter(ctx, f32(3), f32(3*n-1), procgroup.Sum)
		}},
		{"reducescatter long in", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.ReduceScatter(ctx, f32(3), f32(3*n+1), procgroup.Sum)
		}},
		{"reducescatter mixed types", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.ReduceScatter(ctx, []int32{1, 2, 3}, make([]int64, 3*n), procgroup.Sum)
		}},
		{"reducescatter op 0", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			return pg.ReduceScatter(ctx, f32(3), f32(3*n), procgroup.ReduceOp(0))
		}},
	}
	// Overlaps other than the in-place layout: one element off this rank's slot, a whole
	// other rank's slot, and the small buffer starting before the large one. (At n = 1 the
	// only overlap of equal lengths is the in-place one.)
	overlaps := []call{
		{"allgather in off its slot", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			out := f32(3 * n)
			at := offSlot(pg.Rank(), n, 3)
			return pg.AllGather(ctx, out, out[at:at+3])
		}},
		{"allgather in at another's slot", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			out := f32(3 * n)
			at := 3 * ((pg.Rank() + 1) % n)
			return pg.AllGather(ctx, out, out[at:at+3])
		}},
		{"allgather in before out", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			b := f32(3*n + 1)
			return pg.AllGather(ctx, b[1:], b[:3])
		}},
		{"reducescatter out off its block", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			in := f32(3 * n)
			at := offSlot(pg.Rank(), n, 3)
			return pg.ReduceScatter(ctx, in[at:at+3], in, procgroup.Sum)
		}},
		{"reducescatter out at another's block", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			in := f32(3 * n)
			at := 3 * ((pg.Rank() + 1) % n)
			return pg.ReduceScatter(ctx, in[at:at+3], in, procgroup.Sum)
		}},
		{"reducescatter out before in", func(ctx context.Context, pg procgroup.ProcessGroup) procgroup.Work {
			b := f32(3*n + 2)
			return pg.ReduceScatter(ctx, b[:3], b[2:], procgroup.Sum)
		}},
	}
	if n > 1 {
		calls = append(calls, overlaps...)
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.opts.Timeout)
	defer cancel()
	runRanks(gs, func(rank int, pg procgroup.ProcessGroup) {
		for _, c := range calls {
			w := c.do(ctx, pg)
			if w == nil {
				t.Errorf("rank %d: %s: nil Work", rank, c.name)
				continue
			}
			if err := w.Wait(ctx); !errors.Is(err, procgroup.ErrInvalidArgument) {
				t.Errorf("rank %d: %s: err = %v, want ErrInvalidArgument", rank, c.name, err)
			}
		}
	})
	// The group must still work, and agree on what comes next.
	r := rng(t.Name())
	s.batch(t, gs, []*coll{newColl(r, n, procgroup.OpAllReduce, procgroup.Float32, procgroup.Sum, 0, 37)})
}

// offSlot is the start of a count-element window of a size×count buffer that overlaps rank's
// slot but is not it: one element later, or one earlier for the last rank.
func offSlot(rank, size, count int) int {
	if rank < size-1 {
		return rank*count + 1
	}
	return rank*count - 1
}

// testClosePending closes groups with works pending: every work completes (correctly) or
// fails; nothing hangs; a later work fails at once with ErrClosed.
func (s *suite) testClosePending(t *testing.T) {
	n := s.n
	r := rng(t.Name())
	ctx, cancel := context.WithTimeout(context.Background(), s.opts.Timeout)
	defer cancel()

	t.Run("all-ranks-issued", func(t *testing.T) {
		gs := s.start(t)
		cs := make([]*coll, 8)
		for i := range cs {
			cs[i] = newColl(r, n, procgroup.OpAllReduce, procgroup.Float32, procgroup.Sum, 0, 1003)
		}
		errs := make([][]error, n)
		runRanks(gs, func(rank int, pg procgroup.ProcessGroup) {
			works := make([]procgroup.Work, len(cs))
			for i, c := range cs {
				works[i] = c.issue(ctx, pg)
			}
			_ = pg.Close()
			errs[rank] = waitAll(ctx, works)
		})
		for i, c := range cs {
			ok := make([]bool, n)
			for rank := range n {
				err := errs[rank][i]
				ok[rank] = err == nil
				if ctx.Err() != nil {
					t.Fatalf("rank %d: work %d pending after Close: %v", rank, i, err)
				}
			}
			if err := c.check(ok); err != nil {
				t.Errorf("work %d completed with a wrong result: %v", i, err)
			}
		}
		s.checkAfterStop(t, gs, procgroup.ErrClosed, "Close")
	})

	if n > 1 {
		t.Run("peers-silent", func(t *testing.T) {
			// Only rank 0 issues works, which cannot complete; then every rank closes.
			gs := s.start(t)
			works := make([]procgroup.Work, 4)
			for i := range works {
				works[i] = gs[0].AllReduce(ctx, fill(r, procgroup.Float32, procgroup.Sum, 37), procgroup.Sum)
			}
			s.closeAll(t, gs)
			for i, err := range waitAll(ctx, works) {
				if err == nil || ctx.Err() != nil {
					t.Errorf("rank 0: work %d: err = %v, want an error (its peers never issued it)", i, err)
				}
			}
			s.checkAfterStop(t, gs, procgroup.ErrClosed, "Close")
		})
	}
}

// testAbortPending aborts groups with works pending: rank 0's works fail with ErrAborted
// and the cause; nothing hangs; later works fail at once.
func (s *suite) testAbortPending(t *testing.T) {
	n := s.n
	r := rng(t.Name())
	ctx, cancel := context.WithTimeout(context.Background(), s.opts.Timeout)
	defer cancel()
	cause := errors.New("pgtest: deliberate abort")

	t.Run("rank0", func(t *testing.T) {
		// Only rank 0 issues (for n > 1 its works therefore stay pending), then aborts.
		gs := s.start(t)
		cs := make([]*coll, 4)
		works := make([]procgroup.Work, len(cs))
		for i := range cs {
			cs[i] = newColl(r, n, procgroup.OpAllReduce, procgroup.Float64, procgroup.Max, 0, 37)
			works[i] = cs[i].issue(ctx, gs[0])
		}
		gs[0].Abort(cause)
		for i, err := range waitAll(ctx, works) {
			switch {
			case ctx.Err() != nil:
				t.Fatalf("rank 0: work %d still pending after Abort", i)
			case err == nil && n == 1:
				if err := cs[i].check([]bool{true}); err != nil {
					t.Errorf("work %d: %v", i, err)
				}
			case !errors.Is(err, procgroup.ErrAborted) || !errors.Is(err, cause):
				t.Errorf("rank 0: work %d: err = %v, want ErrAborted wrapping the cause", i, err)
			}
		}
		for _, g := range gs[1:] {
			g.Abort(nil)
		}
		s.checkAfterStop(t, gs, procgroup.ErrAborted, "Abort")
	})

	t.Run("all-ranks", func(t *testing.T) {
		// Every rank issues works and aborts at once: works complete or fail, none hangs.
		gs := s.start(t)
		cs := make([]*coll, 6)
		for i := range cs {
			cs[i] = newColl(r, n, procgroup.OpAllReduce, procgroup.Int32, procgroup.Sum, 0, 1003)
		}
		errs := make([][]error, n)
		runRanks(gs, func(rank int, pg procgroup.ProcessGroup) {
			works := make([]procgroup.Work, len(cs))
			for i, c := range cs {
				works[i] = c.issue(ctx, pg)
			}
			pg.Abort(cause)
			errs[rank] = waitAll(ctx, works)
		})
		if ctx.Err() != nil {
			t.Fatalf("works still pending after Abort: %v", errs)
		}
		for i, c := range cs {
			ok := make([]bool, n)
			for rank := range n {
				ok[rank] = errs[rank][i] == nil
			}
			if err := c.check(ok); err != nil {
				t.Errorf("work %d completed with a wrong result: %v", i, err)
			}
		}
		s.checkAfterStop(t, gs, procgroup.ErrAborted, "Abort")
	})
}

// waitAll waits for every work (until ctx ends) and returns their errors.
func waitAll(ctx context.Context, works []procgroup.Work) []error {
	errs := make([]error, len(works))
	for i, w := range works {
		if w == nil {
			errs[i] = errors.New("nil Work")
			continue
		}
		errs[i] = w.Wait(ctx)
	}
	return errs
}

// checkAfterStop checks that works issued after Close or Abort (stop) fail at once with an
// error wrapping want, and that Close then returns (it is idempotent).
func (s *suite) checkAfterStop(t *testing.T, gs []procgroup.ProcessGroup, want error, stop string) {
	t.Helper()
	ctx := context.Background()
	for rank, pg := range gs {
		for _, w := range []procgroup.Work{
			pg.AllReduce(ctx, []float32{1, 2}, procgroup.Sum),
			pg.Barrier(ctx),
		} {
			select {
			case <-w.Done():
				if err := w.Err(); !errors.Is(err, want) {
					t.Errorf("rank %d: work issued after %s: err = %v, want %v", rank, stop, err, want)
				}
			default:
				t.Errorf("rank %d: work issued after %s has not failed at once", rank, stop)
			}
		}
	}
	s.closeAll(t, gs)
}
