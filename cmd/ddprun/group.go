package main

import (
	"context"
	"errors"
	"fmt"
	"github.com/goddp/goddp/procgroup"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// job is what every attempt shares: the program, the store, the environment.
type job struct {
	cfg       *config
	exe       string   // the resolved executable
	baseEnv   []string // environment the ranks inherit (before ddprun's variables)
	storeAddr string   // host:port the ranks dial
	nodeName  string   // an elastic job's name for this node (elastic.go)
	tokenFile string
	runID     string // prefix of GODDP_RUN_ID; the attempt number is appended
	host      string // this node's hostname, for reports
	con       *console
	token     string // the job token, for ddprun's own store connections

	// With --trace_merge on several nodes (Note [Clocks across nodes]): the coordinator
	// (its store is dialed anew at the merge) and this node's clock offset to node 0.
	traceCoord *coordinator
	clock      clockEstimate
}

// rankProc is one running rank.
type rankProc struct {
	rank, localRank int
	cmd             *exec.Cmd
	tails           [2]tail    // last lines of stdout and stderr
	files           []*os.File // log files, closed once output is drained

	mu     sync.Mutex // guards reaped
	reaped bool       // the process has been waited for: its pid may be reused

	// Set by the waiter goroutine before it reports the rank on the events channel.
	state   *os.ProcessState
	waitErr error
	logErr  error // first log-file write error
}

// signal sends sig to the rank's process group, unless the rank has been reaped already.
func (p *rankProc) signal(sig syscall.Signal) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.reaped {
		signalGroup(p.cmd.Process.Pid, sig) //nolint:errcheck // ESRCH: the group is gone already
	}
}

// failed reports whether the rank ended unsuccessfully.
func (p *rankProc) failed() bool {
	return p.waitErr != nil || p.state == nil || !p.state.Success()
}

// killedBy reports whether the rank was killed by sig.
func (p *rankProc) killedBy(sig syscall.Signal) bool {
	if p.state == nil {
		return false
	}
	ws, ok := p.state.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == sig
}

// exitCode is the code ddprun exits with when this rank's failure ends the job: the rank's
// exit code, or 128+N for a rank killed by signal N (as a shell reports it).
func (p *rankProc) exitCode() int {
	if p.state == nil {
		return 1
	}
	if ws, ok := p.state.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	if c := p.state.ExitCode(); c > 0 {
		return c
	}
	return 1
}

// describe says how the rank ended: "exit code 3" or "killed by signal 9 (killed)".
func (p *rankProc) describe() string {
	if p.state == nil {
		return fmt.Sprintf("wait: %v", p.waitErr)
	}
	if ws, ok := p.state.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return fmt.Sprintf("killed by signal %d (%v)", int(ws.Signal()), ws.Signal())
	}
	return fmt.Sprintf("exit code %d", p.state.ExitCode())
}

// attemptResult is how one attempt of the group ended.
type attemptResult struct {
	first       *rankProc // the first rank to fail; nil if none did
	interrupted bool      // ddprun was asked to stop
	startErr    error     // a rank could not be started
	remote      string    // another node's failure verdict (Note [Multi-node restarts])
}

// rankEnv is the environment of one rank: the job's base environment without the variables
// ddprun sets, followed by them.
func (j *job) rankEnv(p *rankProc, attempt int) []string {
	c := j.cfg
	world := c.nnodes * c.nproc
	host, port := splitHostPortLoose(j.storeAddr)
	set := j.elasticEnv(p, attempt)
	if !c.elastic {
		set = [][2]string{
			{"RANK", strconv.Itoa(p.rank)},
			{"WORLD_SIZE", strconv.Itoa(world)},
			{"LOCAL_RANK", strconv.Itoa(p.localRank)},
			{"LOCAL_WORLD_SIZE", strconv.Itoa(c.nproc)},
			{"GROUP_RANK", strconv.Itoa(c.nodeRank)},
			{"GROUP_WORLD_SIZE", strconv.Itoa(c.nnodes)},
			{"ROLE_RANK", strconv.Itoa(p.rank)},
			{"ROLE_WORLD_SIZE", strconv.Itoa(world)},
			{"ROLE_NAME", "default"},
			{"MASTER_ADDR", host},
			{"MASTER_PORT", port},
			{"TORCHELASTIC_RESTART_COUNT", strconv.Itoa(attempt)},
			{"TORCHELASTIC_MAX_RESTARTS", strconv.Itoa(c.maxRestarts)},
			{"TORCHELASTIC_RUN_ID", j.runID},
			{"GODDP_STORE_ADDR", j.storeAddr},
			{"GODDP_TOKEN_FILE", j.tokenFile},
			{"GODDP_RUN_ID", fmt.Sprintf("%s-attempt%d", j.runID, attempt)},
		}
	}
	// The ranks' set-up bound follows --rdzv_timeout unless the environment sets its own.
	if !hasEnv(j.baseEnv, procgroup.ConnectTimeoutEnv) {
		set = append(set, [2]string{procgroup.ConnectTimeoutEnv, c.rdzvTimeout.String()})
	}
	// GODDP_TLS_* (tls.go)
	set = append(set, j.cfg.tls.env()...)
	drop := map[string]bool{"GODDP_TOKEN": true} // the token travels only in the file
	if c.elastic {                               // an elastic rank's place comes from the rendezvous, not from these
		for _, k := range []string{"RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} {
			drop[k] = true
		}
	}
	for _, kv := range set {
		drop[kv[0]] = true
	}
	env := make([]string, 0, len(j.baseEnv)+len(set)+2)
	for _, kv := range j.baseEnv {
		k, _, _ := strings.Cut(kv, "=")
		if !drop[k] {
			env = append(env, kv)
		}
	}
	for _, kv := range set {
		env = append(env, kv[0]+"="+kv[1])
	}
	return env
}

// runAttempt starts every rank of this node, waits for them, and on the first failure (or
// when ctx ends) stops the rest: SIGTERM to each rank's process group, then SIGKILL after
// --stop_timeout. It returns once every rank has been reaped and its output drained.
//
// remote, nil for a single node, yields another node's failure verdict: the local ranks are
// then stopped too.
func (j *job) runAttempt(ctx context.Context, attempt int, remote <-chan string) attemptResult {
	c := j.cfg
	// Buffered so that every waiter can report without blocking, whatever the loop below
	// is doing; each rank reports exactly once.
	events := make(chan *rankProc, c.nproc)
	var wg sync.WaitGroup
	defer wg.Wait()
	var procs []*rankProc
	var res attemptResult

	for local := 0; local < c.nproc; local++ {
		p := &rankProc{rank: c.nodeRank*c.nproc + local, localRank: local}
		if err := j.start(p, attempt, events, &wg); err != nil {
			res.startErr = fmt.Errorf("rank %d: %w", p.rank, err)
			break
		}
		procs = append(procs, p)
	}

	stopAll := func(sig syscall.Signal) {
		for _, p := range procs {
			p.signal(sig)
		}
	}
	var kill *time.Timer
	var killC <-chan time.Time
	stopping := false
	sentKill := false // ddprun has sent SIGKILL to the ranks
	beginStop := func() {
		if stopping {
			return
		}
		stopping = true
		stopAll(syscall.SIGTERM)
		kill = time.NewTimer(c.stopTimeout)
		killC = kill.C
	}
	if res.startErr != nil {
		beginStop()
	}
	defer func() {
		if kill != nil {
			kill.Stop()
		}
	}()

	done := ctx.Done()
	for left := len(procs); left > 0; {
		select {
		case p := <-events:
			left--
			if p.logErr != nil {
				j.con.msg(fmt.Sprintf("ddprun: rank %d: log file: %v\n", p.rank, p.logErr))
			}
			if p.failed() && !stopping {
				res.first = p
				beginStop()
			} else if p.failed() && res.first != nil && !sentKill && p.killedBy(syscall.SIGKILL) && !res.first.killedBy(syscall.SIGKILL) {
				// The first rank to be reported failed with an error (a lost peer, say),
				// and this one, reported after it, died of a SIGKILL that ddprun did not
				// send: that death is the likely cause, since a killed rank's output is
				// drained before it is reported and its peers can fail first.
				res.first = p
			} else if p.failed() && res.remote != "" && res.first == nil && killC != nil && p.killedBy(syscall.SIGKILL) {
				// Stopping for another node's failure, this node only sent SIGTERM, yet
				// the rank died of SIGKILL: it was killed before, and that death is
				// likely what the other node saw (its peer lost). Report it as this
				// node's own failure: a rank's output is drained before it is
				// reported, so the other node's verdict can arrive first.
				res.first, res.remote = p, ""
			}
		case v := <-remote:
			remote = nil
			if !stopping {
				res.remote = v
				beginStop()
			}
		case <-done:
			done = nil
			res.interrupted = true
			beginStop()
		case <-killC:
			killC = nil
			sentKill = true
			j.con.msg(fmt.Sprintf("ddprun: ranks still running %v after SIGTERM; sending SIGKILL\n", c.stopTimeout))
			stopAll(syscall.SIGKILL)
		}
	}
	return res
}

// start launches one rank and the goroutines that pump its output and wait for it; the
// waiter reports the rank on events once it has been reaped and its output drained.
func (j *job) start(p *rankProc, attempt int, events chan<- *rankProc, wg *sync.WaitGroup) error {
	c := j.cfg
	prefix := fmt.Sprintf("[rank%d]: ", p.rank)
	if c.elastic { // the ranks come from the rendezvous, and change
		prefix = fmt.Sprintf("[local%d]: ", p.localRank)
	}
	sinks := [2]*sink{
		{s: streamStdout, prefix: prefix, tail: &p.tails[streamStdout]},
		{s: streamStderr, prefix: prefix, tail: &p.tails[streamStderr]},
	}
	for i, k := range sinks {
		if c.logDir == "" || c.tee&(teeMode(1)<<i) != 0 {
			k.console = j.con
		}
	}
	closeAll := func(fs []*os.File) {
		for _, f := range fs {
			f.Close()
		}
	}
	if c.logDir != "" {
		dir := filepath.Join(c.logDir, fmt.Sprintf("attempt_%d", attempt), strconv.Itoa(p.rank))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("log dir: %w", err)
		}
		for i, name := range []string{"stdout.log", "stderr.log"} {
			f, err := os.OpenFile(filepath.Join(dir, name), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
			if err != nil {
				closeAll(p.files)
				return fmt.Errorf("log file: %w", err)
			}
			p.files = append(p.files, f)
			sinks[i].file = f
		}
	}

	var readers, writers []*os.File
	for range 2 {
		r, w, err := os.Pipe()
		if err != nil {
			closeAll(readers)
			closeAll(writers)
			closeAll(p.files)
			return fmt.Errorf("pipe: %w", err)
		}
		readers, writers = append(readers, r), append(writers, w)
	}
	p.cmd = &exec.Cmd{
		Path:        j.exe,
		Args:        append([]string{j.exe}, c.args...),
		Env:         j.rankEnv(p, attempt),
		Stdin:       nil, // /dev/null: ranks do not share ddprun's terminal input
		Stdout:      writers[0],
		Stderr:      writers[1],
		SysProcAttr: rankSysProcAttr(),
	}
	err := p.cmd.Start()
	closeAll(writers) // the child holds its copies; EOF comes when it (and its children) exit
	if err != nil {
		closeAll(readers)
		closeAll(p.files)
		return fmt.Errorf("start %s: %w", j.exe, err)
	}

	var pumps sync.WaitGroup
	var logErrs [2]error
	for i := range 2 {
		pumps.Add(1)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer pumps.Done()
			logErrs[i] = pump(readers[i], sinks[i])
			readers[i].Close()
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		pid := p.cmd.Process.Pid
		// Note [Reaping]: wait for the exit without reaping, kill whatever the rank left
		// running in its process group (nothing outlives its rank, and the pipes reach
		// EOF), then reap. Until the reap the pid cannot be reused, so neither this kill
		// nor a concurrent stop signal can hit an unrelated process.
		if err := waitExited(pid); err == nil {
			signalGroup(pid, syscall.SIGKILL) //nolint:errcheck // ESRCH: nothing left
		}
		p.mu.Lock()
		p.waitErr = p.cmd.Wait()
		p.reaped = true
		p.mu.Unlock()
		p.state = p.cmd.ProcessState
		var ee *exec.ExitError
		if errors.As(p.waitErr, &ee) {
			p.waitErr = nil // described by state
		}
		// A process that left the rank's process group (setsid) can still hold the
		// pipes open; stop reading after a grace period rather than wait for it.
		drained := make(chan struct{})
		wg.Add(1)
		go func() {
			defer wg.Done()
			pumps.Wait()
			close(drained)
		}()
		grace := time.NewTimer(j.cfg.stopTimeout)
		select {
		case <-drained:
		case <-grace.C:
			j.con.msg(fmt.Sprintf("ddprun: rank %d exited but a process it started still holds its output open; no longer reading it\n", p.rank))
			closeAll(readers)
			<-drained
		}
		grace.Stop()
		closeAll(p.files)
		p.logErr = errors.Join(logErrs[0], logErrs[1])
		events <- p
	}()
	return nil
}

// splitHostPortLoose splits host:port, returning the whole address as host on error.
func splitHostPortLoose(addr string) (string, string) {
	i := strings.LastIndexByte(addr, ':')
	if i < 0 {
		return addr, ""
	}
	return strings.Trim(addr[:i], "[]"), addr[i+1:]
}
