package procgroup

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"errors"
	"fmt"
	"math"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	grpcproto "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/goddp/goddp/procgroup/storepb"
)

// TokenMetadataKey is the gRPC metadata key that carries the job token on every store RPC.
const TokenMetadataKey = "goddp-token"

// Default bounds of a StoreServer (StoreServerOptions fields left at 0).
const (
	DefaultStoreMaxKeys       = 1 << 20
	DefaultStoreMaxKeyBytes   = 4 << 10
	DefaultStoreMaxValueBytes = 64 << 20
	DefaultStoreMaxWaitKeys   = 1 << 14
)

// storeCloseGrace bounds how long Close waits for replies in flight before it cuts the
// connections.
const storeCloseGrace = 5 * time.Second

// StoreServerOptions configure StartStoreServer.
type StoreServerOptions struct {
	// Addr is the "host:port" to listen on; port 0 picks a free one (see StoreServer.Addr).
	Addr string
	// Token is the job's secret; every RPC must carry it (metadata "goddp-token"), else it
	// fails with codes.Unauthenticated. Required.
	Token string
	// Logger receives refused calls and lifecycle lines; nil means zap.NewNop().
	Logger *zap.Logger
	// TLS, when set, secures the listener; clients then dial with a matching DialOptions.TLS.
	TLS *tls.Config
	// Bounds; 0 means the Default* constants. A call that exceeds one fails (codes.
	// ResourceExhausted or InvalidArgument) and the server stays up.
	MaxKeys, MaxKeyBytes, MaxValueBytes int
	// MaxWaitKeys bounds the keys of one Wait; a longer list is refused before it is
	// decoded (a message of one-byte keys would otherwise decode into ~8x its size).
	MaxWaitKeys int
}

func (o *StoreServerOptions) validate() error {
	if o.Token == "" {
		return fmt.Errorf("%w: store server: empty token", ErrInvalidArgument)
	}
	if o.MaxKeys < 0 || o.MaxKeyBytes < 0 || o.MaxValueBytes < 0 || o.MaxWaitKeys < 0 {
		return fmt.Errorf("%w: store server: negative bound", ErrInvalidArgument)
	}
	if o.MaxKeys == 0 {
		o.MaxKeys = DefaultStoreMaxKeys
	}
	if o.MaxKeyBytes == 0 {
		o.MaxKeyBytes = DefaultStoreMaxKeyBytes
	}
	if o.MaxValueBytes == 0 {
		o.MaxValueBytes = DefaultStoreMaxValueBytes
	}
	if o.MaxWaitKeys == 0 {
		o.MaxWaitKeys = DefaultStoreMaxWaitKeys
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	return nil
}

// storeCodec is the proto codec, but it counts the keys of a WaitRequest on the wire and
// refuses more than maxWaitKeys before it decodes any.
type storeCodec struct {
	base        encoding.CodecV2
	maxWaitKeys int
}

func (c storeCodec) Name() string                           { return c.base.Name() }
func (c storeCodec) Marshal(v any) (mem.BufferSlice, error) { return c.base.Marshal(v) }

func (c storeCodec) Unmarshal(data mem.BufferSlice, v any) error {
	req, ok := v.(*storepb.WaitRequest)
	if !ok {
		return c.base.Unmarshal(data, v)
	}
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	b := buf.ReadOnlyData()
	for n := 0; len(b) > 0; {
		num, typ, k := protowire.ConsumeTag(b)
		if k < 0 {
			break // malformed: proto.Unmarshal says so
		}
		m := protowire.ConsumeFieldValue(num, typ, b[k:])
		if m < 0 {
			break
		}
		if num == 1 {
			if n++; n > c.maxWaitKeys {
				return fmt.Errorf("goddp store: a wait for more than %d keys (the limit)", c.maxWaitKeys)
			}
		}
		b = b[k+m:]
	}
	return proto.Unmarshal(buf.ReadOnlyData(), req)
}

// StoreServer serves a MemStore over gRPC to the ranks of one job.
type StoreServer struct {
	storepb.UnimplementedStoreServer

	opts      StoreServerOptions
	tokenHash [sha256.Size]byte
	mem       *MemStore
	lis       net.Listener
	srv       *grpc.Server
	served    chan struct{} // closed when the Serve goroutine has returned
	serveErr  error         // written before served is closed

	// createMu serializes the calls that may create a key (Set, Add, CompareAndSet), so that
	// the MaxKeys check and the creation are atomic together.
	createMu sync.Mutex

	closeOnce sync.Once
}

// StartStoreServer listens on opts.Addr and serves the store until Close.
func StartStoreServer(opts StoreServerOptions) (*StoreServer, error) {
	if err := opts.validate(); err != nil {
		return nil, err
	}
	lis, err := net.Listen("tcp", opts.Addr)
	if err != nil {
		return nil, fmt.Errorf("procgroup: store server: %w", err)
	}
	s := &StoreServer{
		opts:      opts,
		tokenHash: sha256.Sum256([]byte(opts.Token)),
		mem:       NewMemStore(),
		lis:       lis,
		served:    make(chan struct{}),
	}
	sopts := []grpc.ServerOption{
		grpc.UnaryInterceptor(s.authenticate),
		// A message holds at most one key and one value, plus framing.
		grpc.MaxRecvMsgSize(opts.MaxValueBytes + opts.MaxKeyBytes + 1024),
		grpc.MaxSendMsgSize(math.MaxInt32),
		// Stop then waits for the handlers to return (Close promises no goroutine left).
		grpc.WaitForHandlers(true),
		grpc.ForceServerCodecV2(storeCodec{base: encoding.GetCodecV2(grpcproto.Name), maxWaitKeys: opts.MaxWaitKeys}),
	}
	if opts.TLS != nil {
		sopts = append(sopts, grpc.Creds(newLoggedCreds(opts.TLS, opts.Logger))) // logs refused handshakes (tls.go)
	}
	s.srv = grpc.NewServer(sopts...)
	storepb.RegisterStoreServer(s.srv, s)
	go func() {
		defer close(s.served)
		s.serveErr = s.srv.Serve(lis)
	}()
	opts.Logger.Info("store server listening", zap.String("addr", s.Addr()), zap.Bool("tls", opts.TLS != nil))
	return s, nil
}

// Addr is the address the server listens on, with the port it picked.
func (s *StoreServer) Addr() string { return s.lis.Addr().String() }

// Close stops serving: pending calls (a Get waiting for a key, say) fail, replies already
// computed are delivered (for at most a few seconds), connections are closed, and Close returns once every goroutine of the server has returned. It is
// idempotent.
func (s *StoreServer) Close() error {
	var err error
	s.closeOnce.Do(func() {
		// Closing the state first makes the handlers waiting in Get and Wait return; then a
		// graceful stop lets the replies of calls already answered reach their clients (a
		// rank's last Set must not fail because rank 0 stopped its server right after it).
		s.mem.Close()
		stopped := make(chan struct{})
		go func() {
			defer close(stopped)
			s.srv.GracefulStop()
		}()
		timer := time.NewTimer(storeCloseGrace)
		select {
		case <-stopped:
		case <-timer.C:
			s.srv.Stop() // a client that does not read its replies
			<-stopped
		}
		timer.Stop()
		<-s.served
		if s.serveErr != nil && !errors.Is(s.serveErr, grpc.ErrServerStopped) {
			err = fmt.Errorf("procgroup: store server: %w", s.serveErr)
		}
		s.opts.Logger.Info("store server closed", zap.String("addr", s.Addr()))
	})
	return err
}

// authenticate refuses every call that does not carry the job token. The token is compared
// through its SHA-256, in constant time, so neither its bytes nor its length leak.
func (s *StoreServer) authenticate(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	vals := md.Get(TokenMetadataKey)
	ok := false
	if len(vals) == 1 {
		h := sha256.Sum256([]byte(vals[0]))
		ok = subtle.ConstantTimeCompare(h[:], s.tokenHash[:]) == 1
	}
	if !ok {
		from := "unknown"
		if p, found := peer.FromContext(ctx); found {
			from = p.Addr.String()
		}
		reason := "wrong token"
		if len(vals) == 0 {
			reason = "no token"
		}
		s.opts.Logger.Warn("store: refused call", zap.String("method", info.FullMethod),
			zap.String("peer", from), zap.String("reason", reason))
		return nil, status.Error(codes.Unauthenticated, "goddp store: "+reason)
	}
	return handler(ctx, req)
}

func (s *StoreServer) checkKey(key string) error {
	if key == "" {
		return status.Error(codes.InvalidArgument, "goddp store: empty key")
	}
	if len(key) > s.opts.MaxKeyBytes {
		return status.Errorf(codes.InvalidArgument, "goddp store: key of %d bytes exceeds the limit of %d", len(key), s.opts.MaxKeyBytes)
	}
	return nil
}

func (s *StoreServer) checkValue(key string, v []byte) error {
	if len(v) > s.opts.MaxValueBytes {
		return status.Errorf(codes.ResourceExhausted, "goddp store: value of %d bytes for %q exceeds the limit of %d", len(v), key, s.opts.MaxValueBytes)
	}
	return nil
}

// checkRoom refuses to create a key beyond MaxKeys; s.createMu must be held.
func (s *StoreServer) checkRoom(key string) error {
	if s.mem.Len() < s.opts.MaxKeys {
		return nil
	}
	// At the limit: only calls on an existing key may go on. A Get with an ended context
	// answers at once, from the map, without waiting.
	done, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := s.mem.Get(done, key); err == nil {
		return nil
	}
	return status.Errorf(codes.ResourceExhausted, "goddp store: %d keys, the limit", s.opts.MaxKeys)
}

// toStatus maps a MemStore error to a gRPC status.
func toStatus(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ErrStoreClosed):
		return status.Error(codes.Unavailable, "goddp store: server closing")
	case errors.Is(err, ErrInvalidArgument):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return status.FromContextError(err).Err()
	}
	return status.Error(codes.Internal, err.Error())
}

// Set implements storepb.StoreServer.
func (s *StoreServer) Set(ctx context.Context, req *storepb.SetRequest) (*storepb.SetResponse, error) {
	if err := s.checkKey(req.Key); err != nil {
		return nil, err
	}
	if err := s.checkValue(req.Key, req.Value); err != nil {
		return nil, err
	}
	s.createMu.Lock()
	defer s.createMu.Unlock()
	if err := s.checkRoom(req.Key); err != nil {
		return nil, err
	}
	v := req.Value
	if v == nil {
		v = []byte{} // a key that exists never holds nil (see CompareAndSet)
	}
	return &storepb.SetResponse{}, toStatus(s.mem.Set(ctx, req.Key, v))
}

// Get implements storepb.StoreServer.
func (s *StoreServer) Get(ctx context.Context, req *storepb.GetRequest) (*storepb.GetResponse, error) {
	if err := s.checkKey(req.Key); err != nil {
		return nil, err
	}
	v, err := s.mem.Get(ctx, req.Key)
	if err != nil {
		return nil, toStatus(err)
	}
	return &storepb.GetResponse{Value: v}, nil
}

// Add implements storepb.StoreServer.
func (s *StoreServer) Add(ctx context.Context, req *storepb.AddRequest) (*storepb.AddResponse, error) {
	if err := s.checkKey(req.Key); err != nil {
		return nil, err
	}
	s.createMu.Lock()
	defer s.createMu.Unlock()
	if err := s.checkRoom(req.Key); err != nil {
		return nil, err
	}
	n, err := s.mem.Add(ctx, req.Key, req.Delta)
	if err != nil {
		return nil, toStatus(err)
	}
	return &storepb.AddResponse{Value: n}, nil
}

// CompareAndSet implements storepb.StoreServer.
func (s *StoreServer) CompareAndSet(ctx context.Context, req *storepb.CompareAndSetRequest) (*storepb.CompareAndSetResponse, error) {
	if err := s.checkKey(req.Key); err != nil {
		return nil, err
	}
	if err := s.checkValue(req.Key, req.Desired); err != nil {
		return nil, err
	}
	var expected []byte // nil: "absent" for MemStore
	if !req.ExpectAbsent {
		expected = req.Expected
		if expected == nil {
			expected = []byte{}
		}
	}
	desired := req.Desired
	if desired == nil {
		desired = []byte{} // MemStore would store nil, which reads back as "absent"
	}
	s.createMu.Lock()
	defer s.createMu.Unlock()
	if err := s.checkRoom(req.Key); err != nil {
		return nil, err
	}
	v, swapped, err := s.mem.CompareAndSet(ctx, req.Key, expected, desired)
	if err != nil {
		return nil, toStatus(err)
	}
	return &storepb.CompareAndSetResponse{Value: v, Exists: v != nil, Swapped: swapped}, nil
}

// Delete implements storepb.StoreServer.
func (s *StoreServer) Delete(ctx context.Context, req *storepb.DeleteRequest) (*storepb.DeleteResponse, error) {
	if err := s.checkKey(req.Key); err != nil {
		return nil, err
	}
	ok, err := s.mem.Delete(ctx, req.Key)
	if err != nil {
		return nil, toStatus(err)
	}
	return &storepb.DeleteResponse{Existed: ok}, nil
}

// Wait implements storepb.StoreServer.
func (s *StoreServer) Wait(ctx context.Context, req *storepb.WaitRequest) (*storepb.WaitResponse, error) {
	if len(req.Keys) > s.opts.MaxWaitKeys { // storeCodec refuses it first, on the wire
		return nil, status.Errorf(codes.InvalidArgument, "goddp store: a wait for %d keys exceeds the limit of %d", len(req.Keys), s.opts.MaxWaitKeys)
	}
	for _, k := range req.Keys {
		if err := s.checkKey(k); err != nil {
			return nil, err
		}
	}
	if err := s.mem.Wait(ctx, req.Keys...); err != nil {
		return nil, toStatus(err)
	}
	return &storepb.WaitResponse{}, nil
}

// DialOptions configure DialStore.
type DialOptions struct {
	// TLS, when set, is used to reach a server started with StoreServerOptions.TLS.
	TLS *tls.Config
	// Logger receives connection lines; nil means zap.NewNop().
	Logger *zap.Logger
}

// DialStore connects to the store server at addr and returns a client that implements Store.
// It waits, retrying with backoff, until the server answers or ctx ends; a server that
// refuses the token fails the dial at once with codes.Unauthenticated. The returned Store's
// calls fail fast (an unreachable server is an error, not a wait); Get and Wait wait on the
// server for the key, bounded by their ctx.
func DialStore(ctx context.Context, addr, token string, opts DialOptions) (Store, error) {
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	creds := insecure.NewCredentials()
	if opts.TLS != nil {
		creds = credentials.NewTLS(opts.TLS)
	}
	bc := backoff.DefaultConfig
	bc.BaseDelay = 50 * time.Millisecond
	bc.MaxDelay = 2 * time.Second
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(creds),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: bc, MinConnectTimeout: 5 * time.Second}),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(math.MaxInt32), grpc.MaxCallSendMsgSize(math.MaxInt32)),
	)
	if err != nil {
		return nil, fmt.Errorf("procgroup: dial store %s: %w", addr, err)
	}
	c := &storeClient{addr: addr, token: token, conn: conn, rpc: storepb.NewStoreClient(conn), done: make(chan struct{})}
	// A Wait for no keys is the cheapest authenticated round trip; WaitForReady makes it
	// wait through connection failures (with the backoff above) until ctx ends.
	if _, err := c.rpc.Wait(c.ctx(ctx), &storepb.WaitRequest{}, grpc.WaitForReady(true)); err != nil {
		conn.Close()
		return nil, c.wrap("dial", "", ctx, err)
	}
	opts.Logger.Debug("store connected", zap.String("addr", addr))
	return c, nil
}

// storeClient is the Store that DialStore returns.
type storeClient struct {
	addr  string
	token string
	conn  *grpc.ClientConn
	rpc   storepb.StoreClient

	closeOnce sync.Once
	done      chan struct{} // closed by Close
}

var _ Store = (*storeClient)(nil)

func (c *storeClient) ctx(ctx context.Context) context.Context {
	return metadata.AppendToOutgoingContext(ctx, TokenMetadataKey, c.token)
}

func (c *storeClient) closed() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// wrap turns an RPC error into a procgroup error: ctx's own error when ctx ended,
// ErrStoreClosed after Close, ErrInvalidArgument for refused arguments; the gRPC status
// stays in the chain (status.Code works on the result).
func (c *storeClient) wrap(op, key string, ctx context.Context, err error) error {
	what := "procgroup: store " + op
	if len(key) > 64 {
		what += fmt.Sprintf(" %q… (%d bytes)", key[:64], len(key))
	} else if key != "" {
		what += fmt.Sprintf(" %q", key)
	}
	if c.closed() {
		return fmt.Errorf("%s: %w", what, ErrStoreClosed)
	}
	if ctx.Err() != nil {
		return fmt.Errorf("%s: %w", what, ctx.Err())
	}
	switch status.Code(err) {
	case codes.DeadlineExceeded:
		// The deadline travels with the call: the server may see it pass before the
		// client's own timer fires.
		return fmt.Errorf("%s: %w: %w", what, context.DeadlineExceeded, err)
	case codes.Canceled:
		return fmt.Errorf("%s: %w: %w", what, context.Canceled, err)
	case codes.InvalidArgument, codes.ResourceExhausted:
		return fmt.Errorf("%s at %s: %w: %w", what, c.addr, ErrInvalidArgument, err)
	}
	return fmt.Errorf("%s at %s: %w", what, c.addr, err)
}

// Set implements Store.
func (c *storeClient) Set(ctx context.Context, key string, value []byte) error {
	if c.closed() {
		return ErrStoreClosed
	}
	_, err := c.rpc.Set(c.ctx(ctx), &storepb.SetRequest{Key: key, Value: value})
	if err != nil {
		return c.wrap("set", key, ctx, err)
	}
	return nil
}

// Get implements Store.
func (c *storeClient) Get(ctx context.Context, key string) ([]byte, error) {
	if c.closed() {
		return nil, ErrStoreClosed
	}
	resp, err := c.rpc.Get(c.ctx(ctx), &storepb.GetRequest{Key: key})
	if err != nil {
		return nil, c.wrap("get", key, ctx, err)
	}
	if resp.Value == nil {
		return []byte{}, nil // the key exists: never report its value as nil
	}
	return resp.Value, nil
}

// Add implements Store.
func (c *storeClient) Add(ctx context.Context, key string, delta int64) (int64, error) {
	if c.closed() {
		return 0, ErrStoreClosed
	}
	resp, err := c.rpc.Add(c.ctx(ctx), &storepb.AddRequest{Key: key, Delta: delta})
	if err != nil {
		return 0, c.wrap("add", key, ctx, err)
	}
	return resp.Value, nil
}

// CompareAndSet implements Store.
func (c *storeClient) CompareAndSet(ctx context.Context, key string, expected, desired []byte) ([]byte, bool, error) {
	if c.closed() {
		return nil, false, ErrStoreClosed
	}
	resp, err := c.rpc.CompareAndSet(c.ctx(ctx), &storepb.CompareAndSetRequest{
		Key: key, Expected: expected, ExpectAbsent: expected == nil, Desired: desired,
	})
	if err != nil {
		return nil, false, c.wrap("compare-and-set", key, ctx, err)
	}
	v := resp.Value
	if !resp.Exists {
		v = nil
	} else if v == nil {
		v = []byte{}
	}
	return v, resp.Swapped, nil
}

// Delete implements Store.
func (c *storeClient) Delete(ctx context.Context, key string) (bool, error) {
	if c.closed() {
		return false, ErrStoreClosed
	}
	resp, err := c.rpc.Delete(c.ctx(ctx), &storepb.DeleteRequest{Key: key})
	if err != nil {
		return false, c.wrap("delete", key, ctx, err)
	}
	return resp.Existed, nil
}

// Wait implements Store.
func (c *storeClient) Wait(ctx context.Context, keys ...string) error {
	if c.closed() {
		return ErrStoreClosed
	}
	if _, err := c.rpc.Wait(c.ctx(ctx), &storepb.WaitRequest{Keys: keys}); err != nil {
		key := ""
		if len(keys) == 1 {
			key = keys[0]
		}
		return c.wrap("wait", key, ctx, err)
	}
	return nil
}

// Close implements Store: it closes the connection; calls in flight fail with
// ErrStoreClosed. It is idempotent.
func (c *storeClient) Close() error {
	var err error
	c.closeOnce.Do(func() {
		close(c.done)
		err = c.conn.Close()
	})
	return err
}
