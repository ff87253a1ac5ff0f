//go:build linux

package main

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// proc is one process of the job as /proc shows it.
type proc struct {
	pid   int
	start uint64 // start time in clock ticks since boot (field 22 of stat): tells a reused pid apart
	rank  int    // RANK from its environment; -1 for a launcher
	node  int    // the testbed host (node) whose launcher started it
}

func (p proc) String() string {
	if p.rank < 0 {
		return fmt.Sprintf("ddprun node %d (pid %d)", p.node, p.pid)
	}
	return fmt.Sprintf("rank %d (pid %d)", p.rank, p.pid)
}

// statOf returns the parent pid, the state letter and the start time of pid.
func statOf(pid int) (ppid int, state byte, start uint64, err error) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, 0, 0, err
	}
	// The command name may hold spaces and parentheses: the fields start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, 0, fmt.Errorf("/proc/%d/stat: no ')' in %q", pid, b)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return 0, 0, 0, fmt.Errorf("/proc/%d/stat: %d fields after the name, want at least 20", pid, len(f))
	}
	if ppid, err = strconv.Atoi(f[1]); err != nil {
		return 0, 0, 0, fmt.Errorf("/proc/%d/stat: ppid %q", pid, f[1])
	}
	if start, err = strconv.ParseUint(f[19], 10, 64); err != nil {
		return 0, 0, 0, fmt.Errorf("/proc/%d/stat: start time %q", pid, f[19])
	}
	return ppid, f[0][0], start, nil
}

// same reports whether p is still the live process it was (its pid not exited nor reused).
func (p proc) same() bool {
	_, state, start, err := statOf(p.pid)
	return err == nil && start == p.start && state != 'Z' && state != 'X'
}

// envRank returns the RANK variable of pid's environment, or -1.
func envRank(pid int) int {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "environ"))
	if err != nil {
		return -1
	}
	for _, kv := range bytes.Split(b, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, []byte("RANK=")); ok {
			if r, err := strconv.Atoi(string(v)); err == nil {
				return r
			}
		}
	}
	return -1
}

// children returns the live children of each launcher pid (the ranks: ddprun starts the
// trainer itself), with the RANK of their environment, sorted by nothing in particular.
func children(launchers map[int]int) ([]proc, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var out []proc
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		ppid, state, start, err := statOf(pid)
		if err != nil || state == 'Z' || state == 'X' {
			continue
		}
		node, ok := launchers[ppid]
		if !ok {
			continue
		}
		if r := envRank(pid); r >= 0 {
			out = append(out, proc{pid: pid, start: start, rank: r, node: node})
		}
	}
	return out, nil
}

// usage is a process's resident memory and open file descriptors.
type usage struct {
	rssKB int64
	fds   int
}

// usageOf reads VmRSS from /proc/pid/status and counts /proc/pid/fd.
func usageOf(pid int) (usage, error) {
	var u usage
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		return u, err
	}
	found := false
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(v)
			if len(f) < 1 {
				break
			}
			if u.rssKB, err = strconv.ParseInt(f[0], 10, 64); err != nil {
				return u, fmt.Errorf("/proc/%d/status: VmRSS %q", pid, v)
			}
			found = true
		}
	}
	if !found {
		return u, fmt.Errorf("/proc/%d/status: no VmRSS", pid)
	}
	fds, err := os.ReadDir(filepath.Join("/proc", strconv.Itoa(pid), "fd"))
	if err != nil {
		return u, err
	}
	u.fds = len(fds)
	return u, nil
}

// listener is a listening socket: a TCP address or a Unix socket path ("@name" for an
// abstract one), in the network namespace of the process that holds it.
type listener struct {
	network string // "tcp" or "unix"
	addr    string // what to dial: host:port, or the path
	pid     int    // a process that holds it
}

func (l listener) String() string { return l.network + ":" + l.addr }

// socketInodes returns the inodes of the sockets among pid's open files.
func socketInodes(pid int) (map[uint64]bool, error) {
	dir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	inodes := map[uint64]bool{}
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // closed meanwhile
		}
		if s, ok := strings.CutPrefix(target, "socket:["); ok {
			if n, err := strconv.ParseUint(strings.TrimSuffix(s, "]"), 10, 64); err == nil {
				inodes[n] = true
			}
		}
	}
	return inodes, nil
}

// listeners returns the listening TCP and Unix stream sockets that pid holds, read from its
// own view of the network (/proc/pid/net, its namespace's).
func listeners(pid int) ([]listener, error) {
	inodes, err := socketInodes(pid)
	if err != nil {
		return nil, err
	}
	var out []listener
	for _, name := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "net", name))
		if err != nil {
			if os.IsNotExist(err) {
				continue // no IPv6
			}
			return nil, err
		}
		ls, err := parseTCP(b, inodes)
		if err != nil {
			return nil, fmt.Errorf("/proc/%d/net/%s: %w", pid, name, err)
		}
		out = append(out, ls...)
	}
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "net", "unix"))
	if err != nil {
		return nil, err
	}
	out = append(out, parseUnix(b, inodes)...)
	for i := range out {
		out[i].pid = pid
	}
	return out, nil
}

// parseTCP returns the sockets in LISTEN state (st 0A) of a /proc/net/tcp or tcp6 table
// whose inode is among inodes. An unspecified address (0.0.0.0, ::) is dialled on the
// loopback.
func parseTCP(table []byte, inodes map[uint64]bool) ([]listener, error) {
	var out []listener
	sc := bufio.NewScanner(bytes.NewReader(table))
	first := true
	for sc.Scan() {
		if first { // the header
			first = false
			continue
		}
		f := strings.Fields(sc.Text())
		if len(f) < 10 || f[3] != "0A" {
			continue
		}
		inode, err := strconv.ParseUint(f[9], 10, 64)
		if err != nil || !inodes[inode] {
			continue
		}
		hostHex, portHex, ok := strings.Cut(f[1], ":")
		if !ok {
			return nil, fmt.Errorf("local address %q: want HEX:PORT", f[1])
		}
		port, err := strconv.ParseUint(portHex, 16, 16)
		if err != nil {
			return nil, fmt.Errorf("local address %q: port: %v", f[1], err)
		}
		ip, err := procIP(hostHex)
		if err != nil {
			return nil, fmt.Errorf("local address %q: %v", f[1], err)
		}
		if ip.IsUnspecified() {
			ip = net.IPv4(127, 0, 0, 1)
		}
		out = append(out, listener{network: "tcp", addr: net.JoinHostPort(ip.String(), strconv.Itoa(int(port)))})
	}
	return out, sc.Err()
}

// procIP decodes an address of /proc/net/tcp{,6}: 4 or 16 bytes in hex, each 32-bit word in
// the host's (little-endian) byte order.
func procIP(h string) (net.IP, error) {
	b, err := hex.DecodeString(h)
	if err != nil || (len(b) != 4 && len(b) != 16) {
		return nil, fmt.Errorf("address %q: want 8 or 32 hex digits", h)
	}
	for i := 0; i < len(b); i += 4 {
		b[i], b[i+1], b[i+2], b[i+3] = b[i+3], b[i+2], b[i+1], b[i]
	}
	ip := net.IP(b)
	if v4 := ip.To4(); v4 != nil {
		return v4, nil
	}
	return ip, nil
}

// parseUnix returns the listening stream sockets (flag __SO_ACCEPTCON, 0x10000) of a
// /proc/net/unix table whose inode is among inodes and that have a name to dial.
func parseUnix(table []byte, inodes map[uint64]bool) []listener {
	var out []listener
	sc := bufio.NewScanner(bytes.NewReader(table))
	for sc.Scan() {
		// Num RefCount Protocol Flags Type St Inode Path
		f := strings.Fields(sc.Text())
		if len(f) < 8 {
			continue // the header (7 names + "Path" is 8, but its Flags is not hex) or unnamed
		}
		flags, err1 := strconv.ParseUint(f[3], 16, 32)
		typ, err2 := strconv.ParseUint(f[4], 16, 16)
		inode, err3 := strconv.ParseUint(f[6], 10, 64)
		if err1 != nil || err2 != nil || err3 != nil || flags&0x10000 == 0 || typ != 1 || !inodes[inode] {
			continue
		}
		out = append(out, listener{network: "unix", addr: strings.Join(f[7:], " ")})
	}
	return out
}
