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

// DevToken is the token a job on one host uses when the environment sets none (JobToken).
// It is public, so it protects nothing: it keeps development runs on one machine simple.
const DevToken = "goddp-dev-token"

// ErrNoToken is wrapped by JobToken's refusal to run a job that spans hosts without a secret.
var ErrNoToken = errors.New("no job token")

// JobToken is the secret the job's store and data plane authenticate with: env.Token when
// the environment sets one. Without one, a job whose ranks all run on this host and whose
// store is on loopback gets DevToken (with a warning in the log), and any other job (ranks on
// several hosts, or a store that other hosts can reach) is refused with ErrNoToken, unless
// tlsOn (TLS guards the store; the data plane then authenticates by TLS too).
func JobToken(env Env, storeAddr string, tlsOn bool, logger *zap.Logger) (string, error) {
	if env.Token != "" {
		return env.Token, nil
	}
	multiHost := env.LocalWorldSize > 0 && env.LocalWorldSize < env.WorldSize
	host, _, _ := net.SplitHostPort(storeAddr)
	public := storeAddr != "" && !resolvesToLoopback(host)
	if (multiHost || public) && !tlsOn {
		why := fmt.Sprintf("this job spans hosts (WORLD_SIZE=%d, LOCAL_WORLD_SIZE=%d)", env.WorldSize, env.LocalWorldSize)
		if !multiHost {
			why = fmt.Sprintf("its rendezvous store at %s is reachable from other hosts", storeAddr)
		}
		return "", fmt.Errorf("%w: %s, and without a secret anyone on the network could join it or read its traffic: "+
			"set GODDP_TOKEN (or GODDP_TOKEN_FILE, a 0600 file) to the same secret on every host, for instance "+
			"export GODDP_TOKEN=$(openssl rand -hex 32), or enable TLS (GODDP_TLS_CERT, GODDP_TLS_KEY, GODDP_TLS_CA)", ErrNoToken, why)
	}
	if logger != nil && !tlsOn {
		logger.Warn("rendezvous: no GODDP_TOKEN or GODDP_TOKEN_FILE; using the public development token (fine on one host only)")
	}
	return DevToken, nil
}

// resolvesToLoopback reports whether host is a loopback address or a name whose every
// address is one.
func resolvesToLoopback(host string) bool {
	if isLoopback(host) {
		return true
	}
	if net.ParseIP(host) != nil {
		return false
	}
	ips, err := net.LookupIP(host)
	if err != nil || len(ips) == 0 {
		return false
	}
	for _, ip := range ips {
		if !ip.IsLoopback() {
			return false
		}
	}
	return true
}

// StoreAddress is the "host:port" every rank dials for the store env describes.
func (e Env) StoreAddress() string {
	if e.StoreAddr != "" {
		return e.StoreAddr
	}
	if e.MasterAddr == "" {
		return ""
	}
	return net.JoinHostPort(e.MasterAddr, strconv.Itoa(e.MasterPort))
}

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
// With env.StoreKind StoreMemory (no launcher: a world of one process), the store is a
// MemStore. With StoreTCPStore, every rank dials the PyTorch TCPStore at env.StoreAddr
// (torchrun's agent store, or GODDP_STORE=tcpstore://...) and logs a warning that it has no
// authentication; keys go under env.StorePrefix. With StoreGRPC (a store hosted by the
// launcher), every rank dials env.StoreAddr. Otherwise,
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
	timeout, err := ConnectTimeoutFrom(nil)
	if err != nil {
		return nil, nil, fmt.Errorf("procgroup: rendezvous rank %d: %w", env.Rank, err)
	}
	switch env.StoreKind {
	case StoreMemory:
		if env.WorldSize != 1 {
			return nil, nil, fmt.Errorf("%w: rendezvous: an in-process store for a world of %d", ErrInvalidArgument, env.WorldSize)
		}
		logger.Info("rendezvous: no launcher variables in the environment; running as a single process (rank 0 of 1, in-process store)")
		st := NewMemStore()
		return st, st, nil
	}
	if env.StoreAddr == "" && (env.MasterAddr == "" || env.MasterPort < 1 || env.MasterPort > 65535) {
		return nil, nil, fmt.Errorf("%w: rendezvous: no store address (MASTER_ADDR %q, MASTER_PORT %d)",
			ErrInvalidArgument, env.MasterAddr, env.MasterPort)
	}
	token, err := JobToken(env, env.StoreAddress(), files.Enabled(), logger)
	if err != nil {
		return nil, nil, fmt.Errorf("procgroup: rendezvous rank %d: %w", env.Rank, err)
	}
	if env.StoreKind == StoreTCPStore {
		logger.Warn("rendezvous: using a PyTorch TCPStore, which has no authentication: whoever reaches it can read and change the job's keys (the data plane still authenticates peers with the job token)",
			zap.String("addr", env.StoreAddr), zap.String("prefix", env.StorePrefix))
		if files.Enabled() {
			logger.Warn("rendezvous: GODDP_TLS_* secures the data plane only; a TCPStore has no TLS")
		}
		tctx, cancel := context.WithTimeout(ctx, timeout)
		st, err := DialTCPStore(tctx, env.StoreAddr, TCPStoreOptions{Logger: logger})
		cancel()
		if err != nil {
			return nil, nil, fmt.Errorf("procgroup: rendezvous rank %d: %w", env.Rank, err)
		}
		if env.StorePrefix == "" {
			return st, st, nil
		}
		return PrefixStore{Prefix: env.StorePrefix, Store: st}, st, nil
	}
	srvTLS, cliTLS, err := storeTLS(files, env.StoreAddr == "" && env.Rank == 0)
	if err != nil {
		return nil, nil, fmt.Errorf("procgroup: rendezvous rank %d: %w", env.Rank, err)
	}
	dopts := DialOptions{Logger: logger, TLS: cliTLS}
	if env.StoreAddr != "" {
		st, err := dialStoreBounded(ctx, env, env.StoreAddr, token, dopts, timeout)
		if err != nil {
			return nil, nil, fmt.Errorf("procgroup: rendezvous rank %d: %w", env.Rank, err)
		}
		return st, st, nil
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
	st, err := dialStoreBounded(ctx, env, net.JoinHostPort(env.MasterAddr, port), token, dopts, timeout)
	if err != nil {
		if srv != nil {
			srv.Close()
		}
		return nil, nil, fmt.Errorf("procgroup: rendezvous rank %d: %w", env.Rank, err)
	}
	return st, &rdzvCloser{env: env, store: st, srv: srv, logger: logger}, nil
}

// dialStoreBounded dials the store within timeout, warning every ConnectWarnInterval while
// it does not answer.
func dialStoreBounded(ctx context.Context, env Env, addr, token string, dopts DialOptions, timeout time.Duration) (Store, error) {
	if err := resolvable(ctx, addr); err != nil {
		return nil, err
	}
	hint := fmt.Sprintf("check that rank 0's host (or the launcher's store) is up and that this host reaches %s; "+
		"MASTER_ADDR and MASTER_PORT (ddprun: --master_addr, --master_port) must name it as other hosts see it", addr)
	wctx, done := BoundedWait(ctx, timeout, 0, func(waited time.Duration) {
		dopts.Logger.Warn("rendezvous: still waiting for the store", zap.String("addr", addr),
			zap.Duration("waited", waited), zap.Duration("bound", timeout), zap.String("hint", hint))
	})
	st, err := DialStore(wctx, addr, token, dopts)
	timedOut := TimedOut(ctx, wctx)
	done()
	if err != nil && timedOut {
		return nil, fmt.Errorf("%w: the rendezvous store at %s did not answer within %v (%s): %s",
			ErrConnectTimeout, addr, timeout, ConnectTimeoutEnv, hint)
	}
	return st, err
}

// resolvable fails when addr's host is a name that this host's resolver says does not
// exist, after retrying for up to resolveGrace (a Kubernetes service's name may appear a few
// seconds after the pod): waiting for it until the set-up bound would be a silent wait of
// minutes (a launcher's node name that resolves only on other hosts, a typo in MASTER_ADDR).
// Other lookup errors (a resolver that times out) are left to the bounded dial.
func resolvable(ctx context.Context, addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil || net.ParseIP(host) != nil {
		return nil
	}
	end := time.Now().Add(resolveGrace)
	for {
		lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err = net.DefaultResolver.LookupHost(lctx, host)
		cancel()
		var dnsErr *net.DNSError
		if !errors.As(err, &dnsErr) || !dnsErr.IsNotFound {
			return nil
		}
		if time.Now().After(end) || ctx.Err() != nil {
			return fmt.Errorf("%w: the store's host %q does not resolve on this host (%v; tried for %v): set MASTER_ADDR (ddprun: --master_addr, "+
				"--rdzv_endpoint) to a name or address that this host can resolve", ErrInvalidArgument, host, err, resolveGrace)
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// resolveGrace is how long resolvable retries a name that does not resolve (a variable for
// the tests).
var resolveGrace = 30 * time.Second

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
