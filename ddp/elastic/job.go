package elastic

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/procgroup"
)

// Options configure Start. The zero value is ready to use.
type Options struct {
	// Backend names the process group backend (default "gloo"); it must be linked in.
	Backend string
	// BackendOptions holds backend-specific options (procgroup.Options.Backend).
	BackendOptions any
	// Shards is the number of logical shards of a step's batch (ddp.Options.Shards): the
	// world size of every epoch divides it, so that the sum has the same bits at every
	// size. 0 allows any size, and the bits then depend on it.
	Shards int
	// CheckEvery is how many commits pass between two checks for waiting nodes, each a
	// one-element all-reduce (default 1: every step).
	CheckEvery int
	// Logger receives the groups' log lines; nil means zap.NewNop().
	Logger *zap.Logger
	// Report receives the one line per change (Note [Elastic reports]); nil means
	// os.Stderr.
	Report io.Writer
	// LookupEnv reads the environment; nil means os.LookupEnv.
	LookupEnv func(string) (string, bool)
}

// Job is this process's part of an elastic job. See the package doc.
type Job struct {
	o     Options
	cfg   *config // nil: a fixed group (not started by an elastic launcher)
	log   *zap.Logger
	state *State
	desc  string

	store procgroup.Store // the client; st is it under the job's prefix
	st    procgroup.Store
	r     *rounds
	me    member

	static *ddp.Group // the fixed group

	// The current epoch, while Run's body runs.
	o1      *outcome
	rank    int
	pg      procgroup.ProcessGroup
	mon     *monitor
	commits int
	closeMu sync.Mutex
}

// Start joins the job that this process's launcher describes. Under an elastic ddprun
// (--nnodes MIN:MAX; Enabled) it dials the job's rendezvous store; otherwise (any other
// launcher, or none) it creates a fixed group with ddp.InitProcessGroup, and the job then
// ends at the first failure, as a plain job does. Register the state with State, then
// call Run.
func Start(ctx context.Context, o Options) (*Job, error) {
	if o.Backend == "" {
		o.Backend = "gloo"
	}
	if o.CheckEvery <= 0 {
		o.CheckEvery = 1
	}
	if o.Report == nil {
		o.Report = os.Stderr
	}
	if o.LookupEnv == nil {
		o.LookupEnv = os.LookupEnv
	}
	if o.Shards < 0 {
		return nil, fmt.Errorf("elastic: Options.Shards %d is negative", o.Shards)
	}
	j := &Job{o: o, log: o.Logger, state: newState()}
	if j.log == nil {
		j.log = zap.NewNop()
	}
	if !Enabled(o.LookupEnv) {
		g, err := ddp.InitProcessGroup(ctx, o.Backend, ddp.InitOptions{Logger: o.Logger, Backend: o.BackendOptions, LookupEnv: o.LookupEnv})
		if err != nil {
			return nil, err
		}
		j.static = g
		return j, nil
	}
	cfg, err := configFrom(o.LookupEnv)
	if err != nil {
		return nil, err
	}
	if _, err := procgroup.Lookup(o.Backend); err != nil {
		return nil, fmt.Errorf("elastic: %w", err)
	}
	if o.Shards > 0 && cfg.minProcs() > o.Shards {
		return nil, fmt.Errorf("elastic: at least %d nodes × %d processes is more processes than the %d shards of a step; %s",
			cfg.minNodes, cfg.localSize, o.Shards, sizesThatWork(o.Shards))
	}
	if o.Shards > 0 && (&rounds{cfg: cfg, L: o.Shards}).size(cfg.maxProcs()) == 0 {
		return nil, fmt.Errorf("elastic: no world size from %d to %d processes (%d:%d nodes × %d) divides the %d shards of a step; %s",
			cfg.minProcs(), cfg.maxProcs(), cfg.minNodes, cfg.maxNodes, cfg.localSize, o.Shards, sizesThatWork(o.Shards))
	}
	var cli *tls.Config
	if cfg.tls.Enabled() {
		if cli, err = cfg.tls.ClientConfig(); err != nil {
			return nil, fmt.Errorf("elastic: %w", err)
		}
	}
	dctx, cancel := context.WithTimeout(ctx, cfg.connectTimeout)
	store, err := procgroup.DialStore(dctx, cfg.storeAddr, cfg.token, procgroup.DialOptions{TLS: cli, Logger: j.log})
	cancel()
	if err != nil {
		return nil, fmt.Errorf("elastic: the rendezvous store at %s: %w", cfg.storeAddr, err)
	}
	j.cfg, j.store = cfg, store
	j.st = procgroup.PrefixStore{Prefix: "elastic/" + cfg.runID, Store: store}
	j.r = &rounds{st: j.st, cfg: cfg, L: o.Shards, now: time.Now}
	j.me = member{
		ID:   fmt.Sprintf("%s/%d/%d", cfg.node, cfg.localRank, cfg.pid),
		Node: cfg.node, Host: cfg.host, Epoch: -1, Rank: 0, Step: -1,
	}
	return j, nil
}

// sizesThatWork lists the world sizes the shards allow.
func sizesThatWork(L int) string {
	var s []string
	for n := 1; n <= L; n++ {
		if L%n == 0 {
			s = append(s, strconv.Itoa(n))
		}
	}
	return "the world sizes that work are " + strings.Join(s, ", ")
}

// State is where the trainer registers what a survivor hands over: the parameters, the
// optimizer's state, the data position.
func (j *Job) State() *State { return j.state }

// Rank and Size are this process's place in the current epoch (inside Run's body).
func (j *Job) Rank() int {
	if j.static != nil {
		return j.static.Rank()
	}
	return j.rank
}

// Size is the current epoch's world size.
func (j *Job) Size() int {
	if j.static != nil {
		return j.static.Size()
	}
	if j.o1 == nil {
		return 0
	}
	return len(j.o1.Members)
}

// Run runs body once per epoch, until it returns nil: body trains from step start (0 in the
// first epoch) with pg, the epoch's group, committing the state after each synced step
// (Commit). When the membership changes, body's next collective or Commit fails with a
// *ChangeError (or the backend's peer-lost error); body returns it, and Run forms the next
// epoch with the survivors and the waiting nodes, hands every member the state of the last
// step every survivor committed, and runs body again from that step. Any other error ends
// Run, and the job for this process.
//
// It returns ErrFinished for a process that waited to join (a standby) while the job
// ended.
func (j *Job) Run(ctx context.Context, body func(ctx context.Context, pg procgroup.ProcessGroup, start int64) error) error {
	if j.state.err != nil {
		return j.state.err
	}
	if j.static != nil {
		return body(ctx, j.static, 0)
	}
	j.desc = j.state.describe()
	j.me.Model = fingerprint(j.desc)
	newest, err := j.r.epoch(ctx)
	if err != nil {
		return fmt.Errorf("elastic: the rendezvous store: %w", err)
	}
	k := newest + 1
	if k == 0 {
		if err := j.r.open(ctx, 0, "the job starts"); err != nil {
			return fmt.Errorf("elastic: the rendezvous store: %w", err)
		}
	}
	idx, err := j.r.enter(ctx, k, j.me, j.desc)
	if err != nil {
		return err
	}
	me, learned := j.me, time.Time{}
	for {
		o, rank, err := j.r.await(ctx, k, idx, me)
		if err != nil {
			return err
		}
		start, err := j.begin(ctx, o, rank)
		forming := err != nil // a member that fails to connect is lost too
		if err == nil {
			j.report(o, rank, start, learned)
			err = body(ctx, j.pg, start)
			if err == nil {
				return j.finish(ctx)
			}
		}
		next, change, serr := j.end(err, forming)
		if serr != nil {
			return serr
		}
		if !change {
			return err
		}
		if next.next.err != nil {
			return next.next.err
		}
		k, idx, me, learned = o.Round+1, next.next.idx, next.next.me, next.next.learned
	}
}

// begin forms the epoch of o as its member rank: the group, the monitor, the state.
func (j *Job) begin(ctx context.Context, o *outcome, rank int) (int64, error) {
	cfg := j.cfg
	j.o1, j.rank, j.commits = o, rank, 0
	fctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var mu sync.Mutex
	var pg procgroup.ProcessGroup
	abort := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		if pg != nil {
			pg.Abort(err)
		} else {
			cancel(err)
		}
	}
	j.state.thaw() // before the monitor: its freeze is final for the epoch
	j.mon = j.newMonitor(o, rank, abort)
	local, localSize := 0, 0
	for i, m := range o.Members {
		if m.Host == o.Members[rank].Host {
			if i < rank {
				local++
			}
			localSize++
		}
	}
	opts := procgroup.Options{
		Rank: rank, Size: len(o.Members), LocalRank: local, LocalSize: localSize,
		Store: j.store, Prefix: fmt.Sprintf("elastic/%s/e%d/pg", cfg.runID, o.Round), Token: cfg.token,
		Logger: j.log.With(zap.Int("rank", rank), zap.Int("epoch", o.Round)), Backend: j.o.BackendOptions,
		StoreAddr: cfg.storeAddr, ConnectTimeout: cfg.connectTimeout, LookupEnv: j.o.LookupEnv,
	}
	if cfg.tls.Enabled() {
		t, err := cfg.tls.PeerConfig()
		if err != nil {
			return 0, fmt.Errorf("elastic: %w", err)
		}
		opts.TLS = t
	}
	g, err := procgroup.New(fctx, j.o.Backend, opts)
	if err != nil {
		if c := context.Cause(fctx); c != nil && !errors.Is(c, context.Canceled) {
			err = c
		}
		return 0, fmt.Errorf("elastic: epoch %d: rank %d: the group: %w", o.Round, rank, err)
	}
	mu.Lock()
	pg = g
	mu.Unlock()
	j.pg = g
	if cerr := context.Cause(fctx); cerr != nil { // the monitor fired as the group formed
		g.Abort(cerr)
		return 0, cerr
	}
	start, err := j.restore(ctx, o, rank)
	if err != nil {
		return 0, fmt.Errorf("elastic: epoch %d: rank %d: the state: %w", o.Round, rank, err)
	}
	return start, nil
}

// restore hands every member the state of the last step that every survivor committed:
// the survivor of the lowest rank that committed it broadcasts it (Note [Elastic state]).
func (j *Job) restore(ctx context.Context, o *outcome, rank int) (int64, error) {
	step, src := int64(-1), -1
	for i, m := range o.Members {
		if m.Step >= 0 && (src < 0 || m.Step < step) {
			step, src = m.Step, i
		}
	}
	if src < 0 { // a new job: every process starts from the same state
		j.state.detach(-1)
		_, err := j.state.commit(0)
		return 0, err
	}
	j.state.detach(step)
	if rank == src {
		j.state.rollback()
	}
	if err := j.state.broadcast(ctx, j.pg, src); err != nil {
		return 0, err
	}
	_, err := j.state.commit(step)
	return step, err
}

// Note [Elastic state]: Commit copies the registered state after each synced step, so a
// survivor always holds the state after its last one. Survivors differ by at most one step
// (a rank cannot finish step s+1 before every rank has finished step s), so the new epoch
// takes the oldest survivor's step, the last one every survivor completed, and that
// survivor's copy: it puts its copy back, broadcasts it, and every member, a new one
// included, continues from there. Nothing is read from disk.

// Commit records the state after a synced step (the steps done so far: step+1 after step
// step) and checks, every Options.CheckEvery commits, whether nodes wait to join: then
// every rank returns the same *ChangeError here, and body returns it. It is collective:
// every rank calls it after every step.
func (j *Job) Commit(ctx context.Context, step int64) error {
	if j.static != nil {
		return nil
	}
	if ok, err := j.state.commit(step); err != nil {
		return err
	} else if !ok {
		return &ChangeError{Epoch: j.o1.Round, Cause: "the epoch is ending"}
	}
	j.commits++
	if j.commits%j.o.CheckEvery != 0 {
		return nil
	}
	n := len(j.o1.Members)
	flag := []float32{0}
	w := int(j.mon.waiting.Load())
	if j.rank == 0 && w > 0 && j.r.size(n+w) > n {
		flag[0] = float32(w)
	}
	if err := j.pg.AllReduce(ctx, flag, procgroup.Max).Wait(ctx); err != nil {
		return err
	}
	if flag[0] == 0 {
		return nil
	}
	w = int(flag[0])
	cause := fmt.Sprintf("%d process(es) waiting to join at step %d", w, step)
	if j.rank == 0 {
		k := j.o1.Round + 1
		if err := j.st.Set(ctx, roundKey(k, "expect"), []byte(strconv.Itoa(n+w))); err != nil {
			return err
		}
		if err := j.r.open(ctx, k, cause); err != nil {
			return err
		}
	}
	return &ChangeError{Epoch: j.o1.Round, Cause: cause}
}

// end closes the epoch after body failed with err. change reports whether the failure is
// a change of membership (the next round is open, or err is a lost peer or an aborted
// group, which opens it); next is then this rank's arrival there.
//
// storeErr, when not nil, says that the next epoch cannot be formed: the store is gone.
func (j *Job) end(err error, forming bool) (next *monitor, change bool, storeErr error) {
	m := j.mon
	defer j.closeEpoch(true)
	if m == nil {
		return nil, false, nil
	}
	select {
	case <-m.arrived:
		return m, true, nil
	default:
	}
	if ferr := m.failed(); ferr != nil {
		return nil, false, ferr
	}
	if !(forming || errors.Is(err, procgroup.ErrPeerLost) || errors.Is(err, procgroup.ErrAborted)) {
		return nil, false, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), j.cfg.hbTimeout)
	defer cancel()
	cause := fmt.Sprintf("rank %d saw: %v", j.rank, err)
	if ce := (*ChangeError)(nil); errors.As(err, &ce) {
		cause = ce.Cause
	}
	if oerr := j.r.open(ctx, j.o1.Round+1, cause); oerr != nil {
		return nil, false, fmt.Errorf("elastic: rank %d of epoch %d: %v; the next epoch cannot form: the rendezvous store at %s does not answer (%v): the job cannot go on without it (it is hosted by the ddprun that owns --rdzv_endpoint)",
			j.rank, j.o1.Round, err, j.cfg.storeAddr, oerr)
	}
	select {
	case <-m.arrived:
		return m, true, nil
	case <-ctx.Done():
		return nil, false, fmt.Errorf("elastic: rank %d of epoch %d: %v; it could not enter the next round within %v", j.rank, j.o1.Round, err, j.cfg.hbTimeout)
	}
}

// closeEpoch stops the monitor and releases the epoch's group, aborting what it still has
// in flight when abort.
func (j *Job) closeEpoch(abort bool) {
	if j.mon != nil {
		j.mon.close()
		j.mon = nil
	}
	if j.pg != nil {
		if abort {
			j.pg.Abort(errors.New("elastic: the epoch ended"))
		}
		j.pg.Close()
		j.pg = nil
	}
}

// finish ends a job whose body returned nil on every rank: rank 0 says the job is done
// (so that standbys and the store's host stop waiting), and each rank counts itself out.
func (j *Job) finish(ctx context.Context) error {
	n := len(j.o1.Members)
	rank := j.rank
	j.closeEpoch(false)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), j.cfg.hbTimeout)
	defer cancel()
	if rank == 0 {
		if err := j.st.Set(ctx, "finished", []byte(strconv.Itoa(n))); err != nil {
			return fmt.Errorf("elastic: saying the job is done: %w", err)
		}
	}
	if _, err := j.st.Add(ctx, "left", 1); err != nil {
		return fmt.Errorf("elastic: leaving the job: %w", err)
	}
	return nil
}

// Close releases the epoch's group (if Run did not) and the store's connection.
func (j *Job) Close() error {
	j.closeMu.Lock()
	defer j.closeMu.Unlock()
	if j.static != nil {
		return j.static.Close()
	}
	j.closeEpoch(true)
	if j.store != nil {
		err := j.store.Close()
		j.store = nil
		return err
	}
	return nil
}

// Note [Elastic reports]: at the start of every epoch each member writes one line to
// Options.Report: the epoch, why it formed, who left and who joined, the world size before
// and after, the step it resumes from, and how long the pause took on this rank (from the
// moment it learned of the change to the state restored), e.g.
//
//	elastic: epoch 1: rank 1 saw: peer rank 2 lost; left: node n3 (host h3, rank 2 of epoch 0); joined: none; world size 3 -> 2; resuming from step 10; pause 1.21s (this process: rank 0)

func (j *Job) report(o *outcome, rank int, start int64, learned time.Time) {
	var joined []member
	prevSize := len(o.Gone)
	for _, m := range o.Members {
		if m.Epoch != o.Round-1 || o.Round == 0 {
			joined = append(joined, m)
		} else {
			prevSize++
		}
	}
	line := fmt.Sprintf("elastic: epoch %d: %s; left: %s; joined: %s; world size %d -> %d; resuming from step %d",
		o.Round, o.Cause, describeAll(o.Gone), describeAll(joined), prevSize, len(o.Members), start)
	if !learned.IsZero() {
		line += fmt.Sprintf("; pause %.2fs", time.Since(learned).Seconds())
	}
	if len(o.Standby) > 0 {
		line += "; standby: " + describeAll(o.Standby)
	}
	fmt.Fprintf(j.o.Report, "%s (this process: rank %d)\n", line, rank)
}
