//go:build linux

package gloo

import (
	"net"
	"time"

	"golang.org/x/sys/unix"
)

// setLiveness applies Note [Unreachable peers] to a TCP connection of the mesh.
func setLiveness(c *net.TCPConn, timeout time.Duration) {
	c.SetKeepAliveConfig(net.KeepAliveConfig{Enable: true, Idle: time.Second, Interval: time.Second,
		Count: max(1, int(timeout/time.Second))})
	if raw, err := c.SyscallConn(); err == nil {
		raw.Control(func(fd uintptr) {
			unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(timeout/time.Millisecond))
		})
	}
}
