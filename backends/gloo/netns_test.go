//go:build linux

package gloo

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/goddp/goddp/procgroup"
)

// Network-namespace tests: each rank runs as a subprocess (this test binary, in
// TestNetnsHelper) inside a network namespace of its own, on its own address
// 10.99.X.(rank+1)/24, joined to the others by a veth pair to a bridge in a hub namespace.
// Rank 0 hosts the store on its address. Nothing is configured outside the namespaces the
// test creates, which it deletes in t.Cleanup (deleting a namespace deletes its veths).

const (
	netnsHelperEnv = "GODDP_NETNS_HELPER" // "check" or "cut": run as a rank
	netnsPort      = 29611
	netnsTimeout   = 8 * time.Second // the collective timeout in the subprocesses
)

var netnsSeq atomic.Int64

// netnsWorld is n rank namespaces and a hub, named after this process.
type netnsWorld struct {
	t      *testing.T
	n      int
	subnet int
	hub    string
	ranks  []string
}

func (w *netnsWorld) ip(rank int) string { return fmt.Sprintf("10.99.%d.%d", w.subnet, rank+1) }

func ipCmd(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// newNetnsWorld creates the namespaces, or skips the test when it cannot.
func newNetnsWorld(t *testing.T, n int) *netnsWorld {
	t.Helper()
	if testing.Short() {
		t.Skip("network namespaces: skipped with -short")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("network namespaces: no ip command (install iproute2)")
	}
	id := fmt.Sprintf("gd%d-%d", os.Getpid(), netnsSeq.Add(1))
	w := &netnsWorld{t: t, n: n, subnet: int(netnsSeq.Load() % 250), hub: id + "-hub"}
	if err := ipCmd("netns", "add", w.hub); err != nil {
		t.Skipf("network namespaces unavailable (needs root and CAP_SYS_ADMIN): %v", err)
	}
	t.Cleanup(func() {
		for _, ns := range append(w.ranks, w.hub) {
			if err := ipCmd("netns", "del", ns); err != nil {
				t.Errorf("cleanup: %v", err)
			}
		}
	})
	must := func(args ...string) {
		t.Helper()
		if err := ipCmd(args...); err != nil {
			t.Fatal(err)
		}
	}
	must("-n", w.hub, "link", "set", "lo", "up")
	must("-n", w.hub, "link", "add", "br0", "type", "bridge")
	must("-n", w.hub, "link", "set", "br0", "up")
	for r := range n {
		ns := fmt.Sprintf("%s-r%d", id, r)
		must("netns", "add", ns)
		w.ranks = append(w.ranks, ns)
		veth, port := fmt.Sprintf("v%d", r), fmt.Sprintf("h%d", r)
		must("-n", ns, "link", "add", veth, "type", "veth", "peer", "name", port, "netns", w.hub)
		must("-n", ns, "link", "set", "lo", "up")
		must("-n", ns, "addr", "add", w.ip(r)+"/24", "dev", veth)
		must("-n", ns, "link", "set", veth, "up")
		must("-n", w.hub, "link", "set", port, "master", "br0")
		must("-n", w.hub, "link", "set", port, "up")
	}
	return w
}

// rankProc is one rank's subprocess and the lines it printed.
type rankProc struct {
	cmd   *exec.Cmd
	lines chan string // closed at EOF
	tail  []string    // every line, for failure messages (after lines is drained)
	mu    sync.Mutex
}

// start runs every rank in mode, and returns them; ctx bounds their life.
func (w *netnsWorld) start(ctx context.Context, mode string, extraEnv ...string) []*rankProc {
	w.t.Helper()
	procs := make([]*rankProc, w.n)
	for r := range w.n {
		cmd := exec.CommandContext(ctx, "ip", "netns", "exec", w.ranks[r], os.Args[0], "-test.run=^TestNetnsHelper$", "-test.v")
		cmd.Env = append(os.Environ(),
			netnsHelperEnv+"="+mode,
			"RANK="+strconv.Itoa(r), "WORLD_SIZE="+strconv.Itoa(w.n),
			"MASTER_ADDR="+w.ip(0), "MASTER_PORT="+strconv.Itoa(netnsPort),
			"GODDP_TOKEN=netns-test-token", "GODDP_NETNS_IP="+w.ip(r), "GODDP_NETNS_HOST="+w.ranks[r])
		cmd.Env = append(cmd.Env, extraEnv...)
		cmd.WaitDelay = time.Second
		out, err := cmd.StdoutPipe()
		if err != nil {
			w.t.Fatal(err)
		}
		cmd.Stderr = cmd.Stdout
		p := &rankProc{cmd: cmd, lines: make(chan string, 1024)}
		if err := cmd.Start(); err != nil {
			w.t.Fatal(err)
		}
		go func() {
			defer close(p.lines)
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				p.mu.Lock()
				p.tail = append(p.tail, sc.Text())
				p.mu.Unlock()
				select {
				case p.lines <- sc.Text():
				default: // nobody reads the lines any more: tail keeps them
				}
			}
		}()
		procs[r] = p
	}
	return procs
}

// await returns the first line of p with prefix, or fails the test when p's output ends.
func (p *rankProc) await(t *testing.T, r int, prefix string) string {
	t.Helper()
	for l := range p.lines {
		if strings.HasPrefix(l, prefix) {
			return l
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	t.Fatalf("rank %d ended without %q; its output:\n%s", r, prefix, strings.Join(p.tail, "\n"))
	return ""
}

// wait waits for p and fails the test if it failed.
func (p *rankProc) wait(t *testing.T, r int) {
	t.Helper()
	for range p.lines {
	}
	if err := p.cmd.Wait(); err != nil {
		p.mu.Lock()
		defer p.mu.Unlock()
		t.Errorf("rank %d: %v; its output:\n%s", r, err, strings.Join(p.tail, "\n"))
	}
}

// TestNetnsDelayLoss: three ranks on separate "hosts" whose links add 5 ms of delay and
// lose 1% of packets (tc netem; on a kernel without netem, a 20 Mbit/s token bucket);
// mixed collectives stay exactly correct.
func TestNetnsDelayLoss(t *testing.T) {
	w := newNetnsWorld(t, 3)
	if _, err := exec.LookPath("tc"); err != nil {
		t.Skip("no tc command (install iproute2)")
	}
	for r, ns := range w.ranks {
		tc := func(q ...string) ([]byte, error) {
			args := append([]string{"netns", "exec", ns, "tc", "qdisc", "replace", "dev", fmt.Sprintf("v%d", r), "root"}, q...)
			return exec.Command("ip", args...).CombinedOutput()
		}
		if out, err := tc("netem", "delay", "5ms", "loss", "1%"); err != nil {
			// Kernels without sch_netem: a slow link (token bucket) at least.
			t.Logf("tc netem unavailable (%v: %s); limiting the links to 20 Mbit/s with tbf instead", err, bytes.TrimSpace(out))
			if out, err := tc("tbf", "rate", "20mbit", "burst", "32kb", "latency", "50ms"); err != nil {
				t.Skipf("neither tc netem nor tbf available: %v: %s", err, out)
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Second)
	defer cancel()
	procs := w.start(ctx, "check")
	for r, p := range procs {
		l := p.await(t, r, "NETNS OK")
		t.Logf("rank %d: %s", r, l)
	}
	for r, p := range procs {
		p.wait(t, r)
	}
}

// TestNetnsLinkDown: three ranks run all-reduces in a loop; rank 2's link goes down in
// the middle. Every rank fails (before the collective timeout) with an error naming a
// peer it lost: ranks 0 and 1 name rank 2, rank 2 names one of them.
func TestNetnsLinkDown(t *testing.T) {
	w := newNetnsWorld(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Second)
	defer cancel()
	procs := w.start(ctx, "cut")
	for r, p := range procs {
		p.await(t, r, "NETNS READY")
	}
	if err := ipCmd("-n", w.hub, "link", "set", "h2", "down"); err != nil {
		t.Fatal(err)
	}
	cut := time.Now()
	for r, p := range procs {
		l := p.await(t, r, "NETNS ERR")
		t.Logf("rank %d, %v after the cut: %s", r, time.Since(cut).Round(100*time.Millisecond), l)
		want := []string{"peer rank 2 "}
		if r == 2 {
			want = []string{"peer rank 0 ", "peer rank 1 "}
		}
		named := false
		for _, s := range want {
			named = named || strings.Contains(l, s)
		}
		if !named {
			t.Errorf("rank %d's error names none of %q: %s", r, want, l)
		}
		if strings.Contains(l, procgroup.ErrTimeout.Error()) {
			t.Errorf("rank %d ran into the collective timeout instead of naming the lost peer: %s", r, l)
		}
	}
	for r, p := range procs {
		p.wait(t, r)
	}
}

// TestNetnsHelper is a rank of the tests above when GODDP_NETNS_HELPER is set.
func TestNetnsHelper(t *testing.T) {
	mode := os.Getenv(netnsHelperEnv)
	if mode == "" {
		t.Skip("runs only as a subprocess of the network-namespace tests")
	}
	if err := netnsRank(mode); err != nil {
		fmt.Println("NETNS FAIL", err)
		os.Exit(1)
	}
	if mode == "cut" {
		// The store's host may be gone: leave without the rendezvous' release.
		os.Exit(0)
	}
}

func netnsRank(mode string) error {
	env, err := procgroup.InitFromEnv()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	store, closer, err := procgroup.Rendezvous(ctx, env, nil)
	if err != nil {
		return err
	}
	pg, err := procgroup.New(ctx, "gloo", procgroup.Options{
		Rank: env.Rank, Size: env.WorldSize, Store: store, Prefix: "netns", Token: env.Token,
		Timeout: netnsTimeout,
		Backend: &Config{Transport: TransportTCP, ListenAddr: os.Getenv("GODDP_NETNS_IP"), HostID: os.Getenv("GODDP_NETNS_HOST")},
	})
	if err != nil {
		return errors.Join(err, closer.Close())
	}
	if mode == "cut" {
		return netnsCut(ctx, pg, env)
	}
	n, err := netnsCheck(pg, env)
	if err == nil {
		fmt.Println("NETNS OK", n, "collectives checked")
	}
	return errors.Join(err, pg.Close(), closer.Close())
}

// netnsInput is rank r's input of collective i: small integers, so that float sums are
// exact whatever the order of the additions.
func netnsInput(i, r, count int) []float32 {
	rng := rand.New(rand.NewPCG(uint64(i), uint64(r)))
	x := make([]float32, count)
	for k := range x {
		x[k] = float32(rng.IntN(2001) - 1000)
	}
	return x
}

func netnsCheck(pg procgroup.ProcessGroup, env procgroup.Env) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	counts := []int{1, 1000, 20000, 300000}
	n := 0
	for i := range 12 {
		count := counts[i%len(counts)]
		want := make([]float32, count)
		for r := range env.WorldSize {
			for k, v := range netnsInput(i, r, count) {
				want[k] += v
			}
		}
		buf := netnsInput(i, env.Rank, count)
		if err := pg.AllReduce(ctx, buf, procgroup.Sum).Wait(ctx); err != nil {
			return n, err
		}
		for k := range buf {
			if buf[k] != want[k] {
				return n, fmt.Errorf("allreduce #%d: element %d = %v, want %v", i, k, buf[k], want[k])
			}
		}
		n++
		// A broadcast from a rotating root and an all-gather of each rank's first value.
		root := i % env.WorldSize
		b := netnsInput(i, env.Rank, 5000)
		if err := pg.Broadcast(ctx, b, root).Wait(ctx); err != nil {
			return n, err
		}
		if ref := netnsInput(i, root, 5000); !slicesEqual(b, ref) {
			return n, fmt.Errorf("broadcast #%d from %d: wrong data", i, root)
		}
		g := make([]float32, env.WorldSize*3)
		if err := pg.AllGather(ctx, g, netnsInput(i, env.Rank, 3)).Wait(ctx); err != nil {
			return n, err
		}
		for r := range env.WorldSize {
			if !slicesEqual(g[3*r:3*r+3], netnsInput(i, r, 3)) {
				return n, fmt.Errorf("allgather #%d: rank %d's part wrong", i, r)
			}
		}
		n += 2
	}
	return n, nil
}

func slicesEqual(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// netnsCut runs all-reduces of 1 Mi floats until one fails, then prints the error.
func netnsCut(ctx context.Context, pg procgroup.ProcessGroup, env procgroup.Env) error {
	buf := netnsInput(0, env.Rank, 1<<20)
	for i := 0; ; i++ {
		start := time.Now()
		err := pg.AllReduce(ctx, buf, procgroup.Sum).Wait(ctx)
		if err != nil {
			fmt.Printf("NETNS ERR after %v in collective %d: %v\n", time.Since(start).Round(time.Millisecond), i, err)
			pg.Abort(err)
			return nil
		}
		for k := range buf {
			buf[k] = float32(k % 7) // keep the values small
		}
		if i == 0 {
			fmt.Println("NETNS READY")
		}
	}
}
