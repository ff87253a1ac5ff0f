package gloo

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"time"
)

// Note [Data-plane TLS]: with Config.TLS (or procgroup.Options.TLS) set, every TCP
// connection of the mesh runs TLS (1.3 by default), set up before the token handshake, so
// that the handshake, the data and abort frames all travel encrypted, and a peer whose
// certificate the configuration refuses never reaches the token check (the acceptor logs
// it as a refused connection). Unix sockets and shared memory stay on the host and are
// protected by the token alone. The same configuration serves both roles (every rank but
// the highest accepts, every rank but rank 0 dials): as a server it presents
// Certificates and, with ClientAuth, checks the dialer's; as a client it verifies the
// acceptor against RootCAs and the host it dialed (ServerName, when empty), and presents
// Certificates when asked.
//
// A TLS connection has no descriptor of its own: peer.raw stays nil, so the two-rank
// inline exchange (Note [Inline exchange]), which writes to the descriptor directly, is
// not used, and the liveness probe of Note [Stalls] does not look at these connections
// (a peer that dies is still seen by the read that waits for it, or by the abort frames
// of the rank that saw it; a silent link by the collective's timeout). Close closes the
// socket without a close_notify alert: the frames carry their own lengths, and an alert
// written to a peer that no longer reads could block Close.

// Note [Unreachable peers]: a link that goes down (a cable, a switch, a host that vanishes
// without a reset) closes nothing: TCP would retransmit for many minutes, and the ranks
// would only fail at the collective's timeout, without knowing whom they lost. So every
// TCP connection of the mesh sets TCP_USER_TIMEOUT, and keepalive probes every second
// once it has been idle for a second: data or probes unacknowledged for livenessTimeout
// kill the connection, the read or write on it fails, and the group aborts with a
// PeerLostError naming the peer (its abort frames tell the other ranks which one). A slow
// or stopped peer still acknowledges (its kernel does), so it is not mistaken for a lost
// one.

// livenessTimeout is Note [Unreachable peers]'s timeout for a collective timeout of
// timeout: half of it, within [2 s, 30 s].
func livenessTimeout(timeout time.Duration) time.Duration {
	return min(max(timeout/2, 2*time.Second), 30*time.Second)
}

// tlsConfig is the data plane's TLS configuration, or nil.
func (g *group) tlsConfig() *tls.Config {
	if g.cfg.TLS != nil {
		return g.cfg.TLS
	}
	return g.opts.TLS
}

// secureDial runs the client side of Note [Data-plane TLS] on c, freshly dialed to addr
// over network, under c's deadline (and Note [Unreachable peers] on a TCP connection).
// It returns c itself when there is nothing to do,
// and on error a connection for the caller to close. A certificate the configuration
// refuses is errAuth: retrying would not help.
func (g *group) secureDial(c net.Conn, network, addr string) (net.Conn, error) {
	if tc, ok := c.(*net.TCPConn); ok {
		setLiveness(tc, livenessTimeout(g.opts.Timeout))
	}
	cfg := g.tlsConfig()
	if cfg == nil || network != "tcp" {
		return c, nil
	}
	if cfg.ServerName == "" {
		host, _, err := net.SplitHostPort(addr)
		if err != nil {
			return c, fmt.Errorf("tls handshake: %w", err)
		}
		cfg = cfg.Clone()
		cfg.ServerName = host
	}
	tc := tls.Client(c, cfg)
	if err := tc.Handshake(); err != nil {
		if isCertError(err) {
			return c, fmt.Errorf("%w: tls handshake: %w", errAuth, err)
		}
		return c, fmt.Errorf("tls handshake: %w", err)
	}
	return tlsConn{tc}, nil
}

// secureAccept runs the server side of Note [Data-plane TLS] on c, freshly accepted,
// under c's deadline (and Note [Unreachable peers] on a TCP connection). It returns c
// itself for a Unix socket or without TLS.
func (g *group) secureAccept(c net.Conn) (net.Conn, error) {
	tcp, isTCP := c.(*net.TCPConn)
	if isTCP {
		setLiveness(tcp, livenessTimeout(g.opts.Timeout))
	}
	cfg := g.tlsConfig()
	if cfg == nil || !isTCP {
		return c, nil
	}
	tc := tls.Server(c, cfg)
	if err := tc.Handshake(); err != nil {
		return c, fmt.Errorf("tls handshake: %w", err)
	}
	return tlsConn{tc}, nil
}

// isCertError reports whether err is this side refusing the peer's certificate.
func isCertError(err error) bool {
	var ce *tls.CertificateVerificationError
	return errors.As(err, &ce)
}

// tlsConn is a TLS connection whose Close closes the socket at once: Note [Data-plane TLS].
type tlsConn struct{ *tls.Conn }

func (c tlsConn) Close() error { return c.NetConn().Close() }
