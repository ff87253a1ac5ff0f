package procgroup

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/big"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/goddp/goddp/procgroup/storepb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const testToken = "s3cret-job-token"

func startServer(t *testing.T, opts StoreServerOptions) *StoreServer {
	t.Helper()
	if opts.Addr == "" {
		opts.Addr = "127.0.0.1:0"
	}
	if opts.Token == "" {
		opts.Token = testToken
	}
	s, err := StartStoreServer(opts)
	if err != nil {
		t.Fatalf("StartStoreServer: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("server Close: %v", err)
		}
	})
	return s
}

func dial(t *testing.T, addr, token string) Store {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := DialStore(ctx, addr, token, DialOptions{})
	if err != nil {
		t.Fatalf("DialStore: %v", err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

func TestGRPCStoreMethods(t *testing.T) {
	s := startServer(t, StoreServerOptions{})
	st := dial(t, s.Addr(), testToken)
	ctx := context.Background()

	if err := st.Set(ctx, "a", []byte("alpha")); err != nil {
		t.Fatal(err)
	}
	if err := st.Set(ctx, "empty", nil); err != nil {
		t.Fatal(err)
	}
	if v, err := st.Get(ctx, "a"); err != nil || string(v) != "alpha" {
		t.Fatalf("Get a = %q, %v; want alpha", v, err)
	}
	if v, err := st.Get(ctx, "empty"); err != nil || v == nil || len(v) != 0 {
		t.Fatalf("Get empty = %#v, %v; want a non-nil empty value", v, err)
	}

	for i, want := range []int64{5, 2, 1002} {
		delta := []int64{5, -3, 1000}[i]
		if n, err := st.Add(ctx, "ctr", delta); err != nil || n != want {
			t.Fatalf("Add #%d = %d, %v; want %d", i, n, err, want)
		}
	}
	if v, _ := st.Get(ctx, "ctr"); string(v) != "1002" {
		t.Fatalf("counter reads %q, want 1002", v)
	}
	if _, err := st.Add(ctx, "a", 1); !errors.Is(err, ErrInvalidArgument) || status.Code(err) != codes.InvalidArgument {
		t.Fatalf("Add to a non-integer: %v; want ErrInvalidArgument with InvalidArgument", err)
	}

	// CompareAndSet: absent → set; wrong expected → no swap; right one → swap.
	casCases := []struct {
		name              string
		expected, desired []byte
		wantValue         []byte
		wantSwapped       bool
	}{
		{"absent to v1", nil, []byte("v1"), []byte("v1"), true},
		{"expect absent but present", nil, []byte("x"), []byte("v1"), false},
		{"wrong expected", []byte("nope"), []byte("x"), []byte("v1"), false},
		{"right expected", []byte("v1"), []byte("v2"), []byte("v2"), true},
		{"to empty", []byte("v2"), []byte{}, []byte{}, true},
		{"empty expected matches empty", []byte{}, []byte("v3"), []byte("v3"), true},
	}
	for _, c := range casCases {
		v, ok, err := st.CompareAndSet(ctx, "cas", c.expected, c.desired)
		if err != nil || ok != c.wantSwapped || string(v) != string(c.wantValue) || v == nil {
			t.Fatalf("CAS %s = %q, %v, %v; want %q, %v", c.name, v, ok, err, c.wantValue, c.wantSwapped)
		}
	}
	// Expecting a value from an absent key: no swap, and the key stays absent (nil).
	if v, ok, err := st.CompareAndSet(ctx, "nokey", []byte("x"), []byte("y")); err != nil || ok || v != nil {
		t.Fatalf("CAS on absent key = %q, %v, %v; want nil, false", v, ok, err)
	}

	if ok, err := st.Delete(ctx, "a"); err != nil || !ok {
		t.Fatalf("Delete a = %v, %v; want true", ok, err)
	}
	if ok, err := st.Delete(ctx, "a"); err != nil || ok {
		t.Fatalf("second Delete a = %v, %v; want false", ok, err)
	}
	if err := st.Wait(ctx, "ctr", "cas", "empty"); err != nil {
		t.Fatalf("Wait on present keys: %v", err)
	}
	if _, err := st.Get(ctx, ""); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Get of an empty key: %v; want ErrInvalidArgument", err)
	}
}

// A Get or Wait on an absent key waits on the server until another client sets it.
func TestGRPCStoreGetWaitBlockUntilSet(t *testing.T) {
	s := startServer(t, StoreServerOptions{})
	waiter := dial(t, s.Addr(), testToken)
	setter := dial(t, s.Addr(), testToken)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	type result struct {
		v   []byte
		err error
	}
	got := make(chan result, 1)
	waited := make(chan error, 1)
	go func() {
		v, err := waiter.Get(ctx, "late")
		got <- result{v, err}
	}()
	go func() { waited <- waiter.Wait(ctx, "late", "later") }()

	if err := setter.Set(ctx, "late", []byte("value")); err != nil {
		t.Fatal(err)
	}
	// The key did not exist before this Set, so a correct value proves the Get waited.
	if r := <-got; r.err != nil || string(r.v) != "value" {
		t.Fatalf("Get = %q, %v; want value", r.v, r.err)
	}
	// "later" is still missing: a Wait on it must not complete.
	short, cancelShort := context.WithTimeout(ctx, 100*time.Millisecond)
	err := waiter.Wait(short, "late", "later")
	cancelShort()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Wait with a missing key: %v; want DeadlineExceeded", err)
	}
	if err := setter.Set(ctx, "later", []byte("x")); err != nil {
		t.Fatal(err)
	}
	if err := <-waited; err != nil {
		t.Fatalf("Wait: %v", err)
	}
}

func TestGRPCStoreContextEnds(t *testing.T) {
	s := startServer(t, StoreServerOptions{})
	st := dial(t, s.Addr(), testToken)

	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := st.Get(ctx, "never")
		errc <- err
	}()
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("Get after cancel: %v; want context.Canceled", err)
	}

	dctx, dcancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer dcancel()
	if err := st.Wait(dctx, "never"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Wait past deadline: %v; want DeadlineExceeded", err)
	}
	// The server is still fine.
	if _, err := st.Add(context.Background(), "n", 1); err != nil {
		t.Fatal(err)
	}
}

func TestGRPCStoreAddAtomic(t *testing.T) {
	s := startServer(t, StoreServerOptions{})
	const clients, workers, adds = 4, 8, 25
	var stores []Store
	for range clients {
		stores = append(stores, dial(t, s.Addr(), testToken))
	}
	var (
		mu   sync.Mutex
		seen []int64
		wg   sync.WaitGroup
	)
	errc := make(chan error, clients*workers)
	for c := range clients {
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range adds {
					n, err := stores[c].Add(context.Background(), "counter", 1)
					if err != nil {
						errc <- err
						return
					}
					mu.Lock()
					seen = append(seen, n)
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	// Atomic: each of 1..total was returned exactly once.
	const total = clients * workers * adds
	slices.Sort(seen)
	if len(seen) != total {
		t.Fatalf("%d results, want %d", len(seen), total)
	}
	for i, n := range seen {
		if n != int64(i+1) {
			t.Fatalf("sorted results[%d] = %d, want %d (lost or duplicated increment)", i, n, i+1)
		}
	}
}

func TestGRPCStoreAuth(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	s := startServer(t, StoreServerOptions{Logger: zap.New(core)})

	// Wrong token: DialStore fails at once.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := DialStore(ctx, s.Addr(), "wrong", DialOptions{}); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("DialStore with a wrong token: %v; want Unauthenticated", err)
	}

	// Raw clients: no token, wrong token, token twice; then the right one.
	conn, err := grpc.NewClient(s.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	raw := storepb.NewStoreClient(conn)
	for _, md := range []metadata.MD{
		nil,
		metadata.Pairs(TokenMetadataKey, "wrong"),
		metadata.Pairs(TokenMetadataKey, testToken+"x"),
		metadata.Pairs(TokenMetadataKey, "wrong", TokenMetadataKey, testToken),
	} {
		c := metadata.NewOutgoingContext(ctx, md)
		if _, err := raw.Set(c, &storepb.SetRequest{Key: "k", Value: []byte("v")}); status.Code(err) != codes.Unauthenticated {
			t.Errorf("Set with metadata %v: %v; want Unauthenticated", md, err)
		}
		if _, err := raw.Get(c, &storepb.GetRequest{Key: "k"}); status.Code(err) != codes.Unauthenticated {
			t.Errorf("Get with metadata %v: %v; want Unauthenticated", md, err)
		}
	}
	ok := metadata.NewOutgoingContext(ctx, metadata.Pairs(TokenMetadataKey, testToken))
	if _, err := raw.Add(ok, &storepb.AddRequest{Key: "k", Delta: 1}); err != nil {
		t.Fatalf("Add with the right token: %v", err)
	}
	// Refused calls did not write: the key was created by the Add above.
	if resp, err := raw.Get(ok, &storepb.GetRequest{Key: "k"}); err != nil || string(resp.Value) != "1" {
		t.Fatalf("Get k = %v, %v; want 1", resp, err)
	}
	if n := logs.FilterMessage("store: refused call").Len(); n < 9 {
		t.Errorf("%d refusals logged, want at least 9", n)
	}
}

func TestGRPCStoreBounds(t *testing.T) {
	s := startServer(t, StoreServerOptions{MaxKeys: 3, MaxKeyBytes: 8, MaxValueBytes: 16})
	st := dial(t, s.Addr(), testToken)
	ctx := context.Background()

	check := func(what string, err error, code codes.Code) {
		t.Helper()
		if !errors.Is(err, ErrInvalidArgument) || status.Code(err) != code {
			t.Errorf("%s: %v; want ErrInvalidArgument with %v", what, err, code)
		}
	}
	check("long key", st.Set(ctx, "123456789", []byte("v")), codes.InvalidArgument)
	_, err := st.Get(ctx, strings.Repeat("k", 100))
	check("Get long key", err, codes.InvalidArgument)
	check("big value", st.Set(ctx, "k", make([]byte, 17)), codes.ResourceExhausted)
	_, _, err = st.CompareAndSet(ctx, "k", nil, make([]byte, 17))
	check("CAS big value", err, codes.ResourceExhausted)
	// Far above the gRPC message limit too.
	check("huge value", st.Set(ctx, "k", make([]byte, 1<<20)), codes.ResourceExhausted)

	for _, k := range []string{"k1", "k2", "k3"} {
		if err := st.Set(ctx, k, make([]byte, 16)); err != nil {
			t.Fatalf("Set %s within bounds: %v", k, err)
		}
	}
	check("fourth key", st.Set(ctx, "k4", []byte("v")), codes.ResourceExhausted)
	_, err = st.Add(ctx, "k5", 1)
	check("Add of a new key", err, codes.ResourceExhausted)
	_, _, err = st.CompareAndSet(ctx, "k6", nil, []byte("v"))
	check("CAS of a new key", err, codes.ResourceExhausted)
	// Existing keys stay writable; deleting makes room.
	if err := st.Set(ctx, "k1", []byte("new")); err != nil {
		t.Fatalf("overwrite at the key limit: %v", err)
	}
	if _, err := st.Delete(ctx, "k2"); err != nil {
		t.Fatal(err)
	}
	if n, err := st.Add(ctx, "k4", 7); err != nil || n != 7 {
		t.Fatalf("Add after Delete = %d, %v; want 7", n, err)
	}
	if v, err := st.Get(ctx, "k1"); err != nil || string(v) != "new" {
		t.Fatalf("Get k1 = %q, %v", v, err)
	}
}

func TestGRPCStoreClose(t *testing.T) {
	s, err := StartStoreServer(StoreServerOptions{Addr: "127.0.0.1:0", Token: testToken})
	if err != nil {
		t.Fatal(err)
	}
	st := dial(t, s.Addr(), testToken)
	errc := make(chan error, 1)
	go func() {
		_, err := st.Get(context.Background(), "never")
		errc <- err
	}()
	// Whether or not the Get has reached the server when it closes, it must fail, not hang.
	if err := st.Set(context.Background(), "x", []byte("y")); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := <-errc; err == nil {
		t.Fatal("a Get pending on a closed server returned no error")
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := st.Set(context.Background(), "x", nil); err == nil {
		t.Fatal("Set on a closed server succeeded")
	}
	st.Close()
	if err := st.Set(context.Background(), "x", nil); !errors.Is(err, ErrStoreClosed) {
		t.Fatalf("Set on a closed client: %v; want ErrStoreClosed", err)
	}
	if _, err := st.Get(context.Background(), "x"); !errors.Is(err, ErrStoreClosed) {
		t.Fatalf("Get on a closed client: %v; want ErrStoreClosed", err)
	}
}

// DialStore waits for a server that is not up yet.
func TestDialStoreRetriesUntilServerUp(t *testing.T) {
	port := freePort(t)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	type result struct {
		st  Store
		err error
	}
	dialed := make(chan result, 1)
	go func() {
		st, err := DialStore(ctx, addr, testToken, DialOptions{})
		dialed <- result{st, err}
	}()
	s := startServer(t, StoreServerOptions{Addr: addr})
	r := <-dialed
	if r.err != nil {
		t.Fatalf("DialStore: %v", r.err)
	}
	defer r.st.Close()
	if err := r.st.Set(ctx, "k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	_ = s

	// Nobody listening and a short deadline: the dial gives up with ctx's error.
	short, cancelShort := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancelShort()
	if _, err := DialStore(short, fmt.Sprintf("127.0.0.1:%d", freePort(t)), testToken, DialOptions{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("DialStore to nobody: %v; want DeadlineExceeded", err)
	}
}

func TestGRPCStoreTLS(t *testing.T) {
	serverTLS, clientTLS := testTLS(t)
	s := startServer(t, StoreServerOptions{TLS: serverTLS})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := DialStore(ctx, s.Addr(), testToken, DialOptions{TLS: clientTLS})
	if err != nil {
		t.Fatalf("DialStore over TLS: %v", err)
	}
	defer st.Close()
	if n, err := st.Add(ctx, "n", 41); err != nil || n != 41 {
		t.Fatalf("Add over TLS = %d, %v", n, err)
	}
	// A plaintext client never gets an answer.
	short, cancelShort := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancelShort()
	if _, err := DialStore(short, s.Addr(), testToken, DialOptions{}); err == nil {
		t.Fatal("plaintext DialStore to a TLS server succeeded")
	}
}

func TestStartStoreServerBadOptions(t *testing.T) {
	if _, err := StartStoreServer(StoreServerOptions{Addr: "127.0.0.1:0"}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("empty token: %v; want ErrInvalidArgument", err)
	}
	if _, err := StartStoreServer(StoreServerOptions{Addr: "127.0.0.1:0", Token: "t", MaxKeys: -1}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("negative bound: %v; want ErrInvalidArgument", err)
	}
	if _, err := StartStoreServer(StoreServerOptions{Addr: "256.0.0.1:1", Token: "t"}); err == nil {
		t.Error("bad address accepted")
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// testTLS makes a self-signed certificate for 127.0.0.1 and the configs that use it.
func testTLS(t *testing.T) (server, client *tls.Config) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "goddp test store"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IsCA:         true, BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	server = &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}, MinVersion: tls.VersionTLS12}
	client = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	return server, client
}
