//go:build linux

package main

import (
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// soakConfig is the soak's flags.
type soakConfig struct {
	duration       time.Duration
	gap            span // between faults
	stopFor        span // SIGSTOP to SIGCONT
	linkDown       span // link down to up
	kinds          []string
	recoverTimeout time.Duration
	sampleEvery    time.Duration
	seed           uint64
	out            string
}

// sample is the resident memory and descriptors of one of the job's processes at a moment.
type sample struct {
	at    time.Duration
	round string
	p     proc
	u     usage
}

// soak is one run of the soak: the faults it injected and what the job did.
type soak struct {
	cfg      soakConfig
	c        *cluster
	spec     jobSpec
	rng      *rand.Rand
	sched    schedule
	start    time.Time
	log      io.Writer // the launchers' output
	events   io.Writer // one line per fault, as it happens (under eventsMu: both loops write)
	eventsMu sync.Mutex
	refCRC   string
	refTime  time.Duration

	mu      sync.Mutex
	cur     *round   // the round running now
	rounds  []*round // every round started, in order
	failure error    // the first thing that went wrong; the soak stops at it

	faults  []fault
	samples [][]sample // each healthy moment's samples, in order
}

func (s *soak) now() time.Duration { return time.Since(s.start).Round(time.Millisecond) }

func (s *soak) logf(format string, args ...any) {
	s.eventsMu.Lock()
	defer s.eventsMu.Unlock()
	fmt.Fprintf(s.events, "%9s  %s\n", s.now().Round(time.Second/10), fmt.Sprintf(format, args...))
}

func (s *soak) fail(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failure == nil {
		s.failure = err
	}
}

func (s *soak) failed() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failure
}

func (s *soak) current() *round {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}

// runRounds runs the job again and again until the soak's duration is over (a round
// started before then runs to its end), checking each one's params_crc32 against the
// reference's. It returns when the last round ends or one fails.
func (s *soak) runRounds() {
	for i := 1; ; i++ {
		if i > 1 && (time.Since(s.start) >= s.cfg.duration || s.failed() != nil) {
			return
		}
		name := fmt.Sprintf("round %d", i)
		r, err := startRound(s.c, s.spec, name, filepath.Join(s.cfg.out, fmt.Sprintf("ckpt-round%d", i)), s.log)
		if err != nil {
			s.fail(err)
			return
		}
		s.mu.Lock()
		s.cur = r
		s.rounds = append(s.rounds, r)
		s.mu.Unlock()
		s.logf("%s started", name)
		<-r.done
		p := r.progress()
		switch {
		case r.gaveUp:
			s.fail(fmt.Errorf("%s: %w after %d restarts: %v", name, errGaveUp, p.restarts, p.err))
		case p.err != nil:
			s.fail(fmt.Errorf("%s: %v", name, p.err))
		}
		if s.failed() != nil {
			s.logf("%s failed: %v", name, s.failed())
			return
		}
		crc, err := r.agreedCRC(s.c.nproc)
		if err != nil {
			s.fail(err)
			return
		}
		if crc != s.refCRC {
			s.fail(fmt.Errorf("%s: params_crc32=%s, the uninterrupted run's %s", name, crc, s.refCRC))
			return
		}
		s.logf("%s done in %v: %d restarts, params_crc32=%s as the uninterrupted run", name, r.elapsed.Round(time.Second), p.restarts, crc)
	}
}

// healthy returns the running round and its processes when every rank is up and rank 0
// has stepped since the round's last restart and since after.
func (s *soak) healthy(after time.Time) (*round, []proc, progress, bool) {
	r := s.current()
	if r == nil {
		return nil, nil, progress{}, false
	}
	p := r.progress()
	if p.finished || p.lastStep < 0 || !p.lastAt.After(p.restartAt) || !p.lastAt.After(after) {
		return nil, nil, p, false
	}
	ps, err := r.procs()
	if err != nil {
		return nil, nil, p, false
	}
	ranks := 0
	for _, q := range ps {
		if q.rank >= 0 {
			ranks++
		}
	}
	if ranks != s.c.nproc || len(ps) != s.c.nproc+s.c.nodes() {
		return nil, nil, p, false
	}
	return r, ps, p, true
}

func (s *soak) takeSample(r *round, ps []proc) {
	var set []sample
	for _, q := range ps {
		u, err := usageOf(q.pid)
		if err != nil || !q.same() {
			return // a process ended meanwhile: no sample this time
		}
		set = append(set, sample{at: s.now(), round: r.name, p: q, u: u})
	}
	slices.SortFunc(set, func(a, b sample) int { return order(a.p) - order(b.p) })
	s.samples = append(s.samples, set)
}

// order sorts the launchers (by node) before the ranks (by rank).
func order(p proc) int {
	if p.rank < 0 {
		return p.node - 1000
	}
	return p.rank
}

// run is the soak: the reference run, then the rounds under faults.
func (s *soak) run() error {
	s.start = time.Now()
	s.logf("reference: the job uninterrupted, %s", s.c)
	ref, err := startRound(s.c, s.spec, "reference", filepath.Join(s.cfg.out, "ckpt-reference"), s.log)
	if err != nil {
		return fmt.Errorf("the reference run: %w", err)
	}
	for wait := true; wait; {
		select {
		case <-ref.done:
			wait = false
		case <-time.After(200 * time.Millisecond):
			if err := s.failed(); err != nil {
				ref.stop()
				return err
			}
		}
	}
	if p := ref.progress(); p.err != nil || p.restarts > 0 {
		return fmt.Errorf("the reference run: %v (%d restarts), see %s", p.err, p.restarts, filepath.Join(s.cfg.out, "job.log"))
	}
	if s.refCRC, err = ref.agreedCRC(s.c.nproc); err != nil {
		return fmt.Errorf("the reference run: %w", err)
	}
	s.refTime = ref.elapsed
	s.logf("reference: params_crc32=%s in %v", s.refCRC, s.refTime.Round(time.Second))

	s.start = time.Now()
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.runRounds()
	}()
	defer func() {
		if r := s.current(); r != nil && s.failed() != nil {
			r.stop()
		}
		<-done
	}()
	return s.injectAll(done)
}

// injectAll injects a fault every gap while the soak lasts, each once the job is healthy,
// waits for each to be recovered from, and samples the processes between faults.
func (s *soak) injectAll(done <-chan struct{}) error {
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	next := time.Now().Add(s.cfg.gap.draw(s.rng))
	var lastSample, recoveredAt time.Time
	stalledSince := time.Now()
	lastSteps := -1
	for time.Since(s.start) < s.cfg.duration {
		select {
		case <-done:
			return s.failed()
		case <-tick.C:
		}
		if err := s.failed(); err != nil {
			return err
		}
		r, ps, p, ok := s.healthy(recoveredAt)
		if cur := s.current(); cur != nil {
			if q := cur.progress(); q.steps != lastSteps || q.finished {
				lastSteps, stalledSince = q.steps, time.Now()
			}
		}
		if time.Since(stalledSince) > s.cfg.recoverTimeout {
			err := fmt.Errorf("no step for %v with no fault pending", s.cfg.recoverTimeout)
			s.fail(err)
			return err
		}
		if !ok {
			continue
		}
		if time.Since(lastSample) >= s.cfg.sampleEvery {
			s.takeSample(r, ps)
			lastSample = time.Now()
		}
		if time.Now().Before(next) {
			continue
		}
		f := s.inject(r, ps, p)
		s.faults = append(s.faults, f)
		if !f.recovered {
			err := fmt.Errorf("fault %d (%s %s) not recovered from: %s", f.n, f.kind, f.target, f.note)
			s.fail(err)
			return err
		}
		recoveredAt = time.Now()
		lastSample = time.Time{} // a sample after each recovery
		next = time.Now().Add(s.cfg.gap.draw(s.rng))
	}
	// The last samples: the end of the soak's faults.
	if r, ps, _, ok := s.healthy(recoveredAt); ok {
		s.takeSample(r, ps)
	}
	return nil
}

// inject injects the schedule's next fault into round r, whose processes are ps and whose
// progress was p, then waits for the job to recover.
func (s *soak) inject(r *round, ps []proc, p progress) fault {
	kind := s.sched.next()
	f := fault{n: len(s.faults) + 1, kind: kind, at: s.now(), round: r.name, step: p.lastStep}
	var ranks []proc
	for _, q := range ps {
		if q.rank >= 0 {
			ranks = append(ranks, q)
		}
	}
	victim := ranks[s.rng.IntN(len(ranks))]
	s.logf("fault %d: %s (%s, rank 0 at step %d)", f.n, kind, r.name, f.step)
	switch kind {
	case faultKill:
		f.target = victim.String()
		f.detail = "SIGKILL"
		if err := signalRank(victim, syscall.SIGKILL); err != nil {
			f.note = err.Error()
		}
	case faultStop:
		d := s.cfg.stopFor.draw(s.rng)
		f.target = victim.String()
		f.detail = "SIGSTOP for " + d.Round(time.Millisecond).String()
		if err := signalRank(victim, syscall.SIGSTOP); err != nil {
			f.note = err.Error()
			break
		}
		time.Sleep(d)
		if err := signalRank(victim, syscall.SIGCONT); err != nil {
			f.detail += " (gone before SIGCONT)"
		}
	case faultStranger:
		var ls []listener
		for _, q := range ps {
			l, err := listeners(q.pid)
			if err != nil {
				continue // it exited
			}
			ls = append(ls, l...)
		}
		f.target = fmt.Sprintf("%d listening sockets", len(ls))
		var hit, closed []string
		for _, l := range ls {
			res := stranger(l, 2*time.Second)
			switch {
			case res.err != nil:
				hit = append(hit, l.String()+" ("+res.err.Error()+")")
			case res.closed:
				closed = append(closed, l.String())
			default:
				hit = append(hit, l.String()+" (still open after 2s)")
			}
		}
		f.detail = fmt.Sprintf("%d B each; closed by the job: %s", strangerBytes, strings.Join(closed, " "))
		if len(hit) > 0 {
			f.detail += "; not closed: " + strings.Join(hit, " ")
		}
		if len(ls) == 0 {
			f.note = "no listening socket found"
		}
	case faultLink:
		h := s.rng.IntN(s.c.tb.Hosts())
		d := s.cfg.linkDown.draw(s.rng)
		f.target = fmt.Sprintf("host %d's link", h)
		f.detail = "down for " + d.Round(time.Millisecond).String()
		if err := s.c.tb.SetLink(h, false); err != nil {
			f.note = err.Error()
			break
		}
		time.Sleep(d)
		if err := s.c.tb.SetLink(h, true); err != nil {
			f.note = "bringing it back up: " + err.Error()
			s.logf("fault %d: %v", f.n, err)
			return f
		}
	}
	if f.note != "" {
		s.logf("fault %d: %s %s: %s", f.n, kind, f.target, f.note)
		return f
	}
	s.logf("fault %d: %s %s, %s", f.n, kind, f.target, f.detail)
	s.awaitRecovery(r, p, &f)
	s.logf("fault %d: %s", f.n, f.outcome())
	return f
}

// awaitRecovery waits until rank 0 of round r steps past f.step after the fault's end (and
// after the group's restart, if one followed: a kill is always followed by one), or r ends
// well, for at most the recovery timeout.
func (s *soak) awaitRecovery(r *round, before progress, f *fault) {
	end := time.Now()
	deadline := end.Add(s.cfg.recoverTimeout)
	for time.Now().Before(deadline) {
		p := r.progress()
		f.restarts = p.restarts - before.restarts
		switch {
		case p.lastStep > f.step && p.lastAt.After(end) && p.lastAt.After(p.restartAt) &&
			(f.kind != faultKill || f.restarts > 0):
			f.recovered, f.recovery = true, p.lastAt.Sub(end)
			return
		case p.finished && p.err == nil && !r.gaveUp:
			f.recovered, f.recovery = true, time.Since(end)
			f.note = "the round ended meanwhile"
			return
		case p.finished:
			f.note = fmt.Sprintf("the round ended: %v", p.err)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	f.note = fmt.Sprintf("rank 0 did not step past %d within %v", f.step, s.cfg.recoverTimeout)
}

func (f fault) outcome() string {
	if !f.recovered {
		return "NOT recovered: " + f.note
	}
	s := fmt.Sprintf("recovered in %v (%d restarts)", f.recovery.Round(time.Millisecond), f.restarts)
	if f.note != "" {
		s += ", " + f.note
	}
	return s
}

// mkOut makes the soak's output directory.
func mkOut(dir string) (string, error) {
	if dir == "" {
		return os.MkdirTemp("", "fault-soak-")
	}
	return dir, os.MkdirAll(dir, 0o755)
}
