// Package sweepcsv defines, in one place, the CSV files of a bucket_cap_mb sweep:
// scripts/sweep.sh writes raw.csv and cpu.csv, cmd/sweep-report reads raw.csv and writes
// summary.csv and layouts.csv, and cmd/ddpsim reads summary.csv, layouts.csv and cpu.csv.
// Each file's header is a constant here, Read checks it, and Median is the statistic the
// files' median columns hold.
package sweepcsv

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
)

// The files' headers, without the line end.
const (
	// Raw is raw.csv's: one row per launch, kind ddp (bucket_cap_mb set), auto or compute
	// (--no_ddp, bucket_cap_mb empty). RawLayout adds the bucket sizes in MB that the
	// launch ran, space-separated (Note [Same layout] in cmd/sweep-report).
	Raw       = "system,kind,bucket_cap_mb,repeat,ms_step"
	RawLayout = Raw + ",layout"
	// CPU is cpu.csv's: rank 0's CPU per timed step and the buckets of each goddp launch.
	CPU = "system,kind,bucket_cap_mb,repeat,buckets,cpu_ms_step"
	// Summary is summary.csv's: one row per system and cap, and auto's. SummaryNoPBest is
	// the header of a summary written before the p_best column (Note [Resolved best] in
	// cmd/sweep-report).
	Summary        = SummaryNoPBest + ",p_best"
	SummaryNoPBest = "system,bucket_cap_mb,median_ms_step,min_ms_step,max_ms_step,repeats,relative_to_best,compute_ms_step,exposed_ms,exposed_fraction"
	// Layouts is layouts.csv's: one row per bucket layout that caps ran, its caps
	// space-separated, buckets empty where unknown (Note [Same layout]).
	Layouts = "system,caps,buckets,median_ms_step,relative_to_best,p_best"
)

// Table is a CSV file's rows after its header.
type Table struct {
	Header string     // the file's header: one of those Read was given
	Rows   [][]string // as many fields each as the header
	Lines  []int      // each row's line in the file
}

// Read reads the CSV file at path, whose header must be one of headers; what names the
// kind of file in the error.
func Read(path, what string, headers ...string) (*Table, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r := csv.NewReader(f)
	head, err := r.Read()
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	t := &Table{Header: strings.Join(head, ",")}
	if !slices.Contains(headers, t.Header) {
		return nil, fmt.Errorf("%s: not a %s: header %q, want %q", path, what, t.Header, strings.Join(headers, `" or "`))
	}
	for {
		rec, err := r.Read()
		if errors.Is(err, io.EOF) {
			return t, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		line, _ := r.FieldPos(0)
		t.Rows, t.Lines = append(t.Rows, rec), append(t.Lines, line)
	}
}

// Median is the median of xs, NaN if there are none.
func Median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
