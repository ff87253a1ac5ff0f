package ddp

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/goddp/goddp/procgroup"
)

// InitOptions configure InitProcessGroup. The zero value is ready to use.
type InitOptions struct {
	// Timeout bounds each collective (default procgroup.DefaultTimeout).
	Timeout time.Duration
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

// InitProcessGroup creates this process's group as its launcher (ddprun, torchrun-style
// variables, srun or mpirun) describes it: procgroup.InitFromEnv, then procgroup.Rendezvous
// for the store, then procgroup.New with the named backend (which must be linked in, for
// instance with a blank import of backends/gloo). It blocks until every rank has joined or
// ctx ends. The returned close func closes the group, then releases the store; call it
// after the last collective (later calls return the first call's result).
func InitProcessGroup(ctx context.Context, backend string, opts InitOptions) (procgroup.ProcessGroup, func() error, error) {
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
		return nil, nil, fmt.Errorf("ddp: init: %w", err)
	}
	if _, err := procgroup.Lookup(backend); err != nil {
		return nil, nil, fmt.Errorf("ddp: init: %w", err) // before starting a store for nothing
	}
	logger = logger.With(zap.Int("rank", env.Rank), zap.Int("local_rank", env.LocalRank))
	store, release, err := procgroup.Rendezvous(ctx, env, logger)
	if err != nil {
		return nil, nil, fmt.Errorf("ddp: init: %w", err)
	}
	token := env.Token
	if token == "" {
		token = procgroup.DevToken // what Rendezvous used for the store
	}
	prefix, _ := lookup(RunIDEnv)
	if prefix != "" {
		prefix = "run/" + prefix
	}
	pg, err := procgroup.New(ctx, backend, procgroup.Options{
		Rank: env.Rank, Size: env.WorldSize,
		LocalRank: env.LocalRank, LocalSize: env.LocalWorldSize,
		Store: store, Prefix: prefix, Token: token,
		Timeout: opts.Timeout, Logger: logger, Backend: opts.Backend,
	})
	if err != nil {
		return nil, nil, errors.Join(fmt.Errorf("ddp: init: rank %d: %s group: %w", env.Rank, backend, err), release.Close())
	}
	var once sync.Once
	var closeErr error
	closeFn := func() error {
		once.Do(func() { closeErr = errors.Join(pg.Close(), release.Close()) })
		return closeErr
	}
	return pg, closeFn, nil
}
