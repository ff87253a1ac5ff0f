package elastic

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// monitor watches one epoch from one rank (Note [Elastic heartbeats]).
type monitor struct {
	j     *Job
	o     *outcome
	rank  int
	abort func(error) // the epoch's group's Abort, once it exists; cancels its set-up before

	ctx  context.Context
	stop context.CancelFunc
	wg   sync.WaitGroup

	waiting atomic.Int64 // rank 0: processes waiting in the next round

	mu      sync.Mutex
	failErr error // the store is gone: the epoch cannot change, only end

	arrived chan struct{} // closed once this rank has arrived at the next round
	next    struct {
		idx     int
		me      member
		err     error
		learned time.Time
		cause   string
	}
}

// Note [Elastic heartbeats]: every rank of epoch K adds 1 to "e<K>/hb/<rank>" every
// heartbeat (DefaultHeartbeat) and reads every other rank's counter. A rank whose counter
// has not moved for the heartbeat timeout (DefaultHeartbeatTimeout) is silent: its host is
// down, its link is cut, or it is stopped. The first rank to see it opens round K+1, naming
// it. A dead process needs no heartbeat to be seen: its connections close, the backend
// reports its peers lost, and the ranks that see that open the round at once. Each rank
// also waits on "r<K+1>/open": when it appears, for whatever reason, the rank freezes its
// state at its last commit, arrives at round K+1 with it, and aborts the epoch's group, so
// that a collective in flight returns at once instead of at its timeout. Rank 0 also
// counts the processes that wait in round K+1, for Job.Commit's check for joiners.

func (j *Job) newMonitor(o *outcome, rank int, abort func(error)) *monitor {
	ctx, stop := context.WithCancel(context.Background())
	m := &monitor{j: j, o: o, rank: rank, abort: abort, ctx: ctx, stop: stop, arrived: make(chan struct{})}
	m.wg.Add(2)
	go m.beat()
	go m.watch()
	return m
}

func hbKey(epoch, rank int) string { return fmt.Sprintf("e%d/hb/%d", epoch, rank) }

// close stops the monitor and waits for its goroutines.
func (m *monitor) close() {
	m.stop()
	m.wg.Wait()
}

func (m *monitor) failed() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.failErr
}

// call runs one store call bounded by two heartbeats: a store behind a cut link must not
// hold the monitor.
func (m *monitor) call(f func(ctx context.Context) error) error {
	ctx, cancel := context.WithTimeout(m.ctx, 2*m.j.cfg.heartbeat)
	defer cancel()
	return f(ctx)
}

func (m *monitor) beat() {
	defer m.wg.Done()
	cfg, k, n := m.j.cfg, m.o.Round, len(m.o.Members)
	t := time.NewTicker(cfg.heartbeat)
	defer t.Stop()
	start := time.Now()
	last, seen := make([]int, n), make([]time.Time, n)
	for i := range seen {
		seen[i], last[i] = start, -1
	}
	storeOK := start
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		err := m.call(func(ctx context.Context) error {
			if _, err := m.j.st.Add(ctx, hbKey(k, m.rank), 1); err != nil {
				return err
			}
			_, err := m.j.st.Add(ctx, "alive", 1) // the store's host waits while it moves
			return err
		})
		if err != nil {
			if m.ctx.Err() != nil {
				return
			}
			if now.Sub(storeOK) > cfg.hbTimeout {
				m.mu.Lock()
				m.failErr = fmt.Errorf("elastic: rank %d of epoch %d: the rendezvous store at %s has not answered for %v: %w (the job cannot go on without it: it is hosted by the ddprun that owns --rdzv_endpoint)",
					m.rank, k, cfg.storeAddr, now.Sub(storeOK).Round(time.Millisecond), err)
				m.mu.Unlock()
				m.abort(m.failErr)
				return
			}
			continue
		}
		storeOK = now
		for p := range n {
			if p == m.rank {
				continue
			}
			var v int
			if err := m.call(func(ctx context.Context) (err error) { v, err = count(ctx, m.j.st, hbKey(k, p)); return }); err != nil {
				break
			}
			if v != last[p] {
				last[p], seen[p] = v, now
				continue
			}
			if now.Sub(seen[p]) >= cfg.hbTimeout {
				cause := fmt.Sprintf("rank %d (%s) sent no heartbeat for %v", p, m.o.Members[p].String(), now.Sub(seen[p]).Round(time.Second))
				m.call(func(ctx context.Context) error { return m.j.r.open(ctx, k+1, cause) }) //nolint:errcheck // the watch sees the round open, or the next beat tries again
				seen[p] = now                                                                  // once per timeout
			}
		}
		if m.rank == 0 {
			var w int
			if m.call(func(ctx context.Context) (err error) { w, err = count(ctx, m.j.st, roundKey(k+1, "arrive")); return }) == nil {
				m.waiting.Store(int64(w))
			}
		}
	}
}

func (m *monitor) watch() {
	defer m.wg.Done()
	k := m.o.Round
	var cause []byte
	for {
		v, err := m.j.st.Get(m.ctx, roundKey(k+1, "open"))
		if err == nil {
			cause = v
			break
		}
		if sleep(m.ctx, m.j.cfg.heartbeat) != nil {
			return
		}
	}
	learned := time.Now()
	step := m.j.state.freeze()
	me := m.j.me
	me.Epoch, me.Rank, me.Step = k, m.rank, step
	ctx, cancel := context.WithTimeout(m.ctx, m.j.cfg.timeout) // close ends it too
	idx, err := m.j.r.enter(ctx, k+1, me, m.j.desc)
	cancel()
	m.next.idx, m.next.me, m.next.err, m.next.learned, m.next.cause = idx, me, err, learned, string(cause)
	close(m.arrived)
	m.abort(&ChangeError{Epoch: k, Cause: string(cause)})
}

// ChangeError ends an epoch: the job's membership changes. Job.Run forms the next epoch;
// a trainer that sees it from a collective or from Job.Commit returns it from Run's body.
type ChangeError struct {
	Epoch int    // the epoch that ended
	Cause string // why
}

func (e *ChangeError) Error() string {
	return fmt.Sprintf("elastic: epoch %d ends: %s", e.Epoch, e.Cause)
}

// Is makes errors.Is(err, procgroup.ErrAborted) true: the epoch's group is aborted.
func (e *ChangeError) Is(target error) bool { return target == procgroup.ErrAborted }
