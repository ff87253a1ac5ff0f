//go:build linux

// Package testbed makes a cluster of hosts on one Linux machine: each host is a network
// namespace with its own address, and the hosts are joined by a bridge that lives in a
// namespace of its own, so nothing outside the namespaces the testbed creates is touched.
// Links can be shaped to a rate (tbf) and delayed (netem, where the kernel has it), and a
// host's link can be cut and restored while a job runs.
//
// Hosts share the machine's hostname, boot id and file systems, as containers on one node
// do; only the network differs. That is the case in which "same hostname" is not "same
// host", which the launchers and backends must get right.
//
// It needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2's ip and tc. cmd/testbed is
// the command-line front end; the multi-host tests use this package directly.
package testbed

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
)

// Options describe the cluster. The zero value of each field means its default.
type Options struct {
	// Hosts is the number of hosts (default 2, at most 250).
	Hosts int
	// Rate shapes every host's link, both directions, to this rate in tc's syntax ("1gbit",
	// "10gbit", "25gbit"); empty means unshaped.
	Rate string
	// Delay adds this one-way delay to every host's egress in tc's syntax ("1ms"); it needs
	// the kernel's sch_netem.
	Delay string
	// Subnet is the third octet of the hosts' addresses 10.98.<Subnet>.<host+1>/24 (default:
	// from the process id, so that concurrent testbeds do not share one).
	Subnet int
	// Name prefixes the namespaces' names (default "tb<pid>-<seq>").
	Name string
}

// Testbed is a running cluster; Close removes it.
type Testbed struct {
	opts   Options
	hub    string
	hosts  []string // namespace names
	netem  bool
	closed sync.Once
	err    error
}

var seq atomic.Int64

// ErrUnavailable wraps the reason a testbed cannot be made on this machine (not root, no ip
// command, no namespaces).
var ErrUnavailable = errors.New("testbed: unavailable")

// New creates the namespaces, the bridge and the links. On error nothing is left behind.
func New(opts Options) (*Testbed, error) {
	if opts.Hosts == 0 {
		opts.Hosts = 2
	}
	if opts.Hosts < 1 || opts.Hosts > 250 {
		return nil, fmt.Errorf("testbed: %d hosts: want 1 to 250", opts.Hosts)
	}
	n := seq.Add(1)
	if opts.Subnet == 0 {
		opts.Subnet = 1 + int((int64(os.Getpid())*7+n)%250)
	}
	if opts.Subnet < 1 || opts.Subnet > 254 {
		return nil, fmt.Errorf("testbed: subnet %d: want 1 to 254", opts.Subnet)
	}
	if opts.Name == "" {
		opts.Name = fmt.Sprintf("tb%d-%d", os.Getpid(), n)
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return nil, fmt.Errorf("%w: no ip command (install iproute2)", ErrUnavailable)
	}
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("%w: network namespaces need root", ErrUnavailable)
	}
	tb := &Testbed{opts: opts, hub: opts.Name + "-sw"}
	if err := run("ip", "netns", "add", tb.hub); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if err := tb.build(); err != nil {
		return nil, errors.Join(err, tb.Close())
	}
	return tb, nil
}

func (tb *Testbed) build() error {
	steps := [][]string{
		{"-n", tb.hub, "link", "set", "lo", "up"},
		{"-n", tb.hub, "link", "add", "br0", "type", "bridge"},
		{"-n", tb.hub, "link", "set", "br0", "up"},
	}
	for _, s := range steps {
		if err := run("ip", s...); err != nil {
			return err
		}
	}
	for h := range tb.opts.Hosts {
		ns := fmt.Sprintf("%s-h%d", tb.opts.Name, h)
		if err := run("ip", "netns", "add", ns); err != nil {
			return err
		}
		tb.hosts = append(tb.hosts, ns)
		steps := [][]string{
			{"-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", tb.port(h), "netns", tb.hub},
			{"-n", ns, "link", "set", "lo", "up"},
			{"-n", ns, "addr", "add", tb.Addr(h) + "/24", "dev", "eth0"},
			{"-n", ns, "link", "set", "eth0", "up"},
			{"-n", tb.hub, "link", "set", tb.port(h), "master", "br0"},
			{"-n", tb.hub, "link", "set", tb.port(h), "up"},
		}
		for _, s := range steps {
			if err := run("ip", s...); err != nil {
				return err
			}
		}
		if err := tb.shape(h); err != nil {
			return err
		}
	}
	return nil
}

// shape puts the rate limit on both ends of host h's link (the host's egress, and the
// bridge port's egress, which is the host's ingress) and the delay on the host's egress.
func (tb *Testbed) shape(h int) error {
	if tb.opts.Delay != "" {
		args := []string{"-n", tb.hosts[h], "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "netem", "delay", tb.opts.Delay}
		if err := run("tc", args...); err != nil {
			return fmt.Errorf("testbed: netem delay %s: this kernel has no sch_netem (%v); run without a delay", tb.opts.Delay, err)
		}
		tb.netem = true
	}
	if tb.opts.Rate == "" {
		return nil
	}
	bps, err := ParseRate(tb.opts.Rate)
	if err != nil {
		return err
	}
	// The bucket must hold a whole GSO segment (64 KiB) and about a millisecond at the rate,
	// or tbf itself becomes the bottleneck at high rates.
	burst := strconv.FormatInt(max(bps/8/1000, 256<<10), 10)
	tbf := func(ns, dev, parent string) error {
		args := []string{"-n", ns, "qdisc", "add", "dev", dev}
		if parent == "" {
			args = append(args, "root")
		} else {
			args = append(args, "parent", parent)
		}
		args = append(args, "tbf", "rate", tb.opts.Rate, "burst", burst, "latency", "20ms")
		return run("tc", args...)
	}
	parent := ""
	if tb.netem {
		parent = "1:"
	}
	if err := tbf(tb.hosts[h], "eth0", parent); err != nil {
		return err
	}
	return tbf(tb.hub, tb.port(h), "")
}

// ParseRate reads a rate in tc's syntax ("1gbit", "500mbit", "25Gbit") as bits per second.
func ParseRate(s string) (int64, error) {
	t := strings.ToLower(strings.TrimSpace(s))
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		m      int64
	}{{"gbit", 1e9}, {"mbit", 1e6}, {"kbit", 1e3}, {"bit", 1}} {
		if v, ok := strings.CutSuffix(t, u.suffix); ok {
			t, mult = v, u.m
			break
		}
	}
	f, err := strconv.ParseFloat(t, 64)
	if err != nil || f <= 0 {
		return 0, fmt.Errorf("testbed: rate %q: want a number with gbit, mbit, kbit or bit", s)
	}
	return int64(f * float64(mult)), nil
}

func (tb *Testbed) port(h int) string { return fmt.Sprintf("p%d", h) }

// Hosts is the number of hosts.
func (tb *Testbed) Hosts() int { return len(tb.hosts) }

// Addr is host h's address.
func (tb *Testbed) Addr(h int) string { return fmt.Sprintf("10.98.%d.%d", tb.opts.Subnet, h+1) }

// Command returns a command that runs name with args on host h. Its environment is this
// process's plus TESTBED_HOST (h), TESTBED_HOSTS, TESTBED_ADDR (h's address) and
// TESTBED_MASTER (host 0's address).
func (tb *Testbed) Command(ctx context.Context, h int, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", tb.hosts[h], name}, args...)...)
	cmd.Env = append(os.Environ(), tb.Env(h)...)
	return cmd
}

// Env is the TESTBED_* variables of host h.
func (tb *Testbed) Env(h int) []string {
	return []string{
		"TESTBED_HOST=" + strconv.Itoa(h),
		"TESTBED_HOSTS=" + strconv.Itoa(len(tb.hosts)),
		"TESTBED_ADDR=" + tb.Addr(h),
		"TESTBED_MASTER=" + tb.Addr(0),
	}
}

// SetLink takes host h's link down (up=false) or brings it back up: with it down, packets
// to and from the host are dropped, as when a cable is pulled.
func (tb *Testbed) SetLink(h int, up bool) error {
	state := "down"
	if up {
		state = "up"
	}
	return run("ip", "-n", tb.hub, "link", "set", tb.port(h), state)
}

// Close deletes every namespace the testbed made (which deletes their links and qdiscs).
// It is safe to call more than once.
func (tb *Testbed) Close() error {
	tb.closed.Do(func() {
		var errs []error
		for _, ns := range append(append([]string(nil), tb.hosts...), tb.hub) {
			if err := run("ip", "netns", "del", ns); err != nil {
				errs = append(errs, err)
			}
		}
		tb.err = errors.Join(errs...)
	})
	return tb.err
}

// NetemAvailable reports whether this kernel can delay packets with netem, and if not why:
// it tries on a throwaway namespace's loopback.
func NetemAvailable() (bool, string) {
	ns := fmt.Sprintf("tbprobe%d-%d", os.Getpid(), seq.Add(1))
	if err := run("ip", "netns", "add", ns); err != nil {
		return false, err.Error()
	}
	defer run("ip", "netns", "del", ns)
	if err := run("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"); err != nil {
		return false, err.Error()
	}
	return true, ""
}

func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
