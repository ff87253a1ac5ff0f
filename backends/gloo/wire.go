package gloo

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Note [Wire format]: after the handshake, a connection carries frames, each a 16-byte
// header followed by its payload:
//
//	byte 0     kind: 1 data, 2 abort
//	bytes 1-3  zero
//	bytes 4-7  low 32 bits of the collective's sequence number (little endian)
//	bytes 8-15 payload length (little endian), at most maxFrameLen (data) or maxAbortLen
//
// A receiver always knows how many bytes the collective expects next, so a data frame
// whose length or sequence number differs is a protocol error, never a reason to allocate.
// An abort frame's payload is the 4-byte rank whose loss caused the abort (or 0xFFFFFFFF)
// followed by a short UTF-8 reason. In the two-rank exchange (Note [Inline exchange]) the
// first data frame's payload starts with the message's length in bytes (8, little endian).

const (
	frameHeaderLen = 16
	maxFrameLen    = 1 << 30
	maxAbortLen    = 1024

	kindData  = 1
	kindAbort = 2

	noRank = 0xFFFFFFFF
)

var errBadFrame = errors.New("gloo: malformed frame")

type frameHeader struct {
	kind byte
	seq  uint32
	len  uint64
}

func putHeader(b []byte, kind byte, seq uint32, n int) {
	_ = b[frameHeaderLen-1]
	b[0], b[1], b[2], b[3] = kind, 0, 0, 0
	binary.LittleEndian.PutUint32(b[4:], seq)
	binary.LittleEndian.PutUint64(b[8:], uint64(n))
}

// parseHeader decodes and bounds-checks a frame header.
func parseHeader(b []byte) (frameHeader, error) {
	if len(b) < frameHeaderLen {
		return frameHeader{}, fmt.Errorf("%w: header of %d bytes", errBadFrame, len(b))
	}
	h := frameHeader{kind: b[0], seq: binary.LittleEndian.Uint32(b[4:]), len: binary.LittleEndian.Uint64(b[8:])}
	if b[1]|b[2]|b[3] != 0 {
		return frameHeader{}, fmt.Errorf("%w: reserved bytes set", errBadFrame)
	}
	switch h.kind {
	case kindData:
		if h.len > maxFrameLen {
			return frameHeader{}, fmt.Errorf("%w: data length %d over %d", errBadFrame, h.len, maxFrameLen)
		}
	case kindAbort:
		if h.len < 4 || h.len > maxAbortLen {
			return frameHeader{}, fmt.Errorf("%w: abort length %d", errBadFrame, h.len)
		}
	default:
		return frameHeader{}, fmt.Errorf("%w: kind %d", errBadFrame, h.kind)
	}
	return h, nil
}

// abortPayload encodes an abort frame's payload into b (at least maxAbortLen bytes) and
// returns its length.
func abortPayload(b []byte, lostRank int, reason string) int {
	r := uint32(noRank)
	if lostRank >= 0 {
		r = uint32(lostRank)
	}
	binary.LittleEndian.PutUint32(b, r)
	return 4 + copy(b[4:maxAbortLen], reason)
}

// parseAbort decodes an abort frame's payload: the lost rank (-1 if none) and the reason.
func parseAbort(b []byte, size int) (lostRank int, reason string, err error) {
	if len(b) < 4 || len(b) > maxAbortLen {
		return 0, "", fmt.Errorf("%w: abort payload of %d bytes", errBadFrame, len(b))
	}
	r := binary.LittleEndian.Uint32(b)
	switch {
	case r == noRank:
		lostRank = -1
	case int64(r) < int64(size):
		lostRank = int(r)
	default:
		return 0, "", fmt.Errorf("%w: abort names rank %d of %d", errBadFrame, r, size)
	}
	return lostRank, string(b[4:]), nil
}

// Note [Handshake]: every connection authenticates both ways before any frame is read. All
// messages have fixed sizes, so a stranger can make us read at most helloLen bytes (under
// Config.HandshakeTimeout). The key is HMAC-SHA256(token, "goddp-gloo|"+prefix), which binds
// a connection to one job and one group instance.
//
//	dialer   → acceptor: magic(8) nonceD(32)
//	acceptor → dialer:   magic(8) nonceA(32) rankA(4) HMAC(key, "A" nonceD nonceA rankA)
//	dialer   → acceptor: rankD(4) HMAC(key, "D" nonceA nonceD rankD rankA)
//	acceptor → dialer:   one byte 1 (accepted)
const (
	nonceLen  = 32
	macLen    = sha256.Size
	helloLen  = 8 + nonceLen
	replyLen  = 8 + nonceLen + 4 + macLen
	proofLen  = 4 + macLen
	handMagic = "GDDPGLO1"
)

var errAuth = errors.New("gloo: handshake refused")

func groupKey(token, prefix string) []byte {
	m := hmac.New(sha256.New, []byte(token))
	m.Write([]byte("goddp-gloo|" + prefix))
	return m.Sum(nil)
}

func mac(key []byte, role byte, n1, n2 []byte, ranks ...uint32) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte{role})
	m.Write(n1)
	m.Write(n2)
	var rb [4]byte
	for _, r := range ranks {
		binary.LittleEndian.PutUint32(rb[:], r)
		m.Write(rb[:])
	}
	return m.Sum(nil)
}

// handshaker runs Note [Handshake] for one rank.
type handshaker struct {
	key  []byte
	rank int
	size int
	rand io.Reader
}

// dial authenticates the dialing side of conn against the rank it expects (want).
func (h *handshaker) dial(conn io.ReadWriter, want int) error {
	var hello [helloLen]byte
	copy(hello[:], handMagic)
	if _, err := io.ReadFull(h.rand, hello[8:]); err != nil {
		return err
	}
	if _, err := conn.Write(hello[:]); err != nil {
		return fmt.Errorf("gloo: handshake send: %w", err)
	}
	var reply [replyLen]byte
	if _, err := io.ReadFull(conn, reply[:]); err != nil {
		return fmt.Errorf("%w: reading reply: %w", errAuth, err)
	}
	if string(reply[:8]) != handMagic {
		return fmt.Errorf("%w: bad magic", errAuth)
	}
	nonceD, nonceA := hello[8:], reply[8:8+nonceLen]
	rankA := binary.LittleEndian.Uint32(reply[8+nonceLen:])
	if int64(rankA) != int64(want) {
		return fmt.Errorf("%w: peer says rank %d, want %d", errAuth, rankA, want)
	}
	if !hmac.Equal(reply[8+nonceLen+4:], mac(h.key, 'A', nonceD, nonceA, rankA)) {
		return fmt.Errorf("%w: rank %d failed authentication (wrong token?)", errAuth, want)
	}
	var proof [proofLen]byte
	binary.LittleEndian.PutUint32(proof[:], uint32(h.rank))
	copy(proof[4:], mac(h.key, 'D', nonceA, nonceD, uint32(h.rank), rankA))
	if _, err := conn.Write(proof[:]); err != nil {
		return fmt.Errorf("gloo: handshake send: %w", err)
	}
	var ok [1]byte
	if _, err := io.ReadFull(conn, ok[:]); err != nil || ok[0] != 1 {
		return fmt.Errorf("%w: rank %d did not accept the connection", errAuth, want)
	}
	return nil
}

// accept authenticates the accepting side of conn and returns the dialer's rank. It does
// not send the final acceptance byte: the caller does (confirm) once it has registered
// the connection.
func (h *handshaker) accept(conn io.ReadWriter) (int, error) {
	var hello [helloLen]byte
	if _, err := io.ReadFull(conn, hello[:]); err != nil {
		return -1, fmt.Errorf("%w: reading hello: %w", errAuth, err)
	}
	if string(hello[:8]) != handMagic {
		return -1, fmt.Errorf("%w: bad magic", errAuth)
	}
	var reply [replyLen]byte
	copy(reply[:], handMagic)
	if _, err := io.ReadFull(h.rand, reply[8:8+nonceLen]); err != nil {
		return -1, err
	}
	nonceD, nonceA := hello[8:], reply[8:8+nonceLen]
	binary.LittleEndian.PutUint32(reply[8+nonceLen:], uint32(h.rank))
	copy(reply[8+nonceLen+4:], mac(h.key, 'A', nonceD, nonceA, uint32(h.rank)))
	if _, err := conn.Write(reply[:]); err != nil {
		return -1, fmt.Errorf("gloo: handshake send: %w", err)
	}
	var proof [proofLen]byte
	if _, err := io.ReadFull(conn, proof[:]); err != nil {
		return -1, fmt.Errorf("%w: reading proof: %w", errAuth, err)
	}
	rankD := binary.LittleEndian.Uint32(proof[:])
	if !hmac.Equal(proof[4:], mac(h.key, 'D', nonceA, nonceD, rankD, uint32(h.rank))) {
		return -1, fmt.Errorf("%w: bad proof (wrong token?)", errAuth)
	}
	if int64(rankD) >= int64(h.size) {
		return -1, fmt.Errorf("%w: authenticated peer claims rank %d of %d", errAuth, rankD, h.size)
	}
	return int(rankD), nil
}

func confirm(conn io.Writer) error {
	_, err := conn.Write([]byte{1})
	return err
}
