package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/goddp/goddp/internal/tlstest"
	"github.com/goddp/goddp/procgroup"
)

// TestTLSStore: with --tls_* flags ddprun's store serves TLS clients only, and the ranks
// get the files in GODDP_TLS_*; GODDP_TLS_* in ddprun's environment work as well.
func TestTLSStore(t *testing.T) {
	ca, err := tlstest.NewCA("ddprun test CA")
	if err != nil {
		t.Fatal(err)
	}
	f, err := ca.WriteFiles(t.TempDir(), "node", "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		flags []string
		env   []string
	}{
		{"flags", []string{"--tls_cert", f.Cert, "--tls_key", f.Key, "--tls_ca", f.CA, "--tls_mtls"}, nil},
		{"env", nil, []string{"GODDP_TLS_CERT=" + f.Cert, "GODDP_TLS_KEY=" + f.Key, "GODDP_TLS_CA=" + f.CA, "GODDP_TLS_MTLS=1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := parseArgs(append(append([]string{"--standalone"}, tc.flags...), "prog"), func(string) {})
			if err != nil {
				t.Fatal(err)
			}
			if err := cfg.loadTLS(tc.env); err != nil {
				t.Fatal(err)
			}
			srv, addr, err := hostStore(cfg, "tok", zap.NewNop())
			if err != nil {
				t.Fatal(err)
			}
			defer srv.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			st, err := procgroup.DialStore(ctx, addr, "tok", procgroup.DialOptions{TLS: cfg.tls.client})
			if err != nil {
				t.Fatalf("TLS client: %v", err)
			}
			if n, err := st.Add(ctx, "k", 3); err != nil || n != 3 {
				t.Fatalf("Add = %d, %v", n, err)
			}
			st.Close()
			short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
			defer cancelShort()
			if st, err := procgroup.DialStore(short, addr, "tok", procgroup.DialOptions{}); err == nil {
				st.Close()
				t.Fatal("plain-text client reached the TLS store")
			}
			j := &job{cfg: cfg, storeAddr: addr, tokenFile: "/tmp/token", runID: "r"}
			env := strings.Join(j.rankEnv(&rankProc{rank: 0}, 0), "\n") + "\n"
			for _, want := range []string{"GODDP_TLS_CERT=" + f.Cert, "GODDP_TLS_KEY=" + f.Key, "GODDP_TLS_CA=" + f.CA, "GODDP_TLS_MTLS=1"} {
				if !strings.Contains(env, want+"\n") {
					t.Errorf("rank environment lacks %s", want)
				}
			}
		})
	}
	for _, bad := range [][]string{
		{"--tls_cert", f.Cert},
		{"--tls_ca", f.CA, "--tls_mtls"},
	} {
		if _, err := parseArgs(append(append([]string{"--standalone"}, bad...), "prog"), func(string) {}); err == nil {
			t.Errorf("flags %q accepted", bad)
		}
	}
	cfg, err := parseArgs([]string{"--standalone", "--tls_cert", f.Key, "--tls_key", f.Key, "--tls_ca", f.CA, "prog"}, func(string) {})
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.loadTLS(nil); err == nil {
		t.Error("a key file as the certificate was accepted")
	}
}
