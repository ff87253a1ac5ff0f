package ddp

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/goddp/goddp/procgroup"
)

// InitOptions configure InitProcessGroup. The zero value is ready to use.
type InitOptions struct {
	// Timeout bounds each collective: the group's watchdog aborts it on every rank at this
	// timeout, naming the ranks that had not joined (procgroup.WithWatchdog). Zero means
	// $GODDP_COLLECTIVE_TIMEOUT, else procgroup.DefaultTimeout.
	Timeout time.Duration
	// StallWarn is how long a collective may wait before the log names the ranks that have
	// not joined it. Zero means $GODDP_STALL_WARN, else procgroup.DefaultStallWarn.
	StallWarn time.Duration
	// Debug turns on desync detection (procgroup.WithDebug): the ranks compare each
	// collective's fingerprint before running it. GODDP_DEBUG=detail turns it on too.
	Debug bool
	// OnAbort, if set, is called once when the watchdog aborts the group (see
	// procgroup.WatchdogOptions.OnAbort); it must not block.
	OnAbort func(error)
	// Logger receives the group's log lines, with rank and local_rank fields added; nil
	// means zap.NewNop().
	Logger *zap.Logger
	// Backend holds backend-specific options (procgroup.Options.Backend).
	Backend any
	// LookupEnv reads the environment; nil means os.LookupEnv.
	LookupEnv func(string) (string, bool)
}

// RunIDEnv names the variable whose value, when set, prefixes the group's keys in the store
// (a launcher sets a new one per restart, so that a restarted group never reads the keys
// of the one before).
const RunIDEnv = "GODDP_RUN_ID"

// Group is this process's group as InitProcessGroup made it: a procgroup.ProcessGroup (the
// backend's, inside the watchdog and, with debug on, the desync checker) that also owns the
// rendezvous store it was made with. Pass it wherever a ProcessGroup goes (ddp.New, the
// collectives); reach the backend underneath with procgroup.Find (or FindDevice), which
// sees through Unwrap.
type Group struct {
	procgroup.ProcessGroup
	store io.Closer // the rendezvous store's release

	once     sync.Once
	closeErr error
}

// Close closes the group, then releases the rendezvous store; call it after the last
// collective. It is idempotent: later calls return the first one's result.
func (g *Group) Close() error {
	g.once.Do(func() { g.closeErr = errors.Join(g.ProcessGroup.Close(), g.store.Close()) })
	return g.closeErr
}

// Unwrap returns the group inside (procgroup.Unwrapper), so that procgroup.Find reaches
// the backend's group through a Group.
func (g *Group) Unwrap() procgroup.ProcessGroup { return g.ProcessGroup }

var _ procgroup.Unwrapper = (*Group)(nil)

// InitProcessGroup creates this process's group as its launcher (ddprun, torchrun-style
// variables, srun or mpirun) describes it: procgroup.InitFromEnv, then procgroup.Rendezvous
// for the store, then procgroup.New with the named backend (which must be linked in, for
// instance with a blank import of backends/gloo). It blocks until every rank has joined or
// ctx ends. The Group's Close closes the group and then releases the store, so a plain
// defer g.Close() leaks nothing.
//
// With GODDP_TLS_CERT, GODDP_TLS_KEY and GODDP_TLS_CA set (and GODDP_TLS_MTLS=1 for mutual
// TLS; see procgroup.TLSFromEnv) the store and the data plane's connections between hosts
// use TLS (procgroup.RendezvousTLS, procgroup.Options.TLS).
func InitProcessGroup(ctx context.Context, backend string, opts InitOptions) (*Group, error) {
	lookup := opts.LookupEnv
	if lookup == nil {
		lookup = os.LookupEnv
	}
	logger := opts.Logger
	if logger == nil {
		logger = zap.NewNop()
	}
	env, err := procgroup.EnvFrom(lookup)
	if err != nil {
		return nil, fmt.Errorf("ddp: init: %w", err)
	}
	if _, err := procgroup.Lookup(backend); err != nil {
		return nil, fmt.Errorf("ddp: init: %w", err) // before starting a store for nothing
	}
	logger = logger.With(zap.Int("rank", env.Rank), zap.Int("local_rank", env.LocalRank))
	wdOpts := procgroup.WatchdogOptions{
		Timeout: opts.Timeout, WarnAfter: opts.StallWarn, Logger: logger,
		OnAbort: opts.OnAbort, LookupEnv: lookup,
	}
	if err := wdOpts.Validate(); err != nil {
		return nil, fmt.Errorf("ddp: init: %w", err)
	}
	debug, err := procgroup.DebugFromEnv(lookup)
	if err != nil {
		return nil, fmt.Errorf("ddp: init: %w", err)
	}
	debug = debug || opts.Debug
	// GODDP_TLS_*: the store's connections and the data plane's between hosts.
	tlsFiles, err := procgroup.TLSFromEnv(lookup)
	if err != nil {
		return nil, fmt.Errorf("ddp: init: %w", err)
	}
	peerTLS, err := dataPlaneTLS(tlsFiles)
	if err != nil {
		return nil, fmt.Errorf("ddp: init: rank %d: %w", env.Rank, err)
	}
	store, release, err := procgroup.RendezvousTLS(ctx, env, tlsFiles, logger)
	if err != nil {
		return nil, fmt.Errorf("ddp: init: %w", err)
	}
	token, err := procgroup.JobToken(env, env.StoreAddress(), tlsFiles.Enabled(), nil) // Rendezvous checked and logged it
	if err != nil {
		return nil, errors.Join(fmt.Errorf("ddp: init: %w", err), release.Close())
	}
	connectTimeout, err := procgroup.ConnectTimeoutFrom(lookup)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("ddp: init: %w", err), release.Close())
	}
	prefix, _ := lookup(RunIDEnv)
	if prefix != "" {
		prefix = "run/" + prefix
	}
	pg, err := procgroup.New(ctx, backend, procgroup.Options{
		Rank: env.Rank, Size: env.WorldSize,
		LocalRank: env.LocalRank, LocalSize: env.LocalWorldSize,
		Store: store, Prefix: prefix, Token: token,
		// The watchdog fires first, with the fuller report; the backend's own timeout
		// (which starts later, when the collective starts there) is a backstop.
		Timeout: 2 * wdOpts.Timeout, Logger: logger, Backend: opts.Backend, TLS: peerTLS,
		StoreAddr: env.StoreAddress(), ConnectTimeout: connectTimeout, LookupEnv: lookup,
	})
	if err != nil {
		return nil, errors.Join(fmt.Errorf("ddp: init: rank %d: %s group: %w", env.Rank, backend, err), release.Close())
	}
	pg, err = wrapGroup(pg, procgroup.PrefixStore{Prefix: prefix + "/watchdog", Store: store}, wdOpts, debug, logger)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("ddp: init: rank %d: %w", env.Rank, err), release.Close())
	}
	return &Group{ProcessGroup: pg, store: release}, nil
}

// wrapGroup puts the debug wrapper (when debug) and the watchdog around pg, the watchdog
// outermost so that it numbers and times the caller's collectives, not the fingerprint
// exchanges. On error pg is aborted.
func wrapGroup(pg procgroup.ProcessGroup, store procgroup.Store, wd procgroup.WatchdogOptions, debug bool, logger *zap.Logger) (procgroup.ProcessGroup, error) {
	if debug {
		d, err := procgroup.WithDebug(pg, procgroup.DebugOptions{Logger: logger})
		if err != nil {
			pg.Abort(err)
			return nil, err
		}
		pg = d
	}
	w, err := procgroup.WithWatchdog(pg, store, wd)
	if err != nil {
		pg.Abort(err)
		return nil, err
	}
	return w, nil
}

// dataPlaneTLS is the data plane's TLS configuration for files (nil when TLS is off).
func dataPlaneTLS(files procgroup.TLSFiles) (*tls.Config, error) {
	if !files.Enabled() {
		return nil, nil
	}
	return files.PeerConfig()
}
