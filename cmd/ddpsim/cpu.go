package main

import (
	"fmt"
	"math"
	"strconv"

	"github.com/goddp/goddp/internal/sweepcsv"
)

// Note [CPU per collective from a sweep]: the step model's CollectiveCPU (Note [A
// collective's CPU] in package bucket/sim) is the CPU time one collective costs beyond its
// bytes. One pass's CPU time cannot show it: the auto sizing's pass 3 (eight buckets) less
// pass 2 (one) came out between −26 and +8 ms where the seven extra collectives account for
// about 5 ms. A sweep has many launches of each layout: the trainer prints its own CPU per
// timed step, and scripts/sweep.sh writes it beside the buckets each launch ran (cpu.csv).
// The slope of CPU per step against buckets, fitted within each repeat (each repeat's means
// taken out first, so that a repeat on a slower or busier machine does not tilt it), is
// the CPU per collective. Negative slopes are read as zero. Where collectives overlap
// backward for long, the slope also takes in what the overlap costs compute in CPU time
// (the same work run beside the network stack's copies, with the caches and memory
// shared). With -overlap_trace that part is taken out of the traced backward before the
// slowdown is read (Note [Overlap from traces]), so the two terms share it. The
// measurements: docs/results/2026-12-06-collective-cpu.md.

// cpuFit is Note [CPU per collective from a sweep]'s fit.
type cpuFit struct {
	perBucket              float64 // seconds
	launches               int
	minBuckets, maxBuckets int
}

// collectiveCPUFromSweep fits the CPU per collective from a sweep's cpu.csv (system,kind,
// bucket_cap_mb,repeat,buckets,cpu_ms_step; goddp's rows).
func collectiveCPUFromSweep(path string) (cpuFit, error) {
	t, err := goddpRows(path, "sweep.sh cpu.csv", sweepcsv.CPU)
	if err != nil {
		return cpuFit{}, err
	}
	type point struct{ x, y float64 }
	byRep := map[string][]point{}
	fit := cpuFit{minBuckets: math.MaxInt}
	for i, rec := range t.Rows {
		nb, err1 := strconv.Atoi(rec[4])
		ms, err2 := strconv.ParseFloat(rec[5], 64)
		if err1 != nil || err2 != nil || nb < 1 || !(ms > 0) || math.IsInf(ms, 0) {
			return cpuFit{}, fmt.Errorf("%s:%d: bad buckets %q or cpu_ms_step %q", path, t.Lines[i], rec[4], rec[5])
		}
		byRep[rec[3]] = append(byRep[rec[3]], point{float64(nb), ms})
		fit.launches++
		fit.minBuckets, fit.maxBuckets = min(fit.minBuckets, nb), max(fit.maxBuckets, nb)
	}
	var sxy, sxx float64
	for _, ps := range byRep {
		var mx, my float64
		for _, p := range ps {
			mx, my = mx+p.x, my+p.y
		}
		mx, my = mx/float64(len(ps)), my/float64(len(ps))
		for _, p := range ps {
			sxy += (p.x - mx) * (p.y - my)
			sxx += (p.x - mx) * (p.x - mx)
		}
	}
	if !(sxx > 0) {
		return cpuFit{}, fmt.Errorf("%s: no repeat with launches of different bucket counts to fit the CPU per collective from", path)
	}
	fit.perBucket = math.Max(sxy/sxx, 0) / 1e3
	return fit, nil
}
