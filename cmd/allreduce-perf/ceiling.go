package main

import (
	"context"
	"fmt"
	"time"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// Note [Ceiling]: --ceiling bounds each size's busbw by this machine's memory bandwidth.
// On one host an all-reduce is memory traffic. The group says which algorithm a buffer
// takes and how many bytes of the ranks' buffers it reads and writes per rank, per byte of
// the message (procgroup.AlgorithmReporter; gloo's rings: 5(n-1)/n; its in-place pass over
// the shared arena: 2). memRates measures how fast a rank streams memory at that size
// while every rank does the same at once, as they do in the collective, the slowest rank
// counting, over two buffers of half the message each (a rank's collective works over as
// much memory: its own buffer, or its chunk of each of the n buffers), with three loops: a copy (2 bytes of traffic per byte), a reduction dst += src
// (3), and an exchange, dst += src then src = dst a block at a time (4: the in-place
// pass's pattern). It keeps the fastest, since the collectives do all three. The
// ceiling's algbw is that rate divided by the traffic; its busbw follows as for the
// measured time. The single-copy column is the bound for an algorithm that reads its chunk
// of all n buffers once and writes it, then copies the other n-1 chunks from their owners:
// (3n-1)/n, 2.5 bytes per byte at n=2. gloo's in-place pass moves less (it writes each
// chunk to its peers while the chunk is in cache), so its busbw may pass that column; its
// own ceiling is its bound.
//
// Staging memory (gloo's shared-memory slots, socket segments) is not counted: it is small
// and stays in cache. Counting it (9(n-1)/n for the slot ring: every chunk copied into a
// slot and out again) with the copy rate gave ceilings below the measured busbw at 64 and
// 256 MiB on the development VM (115-120%), and so did the copy rate alone for the in-place
// ring (a copy that writes a line it has not read also pays for reading it first: write
// allocation, which the reduction, writing what it just read, does not). With two
// buffers of the message's size and no exchange loop, the in-place pass ran at 109-116%
// of the reduction's ceiling at 64 and 256 MiB (2 ranks, Intel Xeon with a 480 MiB L3,
// 2026-12-03); with the exchange loop, at 100-114%; with halves, at 78-98%: there the
// footprint decides how much the cache holds. The bound is an empirical one: the rates of
// three plain loops, not the hardware's peak.

// minProbeTraffic is how many bytes each rate measurement moves at least.
const minProbeTraffic = 256 << 20

// memRates returns the slowest rank's copy, reduction and exchange rates in GB/s of memory
// traffic (bytes read plus written) for buffers of bytes bytes of dt, every rank measuring
// at once.
func memRates(ctx context.Context, pg procgroup.ProcessGroup, dt procgroup.DType, bytes int) (copyGBs, reduceGBs, exchangeGBs float64, err error) {
	// Two halves: a rank streams over as much memory as its buffer holds, as in the
	// collective (Note [Ceiling]).
	half := max(bytes/2&^63, 64)
	src, dst := kernels.Aligned(half), kernels.Aligned(half)
	for i := range src {
		src[i] = 0x3c // a normal number in every float type (float32 0.0115): no subnormal slow path
	}
	copy(dst, src) // fault the pages in before timing
	reps := max(3, minProbeTraffic/half)
	measure := func(traffic int, f func()) (float64, error) {
		if err := pg.AllReduce(ctx, []int32{0}, procgroup.Sum).Wait(ctx); err != nil {
			return 0, fmt.Errorf("ceiling probe barrier: %w", err)
		}
		start := time.Now()
		for range reps {
			f()
		}
		secs := []float64{time.Since(start).Seconds()}
		if err := pg.AllReduce(ctx, secs, procgroup.Max).Wait(ctx); err != nil {
			return 0, fmt.Errorf("ceiling probe time: %w", err)
		}
		return float64(traffic) * float64(reps) / secs[0] / 1e9, nil
	}
	if copyGBs, err = measure(2*half, func() { copy(dst, src) }); err != nil {
		return 0, 0, 0, err
	}
	if reduceGBs, err = measure(3*half, func() { kernels.Reduce(dt, procgroup.Sum, dst, src) }); err != nil {
		return 0, 0, 0, err
	}
	exchange := func() {
		for a := 0; a < half; a += exchangeBlock {
			b := min(a+exchangeBlock, half)
			kernels.Reduce(dt, procgroup.Sum, dst[a:b], src[a:b])
			copy(src[a:b], dst[a:b])
		}
	}
	if exchangeGBs, err = measure(4*half, exchange); err != nil {
		return 0, 0, 0, err
	}
	return copyGBs, reduceGBs, exchangeGBs, nil
}

// exchangeBlock is the exchange loop's block, in bytes: gloo's in-place pass works in
// blocks of this size (a multiple of every element size).
const exchangeBlock = 32 << 10

// ceilingBusBW is the busbw (GB/s) of an all-reduce over n ranks that moves traffic bytes
// per rank per message byte at rate GB/s; 0 when the traffic is unknown.
func ceilingBusBW(n int, traffic, rate float64) float64 {
	if traffic <= 0 || rate <= 0 || n < 2 {
		return 0
	}
	return rate / traffic * 2 * float64(n-1) / float64(n)
}

// singleCopyTraffic is the traffic of Note [Ceiling]'s single-copy all-reduce.
func singleCopyTraffic(n int) float64 { return float64(3*n-1) / float64(n) }

// addCeiling fills r's ceiling fields for the group's algorithm on buf.
func addCeiling(ctx context.Context, pg procgroup.ProcessGroup, buf any, r *row) error {
	bytes, n := int(r.SizeBytes), pg.Size()
	dt, _, err := procgroup.DTypeOf(buf)
	if err != nil {
		return err
	}
	if dt == procgroup.BFloat16 || dt == procgroup.Float16 {
		dt = procgroup.Float32 // the probe's reduction: these are widened to float32 anyway
	}
	cp, rd, ex, err := memRates(ctx, pg, dt, bytes)
	if err != nil {
		return err
	}
	r.CopyGBs, r.ReduceGBs, r.ExchangeGBs, r.MemGBs = cp, rd, ex, max(cp, rd, ex)
	name, traffic, ok := procgroup.AllReduceAlgorithm(pg, buf)
	if !ok {
		name = "?"
	}
	r.Algo, r.Traffic = name, traffic
	r.CeilBusBW = ceilingBusBW(n, traffic, r.MemGBs)
	if r.CeilBusBW > 0 {
		r.PctCeil = 100 * r.BusBW / r.CeilBusBW
		r.PctCeilMedian = 100 * r.BusBWMedian / r.CeilBusBW
		r.SingleCopyBusBW = ceilingBusBW(n, singleCopyTraffic(n), r.MemGBs)
	}
	return nil
}
