package procgroup

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// replayConn is a net.Conn whose reads are a fixed byte stream (a server's replies) and
// whose writes are discarded.
type replayConn struct {
	r      *bytes.Reader
	closed bool
}

func (c *replayConn) Read(p []byte) (int, error) {
	if c.closed {
		return 0, net.ErrClosed
	}
	return c.r.Read(p)
}
func (c *replayConn) Write(p []byte) (int, error) {
	if c.closed {
		return 0, net.ErrClosed
	}
	return len(p), nil
}
func (c *replayConn) Close() error                     { c.closed = true; return nil }
func (c *replayConn) LocalAddr() net.Addr              { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1} }
func (c *replayConn) RemoteAddr() net.Addr             { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 2} }
func (c *replayConn) SetDeadline(time.Time) error      { return nil }
func (c *replayConn) SetReadDeadline(time.Time) error  { return nil }
func (c *replayConn) SetWriteDeadline(time.Time) error { return nil }

const fuzzTCPAddr = "tcpstore.fuzz.invalid:29500"

// FuzzTCPStoreReplies: a TCPStore client whose server answers with arbitrary bytes runs
// the operations that ops names (one byte each) on one connection until one fails. None
// panics or hangs, a value never exceeds MaxValueBytes, and every error names the server.
func FuzzTCPStoreReplies(f *testing.F) {
	le := func(n uint64) []byte {
		b := make([]byte, 8)
		for i := range b {
			b[i] = byte(n >> (8 * i))
		}
		return b
	}
	cat := func(bs ...[]byte) []byte { return bytes.Join(bs, nil) }
	// ops: 0 add, 1 num_keys, 2 delete, 3 check, 4 wait, 5 get, 6..8 compare-and-set.
	f.Add([]byte{0, 1, 2}, cat(le(7), le(3), le(1)))
	f.Add([]byte{3, 3, 4}, []byte{tcpCheckReady, tcpCheckMissing, tcpStopWaiting})
	f.Add([]byte{5}, cat([]byte{tcpStopWaiting}, le(3), []byte("abc")))
	f.Add([]byte{6, 7, 8}, cat(le(1), []byte("x"), le(0), le(1), []byte("d"), []byte{tcpCheckReady}))
	f.Add([]byte{3}, []byte{7})                           // a check reply that is neither 0 nor 1
	f.Add([]byte{4}, []byte{1})                           // a wait reply other than 0
	f.Add([]byte{5}, cat([]byte{0}, le(1<<62)))           // a value over the bound
	f.Add([]byte{6}, le(0xffffffffffffffff))              // a CAS reply over the bound
	f.Add([]byte{0, 1}, []byte{1, 2, 3})                  // an int64 cut short
	f.Add([]byte{5}, cat([]byte{0}, le(5), []byte("ab"))) // a value cut short
	f.Add([]byte{}, []byte{})
	f.Fuzz(func(t *testing.T, ops, replies []byte) {
		if len(ops) > 64 {
			ops = ops[:64]
		}
		const max = 16
		c := &tcpConn{c: &replayConn{r: bytes.NewReader(replies)}}
		c.r = bufio.NewReader(c.c)
		s := &TCPStore{addr: fuzzTCPAddr, dialect: TCPStoreValidated, q: validatedQueries,
			opts: TCPStoreOptions{MaxValueBytes: max}, busy: map[*tcpConn]struct{}{}, idle: []*tcpConn{c}}
		ctx := context.Background()
		for _, op := range ops {
			var err error
			var v []byte
			switch op % 9 {
			case 0:
				_, err = s.Add(ctx, "k", 1)
			case 1:
				_, err = s.NumKeys(ctx)
			case 2:
				_, err = s.Delete(ctx, "k")
			case 3:
				_, err = s.Check(ctx, "k", "l")
			case 4:
				err = s.Wait(ctx, "k")
			case 5:
				v, err = s.Get(ctx, "k")
			case 6:
				v, _, err = s.CompareAndSet(ctx, "k", []byte("x"), []byte("d"))
			case 7:
				v, _, err = s.CompareAndSet(ctx, "k", nil, []byte("d"))
			case 8:
				v, _, err = s.CompareAndSet(ctx, "k", []byte("d"), []byte("d"))
			}
			if len(v) > max {
				t.Fatalf("op %d returned %d bytes, over the bound %d", op%9, len(v), max)
			}
			if err != nil {
				if !strings.Contains(err.Error(), fuzzTCPAddr) {
					t.Fatalf("op %d: error %q does not name the server %s", op%9, err, fuzzTCPAddr)
				}
				if errors.Is(err, io.EOF) && !strings.Contains(err.Error(), "closed the connection") {
					t.Fatalf("op %d: bare EOF: %v", op%9, err)
				}
				break // the connection is closed: the next call would dial
			}
		}
		s.Close()
	})
}
