package procgroup

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
)

// Note [TCPStore wire protocol]
//
// PyTorch's c10d TCPStore (what torchrun's agent hosts on MASTER_PORT) speaks a small binary
// protocol over one TCP connection per client: a one-byte query type, then its arguments,
// each string or byte vector as a little-endian uint64 length and the bytes, each integer
// as a little-endian int64; WAIT and CHECK send a uint64 key count, then the keys. Replies:
// GET and COMPARE_SET a vector, ADD, GETNUMKEYS and DELETE_KEY an int64 (DELETE_KEY: the
// number of keys removed), CHECK one byte (0 ready, 1 not ready), WAIT one byte (0) once
// every key exists. SET has no reply. There is no authentication. Torch's own clients put
// "/" in front of every key (TCPStore's keyPrefix_); so do we, so that torch and goddp see
// the same keys.
//
// Two dialects exist, with different query numbers:
//   - legacy (torch up to 2.0; checked against the real 1.13 server): SET=0, COMPARE_SET=1,
//     GET=2, ADD=3, CHECK=4, WAIT=5, GETNUMKEYS=6, WATCH_KEY=7, DELETE_KEY=8.
//   - validated (newer torch, from TCPStoreBackend.hpp): VALIDATE=0, SET=1, COMPARE_SET=2,
//     GET=3, ADD=4, CHECK=5, WAIT=6, GETNUMKEYS=7, DELETE_KEY=8, ..., CANCEL_WAIT=12,
//     PING=13. Every connection starts with VALIDATE and the uint32 magic 0x3C85F7CE (no
//     reply); PING carries a uint32 nonce that the server echoes.
//
// The dialect is found by a probe on a connection of its own: VALIDATE, then a PING. A
// validated server echoes the nonce. A legacy server reads the bytes as a SET whose key
// length (built from the magic, the PING byte and the nonce, chosen so that it exceeds any
// possible allocation) it cannot allocate: it drops that connection and serves the others
// (checked against 1.13). Servers that know VALIDATE but not PING (torch 2.1 to 2.3, by
// the source) are not recognised; name the dialect explicitly for them.
//
// GET on a missing key makes the server drop the connection, so Get waits first. A wait
// that ctx ends closes its connection (the server forgets a closed connection's waits), so
// each blocking call holds a connection of its own: the client keeps a pool.

// TCPStoreDialect names a TCPStore protocol dialect (Note [TCPStore wire protocol]).
type TCPStoreDialect int

const (
	// TCPStoreAuto probes the server once at dial time.
	TCPStoreAuto TCPStoreDialect = iota
	// TCPStoreLegacy is torch 2.0's and earlier's protocol (1.13 included).
	TCPStoreLegacy
	// TCPStoreValidated is newer torch's protocol, with the validation message and PING.
	TCPStoreValidated
)

func (d TCPStoreDialect) String() string {
	switch d {
	case TCPStoreAuto:
		return "auto"
	case TCPStoreLegacy:
		return "legacy"
	case TCPStoreValidated:
		return "validated"
	}
	return fmt.Sprintf("TCPStoreDialect(%d)", int(d))
}

// TCPStore query types per dialect.
type tcpQueries struct {
	set, compareSet, get, add, check, wait, numKeys, deleteKey byte
}

var (
	legacyQueries    = tcpQueries{0, 1, 2, 3, 4, 5, 6, 8}
	validatedQueries = tcpQueries{1, 2, 3, 4, 5, 6, 7, 8}
)

const (
	tcpValidate     = 0
	tcpPing         = 13
	tcpMagic        = 0x3C85F7CE
	tcpProbeNonce   = 0xFFFFFF01 // with the magic, a legacy SET key length of 0xFFFFFF0D3C85F7CE
	tcpKeyPrefix    = "/"
	tcpCheckReady   = 0
	tcpCheckMissing = 1
	tcpStopWaiting  = 0
)

// DefaultTCPStoreMaxValueBytes bounds a value read from a TCPStore server: a longer reply
// is refused and its connection closed.
const DefaultTCPStoreMaxValueBytes = 64 << 20

// TCPStoreOptions configure DialTCPStore.
type TCPStoreOptions struct {
	// Dialect: TCPStoreAuto (the zero value) probes the server.
	Dialect TCPStoreDialect
	// MaxValueBytes bounds the values read; 0 means DefaultTCPStoreMaxValueBytes.
	MaxValueBytes int
	// Logger receives the dial's lines; nil means zap.NewNop().
	Logger *zap.Logger
}

func (o *TCPStoreOptions) validate() error {
	if o.Dialect < TCPStoreAuto || o.Dialect > TCPStoreValidated {
		return fmt.Errorf("%w: tcpstore: unknown dialect %d", ErrInvalidArgument, int(o.Dialect))
	}
	if o.MaxValueBytes < 0 {
		return fmt.Errorf("%w: tcpstore: negative MaxValueBytes", ErrInvalidArgument)
	}
	if o.MaxValueBytes == 0 {
		o.MaxValueBytes = DefaultTCPStoreMaxValueBytes
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	return nil
}

// TCPStore is a client of a PyTorch c10d TCPStore server (torchrun's agent store, or any
// torch.distributed.TCPStore with is_master=True), as a Store. It is safe for concurrent
// use; each call that is in flight holds a connection of its own.
//
// The server has no authentication: whoever reaches its port can read and change every
// key. goddp's data plane still authenticates its peers with the job token.
//
// CompareAndSet follows the server's semantics, which cannot tell an absent key from an
// empty value: an expected value of nil (absent) also matches a key whose value is empty.
type TCPStore struct {
	addr    string
	dialect TCPStoreDialect
	q       tcpQueries
	opts    TCPStoreOptions

	mu     sync.Mutex // guards the fields below
	idle   []*tcpConn
	busy   map[*tcpConn]struct{}
	closed bool
}

var _ Store = (*TCPStore)(nil)

type tcpConn struct {
	c net.Conn
	r *bufio.Reader
}

// DialTCPStore connects to the TCPStore server at addr ("host:port"), retrying until it
// answers or ctx ends, and finds its dialect unless opts names one.
func DialTCPStore(ctx context.Context, addr string, opts TCPStoreOptions) (*TCPStore, error) {
	if err := opts.validate(); err != nil {
		return nil, err
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil, fmt.Errorf("%w: tcpstore: address %q: want host:port", ErrInvalidArgument, addr)
	}
	s := &TCPStore{addr: addr, dialect: opts.Dialect, opts: opts, busy: map[*tcpConn]struct{}{}}
	c, err := s.dialRetry(ctx)
	if err != nil {
		return nil, err
	}
	if s.dialect == TCPStoreAuto {
		c.c.Close() // the probe needs a connection of its own
		if s.dialect, err = probeTCPStore(ctx, c.c.RemoteAddr().String()); err != nil {
			return nil, fmt.Errorf("procgroup: tcpstore %s: %w", addr, err)
		}
		c = nil
	}
	s.q = legacyQueries
	if s.dialect == TCPStoreValidated {
		s.q = validatedQueries
	}
	if c != nil {
		s.idle = append(s.idle, c)
	}
	opts.Logger.Debug("tcpstore connected", zap.String("addr", addr), zap.Stringer("dialect", s.dialect))
	return s, nil
}

// Dialect is the protocol dialect in use.
func (s *TCPStore) Dialect() TCPStoreDialect { return s.dialect }

// dialRetry dials until the server accepts or ctx ends.
func (s *TCPStore) dialRetry(ctx context.Context) (*tcpConn, error) {
	delay := 20 * time.Millisecond
	for {
		c, err := s.dial(ctx)
		if err == nil {
			return c, nil
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("procgroup: tcpstore %s: dial: %w (last error: %v)", s.addr, ctx.Err(), err)
		case <-t.C:
		}
		delay = min(2*delay, time.Second)
	}
}

func (s *TCPStore) dial(ctx context.Context) (*tcpConn, error) {
	var d net.Dialer
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	nc, err := d.DialContext(dctx, "tcp", s.addr)
	if err != nil {
		return nil, err
	}
	c := &tcpConn{c: nc, r: bufio.NewReader(nc)}
	if s.dialect == TCPStoreValidated {
		var b []byte
		b = append(b, tcpValidate)
		b = binary.LittleEndian.AppendUint32(b, tcpMagic)
		if _, err := nc.Write(b); err != nil {
			nc.Close()
			return nil, err
		}
	}
	return c, nil
}

// probeTCPStore finds the dialect of the server at addr (Note [TCPStore wire protocol]).
func probeTCPStore(ctx context.Context, addr string) (TCPStoreDialect, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return 0, fmt.Errorf("probe: %w", err)
	}
	defer nc.Close()
	stop := context.AfterFunc(ctx, func() { nc.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	var b []byte
	b = append(b, tcpValidate)
	b = binary.LittleEndian.AppendUint32(b, tcpMagic)
	b = append(b, tcpPing)
	b = binary.LittleEndian.AppendUint32(b, tcpProbeNonce)
	if _, err := nc.Write(b); err != nil {
		return 0, fmt.Errorf("probe: %w", err)
	}
	var reply [4]byte
	_, err = io.ReadFull(nc, reply[:])
	switch {
	case err == nil && binary.LittleEndian.Uint32(reply[:]) == tcpProbeNonce:
		return TCPStoreValidated, nil
	case err == nil:
		return 0, fmt.Errorf("probe: the server answered PING with %x, not its nonce: not a TCPStore?", reply)
	case ctx.Err() != nil:
		return 0, fmt.Errorf("probe: %w", ctx.Err())
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) || isConnReset(err):
		return TCPStoreLegacy, nil // it dropped the probe: Note [TCPStore wire protocol]
	}
	return 0, fmt.Errorf("probe: %w", err)
}

func isConnReset(err error) bool { return errors.Is(err, syscall.ECONNRESET) }

// get takes an idle connection or dials one.
func (s *TCPStore) get(ctx context.Context) (*tcpConn, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrStoreClosed
	}
	if n := len(s.idle); n > 0 {
		c := s.idle[n-1]
		s.idle = s.idle[:n-1]
		s.busy[c] = struct{}{}
		s.mu.Unlock()
		return c, nil
	}
	s.mu.Unlock()
	c, err := s.dial(ctx)
	if err != nil {
		return nil, fmt.Errorf("procgroup: tcpstore %s: dial: %w", s.addr, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		c.c.Close()
		return nil, ErrStoreClosed
	}
	s.busy[c] = struct{}{}
	return c, nil
}

// put returns c to the pool, or closes it when the exchange on it failed.
func (s *TCPStore) put(c *tcpConn, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.busy, c)
	if !ok || s.closed {
		c.c.Close()
		return
	}
	s.idle = append(s.idle, c)
}

// do runs one exchange on a pooled connection; ctx ending interrupts it (and costs the
// connection).
func (s *TCPStore) do(ctx context.Context, op, key string, f func(c *tcpConn) error) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("procgroup: tcpstore %s %q: %w", op, key, err)
	}
	c, err := s.get(ctx)
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { c.c.SetDeadline(time.Unix(1, 0)) })
	err = f(c)
	interrupted := !stop()
	s.put(c, err == nil && !interrupted)
	if err == nil {
		return nil
	}
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	switch {
	case closed:
		return ErrStoreClosed
	case interrupted && ctx.Err() != nil:
		return fmt.Errorf("procgroup: tcpstore %s %q: %w", op, key, ctx.Err())
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || isConnReset(err):
		return fmt.Errorf("procgroup: tcpstore %s %q: the server %s closed the connection (it refuses a request it cannot parse, such as add to a value that is not an integer)", op, key, s.addr)
	}
	return fmt.Errorf("procgroup: tcpstore %s %q: server %s: %w", op, key, s.addr, err)
}

// Request encoding.
type tcpReq []byte

func (b tcpReq) str(s string) tcpReq {
	b = binary.LittleEndian.AppendUint64(b, uint64(len(s)))
	return append(b, s...)
}

func (b tcpReq) bytes(v []byte) tcpReq {
	b = binary.LittleEndian.AppendUint64(b, uint64(len(v)))
	return append(b, v...)
}

func (b tcpReq) int64(n int64) tcpReq { return binary.LittleEndian.AppendUint64(b, uint64(n)) }

func (b tcpReq) keys(keys []string) tcpReq {
	b = binary.LittleEndian.AppendUint64(b, uint64(len(keys)))
	for _, k := range keys {
		b = b.str(tcpKeyPrefix + k)
	}
	return b
}

func (c *tcpConn) send(b tcpReq) error {
	_, err := c.c.Write(b)
	return err
}

func (c *tcpConn) readInt64() (int64, error) {
	var b [8]byte
	if _, err := io.ReadFull(c.r, b[:]); err != nil {
		return 0, err
	}
	return int64(binary.LittleEndian.Uint64(b[:])), nil
}

func (c *tcpConn) readByte() (byte, error) { return c.r.ReadByte() }

// readVector reads a length-prefixed byte vector of at most max bytes.
func (c *tcpConn) readVector(max int) ([]byte, error) {
	return readTCPVector(c.r, max)
}

func readTCPVector(r io.Reader, max int) ([]byte, error) {
	var b [8]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return nil, err
	}
	n := binary.LittleEndian.Uint64(b[:])
	if n > uint64(max) {
		return nil, fmt.Errorf("%w: reply of %d bytes exceeds the limit of %d", ErrInvalidArgument, n, max)
	}
	v := make([]byte, n)
	if _, err := io.ReadFull(r, v); err != nil {
		return nil, err
	}
	return v, nil
}

// sync makes the server answer on c, so that what c sent before (a SET, which has no reply)
// has been applied when it returns.
func (s *TCPStore) sync(c *tcpConn) error {
	if err := c.send(tcpReq{s.q.numKeys}); err != nil {
		return err
	}
	_, err := c.readInt64()
	return err
}

// Set implements Store. It returns once the server has applied the value.
func (s *TCPStore) Set(ctx context.Context, key string, value []byte) error {
	return s.do(ctx, "set", key, func(c *tcpConn) error {
		if err := c.send(tcpReq{s.q.set}.str(tcpKeyPrefix + key).bytes(value)); err != nil {
			return err
		}
		return s.sync(c)
	})
}

// Get implements Store: it waits for key, then reads it.
func (s *TCPStore) Get(ctx context.Context, key string) ([]byte, error) {
	var v []byte
	err := s.do(ctx, "get", key, func(c *tcpConn) error {
		if err := s.wait(c, []string{key}); err != nil {
			return err
		}
		if err := c.send(tcpReq{s.q.get}.str(tcpKeyPrefix + key)); err != nil {
			return err
		}
		var err error
		v, err = c.readVector(s.opts.MaxValueBytes)
		return err
	})
	return v, err
}

// Add implements Store.
func (s *TCPStore) Add(ctx context.Context, key string, delta int64) (int64, error) {
	var n int64
	err := s.do(ctx, "add", key, func(c *tcpConn) error {
		if err := c.send(tcpReq{s.q.add}.str(tcpKeyPrefix + key).int64(delta)); err != nil {
			return err
		}
		var err error
		n, err = c.readInt64()
		return err
	})
	return n, err
}

// CompareAndSet implements Store, with the server's semantics (see TCPStore). With a nil
// or empty expected value, it also reports a swap when the key already held desired.
func (s *TCPStore) CompareAndSet(ctx context.Context, key string, expected, desired []byte) ([]byte, bool, error) {
	var cur []byte
	var swapped bool
	err := s.do(ctx, "compare-and-set", key, func(c *tcpConn) error {
		if err := c.send(tcpReq{s.q.compareSet}.str(tcpKeyPrefix + key).bytes(expected).bytes(desired)); err != nil {
			return err
		}
		var err error
		if cur, err = c.readVector(s.opts.MaxValueBytes); err != nil {
			return err
		}
		switch {
		case len(expected) == 0:
			swapped = bytes.Equal(cur, desired)
		case !bytes.Equal(cur, expected):
			swapped = bytes.Equal(cur, desired)
		case !bytes.Equal(expected, desired):
			// The server answers a missing key with the expected value.
			cur = nil
		default:
			// expected == desired == the reply: the key holds it, or is missing.
			var present bool
			if present, err = s.check(c, []string{key}); err != nil {
				return err
			}
			if swapped = present; !present {
				cur = nil
			}
		}
		return nil
	})
	if err != nil {
		return nil, false, err
	}
	return cur, swapped, nil
}

// Delete implements Store.
func (s *TCPStore) Delete(ctx context.Context, key string) (bool, error) {
	var n int64
	err := s.do(ctx, "delete", key, func(c *tcpConn) error {
		if err := c.send(tcpReq{s.q.deleteKey}.str(tcpKeyPrefix + key)); err != nil {
			return err
		}
		var err error
		n, err = c.readInt64()
		return err
	})
	return n > 0, err
}

// Wait implements Store.
func (s *TCPStore) Wait(ctx context.Context, keys ...string) error {
	if len(keys) == 0 {
		return nil
	}
	return s.do(ctx, "wait", keys[0], func(c *tcpConn) error { return s.wait(c, keys) })
}

func (s *TCPStore) wait(c *tcpConn, keys []string) error {
	if err := c.send(tcpReq{s.q.wait}.keys(keys)); err != nil {
		return err
	}
	b, err := c.readByte()
	if err != nil {
		return err
	}
	if b != tcpStopWaiting {
		return fmt.Errorf("%w: wait: unexpected reply %d", ErrInvalidArgument, b)
	}
	return nil
}

// Check reports whether every key exists, without waiting.
func (s *TCPStore) Check(ctx context.Context, keys ...string) (bool, error) {
	var ok bool
	key := ""
	if len(keys) > 0 {
		key = keys[0]
	}
	err := s.do(ctx, "check", key, func(c *tcpConn) error {
		var err error
		ok, err = s.check(c, keys)
		return err
	})
	return ok, err
}

func (s *TCPStore) check(c *tcpConn, keys []string) (bool, error) {
	if err := c.send(tcpReq{s.q.check}.keys(keys)); err != nil {
		return false, err
	}
	b, err := c.readByte()
	if err != nil {
		return false, err
	}
	switch b {
	case tcpCheckReady:
		return true, nil
	case tcpCheckMissing:
		return false, nil
	}
	return false, fmt.Errorf("%w: check: unexpected reply %d", ErrInvalidArgument, b)
}

// NumKeys is the number of keys the server holds (all of them, not only this client's).
func (s *TCPStore) NumKeys(ctx context.Context) (int64, error) {
	var n int64
	err := s.do(ctx, "num_keys", "", func(c *tcpConn) error {
		if err := c.send(tcpReq{s.q.numKeys}); err != nil {
			return err
		}
		var err error
		n, err = c.readInt64()
		return err
	})
	return n, err
}

// Close implements Store: it closes every connection; calls in flight fail with
// ErrStoreClosed. The server (not ours) stays up.
func (s *TCPStore) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	for _, c := range s.idle {
		c.c.Close()
	}
	s.idle = nil
	for c := range s.busy {
		c.c.Close()
	}
	return nil
}
