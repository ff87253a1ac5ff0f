package gloo

import (
	"bytes"
	crand "crypto/rand"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"testing"
)

func header(kind byte, seq uint32, n uint64) []byte {
	b := make([]byte, frameHeaderLen)
	b[0] = kind
	binary.LittleEndian.PutUint32(b[4:], seq)
	binary.LittleEndian.PutUint64(b[8:], n)
	return b
}

func TestParseHeader(t *testing.T) {
	for _, c := range []struct {
		name string
		b    []byte
		ok   bool
	}{
		{"data", header(kindData, 7, 4096), true},
		{"empty data", header(kindData, 1, 0), true},
		{"max data", header(kindData, 1, maxFrameLen), true},
		{"2^62", header(kindData, 1, 1<<62), false},
		{"over max", header(kindData, 1, maxFrameLen+1), false},
		{"abort", header(kindAbort, 0, 20), true},
		{"short abort", header(kindAbort, 0, 3), false},
		{"long abort", header(kindAbort, 0, maxAbortLen+1), false},
		{"kind 0", header(0, 0, 0), false},
		{"kind 9", header(9, 0, 0), false},
		{"reserved", append([]byte{1, 1}, make([]byte, 14)...), false},
		{"truncated", header(kindData, 1, 1)[:10], false},
	} {
		_, err := parseHeader(c.b)
		if (err == nil) != c.ok {
			t.Errorf("%s: err = %v, want ok=%v", c.name, err, c.ok)
		}
		if err != nil && !errors.Is(err, errBadFrame) {
			t.Errorf("%s: %v does not wrap errBadFrame", c.name, err)
		}
	}
	h, _ := parseHeader(header(kindData, 0xdeadbeef, 99))
	if h.seq != 0xdeadbeef || h.len != 99 {
		t.Fatalf("decoded %+v", h)
	}
	var b [frameHeaderLen + maxAbortLen]byte
	n := abortPayload(b[frameHeaderLen:], 3, "rank 3 died")
	lost, reason, err := parseAbort(b[frameHeaderLen:frameHeaderLen+n], 4)
	if err != nil || lost != 3 || reason != "rank 3 died" {
		t.Fatalf("abort payload: %d %q %v", lost, reason, err)
	}
	if _, _, err := parseAbort(b[frameHeaderLen:frameHeaderLen+n], 3); err == nil {
		t.Fatal("abort naming rank 3 of 3 accepted")
	}
}

// FuzzFrameDecode feeds arbitrary bytes to the frame decoder: it must never panic, and
// whatever it accepts must be within bounds and re-encode to the same header.
func FuzzFrameDecode(f *testing.F) {
	f.Add(header(kindData, 1, 4096))
	f.Add(header(kindData, 1, 1<<62))
	f.Add(header(kindAbort, 0, 12))
	f.Add(append(header(kindAbort, 0, 9), 1, 0, 0, 0, 'd', 'e', 'a', 'd', '!'))
	f.Add([]byte("garbage garbage garbage"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := parseHeader(b)
		if err != nil {
			return
		}
		if h.kind == kindData && h.len > maxFrameLen || h.kind == kindAbort && h.len > maxAbortLen {
			t.Fatalf("accepted %+v", h)
		}
		var enc [frameHeaderLen]byte
		putHeader(enc[:], h.kind, h.seq, int(h.len))
		if !bytes.Equal(enc[:], b[:frameHeaderLen]) {
			t.Fatalf("re-encoding %x gives %x", b[:frameHeaderLen], enc)
		}
		if h.kind == kindAbort && len(b) >= frameHeaderLen+int(h.len) {
			lost, _, err := parseAbort(b[frameHeaderLen:frameHeaderLen+int(h.len)], 8)
			if err == nil && (lost < -1 || lost >= 8) {
				t.Fatalf("abort names rank %d", lost)
			}
		}
	})
}

// scripted plays a fixed byte stream as the remote side of a handshake.
type scripted struct {
	r io.Reader
	w bytes.Buffer
}

func (s *scripted) Read(b []byte) (int, error)  { return s.r.Read(b) }
func (s *scripted) Write(b []byte) (int, error) { return s.w.Write(b) }

// FuzzHandshake plays arbitrary bytes as the other side of both handshake roles: no input
// may panic or be accepted without the key. Each role draws a fresh random nonce, as it
// does in a job: with a fixed one, the recorded genuine reply among the seeds (with the
// acceptance byte after it, testdata/fuzz/FuzzHandshake/10b0427e6762e284) is a replay that
// any peer accepts, and no forgery.
func FuzzHandshake(f *testing.F) {
	key := groupKey("secret", "p")
	// A genuine dialer's messages, recorded against a zero nonce, as a seed.
	good := append([]byte(handMagic), make([]byte, nonceLen)...)
	f.Add(good)
	f.Add([]byte("GDDPGLO1"))
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"))
	f.Add(append(good, make([]byte, proofLen)...))
	f.Add(append(append([]byte(handMagic), make([]byte, nonceLen+4)...), mac(key, 'A', make([]byte, nonceLen), make([]byte, nonceLen), 0)...))
	f.Fuzz(func(t *testing.T, in []byte) {
		acc := &handshaker{key: key, rank: 0, size: 4, rand: crand.Reader}
		if r, err := acc.accept(&scripted{r: bytes.NewReader(in)}); err == nil {
			t.Fatalf("accept took %x as rank %d", in, r)
		}
		dial := &handshaker{key: key, rank: 1, size: 4, rand: crand.Reader}
		if err := dial.dial(&scripted{r: bytes.NewReader(in)}, 0); err == nil {
			t.Fatalf("dial accepted %x", in)
		}
	})
}

func TestHandshake(t *testing.T) {
	run := func(dialKey, accKey []byte) (int, error, error) {
		a, b := net.Pipe()
		defer a.Close()
		defer b.Close()
		var derr error
		done := make(chan struct{})
		go func() {
			defer close(done)
			h := &handshaker{key: dialKey, rank: 2, size: 3, rand: rngReader{rand.New(rand.NewPCG(1, 2))}}
			derr = h.dial(a, 0)
			a.Close()
		}()
		h := &handshaker{key: accKey, rank: 0, size: 3, rand: rngReader{rand.New(rand.NewPCG(3, 4))}}
		r, aerr := h.accept(b)
		if aerr == nil {
			confirm(b)
		}
		b.Close()
		<-done
		return r, aerr, derr
	}
	k := groupKey("secret", "g")
	if r, aerr, derr := run(k, k); aerr != nil || derr != nil || r != 2 {
		t.Fatalf("good handshake: rank %d, %v, %v", r, aerr, derr)
	}
	for name, other := range map[string][]byte{"wrong token": groupKey("other", "g"), "wrong group": groupKey("secret", "h")} {
		_, aerr, derr := run(other, k)
		if aerr == nil || derr == nil {
			t.Fatalf("%s: accept %v, dial %v; want both refused", name, aerr, derr)
		}
	}
}

type rngReader struct{ r *rand.Rand }

func (r rngReader) Read(b []byte) (int, error) {
	for i := range b {
		b[i] = byte(r.r.Uint32())
	}
	return len(b), nil
}
