//go:build linux

package gloo

import (
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// probePeer is a peer over c as alive sees it, with PollInterval poll.
func probePeer(t *testing.T, c net.Conn, poll time.Duration) *peer {
	t.Helper()
	raw, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	return &peer{g: &group{cfg: Config{PollInterval: poll}}, conn: c, raw: raw}
}

// connPair is a connected pair of sockets over network ("tcp" on loopback, or "unix").
func connPair(t *testing.T, network string) (a, b net.Conn) {
	t.Helper()
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = "@goddp-probe-test-" + strings.ReplaceAll(t.Name(), "/", "-")
	}
	ln, err := net.Listen(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		b, err = ln.Accept()
	}()
	a, aerr := net.Dial(network, ln.Addr().String())
	<-done
	if aerr != nil || err != nil {
		t.Fatalf("connect: %v, %v", aerr, err)
	}
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// deadWithin probes p every few ms until it reports the peer dead, for at most d; it
// fails the test if the peer still looks alive then.
func deadWithin(t *testing.T, p *peer, d time.Duration, what string) error {
	t.Helper()
	end := time.Now().Add(d)
	for {
		ok, err := p.alive()
		if !ok {
			return err
		}
		if time.Now().After(end) {
			t.Fatalf("%s: alive() still says alive after %v", what, d)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// aliveFor probes p for d and fails the test if it ever reports the peer dead.
func aliveFor(t *testing.T, p *peer, d time.Duration, what string) {
	t.Helper()
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if ok, err := p.alive(); !ok {
			t.Fatalf("%s: alive() says dead (%v); the peer is live", what, err)
		}
	}
}

// TestAliveProbe (Note [Probing peers]), over TCP and Unix sockets: a live peer is alive
// with and without bytes unread; a peer that closed with nothing unread is dead at once;
// one that wrote bytes and then closed (or whose socket was reset: TCP closed with bytes
// of ours unread) is dead within about a PollInterval, although its bytes are unread.
func TestAliveProbe(t *testing.T) {
	const poll = 40 * time.Millisecond
	for _, network := range []string{"tcp", "unix"} {
		t.Run(network, func(t *testing.T) {
			a, b := connPair(t, network)
			p := probePeer(t, a, poll)
			aliveFor(t, p, 3*poll, "live, nothing unread")
			if _, err := b.Write([]byte("unread bytes")); err != nil {
				t.Fatal(err)
			}
			aliveFor(t, p, 3*poll, "live, bytes unread")

			a, b = connPair(t, network)
			p = probePeer(t, a, poll)
			b.Close()
			time.Sleep(10 * time.Millisecond)
			if ok, err := p.alive(); ok {
				t.Errorf("closed with nothing unread: alive() says alive; want dead at once")
			} else if err == nil {
				t.Errorf("closed with nothing unread: dead without an error")
			}

			a, b = connPair(t, network)
			p = probePeer(t, a, poll)
			b.Write([]byte("last words"))
			b.Close()
			if err := deadWithin(t, p, 10*poll, "wrote, then closed"); err == nil || !strings.Contains(err.Error(), "10 bytes left unread") {
				t.Errorf("wrote, then closed: %v; want the unread bytes counted", err)
			}

			a, b = connPair(t, network)
			p = probePeer(t, a, poll)
			a.Write([]byte("never read")) // b closes with these unread: a reset
			b.Write([]byte("last words"))
			time.Sleep(10 * time.Millisecond)
			b.Close()
			deadWithin(t, p, 10*poll, "wrote, then closed with bytes unread (reset)")
		})
	}
}

// TestAliveProbePeerExits: a peer process that writes to its Unix socket and exits
// without anyone reading is dead within about a PollInterval.
func TestAliveProbePeerExits(t *testing.T) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "mine"), os.NewFile(uintptr(fds[1]), "theirs")
	c, err := net.FileConn(mine)
	mine.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cmd := exec.Command("/bin/sh", "-c", "printf 'last words' >&3")
	cmd.ExtraFiles = []*os.File{theirs}
	err = cmd.Run()
	theirs.Close()
	if err != nil {
		t.Skipf("no child process: %v", err)
	}
	const poll = 40 * time.Millisecond
	p := probePeer(t, c, poll)
	if err := deadWithin(t, p, 10*poll, "child wrote and exited"); err == nil {
		t.Errorf("child wrote and exited: dead without an error")
	}
}
