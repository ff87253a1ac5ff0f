package main

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"sync/atomic"

	"github.com/goddp/goddp/procgroup"
)

// spec is one collective of the soak, drawn identically on every rank.
type spec struct {
	kind  procgroup.CollectiveOp
	dt    procgroup.DType
	op    procgroup.ReduceOp // AllReduce, ReduceScatter
	root  int                // Broadcast
	count int                // per rank: len(buf), AllGather's len(in), ReduceScatter's len(out)
	salt  uint64             // seeds the data
}

func (s spec) String() string {
	switch s.kind {
	case procgroup.OpBarrier:
		return "barrier"
	case procgroup.OpBroadcast:
		return fmt.Sprintf("broadcast %v×%d root %d", s.dt, s.count, s.root)
	case procgroup.OpAllGather:
		return fmt.Sprintf("allgather %v×%d", s.dt, s.count)
	}
	return fmt.Sprintf("%v %v×%d %v", s.kind, s.dt, s.count, s.op)
}

var kinds = []procgroup.CollectiveOp{
	procgroup.OpAllReduce, procgroup.OpAllReduce, procgroup.OpAllReduce, // the common case
	procgroup.OpBroadcast, procgroup.OpAllGather, procgroup.OpReduceScatter, procgroup.OpBarrier,
}

// draw picks the next collective: a kind, an element type, a reduction, a root and a
// log-uniform count in [0, maxCount] (0 and 1 included).
func draw(r *rand.Rand, n, maxCount int) spec {
	s := spec{
		kind: kinds[r.IntN(len(kinds))],
		dt:   procgroup.DTypes[r.IntN(len(procgroup.DTypes))],
		op:   procgroup.ReduceOps[r.IntN(len(procgroup.ReduceOps))],
		root: r.IntN(n),
		salt: r.Uint64(),
	}
	switch k := r.IntN(20); {
	case k == 0:
		s.count = 0
	case k == 1:
		s.count = 1
	default:
		s.count = int(math.Exp2(r.Float64() * math.Log2(float64(maxCount+1))))
		s.count = min(s.count, maxCount)
	}
	if s.kind == procgroup.OpAllGather || s.kind == procgroup.OpReduceScatter {
		s.count = max(s.count/n, min(s.count, 1))
	}
	return s
}

// value is rank's i-th input of s: a small integer, exact in every element type and so are
// its sums and products over a few ranks (Prod draws from ±1, ±2).
func value(s spec, rank, i int) float64 {
	h := s.salt ^ uint64(rank+1)*0x9e3779b97f4a7c15 ^ uint64(i+1)*0xbf58476d1ce4e5b9
	h ^= h >> 31
	h *= 0x94d049bb133111eb
	h ^= h >> 29
	if s.op == procgroup.Prod && (s.kind == procgroup.OpAllReduce || s.kind == procgroup.OpReduceScatter) {
		return [...]float64{-2, -1, 1, 2}[h&3]
	}
	return float64(int(h%17) - 8)
}

// fill sets buf[i] = f(i).
func fill(buf any, f func(i int) float64) {
	switch b := buf.(type) {
	case []float32:
		for i := range b {
			b[i] = float32(f(i))
		}
	case []float64:
		for i := range b {
			b[i] = f(i)
		}
	case []int32:
		for i := range b {
			b[i] = int32(f(i))
		}
	case []int64:
		for i := range b {
			b[i] = int64(f(i))
		}
	case []procgroup.BF16:
		for i := range b {
			b[i] = procgroup.BF16FromFloat32(float32(f(i)))
		}
	case []procgroup.F16:
		for i := range b {
			b[i] = procgroup.F16FromFloat32(float32(f(i)))
		}
	}
}

// at is buf[i] as a float64.
func at(buf any, i int) float64 {
	switch b := buf.(type) {
	case []float32:
		return float64(b[i])
	case []float64:
		return b[i]
	case []int32:
		return float64(b[i])
	case []int64:
		return float64(b[i])
	case []procgroup.BF16:
		return float64(b[i].Float32())
	case []procgroup.F16:
		return float64(b[i].Float32())
	}
	panic(fmt.Sprintf("collective-soak: buffer %T", buf))
}

// reduced is the reference reduction of element i over all ranks, in float64 (integer
// Avg truncates, as the backends do).
func reduced(s spec, n, i int) float64 {
	acc := value(s, 0, i)
	for r := 1; r < n; r++ {
		v := value(s, r, i)
		switch s.op {
		case procgroup.Sum, procgroup.Avg:
			acc += v
		case procgroup.Min:
			acc = math.Min(acc, v)
		case procgroup.Max:
			acc = math.Max(acc, v)
		case procgroup.Prod:
			acc *= v
		}
	}
	if s.op == procgroup.Avg {
		if s.dt == procgroup.Int32 || s.dt == procgroup.Int64 {
			return math.Trunc(acc / float64(n))
		}
		return acc / float64(n)
	}
	return acc
}

// tolerance is the error allowed on an element whose reference is want: exact but for
// float Avg, which rounds once in the element type (and may be computed from pre-divided
// inputs).
func tolerance(s spec, want float64) float64 {
	if s.op != procgroup.Avg {
		return 0
	}
	var rel float64
	switch s.dt {
	case procgroup.Float32:
		rel = 1e-6
	case procgroup.Float64:
		rel = 1e-12
	case procgroup.BFloat16:
		rel = 1.0 / 64
	case procgroup.Float16:
		rel = 1.0 / 512
	}
	return rel * (math.Abs(want) + 8)
}

// job is one issued collective and its buffers.
type job struct {
	s       spec
	in, out any
	work    procgroup.Work
}

// issue creates rank's inputs for s and issues it on pg.
func issue(ctx context.Context, pg procgroup.ProcessGroup, s spec) *job {
	rank, n := pg.Rank(), pg.Size()
	j := &job{s: s}
	switch s.kind {
	case procgroup.OpAllReduce:
		j.out = procgroup.NewBuffer(s.dt, s.count)
		fill(j.out, func(i int) float64 { return value(s, rank, i) })
		j.work = pg.AllReduce(ctx, j.out, s.op)
	case procgroup.OpBroadcast:
		j.out = procgroup.NewBuffer(s.dt, s.count)
		fill(j.out, func(i int) float64 { return value(s, rank, i) })
		j.work = pg.Broadcast(ctx, j.out, s.root)
	case procgroup.OpAllGather:
		j.in, j.out = procgroup.NewBuffer(s.dt, s.count), procgroup.NewBuffer(s.dt, n*s.count)
		fill(j.in, func(i int) float64 { return value(s, rank, i) })
		j.work = pg.AllGather(ctx, j.out, j.in)
	case procgroup.OpReduceScatter:
		j.in, j.out = procgroup.NewBuffer(s.dt, n*s.count), procgroup.NewBuffer(s.dt, s.count)
		fill(j.in, func(i int) float64 { return value(s, rank, i) })
		j.work = pg.ReduceScatter(ctx, j.out, j.in, s.op)
	case procgroup.OpBarrier:
		j.work = pg.Barrier(ctx)
	}
	return j
}

// check compares rank's result of j element by element with the reference.
func check(j *job, rank, n int) error {
	s := j.s
	var want func(i int) float64
	switch s.kind {
	case procgroup.OpBarrier:
		return nil
	case procgroup.OpAllReduce:
		want = func(i int) float64 { return reduced(s, n, i) }
	case procgroup.OpBroadcast:
		want = func(i int) float64 { return value(s, s.root, i) }
	case procgroup.OpAllGather:
		want = func(i int) float64 { return value(s, i/s.count, i%s.count) }
	case procgroup.OpReduceScatter:
		want = func(i int) float64 { return reduced(s, n, rank*s.count+i) }
	}
	var count int
	if _, c, err := procgroup.DTypeOf(j.out); err == nil {
		count = c
	}
	for i := range count {
		w, got := want(i), at(j.out, i)
		if math.Abs(got-w) > tolerance(s, w) || math.IsNaN(got) {
			return fmt.Errorf("%v: element %d = %v, want %v", s, i, got, w)
		}
	}
	return nil
}

// stats are a rank's counters, read by the reporter.
type stats struct {
	collectives atomic.Int64
	errors      atomic.Int64
}

// soak runs batches of 1 to 4 collectives in flight, drawn from seed, checking every
// result, until rank 0 decides to stop: after each batch rank 0 broadcasts whether
// stop() is true (the ranks' clocks may disagree; rank 0's decision is the same for all).
// It returns the first error.
func soak(ctx context.Context, pg procgroup.ProcessGroup, seed uint64, maxCount int, stop func() bool, st *stats) error {
	rank, n := pg.Rank(), pg.Size()
	r := rand.New(rand.NewPCG(seed, 0x5eed))
	flag := make([]int32, 1)
	jobs := make([]*job, 0, 4)
	for batch := 1; ; batch++ {
		jobs = jobs[:0]
		for range 1 + r.IntN(4) {
			jobs = append(jobs, issue(ctx, pg, draw(r, n, maxCount)))
		}
		for _, j := range jobs {
			if err := j.work.Wait(ctx); err != nil {
				st.errors.Add(1)
				return fmt.Errorf("batch %d: %v: %w", batch, j.s, err)
			}
			if err := check(j, rank, n); err != nil {
				st.errors.Add(1)
				return fmt.Errorf("batch %d: wrong result: %w", batch, err)
			}
			st.collectives.Add(1)
		}
		flag[0] = 0
		if rank == 0 && stop() {
			flag[0] = 1
		}
		if err := pg.Broadcast(ctx, flag, 0).Wait(ctx); err != nil {
			st.errors.Add(1)
			return fmt.Errorf("batch %d: stop flag: %w", batch, err)
		}
		st.collectives.Add(1)
		if flag[0] == 1 {
			return nil
		}
	}
}
