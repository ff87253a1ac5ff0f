package procgroup

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"

	"go.uber.org/zap"
	"google.golang.org/grpc/credentials"
)

// Environment variables read by TLSFromEnv (and set by launchers such as ddprun).
const (
	EnvTLSCert = "GODDP_TLS_CERT" // PEM certificate (chain) of this process
	EnvTLSKey  = "GODDP_TLS_KEY"  // PEM private key of that certificate
	EnvTLSCA   = "GODDP_TLS_CA"   // PEM bundle of the CAs that sign the job's certificates
	EnvTLSMTLS = "GODDP_TLS_MTLS" // "1": servers require client certificates (mutual TLS)
)

// TLSFiles names the PEM files that secure the job's network connections (the store's
// gRPC server and the data plane between hosts). The zero value means no TLS.
//
// Every certificate of a job is signed by a CA in CAFile. A server presents
// CertFile/KeyFile; a client verifies the server's certificate against CAFile and the
// host name or IP address it dialed (so a certificate lists its host's names and
// addresses as subject alternative names). With RequireClientCert (mutual TLS) a server
// also refuses every client that does not present a certificate signed by a CA in
// CAFile. A data-plane rank is a server and a client at once: its certificate then needs
// both the server and the client extended key usage (or none).
type TLSFiles struct {
	CertFile, KeyFile string
	CAFile            string
	RequireClientCert bool
}

// Enabled reports whether any field is set.
func (f TLSFiles) Enabled() bool { return f != TLSFiles{} }

// check verifies that the fields are consistent: a certificate and its key come together.
func (f TLSFiles) check() error {
	if (f.CertFile == "") != (f.KeyFile == "") {
		return fmt.Errorf("%w: tls: certificate %q and key %q: set both or neither", ErrInvalidArgument, f.CertFile, f.KeyFile)
	}
	if f.RequireClientCert && f.CAFile == "" {
		return fmt.Errorf("%w: tls: mutual TLS needs a CA file to verify clients", ErrInvalidArgument)
	}
	return nil
}

func (f TLSFiles) keyPair() ([]tls.Certificate, error) {
	if f.CertFile == "" {
		return nil, nil
	}
	c, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("procgroup: tls: certificate %s, key %s: %w", f.CertFile, f.KeyFile, err)
	}
	return []tls.Certificate{c}, nil
}

func (f TLSFiles) caPool() (*x509.CertPool, error) {
	b, err := os.ReadFile(f.CAFile)
	if err != nil {
		return nil, fmt.Errorf("procgroup: tls: CA file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("procgroup: tls: CA file %s: no PEM certificate in it", f.CAFile)
	}
	return pool, nil
}

// ServerConfig returns the configuration of a TLS server (TLS 1.3 at least): it presents
// CertFile/KeyFile, and with RequireClientCert it requires and verifies a client
// certificate against CAFile. CertFile and KeyFile are required.
func (f TLSFiles) ServerConfig() (*tls.Config, error) {
	if err := f.check(); err != nil {
		return nil, err
	}
	if f.CertFile == "" {
		return nil, fmt.Errorf("%w: tls: a server needs a certificate and a key (%s, %s)", ErrInvalidArgument, EnvTLSCert, EnvTLSKey)
	}
	certs, err := f.keyPair()
	if err != nil {
		return nil, err
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS13, Certificates: certs, ClientAuth: tls.NoClientCert}
	if f.RequireClientCert {
		if cfg.ClientCAs, err = f.caPool(); err != nil {
			return nil, err
		}
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

// ClientConfig returns the configuration of a TLS client (TLS 1.3 at least) that verifies
// the server against CAFile and presents CertFile/KeyFile when they are set (required with
// RequireClientCert). ServerName is left empty: the dialer fills in the host it dials
// (gRPC does; see also PeerConfig).
func (f TLSFiles) ClientConfig() (*tls.Config, error) {
	if err := f.check(); err != nil {
		return nil, err
	}
	if f.CAFile == "" {
		return nil, fmt.Errorf("%w: tls: a client needs a CA file to verify the server (%s)", ErrInvalidArgument, EnvTLSCA)
	}
	if f.RequireClientCert && f.CertFile == "" {
		return nil, fmt.Errorf("%w: tls: mutual TLS: a client needs a certificate and a key (%s, %s)", ErrInvalidArgument, EnvTLSCert, EnvTLSKey)
	}
	certs, err := f.keyPair()
	if err != nil {
		return nil, err
	}
	pool, err := f.caPool()
	if err != nil {
		return nil, err
	}
	return &tls.Config{MinVersion: tls.VersionTLS13, Certificates: certs, RootCAs: pool}, nil
}

// PeerConfig returns one configuration for both roles, for a data plane whose ranks dial
// and accept each other (Options.TLS): the union of ServerConfig and ClientConfig. All
// three files are required. A dialer using it must set ServerName (to the host it dials)
// on a Clone.
func (f TLSFiles) PeerConfig() (*tls.Config, error) {
	s, err := f.ServerConfig()
	if err != nil {
		return nil, err
	}
	c, err := f.ClientConfig()
	if err != nil {
		return nil, err
	}
	s.RootCAs = c.RootCAs
	return s, nil
}

// Environ returns f as the environment variables TLSFromEnv reads ("NAME=value"), for
// launchers that hand it to their ranks; nil when f is not Enabled.
func (f TLSFiles) Environ() []string {
	if !f.Enabled() {
		return nil
	}
	mtls := "0"
	if f.RequireClientCert {
		mtls = "1"
	}
	return []string{EnvTLSCert + "=" + f.CertFile, EnvTLSKey + "=" + f.KeyFile, EnvTLSCA + "=" + f.CAFile, EnvTLSMTLS + "=" + mtls}
}

// TLSFromEnv reads GODDP_TLS_CERT, GODDP_TLS_KEY, GODDP_TLS_CA and GODDP_TLS_MTLS (1, true,
// 0, false or empty) through lookup (nil means os.LookupEnv). None set means the zero
// TLSFiles (no TLS). The files are not read here (ServerConfig and ClientConfig do).
func TLSFromEnv(lookup func(string) (string, bool)) (TLSFiles, error) {
	if lookup == nil {
		lookup = os.LookupEnv
	}
	get := func(k string) string {
		v, _ := lookup(k)
		return strings.TrimSpace(v)
	}
	f := TLSFiles{CertFile: get(EnvTLSCert), KeyFile: get(EnvTLSKey), CAFile: get(EnvTLSCA)}
	switch m := strings.ToLower(get(EnvTLSMTLS)); m {
	case "", "0", "false":
	case "1", "true":
		f.RequireClientCert = true
	default:
		return TLSFiles{}, fmt.Errorf("procgroup: env: %s=%q: want 1 or 0", EnvTLSMTLS, m)
	}
	if err := f.check(); err != nil {
		return TLSFiles{}, fmt.Errorf("procgroup: env: %w", err)
	}
	return f, nil
}

// RendezvousTLS is Rendezvous with the store's TLS given by files (the zero value: no
// TLS): rank 0's store server (when it hosts one) uses files.ServerConfig, every rank's
// client files.ClientConfig. Rendezvous reads files from the environment (TLSFromEnv).
func RendezvousTLS(ctx context.Context, env Env, files TLSFiles, logger *zap.Logger) (Store, io.Closer, error) {
	return rendezvous(ctx, env, files, logger)
}

// storeTLS returns the server (rank 0 hosting the store only) and client TLS configs of
// files; nil, nil when files is not Enabled.
func storeTLS(files TLSFiles, server bool) (srv, cli *tls.Config, err error) {
	if !files.Enabled() {
		return nil, nil, nil
	}
	if server {
		if srv, err = files.ServerConfig(); err != nil {
			return nil, nil, err
		}
	}
	if cli, err = files.ClientConfig(); err != nil {
		return nil, nil, err
	}
	return srv, cli, nil
}

// loggedCreds are the store server's TLS credentials: a connection whose TLS handshake
// fails (a plain-text client, a client without a valid certificate under mutual TLS, a
// stranger's garbage) is logged, as refused calls are.
type loggedCreds struct {
	credentials.TransportCredentials
	log *zap.Logger
}

func newLoggedCreds(cfg *tls.Config, log *zap.Logger) credentials.TransportCredentials {
	return loggedCreds{credentials.NewTLS(cfg), log}
}

func (c loggedCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ServerHandshake(raw)
	if err != nil && !errors.Is(err, io.EOF) {
		c.log.Warn("store: refused connection", zap.String("peer", raw.RemoteAddr().String()),
			zap.String("reason", "tls handshake"), zap.Error(err))
	}
	return conn, info, err
}

func (c loggedCreds) Clone() credentials.TransportCredentials {
	return loggedCreds{c.TransportCredentials.Clone(), c.log}
}
