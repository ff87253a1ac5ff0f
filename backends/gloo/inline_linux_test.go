package gloo

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"math"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// streamRank is rank 0 of a two-rank group whose peer is a bare socket the test scripts:
// it runs the receiving half of Note [Inline exchange] on whatever bytes arrive.
type streamRank struct {
	g      *group
	remote *os.File
}

func newStreamRank(t testing.TB, seg int) *streamRank {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	local := os.NewFile(uintptr(fds[0]), "local")
	c, err := net.FileConn(local)
	local.Close()
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{SegmentSize: seg, PollInterval: 20 * time.Millisecond, HostID: "h"}
	if err := cfg.validate(); err != nil {
		t.Fatal(err)
	}
	g := &group{rank: 0, size: 2, cfg: cfg, opts: procgroup.Options{Timeout: 5 * time.Second},
		hosts: []string{"h0", "h1"}, peers: make([]*peer, 2), aborted: make(chan struct{}),
		stop: make(chan struct{}), timer: time.NewTimer(time.Hour)}
	g.timer.Stop()
	g.peers[1] = g.newPeer(1, c)
	s := &streamRank{g: g, remote: os.NewFile(uintptr(fds[1]), "remote")}
	t.Cleanup(func() { c.Close(); s.remote.Close() })
	return s
}

// run plays stream as the peer's bytes (then end of file) against an all-reduce of buf.
func (s *streamRank) run(buf []float32, stream []byte) error {
	s.remote.Write(stream)
	syscall.Shutdown(int(s.remote.Fd()), syscall.SHUT_WR)
	b, dt, _, _ := kernels.Bytes(buf)
	o := &op{kind: procgroup.OpAllReduce, dt: dt, rop: procgroup.Sum, buf: b, seq: 1, ctx: context.Background(),
		deadline: time.Now().Add(5 * time.Second)}
	s.g.cur = o
	defer func() { s.g.cur = nil }()
	return s.g.inlinePairAllReduce(o)
}

// pairStream encodes what a well-behaved peer sends for collective seq: data in frames of
// seg bytes, the first prefixed with the total length.
func pairStream(seq uint32, data []byte, seg int) []byte {
	var out []byte
	for a := 0; a < len(data); a += seg {
		l := min(seg, len(data)-a)
		pl := l
		if a == 0 {
			pl += 8
		}
		h := make([]byte, frameHeaderLen)
		putHeader(h, kindData, seq, pl)
		out = append(out, h...)
		if a == 0 {
			out = binary.LittleEndian.AppendUint64(out, uint64(len(data)))
		}
		out = append(out, data[a:a+l]...)
	}
	return out
}

func f32bytes(v []float32) []byte {
	b, _, _, _ := kernels.Bytes(v)
	return b
}

// TestPairStream: a scripted peer's well-formed stream is combined correctly; an abort
// frame, a wrong length or sequence number, a garbage header and a truncated stream each
// fail with the matching error.
func TestPairStream(t *testing.T) {
	theirs := []float32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}
	mine := func() []float32 { return []float32{10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110} }
	good := pairStream(1, f32bytes(theirs), 16)
	abort := make([]byte, frameHeaderLen+maxAbortLen)
	n := abortPayload(abort[frameHeaderLen:], 1, "rank 1 ran out of memory")
	putHeader(abort, kindAbort, 0, n)
	abort = abort[:frameHeaderLen+n]
	for _, c := range []struct {
		name   string
		stream []byte
		check  func(error) bool
	}{
		{"good", good, func(err error) bool { return err == nil }},
		{"abort-first", abort, isLost},
		{"abort-between-frames", append(append([]byte(nil), good[:frameHeaderLen+8+16]...), abort...), isLost},
		{"other-length", pairStream(1, f32bytes(theirs[:10]), 16), isInvalid},
		{"other-seq", pairStream(2, f32bytes(theirs), 16), isInvalid},
		{"garbage", []byte("this is not a frame header at all"), func(err error) bool { return errors.Is(err, errBadFrame) }},
		{"truncated", good[:len(good)-3], isLost},
		{"huge", header(kindData, 1, 1<<62), func(err error) bool { return errors.Is(err, errBadFrame) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := newStreamRank(t, 16)
			buf := mine()
			err := s.run(buf, c.stream)
			if !c.check(err) {
				t.Fatalf("got %v", err)
			}
			if err == nil {
				for i := range buf {
					if want := mine()[i] + theirs[i]; buf[i] != want {
						t.Fatalf("[%d] = %v, want %v", i, buf[i], want)
					}
				}
			}
		})
	}
}

func isLost(err error) bool { return errors.Is(err, procgroup.ErrPeerLost) }

func isInvalid(err error) bool { return errors.Is(err, procgroup.ErrInvalidArgument) }

// FuzzPairStream plays arbitrary bytes as the peer of the exchange: it must return (never
// hang or panic), and succeed only on a stream that carries the expected frames.
func FuzzPairStream(f *testing.F) {
	theirs := []float32{1.5, -2, 3, 4, 5, 6, 7}
	good := pairStream(1, f32bytes(theirs), 16)
	f.Add(good)
	f.Add(good[:20])
	f.Add(pairStream(1, f32bytes(theirs[:6]), 16))
	f.Add(append(header(kindAbort, 0, 9), 1, 0, 0, 0, 'd', 'e', 'a', 'd', '!'))
	f.Add(header(kindData, 1, 1<<62))
	f.Add([]byte("garbage garbage garbage"))
	f.Fuzz(func(t *testing.T, stream []byte) {
		if len(stream) > 4096 {
			return
		}
		s := newStreamRank(t, 16)
		buf := []float32{1, 1, 1, 1, 1, 1, 1}
		if err := s.run(buf, stream); err != nil {
			return
		}
		// Success needs the frames of good: the same headers and length prefix, any data.
		const h2 = frameHeaderLen + 8 + 16 // the second header's offset
		if len(stream) < len(good) || !bytes.Equal(stream[:frameHeaderLen+8], good[:frameHeaderLen+8]) ||
			!bytes.Equal(stream[h2:h2+frameHeaderLen], good[h2:h2+frameHeaderLen]) {
			t.Fatalf("accepted a stream without the expected frames: %x", stream)
		}
		data := append(append([]byte(nil), stream[frameHeaderLen+8:h2]...), stream[h2+frameHeaderLen:len(good)]...)
		for i, v := range buf {
			want := 1 + math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:]))
			if math.Float32bits(v) != math.Float32bits(want) && !(v != v && want != want) {
				t.Fatalf("[%d] = %v, want %v", i, v, want)
			}
		}
	})
}
