//go:build linux

package main

import (
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// strangerResult is what one stranger saw at one listening socket.
type strangerResult struct {
	l      listener
	sent   int
	closed bool // the job closed the connection (it refused the stranger) within the wait
	err    error
}

// strangerBytes is how much a stranger writes: more than any frame header or handshake.
const strangerBytes = 4096

// stranger connects to l in the network namespace of the process that holds it, writes
// strangerBytes random bytes, and waits up to wait for the job to close the connection.
func stranger(l listener, wait time.Duration) strangerResult {
	res := strangerResult{l: l}
	conn, err := dialIn(l, 2*time.Second)
	if err != nil {
		res.err = err
		return res
	}
	defer conn.Close()
	junk := make([]byte, strangerBytes)
	rand.Read(junk)
	conn.SetDeadline(time.Now().Add(wait))
	res.sent, err = conn.Write(junk)
	if err != nil {
		// A reset while writing: the job closed it on the first bytes.
		res.closed = true
		return res
	}
	_, err = io.Copy(io.Discard, conn)
	var ne net.Error
	res.closed = !(errors.As(err, &ne) && ne.Timeout())
	return res
}

// dialIn dials l from the network namespace of l.pid (a testbed host's, or this one's).
func dialIn(l listener, timeout time.Duration) (net.Conn, error) {
	mine, err1 := os.Stat("/proc/self/ns/net")
	theirs, err2 := os.Stat("/proc/" + strconv.Itoa(l.pid) + "/ns/net")
	if err1 == nil && err2 == nil && os.SameFile(mine, theirs) {
		return net.DialTimeout(l.network, l.addr, timeout)
	}
	if err2 != nil {
		return nil, fmt.Errorf("the network namespace of pid %d: %w", l.pid, err2)
	}
	// The socket is made by the thread that calls socket(2), in that thread's namespace: a
	// goroutine locked to its thread moves the thread into the process's namespace, dials,
	// and moves it back before unlocking it. The thread must not end (a goroutine that exits
	// locked ends its thread): the launchers are started with Pdeathsig, which the kernel
	// sends when the thread that forked them exits, and this may be that thread. Only if it
	// cannot return to this namespace is it left to end.
	type result struct {
		c   net.Conn
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		home, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: err}
			return
		}
		defer home.Close()
		f, err := os.Open("/proc/" + strconv.Itoa(l.pid) + "/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: err}
			return
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: fmt.Errorf("setns into pid %d's network namespace: %w", l.pid, err)}
			return
		}
		c, err := net.DialTimeout(l.network, l.addr, timeout)
		if unix.Setns(int(home.Fd()), unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		}
		ch <- result{c, err}
	}()
	r := <-ch
	return r.c, r.err
}
