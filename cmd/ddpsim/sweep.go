package main

import (
	"encoding/csv"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
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

// goddpRows reads the CSV at path, whose first row must be header (what names the kind of
// file in the error), and returns goddp's rows and their line numbers.
func goddpRows(path, header, what string) (rows [][]string, lines []int, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	recs, err := csv.NewReader(f).ReadAll()
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(recs) == 0 || strings.Join(recs[0], ",") != header {
		return nil, nil, fmt.Errorf("%s: not a %s (%s)", path, what, header)
	}
	for i, r := range recs[1:] {
		if r[0] == "goddp" {
			rows, lines = append(rows, r), append(lines, i+2)
		}
	}
	return rows, lines, nil
}

// readLayouts reads goddp's rows of a layouts.csv.
func readLayouts(path string) ([]measuredLayout, error) {
	rows, _, err := goddpRows(path, "system,caps,buckets,median_ms_step,relative_to_best,p_best", "sweep-report layouts.csv")
	if err != nil {
		return nil, err
	}
	var ls []measuredLayout
	for _, r := range rows {
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
	f, err := os.Open(path)
	if err != nil {
		return summary{}, err
	}
	defer f.Close()
	recs, err := csv.NewReader(f).ReadAll()
	if err != nil {
		return summary{}, fmt.Errorf("%s: %w", path, err)
	}
	if len(recs) == 0 || len(recs[0]) < 8 || recs[0][0] != "system" || recs[0][1] != "bucket_cap_mb" || recs[0][2] != "median_ms_step" || recs[0][7] != "compute_ms_step" {
		return summary{}, fmt.Errorf("%s: not a sweep-report summary.csv (system,bucket_cap_mb,median_ms_step,...,compute_ms_step,...)", path)
	}
	pcol := slices.Index(recs[0], "p_best")
	s := summary{caps: map[float64]float64{}}
	if pcol >= 0 {
		s.pBest = map[float64]float64{}
	}
	for _, r := range recs[1:] {
		if r[0] != "goddp" {
			continue
		}
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
