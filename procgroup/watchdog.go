package procgroup

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
)

// Environment variables read by WatchdogOptions.Validate. A value is a Go duration ("90s",
// "30m") or a plain number of seconds ("90").
const (
	// TimeoutEnv bounds each collective (WatchdogOptions.Timeout).
	TimeoutEnv = "GODDP_COLLECTIVE_TIMEOUT"
	// StallWarnEnv is the wait after which a stalled collective is reported
	// (WatchdogOptions.WarnAfter).
	StallWarnEnv = "GODDP_STALL_WARN"
)

// DefaultStallWarn is WatchdogOptions.WarnAfter's default (Horovod's stall-check default),
// lowered to half the timeout when the timeout is shorter.
const DefaultStallWarn = 60 * time.Second

// WatchdogOptions configure WithWatchdog. The zero value is ready to use.
type WatchdogOptions struct {
	// Timeout bounds each collective, from the moment it is issued: at the timeout the
	// group is aborted on every rank. Zero means $GODDP_COLLECTIVE_TIMEOUT, else
	// DefaultTimeout.
	Timeout time.Duration
	// WarnAfter is how long a collective may wait before the log reports which ranks have
	// not joined it. Zero means $GODDP_STALL_WARN, else DefaultStallWarn (at most half of
	// Timeout).
	WarnAfter time.Duration
	// Interval is the period at which the watchdog checks the oldest pending collective
	// and polls the group's abort flag in the store (default WarnAfter/4, at most 1 s, at
	// least 10 ms). A change in this rank's progress is published in the store within
	// Interval/10, and at most once per Interval/10 (Note [Stall report]).
	Interval time.Duration
	// Host names this rank's machine in reports (default os.Hostname()).
	Host string
	// Logger receives the stall warnings; nil means zap.NewNop().
	Logger *zap.Logger
	// OnAbort, if set, is called once, from the watchdog's goroutine, when the watchdog
	// aborts the group (a local timeout, or another rank's, seen in the store). A program
	// whose rank may be stuck outside any collective uses it to stop that rank (for
	// instance by cancelling its context). It must not block.
	OnAbort func(err error)
	// LookupEnv reads the environment; nil means os.LookupEnv.
	LookupEnv func(string) (string, bool)
}

// Validate fills defaults (from the environment where an option is zero) and checks o.
func (o *WatchdogOptions) Validate() error {
	lookup := o.LookupEnv
	if lookup == nil {
		lookup = os.LookupEnv
	}
	if o.Timeout == 0 {
		d, err := envDuration(lookup, TimeoutEnv)
		if err != nil {
			return err
		}
		o.Timeout = d
		if o.Timeout == 0 {
			o.Timeout = DefaultTimeout
		}
	}
	if o.WarnAfter == 0 {
		d, err := envDuration(lookup, StallWarnEnv)
		if err != nil {
			return err
		}
		o.WarnAfter = d
		if o.WarnAfter == 0 {
			o.WarnAfter = min(DefaultStallWarn, o.Timeout/2)
		}
	}
	switch {
	case o.Timeout < 0:
		return fmt.Errorf("%w: watchdog timeout %v is negative", ErrInvalidArgument, o.Timeout)
	case o.WarnAfter < 0:
		return fmt.Errorf("%w: watchdog stall warning %v is negative", ErrInvalidArgument, o.WarnAfter)
	case o.Interval < 0:
		return fmt.Errorf("%w: watchdog interval %v is negative", ErrInvalidArgument, o.Interval)
	}
	if o.Interval == 0 {
		o.Interval = min(time.Second, o.WarnAfter/4, o.Timeout/4)
	}
	o.Interval = max(o.Interval, 10*time.Millisecond)
	if o.Host == "" {
		h, err := os.Hostname()
		if err != nil || h == "" {
			h = "unknown-host"
		}
		o.Host = h
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	return nil
}

// envDuration parses the variable name as a duration or a number of seconds; unset or
// empty gives 0.
func envDuration(lookup func(string) (string, bool), name string) (time.Duration, error) {
	v, ok := lookup(name)
	v = strings.TrimSpace(v)
	if !ok || v == "" {
		return 0, nil
	}
	if s, err := strconv.ParseFloat(v, 64); err == nil {
		if s <= 0 {
			return 0, fmt.Errorf("%w: %s=%q: want a positive duration", ErrInvalidArgument, name, v)
		}
		return time.Duration(s * float64(time.Second)), nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("%w: %s=%q: want a positive duration such as 90s or 30m", ErrInvalidArgument, name, v)
	}
	return d, nil
}

// RankProgress is a rank's progress as its watchdog last published it.
type RankProgress struct {
	Rank int
	Host string // "?" if the rank never published
	// Issued and Completed are the sequence numbers of the last collective the rank
	// issued and of the last one that completed there (0: none).
	Issued, Completed int64
}

func (p RankProgress) String() string { return fmt.Sprintf("%d (%s)", p.Rank, p.Host) }

// CollectiveTimeoutError is the error of a collective that did not complete within the
// watchdog's timeout, as the rank whose watchdog fired saw it. It wraps ErrTimeout.
type CollectiveTimeoutError struct {
	Rank    int
	Host    string
	Op      CollectiveOp
	Seq     int64
	After   time.Duration
	Missing []RankProgress // the ranks that had not issued the collective
}

func (e *CollectiveTimeoutError) Error() string {
	return fmt.Sprintf("procgroup: rank %d (%s): %s #%d timed out after %v: %s",
		e.Rank, e.Host, e.Op, e.Seq, e.After, missingText(e.Missing, e.Op, e.Seq))
}

func (e *CollectiveTimeoutError) Unwrap() error { return ErrTimeout }

// RemoteAbortError is the error of a rank whose group was aborted by another rank's
// watchdog, which it learnt from the store. It wraps ErrTimeout (the watchdog aborts a
// group through the store only at a timeout); Reason is the other rank's
// CollectiveTimeoutError text.
type RemoteAbortError struct {
	Rank   int // this rank
	By     int // the rank whose watchdog aborted the group
	Reason string
}

func (e *RemoteAbortError) Error() string {
	return fmt.Sprintf("procgroup: rank %d: group aborted by rank %d: %s", e.Rank, e.By, e.Reason)
}

func (e *RemoteAbortError) Unwrap() error { return ErrTimeout }

// missingText renders "ranks 2 (b), 3 (c) have not joined allreduce #57; they last
// completed #41" for an error or a warning.
func missingText(missing []RankProgress, op CollectiveOp, seq int64) string {
	if len(missing) == 0 {
		return fmt.Sprintf("every rank has joined %s #%d, which has not completed", op, seq)
	}
	var b strings.Builder
	names := make([]string, len(missing))
	done := make([]string, len(missing))
	same := true
	for i, m := range missing {
		names[i] = m.String()
		done[i] = "#" + strconv.FormatInt(m.Completed, 10)
		same = same && m.Completed == missing[0].Completed
	}
	if same {
		done = done[:1]
	}
	if len(missing) == 1 {
		fmt.Fprintf(&b, "rank %s has not joined %s #%d; it last completed %s", names[0], op, seq, done[0])
	} else {
		fmt.Fprintf(&b, "ranks %s have not joined %s #%d; they last completed %s",
			strings.Join(names, ", "), op, seq, strings.Join(done, ", "))
	}
	return b.String()
}

// Store keys of the watchdog, under the store given to WithWatchdog.
const (
	wdAbortKey  = "abort"     // "<rank>\n<reason>", set once by the first watchdog to fire
	wdStatusKey = "progress/" // + rank: "<issued> <completed> <host>"
)

// peekSentinel is a value no key holds: CompareAndSet with it as expected value reads a
// key without waiting (Store.Get waits for absent keys) and never swaps.
var peekSentinel = []byte("\x00goddp-peek\x00")

// peek reads key, returning nil if it is absent, without waiting.
func peek(ctx context.Context, s Store, key string) ([]byte, error) {
	v, _, err := s.CompareAndSet(ctx, key, peekSentinel, peekSentinel)
	return v, err
}

// WithWatchdog wraps pg (of any backend) in a watchdog that numbers its collectives and
// bounds each of them.
//
// The collectives are numbered 1, 2, ... in issue order (invalid calls, which fail at once
// with ErrInvalidArgument, take no number). One goroutine publishes this rank's last issued
// and last completed numbers and its host in store within opts.Interval/10 of a change (at
// most once per Interval/10, whatever the rate of collectives), and every opts.Interval
// polls the group's abort flag. When the oldest pending collective has waited
// opts.WarnAfter, it reads every rank's progress and logs the ranks that have not issued it
// (Note [Stall report]); at opts.Timeout it sets the abort flag with a
// *CollectiveTimeoutError, aborts pg with it, and every other rank's watchdog, seeing the
// flag, aborts its own group with a
// *RemoteAbortError (so a rank stuck outside any collective fails too: its next collective
// fails at once, and opts.OnAbort is called).
//
// The works it returns are pg's, with one change: a work that fails because the group was
// aborted (errors.Is ErrAborted or ErrPeerLost) while a watchdog's abort reason is set
// reports that reason first (reading the store once, on that failure path only), so every
// waiting rank's error names the op, the sequence number and the missing ranks.
//
// store should be private to the group (a PrefixStore): all ranks' watchdogs must share it.
// Close and Abort stop the watchdog's goroutine and wait for it, and close or abort pg.
func WithWatchdog(pg ProcessGroup, store Store, opts WatchdogOptions) (ProcessGroup, error) {
	if pg == nil || store == nil {
		return nil, fmt.Errorf("%w: WithWatchdog needs a group and a store", ErrInvalidArgument)
	}
	if err := opts.Validate(); err != nil {
		return nil, fmt.Errorf("procgroup: watchdog: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	w := &watchdog{
		inner: pg, store: store, opts: opts, rank: pg.Rank(), size: pg.Size(),
		log:  opts.Logger.With(zap.String("component", "watchdog")),
		ctx:  ctx,
		stop: cancel,
		kick: make(chan struct{}, 1),
	}
	// The first publication is synchronous, so that a peer's report never finds this rank
	// unknown once the group exists.
	w.publish()
	w.wg.Add(1)
	go w.run()
	return w, nil
}

// Note [Stall report]: a rank has "joined" collective #s when its published Issued is at
// least s, and the report gives its published Completed. A rank that is stuck cannot
// publish (a rank frozen by SIGSTOP runs no code at all), so the report is only true if
// every rank published its progress before it stopped, promptly. Publishing once per
// Interval would leave up to an Interval of completions unpublished (and report a rank
// frozen within its first Interval as having completed #0). So the monitor publishes on
// change, with a hold-off: after a publication it waits publishDelay (Interval/10) before
// the next, then publishes the first change at once. It learns of that change by waiting
// on the oldest pending work's Done channel and on kick, which issue signals without
// blocking; while it holds off it watches neither, so however fast collectives complete it
// wakes about once per publishDelay and writes at most one key per publishDelay (after a
// failed write it waits an Interval). The caller's path gains one non-blocking channel send
// per collective. A rank that stopped more than publishDelay (plus a store round trip)
// after its last change is reported exactly. Stall reports, timeouts and the abort flag
// use the store only when something is wrong, or once per Interval.

type pendingWork struct {
	seq   int64
	op    CollectiveOp
	start time.Time
	work  Work
}

type watchdog struct {
	inner      ProcessGroup
	store      Store
	opts       WatchdogOptions
	log        *zap.Logger
	rank, size int

	ctx  context.Context // store calls; cancelled by stop
	stop context.CancelFunc
	wg   sync.WaitGroup // the monitor goroutine
	once sync.Once      // guards the stop sequence

	mu        sync.Mutex // guards the fields below
	issued    int64
	completed int64
	pending   []pendingWork // issue order; works complete in that order
	cause     error         // the watchdog's abort reason, once known

	// kick is signalled (without blocking) by issue, so that the monitor publishes the
	// change (Note [Stall report]).
	kick chan struct{}

	// Owned by the monitor goroutine (and WithWatchdog before it starts).
	published               bool      // pubIssued and pubCompleted are in the store
	pubIssued, pubCompleted int64     // the progress last published
	nextPub                 time.Time // no publication before this (Note [Stall report])
	warned                  int64     // the last sequence number reported as stalled
	fired                   bool      // the watchdog has aborted the group
}

var _ ProcessGroup = (*watchdog)(nil)

func (w *watchdog) Rank() int { return w.rank }
func (w *watchdog) Size() int { return w.size }

// issue numbers and records the collective that call issues on the inner group. It holds
// w.mu across the call, so that numbers follow the inner group's issue order.
func (w *watchdog) issue(op CollectiveOp, call func() Work) Work {
	w.mu.Lock()
	defer w.mu.Unlock()
	wk := call()
	select {
	case <-wk.Done():
		if errors.Is(wk.Err(), ErrInvalidArgument) {
			return wk // takes no sequence number, as in the backends
		}
		w.issued++
		if len(w.pending) == 0 {
			w.completed = w.issued
			w.signal()
			return w.wrap(wk)
		}
	default:
		w.issued++
	}
	w.pending = append(w.pending, pendingWork{seq: w.issued, op: op, start: time.Now(), work: wk})
	w.signal()
	return w.wrap(wk)
}

// signal tells the monitor that this rank's progress changed, without blocking.
func (w *watchdog) signal() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

func (w *watchdog) wrap(wk Work) Work { return &wdWork{Work: wk, w: w} }

// Unwrap implements Unwrapper: the group the watchdog wraps.
func (w *watchdog) Unwrap() ProcessGroup { return w.inner }

func (w *watchdog) AllReduce(ctx context.Context, buf any, op ReduceOp) Work {
	return w.issue(OpAllReduce, func() Work { return w.inner.AllReduce(ctx, buf, op) })
}

func (w *watchdog) Broadcast(ctx context.Context, buf any, root int) Work {
	return w.issue(OpBroadcast, func() Work { return w.inner.Broadcast(ctx, buf, root) })
}

func (w *watchdog) AllGather(ctx context.Context, out, in any) Work {
	return w.issue(OpAllGather, func() Work { return w.inner.AllGather(ctx, out, in) })
}

func (w *watchdog) ReduceScatter(ctx context.Context, out, in any, op ReduceOp) Work {
	return w.issue(OpReduceScatter, func() Work { return w.inner.ReduceScatter(ctx, out, in, op) })
}

func (w *watchdog) Barrier(ctx context.Context) Work {
	return w.issue(OpBarrier, func() Work { return w.inner.Barrier(ctx) })
}

// Close closes the inner group (the watchdog keeps running meanwhile, so a Close stuck on
// a hung collective still ends at the timeout), then stops the watchdog.
func (w *watchdog) Close() error {
	err := w.inner.Close()
	w.shutdown()
	return err
}

// Abort aborts the inner group and stops the watchdog.
func (w *watchdog) Abort(cause error) {
	w.inner.Abort(cause)
	w.shutdown()
}

func (w *watchdog) shutdown() {
	w.once.Do(func() {
		w.stop()
		w.wg.Wait()
	})
}

// publishDelay is the hold-off between two publications of this rank's progress, and so
// the bound on how stale a publication is (Note [Stall report]).
func (w *watchdog) publishDelay() time.Duration { return max(w.opts.Interval/10, time.Millisecond) }

func (w *watchdog) run() {
	defer w.wg.Done()
	t := time.NewTicker(w.opts.Interval)
	defer t.Stop()
	hold := time.NewTimer(time.Hour)
	hold.Stop()
	defer hold.Stop()
	for {
		// Note [Stall report]: wait for a change, or for the end of the hold-off.
		var kick, done <-chan struct{}
		var held <-chan time.Time
		if !w.fired {
			if d := time.Until(w.nextPub); d > 0 {
				hold.Reset(d)
				held = hold.C
			} else {
				kick, done = w.kick, w.oldestDone()
			}
		}
		select {
		case <-w.ctx.Done():
			return
		case now := <-t.C:
			w.check(now)
		case <-kick:
			w.flush()
		case <-done:
			w.flush()
		case <-held:
			w.flush()
		}
	}
}

// oldestDone is the Done channel of the oldest pending work (nil if none).
func (w *watchdog) oldestDone() <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.pending) == 0 {
		return nil
	}
	return w.pending[0].work.Done()
}

// retire moves completed works from pending to w.completed and returns the oldest work
// still pending (zero if none). w.mu must be held.
func (w *watchdog) retire() pendingWork {
	for len(w.pending) > 0 && isDone(w.pending[0].work) {
		w.completed = w.pending[0].seq
		w.pending[0] = pendingWork{}
		w.pending = w.pending[1:]
	}
	if len(w.pending) == 0 {
		return pendingWork{}
	}
	return w.pending[0]
}

// flush retires completed works and publishes this rank's progress if it changed.
func (w *watchdog) flush() {
	w.mu.Lock()
	w.retire()
	w.mu.Unlock()
	if !w.fired {
		w.publish()
	}
}

// check is one round of the monitor: retire completed works, publish progress, poll the
// abort flag, report a stall or time out the oldest pending collective.
func (w *watchdog) check(now time.Time) {
	w.mu.Lock()
	oldest := w.retire()
	w.mu.Unlock()
	if w.fired {
		return
	}
	w.publish()
	if cause := w.pollAbort(); cause != nil {
		w.fire(cause)
		return
	}
	if oldest.work == nil {
		return
	}
	waited := now.Sub(oldest.start)
	switch {
	case waited >= w.opts.Timeout:
		missing := w.missing(oldest.seq)
		terr := &CollectiveTimeoutError{
			Rank: w.rank, Host: w.opts.Host, Op: oldest.op, Seq: oldest.seq,
			After: w.opts.Timeout, Missing: missing,
		}
		reason := []byte(strconv.Itoa(w.rank) + "\n" + terr.Error())
		ctx, cancel := context.WithTimeout(w.ctx, w.storeTimeout())
		cur, swapped, err := w.store.CompareAndSet(ctx, wdAbortKey, nil, reason)
		cancel()
		var cause error = terr
		if err != nil {
			w.log.Warn("cannot publish the abort to the other ranks", zap.Error(err))
		} else if !swapped {
			cause = w.remoteErr(cur) // another rank's watchdog fired first: report its reason
		}
		w.log.Error("collective timed out; aborting the group", zap.String("op", oldest.op.String()),
			zap.Int64("seq", oldest.seq), zap.Error(cause))
		w.fire(cause)
	case waited >= w.opts.WarnAfter && w.warned < oldest.seq:
		w.warned = oldest.seq
		missing := w.missing(oldest.seq)
		ranks := make([]int, len(missing))
		for i, m := range missing {
			ranks[i] = m.Rank
		}
		w.log.Warn(fmt.Sprintf("%s after %v", missingText(missing, oldest.op, oldest.seq), waited.Round(time.Millisecond)),
			zap.String("op", oldest.op.String()), zap.Int64("seq", oldest.seq), zap.Ints("missing_ranks", ranks),
			zap.Duration("waited", waited))
	}
}

// fire aborts the inner group with cause, once.
func (w *watchdog) fire(cause error) {
	w.fired = true
	w.mu.Lock()
	w.cause = cause
	w.mu.Unlock()
	w.inner.Abort(cause)
	if w.opts.OnAbort != nil {
		w.opts.OnAbort(cause)
	}
}

// storeTimeout bounds each store call of the watchdog, so a dead store never wedges it.
func (w *watchdog) storeTimeout() time.Duration { return max(w.opts.Interval, 2*time.Second) }

// publish writes this rank's progress if it changed since the last time, and holds off
// the next publication for publishDelay.
func (w *watchdog) publish() {
	w.mu.Lock()
	issued, completed := w.issued, w.completed
	w.mu.Unlock()
	if w.published && issued == w.pubIssued && completed == w.pubCompleted {
		return
	}
	v := fmt.Appendf(nil, "%d %d %s", issued, completed, w.opts.Host)
	ctx, cancel := context.WithTimeout(w.ctx, w.storeTimeout())
	defer cancel()
	err := w.store.Set(ctx, wdStatusKey+strconv.Itoa(w.rank), v)
	if err != nil {
		// Retried at the next round: a store that fails or hangs must not keep the
		// monitor from its checks.
		w.nextPub = time.Now().Add(w.opts.Interval)
		if w.ctx.Err() == nil {
			w.log.Debug("cannot publish progress", zap.Error(err))
		}
		return
	}
	w.nextPub = time.Now().Add(w.publishDelay())
	w.published, w.pubIssued, w.pubCompleted = true, issued, completed
}

// pollAbort returns the error of another rank's abort, if the flag is set.
func (w *watchdog) pollAbort() error {
	ctx, cancel := context.WithTimeout(w.ctx, w.storeTimeout())
	defer cancel()
	v, err := peek(ctx, w.store, wdAbortKey)
	if err != nil || v == nil {
		return nil
	}
	return w.remoteErr(v)
}

// remoteErr decodes the abort flag's value.
func (w *watchdog) remoteErr(v []byte) error {
	by, reason, _ := strings.Cut(string(v), "\n")
	r, err := strconv.Atoi(by)
	if err != nil {
		r = -1
	}
	return &RemoteAbortError{Rank: w.rank, By: r, Reason: reason}
}

// progress reads every rank's published progress (this rank's from memory).
func (w *watchdog) progress() []RankProgress {
	ctx, cancel := context.WithTimeout(w.ctx, w.storeTimeout())
	defer cancel()
	ps := make([]RankProgress, w.size)
	for r := range ps {
		ps[r] = RankProgress{Rank: r, Host: "?"}
		if r == w.rank {
			w.mu.Lock()
			ps[r].Host, ps[r].Issued, ps[r].Completed = w.opts.Host, w.issued, w.completed
			w.mu.Unlock()
			continue
		}
		v, err := peek(ctx, w.store, wdStatusKey+strconv.Itoa(r))
		if err != nil || v == nil {
			continue
		}
		f := strings.SplitN(string(v), " ", 3)
		if len(f) != 3 {
			continue
		}
		ps[r].Issued, _ = strconv.ParseInt(f[0], 10, 64)
		ps[r].Completed, _ = strconv.ParseInt(f[1], 10, 64)
		ps[r].Host = f[2]
	}
	return ps
}

// missing lists the ranks that have not issued collective seq.
func (w *watchdog) missing(seq int64) []RankProgress {
	var m []RankProgress
	for _, p := range w.progress() {
		if p.Issued < seq {
			m = append(m, p)
		}
	}
	return m
}

// abortCause returns the watchdog's abort reason: the one this rank knows, else the
// store's flag (read once per call; used on failure paths only).
func (w *watchdog) abortCause() error {
	w.mu.Lock()
	cause := w.cause
	w.mu.Unlock()
	if cause != nil {
		return cause
	}
	ctx, cancel := context.WithTimeout(context.Background(), w.storeTimeout())
	defer cancel()
	v, err := peek(ctx, w.store, wdAbortKey)
	if err != nil || v == nil {
		return nil
	}
	return w.remoteErr(v)
}

func isDone(wk Work) bool {
	select {
	case <-wk.Done():
		return true
	default:
		return false
	}
}

// wdWork is a Work of the watchdog: the inner work, whose error gains the watchdog's
// abort reason when the group was aborted by a watchdog (see WithWatchdog).
type wdWork struct {
	Work
	w    *watchdog
	once sync.Once
	err  error
}

func (x *wdWork) result() error {
	x.once.Do(func() {
		err := x.Work.Err()
		x.err = err
		if err == nil || !(errors.Is(err, ErrAborted) || errors.Is(err, ErrPeerLost)) {
			return
		}
		cause := x.w.abortCause()
		if cause == nil || errors.Is(err, cause) {
			return
		}
		var rae *RemoteAbortError
		var cte *CollectiveTimeoutError
		if errors.As(err, &rae) || errors.As(err, &cte) {
			return // already names the watchdog's reason
		}
		x.err = fmt.Errorf("%w (%w)", cause, err)
	})
	return x.err
}

// Unwrap implements WorkUnwrapper: the inner group's Work.
func (x *wdWork) Unwrap() Work { return x.Work }

// Wait implements Work.
func (x *wdWork) Wait(ctx context.Context) error {
	if err := x.Work.Wait(ctx); err != nil && !isDone(x.Work) {
		return err // ctx ended first
	}
	return x.result()
}

// Err implements Work.
func (x *wdWork) Err() error {
	if !isDone(x.Work) {
		return nil
	}
	return x.result()
}
