package procgroup

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"
)

// DevToken is the token Rendezvous uses when the environment sets none. It is public, so it
// protects nothing: it keeps development runs on one machine simple.
const DevToken = "goddp-dev-token"

// Keys Rendezvous uses in the store to count the ranks that have released it.
const (
	rdzvReleasedKey = "goddp/rendezvous/released"
	rdzvAllKey      = "goddp/rendezvous/all-released"
)

// rendezvousCloseTimeout bounds how long rank 0's closer waits for the other ranks before it
// stops its store server anyway (a variable so that tests can shorten it).
var rendezvousCloseTimeout = 10 * time.Second

// Rendezvous returns the job's store, as env describes it, and the closer that releases it.
//
// If env.StoreAddr is set (a store hosted by the launcher), every rank dials it. Otherwise,
// like torch's TCPStore, rank 0 starts a StoreServer on port env.MasterPort (on the loopback
// address when env.MasterAddr is one, else on every interface, since MASTER_ADDR names this
// host as the other ranks reach it), and every rank, rank 0 included, dials
// MasterAddr:MasterPort, waiting until ctx ends for the server to answer. Without a token in
// env, DevToken is used and a warning logged.
//
// The closer closes the client; rank 0's also stops the server, but first waits until every
// rank has called its closer (counted in the store), or rendezvousCloseTimeout has passed,
// so that no rank loses the store while it still needs it. Call it once the process group
// built on the store is closed.
//
// The store's TLS comes from GODDP_TLS_* (TLSFromEnv); RendezvousTLS takes it explicitly.
func Rendezvous(ctx context.Context, env Env, logger *zap.Logger) (Store, io.Closer, error) {
	files, err := TLSFromEnv(nil)
	if err != nil {
		return nil, nil, fmt.Errorf("procgroup: rendezvous rank %d: %w", env.Rank, err)
	}
	return rendezvous(ctx, env, files, logger)
}

func rendezvous(ctx context.Context, env Env, files TLSFiles, logger *zap.Logger) (Store, io.Closer, error) {
	if logger == nil {
		logger = zap.NewNop()
	}
	token := env.Token
	if token == "" {
		token = DevToken
		logger.Warn("rendezvous: no GODDP_TOKEN or GODDP_TOKEN_FILE; using the public development token")
	}
	srvTLS, cliTLS, err := storeTLS(files, env.StoreAddr == "" && env.Rank == 0)
	if err != nil {
		return nil, nil, fmt.Errorf("procgroup: rendezvous rank %d: %w", env.Rank, err)
	}
	dopts := DialOptions{Logger: logger, TLS: cliTLS}
	if env.StoreAddr != "" {
		st, err := DialStore(ctx, env.StoreAddr, token, dopts)
		if err != nil {
			return nil, nil, fmt.Errorf("procgroup: rendezvous rank %d: %w", env.Rank, err)
		}
		return st, st, nil
	}
	if env.MasterAddr == "" || env.MasterPort < 1 || env.MasterPort > 65535 {
		return nil, nil, fmt.Errorf("%w: rendezvous: no store address (MASTER_ADDR %q, MASTER_PORT %d)",
			ErrInvalidArgument, env.MasterAddr, env.MasterPort)
	}
	port := strconv.Itoa(env.MasterPort)
	var srv *StoreServer
	if env.Rank == 0 {
		bind := net.JoinHostPort("", port)
		if isLoopback(env.MasterAddr) {
			bind = net.JoinHostPort(env.MasterAddr, port)
		}
		var err error
		srv, err = StartStoreServer(StoreServerOptions{Addr: bind, Token: token, Logger: logger, TLS: srvTLS})
		if err != nil {
			return nil, nil, fmt.Errorf("procgroup: rendezvous rank 0: %w", err)
		}
	}
	st, err := DialStore(ctx, net.JoinHostPort(env.MasterAddr, port), token, dopts)
	if err != nil {
		if srv != nil {
			srv.Close()
		}
		return nil, nil, fmt.Errorf("procgroup: rendezvous rank %d: %w", env.Rank, err)
	}
	return st, &rdzvCloser{env: env, store: st, srv: srv, logger: logger}, nil
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// rdzvCloser releases a store that rank 0 hosts.
type rdzvCloser struct {
	env    Env
	store  Store
	srv    *StoreServer // nil except on rank 0
	logger *zap.Logger

	once sync.Once
	err  error
}

func (c *rdzvCloser) Close() error {
	c.once.Do(func() { c.err = c.close() })
	return c.err
}

func (c *rdzvCloser) close() error {
	ctx, cancel := context.WithTimeout(context.Background(), rendezvousCloseTimeout)
	defer cancel()
	var errs []error
	n, err := c.store.Add(ctx, rdzvReleasedKey, 1)
	switch {
	case err != nil:
		errs = append(errs, fmt.Errorf("procgroup: rendezvous rank %d: release: %w", c.env.Rank, err))
	case n >= int64(c.env.WorldSize):
		if err := c.store.Set(ctx, rdzvAllKey, nil); err != nil {
			errs = append(errs, fmt.Errorf("procgroup: rendezvous rank %d: release: %w", c.env.Rank, err))
		}
	}
	if c.srv != nil && err == nil {
		if err := c.store.Wait(ctx, rdzvAllKey); err != nil {
			c.logger.Warn("rendezvous: stopping the store before every rank released it",
				zap.Int("world_size", c.env.WorldSize), zap.Error(err))
		}
	}
	if err := c.store.Close(); err != nil {
		errs = append(errs, err)
	}
	if c.srv != nil {
		if err := c.srv.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
