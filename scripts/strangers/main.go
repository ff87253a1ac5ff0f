// Command strangers is scripts/strangers.sh's helper: it makes a throwaway PKI for a job,
// and plays the strangers that knock on a job's listening ports.
//
//	go run ./scripts/strangers certs DIR
//	    writes DIR/job/{ca.crt,node.crt,node.key} (the job's CA and a certificate for
//	    127.0.0.1) and DIR/stranger/{ca.crt,stranger.crt,stranger.key} (another CA's).
//	go run ./scripts/strangers attack DIR STORE_PORT [DATA_PORT...]
//	    throws at each port: 4 KiB of random bytes, a TLS client without a certificate, a
//	    TLS client with the stranger's certificate; and at the store, a client with the
//	    job's certificate but a wrong token, and oversized keys and values. Prints one
//	    line per attempt; exits 1 if any was let in.
package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/goddp/goddp/internal/tlstest"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/storepb"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: strangers certs DIR | strangers attack DIR STORE_PORT [DATA_PORT...]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "certs":
		err = certs(os.Args[2])
	case "attack":
		err = attack(os.Args[2], os.Args[3], os.Args[4:])
	default:
		err = fmt.Errorf("unknown mode %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "strangers:", err)
		os.Exit(1)
	}
}

func certs(dir string) error {
	for _, d := range []struct{ sub, ca, name string }{{"job", "job CA", "node"}, {"stranger", "stranger CA", "stranger"}} {
		ca, err := tlstest.NewCA(d.ca)
		if err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Join(dir, d.sub), 0o700); err != nil {
			return err
		}
		if _, err := ca.WriteFiles(filepath.Join(dir, d.sub), d.name, "127.0.0.1", "localhost"); err != nil {
			return err
		}
	}
	return nil
}

var letIn = 0

func report(port, what string, err error) {
	if err == nil {
		letIn++
		fmt.Printf("STRANGER port %s: %-38s LET IN\n", port, what)
		return
	}
	msg := strings.ReplaceAll(err.Error(), "\n", " ")
	if len(msg) > 160 {
		msg = msg[:160] + "..."
	}
	fmt.Printf("STRANGER port %s: %-38s refused: %s\n", port, what, msg)
}

// probe runs hello on a fresh connection to port and then reads: a server that accepts
// the stranger would answer or wait; one that refuses closes the connection.
func probe(port string, wrap func(net.Conn) (net.Conn, error), hello []byte) error {
	c, err := net.DialTimeout("tcp", "127.0.0.1:"+port, 3*time.Second)
	if err != nil {
		return fmt.Errorf("dial: %w", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	conn := c
	if wrap != nil {
		if conn, err = wrap(c); err != nil {
			return err
		}
	}
	if _, err := conn.Write(hello); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	buf := make([]byte, 256)
	for {
		if _, err := conn.Read(buf); err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				return nil // kept waiting for more: not refused
			}
			return fmt.Errorf("connection closed by the server: %w", err)
		}
	}
}

func tlsWrap(cfg *tls.Config) func(net.Conn) (net.Conn, error) {
	return func(c net.Conn) (net.Conn, error) {
		tc := tls.Client(c, cfg)
		if err := tc.Handshake(); err != nil {
			return nil, fmt.Errorf("tls handshake: %w", err)
		}
		return tc, nil
	}
}

func attack(dir, storePort string, dataPorts []string) error {
	job := procgroup.TLSFiles{CertFile: filepath.Join(dir, "job/node.crt"), KeyFile: filepath.Join(dir, "job/node.key"), CAFile: filepath.Join(dir, "job/ca.crt")}
	noCert, err := procgroup.TLSFiles{CAFile: job.CAFile}.ClientConfig()
	if err != nil {
		return err
	}
	stranger, err := procgroup.TLSFiles{CertFile: filepath.Join(dir, "stranger/stranger.crt"), KeyFile: filepath.Join(dir, "stranger/stranger.key"), CAFile: job.CAFile}.ClientConfig()
	if err != nil {
		return err
	}
	insider, err := job.ClientConfig()
	if err != nil {
		return err
	}
	noCert.ServerName, stranger.ServerName = "127.0.0.1", "127.0.0.1" // they trust the job's servers
	garbage := make([]byte, 4096)
	rand.Read(garbage)
	for _, port := range append([]string{storePort}, dataPorts...) {
		report(port, "4 KiB of random bytes", probe(port, nil, garbage))
		report(port, "TLS client without a certificate", probe(port, tlsWrap(noCert), garbage[:64]))
		report(port, "TLS client with a stranger's certificate", probe(port, tlsWrap(stranger), garbage[:64]))
	}
	// The store, with the job's certificate but not its token.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	addr := "127.0.0.1:" + storePort
	_, err = procgroup.DialStore(ctx, addr, "wrong-token", procgroup.DialOptions{TLS: insider})
	report(storePort, "store: wrong token", expect(err, codes.Unauthenticated))
	st, err := procgroup.DialStore(ctx, addr, "", procgroup.DialOptions{TLS: insider})
	report(storePort, "store: no token", expect(err, codes.Unauthenticated))
	if err == nil {
		st.Close()
	}
	// Oversized requests with the job's certificate and a wrong token: the message size
	// limit or the token check refuses them.
	raw, err := dialNoCheck(addr, insider)
	if err != nil {
		return err
	}
	defer raw.Close()
	report(storePort, "store: key of 1 MiB", expect(raw.Set(ctx, strings.Repeat("k", 1<<20), []byte("v")), codes.Unauthenticated, codes.InvalidArgument))
	report(storePort, "store: value of 100 MiB", expect(raw.Set(ctx, "k", make([]byte, 100<<20)), codes.ResourceExhausted))
	if letIn > 0 {
		return fmt.Errorf("%d strangers let in", letIn)
	}
	return nil
}

// expect returns err when it is a refusal with one of codes, a note saying otherwise when
// it is another error, and nil (let in) when the call succeeded.
func expect(err error, want ...codes.Code) error {
	if err == nil {
		return nil
	}
	for _, c := range want {
		if status.Code(err) == c {
			return err
		}
	}
	return fmt.Errorf("refused, but not as expected (%v): %w", status.Code(err), err)
}

// rawStore is a store client that skips DialStore's authenticated first round trip (which
// would refuse the wrong token at once): each request carries the wrong token itself.
type rawStore struct {
	conn *grpc.ClientConn
	rpc  storepb.StoreClient
}

func dialNoCheck(addr string, cfg *tls.Config) (*rawStore, error) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(cfg)),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(1<<30)))
	if err != nil {
		return nil, err
	}
	return &rawStore{conn, storepb.NewStoreClient(conn)}, nil
}

func (s *rawStore) Set(ctx context.Context, key string, value []byte) error {
	ctx = metadata.AppendToOutgoingContext(ctx, procgroup.TokenMetadataKey, "wrong-token")
	_, err := s.rpc.Set(ctx, &storepb.SetRequest{Key: key, Value: value})
	return err
}

func (s *rawStore) Close() error { return s.conn.Close() }
