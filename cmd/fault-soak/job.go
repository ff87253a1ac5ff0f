//go:build linux

package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/big"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/goddp/goddp/internal/testbed"
)

// cluster is where a job runs: this host, or the hosts of a testbed.
type cluster struct {
	tb    *testbed.Testbed // nil: this host only
	nproc int              // ranks in all
	token string           // the job token across hosts
}

// nodes is the number of launchers (ddprun processes) a job has.
func (c *cluster) nodes() int {
	if c.tb == nil {
		return 1
	}
	return c.tb.Hosts()
}

func (c *cluster) String() string {
	if c.tb == nil {
		return fmt.Sprintf("%d ranks on this host (ddprun --standalone)", c.nproc)
	}
	return fmt.Sprintf("%d ranks on %d testbed hosts (%d per host, ddprun --nnodes %d)", c.nproc, c.tb.Hosts(), c.nproc/c.tb.Hosts(), c.tb.Hosts())
}

// jobSpec is what every run of the job shares: the launcher, the trainer and its flags.
type jobSpec struct {
	ddprun      string
	trainer     string
	args        []string // the trainer's flags, without --checkpoint_dir
	maxRestarts int
	env         []string // added to the launchers' environment
}

// round is one run of the job, from its launchers' start to their exit, and what its
// output said.
type round struct {
	name  string
	cmds  []*exec.Cmd
	nodes map[int]int // launcher pid → node
	start time.Time
	done  chan struct{}

	mu        sync.Mutex
	lastStep  int       // rank 0's last "step N loss" line; -1 before the first
	lastAt    time.Time // when it was read
	steps     int       // how many such lines
	restarts  int       // node 0's "restarting the group" lines
	restartAt time.Time // when the last one was read
	gaveUp    bool
	refusals  int            // log lines that say a stranger was refused
	crc       map[int]string // params_crc32 by rank
	err       error          // the first launcher's failure, once done
	elapsed   time.Duration
}

var (
	stepLine    = regexp.MustCompile(`^\[rank0\]: step (\d+) loss`)
	restartLine = regexp.MustCompile(`^ddprun: restarting the group \(restart (\d+) of \d+\)`)
	crcLine     = regexp.MustCompile(`^\[rank(\d+)\]: params_crc32=([0-9a-f]{8})$`)
	refusedLine = regexp.MustCompile(`(?i)refused`)
	giveUpLine  = regexp.MustCompile(`^ddprun: giving up`)
)

// observe updates what the round knows from one line of node's launcher output, read at t.
func (r *round) observe(node int, line string, t time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if m := stepLine.FindStringSubmatch(line); m != nil {
		n, _ := strconv.Atoi(m[1])
		r.lastStep, r.lastAt = n, t
		r.steps++
		return
	}
	if m := crcLine.FindStringSubmatch(line); m != nil {
		r.crc[atoi(m[1])] = m[2]
		return
	}
	if m := restartLine.FindStringSubmatch(line); m != nil && node == 0 {
		r.restarts = max(r.restarts, atoi(m[1]))
		r.restartAt = t
		return
	}
	if giveUpLine.MatchString(line) {
		r.gaveUp = true
		return
	}
	if refusedLine.MatchString(line) {
		r.refusals++
	}
}

func atoi(s string) int { n, _ := strconv.Atoi(s); return n }

// progress is a snapshot of what a round's output has said so far.
type progress struct {
	lastStep  int
	lastAt    time.Time
	steps     int
	restarts  int
	restartAt time.Time
	refusals  int
	finished  bool
	err       error
}

func (r *round) progress() progress {
	r.mu.Lock()
	defer r.mu.Unlock()
	p := progress{lastStep: r.lastStep, lastAt: r.lastAt, steps: r.steps, restarts: r.restarts, restartAt: r.restartAt, refusals: r.refusals}
	select {
	case <-r.done:
		p.finished, p.err = true, r.err
	default:
	}
	return p
}

// agreedCRC returns the params_crc32 every one of n ranks printed, or an error that says
// which rank printed what.
func (r *round) agreedCRC(n int) (string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for rank := range n {
		if r.crc[rank] == "" || r.crc[rank] != r.crc[0] || len(r.crc) != n {
			return "", fmt.Errorf("%s: params_crc32 by rank %v, want one value from each of %d ranks", r.name, r.crc, n)
		}
	}
	return r.crc[0], nil
}

// randomPort returns a port for a multi-host job's store, away from the ephemeral range.
func randomPort() int {
	n, _ := rand.Int(rand.Reader, big.NewInt(10000))
	return 20000 + int(n.Int64())
}

// newToken returns a fresh secret job token.
func newToken() string {
	b := make([]byte, 32)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// startRound starts the job's launchers, one per node, with ckptDir as the trainer's
// --checkpoint_dir, writing their output, each line prefixed with its node, to log.
func startRound(c *cluster, spec jobSpec, name, ckptDir string, log io.Writer) (*round, error) {
	r := &round{name: name, nodes: map[int]int{}, start: time.Now(), done: make(chan struct{}), lastStep: -1, crc: map[int]string{}}
	trainer := append([]string{spec.trainer, "--"}, spec.args...)
	trainer = append(trainer, "--checkpoint_dir", ckptDir)
	restarts := "--max_restarts=" + strconv.Itoa(spec.maxRestarts)
	port := randomPort()
	var logMu sync.Mutex
	var readers sync.WaitGroup
	for node := range c.nodes() {
		var cmd *exec.Cmd
		if c.tb == nil {
			args := append([]string{"--standalone", "--nproc_per_node", strconv.Itoa(c.nproc), restarts}, trainer...)
			cmd = exec.Command(spec.ddprun, args...)
			cmd.Env = os.Environ()
		} else {
			args := append([]string{"--nnodes", strconv.Itoa(c.nodes()), "--node_rank", strconv.Itoa(node),
				"--nproc_per_node", strconv.Itoa(c.nproc / c.nodes()), "--master_addr", c.tb.Addr(0),
				"--master_port", strconv.Itoa(port), restarts}, trainer...)
			cmd = c.tb.Command(context.Background(), node, spec.ddprun, args...)
			cmd.Env = append(cmd.Env, "GODDP_TOKEN="+c.token)
		}
		cmd.Env = append(cmd.Env, spec.env...)
		// Its own process group, killed with this process if it dies.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		pr, pw, err := os.Pipe()
		if err != nil {
			r.stop()
			return nil, err
		}
		cmd.Stdout, cmd.Stderr = pw, pw
		if err := cmd.Start(); err != nil {
			pr.Close()
			pw.Close()
			r.stop()
			return nil, fmt.Errorf("%s: starting node %d's ddprun: %w", name, node, err)
		}
		pw.Close()
		r.cmds = append(r.cmds, cmd)
		r.nodes[cmd.Process.Pid] = node
		readers.Add(1)
		go func() {
			defer readers.Done()
			defer pr.Close()
			sc := bufio.NewScanner(pr)
			sc.Buffer(make([]byte, 64<<10), 1<<20)
			for sc.Scan() {
				line := sc.Text()
				r.observe(node, line, time.Now())
				logMu.Lock()
				fmt.Fprintf(log, "[node%d %s] %s\n", node, time.Now().UTC().Format("15:04:05.000"), line)
				logMu.Unlock()
			}
			io.Copy(io.Discard, pr)
		}()
	}
	go func() {
		var first error
		for node, cmd := range r.cmds {
			if err := cmd.Wait(); err != nil && first == nil {
				first = fmt.Errorf("node %d's ddprun: %w", node, err)
			}
		}
		readers.Wait()
		r.mu.Lock()
		r.err, r.elapsed = first, time.Since(r.start)
		r.mu.Unlock()
		close(r.done)
	}()
	return r, nil
}

// stop ends a round's launchers, if still running: SIGTERM to each one's process group (the
// launcher stops its ranks), SIGKILL after 20 s; and waits for them.
func (r *round) stop() {
	for _, cmd := range r.cmds {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
	}
	if len(r.cmds) == 0 {
		return
	}
	select {
	case <-r.done:
	case <-time.After(20 * time.Second):
		for _, cmd := range r.cmds {
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		}
		<-r.done
	}
}

// procs returns the round's live launchers and ranks.
func (r *round) procs() ([]proc, error) {
	var out []proc
	for pid, node := range r.nodes {
		_, state, start, err := statOf(pid)
		if err != nil || state == 'Z' {
			continue
		}
		out = append(out, proc{pid: pid, start: start, rank: -1, node: node})
	}
	ranks, err := children(r.nodes)
	if err != nil {
		return nil, err
	}
	return append(out, ranks...), nil
}

// errGaveUp is a round whose launcher spent its restarts.
var errGaveUp = errors.New("ddprun gave up (--max_restarts spent)")
