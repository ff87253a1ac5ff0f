//go:build linux

package main

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"syscall"
	"time"
)

// The kinds of fault.
const (
	faultKill     = "kill"     // kill -9 of a rank
	faultStop     = "stop"     // SIGSTOP of a rank, SIGCONT after a while
	faultStranger = "stranger" // a stranger's bytes on every listening socket of the job
	faultLink     = "link"     // a testbed host's link down, up after a while
)

var allFaults = []string{faultKill, faultStop, faultStranger, faultLink}

// parseFaults reads --faults: a comma-separated list of kinds.
func parseFaults(s string) ([]string, error) {
	var kinds []string
	for k := range strings.SplitSeq(s, ",") {
		k = strings.TrimSpace(k)
		if !slices.Contains(allFaults, k) {
			return nil, fmt.Errorf("--faults %q: unknown kind %q (want some of %s)", s, k, strings.Join(allFaults, ","))
		}
		if !slices.Contains(kinds, k) {
			kinds = append(kinds, k)
		}
	}
	return kinds, nil
}

// span is a range of durations to draw from, both ends included.
type span struct{ lo, hi time.Duration }

func (s span) String() string { return s.lo.String() + "–" + s.hi.String() }

func (s span) draw(rng *rand.Rand) time.Duration {
	if s.hi <= s.lo {
		return s.lo
	}
	return s.lo + time.Duration(rng.Int64N(int64(s.hi-s.lo)+1))
}

// parseSpan reads "LO-HI" (two durations) or one duration.
func parseSpan(name, v string) (span, error) {
	lo, hi, ok := strings.Cut(v, "-")
	if !ok {
		hi = lo
	}
	a, err1 := time.ParseDuration(strings.TrimSpace(lo))
	b, err2 := time.ParseDuration(strings.TrimSpace(hi))
	if err1 != nil || err2 != nil || a <= 0 || b < a {
		return span{}, fmt.Errorf("--%s %q: want LO-HI, two positive durations, LO at most HI (e.g. 30s-90s)", name, v)
	}
	return span{a, b}, nil
}

// schedule deals the kinds out in rounds: every kind once, in a random order, then again,
// so that each gets its share of the faults.
type schedule struct {
	rng   *rand.Rand
	kinds []string
	deck  []string
}

func (s *schedule) next() string {
	if len(s.deck) == 0 {
		s.deck = slices.Clone(s.kinds)
		s.rng.Shuffle(len(s.deck), func(i, j int) { s.deck[i], s.deck[j] = s.deck[j], s.deck[i] })
	}
	k := s.deck[0]
	s.deck = s.deck[1:]
	return k
}

// fault is one injected fault and what followed it.
type fault struct {
	n         int
	kind      string
	at        time.Duration // since the soak's start
	round     string
	target    string
	detail    string
	step      int // rank 0's last step before it
	recovered bool
	recovery  time.Duration // from the fault's end to rank 0's next step past step
	restarts  int           // group restarts between the fault and its recovery
	note      string        // why it did not recover, or what else was seen
}

// signalRank sends sig to p, unless p has exited (or its pid is another process's now).
func signalRank(p proc, sig syscall.Signal) error {
	if !p.same() {
		return fmt.Errorf("%v is gone", p)
	}
	return syscall.Kill(p.pid, sig)
}
