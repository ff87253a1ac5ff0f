package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/goddp/goddp/procgroup"
)

// newToken returns a fresh random job token (256 bits, hex).
func newToken() (string, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("token: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// sharedToken reads a multi-node job's token from GODDP_TOKEN or the file named by
// GODDP_TOKEN_FILE in env. Every node's ddprun must be given the same one.
func sharedToken(env []string) (string, error) {
	get := func(k string) string { v, _ := lookupEnv(env, k); return v }
	if t := strings.TrimSpace(get("GODDP_TOKEN")); t != "" {
		return t, nil
	}
	if path := get("GODDP_TOKEN_FILE"); path != "" {
		b, err := os.ReadFile(path)
		if err != nil {
			return "", fmt.Errorf("GODDP_TOKEN_FILE: %w", err)
		}
		if t := strings.TrimSpace(string(b)); t != "" {
			return t, nil
		}
		return "", fmt.Errorf("GODDP_TOKEN_FILE %s is empty", path)
	}
	return "", errors.New("a multi-node job (--nnodes > 1) needs the same token on every node: " +
		"set GODDP_TOKEN or GODDP_TOKEN_FILE in ddprun's environment (for instance to the output of 'openssl rand -hex 32')")
}

// writeTokenFile writes token to a new 0600 file in dir and returns its path.
func writeTokenFile(dir, token string) (string, error) {
	path := filepath.Join(dir, "token")
	if err := os.WriteFile(path, []byte(token), 0o600); err != nil {
		return "", fmt.Errorf("token file: %w", err)
	}
	return path, nil
}

// deriveRunID names a multi-node job after its token, so that every node agrees on the
// store key prefix without being told; a single-node job gets a random one.
func deriveRunID(token string, multiNode bool) (string, error) {
	if multiNode {
		sum := sha256.Sum256([]byte("goddp-run-id\x00" + token))
		return hex.EncodeToString(sum[:6]), nil
	}
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("run id: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// hostStore starts the rendezvous store on this node and returns it with the address the
// ranks dial. A single-node job listens on --master_addr only; a multi-node job listens on
// every interface, at --master_port (or the port of --rdzv_endpoint).
func hostStore(c *config, token string, log *zap.Logger) (*procgroup.StoreServer, string, error) {
	listen := net.JoinHostPort(c.storeHost, strconv.Itoa(c.storePort))
	if c.nnodes > 1 {
		listen = net.JoinHostPort("", strconv.Itoa(c.storePort))
	}
	srv, err := procgroup.StartStoreServer(procgroup.StoreServerOptions{Addr: listen, Token: token, Logger: log, TLS: c.tls.server})
	if err != nil {
		return nil, "", fmt.Errorf("rendezvous store on %s: %w", listen, err)
	}
	_, port, err := net.SplitHostPort(srv.Addr())
	if err != nil {
		srv.Close()
		return nil, "", fmt.Errorf("rendezvous store address %q: %w", srv.Addr(), err)
	}
	return srv, net.JoinHostPort(c.storeHost, port), nil
}

// awaitStore waits, for up to timeout, until the store at addr answers an authenticated
// call with token. It is how the nodes other than node 0 wait for node 0's ddprun, and it
// catches a wrong token before any rank starts.
func awaitStore(ctx context.Context, addr, token string, tlsCfg *tls.Config, timeout time.Duration, con *console) error {
	con.msg(fmt.Sprintf("ddprun: waiting for the rendezvous store at %s (up to %v)\n", addr, timeout))
	dctx, cancel := procgroup.BoundedWait(ctx, timeout, 0, func(waited time.Duration) {
		con.msg(fmt.Sprintf("ddprun: still waiting for the rendezvous store at %s after %v (bound %v, --rdzv_timeout)\n", addr, waited, timeout))
	})
	defer cancel()
	st, err := procgroup.DialStore(dctx, addr, token, procgroup.DialOptions{TLS: tlsCfg})
	if err != nil {
		if procgroup.TimedOut(ctx, dctx) {
			return fmt.Errorf("rendezvous store at %s not reachable within %v (--rdzv_timeout): check that node 0's ddprun is running "+
				"and that this host reaches %s (--master_addr must be node 0's address as this host sees it, not localhost)", addr, timeout, addr)
		}
		return fmt.Errorf("rendezvous store: %w", err)
	}
	return st.Close()
}
