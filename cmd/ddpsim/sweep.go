package main

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/goddp/goddp/internal/sweepcsv"
)

// summary is goddp's part of sweep-report's summary.csv: the median ms/step per cap and
// with auto, and each cap's P(best) (Note [Resolved best] in cmd/sweep-report; nil in a
// summary without the column).
type summary struct {
	caps    map[float64]float64
	auto    float64
	pBest   map[float64]float64
	layouts []measuredLayout // from -layouts
}

// measuredLayout is one row of a sweep's layouts.csv: the caps that ran one bucket layout,
// their pooled median and its P(best) (Note [Same layout] in cmd/sweep-report).
type measuredLayout struct {
	caps  []float64
	ms    float64
	pBest float64
}

// goddpRows is sweepcsv.Read of path, keeping goddp's rows.
func goddpRows(path, what string, headers ...string) (*sweepcsv.Table, error) {
	t, err := sweepcsv.Read(path, what, headers...)
	if err != nil {
		return nil, err
	}
	rows, lines := t.Rows[:0], t.Lines[:0]
	for i, r := range t.Rows {
		if r[0] == "goddp" {
			rows, lines = append(rows, r), append(lines, t.Lines[i])
		}
	}
	t.Rows, t.Lines = rows, lines
	return t, nil
}

// readLayouts reads goddp's rows of a layouts.csv.
func readLayouts(path string) ([]measuredLayout, error) {
	t, err := goddpRows(path, "sweep-report layouts.csv", sweepcsv.Layouts)
	if err != nil {
		return nil, err
	}
	var ls []measuredLayout
	for _, r := range t.Rows {
		var l measuredLayout
		for _, f := range strings.Fields(r[1]) {
			c, err := strconv.ParseFloat(f, 64)
			if err != nil {
				return nil, fmt.Errorf("%s: caps %q: %w", path, r[1], err)
			}
			l.caps = append(l.caps, c)
		}
		if l.ms, err = strconv.ParseFloat(r[3], 64); err != nil {
			return nil, fmt.Errorf("%s: ms/step %q: %w", path, r[3], err)
		}
		if l.pBest, err = strconv.ParseFloat(r[5], 64); err != nil {
			return nil, fmt.Errorf("%s: p_best %q: %w", path, r[5], err)
		}
		if len(l.caps) == 0 {
			return nil, fmt.Errorf("%s: a row with no caps", path)
		}
		ls = append(ls, l)
	}
	if len(ls) == 0 {
		return nil, fmt.Errorf("%s: no goddp rows", path)
	}
	return ls, nil
}

// readSummary reads goddp's rows of a summary.csv.
func readSummary(path string) (summary, error) {
	t, err := goddpRows(path, "sweep-report summary.csv", sweepcsv.Summary, sweepcsv.SummaryNoPBest)
	if err != nil {
		return summary{}, err
	}
	s := summary{caps: map[float64]float64{}}
	pcol := slices.Index(strings.Split(t.Header, ","), "p_best") // -1 in a summary without it
	if pcol >= 0 {
		s.pBest = map[float64]float64{}
	}
	for _, r := range t.Rows {
		ms, err := strconv.ParseFloat(r[2], 64)
		if err != nil {
			return summary{}, fmt.Errorf("%s: ms/step %q: %w", path, r[2], err)
		}
		if r[1] == "auto" {
			s.auto = ms
			continue
		}
		c, err := strconv.ParseFloat(r[1], 64)
		if err != nil {
			return summary{}, fmt.Errorf("%s: bucket_cap_mb %q: %w", path, r[1], err)
		}
		s.caps[c] = ms
		if pcol >= 0 {
			if s.pBest[c], err = strconv.ParseFloat(r[pcol], 64); err != nil {
				return summary{}, fmt.Errorf("%s: p_best %q: %w", path, r[pcol], err)
			}
		}
	}
	if len(s.caps) == 0 {
		return summary{}, fmt.Errorf("%s: no goddp rows", path)
	}
	return s, nil
}
