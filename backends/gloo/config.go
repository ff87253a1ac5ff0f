package gloo

import (
	"fmt"
	"os"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// Transports and algorithms accepted by Config (and by GODDP_GLOO_TRANSPORT / GODDP_GLOO_ALGO).
const (
	TransportAuto = "auto" // Unix domain sockets between ranks on one host, TCP between hosts
	TransportTCP  = "tcp"
	TransportUnix = "unix" // every peer must be on this host

	AlgoAuto   = "auto"   // direct below Config.DirectMaxBytes, ring above
	AlgoRing   = "ring"   // pipelined ring: reduce-scatter then all-gather
	AlgoDirect = "direct" // every rank exchanges its whole buffer with every other (latency-optimal)
)

// Config holds the gloo backend's options; pass a *Config as procgroup.Options.Backend.
// The zero value means the defaults. The environment variables GODDP_GLOO_TRANSPORT and
// GODDP_GLOO_ALGO, when set, override Transport and Algorithm.
type Config struct {
	// Transport is "auto" (default), "tcp" or "unix".
	Transport string
	// Algorithm is "auto" (default), "ring" or "direct".
	Algorithm string
	// ListenAddr is the host (or host:port) of the TCP listener; default 127.0.0.1.
	ListenAddr string
	// SegmentSize is the ring's pipeline segment and the largest data frame, in bytes
	// (default 1 MiB; rounded down to a multiple of 8).
	SegmentSize int
	// DirectMaxBytes is the largest message the "auto" algorithm sends with direct exchange
	// (default 64 KiB).
	DirectMaxBytes int
	// InlineMaxBytes is the largest per-peer message the worker writes itself, without
	// handing it to the peer's writer goroutine (default 32 KiB). It must fit in a socket's
	// send buffer: Note [Inline writes].
	InlineMaxBytes int
	// PollInterval is how often a worker blocked on a read checks the other peers for a
	// closed connection, the collective's timeout and its ctx (default 500 ms).
	PollInterval time.Duration
	// HandshakeTimeout bounds one connection's authentication (default 10 s).
	HandshakeTimeout time.Duration
	// HostID identifies this host to the other ranks (default: hostname and boot id); ranks
	// with the same HostID use the same-host transport. Tests set it to simulate hosts.
	HostID string
}

func (c *Config) validate() error {
	if v := os.Getenv("GODDP_GLOO_TRANSPORT"); v != "" {
		c.Transport = v
	}
	if v := os.Getenv("GODDP_GLOO_ALGO"); v != "" {
		c.Algorithm = v
	}
	switch c.Transport {
	case "":
		c.Transport = TransportAuto
	case TransportAuto, TransportTCP, TransportUnix:
	default:
		return fmt.Errorf("%w: gloo: unknown transport %q (want auto, tcp or unix)", procgroup.ErrInvalidArgument, c.Transport)
	}
	switch c.Algorithm {
	case "":
		c.Algorithm = AlgoAuto
	case AlgoAuto, AlgoRing, AlgoDirect:
	default:
		return fmt.Errorf("%w: gloo: unknown algorithm %q (want auto, ring or direct)", procgroup.ErrInvalidArgument, c.Algorithm)
	}
	if c.ListenAddr == "" {
		c.ListenAddr = "127.0.0.1"
	}
	if c.SegmentSize == 0 {
		c.SegmentSize = 1 << 20
	}
	c.SegmentSize &^= 7
	if c.SegmentSize < 8 || c.SegmentSize > maxFrameLen {
		return fmt.Errorf("%w: gloo: segment size %d outside [8, %d]", procgroup.ErrInvalidArgument, c.SegmentSize, maxFrameLen)
	}
	if c.DirectMaxBytes == 0 {
		c.DirectMaxBytes = 64 << 10
	}
	if c.InlineMaxBytes == 0 {
		c.InlineMaxBytes = 32 << 10
	}
	if c.InlineMaxBytes > c.SegmentSize {
		c.InlineMaxBytes = c.SegmentSize
	}
	if c.PollInterval <= 0 {
		c.PollInterval = 500 * time.Millisecond
	}
	if c.HandshakeTimeout <= 0 {
		c.HandshakeTimeout = 10 * time.Second
	}
	if c.HostID == "" {
		c.HostID = defaultHostID()
	}
	return nil
}

func defaultHostID() string {
	h, _ := os.Hostname()
	b, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	return h + "/" + string(b)
}
