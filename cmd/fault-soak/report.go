//go:build linux

package main

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"time"
)

// report writes the soak's tables in Markdown.
func (s *soak) report(w io.Writer, err error) {
	fmt.Fprintf(w, "fault-soak: %s; faults every %v for %v (seed %d); kinds %s\n\n",
		s.c, s.cfg.gap, s.cfg.duration, s.cfg.seed, strings.Join(s.cfg.kinds, ","))
	fmt.Fprintf(w, "trainer: %s %s\n\n", s.spec.trainer, strings.Join(s.spec.args, " "))
	if s.refCRC != "" {
		fmt.Fprintf(w, "uninterrupted run: params_crc32=%s in %v\n\n", s.refCRC, s.refTime.Round(time.Second))
	}
	if err != nil {
		fmt.Fprintf(w, "**FAILED**: %v\n\n", err)
	} else {
		fmt.Fprintf(w, "**PASSED**: every fault recovered from, every round at the uninterrupted run's params_crc32\n\n")
	}

	fmt.Fprintln(w, "| fault | injected | recovered | followed by a group restart | recovery (median) | recovery (max) |")
	fmt.Fprintln(w, "| --- | ---: | ---: | ---: | ---: | ---: |")
	total, totalOK := 0, 0
	for _, k := range s.cfg.kinds {
		var n, ok, restarted int
		var rec []time.Duration
		for _, f := range s.faults {
			if f.kind != k {
				continue
			}
			n++
			if f.recovered {
				ok++
				rec = append(rec, f.recovery)
			}
			if f.restarts > 0 {
				restarted++
			}
		}
		total, totalOK = total+n, totalOK+ok
		med, top := "–", "–"
		if len(rec) > 0 {
			slices.Sort(rec)
			med, top = rec[len(rec)/2].Round(time.Millisecond).String(), rec[len(rec)-1].Round(time.Millisecond).String()
		}
		fmt.Fprintf(w, "| %s | %d | %d | %d | %s | %s |\n", describeKind(k), n, ok, restarted, med, top)
	}
	fmt.Fprintf(w, "| all | %d | %d | | | |\n\n", total, totalOK)

	fmt.Fprintln(w, "| round | wall time | group restarts | strangers refused (log lines) | params_crc32 | = uninterrupted |")
	fmt.Fprintln(w, "| --- | ---: | ---: | ---: | --- | --- |")
	s.mu.Lock()
	rounds := slices.Clone(s.rounds)
	s.mu.Unlock()
	for _, r := range rounds {
		p := r.progress()
		crc, cerr := r.agreedCRC(s.c.nproc)
		same := "yes"
		switch {
		case !p.finished:
			crc, same = "(stopped)", "–"
		case cerr != nil:
			crc, same = "(none agreed)", "no"
		case crc != s.refCRC:
			same = "**no**"
		}
		wall := "–"
		if p.finished {
			wall = r.elapsed.Round(time.Second).String()
		}
		fmt.Fprintf(w, "| %s | %s | %d | %d | %s | %s |\n", r.name, wall, p.restarts, p.refusals, crc, same)
	}
	fmt.Fprintln(w)

	if len(s.samples) > 0 {
		first, last := s.samples[0], s.samples[len(s.samples)-1]
		fmt.Fprintf(w, "Resident memory (VmRSS) and open descriptors of the job's processes, at the first sample (%v, %s) and the last (%v, %s), %d samples:\n\n",
			first[0].at.Round(time.Second), first[0].round, last[0].at.Round(time.Second), last[0].round, len(s.samples))
		fmt.Fprintln(w, "| process | start: pid | RSS MiB | fds | end: pid | RSS MiB | fds | max RSS MiB | max fds |")
		fmt.Fprintln(w, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
		for _, a := range first {
			role := roleOf(a.p)
			var b *sample
			maxRSS, maxFDs := int64(0), 0
			for _, set := range s.samples {
				for i := range set {
					if roleOf(set[i].p) == role {
						maxRSS, maxFDs = max(maxRSS, set[i].u.rssKB), max(maxFDs, set[i].u.fds)
					}
				}
			}
			for i := range last {
				if roleOf(last[i].p) == role {
					b = &last[i]
				}
			}
			end := "– | – | –"
			if b != nil {
				end = fmt.Sprintf("%d | %.1f | %d", b.p.pid, mib(b.u.rssKB), b.u.fds)
			}
			fmt.Fprintf(w, "| %s | %d | %.1f | %d | %s | %.1f | %d |\n", role, a.p.pid, mib(a.u.rssKB), a.u.fds, end, mib(maxRSS), maxFDs)
		}
		fmt.Fprintln(w)
	}

	if len(s.faults) > 0 {
		fmt.Fprintln(w, "| # | at | round | fault | target | what | rank 0's step | outcome |")
		fmt.Fprintln(w, "| ---: | ---: | --- | --- | --- | --- | ---: | --- |")
		for _, f := range s.faults {
			fmt.Fprintf(w, "| %d | %v | %s | %s | %s | %s | %d | %s |\n", f.n, f.at.Round(time.Second), f.round, f.kind, f.target,
				strings.ReplaceAll(f.detail, "|", "/"), f.step, f.outcome())
		}
		fmt.Fprintln(w)
	}
}

func describeKind(k string) string {
	switch k {
	case faultKill:
		return "kill -9 of a rank"
	case faultStop:
		return "SIGSTOP, then SIGCONT, of a rank"
	case faultStranger:
		return "a stranger's bytes on every listening socket"
	case faultLink:
		return "a testbed host's link down, then up"
	}
	return k
}

// roleOf names a process by what it is in the job, which outlives its pid.
func roleOf(p proc) string {
	if p.rank < 0 {
		return fmt.Sprintf("ddprun (node %d)", p.node)
	}
	return fmt.Sprintf("rank %d", p.rank)
}

func mib(kb int64) float64 { return float64(kb) / 1024 }
