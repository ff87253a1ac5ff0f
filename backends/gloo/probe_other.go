//go:build !linux

package gloo

import (
	"errors"
	"syscall"
)

// probeConn is alive's look at socket fd, consuming nothing: a peek of one byte. A peer
// that closed its end with bytes still unread is taken for live here (gone is only
// reported when nothing is left to read); Linux looks at POLLRDHUP (probe_linux.go).
func probeConn(fd int) (gone bool, unread int, err error) {
	var b [1]byte
	n, _, err := syscall.Recvfrom(fd, b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
	switch {
	case err == syscall.EAGAIN || err == syscall.EINTR:
		return false, 0, nil
	case err != nil:
		return true, 0, err
	case n == 0:
		return true, 0, errors.New("connection closed by peer")
	}
	return false, 0, nil
}
