package main

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// elasticArgs: 6 logical shards of 4 samples, 40 steps of at least 50 ms (--step_time), so
// that a node can be lost or gained mid-run.
const elasticArgs = "--hidden_size 16 --steps 40 --log_every 1 --lr 0.3 --global_batch_size 24 --micro_batch_size 4 --bucket_cap_mb 0.0001 --first_bucket_cap_mb 0.0001 --step_time 50ms"

// node is one ddprun of an elastic job: a "node" of it, on this host.
type node struct {
	t    *testing.T
	name string
	cmd  *exec.Cmd
	done chan struct{} // closed when it has exited and its output is read
	err  error         // its exit, once done

	mu    sync.Mutex
	lines []stamped
}

type stamped struct {
	at   time.Time
	line string
}

// elasticJob holds the common flags of one job's nodes.
type elasticJob struct {
	t      *testing.T
	ddprun string
	port   int
	nnodes string
	env    []string
	args   string
	nodes  []*node
}

func newElasticJob(t *testing.T, nnodes string, env []string, args string) *elasticJob {
	if testing.Short() {
		t.Skip("builds ddprun and runs an elastic job")
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	j := &elasticJob{t: t, ddprun: buildDDPRun(t), port: port, nnodes: nnodes, args: args,
		env: append([]string{asMainEnv + "=1", "GODDP_TOKEN=elastic-test-token-0123456789abcdef"}, env...)}
	t.Cleanup(func() {
		for _, n := range j.nodes {
			n.cmd.Process.Kill()
			<-n.done
		}
	})
	return j
}

// start starts one node with args (the job's when empty) and ddprun flags extra.
func (j *elasticJob) start(name, args string, extra ...string) *node {
	j.t.Helper()
	exe, err := os.Executable()
	if err != nil {
		j.t.Fatal(err)
	}
	if args == "" {
		args = j.args
	}
	flags := append([]string{"--nnodes", j.nnodes, "--rdzv_endpoint", "127.0.0.1:" + strconv.Itoa(j.port), "--rdzv_timeout", "30s"}, extra...)
	cmd := exec.Command(j.ddprun, append(append(flags, exe, "--"), strings.Fields(args)...)...)
	cmd.Env = append(os.Environ(), j.env...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		j.t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		j.t.Fatal(err)
	}
	n := &node{t: j.t, name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			n.mu.Lock()
			n.lines = append(n.lines, stamped{time.Now(), sc.Text()})
			n.mu.Unlock()
		}
		n.err = cmd.Wait()
		close(n.done)
	}()
	j.nodes = append(j.nodes, n)
	return n
}

// output is everything the node printed so far.
func (n *node) output() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	var b strings.Builder
	for _, l := range n.lines {
		b.WriteString(l.line + "\n")
	}
	return b.String()
}

// waitFor waits until some line of the node matches re, and returns when it came.
func (n *node) waitFor(re *regexp.Regexp, within time.Duration) time.Time {
	n.t.Helper()
	end := time.Now().Add(within)
	for time.Now().Before(end) {
		n.mu.Lock()
		for _, l := range n.lines {
			if re.MatchString(l.line) {
				n.mu.Unlock()
				return l.at
			}
		}
		n.mu.Unlock()
		select {
		case <-n.done:
			n.t.Fatalf("%s exited (%v) before printing %q:\n%s", n.name, n.err, re, n.output())
		case <-time.After(20 * time.Millisecond):
		}
	}
	n.t.Fatalf("%s printed no %q within %v:\n%s", n.name, re, within, n.output())
	return time.Time{}
}

// firstAfter is the time of the node's first line after t0 that matches re.
func (n *node) firstAfter(t0 time.Time, re *regexp.Regexp) (time.Time, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, l := range n.lines {
		if l.at.After(t0) && re.MatchString(l.line) {
			return l.at, true
		}
	}
	return time.Time{}, false
}

// wait waits for the node to exit.
func (n *node) wait(within time.Duration) error {
	n.t.Helper()
	select {
	case <-n.done:
		return n.err
	case <-time.After(within):
		n.t.Fatalf("%s still running after %v:\n%s", n.name, within, n.output())
		return nil
	}
}

var (
	hostsStore = regexp.MustCompile(`hosts the job's rendezvous store`)
	stepLine   = regexp.MustCompile(`^\[local0\]: step (\d+) loss`)
	crcLine    = regexp.MustCompile(`(?m)^\[local0\]: (params_crc32=[0-9a-f]{8})$`)
)

func stepAtLeast(s int) *regexp.Regexp {
	return regexp.MustCompile(fmt.Sprintf(`^\[local0\]: step (%s) loss`, strings.Join(func() []string {
		var v []string
		for i := s; i < s+30; i++ {
			v = append(v, strconv.Itoa(i))
		}
		return v
	}(), "|")))
}

// waitAny waits until one of nodes prints a line that matches re.
func waitAny(t *testing.T, re *regexp.Regexp, nodes ...*node) {
	t.Helper()
	end := time.Now().Add(time.Minute)
	for time.Now().Before(end) {
		for _, n := range nodes {
			if _, ok := n.firstAfter(time.Time{}, re); ok {
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no node printed %q within a minute", re)
}

// wantCRCOf checks that the node exited 0 and printed want.
func wantCRCOf(t *testing.T, n *node, want string) {
	t.Helper()
	if err := n.wait(2 * time.Minute); err != nil {
		t.Fatalf("%s: ddprun: %v\n%s", n.name, err, n.output())
	}
	m := crcLine.FindStringSubmatch(n.output())
	if m == nil || m[1] != want {
		t.Fatalf("%s ends with %v; the uninterrupted run with the same global batch: %s\n%s", n.name, m, want, n.output())
	}
}

// TestElasticLoseNode: three nodes (ddprun --nnodes 2:3, one rank each); the third is
// killed with SIGKILL (its ddprun, and with it its rank) at step 10 of 40. The two others
// go on without a restart, and end with the crc of one process that runs the same 6
// shards; each says the change in one line.
func TestElasticLoseNode(t *testing.T) {
	want := uninterrupted(t, elasticArgs)
	j := newElasticJob(t, "2:3", nil, elasticArgs)
	a := j.start("node a", "")
	a.waitFor(hostsStore, 30*time.Second)
	b, c := j.start("node b", ""), j.start("node c", "")
	var seen time.Time
	for _, n := range []*node{a, b, c} {
		if at := n.waitFor(regexp.MustCompile(`elastic: epoch 0: .*world size 0 -> 3`), time.Minute); at.After(seen) {
			seen = at
		}
	}
	waitAny(t, stepAtLeast(10), a, b, c) // rank 0 prints the steps: any of them
	killed := time.Now()
	c.cmd.Process.Signal(syscall.SIGKILL)
	<-c.done
	for _, n := range []*node{a, b} {
		n.waitFor(regexp.MustCompile(`elastic: epoch 1: .*left: node .*rank \d of epoch 0\); joined: none; world size 3 -> 2; resuming from step \d+; pause`), time.Minute)
		wantCRCOf(t, n, want)
	}
	var next time.Time
	for _, n := range []*node{a, b} {
		if at, ok := n.firstAfter(killed, regexp.MustCompile(`elastic: epoch 1`)); ok {
			if s, ok := n.firstAfter(at, stepLine); ok && (next.IsZero() || s.Before(next)) {
				next = s
			}
		}
	}
	if next.IsZero() {
		t.Fatalf("no step after the change:\n%s\n%s", a.output(), b.output())
	}
	t.Logf("pause from the kill to the next step: %v", next.Sub(killed).Round(time.Millisecond))
}

// TestElasticGainNode: two nodes (--nnodes 2:3) train; a third starts once they are past
// step 10, is let in at a step boundary with the state of a survivor, and all three end
// with the crc of one process.
func TestElasticGainNode(t *testing.T) {
	want := uninterrupted(t, elasticArgs)
	j := newElasticJob(t, "2:3", nil, elasticArgs)
	a := j.start("node a", "")
	a.waitFor(hostsStore, 30*time.Second)
	b := j.start("node b", "")
	waitAny(t, stepAtLeast(10), a, b)
	started := time.Now()
	c := j.start("node c", "")
	for _, n := range []*node{a, b, c} {
		n.waitFor(regexp.MustCompile(`elastic: epoch 1: 1 process\(es\) waiting to join at step \d+; left: none; joined: node .*; world size 2 -> 3; resuming from step \d+`), time.Minute)
	}
	for _, n := range []*node{a, b, c} {
		wantCRCOf(t, n, want)
	}
	if at, ok := c.firstAfter(started, stepLine); ok {
		t.Logf("from the joiner's start to the first step of 3 nodes: %v", at.Sub(started).Round(time.Millisecond))
	}
}

// TestElasticRefusals: a world the shards do not fit is refused at start, naming the sizes
// that work; a node with another model is refused when it tries to join, naming the
// difference, and the job goes on; a rank stopped past the heartbeat timeout (a silent
// host) is dropped, the others go on, and when it wakes it is refused as a stale member
// of an old epoch.
func TestElasticRefusals(t *testing.T) {
	want := uninterrupted(t, elasticArgs)
	t.Run("shards", func(t *testing.T) {
		j := newElasticJob(t, "1:1", nil, elasticArgs)
		n := j.start("node", "", "--nproc_per_node", "4")
		err := n.wait(time.Minute)
		const msg = "no world size from 4 to 4 processes (1:1 nodes × 4) divides the 6 shards of a step; the world sizes that work are 1, 2, 3, 6"
		if err == nil || !strings.Contains(n.output(), msg) {
			t.Fatalf("ddprun: %v; want a failure saying %q:\n%s", err, msg, n.output())
		}
	})
	t.Run("model", func(t *testing.T) {
		j := newElasticJob(t, "2:3", nil, elasticArgs)
		a := j.start("node a", "")
		a.waitFor(hostsStore, 30*time.Second)
		b := j.start("node b", "")
		waitAny(t, stepAtLeast(5), a, b)
		odd := j.start("odd node", strings.Replace(elasticArgs, "--hidden_size 16", "--hidden_size 32", 1))
		err := odd.wait(time.Minute)
		const msg = `cannot join: its model or settings differ from the job's: this process has "tensor w1 [32 4]" where the job has "tensor w1 [16 4]"`
		if err == nil || !strings.Contains(odd.output(), msg) {
			t.Fatalf("the odd node: ddprun: %v; want a failure saying %q:\n%s", err, msg, odd.output())
		}
		wantCRCOf(t, a, want)
		wantCRCOf(t, b, want)
		if strings.Contains(a.output()+b.output(), "elastic: epoch 1") {
			t.Errorf("the job changed for a node it refused:\n%s", a.output())
		}
	})
	t.Run("stale", func(t *testing.T) {
		hb := []string{"GODDP_ELASTIC_HEARTBEAT=200ms", "GODDP_ELASTIC_HEARTBEAT_TIMEOUT=1s"}
		j := newElasticJob(t, "2:3", hb, elasticArgs)
		a := j.start("node a", "")
		a.waitFor(hostsStore, 30*time.Second)
		b, c := j.start("node b", ""), j.start("node c", "")
		waitAny(t, stepAtLeast(8), a, b, c)
		pid := rankPID(t, c)
		syscall.Kill(pid, syscall.SIGSTOP)
		for _, n := range []*node{a, b} {
			n.waitFor(regexp.MustCompile(`elastic: epoch 1: rank \d \(node .*\) sent no heartbeat for .*; world size 3 -> 2`), time.Minute)
		}
		syscall.Kill(pid, syscall.SIGCONT)
		err := c.wait(time.Minute)
		stale := regexp.MustCompile(`elastic: node \S+ \(host [^,]+, rank \d of epoch 0\) was dropped from the job: epoch 1 formed without it`)
		if err == nil || !stale.MatchString(c.output()) {
			t.Fatalf("the stopped node: ddprun: %v; want a failure matching %q:\n%s", err, stale, c.output())
		}
		wantCRCOf(t, a, want)
		wantCRCOf(t, b, want)
	})
}

// rankPID finds the pid of the trainer that node n's ddprun started (its only child).
func rankPID(t *testing.T, n *node) int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var kids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces, so read after the last ')'.
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(n.cmd.Process.Pid) {
			kids = append(kids, pid)
		}
	}
	if len(kids) != 1 {
		t.Fatalf("%s's ddprun has children %v, want its one rank", n.name, kids)
	}
	return kids[0]
}
