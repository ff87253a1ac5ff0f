package main

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// maxIters bounds the timed iterations --min_time asks for.
const maxIters = 1 << 20

// afterOp, when set (by the test hooks), runs after each measured collective (warm-up,
// checked, timed) this rank completes.
var afterOp func(rank int)

// bench runs every size of cfg on pg and calls emit with each size's row (on every rank:
// the numbers are agreed between ranks with collectives).
//
// For each size the input is filled from the rank's pristine data before each warm-up
// iteration, the checked one and the first timed one; the timed ones then run back to
// back (restored before each with --reset, and for products, which would pass through
// subnormals), and the time of a size is the slowest rank's mean.
func bench(ctx context.Context, pg procgroup.ProcessGroup, cfg config, emit func(row)) error {
	rank, world := pg.Rank(), pg.Size()
	if cfg.collective == "" {
		cfg.collective = collAllReduce
	}
	// allreduce is the all-reduce of the agreements between ranks (times, counts).
	allreduce := func(buf any, op procgroup.ReduceOp, what string, size int64) error {
		if err := pg.AllReduce(ctx, buf, op).Wait(ctx); err != nil {
			return fmt.Errorf("%s all-reduce of %d bytes: %w", what, size, err)
		}
		return nil
	}
	for size := cfg.minBytes; size <= cfg.maxBytes; size *= cfg.factor {
		t, err := newTask(pg, cfg, size)
		if err != nil {
			return err
		}
		if t == nil {
			continue // less than one element per rank
		}
		bytes := t.bytes
		one := func(what string) error {
			if err := t.run(ctx); err != nil {
				return fmt.Errorf("%s %s of %d bytes: %w", what, cfg.collective, bytes, err)
			}
			if afterOp != nil {
				afterOp(rank)
			}
			return nil
		}

		fastest := []float64{math.Inf(1)} // the fastest warm-up iteration, in seconds
		for range cfg.warmup {
			copyBuf(t.in, t.src)
			start := time.Now()
			if err := one("warm-up"); err != nil {
				return err
			}
			fastest[0] = min(fastest[0], time.Since(start).Seconds())
		}
		iters := cfg.iters
		if cfg.minTime > 0 && cfg.warmup > 0 {
			// As the PyTorch peer does: enough iterations for --min_time at the fastest
			// warm-up's pace, the same count on every rank (the slowest rank's pace).
			if err := allreduce(fastest, procgroup.Max, "warm-up time", 8); err != nil {
				return err
			}
			iters = max(iters, int(min(math.Ceil(cfg.minTime.Seconds()/max(fastest[0], 1e-9)), maxIters)))
		}
		wrong := int64(-1)
		if cfg.check {
			// The warm-up left right results in out; the checked run must write them again.
			scribble(t.out)
			copyBuf(t.in, t.src)
			if err := one("checked"); err != nil {
				return err
			}
			total := []int64{t.wrong(rank, world, cfg)}
			if err := allreduce(total, procgroup.Sum, "wrong-count", 8); err != nil {
				return err
			}
			wrong = total[0]
		}
		// The timed iterations run back to back on the buffer, as nccl-tests' and the PyTorch
		// peer's do: sums grow (the check above is an iteration of its own). Products would
		// shrink towards 0 through the subnormals, where x86 multiplies slow down by orders
		// of magnitude, so they restart from the input, as every op does with --reset: the
		// input is copied in again outside the timer, so each rank has just written its
		// whole buffer, as a DDP bucket's rank has, and the peers' chunks come from the other
		// cores' caches.
		reset := cfg.reset || cfg.op == procgroup.Prod
		var elapsed time.Duration
		its := make([]float64, iters)
		copyBuf(t.in, t.src)
		for i := range iters {
			if reset && i > 0 {
				copyBuf(t.in, t.src)
			}
			start := time.Now()
			if err := one("timed"); err != nil {
				return err
			}
			d := time.Since(start)
			elapsed += d
			its[i] = float64(d.Nanoseconds()) / 1e3
		}
		// The mean (nccl-tests' time) and the median iteration (the PyTorch peer's), each
		// the slowest rank's.
		us := []float64{float64(elapsed.Nanoseconds()) / 1e3 / float64(iters), median(its)}
		if err := allreduce(us, procgroup.Max, "time", 16); err != nil {
			return err
		}
		r := row{
			Collective: cfg.collective, InPlace: cfg.inPlace || cfg.collective == collAllReduce || cfg.collective == collBroadcast, SizeBytes: bytes, Count: t.count, DType: cfg.dtype.String(), Op: cfg.op.String(), Ranks: world,
			TimeUS: us[0], TimeUSMedian: us[1], Iters: iters, Wrong: wrong,
		}
		bus := busFactor(cfg.collective, world)
		if us[0] > 0 {
			r.AlgBW = float64(bytes) / (us[0] * 1e3) // bytes/ns = GB/s
		}
		if us[1] > 0 {
			r.BusBWMedian = float64(bytes) / (us[1] * 1e3) * bus
		}
		r.BusBW = r.AlgBW * bus
		if cfg.check {
			ok := wrong == 0
			r.OK = &ok
		}
		if cfg.collective == collAllReduce {
			if name, _, ok := procgroup.AllReduceAlgorithm(pg, t.in); ok {
				r.Algo = name // the group's choice for this size (gloo: Note [Algorithm choice])
			}
			if cfg.ceiling {
				if err := addCeiling(ctx, pg, t.in, &r); err != nil {
					return err
				}
			}
		}
		emit(r)
		t.free()
		if size > cfg.maxBytes/cfg.factor {
			break // the next step would pass -e (or overflow)
		}
	}
	return nil
}

// newBuffer returns the buffer a size is all-reduced in: from the group's allocator with
// --shared (procgroup.BufferAllocator: gloo's shared arena) when it has one and gives
// one, an ordinary slice otherwise; free gives it back.
func newBuffer(pg procgroup.ProcessGroup, cfg config, count int) (buf any, free func(), err error) {
	if a, ok := procgroup.Find[procgroup.BufferAllocator](pg); ok && cfg.shared {
		b, err := a.AllocBuffer(cfg.dtype, count)
		if err != nil {
			return nil, nil, fmt.Errorf("shared buffer of %d elements: %w", count, err)
		}
		if b != nil {
			return b, func() { a.FreeBuffer(b) }, nil
		}
	}
	return procgroup.NewBuffer(cfg.dtype, count), func() {}, nil
}

// gen yields one rank's data for one size: the same sequence whoever draws it, so that
// every rank can recompute every other rank's contribution.
type gen struct {
	rng   *rand.Rand
	dtype procgroup.DType
	op    procgroup.ReduceOp
	world int
}

func newGen(rank, world int, bytes int64, dt procgroup.DType, op procgroup.ReduceOp) *gen {
	seed := uint64(rank)*0x9E3779B97F4A7C15 + 1
	return &gen{rng: rand.New(rand.NewPCG(seed, uint64(bytes))), dtype: dt, op: op, world: world}
}

// next returns the next element, exactly representable in the element type.
//
// Integers are small, so that sums and products over the ranks are exact in float64 and
// never overflow: [-1000, 1000], or {-1, 1, 2} for products (|product| ≤ 2^30 up to 30
// ranks, {-1, 1} beyond). Floats are in [-1, 1), or ±[0.5, 1.5) for products, so products
// neither vanish nor blow up.
func (g *gen) next() float64 {
	switch g.dtype {
	case procgroup.Int32, procgroup.Int64:
		if g.op == procgroup.Prod {
			if g.world <= 30 {
				return [3]float64{-1, 1, 2}[g.rng.IntN(3)]
			}
			return [2]float64{-1, 1}[g.rng.IntN(2)]
		}
		return float64(g.rng.IntN(2001) - 1000)
	}
	var x float64
	if g.op == procgroup.Prod {
		x = 0.5 + g.rng.Float64()
		if g.rng.IntN(2) == 0 {
			x = -x
		}
	} else {
		x = 2*g.rng.Float64() - 1
	}
	switch g.dtype {
	case procgroup.Float32:
		return float64(float32(x))
	case procgroup.BFloat16:
		return float64(procgroup.BF16FromFloat32(float32(x)).Float32())
	case procgroup.Float16:
		return float64(procgroup.F16FromFloat32(float32(x)).Float32())
	}
	return x
}

func copyBuf(dst, src any) {
	switch d := dst.(type) {
	case []float32:
		copy(d, src.([]float32))
	case []float64:
		copy(d, src.([]float64))
	case []int32:
		copy(d, src.([]int32))
	case []int64:
		copy(d, src.([]int64))
	case []procgroup.BF16:
		copy(d, src.([]procgroup.BF16))
	case []procgroup.F16:
		copy(d, src.([]procgroup.F16))
	}
}

// scribble writes 0xa5 over every byte of buf (a value no result here holds: about -2.9e-16
// as float32, -1515870811 as int32), so that the checked run counts each element a
// collective leaves unwritten.
func scribble(buf any) {
	b, _, _, _ := kernels.Bytes(buf)
	for i := range b {
		b[i] = 0xa5
	}
}

func fill(buf any, g *gen) {
	switch b := buf.(type) {
	case []float32:
		for i := range b {
			b[i] = float32(g.next())
		}
	case []float64:
		for i := range b {
			b[i] = g.next()
		}
	case []int32:
		for i := range b {
			b[i] = int32(g.next())
		}
	case []int64:
		for i := range b {
			b[i] = int64(g.next())
		}
	case []procgroup.BF16:
		for i := range b {
			b[i] = procgroup.BF16FromFloat32(float32(g.next()))
		}
	case []procgroup.F16:
		for i := range b {
			b[i] = procgroup.F16FromFloat32(float32(g.next()))
		}
	}
}

// load converts buf[off:off+len(dst)] to float64.
func load(dst []float64, buf any, off int) {
	switch b := buf.(type) {
	case []float32:
		for i := range dst {
			dst[i] = float64(b[off+i])
		}
	case []float64:
		copy(dst, b[off:])
	case []int32:
		for i := range dst {
			dst[i] = float64(b[off+i])
		}
	case []int64:
		for i := range dst {
			dst[i] = float64(b[off+i])
		}
	case []procgroup.BF16:
		for i := range dst {
			dst[i] = float64(b[off+i].Float32())
		}
	case []procgroup.F16:
		for i := range dst {
			dst[i] = float64(b[off+i].Float32())
		}
	}
}

// unitRoundoff is the relative rounding error of one operation in dt.
func unitRoundoff(dt procgroup.DType) float64 {
	switch dt {
	case procgroup.Float32:
		return 0x1p-24
	case procgroup.Float64:
		return 0x1p-53
	case procgroup.BFloat16:
		return 0x1p-8
	case procgroup.Float16:
		return 0x1p-11
	}
	return 0
}

// verify compares the all-reduced buf with a reference computed here, in float64, from
// every rank's data regenerated from its seed, and returns the number of elements that
// differ by more than the tolerance.
func verify(buf any, world int, bytes int64, dt procgroup.DType, op procgroup.ReduceOp) int64 {
	return verifyAt(buf, world, bytes, dt, op, 0)
}

// verifyAt is verify for a buf that holds the reduction of elements skip.. of every
// rank's data (a ReduceScatter's share).
//
// Integers, Min and Max must match exactly. For float Sum and Avg the tolerance is
// 2(n+1)·u·Σ|x| (u the type's unit roundoff; n+1 roundings along any reduction order, each
// bounded by u times the partial sum, which is at most Σ|x|; twice that as margin); for
// Prod it is 2(n+1)·u·|Πx|.
func verifyAt(buf any, world int, bytes int64, dt procgroup.DType, op procgroup.ReduceOp, skip int) int64 {
	_, count, _ := procgroup.DTypeOf(buf)
	gens := make([]*gen, world)
	for r := range gens {
		gens[r] = newGen(r, world, bytes, dt, op)
		for range skip {
			gens[r].next()
		}
	}
	isInt := dt == procgroup.Int32 || dt == procgroup.Int64
	u := unitRoundoff(dt)
	n := float64(world)
	var atol float64
	if dt == procgroup.Float16 {
		atol = n * 0x1p-24 // float16 subnormal spacing
	}
	chunk := make([]float64, 1<<14)
	var wrong int64
	for off := 0; off < count; off += len(chunk) {
		got := chunk[:min(len(chunk), count-off)]
		load(got, buf, off)
		for _, g := range got {
			var want, scale float64
			switch op {
			case procgroup.Sum, procgroup.Avg:
				for _, gn := range gens {
					v := gn.next()
					want += v
					scale += math.Abs(v)
				}
				if op == procgroup.Avg {
					want /= n
					scale /= n
					if isInt {
						want = math.Trunc(want)
					}
				}
			case procgroup.Prod:
				want = 1
				for _, gn := range gens {
					want *= gn.next()
				}
				scale = math.Abs(want)
			case procgroup.Min:
				want = math.Inf(1)
				for _, gn := range gens {
					want = math.Min(want, gn.next())
				}
			case procgroup.Max:
				want = math.Inf(-1)
				for _, gn := range gens {
					want = math.Max(want, gn.next())
				}
			}
			tol := 2*(n+1)*u*scale + atol
			if isInt || op == procgroup.Min || op == procgroup.Max {
				tol = 0
			}
			if math.IsNaN(g) || math.Abs(g-want) > tol {
				wrong++
			}
		}
	}
	return wrong
}

// median is the median of xs (the mean of the middle two for an even count); it sorts xs.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	slices.Sort(xs)
	m := len(xs) / 2
	if len(xs)%2 == 1 {
		return xs[m]
	}
	return (xs[m-1] + xs[m]) / 2
}
