package gloo

import (
	"context"
	"fmt"
	"math"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/goddp/goddp/procgroup"
)

// Note [Algorithm choice]: on one host the all-reduce's algorithm follows fixed rules
// measured on shared memory (direct up to DirectMaxBytes, the ring above). A group that
// spans hosts has a link whose speed nobody knows in advance (1 Gbit/s or 400), so there,
// with Algorithm auto, New calibrates a cost model as NCCL's tuning tables do, but
// measured. It runs only where every rank asks for it, since each reads its own
// environment (Note [Agreement] compares the ranks' settings). Every rank then times
// all-reduces of a few sizes (calibSizes) with each candidate (direct; recursive
// doubling from 3 ranks on; and the ring the placement allows: the hierarchical rings,
// the two-rank exchange or the flat ring; timed on an arena buffer where the reducer's
// buckets live in one), the ranks take the slowest rank's time of each (an all-reduce
// with Max), and rank 0 fits each candidate's time as α + β·bytes (least squares on
// relative errors: fitLine) and broadcasts the fits. Every rank then holds the same table
// and makes the same choice for every size: the candidate with the least predicted time,
// up to calibLimit times the largest size measured, and the ring above. Direct and
// recursive doubling give the same bits (Note [One association]), so the choice between
// them changes no result. GODDP_GLOO_ALGO (Config.Algorithm) overrides the model, and
// GODDP_GLOO_TUNE=off (Config.Tune) keeps the fixed rules across hosts too.

// calibSizes are the message sizes the calibration times (bytes of float32).
var calibSizes = []int{4 << 10, 16 << 10, 64 << 10, 256 << 10}

// calibReps is how many times each (candidate, size) is timed after one warm-up; the
// fastest counts.
const calibReps = 3

// algoCost is one candidate's fitted cost.
type algoCost struct {
	path        string  // allReducePath's name
	alpha, beta float64 // seconds, seconds per byte
}

// costModel is Note [Algorithm choice]'s table; nil where the fixed rules apply.
type costModel struct {
	algos []algoCost
	ring  string        // the ring path, for sizes past limit
	limit int           // the largest size the fits are trusted for
	took  time.Duration // the calibration's length
}

// calibLimit is how far past the largest calibrated size the fits are used; larger
// messages take the ring, whose cost is all bandwidth.
const calibLimit = 4

// choose is the path with the least predicted time for n bytes (the first on a tie).
func (m *costModel) choose(n int) string {
	if n > m.limit {
		return m.ring
	}
	best, bt := "", math.Inf(1)
	for _, a := range m.algos {
		if t := a.alpha + a.beta*float64(n); t < bt {
			best, bt = a.path, t
		}
	}
	return best
}

func (m *costModel) String() string {
	var b strings.Builder
	for i, a := range m.algos {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%s %.1fµs + %.3fns/B", a.path, a.alpha*1e6, a.beta*1e9)
	}
	// Where the choice changes, scanning sizes by powers of two from 1 KiB to 16 MiB.
	prev := ""
	for s := 1 << 10; s <= 16<<20; s <<= 1 {
		if c := m.choose(s); c != prev {
			fmt.Fprintf(&b, "; from %s: %s", sizeName(s), c)
			prev = c
		}
	}
	return b.String()
}

func sizeName(n int) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%d GiB", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

// spansHosts reports whether the group's ranks are on more than one host.
func (g *group) spansHosts() bool {
	for _, h := range g.hostIDs {
		if h != g.hostIDs[0] {
			return true
		}
	}
	return false
}

// ringPath is the path the fixed rules give a message too large for direct.
func (g *group) ringPath() string {
	switch {
	case g.useShmRing():
		return "shm-ring"
	case g.useHier():
		return "hierarchical"
	case g.size == 2:
		return "pair"
	}
	return "ring"
}

// calibrate builds Note [Algorithm choice]'s model when it applies; every rank runs it at
// the same point of New, before any collective of the user's.
func (g *group) calibrate(ctx context.Context) error {
	if g.size < 2 || !g.spansHosts() {
		return nil
	}
	// Every rank calibrates or none does: the settings come from each rank's environment,
	// and Note [Agreement] compared them (the algorithm is the same on every rank).
	if g.cfg.Algorithm != AlgoAuto || !g.tuneAll {
		return nil
	}
	start := time.Now()
	paths := []string{"direct"}
	if g.size >= 3 {
		paths = append(paths, "rd")
	}
	paths = append(paths, g.ringPath())
	// Where the host phases can run in place, the probe's buffer is the arena's, as the
	// reducer's buckets are, so that the hierarchical candidate is timed on that path
	// (Note [Host phases in place]).
	count := calibSizes[len(calibSizes)-1] / 4
	buf, _ := g.arenaAlloc(procgroup.Float32, count).([]float32)
	if buf != nil {
		defer g.FreeBuffer(buf)
	} else {
		buf = make([]float32, count)
	}
	times := make([]float64, len(paths)*len(calibSizes))
	for i, path := range paths {
		for k, size := range calibSizes {
			b := buf[:size/4]
			best := math.Inf(1)
			for rep := 0; rep <= calibReps; rep++ {
				t0 := time.Now()
				if err := g.submitPath(ctx, b, procgroup.Max, path).Wait(ctx); err != nil {
					return fmt.Errorf("calibrating the all-reduce (%s, %s): %w", path, sizeName(size), err)
				}
				if rep > 0 { // the first one absorbs the ranks' skew
					best = min(best, time.Since(t0).Seconds())
				}
			}
			times[i*len(calibSizes)+k] = best
		}
	}
	if err := g.submitPath(ctx, times, procgroup.Max, "direct").Wait(ctx); err != nil {
		return fmt.Errorf("calibrating the all-reduce (exchanging the times): %w", err)
	}
	// Rank 0 fits and every rank takes its numbers, so that no difference in floating
	// point between the ranks' machines can make them choose differently.
	fit := make([]float64, 2*len(paths))
	for i := range paths {
		fit[2*i], fit[2*i+1] = fitLine(calibSizes, times[i*len(calibSizes):(i+1)*len(calibSizes)])
	}
	if err := g.Broadcast(ctx, fit, 0).Wait(ctx); err != nil {
		return fmt.Errorf("calibrating the all-reduce (rank 0's fit): %w", err)
	}
	m := &costModel{ring: paths[len(paths)-1], limit: calibLimit * calibSizes[len(calibSizes)-1]}
	for i, path := range paths {
		m.algos = append(m.algos, algoCost{path: path, alpha: fit[2*i], beta: fit[2*i+1]})
	}
	m.took = time.Since(start)
	g.model = m
	if g.rank == 0 {
		g.log.Info("gloo: all-reduce algorithms calibrated across hosts (GODDP_GLOO_ALGO overrides, GODDP_GLOO_TUNE=off keeps fixed rules)",
			zap.Duration("took", m.took), zap.String("model", m.String()))
	}
	return nil
}

// fitLine fits t = α + β·x by least squares on the relative errors (each point weighted
// by 1/t², so that the small sizes, where α shows, count as much as the large ones, where
// β does), with α and β at least 0.
func fitLine(xs []int, ts []float64) (alpha, beta float64) {
	var sw, sx, st, sxx, sxt float64
	for i, x := range xs {
		if !(ts[i] > 0) {
			continue
		}
		w, fx := 1/(ts[i]*ts[i]), float64(x)
		sw, sx, st, sxx, sxt = sw+w, sx+w*fx, st+w*ts[i], sxx+w*fx*fx, sxt+w*fx*ts[i]
	}
	if sw == 0 {
		return 0, 0
	}
	if d := sw*sxx - sx*sx; d > 0 {
		beta = (sw*sxt - sx*st) / d
	}
	beta = max(beta, 0)
	alpha = max((st-beta*sx)/sw, 0)
	return alpha, beta
}
