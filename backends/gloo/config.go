package gloo

import (
	"crypto/tls"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// Transports and algorithms accepted by Config (and by GODDP_GLOO_TRANSPORT / GODDP_GLOO_ALGO).
const (
	TransportAuto = "auto" // Unix domain sockets between ranks on one host, TCP between hosts
	TransportTCP  = "tcp"
	TransportUnix = "unix" // every peer must be on this host

	AlgoAuto   = "auto"         // direct below Config.DirectMaxBytes, ring above (hierarchical across hosts when it applies)
	AlgoRing   = "ring"         // pipelined ring: reduce-scatter then all-gather, over every rank
	AlgoDirect = "direct"       // every rank exchanges its whole buffer with every other (latency-optimal)
	AlgoHier   = "hierarchical" // Note [Hierarchical] where the placement allows it (as auto), the flat ring elsewhere
	AlgoRD     = "rd"           // recursive doubling (Note [Recursive doubling]) for every size

	TuneAuto = "auto" // across hosts, auto's choice comes from a calibrated cost model (Note [Algorithm choice])
	TuneOff  = "off"  // the fixed rules everywhere

	ShmAuto = "auto" // same-host ranks joined by Unix sockets move large data through shared memory
	ShmOff  = "off"  // data always goes over the sockets

	VMReadvAuto = "auto" // Note [Single copy] where every rank can read its peers
	VMReadvOff  = "off"  // never process_vm_readv

	AdoptAuto = "auto" // Note [Adopted buffers]: the user's buffers move into the arena at their second collective
	AdoptOff  = "off"  // the user's buffers stay private
)

// Config holds the gloo backend's options; pass a *Config as procgroup.Options.Backend.
// The zero value means the defaults. The environment variables GODDP_GLOO_TRANSPORT and
// GODDP_GLOO_ALGO, when set, override Transport and Algorithm.
type Config struct {
	// Transport is "auto" (default), "tcp" or "unix".
	Transport string
	// Algorithm is "auto" (default), "ring", "direct", "hierarchical" or "rd".
	Algorithm string
	// ListenAddr is the host (or host:port) of the TCP listener, which is also the address
	// published to the peers. Empty (the default) picks it with procgroup.ChooseListenAddr:
	// the interface GODDP_SOCKET_IFNAME or GLOO_SOCKET_IFNAME names, else the local end of
	// the route to the rendezvous store, else the hostname's address.
	ListenAddr string
	// SegmentSize is the ring's pipeline segment and the largest data frame, in bytes
	// (default 1 MiB; rounded down to a multiple of 8); the two-rank socket exchange
	// sends frames of this size and stages two of them (Note [Inline exchange]).
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
	// SharedMemory is "auto" (default) or "off". With "auto", ranks on one host whose
	// connection is a Unix socket share one memory region (Note [Shared memory]) through
	// which the ring all-reduce moves its data; the socket still carries control, aborts
	// and liveness. GODDP_GLOO_SHM overrides it. It may differ between ranks: a rank
	// with "off" is left out of its host's region, and where a host's ranks do not all
	// share memory, the hierarchical all-reduce runs without its pipeline on every host
	// (Note [Agreement]).
	SharedMemory string
	// ShmSlotSize is the size of one shared-memory slot, the ring's pipeline segment on
	// that path (default 256 KiB; rounded down to a multiple of 64). Only the lowest rank
	// of a host's value counts: it lays out the region.
	ShmSlotSize int
	// ShmSlots is the number of slots per directed pair of ranks (default 8).
	ShmSlots int
	// ShmArenaMiB is the shared memory each rank of a host may hand out with AllocBuffer,
	// in MiB (Note [Shared buffers]; default 1024, -1: none). It is address space: pages
	// take memory only once written. Only the lowest rank of a host's value counts.
	// GODDP_GLOO_SHM_ARENA_MIB overrides it.
	ShmArenaMiB int
	// HierPieceSize is the piece of Note [Hierarchical pipeline], in bytes: where a host's
	// ranks share memory, the hierarchical all-reduce cuts its message into pieces of about
	// this size (at most 16) and overlaps one piece's host phases with another's transfer
	// across hosts (default 2 MiB; -1: one piece, no overlap). Every rank must have the
	// same value: New refuses ranks that differ (Note [Agreement]), as it does for
	// Algorithm, SegmentSize and DirectMaxBytes. GODDP_GLOO_HIER_PIECE overrides it.
	HierPieceSize int
	// Tune is "auto" (default) or "off": whether a group that spans hosts calibrates the
	// cost model that picks the all-reduce's algorithm (Note [Algorithm choice]).
	// GODDP_GLOO_TUNE overrides it.
	Tune string
	// VMReadv is "auto" (default) or "off": whether the collectives of a group whose ranks
	// all share one region read the peers' own buffers with process_vm_readv (Note
	// [Single copy]). Where any rank has "off" or cannot read its peers, the whole group
	// runs without it. GODDP_GLOO_VMREADV (auto, off; 1 and 0 too) overrides it.
	VMReadv string
	// AdoptBuffers is "auto" (default) or "off": whether a rank of a host with a shared
	// arena moves a buffer of Go's heap into it, under the buffer's own addresses, once
	// the buffer has been passed to a second collective (Note [Adopted buffers]), so that
	// later collectives on it run in place. The group then holds the buffer until Close
	// (at most half the arena part). Each rank may differ: a rank without it sends its
	// peers down their other paths. GODDP_GLOO_ADOPT overrides it.
	AdoptBuffers string
	// HostID identifies this host to the other ranks (default procgroup.HostIdentity: the
	// boot id and the network namespace, never the hostname alone); ranks with the same
	// HostID use Unix sockets and shared memory. Tests set it to simulate hosts.
	HostID string
	// TLS, when set, secures every TCP connection between ranks (Note [Data-plane TLS]);
	// nil means procgroup.Options.TLS, and both nil plain TCP (authenticated by the token).
	TLS *tls.Config
}

// enumSetting takes *v from the environment variable env when set, the default (the first
// of allowed) when empty, and fails unless it is one of allowed.
func enumSetting(v *string, env, what string, allowed ...string) error {
	if e := os.Getenv(env); e != "" {
		*v = e
	}
	if *v == "" {
		*v = allowed[0]
	}
	if !slices.Contains(allowed, *v) {
		return fmt.Errorf("%w: gloo: unknown %s %q (want %s)", procgroup.ErrInvalidArgument, what, *v, strings.Join(allowed, " or "))
	}
	return nil
}

// maxShmArenaMiB bounds Config.ShmArenaMiB (1 TiB per rank).
const maxShmArenaMiB = 1 << 20

func (c *Config) validate() error {
	if v := os.Getenv("GODDP_GLOO_TRANSPORT"); v != "" {
		c.Transport = v
	}
	if v := os.Getenv("GODDP_GLOO_ALGO"); v != "" {
		c.Algorithm = v
	}
	if err := enumSetting(&c.SharedMemory, "GODDP_GLOO_SHM", "shared-memory mode", ShmAuto, ShmOff); err != nil {
		return err
	}
	if c.ShmSlotSize == 0 {
		c.ShmSlotSize = 256 << 10
	}
	c.ShmSlotSize &^= 63
	if c.ShmSlotSize < 64 || c.ShmSlotSize > maxShmSlot {
		return fmt.Errorf("%w: gloo: shared-memory slot size %d outside [64, %d]", procgroup.ErrInvalidArgument, c.ShmSlotSize, maxShmSlot)
	}
	if c.ShmSlots == 0 {
		c.ShmSlots = 8
	}
	if err := enumSetting(&c.Tune, "GODDP_GLOO_TUNE", "tuning mode", TuneAuto, TuneOff); err != nil {
		return err
	}
	if err := enumSetting(&c.AdoptBuffers, "GODDP_GLOO_ADOPT", "buffer adoption mode", AdoptAuto, AdoptOff); err != nil {
		return err
	}
	switch v := os.Getenv("GODDP_GLOO_VMREADV"); v {
	case "":
	case "1": // the opt-in of earlier versions
		c.VMReadv = VMReadvAuto
	case "0":
		c.VMReadv = VMReadvOff
	default:
		c.VMReadv = v
	}
	switch c.VMReadv {
	case "":
		c.VMReadv = VMReadvAuto
	case VMReadvAuto, VMReadvOff:
	default:
		return fmt.Errorf("%w: gloo: unknown process_vm_readv mode %q (GODDP_GLOO_VMREADV, gloo.Config.VMReadv; want auto or off)", procgroup.ErrInvalidArgument, c.VMReadv)
	}
	if v := os.Getenv("GODDP_GLOO_SHM_ARENA_MIB"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < -1 {
			return fmt.Errorf("%w: gloo: GODDP_GLOO_SHM_ARENA_MIB=%q: want a number of MiB, or -1 for none", procgroup.ErrInvalidArgument, v)
		}
		c.ShmArenaMiB = n
	}
	if v := os.Getenv("GODDP_GLOO_HIER_PIECE"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < -1 || n == 0 {
			return fmt.Errorf("%w: gloo: GODDP_GLOO_HIER_PIECE=%q: want a number of bytes, or -1 for one piece", procgroup.ErrInvalidArgument, v)
		}
		c.HierPieceSize = n
	}
	switch {
	case c.HierPieceSize == 0:
		c.HierPieceSize = 2 << 20
	case c.HierPieceSize < -1:
		return fmt.Errorf("%w: gloo: hierarchical piece size %d: want bytes, or -1 for one piece", procgroup.ErrInvalidArgument, c.HierPieceSize)
	}
	switch {
	case c.ShmArenaMiB == 0:
		c.ShmArenaMiB = 1024
	case c.ShmArenaMiB < -1 || c.ShmArenaMiB > maxShmArenaMiB:
		return fmt.Errorf("%w: gloo: shared arena of %d MiB outside [-1, %d]", procgroup.ErrInvalidArgument, c.ShmArenaMiB, maxShmArenaMiB)
	}
	if c.ShmSlots < 1 || c.ShmSlots > maxShmSlots {
		return fmt.Errorf("%w: gloo: %d shared-memory slots outside [1, %d]", procgroup.ErrInvalidArgument, c.ShmSlots, maxShmSlots)
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
	case AlgoAuto, AlgoRing, AlgoDirect, AlgoHier, AlgoRD:
	default:
		return fmt.Errorf("%w: gloo: unknown algorithm %q (want auto, ring, direct, hierarchical or rd)", procgroup.ErrInvalidArgument, c.Algorithm)
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
		c.HostID = procgroup.HostIdentity()
	}
	return nil
}
