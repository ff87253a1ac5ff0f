package procgroup

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"time"
)

// ConnectTimeoutEnv names the variable that bounds each step of a group's set-up: reaching
// the rendezvous store, waiting for a peer's address, each dial and each handshake. Its
// value is a Go duration ("90s", "5m").
const ConnectTimeoutEnv = "GODDP_CONNECT_TIMEOUT"

// DefaultConnectTimeout is the set-up bound when GODDP_CONNECT_TIMEOUT is not set. Five
// minutes, like ddprun's --rdzv_timeout: the ranks of a multi-node job start when their
// nodes' launchers do, which on a busy cluster can be minutes apart, and a rank that waits
// says so every ConnectWarnInterval meanwhile. It is far below PyTorch's 30-minute init
// timeout, which is what leaves a mis-addressed job silent for half an hour.
const DefaultConnectTimeout = 5 * time.Minute

// ConnectWarnInterval is how often a rank that waits during set-up logs what it waits for.
const ConnectWarnInterval = 10 * time.Second

// ConnectTimeoutFrom reads GODDP_CONNECT_TIMEOUT through lookup (nil: os.LookupEnv); unset
// means DefaultConnectTimeout.
func ConnectTimeoutFrom(lookup func(string) (string, bool)) (time.Duration, error) {
	if lookup == nil {
		lookup = os.LookupEnv
	}
	v, ok := lookup(ConnectTimeoutEnv)
	if !ok || strings.TrimSpace(v) == "" {
		return DefaultConnectTimeout, nil
	}
	d, err := time.ParseDuration(strings.TrimSpace(v))
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("%w: %s=%q: want a positive duration such as 90s or 5m", ErrInvalidArgument, ConnectTimeoutEnv, v)
	}
	return d, nil
}

// ErrConnectTimeout is wrapped by the errors of set-up steps that ran out of their bound.
var ErrConnectTimeout = errors.New("set-up timed out")

// BoundedWait runs one set-up wait: ctx bounded by timeout, and every interval (or
// ConnectWarnInterval when interval is 0, at most a third of timeout) a call of warn with
// the time waited so far. Call done when the wait ends; it stops the warnings and waits for
// a warn in progress.
func BoundedWait(ctx context.Context, timeout, interval time.Duration, warn func(waited time.Duration)) (wctx context.Context, done func()) {
	if interval <= 0 {
		interval = min(ConnectWarnInterval, max(timeout/3, 100*time.Millisecond))
	}
	wctx, cancel := context.WithTimeout(ctx, timeout)
	start := time.Now()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				warn(time.Since(start).Round(time.Millisecond))
			case <-stop:
				return
			case <-wctx.Done():
				return
			}
		}
	}()
	var once sync.Once
	return wctx, func() {
		once.Do(func() {
			close(stop)
			wg.Wait()
			cancel()
		})
	}
}

// TimedOut reports whether a wait under wctx (from BoundedWait) ended by its own bound
// rather than by the caller's ctx.
//
// The bound counts as reached once its deadline has passed, even if wctx's timer has not
// fired yet: a gRPC call carries the deadline to the server, which can end the call (and the
// client report DeadlineExceeded) before the client's own timer runs on a loaded machine.
func TimedOut(ctx, wctx context.Context) bool {
	if ctx.Err() != nil {
		return false
	}
	if errors.Is(wctx.Err(), context.DeadlineExceeded) {
		return true
	}
	d, ok := wctx.Deadline()
	if !ok || time.Now().Before(d) {
		return false
	}
	pd, parentBound := ctx.Deadline()
	return !parentBound || pd.After(d) // the deadline passed is wctx's own, not the caller's
}

// LastError is a concurrency-safe holder of the latest error of a retried step, for the
// warnings of a BoundedWait.
type LastError struct {
	mu  sync.Mutex
	err error
}

// Set records err.
func (l *LastError) Set(err error) {
	l.mu.Lock()
	l.err = err
	l.mu.Unlock()
}

// String is the latest error's text, or "none".
func (l *LastError) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err == nil {
		return "none"
	}
	return l.err.Error()
}

// SocketIfnameEnvs are the variables that name the network interface whose address a
// backend listens on and publishes, in the order they are read (GLOO_SOCKET_IFNAME is
// PyTorch's name for the same thing).
var SocketIfnameEnvs = []string{"GODDP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}

// ListenAddr is the address a rank's data plane listens on and publishes, and why it was
// chosen.
type ListenAddr struct {
	IP     net.IP
	Reason string
}

// ChooseListenAddr picks the address this rank's peers reach it at, as PyTorch users
// expect:
//   - the first IPv4 (else IPv6) address of the interface GODDP_SOCKET_IFNAME names, or
//     GLOO_SOCKET_IFNAME (an interface that does not exist or has no address is an error);
//   - otherwise the local address of this host's route to the rendezvous store at storeAddr
//     ("host:port"; a loopback store gives 127.0.0.1): the interface through which this
//     host reaches the store is, in every ordinary cluster, the one its peers reach it by;
//   - otherwise the first non-loopback address the hostname resolves to;
//   - otherwise 127.0.0.1.
//
// lookup reads the environment (nil: os.LookupEnv).
func ChooseListenAddr(lookup func(string) (string, bool), storeAddr string) (ListenAddr, error) {
	if lookup == nil {
		lookup = os.LookupEnv
	}
	for _, name := range SocketIfnameEnvs {
		v, ok := lookup(name)
		if !ok || strings.TrimSpace(v) == "" {
			continue
		}
		ifname := strings.TrimSpace(strings.Split(v, ",")[0]) // gloo takes a list; one is used here
		ip, err := interfaceIP(ifname)
		if err != nil {
			return ListenAddr{}, fmt.Errorf("%w: %s=%s: %v", ErrInvalidArgument, name, v, err)
		}
		return ListenAddr{IP: ip, Reason: fmt.Sprintf("%s=%s", name, ifname)}, nil
	}
	if storeAddr != "" {
		host, port, err := net.SplitHostPort(storeAddr)
		if err == nil {
			if isLoopback(host) {
				return ListenAddr{IP: net.IPv4(127, 0, 0, 1), Reason: "the rendezvous store " + storeAddr + " is on loopback"}, nil
			}
			if ip, err := routeIP(host, port); err == nil {
				return ListenAddr{IP: ip, Reason: "the local address of the route to the rendezvous store " + storeAddr}, nil
			}
		}
	}
	if h, err := os.Hostname(); err == nil {
		if ips, err := net.LookupIP(h); err == nil {
			for _, ip := range ips {
				if !ip.IsLoopback() {
					return ListenAddr{IP: ip, Reason: "the hostname " + h + " resolves to it"}, nil
				}
			}
		}
	}
	return ListenAddr{IP: net.IPv4(127, 0, 0, 1), Reason: "no interface named, no route to the store, and the hostname resolves to no other address"}, nil
}

// routeIP is the source address of the route to host: a UDP "connection" sends nothing but
// makes the kernel pick the route.
func routeIP(host, port string) (net.IP, error) {
	addrs, err := net.LookupIP(host)
	if err != nil {
		return nil, err
	}
	var lastErr error
	for _, a := range addrs {
		c, err := net.Dial("udp", net.JoinHostPort(a.String(), port))
		if err != nil {
			lastErr = err
			continue
		}
		ip := c.LocalAddr().(*net.UDPAddr).IP
		c.Close()
		return ip, nil
	}
	if lastErr == nil {
		lastErr = fmt.Errorf("%s has no address", host)
	}
	return nil, lastErr
}

func interfaceIP(name string) (net.IP, error) {
	ifc, err := net.InterfaceByName(name)
	if err != nil {
		var names []string
		if all, err := net.Interfaces(); err == nil {
			for _, i := range all {
				names = append(names, i.Name)
			}
		}
		return nil, fmt.Errorf("no interface %q on this host (it has: %s)", name, strings.Join(names, ", "))
	}
	addrs, err := ifc.Addrs()
	if err != nil {
		return nil, fmt.Errorf("interface %s: %v", name, err)
	}
	var v6 net.IP
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok || ipn.IP.IsLinkLocalUnicast() {
			continue
		}
		if ip4 := ipn.IP.To4(); ip4 != nil {
			return ip4, nil
		}
		if v6 == nil {
			v6 = ipn.IP
		}
	}
	if v6 != nil {
		return v6, nil
	}
	return nil, fmt.Errorf("interface %s has no usable address", name)
}

// HostIdentity is a string that two processes share exactly when they run on one kernel
// (the boot id) in one network namespace (its inode): then Unix sockets in the abstract
// namespace and file descriptors passed over them connect them. A hostname is never enough:
// containers, and the network namespaces of a testbed, share one while their networks differ.
func HostIdentity() string {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	id := strings.TrimSpace(string(boot))
	if err != nil || id == "" {
		// No boot id (not Linux): nothing true to compare, so share nothing.
		id = fmt.Sprintf("pid-%d-%d", os.Getpid(), time.Now().UnixNano())
	}
	ns, err := os.Readlink("/proc/self/ns/net")
	if err != nil {
		ns = "net:?"
	}
	return id + "/" + ns
}
