//go:build linux

package main

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestListeners: a TCP and a Unix listener of this process are found in /proc with the
// addresses they were given; once closed, they are not.
func TestListeners(t *testing.T) {
	tl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	abstract := fmt.Sprintf("@fault-soak-test-%d", os.Getpid())
	ul, err := net.Listen("unix", abstract)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "sock")
	pl, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"tcp:" + tl.Addr().String(), "unix:" + abstract, "unix:" + path}
	found := func() []string {
		ls, err := listeners(os.Getpid())
		if err != nil {
			t.Fatal(err)
		}
		var s []string
		for _, l := range ls {
			s = append(s, l.String())
		}
		return s
	}
	got := found()
	for _, w := range want {
		if !slices.Contains(got, w) {
			t.Errorf("listeners(self) = %v, lacks %s", got, w)
		}
	}
	tl.Close()
	ul.Close()
	pl.Close()
	got = found()
	for _, w := range want {
		if slices.Contains(got, w) {
			t.Errorf("listeners(self) = %v after closing %s", got, w)
		}
	}
}

// TestUsageOf: the descriptor count follows files opened and closed.
func TestUsageOf(t *testing.T) {
	before, err := usageOf(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if before.rssKB <= 0 || before.fds < 3 {
		t.Fatalf("usageOf(self) = %+v", before)
	}
	var files []*os.File
	for range 7 {
		f, err := os.Open(os.Args[0])
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	during, err := usageOf(os.Getpid())
	for _, f := range files {
		f.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	if during.fds != before.fds+7 {
		t.Errorf("fds %d with 7 more files open, %d before", during.fds, before.fds)
	}
}

// TestSchedule: each block of len(kinds) faults holds every kind once.
func TestSchedule(t *testing.T) {
	s := schedule{rng: rand.New(rand.NewPCG(1, 2)), kinds: allFaults}
	orders := map[string]bool{}
	for range 20 {
		var block []string
		for range allFaults {
			block = append(block, s.next())
		}
		orders[strings.Join(block, ",")] = true
		slices.Sort(block)
		if want := slices.Sorted(slices.Values(allFaults)); !slices.Equal(block, want) {
			t.Fatalf("a block of faults %v, want each of %v once", block, want)
		}
	}
	if len(orders) < 2 {
		t.Errorf("20 blocks all in the order %v: not shuffled", orders)
	}
}

func TestParseFlags(t *testing.T) {
	if s, err := parseSpan("gap", "30s-90s"); err != nil || s != (span{30 * time.Second, 90 * time.Second}) {
		t.Errorf("parseSpan(30s-90s) = %v, %v", s, err)
	}
	for _, bad := range []string{"90s-30s", "0s-1s", "x", "1s-"} {
		if _, err := parseSpan("gap", bad); err == nil || !strings.Contains(err.Error(), "--gap") {
			t.Errorf("parseSpan(%q): %v, want an error naming --gap", bad, err)
		}
	}
	if k, err := parseFaults("kill,stop,kill"); err != nil || !slices.Equal(k, []string{"kill", "stop"}) {
		t.Errorf("parseFaults(kill,stop,kill) = %v, %v", k, err)
	}
	if _, err := parseFaults("kill,reboot"); err == nil || !strings.Contains(err.Error(), `"reboot"`) {
		t.Errorf("parseFaults(kill,reboot): %v, want an error naming it", err)
	}
	var out, errs strings.Builder
	if code := run([]string{"--gap", "9s-1s", "--", "true"}, &out, &errs); code != 2 || !strings.Contains(errs.String(), "--gap") {
		t.Errorf("run --gap 9s-1s: exit %d, %q; want 2 naming --gap", code, errs.String())
	}
	if code := run([]string{"--", "true", "--checkpoint_dir", "x"}, &out, &errs); code != 2 || !strings.Contains(errs.String(), "--checkpoint_dir") {
		t.Errorf("run with the trainer's --checkpoint_dir: exit %d, %q; want 2 naming it", code, errs.String())
	}
}

// TestObserve: what a round learns from its launchers' lines.
func TestObserve(t *testing.T) {
	r := &round{name: "r", lastStep: -1, crc: map[int]string{}, done: make(chan struct{})}
	t0 := time.Now()
	for i, l := range []string{
		"[rank0]: step 50 loss 1.000000",
		"[rank1]: step 99 loss 1.0", // not rank 0
		"ddprun: restarting the group (restart 1 of 1000)",
		"[rank0]: step 100 loss 0.900000  12.5 ms/step",
		"[rank0]: gloo: refused a connection from 127.0.0.1:5555: bad magic",
		"[rank0]: params_crc32=0badf00d",
		"[rank1]: params_crc32=0badf00d",
	} {
		r.observe(0, l, t0.Add(time.Duration(i)*time.Second))
	}
	r.observe(1, "ddprun: restarting the group (restart 2 of 1000)", t0) // node 1 does not count
	p := r.progress()
	if p.lastStep != 100 || p.steps != 2 || p.restarts != 1 || p.refusals != 1 || !p.restartAt.Equal(t0.Add(2*time.Second)) {
		t.Errorf("progress %+v", p)
	}
	if crc, err := r.agreedCRC(2); err != nil || crc != "0badf00d" {
		t.Errorf("agreedCRC(2) = %q, %v", crc, err)
	}
	if _, err := r.agreedCRC(3); err == nil {
		t.Error("agreedCRC(3) with two ranks' lines: no error")
	}
	r.observe(0, "[rank1]: params_crc32=12345678", t0)
	if _, err := r.agreedCRC(2); err == nil {
		t.Error("agreedCRC(2) with ranks at different crcs: no error")
	}
}

// TestDialInKeepsLaunchers: dialling into another network namespace must not end a
// thread of this process. The launchers are started with Pdeathsig, which the kernel
// sends when the thread that forked them ends: children forked from eight threads, then
// forty dials into a namespace, and every child must still be alive.
func TestDialInKeepsLaunchers(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: setns into a network namespace")
	}
	for _, c := range []string{"ip", "python3", "sleep"} {
		if _, err := exec.LookPath(c); err != nil {
			t.Skipf("needs %s: %v", c, err)
		}
	}
	ns := fmt.Sprintf("fsoak%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		t.Skipf("ip netns add: %v: %s", err, out)
	}
	defer exec.Command("ip", "netns", "del", ns).Run()
	exec.Command("ip", "-n", ns, "link", "set", "lo", "up").Run()
	// A listener in the namespace: it accepts and closes every connection.
	srv := exec.Command("ip", "netns", "exec", ns, "python3", "-c", `
import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(64)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.close()
`)
	stdout, err := srv.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { srv.Process.Kill(); srv.Wait() }()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	port := strings.TrimSpace(line)

	var kids []*exec.Cmd
	var mu sync.Mutex
	var forked, release sync.WaitGroup
	release.Add(1)
	for range 8 {
		forked.Add(1)
		go func() {
			runtime.LockOSThread() // eight threads at once: each fork is another thread's
			defer runtime.UnlockOSThread()
			c := exec.Command("sleep", "60")
			c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			err := c.Start()
			mu.Lock()
			if err == nil {
				kids = append(kids, c)
			}
			mu.Unlock()
			forked.Done()
			release.Wait()
		}()
	}
	forked.Wait()
	release.Done()
	defer func() {
		for _, c := range kids {
			c.Process.Kill()
			c.Wait()
		}
	}()
	if len(kids) != 8 {
		t.Fatalf("started %d of 8 children", len(kids))
	}
	l := listener{network: "tcp", addr: "127.0.0.1:" + port, pid: srv.Process.Pid}
	for i := range 40 {
		if res := stranger(l, time.Second); res.err != nil || !res.closed {
			t.Fatalf("stranger %d at %v in namespace %s: sent %d, closed %v, %v", i, l, ns, res.sent, res.closed, res.err)
		}
	}
	time.Sleep(100 * time.Millisecond) // a Pdeathsig is delivered at once; give it a moment
	for _, c := range kids {
		if _, state, _, err := statOf(c.Process.Pid); err != nil || state == 'Z' {
			t.Errorf("child %d (forked with Pdeathsig) died during the dials: state %c, %v", c.Process.Pid, state, err)
		}
	}
}

// TestSoakMLP runs the soak as a user does, on this host (no testbed), briefly and with
// faults every second or two, over examples/mlp: with restarts to spare every fault is
// recovered from and every round ends at the uninterrupted run's crc; with one restart
// only, the second kill of a round is not, and the soak says so and exits 1.
func TestSoakMLP(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds ddprun and examples/mlp and runs them for half a minute")
	}
	bin := t.TempDir()
	build := exec.Command("go", "build", "-o", bin+"/", "../ddprun", "../../examples/mlp")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	mlp := []string{filepath.Join(bin, "mlp"), "--hidden_size", "16", "--global_batch_size", "16", "--micro_batch_size", "4",
		"--steps", "15000", "--log_every", "100", "--checkpoint_every", "50"}
	soak := func(restarts, faults string) (int, string) {
		var out, errs strings.Builder
		args := append([]string{"--testbed", "off", "--duration", "6s", "--gap", "1s-2s", "--stop_for", "100ms-300ms",
			"--faults", faults, "--max_restarts", restarts, "--sample_every", "500ms", "--seed", "7",
			"--out", t.TempDir(), "--ddprun", filepath.Join(bin, "ddprun"), "--"}, mlp...)
		code := run(args, &out, &errs)
		return code, out.String() + errs.String()
	}
	code, out := soak("100", "kill,stop,stranger")
	if code != 0 || !strings.Contains(out, "**PASSED**") {
		t.Fatalf("soak: exit %d, want 0 and PASSED:\n%s", code, out)
	}
	for _, want := range []string{"| kill -9 of a rank | ", "| round 1 | ", "| rank 3 | "} {
		if !strings.Contains(out, want) {
			t.Errorf("the report lacks %q:\n%s", want, out)
		}
	}
	code, out = soak("1", "kill")
	if code != 1 || !strings.Contains(out, "**FAILED**") {
		t.Fatalf("soak with --max_restarts 1 and kills: exit %d, want 1 and FAILED:\n%s", code, out)
	}
	t.Logf("with one restart: %s", firstLine(out, "**FAILED**"))
}

func firstLine(out, s string) string {
	for l := range strings.Lines(out) {
		if strings.Contains(l, s) {
			return strings.TrimSpace(l)
		}
	}
	return ""
}
