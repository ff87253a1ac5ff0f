package procgroup

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/goddp/goddp/internal/tlstest"
	"github.com/goddp/goddp/procgroup/storepb"
)

// testPKI writes a job CA with a certificate for 127.0.0.1 ("rank"), and a second CA
// with a certificate of its own ("stranger"), into a temporary folder.
func testPKI(t *testing.T) (job, stranger TLSFiles) {
	t.Helper()
	dir := t.TempDir()
	ca, err := tlstest.NewCA("goddp test job CA")
	if err != nil {
		t.Fatal(err)
	}
	f, err := ca.WriteFiles(dir, "rank", "127.0.0.1", "localhost")
	if err != nil {
		t.Fatal(err)
	}
	other, err := tlstest.NewCA("stranger CA")
	if err != nil {
		t.Fatal(err)
	}
	sdir := t.TempDir()
	s, err := other.WriteFiles(sdir, "stranger", "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	return TLSFiles{CertFile: f.Cert, KeyFile: f.Key, CAFile: f.CA, RequireClientCert: true},
		TLSFiles{CertFile: s.Cert, KeyFile: s.Key, CAFile: s.CA}
}

func TestTLSFromEnv(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  map[string]string
		want TLSFiles
		err  string
	}{
		{"none", nil, TLSFiles{}, ""},
		{"all", map[string]string{EnvTLSCert: "c.pem", EnvTLSKey: " k.pem ", EnvTLSCA: "ca.pem", EnvTLSMTLS: "1"},
			TLSFiles{CertFile: "c.pem", KeyFile: "k.pem", CAFile: "ca.pem", RequireClientCert: true}, ""},
		{"client only", map[string]string{EnvTLSCA: "ca.pem", EnvTLSMTLS: "false"}, TLSFiles{CAFile: "ca.pem"}, ""},
		{"cert without key", map[string]string{EnvTLSCert: "c.pem", EnvTLSCA: "ca.pem"}, TLSFiles{}, "set both or neither"},
		{"mtls without ca", map[string]string{EnvTLSCert: "c.pem", EnvTLSKey: "k.pem", EnvTLSMTLS: "true"}, TLSFiles{}, "needs a CA"},
		{"bad mtls", map[string]string{EnvTLSMTLS: "yes"}, TLSFiles{}, "GODDP_TLS_MTLS"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := TLSFromEnv(func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok })
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("TLSFromEnv = %+v, %v; want an error containing %q", got, err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("TLSFromEnv = %+v, %v; want %+v", got, err, tc.want)
			}
			// Environ round-trips.
			m := map[string]string{}
			for _, kv := range got.Environ() {
				k, v, _ := strings.Cut(kv, "=")
				m[k] = v
			}
			back, err := TLSFromEnv(func(k string) (string, bool) { v, ok := m[k]; return v, ok })
			if err != nil || back != got {
				t.Fatalf("TLSFromEnv(Environ()) = %+v, %v; want %+v", back, err, got)
			}
		})
	}
}

func TestTLSFilesConfigs(t *testing.T) {
	job, _ := testPKI(t)
	srv, err := job.ServerConfig()
	if err != nil {
		t.Fatal(err)
	}
	if srv.MinVersion != tls.VersionTLS13 || srv.ClientAuth != tls.RequireAndVerifyClientCert || srv.ClientCAs == nil || len(srv.Certificates) != 1 {
		t.Fatalf("ServerConfig = %+v", srv)
	}
	peer, err := job.PeerConfig()
	if err != nil || peer.RootCAs == nil || peer.ClientCAs == nil || len(peer.Certificates) != 1 {
		t.Fatalf("PeerConfig = %+v, %v", peer, err)
	}
	plain := job
	plain.RequireClientCert = false
	if srv, err := plain.ServerConfig(); err != nil || srv.ClientAuth != tls.NoClientCert {
		t.Fatalf("ServerConfig without mTLS = %+v, %v", srv, err)
	}
	for name, f := range map[string]TLSFiles{
		"missing cert":    {CertFile: "/nonexistent.crt", KeyFile: job.KeyFile, CAFile: job.CAFile},
		"key of nothing":  {CertFile: job.CAFile, KeyFile: job.KeyFile, CAFile: job.CAFile},
		"ca not pem":      {CertFile: job.CertFile, KeyFile: job.KeyFile, CAFile: job.KeyFile, RequireClientCert: true},
		"server, no cert": {CAFile: job.CAFile},
	} {
		if _, err := f.ServerConfig(); err == nil {
			t.Errorf("%s: ServerConfig accepted %+v", name, f)
		}
	}
	if _, err := (TLSFiles{CertFile: job.CertFile, KeyFile: job.KeyFile}).ClientConfig(); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("ClientConfig without CA: %v; want ErrInvalidArgument", err)
	}
	if _, err := (TLSFiles{CAFile: job.CAFile, RequireClientCert: true}).ClientConfig(); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("mTLS ClientConfig without a certificate: %v; want ErrInvalidArgument", err)
	}
}

// TestStoreMutualTLS: a store with mutual TLS serves a client with a certificate of the
// job's CA; a client without a certificate, one with a stranger's certificate and a
// plain-text client are refused and logged, and the store keeps serving.
func TestStoreMutualTLS(t *testing.T) {
	job, stranger := testPKI(t)
	srvTLS, err := job.ServerConfig()
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.WarnLevel)
	s := startServer(t, StoreServerOptions{TLS: srvTLS, Logger: zap.New(core)})
	good, err := job.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	st := dialTLS(t, s.Addr(), good)
	ctx := context.Background()
	if n, err := st.Add(ctx, "n", 41); err != nil || n != 41 {
		t.Fatalf("Add over mutual TLS = %d, %v", n, err)
	}

	noCert, err := TLSFiles{CAFile: job.CAFile}.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	strangerCert, err := TLSFiles{CertFile: stranger.CertFile, KeyFile: stranger.KeyFile, CAFile: job.CAFile}.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	distrust, err := TLSFiles{CAFile: stranger.CAFile, CertFile: job.CertFile, KeyFile: job.KeyFile}.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		cfg  *tls.Config
		log  bool // the server logs the refusal (it cannot when the client walks away)
	}{
		{"no client certificate", noCert, true},
		{"stranger's certificate", strangerCert, true},
		{"plain text", nil, true},
		{"server not trusted", distrust, false},
	} {
		before := logs.FilterMessage("store: refused connection").Len()
		short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		bad, err := DialStore(short, s.Addr(), testToken, DialOptions{TLS: tc.cfg})
		cancel()
		if err == nil {
			bad.Close()
			t.Errorf("%s: DialStore succeeded", tc.name)
			continue
		}
		if tc.log && logs.FilterMessage("store: refused connection").Len() == before {
			t.Errorf("%s: refused, but not logged", tc.name)
		}
		// The store keeps serving the good client.
		if n, err := st.Add(ctx, "n", 1); err != nil {
			t.Fatalf("after %s: Add = %d, %v", tc.name, n, err)
		}
	}
	if v, err := st.Get(ctx, "n"); err != nil || string(v) != "45" {
		t.Fatalf("Get n = %q, %v; want 45", v, err)
	}
	for _, e := range logs.FilterMessage("store: refused connection").All() {
		t.Logf("logged: %s %v", e.Message, e.ContextMap())
	}
}

func dialTLS(t *testing.T, addr string, cfg *tls.Config) Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := DialStore(ctx, addr, testToken, DialOptions{TLS: cfg})
	if err != nil {
		t.Fatalf("DialStore over TLS: %v", err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// TestRendezvousTLSWorld: three ranks meet through rank 0's store over mutual TLS.
func TestRendezvousTLSWorld(t *testing.T) {
	job, _ := testPKI(t)
	const n = 3
	port := freePort(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	stores, closers := meetAll(t, n, port, testToken, func(ctx context.Context, env Env) (Store, io.Closer, error) {
		return RendezvousTLS(ctx, env, job, nil)
	})
	for r, st := range stores {
		if _, err := st.Add(ctx, "count", int64(r+1)); err != nil {
			t.Fatal(err)
		}
	}
	for r, st := range stores {
		if v, err := st.Get(ctx, "count"); err != nil || string(v) != "6" {
			t.Fatalf("rank %d: count = %q, %v; want 6", r, v, err)
		}
	}
	// A plain-text client cannot use the store.
	short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancelShort()
	if st, err := DialStore(short, fmt.Sprintf("127.0.0.1:%d", port), testToken, DialOptions{}); err == nil {
		st.Close()
		t.Fatal("plain-text client reached the TLS rendezvous store")
	}
	closeAll := make(chan error, n)
	for _, c := range closers {
		go func() { closeAll <- c.Close() }()
	}
	for range n {
		if err := <-closeAll; err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
	// Bad TLS settings fail Rendezvous with a clear error, without a hang.
	env := Env{Rank: 0, WorldSize: 1, LocalWorldSize: 1, MasterAddr: "127.0.0.1", MasterPort: freePort(t), Token: testToken}
	if _, _, err := RendezvousTLS(ctx, env, TLSFiles{CertFile: job.CertFile, KeyFile: job.KeyFile}, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("RendezvousTLS without a CA: %v; want ErrInvalidArgument", err)
	}
}

// TestStoreBoundsServerStaysUp exceeds each bound (key size, value size, number of keys,
// and a message far above gRPC's receive limit) from one client, over TLS, and checks
// that each is an error and that another client is served all along.
func TestStoreBoundsServerStaysUp(t *testing.T) {
	job, _ := testPKI(t)
	srvTLS, err := job.ServerConfig()
	if err != nil {
		t.Fatal(err)
	}
	cliTLS, err := job.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	const maxKeys, maxKey, maxValue = 4, 32, 1 << 10
	s := startServer(t, StoreServerOptions{TLS: srvTLS, MaxKeys: maxKeys, MaxKeyBytes: maxKey, MaxValueBytes: maxValue})
	bad := dialTLS(t, s.Addr(), cliTLS)
	good := dialTLS(t, s.Addr(), cliTLS)
	ctx := context.Background()
	n := 0
	stillUp := func(what string) {
		t.Helper()
		n++
		if v, err := good.Add(ctx, "good", 1); err != nil || v != int64(n) {
			t.Fatalf("after %s: good client's Add = %d, %v; want %d", what, v, err, n)
		}
	}
	stillUp("nothing")
	long := strings.Repeat("k", maxKey+1)
	attacks := []struct {
		name string
		do   func() error
	}{
		{"key too long (Set)", func() error { return bad.Set(ctx, long, []byte("v")) }},
		{"key too long (Wait)", func() error { return bad.Wait(ctx, "ok", long) }},
		{"key of 1 MiB (Get)", func() error { _, err := bad.Get(ctx, strings.Repeat("x", 1<<20)); return err }},
		{"value too big", func() error { return bad.Set(ctx, "v", make([]byte, maxValue+1)) }},
		{"value of 64 MiB", func() error { return bad.Set(ctx, "v", make([]byte, 64<<20)) }},
		{"too many keys", func() error {
			for i := range maxKeys + 1 {
				if err := bad.Set(ctx, fmt.Sprintf("k%d", i), []byte("v")); err != nil {
					return err
				}
			}
			return nil
		}},
	}
	for _, a := range attacks {
		err := a.do()
		if err == nil {
			t.Errorf("%s: no error", a.name)
		} else if c := status.Code(err); c != codes.InvalidArgument && c != codes.ResourceExhausted {
			t.Errorf("%s: %v; want InvalidArgument or ResourceExhausted", a.name, err)
		}
		stillUp(a.name)
	}
	// A raw client that sends a message beyond the server's receive limit.
	conn, err := grpc.NewClient(s.Addr(), grpc.WithTransportCredentials(credentials.NewTLS(cliTLS)),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(1<<30)))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	raw := storepb.NewStoreClient(conn)
	mctx := metadata.AppendToOutgoingContext(ctx, TokenMetadataKey, testToken)
	if _, err := raw.Set(mctx, &storepb.SetRequest{Key: "huge", Value: make([]byte, 8<<20)}); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("raw 8 MiB Set: %v; want ResourceExhausted", err)
	}
	stillUp("raw oversized message")
}
