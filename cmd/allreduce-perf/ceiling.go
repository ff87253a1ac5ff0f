package main

import (
	"context"
	"fmt"
	"time"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// Note [Ceiling]: --ceiling bounds each size's busbw by this machine's memory bandwidth.
// On one host an all-reduce is memory traffic. The group says which algorithm a size takes
// and how many bytes of the ranks' buffers it reads and writes per rank, per byte of the
// message (procgroup.AlgorithmReporter; gloo's ring: 5(n-1)/n). memRates measures how fast a
// rank moves memory, read plus written, copying a message-sized buffer while every rank
// does the same at once, as they do in the collective; the slowest rank counts. The
// ceiling's algbw is that rate divided by the traffic, and its busbw follows as for the
// measured time. The single-copy column is the same bound for an algorithm that reads its
// peers' buffers in place: a rank reads its chunk of all n buffers and writes its own, then
// copies the other n-1 chunks from their owners: (3n-1)/n.
//
// Staging memory (gloo's shared-memory slots, socket segments) is not counted: it is small
// and stays in cache. Counting it (9(n-1)/n for the shared-memory ring: every chunk copied
// into a slot and out again) gave ceilings below the measured busbw at 64 and 256 MiB on the
// development VM (115-120%), so that model is no bound. Over sockets the kernel's own costs
// are not counted either, so the ceiling there is looser.

// minProbeTraffic is how many bytes each rate measurement moves at least.
const minProbeTraffic = 256 << 20

// memRate returns the slowest rank's copy rate in GB/s of memory traffic (bytes read plus
// written) for buffers of bytes bytes, every rank measuring at once.
func memRate(ctx context.Context, pg procgroup.ProcessGroup, bytes int) (float64, error) {
	src, dst := kernels.Aligned(bytes), kernels.Aligned(bytes)
	for i := range src {
		src[i] = byte(i)
	}
	copy(dst, src) // fault the pages in before timing
	reps := max(3, minProbeTraffic/max(bytes, 1))
	if err := pg.AllReduce(ctx, []int32{0}, procgroup.Sum).Wait(ctx); err != nil {
		return 0, fmt.Errorf("ceiling probe barrier: %w", err)
	}
	start := time.Now()
	for range reps {
		copy(dst, src)
	}
	secs := []float64{time.Since(start).Seconds()}
	if err := pg.AllReduce(ctx, secs, procgroup.Max).Wait(ctx); err != nil {
		return 0, fmt.Errorf("ceiling probe time: %w", err)
	}
	return 2 * float64(bytes) * float64(reps) / secs[0] / 1e9, nil
}

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

// addCeiling fills r's ceiling fields for the group's algorithm at this size.
func addCeiling(ctx context.Context, pg procgroup.ProcessGroup, dt procgroup.DType, r *row) error {
	bytes, n := int(r.SizeBytes), pg.Size()
	rate, err := memRate(ctx, pg, bytes)
	if err != nil {
		return err
	}
	r.MemGBs = rate
	name, traffic, ok := procgroup.AllReduceAlgorithm(pg, dt, bytes)
	if !ok {
		name = "?"
	}
	r.Algo, r.Traffic = name, traffic
	r.CeilBusBW = ceilingBusBW(n, traffic, rate)
	if r.CeilBusBW > 0 {
		r.PctCeil = 100 * r.BusBW / r.CeilBusBW
		r.SingleCopyBusBW = ceilingBusBW(n, singleCopyTraffic(n), rate)
	}
	return nil
}
