package gloo

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/goddp/goddp/internal/tlstest"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// peerTLS returns a data-plane TLS config (mutual TLS) with a certificate for hosts,
// signed by a new CA, and the TLSFiles it was built from.
func peerTLS(t testing.TB, ca *tlstest.CA, name string, hosts ...string) (*tls.Config, procgroup.TLSFiles) {
	t.Helper()
	if ca == nil {
		var err error
		if ca, err = tlstest.NewCA("goddp gloo test CA"); err != nil {
			t.Fatal(err)
		}
	}
	f, err := ca.WriteFiles(t.TempDir(), name, hosts...)
	if err != nil {
		t.Fatal(err)
	}
	files := procgroup.TLSFiles{CertFile: f.Cert, KeyFile: f.Key, CAFile: f.CA, RequireClientCert: true}
	cfg, err := files.PeerConfig()
	if err != nil {
		t.Fatal(err)
	}
	return cfg, files
}

// TestConformanceTLS runs the shared suite over TCP with mutual TLS, at world sizes 2 and 3,
// with both algorithms.
func TestConformanceTLS(t *testing.T) {
	cfg, _ := peerTLS(t, nil, "rank", "127.0.0.1")
	for _, v := range []variant{
		{"tls-auto", &Config{Transport: TransportTCP, TLS: cfg}},
		{"tls-ring", &Config{Transport: TransportTCP, Algorithm: AlgoRing, SegmentSize: 4096, TLS: cfg}},
	} {
		t.Run(v.name, func(t *testing.T) {
			pgtest.Run(t, func(t testing.TB, size int) []procgroup.ProcessGroup {
				return startGroupsNoCleanup(t, size, v.cfg)
			}, pgtest.SuiteOptions{Sizes: []int{2, 3}, Short: true, Large: 1 << 14})
		})
	}
}

// TestTLSUsed checks that the mesh's TCP connections are TLS, and that Options.TLS works
// as well as Config.TLS, with the two-rank path (no inline exchange over TLS).
func TestTLSUsed(t *testing.T) {
	cfg, _ := peerTLS(t, nil, "rank", "127.0.0.1")
	store := procgroup.NewMemStore()
	defer store.Close()
	groups := make([]procgroup.ProcessGroup, 2)
	each(t, groups, func(r int, _ procgroup.ProcessGroup) error {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		var err error
		groups[r], err = procgroup.New(ctx, "gloo", procgroup.Options{
			Rank: r, Size: 2, Store: store, Prefix: "opts-tls", Token: "secret",
			Backend: &Config{Transport: TransportTCP}, TLS: cfg,
		})
		return err
	})
	defer func() {
		for _, g := range groups {
			g.Close()
		}
	}()
	for r, pg := range groups {
		p := pg.(*group).peers[1-r]
		tc, ok := p.conn.(tlsConn)
		if !ok {
			t.Fatalf("rank %d: connection is %T, want TLS", r, p.conn)
		}
		if st := tc.ConnectionState(); st.Version != tls.VersionTLS13 || len(st.PeerCertificates) == 0 {
			t.Fatalf("rank %d: TLS version %x, %d peer certificates", r, st.Version, len(st.PeerCertificates))
		}
	}
	checkAllReduce(t, groups, 1000)
	checkAllReduce(t, groups, 3<<18)
}

// TestTLSStrangers: with mutual TLS, a client without a certificate, one with a
// certificate of another CA (even one that knows the token) and a plain-text client that
// knows the token are all refused before the token check and logged; the group keeps
// working.
func TestTLSStrangers(t *testing.T) {
	ca, err := tlstest.NewCA("job CA")
	if err != nil {
		t.Fatal(err)
	}
	cfg, files := peerTLS(t, ca, "rank", "127.0.0.1")
	strangerCfg, _ := peerTLS(t, nil, "stranger", "127.0.0.1")
	core, logs := observer.New(zap.WarnLevel)
	groups := startGroupsLogged(t, 3, &Config{Transport: TransportTCP, TLS: cfg, HandshakeTimeout: 2 * time.Second}, zap.New(core))
	g0 := groups[0].(*group)
	addr := g0.listeners[0].Addr().String()
	rightKey := &handshaker{key: groupKey("secret", g0.opts.Prefix), rank: 2, size: 3, rand: rand.Reader}

	noCert, err := procgroup.TLSFiles{CAFile: files.CAFile}.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	noCert.ServerName = "127.0.0.1"
	strangerCfg = strangerCfg.Clone()
	strangerCfg.ServerName = "127.0.0.1"
	strangerCfg.RootCAs = cfg.RootCAs // it trusts the job's server, but the job does not trust it
	attacks := map[string]func(c net.Conn) error{
		"plain text with the token": func(c net.Conn) error { return rightKey.dial(c, 0) },
		"garbage":                   func(c net.Conn) error { _, err := c.Write([]byte(strings.Repeat("garbage!", 512))); return err },
		"tls without certificate": func(c net.Conn) error {
			return rightKey.dial(tls.Client(c, noCert), 0)
		},
		"tls with a stranger's certificate": func(c net.Conn) error {
			return rightKey.dial(tls.Client(c, strangerCfg), 0)
		},
	}
	for name, f := range attacks {
		before := logs.FilterMessage("gloo: refused connection").Len()
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		err = f(c)
		if name != "garbage" && err == nil {
			t.Errorf("%s: handshake accepted", name)
		}
		// Wait for the acceptor's verdict (it reads until the stranger's bytes are wrong).
		c.Read(make([]byte, 1))
		c.Close()
		deadline := time.Now().Add(5 * time.Second)
		for logs.FilterMessage("gloo: refused connection").Len() == before && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if logs.FilterMessage("gloo: refused connection").Len() == before {
			t.Errorf("%s: not logged", name)
		}
		checkAllReduce(t, groups, 1000)
	}
	for _, e := range logs.FilterMessage("gloo: refused connection").All() {
		if !strings.Contains(e.ContextMap()["error"].(string), "tls") {
			t.Errorf("refusal not at the TLS layer: %v", e.ContextMap())
		}
		t.Logf("logged: %s %v", e.Message, e.ContextMap())
	}
	checkAllReduce(t, groups, 3<<18)
}

// TestTLSUntrustedRank: a rank whose certificate comes from another CA cannot join; the
// dialing rank fails at once with an error that names the peer and the certificate.
func TestTLSUntrustedRank(t *testing.T) {
	ca, err := tlstest.NewCA("job CA")
	if err != nil {
		t.Fatal(err)
	}
	good, _ := peerTLS(t, ca, "rank", "127.0.0.1")
	bad, _ := peerTLS(t, nil, "impostor", "127.0.0.1")
	store := procgroup.NewMemStore()
	defer store.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errs := make([]error, 2)
	groups := make([]procgroup.ProcessGroup, 2)
	done := make(chan int)
	for r, cfg := range []*tls.Config{good, bad} {
		go func() {
			groups[r], errs[r] = procgroup.New(ctx, "gloo", procgroup.Options{
				Rank: r, Size: 2, Store: store, Prefix: "impostor", Token: "secret",
				Backend: &Config{Transport: TransportTCP, TLS: cfg, HandshakeTimeout: 2 * time.Second},
			})
			done <- r
		}()
	}
	// Rank 1 (the impostor) dials rank 0 and refuses its certificate: it fails at once.
	if r := <-done; r != 1 {
		t.Fatalf("rank %d returned first (%v)", r, errs[r])
	}
	if !errors.Is(errs[1], errAuth) || !strings.Contains(errs[1].Error(), "rank 0") || !strings.Contains(errs[1].Error(), "certificate") {
		t.Errorf("impostor: %v; want an authentication error naming rank 0 and the certificate", errs[1])
	}
	if ctx.Err() != nil {
		t.Errorf("impostor's refusal took until the deadline")
	}
	cancel() // rank 0 waits for a peer that will not come
	<-done
	if errs[0] == nil {
		groups[0].Close()
		t.Error("rank 0 formed a group with the impostor")
	}
	for _, g := range groups {
		if g != nil {
			g.Close()
		}
	}
}
