package observe

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/term"
)

// ProgressMode chooses how a Progress writes.
type ProgressMode int

const (
	// ProgressAuto: a line redrawn in place (carriage return) on the user's terminal
	// (IsUserTerminal), plain periodic lines otherwise (a pipe, a file, ddprun's rank
	// prefixes, mpirun's pseudo-terminal).
	ProgressAuto ProgressMode = iota
	// ProgressTerminal always redraws one line.
	ProgressTerminal
	// ProgressPlain always writes whole lines.
	ProgressPlain
)

// ProgressOptions configure a Progress.
type ProgressOptions struct {
	// Total is the number of steps of the run (0: unknown, no ETA).
	Total int
	// Mode: see ProgressMode.
	Mode ProgressMode
	// Every is the least time between two lines: default 200ms on a terminal, 10s
	// otherwise. The first and the last step are always shown.
	Every time.Duration
	// Now is the clock (default time.Now), for tests.
	Now func() time.Time
}

// Progress shows a training run's progress: step, loss, ms/step and the ETA, as
//
//	step 120/1000  loss 3.4521  412.3 ms/step  ETA 6m2s
//
// It is safe for concurrent use.
type Progress struct {
	w     io.Writer
	tty   bool
	total int
	every time.Duration
	now   func() time.Time

	mu        sync.Mutex // guards the fields below
	started   bool
	t0        time.Time // when the first step was reported
	step0     int
	lastShown time.Time
	lastStep  int
	shownAt   time.Time // when lastStep was shown, for ms/step since then
	width     int       // length of the line on screen (terminal mode)
	done      bool
}

// IsUserTerminal reports whether w is a terminal that the user watches: a terminal
// (golang.org/x/term.IsTerminal on its descriptor), but not the pseudo-terminal through
// which mpirun (Open MPI: OMPI_COMM_WORLD_RANK or PMIX_RANK set) collects a rank's output
// into its own, which may well be a pipe or a log file. lookup reads the environment (nil:
// os.LookupEnv).
func IsUserTerminal(w io.Writer, lookup func(string) (string, bool)) bool {
	f, ok := w.(interface{ Fd() uintptr })
	if !ok || !term.IsTerminal(int(f.Fd())) {
		return false
	}
	if lookup == nil {
		lookup = os.LookupEnv
	}
	for _, v := range []string{"OMPI_COMM_WORLD_RANK", "PMIX_RANK"} {
		if _, ok := lookup(v); ok {
			return false
		}
	}
	return true
}

// NewProgress returns a Progress writing to w.
func NewProgress(w io.Writer, opts ProgressOptions) *Progress {
	tty := false
	switch opts.Mode {
	case ProgressTerminal:
		tty = true
	case ProgressAuto:
		tty = IsUserTerminal(w, nil)
	}
	if opts.Every <= 0 {
		opts.Every = 10 * time.Second
		if tty {
			opts.Every = 200 * time.Millisecond
		}
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Progress{w: w, tty: tty, total: opts.Total, every: opts.Every, now: opts.Now}
}

// Update reports that step (counted from 0) has finished with loss. The ms/step is the mean
// since the previous line; the ETA extrapolates the mean since the first Update.
func (p *Progress) Update(step int, loss float64) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.now()
	if !p.started {
		p.started, p.t0, p.step0, p.lastStep, p.shownAt = true, now, step, step, now
		p.show(step, loss, 0, now)
		return
	}
	last := p.total > 0 && step >= p.total-1
	if !last && now.Sub(p.lastShown) < p.every {
		return
	}
	var per time.Duration
	if n := step - p.lastStep; n > 0 {
		per = now.Sub(p.shownAt) / time.Duration(n)
	}
	p.show(step, loss, per, now)
	p.lastStep, p.shownAt = step, now
	if last {
		p.finish()
	}
}

// show writes the line. p.mu must be held.
func (p *Progress) show(step int, loss float64, per time.Duration, now time.Time) {
	p.lastShown = now
	var b strings.Builder
	if p.total > 0 {
		fmt.Fprintf(&b, "step %d/%d", step+1, p.total)
	} else {
		fmt.Fprintf(&b, "step %d", step+1)
	}
	fmt.Fprintf(&b, "  loss %.4f", loss)
	if per > 0 {
		fmt.Fprintf(&b, "  %.1f ms/step", float64(per)/1e6)
	}
	if n := step - p.step0; p.total > 0 && n > 0 {
		left := p.total - 1 - step
		eta := now.Sub(p.t0) / time.Duration(n) * time.Duration(left)
		fmt.Fprintf(&b, "  ETA %s", eta.Round(time.Second))
	}
	line := b.String()
	if !p.tty {
		fmt.Fprintln(p.w, line)
		return
	}
	pad := ""
	if len(line) < p.width {
		pad = strings.Repeat(" ", p.width-len(line))
	}
	p.width = len(line)
	fmt.Fprint(p.w, "\r"+line+pad)
}

// finish ends the terminal line. p.mu must be held.
func (p *Progress) finish() {
	if p.tty && !p.done && p.started {
		fmt.Fprintln(p.w)
	}
	p.done = true
}

// Done ends the progress display (on a terminal, it moves to the next line). Call it when
// the run stops before its last step too.
func (p *Progress) Done() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.finish()
}
