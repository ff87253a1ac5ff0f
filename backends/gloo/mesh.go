package gloo

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/goddp/goddp/procgroup"
)

// addrInfo is what each rank publishes under "gloo/<rank>" in the group's store prefix.
type addrInfo struct {
	Host    string `json:"host"`         // host name, for messages
	HostID  string `json:"host_id"`      // same HostID: same-host transport (Config.HostID)
	Machine string `json:"machine"`      // procgroup.HostIdentity, which tests cannot override
	IP      string `json:"ip,omitempty"` // the address peers reach it at, for messages
	TCP     string `json:"tcp,omitempty"`
	Unix    string `json:"unix,omitempty"`
	// Note [Agreement]: the settings every rank compares before it dials.
	Settings *groupSettings `json:"settings,omitempty"`
}

// peer is one connection of the mesh.
type peer struct {
	g    *group
	rank int
	conn net.Conn
	raw  syscall.RawConn

	wmu  sync.Mutex // held while one frame is written (writer goroutine, inline write, abort)
	torn bool       // guarded by wmu: a frame was cut short, write nothing more (Note [Torn frames])

	mu       sync.Mutex // guards the fields below
	q        []sendReq
	qhead    int
	issued   int           // requests ever queued (written by the worker only)
	done     int           // requests ever written (or failed)
	werr     error         // first write error
	wake     chan struct{} // size 1: the queue is not empty
	progress chan struct{} // size 1: done advanced

	whdr [frameHeaderLen]byte // writer goroutine only
	iov  [2][]byte            // writeFrame's vector (under wmu)
	bufs net.Buffers          // a field, so that WriteTo's receiver does not escape

	goneAt atomic.Int64 // alive: when it first found the peer gone with bytes unread (UnixNano)

	// worker-only
	spins    int // Note [Inline exchange]'s yields before poll: inlineSpins on this host, else 0
	deadline time.Time
	hdr      [frameHeaderLen]byte
	abortBuf [maxAbortLen]byte
	rbuf     []byte // a small frame with its header
}

type sendReq struct {
	hdr  [frameHeaderLen]byte
	data []byte
}

func (g *group) newPeer(rank int, c net.Conn) *peer {
	p := &peer{g: g, rank: rank, conn: c, wake: make(chan struct{}, 1), progress: make(chan struct{}, 1),
		rbuf: make([]byte, frameHeaderLen+g.cfg.InlineMaxBytes)}
	// Note [Inline writes]: the worker writes small frames itself, to every peer, before it
	// reads; two ranks doing that at once only avoid a deadlock if each frame fits in the
	// socket's send buffer, so make that buffer comfortably large.
	switch c := c.(type) {
	case *net.UnixConn:
		c.SetWriteBuffer(4 << 20)
		c.SetReadBuffer(4 << 20)
	case *net.TCPConn:
		c.SetNoDelay(true)
		c.SetWriteBuffer(4 << 20)
	}
	if sc, ok := c.(syscall.Conn); ok {
		p.raw, _ = sc.SyscallConn()
	}
	return p
}

// connect sets up the mesh: rank r accepts from every higher rank and dials every lower one.
// Every wait in it is bounded by Options.ConnectTimeout and says what it waits for every
// procgroup.ConnectWarnInterval (Note [Set-up waits]).
func (g *group) connect(ctx context.Context) error {
	store := procgroup.PrefixStore{Prefix: g.opts.Prefix + "/gloo", Store: g.opts.Store}
	hs := &handshaker{key: groupKey(g.opts.Token, g.opts.Prefix), rank: g.rank, size: g.size, rand: rand.Reader}
	info := addrInfo{Host: hostname(), HostID: g.cfg.HostID, Machine: procgroup.HostIdentity(), Settings: g.cfg.settings()}
	g.hosts[g.rank] = info.Host
	g.hostIDs[g.rank] = info.HostID
	if g.size == 1 {
		return nil
	}
	accepts := g.rank < g.size-1 // the highest rank only dials
	addr, reason := "", ""
	if g.cfg.Transport != TransportUnix {
		var err error
		if addr, reason, err = g.listenAddr(); err != nil {
			return err
		}
		info.IP, _, _ = net.SplitHostPort(addr)
	}
	if accepts && g.cfg.Transport != TransportUnix {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("listen tcp %s (%s): %w", addr, reason, err)
		}
		g.listeners = append(g.listeners, ln)
		info.TCP = ln.Addr().String()
		g.log.Info("gloo: listening for peers", zap.String("addr", info.TCP), zap.String("reason", reason))
	}
	if accepts && g.cfg.Transport != TransportTCP {
		name := "@goddp-gloo-" + hex.EncodeToString(randomBytes(12))
		ln, err := net.Listen("unix", name)
		if err != nil {
			if g.cfg.Transport == TransportUnix {
				return fmt.Errorf("listen unix: %w", err)
			}
			g.log.Warn("gloo: no unix socket listener, using TCP only", zap.Error(err))
		} else {
			g.listeners = append(g.listeners, ln)
			info.Unix = name
		}
	}
	for _, ln := range g.listeners {
		g.wg.Add(1)
		go g.acceptLoop(ln, hs)
	}
	b, _ := json.Marshal(info)
	if err := store.Set(ctx, strconv.Itoa(g.rank), b); err != nil {
		return fmt.Errorf("publish address: %w", err)
	}
	infos, err := g.gatherAddrs(ctx, store, info)
	if err != nil {
		return err
	}
	if err := g.agreeSettings(infos); err != nil {
		return err
	}
	if err := g.checkReachable(infos); err != nil {
		return err
	}
	for j := 0; j < g.rank; j++ {
		c, err := g.dial(ctx, j, infos[j], hs)
		if err != nil {
			return err
		}
		g.meshMu.Lock()
		g.peers[j] = g.newPeer(j, c)
		g.meshMu.Unlock()
	}
	return g.awaitDialers(ctx, infos[g.rank])
}

// Note [Set-up waits]
// A rank waits at three points of the set-up: for each peer's address in the store, for
// each dial (retried with backoff while the peer's listener is not up yet), and for the
// higher ranks to dial in. Each wait is bounded by Options.ConnectTimeout, and while it
// lasts a warning names the peer, its address and transport, the time waited, the last
// error and the likely fix; the final error says the same. A wrong address therefore shows
// in the first seconds of a job, not as silence until the collective timeout.

// listenAddr is the TCP listener's host:port and why it was chosen.
func (g *group) listenAddr() (addr, reason string, err error) {
	if a := g.cfg.ListenAddr; a != "" {
		if _, _, err := net.SplitHostPort(a); err != nil {
			a = net.JoinHostPort(a, "0")
		}
		return a, "gloo.Config.ListenAddr", nil
	}
	la, err := procgroup.ChooseListenAddr(g.opts.LookupEnv, g.opts.StoreAddr)
	if err != nil {
		return "", "", err
	}
	return net.JoinHostPort(la.IP.String(), "0"), la.Reason, nil
}

// gatherAddrs reads every other rank's published addresses, waiting for each in turn.
func (g *group) gatherAddrs(ctx context.Context, store procgroup.Store, mine addrInfo) ([]addrInfo, error) {
	infos := make([]addrInfo, g.size)
	infos[g.rank] = mine
	for j := range g.size {
		if j == g.rank {
			continue
		}
		wctx, done := procgroup.BoundedWait(ctx, g.opts.ConnectTimeout, 0, func(waited time.Duration) {
			g.log.Warn("gloo: still waiting for a peer to publish its address",
				zap.Int("peer", j), zap.Duration("waited", waited), zap.Duration("bound", g.opts.ConnectTimeout),
				zap.String("hint", g.absentHint(j)))
		})
		raw, err := store.Get(wctx, strconv.Itoa(j))
		timedOut := procgroup.TimedOut(ctx, wctx)
		done()
		if err != nil {
			if timedOut {
				return nil, fmt.Errorf("%w: rank %d did not publish its address within %v (%s): %s",
					procgroup.ErrConnectTimeout, j, g.opts.ConnectTimeout, procgroup.ConnectTimeoutEnv, g.absentHint(j))
			}
			return nil, fmt.Errorf("address of rank %d: %w", j, err)
		}
		if err := json.Unmarshal(raw, &infos[j]); err != nil {
			return nil, fmt.Errorf("address of rank %d: %w", j, err)
		}
		g.hosts[j], g.hostIDs[j] = infos[j].Host, infos[j].HostID
		if infos[j].Machine != mine.Machine {
			g.hosts[j] = infos[j].describe() // one hostname can stand for several hosts
		}
	}
	return infos, nil
}

func (g *group) absentHint(j int) string {
	where := "the rendezvous store"
	if g.opts.StoreAddr != "" {
		where += " at " + g.opts.StoreAddr
	}
	return fmt.Sprintf("rank %d has not joined the group; check that its process started and that its host can reach %s", j, where)
}

// checkReachable fails at once where a rank published a loopback address that a rank on
// another machine would have to dial: the dial could only reach the dialer's own loopback.
func (g *group) checkReachable(infos []addrInfo) error {
	me := infos[g.rank]
	for j, pi := range infos {
		if j == g.rank || pi.Machine == me.Machine {
			continue
		}
		if j > g.rank && me.TCP != "" && isLoopbackAddr(me.TCP) {
			return fmt.Errorf("%w: rank %d would publish the loopback address %s, but rank %d runs on another host (%s), "+
				"which cannot reach it there; set GODDP_SOCKET_IFNAME (or GLOO_SOCKET_IFNAME) to the interface that joins the hosts, "+
				"or point the launcher at this host's routable address (--master_addr, MASTER_ADDR) rather than at localhost",
				procgroup.ErrInvalidArgument, g.rank, me.TCP, j, pi.describe())
		}
		if j < g.rank && pi.TCP != "" && isLoopbackAddr(pi.TCP) {
			return fmt.Errorf("%w: rank %d published the loopback address %s, but it runs on another host (%s) than rank %d; "+
				"set GODDP_SOCKET_IFNAME (or GLOO_SOCKET_IFNAME) to the interface that joins the hosts on rank %d's host, "+
				"or point the launcher at a routable address (--master_addr, MASTER_ADDR) rather than at localhost",
				procgroup.ErrInvalidArgument, j, pi.TCP, pi.describe(), g.rank, j)
		}
	}
	return nil
}

func isLoopbackAddr(hostport string) bool {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// describe names the host of a published address for messages: its name and address.
func (pi addrInfo) describe() string {
	if pi.IP != "" {
		return pi.Host + " " + pi.IP
	}
	return pi.Host
}

// dial connects to rank j, retrying until the connect bound or ctx ends, and authenticates.
// A failed Unix dial falls back to TCP at once.
func (g *group) dial(ctx context.Context, j int, pi addrInfo, hs *handshaker) (net.Conn, error) {
	network, addr := "tcp", pi.TCP
	sameHost := pi.HostID == g.cfg.HostID && pi.Unix != ""
	switch g.cfg.Transport {
	case TransportUnix:
		if !sameHost {
			return nil, fmt.Errorf("%w: transport unix, but rank %d is on another host (%s)", procgroup.ErrInvalidArgument, j, pi.describe())
		}
		network, addr = "unix", pi.Unix
	case TransportAuto:
		if sameHost {
			network, addr = "unix", pi.Unix
		}
	}
	if addr == "" {
		return nil, fmt.Errorf("rank %d published no %s address", j, network)
	}
	var last procgroup.LastError
	var target atomicString
	target.Store(network + " " + addr)
	hint := func() string {
		return fmt.Sprintf("check that this host can reach %s (routing, firewall), or set GODDP_SOCKET_IFNAME on rank %d's host "+
			"to the interface that joins the hosts", pi.describe(), j)
	}
	wctx, done := procgroup.BoundedWait(ctx, g.opts.ConnectTimeout, 0, func(waited time.Duration) {
		g.log.Warn("gloo: still connecting to a peer", zap.Int("peer", j), zap.String("host", pi.Host),
			zap.String("addr", target.Load()), zap.Duration("waited", waited), zap.Duration("bound", g.opts.ConnectTimeout),
			zap.String("last_error", last.String()), zap.String("hint", hint()))
	})
	defer done()
	d := net.Dialer{Timeout: min(g.opts.ConnectTimeout, 30*time.Second)}
	backoff := 10 * time.Millisecond
	for {
		c, err := d.DialContext(wctx, network, addr)
		if err == nil {
			c.SetDeadline(time.Now().Add(g.cfg.HandshakeTimeout))
			if c, err = g.secureDial(c, network, addr); err == nil { // Note [Data-plane TLS]
				err = hs.dial(c, j)
			}
			if err == nil {
				c.SetDeadline(time.Time{})
				return c, nil
			}
			c.Close()
			if errors.Is(err, errAuth) {
				return nil, fmt.Errorf("connect to rank %d at %s %s: %w", j, network, addr, err)
			}
		}
		last.Set(err)
		if network == "unix" && g.cfg.Transport == TransportAuto && pi.TCP != "" {
			g.log.Info("gloo: unix socket dial failed, using TCP", zap.Int("peer", j), zap.Error(err))
			network, addr = "tcp", pi.TCP
			target.Store(network + " " + addr)
			continue
		}
		select {
		case <-wctx.Done():
			if procgroup.TimedOut(ctx, wctx) {
				return nil, fmt.Errorf("%w: could not connect to rank %d (%s) at %s %s within %v (%s); last error: %v; %s",
					procgroup.ErrConnectTimeout, j, pi.Host, network, addr, g.opts.ConnectTimeout, procgroup.ConnectTimeoutEnv, err, hint())
			}
			return nil, fmt.Errorf("connect to rank %d at %s %s: %w (last error: %v)", j, network, addr, ctx.Err(), err)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// awaitDialers waits, within the connect bound, until every higher rank has dialed in.
func (g *group) awaitDialers(ctx context.Context, me addrInfo) error {
	missing := func() int {
		g.meshMu.Lock()
		defer g.meshMu.Unlock()
		for j := g.rank + 1; j < g.size; j++ {
			if g.peers[j] == nil {
				return j
			}
		}
		return -1
	}
	hint := func(j int) string {
		return fmt.Sprintf("rank %d (%s) has not connected to this rank's listener at %s; check that its host can reach this address, "+
			"or set GODDP_SOCKET_IFNAME on this host to the interface that joins the hosts", j, g.hosts[j], me.TCP)
	}
	wctx, done := procgroup.BoundedWait(ctx, g.opts.ConnectTimeout, 0, func(waited time.Duration) {
		if j := missing(); j >= 0 {
			g.log.Warn("gloo: still waiting for a peer to connect", zap.Int("peer", j), zap.String("listen", me.TCP),
				zap.Duration("waited", waited), zap.Duration("bound", g.opts.ConnectTimeout), zap.String("hint", hint(j)))
		}
	})
	defer done()
	for {
		j := missing()
		if j < 0 {
			return nil
		}
		select {
		case <-g.meshCh:
		case <-wctx.Done():
			if procgroup.TimedOut(ctx, wctx) {
				return fmt.Errorf("%w: rank %d did not connect within %v (%s): %s",
					procgroup.ErrConnectTimeout, j, g.opts.ConnectTimeout, procgroup.ConnectTimeoutEnv, hint(j))
			}
			return fmt.Errorf("waiting for rank %d to connect: %w", j, ctx.Err())
		}
	}
}

// atomicString is a string read by a warning goroutine while the dialer changes it.
type atomicString struct{ v atomic.Value }

func (a *atomicString) Store(s string) { a.v.Store(s) }
func (a *atomicString) Load() string   { s, _ := a.v.Load().(string); return s }

// acceptLoop accepts connections until the listener closes; each one is authenticated on
// its own goroutine (at most cap(hsSem) at once), so a slow stranger blocks nobody.
func (g *group) acceptLoop(ln net.Listener, hs *handshaker) {
	defer g.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			select {
			case <-g.stop:
				return
			default:
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			g.log.Warn("gloo: accept", zap.Error(err))
			time.Sleep(10 * time.Millisecond)
			continue
		}
		select {
		case g.hsSem <- struct{}{}:
		default:
			g.log.Warn("gloo: refused connection: too many handshakes in progress", zap.String("remote", c.RemoteAddr().String()))
			c.Close()
			continue
		}
		g.hsMu.Lock()
		select {
		case <-g.stop:
			g.hsMu.Unlock()
			c.Close()
			<-g.hsSem
			return
		default:
		}
		g.hsConns[c] = struct{}{}
		g.hsMu.Unlock()
		g.wg.Add(1)
		go g.handshake(c, hs)
	}
}

func (g *group) handshake(c net.Conn, hs *handshaker) {
	defer g.wg.Done()
	defer func() { <-g.hsSem }()
	keep := false
	defer func() {
		g.hsMu.Lock()
		delete(g.hsConns, c)
		g.hsMu.Unlock()
		if !keep {
			c.Close()
		}
	}()
	remote := c.RemoteAddr().String()
	c.SetDeadline(time.Now().Add(g.cfg.HandshakeTimeout))
	conn, err := g.secureAccept(c) // Note [Data-plane TLS]; c itself without TLS
	var rank int
	if err == nil {
		rank, err = hs.accept(conn)
	}
	if err != nil {
		g.log.Warn("gloo: refused connection", zap.String("remote", remote), zap.Error(err))
		return
	}
	g.meshMu.Lock()
	if rank <= g.rank || g.peers[rank] != nil {
		g.meshMu.Unlock()
		g.log.Warn("gloo: refused authenticated connection: unexpected or duplicate", zap.Int("peer", rank))
		return
	}
	select {
	case <-g.stop:
		g.meshMu.Unlock()
		return
	default:
	}
	if err := confirm(conn); err != nil {
		g.meshMu.Unlock()
		g.log.Warn("gloo: handshake confirm", zap.Int("peer", rank), zap.Error(err))
		return
	}
	c.SetDeadline(time.Time{})
	g.peers[rank] = g.newPeer(rank, conn)
	keep = true
	g.meshMu.Unlock()
	select {
	case g.meshCh <- struct{}{}:
	default:
	}
}

// writeLoop writes the peer's queued frames in order until the group stops.
func (p *peer) writeLoop() {
	defer p.g.wg.Done()
	for {
		select {
		case <-p.wake:
		case <-p.g.stop:
			return
		}
		for {
			p.mu.Lock()
			if p.qhead == len(p.q) {
				clear(p.q)
				p.q, p.qhead = p.q[:0], 0
				p.mu.Unlock()
				break
			}
			r := &p.q[p.qhead]
			p.whdr = r.hdr // a field, not a local: a local would escape through Write
			data := r.data
			r.data = nil
			p.qhead++
			p.mu.Unlock()
			var err error
			select {
			case <-p.g.aborted:
				err = p.g.abortErr
			default:
				err = p.writeFrame(p.whdr[:], data)
			}
			p.mu.Lock()
			p.done++
			if err != nil && p.werr == nil {
				p.werr = err
			}
			p.mu.Unlock()
			if err != nil {
				p.lostOnWrite()
				p.g.abort(p.g.lostErr(p, err))
			}
			select {
			case p.progress <- struct{}{}:
			default:
			}
		}
	}
}

// writeFrame writes header and payload with one writev (one syscall, and on TCP one
// segment train instead of a 16-byte packet then the data).
func (p *peer) writeFrame(hdr, data []byte) error {
	p.wmu.Lock()
	defer p.wmu.Unlock()
	if len(data) == 0 {
		_, err := p.conn.Write(hdr)
		return err
	}
	p.iov[0], p.iov[1] = hdr, data
	p.bufs = p.iov[:]
	_, err := p.bufs.WriteTo(p.conn)
	p.iov[0], p.iov[1], p.bufs = nil, nil, nil
	return err
}

// Note [Lost on write]: a write to a peer fails once the peer has closed its end, and a peer
// closes its end when it aborts, just after its abort frame, which names the rank that was
// lost (group.abort). That frame then waits in this rank's receive buffer for the goroutine
// that reads the peer (the worker, or the crossWorker of Note [Hierarchical pipeline]). Had
// the writer aborted the group at once, the group would have named the peer as the lost
// rank: a 2+2-rank group whose rank 3 died reported rank 2 lost on rank 0 in about 1 run
// of 20 (TestHierPipelinePeerLost, 2026-12-05). So the writer first gives the reading side
// one PollInterval to abort the group with the cause the peer sent, and names the peer only
// if it has not: a peer that truly died is named at most that much later.

// lostOnWrite waits, after a failed write to p, for Note [Lost on write]: until the group
// aborts or stops, or one PollInterval has passed.
func (p *peer) lostOnWrite() {
	t := time.NewTimer(p.g.cfg.PollInterval)
	defer t.Stop()
	select {
	case <-p.g.aborted:
	case <-p.g.stop:
	case <-t.C:
	}
}

// enqueue hands one data frame to the peer's writer goroutine; it is request number
// p.issued. data must stay untouched until waitDone(p.issued) returns.
func (p *peer) enqueue(seq uint32, data []byte) {
	p.mu.Lock()
	p.q = append(p.q, sendReq{data: data})
	putHeader(p.q[len(p.q)-1].hdr[:], kindData, seq, len(data))
	p.issued++
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// sendAbort tells the peer why the group aborts. A frame being written to the peer is let
// finish first (until deadline): an abort frame cut into the middle of one would only be
// garbage to the peer. Writers write nothing new once the group is aborted. It reports
// whether the frame was written.
func (p *peer) sendAbort(lost int, reason string, deadline time.Time) bool {
	for !p.wmu.TryLock() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	defer p.wmu.Unlock()
	if p.torn {
		return false
	}
	var b [frameHeaderLen + maxAbortLen]byte
	n := abortPayload(b[frameHeaderLen:], lost, reason)
	putHeader(b[:], kindAbort, 0, n)
	p.conn.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	_, err := p.conn.Write(b[:frameHeaderLen+n])
	return err == nil
}

// Note [Probing peers]: alive tells a dead peer from a live one by the socket: one that
// closed its end (its FIN, the kernel's close of a killed process's Unix socket) or
// broke (a reset) is gone, even with bytes still unread (a peek of one byte took those for
// life). But an aborting peer writes its abort frame, which names the rank that was lost,
// before it closes, and that frame may wait unread behind others while the goroutine that
// reads the peer is busy elsewhere. So a peer gone with bytes unread is reported only once
// it has been so for one PollInterval, which gives the reader (and the abort's other
// paths: the frames to the other peers, shared memory) time to abort the group with the
// cause, as Note [Lost on write] does for writes; a peer gone with nothing unread is
// reported at once.

// alive probes the connection without consuming data: false if the peer closed it or it
// broke (Note [Probing peers]).
func (p *peer) alive() (bool, error) {
	if p.raw == nil {
		return true, nil
	}
	var gone bool
	var unread int
	var perr error
	// Control, not Read: Read would report the read deadline that brought us here. The
	// worker and crossWorker (Note [Hierarchical pipeline]) may probe at once.
	err := p.raw.Control(func(fd uintptr) { gone, unread, perr = probeConn(int(fd)) })
	switch {
	case err != nil:
		return false, err
	case !gone:
		return true, nil
	case unread == 0:
		return false, perr
	}
	now := time.Now().UnixNano()
	if p.goneAt.CompareAndSwap(0, now) {
		return true, nil
	}
	if since := time.Duration(now - p.goneAt.Load()); since < p.g.cfg.PollInterval {
		return true, nil
	}
	return false, fmt.Errorf("connection closed by peer, %d bytes left unread", unread)
}
