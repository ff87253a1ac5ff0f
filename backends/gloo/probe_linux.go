//go:build linux

package gloo

import (
	"errors"
	"syscall"

	"golang.org/x/sys/unix"
)

// probeConn is alive's look at socket fd (TCP or Unix stream), consuming nothing: gone
// when the peer has closed its end (POLLRDHUP: its FIN, or its close of a Unix socket) or
// the connection broke (POLLHUP, POLLERR: a reset); unread, the bytes still waiting to
// be read (SIOCINQ); for a gone connection with none, err is what a read would report.
// Unread bytes say nothing of the peer: a peer that wrote and then died leaves them.
func probeConn(fd int) (gone bool, unread int, err error) {
	pfd := [1]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLRDHUP}}
	if n, err := unix.Poll(pfd[:], 0); n <= 0 {
		if err != nil && err != unix.EINTR {
			return true, 0, err
		}
		return false, 0, nil // nothing to read, nothing closed
	}
	ev := pfd[0].Revents
	if ev&unix.POLLNVAL != 0 {
		return true, 0, errors.New("descriptor not open")
	}
	if ev&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) == 0 {
		return false, 0, nil // only POLLIN: bytes from a live peer
	}
	if unread, err = unix.IoctlGetInt(fd, unix.SIOCINQ); err == nil && unread > 0 {
		return true, unread, nil
	}
	// Nothing unread: a read reports the end (0) or the error (a reset).
	var b [1]byte
	n, _, err := syscall.Recvfrom(fd, b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
	switch {
	case err == nil && n > 0: // arrived since
		return true, n, nil
	case err == nil || err == syscall.EAGAIN:
		return true, 0, errors.New("connection closed by peer")
	}
	return true, 0, err
}
