package launchtest

import (
	"bufio"
	"net"
	"os"
	"os/exec"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Node is one ddprun of an elastic job: a "node" of it, on this host.
type Node struct {
	t    *testing.T
	Name string
	Cmd  *exec.Cmd
	done chan struct{} // closed when it has exited and its output is read
	err  error         // its exit, once done

	mu    sync.Mutex
	lines []stamped
}

type stamped struct {
	at   time.Time
	line string
}

// ElasticJob starts the nodes of one elastic job on this host: ddprun --nnodes NNODES
// --rdzv_endpoint 127.0.0.1:PORT, each running Exe with Env added.
type ElasticJob struct {
	t      *testing.T
	ddprun string
	exe    string
	port   int
	nnodes string
	env    []string
	args   string
	nodes  []*Node

	// Host is the store's host in --rdzv_endpoint (default 127.0.0.1); Command, when set,
	// makes each node's command (on testbed host h, say) in place of exec.Command.
	Host    string
	Command func(h int, name string, args ...string) *exec.Cmd
}

// NewElasticJob builds ddprun and picks the store's port; t's cleanup kills every node
// still running. args are the trainer's, env is added to each node's environment (with a
// shared GODDP_TOKEN).
func NewElasticJob(t *testing.T, exe, nnodes string, env []string, args string) *ElasticJob {
	return NewElasticJobWith(t, DDPRun(t), exe, nnodes, env, args)
}

// NewElasticJobWith is NewElasticJob with a ddprun already built.
func NewElasticJobWith(t *testing.T, ddprun, exe, nnodes string, env []string, args string) *ElasticJob {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	j := &ElasticJob{t: t, ddprun: ddprun, exe: exe, port: port, nnodes: nnodes, args: args,
		env: append([]string{"GODDP_TOKEN=elastic-test-token-0123456789abcdef"}, env...)}
	t.Cleanup(func() {
		for _, n := range j.nodes {
			n.Cmd.Process.Kill()
			<-n.done
		}
	})
	return j
}

// Start starts one node with args (the job's when empty) and ddprun flags extra.
func (j *ElasticJob) Start(name, args string, extra ...string) *Node {
	j.t.Helper()
	return j.StartOn(-1, name, args, extra...)
}

// StartOn is Start on host h (passed to Command).
func (j *ElasticJob) StartOn(h int, name, args string, extra ...string) *Node {
	j.t.Helper()
	host := j.Host
	if host == "" {
		host = "127.0.0.1"
	}
	exe := j.exe
	if args == "" {
		args = j.args
	}
	flags := append([]string{"--nnodes", j.nnodes, "--rdzv_endpoint", net.JoinHostPort(host, strconv.Itoa(j.port)), "--rdzv_timeout", "30s"}, extra...)
	argv := append(append(flags, exe, "--"), strings.Fields(args)...)
	var cmd *exec.Cmd
	if j.Command != nil {
		cmd = j.Command(h, j.ddprun, argv...)
		cmd.Env = append(cmd.Env, j.env...)
	} else {
		cmd = exec.Command(j.ddprun, argv...)
		cmd.Env = append(os.Environ(), j.env...)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		j.t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		j.t.Fatal(err)
	}
	n := &Node{t: j.t, Name: name, Cmd: cmd, done: make(chan struct{})}
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

// Output is everything the node printed so far.
func (n *Node) Output() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	var b strings.Builder
	for _, l := range n.lines {
		b.WriteString(l.line + "\n")
	}
	return b.String()
}

// WaitFor waits until some line of the node matches re, and returns when it came.
func (n *Node) WaitFor(re *regexp.Regexp, within time.Duration) time.Time {
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
			n.t.Fatalf("%s exited (%v) before printing %q:\n%s", n.Name, n.err, re, n.Output())
		case <-time.After(20 * time.Millisecond):
		}
	}
	n.t.Fatalf("%s printed no %q within %v:\n%s", n.Name, re, within, n.Output())
	return time.Time{}
}

// FirstAfter is the time of the node's first line after t0 that matches re.
func (n *Node) FirstAfter(t0 time.Time, re *regexp.Regexp) (time.Time, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, l := range n.lines {
		if l.at.After(t0) && re.MatchString(l.line) {
			return l.at, true
		}
	}
	return time.Time{}, false
}

// Wait waits for the node to exit.
func (n *Node) Wait(within time.Duration) error {
	n.t.Helper()
	select {
	case <-n.done:
		return n.err
	case <-time.After(within):
		n.t.Fatalf("%s still running after %v:\n%s", n.Name, within, n.Output())
		return nil
	}
}

// WaitAny waits until one of nodes prints a line that matches re.
func WaitAny(t *testing.T, re *regexp.Regexp, nodes ...*Node) {
	t.Helper()
	end := time.Now().Add(time.Minute)
	for time.Now().Before(end) {
		for _, n := range nodes {
			if _, ok := n.FirstAfter(time.Time{}, re); ok {
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no node printed %q within a minute", re)
}

// Kill kills the node's ddprun with SIGKILL (its ranks die with it) and waits for it.
func (n *Node) Kill() {
	n.Cmd.Process.Signal(syscall.SIGKILL)
	<-n.done
}

// RankPID finds the pid of the trainer that node n's ddprun started (its only child).
func RankPID(t *testing.T, n *Node) int {
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
		if len(f) > 1 && f[1] == strconv.Itoa(n.Cmd.Process.Pid) {
			kids = append(kids, pid)
		}
	}
	if len(kids) != 1 {
		t.Fatalf("%s's ddprun has children %v, want its one rank", n.Name, kids)
	}
	return kids[0]
}

var (
	resumeRe = regexp.MustCompile(`elastic: epoch (\d+): .*resuming from step (\d+)`)
	stepRe   = regexp.MustCompile(`^\[local0\]: step (\d+) loss`)
)

// StepAfterResume is when the first step of the last epoch was printed by any of nodes (the
// first "step S loss" line, S the step the last epoch resumed from, printed after the
// report of that epoch), and when the last step before that report was.
func StepAfterResume(nodes ...*Node) (after, before time.Time, ok bool) {
	epoch, from, at := -1, "", time.Time{}
	for _, n := range nodes {
		n.mu.Lock()
		for _, l := range n.lines {
			if m := resumeRe.FindStringSubmatch(l.line); m != nil {
				if e, _ := strconv.Atoi(m[1]); e > epoch {
					epoch, from, at = e, m[2], l.at
				}
			}
		}
		n.mu.Unlock()
	}
	if epoch < 0 {
		return time.Time{}, time.Time{}, false
	}
	var first, last time.Time
	for _, n := range nodes {
		n.mu.Lock()
		for _, l := range n.lines {
			m := stepRe.FindStringSubmatch(l.line)
			if m == nil {
				continue
			}
			if m[1] == from && l.at.After(at.Add(-time.Second)) && (first.IsZero() || l.at.Before(first)) {
				first = l.at
			}
			if l.at.Before(at) && l.at.After(last) && m[1] != from {
				last = l.at
			}
		}
		n.mu.Unlock()
	}
	return first, last, !first.IsZero()
}

// rank0Resume is the report of an epoch as its rank 0 prints it.
var rank0Resume = regexp.MustCompile(`elastic: epoch (\d+): .*resuming from step (\d+).*\(this process: rank 0\)`)

// KeptSteps is the run's log of steps kept: the step lines of every node in the order they
// came, where each epoch's report (its rank 0's) drops the steps from the one it resumes
// from, which the epoch runs again.
func KeptSteps(nodes ...*Node) []int {
	var lines []stamped
	for _, n := range nodes {
		n.mu.Lock()
		lines = append(lines, n.lines...)
		n.mu.Unlock()
	}
	sort.SliceStable(lines, func(i, j int) bool { return lines[i].at.Before(lines[j].at) })
	var kept []int
	for _, l := range lines {
		if m := rank0Resume.FindStringSubmatch(l.line); m != nil {
			from, _ := strconv.Atoi(m[2])
			for len(kept) > 0 && kept[len(kept)-1] >= from {
				kept = kept[:len(kept)-1]
			}
		} else if m := stepRe.FindStringSubmatch(l.line); m != nil {
			s, _ := strconv.Atoi(m[1])
			kept = append(kept, s)
		}
	}
	return kept
}

// SetArgs replaces the trainer's arguments of the nodes started next.
func (j *ElasticJob) SetArgs(args string) { j.args = args }
