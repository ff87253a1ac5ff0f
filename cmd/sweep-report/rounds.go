package main

import (
	"cmp"
	"fmt"
	"io"
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/goddp/goddp/internal/sweepcsv"
)

// Note [Rounds pooled]: one sweep's medians over 5-12 repeats differ by more than the 5% that
// tells auto's choice from the best cap (on the two-host testbed, caps that ran one layout
// measured up to 14.7% apart in one sweep, Note [Same layout]), and the least median of many
// is below what that layout typically takes. Several sweeps of one configuration, taken at
// different times (rounds), say more together, once two things are undone:
//   - the machine's speed drifts between rounds (another tenant, another testbed): every
//     launch of a round is divided by the median of all that round's launches (each round
//     runs the same caps and auto as often, so the median is taken over the same mix);
//   - the caps' layouts are what ran, not the caps: launches are grouped by the bucket
//     layout they ran (the raw CSV's layout column), whichever cap or auto asked for it.
//
// A layout's figure is then, as in Note [Same layout], the median over (round, repeat) of
// the median of its launches there, P(best) the resampling of Note [Resolved best] over
// (round, repeat), and auto's ratio to the best layout comes with the 5th and 95th
// percentiles of that ratio over the same resamples: the ratio of auto's median to the least
// layout median in each draw.

// roundsLaunch is one launch of a pooled sweep.
type roundsLaunch struct {
	key    string  // round/repeat: the unit that is resampled
	layout string  // the bucket sizes in MB
	cap    float64 // 0 for auto
	v      float64 // ms/step over the round's median
}

// roundsPooled writes Note [Rounds pooled]'s report for the raw CSVs at paths (one per round,
// of one configuration) to w.
func roundsPooled(paths []string, w io.Writer) error {
	if len(paths) < 2 {
		return fmt.Errorf("-rounds: %d raw CSV, want two or more (of one configuration, swept at different times)", len(paths))
	}
	bySystem := map[string][]roundsLaunch{}
	for r, path := range paths {
		all, err := read(path)
		if err != nil {
			return err
		}
		for name, s := range all {
			var ls []roundsLaunch
			add := func(c float64, rep, lay string, ms float64) error {
				if lay == "" {
					return fmt.Errorf("%s: a launch (cap %g, repeat %s) without a layout: pooling rounds groups launches by the layout they ran (the raw CSV's layout column)", path, c, rep)
				}
				ls = append(ls, roundsLaunch{key: strconv.Itoa(r+1) + "/" + rep, layout: lay, cap: c, v: ms})
				return nil
			}
			for c, reps := range s.ddpRep {
				for rep, ms := range reps {
					if err := add(c, rep, s.layoutRep[c][rep], ms); err != nil {
						return err
					}
				}
			}
			for rep, ms := range s.autoRep {
				if err := add(0, rep, s.autoLay[rep], ms); err != nil {
					return err
				}
			}
			if len(ls) == 0 {
				continue
			}
			vs := make([]float64, len(ls))
			for i, l := range ls {
				vs[i] = l.v
			}
			m := sweepcsv.Median(vs)
			for i := range ls {
				ls[i].v /= m
			}
			bySystem[name] = append(bySystem[name], ls...)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(bySystem)) {
		writeRounds(w, name, len(paths), bySystem[name])
	}
	return nil
}

// pooledLayout is one layout of Note [Rounds pooled], over all the rounds.
type pooledLayout struct {
	layout   string
	caps     map[float64]bool     // the caps whose launches ran it (0: auto)
	byKey    map[string][]float64 // by round/repeat: its launches there
	rep      map[string]float64   // by round/repeat: the median of byKey's
	launches int
}

// writeRounds writes one system's pooled table.
func writeRounds(w io.Writer, name string, rounds int, ls []roundsLaunch) {
	at := map[string]*pooledLayout{}
	autoRep, defRep := map[string]float64{}, map[string]float64{} // a launch of each per round/repeat
	autoLays := map[string]int{}
	for _, l := range ls {
		g := at[l.layout]
		if g == nil {
			g = &pooledLayout{layout: l.layout, caps: map[float64]bool{}, byKey: map[string][]float64{}}
			at[l.layout] = g
		}
		g.caps[l.cap] = true
		g.launches++
		g.byKey[l.key] = append(g.byKey[l.key], l.v)
		switch l.cap {
		case 0:
			autoRep[l.key] = l.v
			autoLays[l.layout]++
		case 25:
			defRep[l.key] = l.v
		}
	}
	gs := make([]*pooledLayout, 0, len(at))
	for _, g := range at {
		g.rep = map[string]float64{}
		for k, xs := range g.byKey {
			g.rep[k] = sweepcsv.Median(xs)
		}
		gs = append(gs, g)
	}
	nb := func(g *pooledLayout) int { return len(strings.Fields(g.layout)) }
	slices.SortFunc(gs, func(a, b *pooledLayout) int {
		return cmp.Or(cmp.Compare(nb(a), nb(b)), strings.Compare(a.layout, b.layout))
	})
	// The layouts that a cap ran are the ones ranked; one that only auto ran is shown but not
	// a candidate for best (the sweep did not try it).
	rep := map[float64]map[string]float64{}
	var keys []float64
	meds := make([]float64, len(gs))
	best := math.Inf(1)
	for i, g := range gs {
		meds[i] = sweepcsv.Median(repValues(g.rep))
		if len(g.caps) == 1 && g.caps[0] {
			continue
		}
		keys = append(keys, float64(i))
		rep[float64(i)] = g.rep
		best = math.Min(best, meds[i])
	}
	pb := pBest(rep, keys, pBestDraws)
	fmt.Fprintf(w, "\n%s, %d rounds pooled (Note [Rounds pooled] in cmd/sweep-report): ms/step over each round's median, by the layout the launches ran\n\n", name, rounds)
	fmt.Fprintf(w, "| buckets | layout (MB) | caps that ran it | launches | ms/step (relative) | relative to best | P(best) |\n|---:|---|---|---:|---:|---:|---:|\n")
	for i, g := range gs {
		var cs []string
		for _, c := range slices.Sorted(maps.Keys(g.caps)) {
			if c == 0 {
				cs = append(cs, "auto")
			} else {
				cs = append(cs, strconv.FormatFloat(c, 'g', -1, 64))
			}
		}
		p := "-"
		if _, ok := rep[float64(i)]; ok {
			p = fmt.Sprintf("%.2f", pb[float64(i)])
		}
		fmt.Fprintf(w, "| %d | %s | %s | %d | %.3f | %.3fx | %s |\n", nb(g), g.layout, strings.Join(cs, ", "), g.launches, meds[i], meds[i]/best, p)
	}
	if len(autoRep) == 0 {
		return
	}
	a := sweepcsv.Median(repValues(autoRep))
	lo, hi := ratioInterval(autoRep, rep, keys)
	fmt.Fprintf(w, "\nauto (%d launches): %.3fx the best layout's ms/step, 90%% of resamples within %.3f..%.3fx; it ran", len(autoRep), a/best, lo, hi)
	lays := slices.Sorted(maps.Keys(autoLays))
	slices.SortStableFunc(lays, func(x, y string) int { return cmp.Compare(autoLays[y], autoLays[x]) })
	for i, lay := range lays {
		sep := ","
		if i == len(lays)-1 {
			sep = "\n"
		}
		times := fmt.Sprintf("%d times", autoLays[lay])
		if autoLays[lay] == 1 {
			times = "once"
		}
		fmt.Fprintf(w, " %d buckets (%s) %s%s", len(strings.Fields(lay)), lay, times, sep)
	}
	if len(defRep) > 0 {
		d := sweepcsv.Median(repValues(defRep))
		fmt.Fprintf(w, "auto against the default 25 MB: %s; the default takes %.3fx auto's\n", timeAgainst(a, d), d/a)
	}
}

// ratioInterval is the 5th and 95th percentiles, over resamples of the round/repeat keys
// (the same draw for all, Note [Resolved best]), of auto's median over the least of the
// layouts' medians.
func ratioInterval(auto map[string]float64, rep map[float64]map[string]float64, layouts []float64) (lo, hi float64) {
	ms := []map[string]float64{auto}
	for _, l := range layouts {
		ms = append(ms, rep[l])
	}
	rs := make([]float64, 0, pBestDraws)
	resample(ms, pBestDraws, rand.New(rand.NewPCG(3, 4)), func(med func(map[string]float64) float64) {
		a, least := med(auto), math.Inf(1)
		for _, l := range layouts {
			if m := med(rep[l]); m < least {
				least = m
			}
		}
		if r := a / least; !math.IsNaN(r) && !math.IsInf(least, 1) {
			rs = append(rs, r)
		}
	})
	if len(rs) == 0 {
		return math.NaN(), math.NaN()
	}
	sort.Float64s(rs)
	return rs[len(rs)*5/100], rs[len(rs)*95/100]
}
