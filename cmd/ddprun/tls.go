package main

import (
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/goddp/goddp/procgroup"
)

// jobTLS is the job's TLS: the store server's and clients' configurations, and the files
// the ranks get (GODDP_TLS_*). The zero value means no TLS.
type jobTLS struct {
	files          procgroup.TLSFiles
	server, client *tls.Config
}

// tlsFlags defines --tls_cert, --tls_key, --tls_ca and --tls_mtls on fs.
func tlsFlags(fs *flag.FlagSet, f *procgroup.TLSFiles) {
	fs.StringVar(&f.CertFile, "tls_cert", "", "PEM certificate of this node, for the store and the data plane (default $"+procgroup.EnvTLSCert+")")
	fs.StringVar(&f.KeyFile, "tls_key", "", "PEM private key of --tls_cert (default $"+procgroup.EnvTLSKey+")")
	fs.StringVar(&f.CAFile, "tls_ca", "", "PEM CA bundle that verifies the job's certificates (default $"+procgroup.EnvTLSCA+")")
	fs.BoolVar(&f.RequireClientCert, "tls_mtls", false, "mutual TLS: servers require a client certificate signed by --tls_ca (default $"+procgroup.EnvTLSMTLS+")")
}

// validateTLS checks the TLS flags: all three files together (every rank is a server and
// a client of the data plane).
func (c *config) validateTLS() error {
	f := c.tlsFlags
	if !f.Enabled() {
		return nil
	}
	if f.CertFile == "" || f.KeyFile == "" || f.CAFile == "" {
		return errors.New("TLS needs --tls_cert, --tls_key and --tls_ca together")
	}
	return nil
}

// loadTLS reads the TLS flags, or else GODDP_TLS_* in ddprun's environment env, and loads
// the certificates, so that a bad file fails before any rank starts.
func (c *config) loadTLS(env []string) error {
	f := c.tlsFlags
	if !f.Enabled() {
		var err error
		f, err = procgroup.TLSFromEnv(func(k string) (string, bool) {
			for i := len(env) - 1; i >= 0; i-- {
				if v, ok := strings.CutPrefix(env[i], k+"="); ok {
					return v, true
				}
			}
			return "", false
		})
		if err != nil {
			return err
		}
		if !f.Enabled() {
			c.tls = jobTLS{}
			return nil
		}
	}
	for _, p := range []*string{&f.CertFile, &f.KeyFile, &f.CAFile} {
		if *p != "" {
			abs, err := filepath.Abs(*p)
			if err != nil {
				return fmt.Errorf("tls: %w", err)
			}
			*p = abs
		}
	}
	// Every rank dials and accepts (PeerConfig); ddprun serves the store and dials it.
	if _, err := f.PeerConfig(); err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	srv, err := f.ServerConfig()
	if err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	cli, err := f.ClientConfig()
	if err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	c.tls = jobTLS{files: f, server: srv, client: cli}
	return nil
}

// env is the ranks' GODDP_TLS_* variables.
func (t jobTLS) env() [][2]string {
	var kvs [][2]string
	for _, kv := range t.files.Environ() {
		k, v, _ := strings.Cut(kv, "=")
		kvs = append(kvs, [2]string{k, v})
	}
	return kvs
}
