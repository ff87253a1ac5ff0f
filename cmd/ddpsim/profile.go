package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/goddp/goddp/bucket/sim"
	"github.com/goddp/goddp/internal/sweepcsv"
)

// loadProfiles reads the profiles and combines them field by field (the median); the
// all-reduce curve keeps, per size, the median of the repeats.
func loadProfiles(paths []string) (*sim.Profile, error) {
	var ps []*sim.Profile
	for _, path := range paths {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		p := new(sim.Profile)
		if err := json.Unmarshal(b, p); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if err := p.Check(); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if len(ps) > 0 && (len(p.Params) != len(ps[0].Params) || p.TotalBytes() != ps[0].TotalBytes()) {
			return nil, fmt.Errorf("%s: another model than %s (%d gradients, %d bytes; there %d, %d)", path, paths[0], len(p.Params), p.TotalBytes(), len(ps[0].Params), ps[0].TotalBytes())
		}
		ps = append(ps, p)
	}
	if len(ps) == 1 {
		return ps[0], nil
	}
	med := func(get func(*sim.Profile) float64) float64 {
		xs := make([]float64, len(ps))
		for k, p := range ps {
			xs[k] = get(p)
		}
		return sweepcsv.Median(xs)
	}
	out := *ps[0]
	out.Ready = make([]float64, len(out.Params))
	for i := range out.Ready {
		out.Ready[i] = med(func(p *sim.Profile) float64 { return p.Ready[i] })
	}
	out.Backward = med(func(p *sim.Profile) float64 { return p.Backward })
	out.Other = med(func(p *sim.Profile) float64 { return p.Other })
	out.CopyPerByte = med(func(p *sim.Profile) float64 { return p.CopyPerByte })
	out.UnpackPerByte = med(func(p *sim.Profile) float64 { return p.UnpackPerByte })
	out.Launch = med(func(p *sim.Profile) float64 { return p.Launch })
	out.CollectiveCPU = med(func(p *sim.Profile) float64 { return p.CollectiveCPU })
	out.Slowdown = med(func(p *sim.Profile) float64 { return p.Slowdown })
	out.CommSlowdown = med(func(p *sim.Profile) float64 { return p.CommSlowdown })
	out.Skew = med(func(p *sim.Profile) float64 { return p.Skew })
	bySize := map[int64][]float64{}
	for _, p := range ps {
		for _, pt := range p.Comm.Points {
			bySize[pt.Bytes] = append(bySize[pt.Bytes], pt.Seconds)
		}
	}
	if len(bySize) == 0 { // lines without measured points
		out.Comm = sim.Comm{Alpha: med(func(p *sim.Profile) float64 { return p.Comm.Alpha }), Beta: med(func(p *sim.Profile) float64 { return p.Comm.Beta })}
		return &out, nil
	}
	var pts []sim.Point
	for b, xs := range bySize {
		pts = append(pts, sim.Point{Bytes: b, Seconds: sweepcsv.Median(xs)})
	}
	comm, err := sim.Fit(pts)
	if err != nil {
		return nil, err
	}
	// The probe's points, each the faster of two tries: its lower curve, if every profile's
	// is (Note [Lower curve] in package bucket/sim).
	comm.Lower = true
	for _, p := range ps {
		comm.Lower = comm.Lower && p.Comm.Lower
	}
	out.Comm = comm
	return &out, nil
}

// readPerf reads allreduce-perf --json's rows (size_bytes, time_us) into a curve.
func readPerf(path string) (sim.Comm, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return sim.Comm{}, err
	}
	var pts []sim.Point
	for n, line := range strings.Split(string(b), "\n") {
		if strings.TrimSpace(line) == "" {
			continue
		}
		var r struct {
			SizeBytes int64   `json:"size_bytes"`
			TimeUS    float64 `json:"time_us"`
		}
		if err := json.Unmarshal([]byte(line), &r); err != nil || r.SizeBytes <= 0 || !(r.TimeUS > 0) {
			return sim.Comm{}, fmt.Errorf("%s:%d: not an allreduce-perf --json row: %q", path, n+1, line)
		}
		pts = append(pts, sim.Point{Bytes: r.SizeBytes, Seconds: r.TimeUS / 1e6})
	}
	c, err := sim.Fit(pts)
	if err != nil {
		return sim.Comm{}, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

func mean(xs []float64) float64 {
	var s float64
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}
