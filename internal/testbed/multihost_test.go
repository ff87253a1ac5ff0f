//go:build linux

package testbed

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/goddp/goddp/ddp/tracefile"
	"github.com/goddp/goddp/internal/launchtest"
)

// The multi-host tests run jobs as a user would on two machines: the testbed's hosts, the
// built ddprun and example trainer, --nnodes/--node_rank/--master_addr, and a token in the
// environment. Nothing else is configured: no backend options, no listen address, no host
// ids.

const (
	storePort = "29500"
	// tiny is the trainer's configuration in these tests: a small model, a few steps.
	tiny = "--num_layers 1 --hidden_size 16 --seq_len 8 --batch_size 2 --warmup_steps 1 --bench_steps 4 --log_every 1"
)

var (
	binOnce sync.Once
	binDir  string
	binErr  error
)

// bins builds ddprun and the example trainer once per test binary.
func bins(t *testing.T) (ddprun, trainer string) {
	t.Helper()
	binOnce.Do(func() {
		binDir, binErr = os.MkdirTemp("", "goddp-multihost-")
		if binErr != nil {
			return
		}
		gotool := filepath.Join(os.Getenv("GOROOT"), "bin", "go")
		if _, err := os.Stat(gotool); err != nil {
			gotool = "go"
		}
		for _, pkg := range []string{"github.com/goddp/goddp/cmd/ddprun", "github.com/goddp/goddp/examples/transformer"} {
			out, err := exec.Command(gotool, "build", "-o", binDir+"/", pkg).CombinedOutput()
			if err != nil {
				binErr = fmt.Errorf("go build %s: %v\n%s", pkg, err, out)
				return
			}
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return filepath.Join(binDir, "ddprun"), filepath.Join(binDir, "transformer")
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// newBed makes a testbed or skips the test where this machine cannot.
func newBed(t *testing.T, opts Options) *Testbed {
	t.Helper()
	if testing.Short() {
		t.Skip("multi-host testbed: skipped with -short")
	}
	tb, err := New(opts)
	if err != nil {
		if strings.Contains(err.Error(), ErrUnavailable.Error()) {
			t.Skipf("multi-host testbed: %v", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := tb.Close(); err != nil {
			t.Errorf("testbed teardown: %v", err)
		}
	})
	return tb
}

// syncBuf collects a process's output for reading while it runs.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// node is one host's ddprun.
type node struct {
	host int
	cmd  *exec.Cmd
	out  syncBuf
	done chan struct{}
	err  error
	took time.Duration
}

// startNode runs ddprun on host h of tb as node h of an nnodes job, with nproc ranks, the
// token, and ddpArgs/trainerArgs.
func startNode(t *testing.T, ctx context.Context, tb *Testbed, h, nproc int, env []string, ddpArgs []string, trainerArgs string) *node {
	t.Helper()
	ddprun, trainer := bins(t)
	args := append([]string{"--nnodes", strconv.Itoa(tb.Hosts()), "--node_rank", strconv.Itoa(h),
		"--nproc_per_node", strconv.Itoa(nproc), "--master_addr", tb.Addr(0), "--master_port", storePort}, ddpArgs...)
	args = append(append(args, trainer, "--"), strings.Fields(trainerArgs)...)
	cmd := tb.Command(ctx, h, ddprun, args...)
	cmd.Env = append(cmd.Env, env...)
	n := &node{host: h, cmd: cmd, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = &n.out, &n.out
	cmd.WaitDelay = 10 * time.Second
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		n.err = cmd.Wait()
		n.took = time.Since(start)
		close(n.done)
	}()
	return n
}

func (n *node) wait(t *testing.T, bound time.Duration) {
	t.Helper()
	select {
	case <-n.done:
	case <-time.After(bound):
		n.cmd.Process.Kill()
		<-n.done
		t.Fatalf("host%d: ddprun still running after %v:\n%s", n.host, bound, n.out.String())
	}
}

// waitFor waits until the node's output matches re.
func (n *node) waitFor(t *testing.T, re *regexp.Regexp, bound time.Duration) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !re.MatchString(n.out.String()) {
		select {
		case <-n.done:
			t.Fatalf("host%d: ddprun ended before %q:\n%s", n.host, re, n.out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("host%d: no %q after %v:\n%s", n.host, re, bound, n.out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

var crcRe = regexp.MustCompile(`\[rank(\d+)\]: params_crc32=([0-9a-f]{8})`)

// crcs returns every rank's params_crc32 in outs.
func crcs(outs ...string) map[int]string {
	m := map[int]string{}
	for _, o := range outs {
		for _, s := range crcRe.FindAllStringSubmatch(o, -1) {
			r, _ := strconv.Atoi(s[1])
			m[r] = s[2]
		}
	}
	return m
}

// oneHost runs the same job on this machine's loopback, all ranks under one ddprun.
func oneHost(t *testing.T, nproc int, trainerArgs string) string {
	t.Helper()
	ddprun, trainer := bins(t)
	args := append([]string{"--standalone", "--nproc_per_node", strconv.Itoa(nproc), trainer, "--"}, strings.Fields(trainerArgs)...)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, ddprun, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("one-host reference: %v\n%s", err, out)
	}
	c := crcs(string(out))
	if len(c) != nproc {
		t.Fatalf("one-host reference: %d crcs:\n%s", len(c), out)
	}
	return c[0]
}

func tokenEnv() []string { return []string{"GODDP_TOKEN=multihost-test-" + strconv.Itoa(os.Getpid())} }

var transportRe = regexp.MustCompile(`\[rank(\d+)\]: transports: rank \d+: (.*)`)

// checkTransports asserts, from what every rank's group reports, shared memory between ranks
// of one host and TCP to the peer's testbed address across hosts.
func checkTransports(t *testing.T, tb *Testbed, nproc int, outs ...string) {
	t.Helper()
	seen := 0
	for _, o := range outs {
		for _, m := range transportRe.FindAllStringSubmatch(o, -1) {
			seen++
			r, _ := strconv.Atoi(m[1])
			for _, f := range regexp.MustCompile(`(\d+)=(self|shm|unix|tcp \S+|none)`).FindAllStringSubmatch(m[2], -1) {
				p, _ := strconv.Atoi(f[1])
				var want string
				switch {
				case p == r:
					want = "self"
				case p/nproc == r/nproc:
					want = "shm"
				default:
					want = "tcp " + tb.Addr(p/nproc) + ":"
				}
				if !strings.HasPrefix(f[2], want) {
					t.Errorf("rank %d reaches rank %d by %q, want %q...", r, p, f[2], want)
				}
			}
		}
	}
	if want := tb.Hosts() * nproc; seen != want {
		t.Errorf("%d transports lines, want %d", seen, want)
	}
}

func runTwoHosts(t *testing.T, nproc int) {
	tb := newBed(t, Options{Hosts: 2})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	args := tiny + " --seed 11"
	nodes := []*node{
		startNode(t, ctx, tb, 0, nproc, tokenEnv(), nil, args),
		startNode(t, ctx, tb, 1, nproc, tokenEnv(), nil, args),
	}
	var outs []string
	for _, n := range nodes {
		n.wait(t, 4*time.Minute)
		if n.err != nil {
			t.Fatalf("host%d: %v\n%s", n.host, n.err, n.out.String())
		}
		outs = append(outs, n.out.String())
	}
	got := crcs(outs...)
	ref := oneHost(t, 2*nproc, args)
	if len(got) != 2*nproc {
		t.Fatalf("%d ranks reported a crc, want %d: %v", len(got), 2*nproc, got)
	}
	for r, c := range got {
		if c != ref {
			t.Errorf("rank %d params_crc32=%s, the same job on one host %s", r, c, ref)
		}
	}
	checkTransports(t, tb, nproc, outs...)
	t.Logf("every rank params_crc32=%s, as on one host; host0's output:\n%s", ref, outs[0])
}

// TestTwoHostsOneRank: 2 hosts × 1 rank ends bit-identical to the same job on one host.
func TestTwoHostsOneRank(t *testing.T) { runTwoHosts(t, 1) }

// TestTwoHostsTwoRanks: 2 hosts × 2 ranks, shared memory inside a host and TCP across.
func TestTwoHostsTwoRanks(t *testing.T) { runTwoHosts(t, 2) }

// TestUnreachableHost: a host whose link is down before the start makes both nodes fail
// within the rendezvous bound, each naming the other side.
func TestUnreachableHost(t *testing.T) {
	tb := newBed(t, Options{Hosts: 2})
	if err := tb.SetLink(1, false); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	bound := []string{"--rdzv_timeout", "3s"}
	n0 := startNode(t, ctx, tb, 0, 1, tokenEnv(), bound, tiny)
	n1 := startNode(t, ctx, tb, 1, 1, tokenEnv(), bound, tiny)
	for _, n := range []*node{n0, n1} {
		n.wait(t, time.Minute)
		if n.err == nil {
			t.Fatalf("host%d: ddprun succeeded with host1 unreachable:\n%s", n.host, n.out.String())
		}
		t.Logf("host%d failed after %v", n.host, n.took.Round(time.Millisecond))
	}
	if want := "node 1 did not arrive within 3s"; !strings.Contains(n0.out.String(), want) {
		t.Errorf("host0's output lacks %q:\n%s", want, n0.out.String())
	}
	if want := "rendezvous store at " + tb.Addr(0) + ":" + storePort + " not reachable within 3s"; !strings.Contains(n1.out.String(), want) {
		t.Errorf("host1's output lacks %q:\n%s", want, n1.out.String())
	}
}

// TestUnreachableRankNoLauncher: ranks started without ddprun (the variables torchrun sets),
// one host cut off: both fail within GODDP_CONNECT_TIMEOUT, naming the store or the rank.
func TestUnreachableRankNoLauncher(t *testing.T) {
	tb := newBed(t, Options{Hosts: 2})
	if err := tb.SetLink(1, false); err != nil {
		t.Fatal(err)
	}
	outs := rawRanks(t, tb, append(tokenEnv(), "GODDP_CONNECT_TIMEOUT=3s"))
	if want := "rank 1 did not publish its address within 3s"; !strings.Contains(outs[0], want) {
		t.Errorf("rank 0's output lacks %q:\n%s", want, outs[0])
	}
	if want := "the rendezvous store at " + tb.Addr(0) + ":" + storePort + " did not answer within 3s"; !strings.Contains(outs[1], want) {
		t.Errorf("rank 1's output lacks %q:\n%s", want, outs[1])
	}
}

// TestNoTokenAcrossHosts: ranks on two hosts with no token refuse to start.
func TestNoTokenAcrossHosts(t *testing.T) {
	tb := newBed(t, Options{Hosts: 2})
	outs := rawRanks(t, tb, nil)
	for r, o := range outs {
		if want := "no job token: this job spans hosts (WORLD_SIZE=2, LOCAL_WORLD_SIZE=1)"; !strings.Contains(o, want) {
			t.Errorf("rank %d's output lacks %q:\n%s", r, want, o)
		}
	}
}

// TestLoopbackPublished: GODDP_SOCKET_IFNAME=lo on two hosts is refused at once by both
// ranks, naming the fix, instead of dialing a loopback address on the wrong host.
func TestLoopbackPublished(t *testing.T) {
	tb := newBed(t, Options{Hosts: 2})
	outs := rawRanks(t, tb, append(tokenEnv(), "GODDP_SOCKET_IFNAME=lo"))
	if want := "rank 0 would publish the loopback address 127.0.0.1:"; !strings.Contains(outs[0], want) {
		t.Errorf("rank 0's output lacks %q:\n%s", want, outs[0])
	}
	if want := "rank 0 published the loopback address 127.0.0.1:"; !strings.Contains(outs[1], want) {
		t.Errorf("rank 1's output lacks %q:\n%s", want, outs[1])
	}
	for r, o := range outs {
		if !strings.Contains(o, "set GODDP_SOCKET_IFNAME") {
			t.Errorf("rank %d's error names no fix:\n%s", r, o)
		}
	}
}

// rawRanks runs one trainer rank per host with the variables torchrun would set, expects
// every rank to fail within a minute, and returns their outputs.
func rawRanks(t *testing.T, tb *Testbed, env []string) []string {
	t.Helper()
	_, trainer := bins(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var outs []string
	var wg sync.WaitGroup
	outs = make([]string, tb.Hosts())
	for h := range tb.Hosts() {
		cmd := tb.Command(ctx, h, trainer, strings.Fields(tiny)...)
		cmd.Env = append(cmd.Env, "RANK="+strconv.Itoa(h), "WORLD_SIZE="+strconv.Itoa(tb.Hosts()),
			"LOCAL_RANK=0", "LOCAL_WORLD_SIZE=1", "MASTER_ADDR="+tb.Addr(0), "MASTER_PORT="+storePort)
		cmd.Env = append(cmd.Env, env...)
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := cmd.CombinedOutput()
			outs[h] = string(out)
			if err == nil {
				t.Errorf("rank %d succeeded:\n%s", h, out)
			}
		}()
	}
	wg.Wait()
	if ctx.Err() != nil {
		t.Fatalf("ranks still running after 2 minutes:\n%s", strings.Join(outs, "\n"))
	}
	return outs
}

// trainerPIDs finds the trainer processes started with the given seed (their command line
// carries it), sorted.
func trainerPIDs(t *testing.T, seed string) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		if len(args) > 0 && filepath.Base(args[0]) == "transformer" && strings.Contains(string(b), "\x00--seed\x00"+seed+"\x00") {
			pids = append(pids, pid)
		}
	}
	sort.Ints(pids)
	return pids
}

// rankPID is the pid of the trainer process that host n.host's ddprun started (one rank
// per host).
// It looks for up to 10 s: under load the rank may still be between its exec and the
// environment /proc shows, or in a launcher's restart, when the caller asks.
func rankPID(t *testing.T, n *node, seed string) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		for _, pid := range trainerPIDs(t, seed) {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
			if err == nil && strings.Contains(string(b), "\x00GROUP_RANK="+strconv.Itoa(n.host)+"\x00") {
				return pid
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no trainer process of host%d found in 10s (trainers with --seed %s: %v); its ddprun so far:\n%s", n.host, seed, trainerPIDs(t, seed), n.out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestRankKilledMidRun: kill -9 of host1's rank mid-run makes every rank fail quickly, and
// rank 0 names the lost rank.
func TestRankKilledMidRun(t *testing.T) {
	tb := newBed(t, Options{Hosts: 2})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	args := "--num_layers 1 --hidden_size 16 --seq_len 8 --batch_size 2 --warmup_steps 1 --bench_steps 100000 --log_every 1 --seed 7301"
	n0 := startNode(t, ctx, tb, 0, 1, tokenEnv(), nil, args)
	n1 := startNode(t, ctx, tb, 1, 1, tokenEnv(), nil, args)
	n0.waitFor(t, regexp.MustCompile(`\[rank0\]: step 3 loss`), 2*time.Minute) // rank 0 logs the steps
	pid := rankPID(t, n1, "7301")
	killed := time.Now()
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for _, n := range []*node{n0, n1} {
		n.wait(t, time.Minute)
		if n.err == nil {
			t.Fatalf("host%d: ddprun succeeded after a rank was killed:\n%s", n.host, n.out.String())
		}
		t.Logf("host%d's ddprun exited %v after the kill", n.host, time.Since(killed).Round(time.Millisecond))
	}
	// Host0 learns it from its rank (gloo's peer-lost error) or from host1's ddprun through
	// the store, whichever comes first; either names rank 1.
	lost := regexp.MustCompile(`peer rank 1 on \S+ ` + regexp.QuoteMeta(tb.Addr(1)) + ` lost|failed on another node: rank 1 \(node 1, host \S+\) killed by signal 9`)
	if !lost.MatchString(n0.out.String()) {
		t.Errorf("host0's output does not name the lost rank 1:\n%s", n0.out.String())
	}
	t.Logf("host0's output:\n%s", n0.out.String())
	if want := "rank 1 (local_rank 0, host"; !strings.Contains(n1.out.String(), want) || !strings.Contains(n1.out.String(), "killed by signal 9") {
		t.Errorf("host1's output lacks the killed rank's report (%q, killed by signal 9):\n%s", want, n1.out.String())
	}
}

// TestTwoNodeRestart: --max_restarts 1 on a two-node job, host1's rank killed mid-run: both
// nodes restart, resume from their checkpoints, and end bit-identical to an uninterrupted run.
// The run is long enough (400 steps of a tiny model) that host1's rank is still there when
// the test, polling rank 0's output, has seen step 5: with 40 steps it could finish first.
func TestTwoNodeRestart(t *testing.T) {
	tb := newBed(t, Options{Hosts: 2})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	base := "--num_layers 1 --hidden_size 16 --seq_len 8 --batch_size 2 --warmup_steps 2 --bench_steps 400 --log_every 1 --checkpoint_every 2 --seed 7302"
	ref := oneHost(t, 2, base+" --checkpoint_dir "+t.TempDir())
	restart := []string{"--max_restarts", "1"}
	n0 := startNode(t, ctx, tb, 0, 1, tokenEnv(), restart, base+" --checkpoint_dir "+t.TempDir())
	n1 := startNode(t, ctx, tb, 1, 1, tokenEnv(), restart, base+" --checkpoint_dir "+t.TempDir())
	n0.waitFor(t, regexp.MustCompile(`\[rank0\]: step 5 loss`), 2*time.Minute)
	pid := rankPID(t, n1, "7302")
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var outs []string
	for _, n := range []*node{n0, n1} {
		n.wait(t, 3*time.Minute)
		if n.err != nil {
			t.Fatalf("host%d: %v\n%s", n.host, n.err, n.out.String())
		}
		outs = append(outs, n.out.String())
	}
	if !strings.Contains(outs[0], "restarting the group") || !strings.Contains(outs[1], "restarting the group") {
		t.Errorf("a node shows no restart:\n%s\n%s", outs[0], outs[1])
	}
	if !regexp.MustCompile(`start_step=[1-9]`).MatchString(outs[0] + outs[1]) {
		t.Errorf("the restart did not resume from a checkpoint:\n%s\n%s", outs[0], outs[1])
	}
	got := crcs(outs...)
	if len(got) != 2 {
		t.Fatalf("crcs %v", got)
	}
	for r, c := range got {
		if c != ref {
			t.Errorf("rank %d params_crc32=%s after the restart, uninterrupted %s", r, c, ref)
		}
	}
	t.Logf("both ranks params_crc32=%s after the restart, as uninterrupted; host1's output:\n%s", ref, outs[1])
}

// TestLinkDownMidRun: host1's link cut mid-run makes both nodes fail within seconds (TCP
// user timeout and keepalives, not the 30-minute collective timeout), rank 0 naming rank 1.
func TestLinkDownMidRun(t *testing.T) {
	tb := newBed(t, Options{Hosts: 2})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	args := "--num_layers 1 --hidden_size 16 --seq_len 8 --batch_size 2 --warmup_steps 1 --bench_steps 100000 --log_every 1 --seed 7303"
	n0 := startNode(t, ctx, tb, 0, 1, tokenEnv(), nil, args)
	n1 := startNode(t, ctx, tb, 1, 1, tokenEnv(), nil, args)
	n0.waitFor(t, regexp.MustCompile(`\[rank0\]: step 3 loss`), 2*time.Minute)
	cut := time.Now()
	if err := tb.SetLink(1, false); err != nil {
		t.Fatal(err)
	}
	for _, n := range []*node{n0, n1} {
		n.wait(t, 2*time.Minute)
		if n.err == nil {
			t.Fatalf("host%d: ddprun succeeded after the link went down:\n%s", n.host, n.out.String())
		}
		t.Logf("host%d's ddprun exited %v after the cut", n.host, time.Since(cut).Round(time.Millisecond))
	}
	if !regexp.MustCompile(`peer rank 1 on \S+ ` + regexp.QuoteMeta(tb.Addr(1)) + ` lost`).MatchString(n0.out.String()) {
		t.Errorf("host0's output does not name the lost rank 1:\n%s", n0.out.String())
	}
	if !regexp.MustCompile(`peer rank 0 on \S+ ` + regexp.QuoteMeta(tb.Addr(0)) + ` lost`).MatchString(n1.out.String()) {
		t.Errorf("host1's output does not name the lost rank 0:\n%s", n1.out.String())
	}
	t.Logf("host0:\n%s\nhost1:\n%s", lastLines(n0.out.String(), 6), lastLines(n1.out.String(), 6))
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// TestTwoNodeTraceMerge: --trace_merge on a two-node job gives node 0 one timeline with every
// node's ranks, their hosts, and the clock offset it estimated.
func TestTwoNodeTraceMerge(t *testing.T) {
	tb := newBed(t, Options{Hosts: 2})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	out := filepath.Join(t.TempDir(), "merged", "trace.json")
	merge := []string{"--trace_merge", out}
	n0 := startNode(t, ctx, tb, 0, 1, tokenEnv(), merge, tiny)
	n1 := startNode(t, ctx, tb, 1, 1, tokenEnv(), merge, tiny)
	for _, n := range []*node{n0, n1} {
		n.wait(t, 3*time.Minute)
		if n.err != nil {
			t.Fatalf("host%d: %v\n%s", n.host, n.err, n.out.String())
		}
	}
	if !regexp.MustCompile(`merged 2 ranks' traces from 2 nodes into .*; clock offsets to node 0: node 1 [-+][0-9.]+ms \(±[0-9.]+ms\)`).MatchString(n0.out.String()) {
		t.Errorf("host0 reports no merge with clock offsets:\n%s", n0.out.String())
	}
	tf, err := tracefile.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(tf.OtherData.Ranks) != "[0 1]" {
		t.Errorf("merged ranks %v, want [0 1]", tf.OtherData.Ranks)
	}
	for r, want := range []string{"node 0", "node 1"} {
		if !strings.HasSuffix(tf.OtherData.Hosts[r], want) {
			t.Errorf("rank %d's host %q, want ...%q", r, tf.OtherData.Hosts[r], want)
		}
	}
	events := map[int]int{}
	for _, e := range tf.TraceEvents {
		events[e.PID]++
	}
	if events[0] == 0 || events[1] == 0 {
		t.Errorf("events per rank %v: want both ranks' events", events)
	}
}

// TestElasticLinkCut: an elastic job (ddprun --nnodes 2:3) on three hosts; host 2's link is
// cut mid-run. Hosts 0 and 1 find it silent (heartbeats, or the connections' keepalives),
// form the next epoch without it within 20 s and end with the crc of the same 6 shards on
// one host; host 2, cut off from the store, fails.
func TestElasticLinkCut(t *testing.T) {
	tb := newBed(t, Options{Hosts: 3})
	ddprun, trainer := bins(t)
	args := "--num_layers 1 --hidden_size 16 --seq_len 8 --global_batch_size 12 --micro_batch_size 2 --warmup_steps 0 --bench_steps 800 --log_every 1 --seed 7303"
	want := oneHost(t, 1, args)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	j := launchtest.NewElasticJobWith(t, ddprun, trainer, "2:3", tokenEnv(), args)
	j.Host = tb.Addr(0)
	j.Command = func(h int, name string, args ...string) *exec.Cmd { return tb.Command(ctx, h, name, args...) }
	n0 := j.StartOn(0, "host0", "")
	n0.WaitFor(regexp.MustCompile(`hosts the job's rendezvous store`), time.Minute)
	n1, n2 := j.StartOn(1, "host1", ""), j.StartOn(2, "host2", "")
	launchtest.WaitAny(t, regexp.MustCompile(`^\[local0\]: step (2[0-9]|[3-9][0-9]) loss`), n0, n1, n2)
	cut := time.Now()
	if err := tb.SetLink(2, false); err != nil {
		t.Fatal(err)
	}
	for _, n := range []*launchtest.Node{n0, n1} {
		n.WaitFor(regexp.MustCompile(`elastic: epoch 1: .*world size 3 -> 2; resuming from step \d+; pause`), time.Minute)
	}
	for _, n := range []*launchtest.Node{n0, n1} {
		if err := n.Wait(2 * time.Minute); err != nil {
			t.Fatalf("%s: ddprun: %v\n%s", n.Name, err, lastLines(n.Output(), 20))
		}
		if got := regexp.MustCompile(`\[local0\]: params_crc32=([0-9a-f]{8})`).FindStringSubmatch(n.Output()); got == nil || got[1] != want {
			t.Fatalf("%s ends with %v; the same shards on one host: %s\n%s", n.Name, got, want, lastLines(n.Output(), 20))
		}
	}
	if err := n2.Wait(2 * time.Minute); err == nil {
		t.Errorf("host2's ddprun succeeded with its link cut:\n%s", lastLines(n2.Output(), 10))
	}
	next, _, ok := launchtest.StepAfterResume(n0, n1)
	if !ok {
		t.Fatalf("no step after the change:\n%s\n%s", lastLines(n0.Output(), 8), lastLines(n1.Output(), 8))
	}
	pause := next.Sub(cut)
	t.Logf("pause from the cut to the next step: %v", pause.Round(time.Millisecond))
	if pause > 20*time.Second {
		t.Errorf("the survivors went on %v after the cut; the bound is 20 s", pause.Round(time.Millisecond))
	}
}

// TestAutoHookOverSlowLink: over 1 Gbit/s, a model of 25 MB of gradients whose compute
// takes far less than their 200 ms on the wire, --comm_hook auto compresses (rank 0 prints
// a choice with PowerSGD in it, Note [Auto hook]), and both ranks end with the same
// parameters. On one host the same job keeps the plain all-reduce (examples/mlp and
// examples/transformer's TestCommHookFlag).
func TestAutoHookOverSlowLink(t *testing.T) {
	tb := newBed(t, Options{Hosts: 2, Rate: "1gbit"})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	const args = "--num_layers 2 --hidden_size 512 --seq_len 8 --batch_size 1 --warmup_steps 4 --bench_steps 2 --comm_hook auto"
	nodes := []*node{
		startNode(t, ctx, tb, 0, 1, tokenEnv(), nil, args),
		startNode(t, ctx, tb, 1, 1, tokenEnv(), nil, args),
	}
	var outs []string
	for _, n := range nodes {
		n.wait(t, 4*time.Minute)
		if n.err != nil {
			t.Fatalf("host%d: %v\n%s", n.host, n.err, n.out.String())
		}
		outs = append(outs, n.out.String())
	}
	if got := crcs(outs...); len(got) != 2 || got[0] != got[1] {
		t.Fatalf("the ranks end with %v, want one params_crc32 each, the same\n%s", got, outs[0])
	}
	var plan string
	for _, line := range strings.Split(outs[0], "\n") {
		if strings.Contains(line, "auto hook after 3 synced steps") {
			plan = line
		}
	}
	if !strings.Contains(plan, "; hooks ") || !strings.Contains(plan, "powersgd(r=") {
		t.Fatalf("rank 0's plan %q does not compress over 1 Gbit/s\n%s", plan, outs[0])
	}
	t.Logf("%s", plan)
}
