//go:build !linux

package gloo

import (
	"net"
	"time"
)

// setLiveness applies Note [Unreachable peers] as far as the platform allows: keepalive
// probes only.
func setLiveness(c *net.TCPConn, timeout time.Duration) {
	c.SetKeepAliveConfig(net.KeepAliveConfig{Enable: true, Idle: time.Second, Interval: time.Second,
		Count: max(1, int(timeout/time.Second))})
}
