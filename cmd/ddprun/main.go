package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/goddp/goddp/internal/openblascore"
	"github.com/goddp/goddp/internal/outpath"
	"github.com/goddp/goddp/procgroup"
)

func main() {
	os.Exit(mainExit(os.Args[1:]))
}

// interruptError is the cause of the run's context when ddprun receives a signal.
type interruptError struct{ sig os.Signal }

func (e *interruptError) Error() string { return "interrupted by " + e.sig.String() }

// mainExit runs ddprun with the process's signals, environment and standard streams.
func mainExit(args []string) int {
	sigs := make(chan os.Signal, 1) // signal.Notify needs a buffer: it does not block to deliver
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT)
	defer signal.Stop(sigs)
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		select {
		case s := <-sigs:
			cancel(&interruptError{s})
		case <-stop:
		}
	}()
	code := run(ctx, args, os.Environ(), os.Stdout, os.Stderr)
	close(stop)
	<-done
	return code
}

// run is ddprun: it parses args, prepares the program and the store, and runs the group,
// restarting it on failure. env is the environment the ranks inherit. It returns the exit
// code: 0 when every rank succeeded, 2 for a bad command line, the first failed rank's code
// (128+N for signal N) when ddprun gives up, 128+N when ddprun itself got signal N, and 1 for
// any other error.
func run(ctx context.Context, args, env []string, stdout, stderr io.Writer) int {
	con := &console{out: stdout, err: stderr}
	cfg, err := parseArgs(args, func(w string) { con.msg("ddprun: warning: " + w + "\n") })
	switch {
	case errors.Is(err, flag.ErrHelp):
		printUsage(stdout)
		return 0
	case err != nil:
		con.msg(fmt.Sprintf("ddprun: %v\nRun 'ddprun --help' for usage.\n", err))
		return 2
	}
	if err := runJob(ctx, cfg, env, con); err != nil {
		var ex *exitError
		if errors.As(err, &ex) {
			return ex.code
		}
		con.msg(fmt.Sprintf("ddprun: %v\n", err))
		return 1
	}
	return 0
}

// exitError ends the job with a specific exit code; its message has been printed already.
type exitError struct{ code int }

func (e *exitError) Error() string { return fmt.Sprintf("exit code %d", e.code) }

// interruptCode is the exit code for a job stopped by ctx: 128+signal, or 1.
func interruptCode(ctx context.Context) int {
	var ie *interruptError
	if errors.As(context.Cause(ctx), &ie) {
		if s, ok := ie.sig.(syscall.Signal); ok {
			return 128 + int(s)
		}
	}
	return 1
}

// runJob prepares the program, the token and the store, then runs attempts until one
// succeeds, ddprun is interrupted, or --max_restarts is spent.
func runJob(ctx context.Context, cfg *config, env []string, con *console) error {
	if err := checkOutputs(cfg); err != nil {
		return err
	}
	host, _ := os.Hostname()
	workDir, err := os.MkdirTemp("", "ddprun-")
	if err != nil {
		return fmt.Errorf("work dir: %w", err)
	}
	defer os.RemoveAll(workDir)

	tags, _ := lookupEnv(env, "GODDP_GO_TAGS")
	exe, err := resolveProgram(ctx, cfg.program, workDir, cfg.goBuildFlags, tags, con)
	if err != nil {
		return orInterrupt(ctx, err)
	}
	token, tokenFile, runID, err := jobToken(cfg, env, workDir)
	if err != nil {
		return err
	}
	if err := cfg.loadTLS(env); err != nil { // tls.go
		return err
	}

	j := &job{cfg: cfg, exe: exe, baseEnv: env, tokenFile: tokenFile, runID: runID, host: host, con: con, token: token}
	if cfg.elastic {
		return j.runElastic(ctx) // elastic.go
	}
	closeStore, err := j.connectStore(ctx)
	if err != nil {
		return err
	}
	defer closeStore()
	if cfg.nproc > 1 {
		setDefaultThreads(j, con)
	}
	setCoreType(j, con, openblascore.Host())
	setGoMaxProcs(j, con, runtime.NumCPU())
	if cfg.traceMerge != "" {
		merge, err := j.setupTraceMerge(workDir)
		if err != nil {
			return err
		}
		defer merge() // before the work directory is removed
	}
	var coord *coordinator
	if cfg.nnodes > 1 {
		var closeCoord func()
		if coord, closeCoord, err = j.newCoordinator(ctx); err != nil {
			return err
		}
		defer closeCoord()
	}

	for attempt := 0; ; attempt++ {
		res, err := j.attemptAcrossNodes(ctx, coord, attempt)
		if err != nil {
			return err
		}
		code, end, err := j.outcome(ctx, res, attempt)
		if end {
			return err
		}
		if attempt >= cfg.maxRestarts {
			if cfg.maxRestarts > 0 {
				con.msg(fmt.Sprintf("ddprun: giving up after %d restarts\n", cfg.maxRestarts))
			}
			return &exitError{code}
		}
		con.msg(fmt.Sprintf("ddprun: restarting the group (restart %d of %d)\n", attempt+1, cfg.maxRestarts))
	}
}

// checkOutputs checks the output paths before the run: a bad one fails now, not after it.
// With several nodes only node 0 writes the merged trace.
func checkOutputs(cfg *config) error {
	if cfg.isStoreHost() {
		if err := outpath.File("--trace_merge", cfg.traceMerge); err != nil {
			return err
		}
	}
	return outpath.Dir("--log_dir", cfg.logDir)
}

// orInterrupt is err, or the exit of an interrupted job when ctx has ended (err is then
// its consequence).
func orInterrupt(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return &exitError{interruptCode(ctx)}
	}
	return err
}

// jobToken returns the job's token (with several nodes the one they share, otherwise a new
// one), the file in workDir that passes it to the ranks, and the run ID.
func jobToken(cfg *config, env []string, workDir string) (token, file, runID string, err error) {
	if cfg.nnodes > 1 || cfg.elastic {
		token, err = sharedToken(env)
	} else {
		token, err = newToken()
	}
	if err != nil {
		return "", "", "", err
	}
	if file, err = writeTokenFile(workDir, token); err != nil {
		return "", "", "", err
	}
	runID = cfg.rdzvID
	if runID == "" {
		if runID, err = deriveRunID(token, cfg.nnodes > 1 || cfg.elastic); err != nil {
			return "", "", "", err
		}
	}
	return token, file, runID, nil
}

// connectStore sets j.storeAddr: on the store host it serves the store (closeStore stops
// it), elsewhere it waits until the store host's store answers.
func (j *job) connectStore(ctx context.Context) (closeStore func(), err error) {
	cfg := j.cfg
	if cfg.isStoreHost() {
		srv, addr, err := hostStore(cfg, j.token, storeLogger(j.con))
		if err != nil {
			return nil, err
		}
		j.storeAddr = addr
		return func() { srv.Close() }, nil
	}
	j.storeAddr = net.JoinHostPort(cfg.storeHost, strconv.Itoa(cfg.storePort))
	if err := awaitStore(ctx, j.storeAddr, j.token, cfg.tls.client, cfg.rdzvTimeout, j.con); err != nil {
		return nil, orInterrupt(ctx, err)
	}
	return func() {}, nil
}

// newCoordinator dials the store for the coordinator of a job on several nodes (closeCoord
// closes the connection) and, with --trace_merge, estimates this node's clock offset to
// node 0.
func (j *job) newCoordinator(ctx context.Context) (coord *coordinator, closeCoord func(), err error) {
	cfg := j.cfg
	st, err := procgroup.DialStore(ctx, j.storeAddr, j.token, procgroup.DialOptions{TLS: cfg.tls.client})
	if err != nil {
		return nil, nil, fmt.Errorf("rendezvous store: %w", err)
	}
	coord = &coordinator{st: st, prefix: j.runID + "/ddprun", nnodes: cfg.nnodes, node: cfg.nodeRank, timeout: cfg.rdzvTimeout,
		host: j.host, warn: func(m string) { j.con.msg(m + "\n") }}
	if cfg.traceMerge != "" {
		j.traceCoord = coord
		if err := j.syncClocks(ctx); err != nil {
			st.Close()
			return nil, nil, fmt.Errorf("--trace_merge: clock offset to node 0: %w", err)
		}
	}
	return coord, func() { st.Close() }, nil
}

// attemptAcrossNodes is runAttempt for a job on one node or, with coord, on several: it
// first joins the attempt's rendezvous, and after the attempt publishes this node's verdict
// or agrees with the other nodes that the attempt succeeded.
func (j *job) attemptAcrossNodes(ctx context.Context, coord *coordinator, attempt int) (attemptResult, error) {
	if coord == nil {
		return j.runAttempt(ctx, attempt, nil), nil
	}
	if err := coord.join(ctx, attempt); err != nil {
		return attemptResult{}, orInterrupt(ctx, fmt.Errorf("rendezvous: %w", err))
	}
	remote, stopWatch := coord.watch(ctx, attempt)
	defer stopWatch()
	res := j.runAttempt(ctx, attempt, remote)
	node, host := j.cfg.nodeRank, j.host
	switch {
	case res.interrupted:
		coord.publish(ctx, attempt, fmt.Sprintf("stop node %d (host %s) was interrupted", node, host))
	case res.startErr != nil:
		coord.publish(ctx, attempt, fmt.Sprintf("stop node %d (host %s) could not start its ranks", node, host))
	case res.first != nil:
		coord.publish(ctx, attempt, verdictFor(res.first, host, node))
	case res.remote == "":
		v, err := coord.finish(ctx, attempt, remote)
		if err != nil && ctx.Err() == nil {
			return res, fmt.Errorf("rendezvous after attempt %d: %w", attempt, err)
		}
		res.remote = v
		switch {
		case ctx.Err() != nil:
			coord.publish(ctx, attempt, fmt.Sprintf("stop node %d (host %s) was interrupted", node, host))
		case v == "":
			coord.leave(ctx, attempt)
		}
	}
	return res, nil
}

// outcome reports how an attempt ended: end with the job's result (nil: it succeeded), or
// the exit code of a failed attempt, which a restart may follow.
func (j *job) outcome(ctx context.Context, res attemptResult, attempt int) (code int, end bool, err error) {
	switch {
	case res.interrupted || (res.first == nil && res.remote == "" && ctx.Err() != nil):
		j.con.msg(fmt.Sprintf("ddprun: %v; stopped every rank\n", context.Cause(ctx)))
		return 0, true, &exitError{interruptCode(ctx)}
	case res.startErr != nil:
		return 0, true, fmt.Errorf("attempt %d: %w", attempt, res.startErr)
	case res.first != nil:
		j.reportFailure(res.first, attempt)
		return res.first.exitCode(), false, nil
	case res.remote != "":
		c, desc, stop := parseVerdict(res.remote)
		if stop {
			j.con.msg(fmt.Sprintf("ddprun: attempt %d stopped: %s; stopped this node's ranks\n", attempt, desc))
			return 0, true, &exitError{1}
		}
		j.con.msg(fmt.Sprintf("ddprun: attempt %d failed on another node: %s; stopped this node's ranks\n", attempt, desc))
		return c, false, nil
	}
	return 0, true, nil
}

// reportFailure prints the first failure of an attempt: rank, host, how it ended, and its
// last lines.
func (j *job) reportFailure(p *rankProc, attempt int) {
	msg := fmt.Sprintf("ddprun: rank %d (local_rank %d, host %s, pid %d) failed on attempt %d: %s\n",
		p.rank, p.localRank, j.host, p.cmd.Process.Pid, attempt, p.describe())
	if j.cfg.elastic { // its rank came from the rendezvous, and ddprun does not know it
		msg = fmt.Sprintf("ddprun: local rank %d (host %s, pid %d) failed on attempt %d: %s\n",
			p.localRank, j.host, p.cmd.Process.Pid, attempt, p.describe())
	}
	printed := false
	for i, name := range []string{"stdout", "stderr"} {
		lines := p.tails[i].get()
		if len(lines) == 0 {
			continue
		}
		printed = true
		msg += fmt.Sprintf("ddprun: last %d lines of rank %d's %s:\n", len(lines), p.rank, name)
		for _, l := range lines {
			msg += "    " + l + "\n"
		}
	}
	if !printed {
		msg += fmt.Sprintf("ddprun: rank %d printed nothing\n", p.rank)
	}
	if j.cfg.logDir != "" {
		msg += fmt.Sprintf("ddprun: full logs in %s\n", filepath.Join(j.cfg.logDir, fmt.Sprintf("attempt_%d", attempt), strconv.Itoa(p.rank)))
	}
	j.con.msg(msg)
}

// addEnv adds KEY=VALUE to the ranks' environment, without writing into an array that the
// caller's environment slice may share.
func (j *job) addEnv(kv string) {
	j.baseEnv = append(j.baseEnv[:len(j.baseEnv):len(j.baseEnv)], kv)
}

// setDefaultThreads sets OMP_NUM_THREADS and OPENBLAS_NUM_THREADS to 1 for the ranks unless
// the environment sets them, as torchrun does for OMP_NUM_THREADS: several ranks on one
// node, each with a thread per core, oversubscribe the CPUs. It says so in one line.
func setDefaultThreads(j *job, con *console) {
	var set []string
	for _, k := range []string{"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"} {
		if !hasEnv(j.baseEnv, k) {
			j.addEnv(k + "=1")
			set = append(set, k+"=1")
		}
	}
	if len(set) > 0 {
		con.msg(fmt.Sprintf("ddprun: setting %s for each rank (set them yourself to change this)\n", strings.Join(set, " ")))
	}
}

// validGoMaxProcs reports whether v is a --gomaxprocs value.
func validGoMaxProcs(v string) bool {
	if v == "keep" || v == "split" {
		return true
	}
	n, err := strconv.Atoi(v)
	return err == nil && n > 0
}

// setGoMaxProcs sets GOMAXPROCS for the ranks as --gomaxprocs says, unless the environment
// sets it: keep (the default) leaves Go's own choice, every core; split gives each of this
// node's ranks cpus/nproc of them (at least one); a number is taken as it is. It says so in
// one line. keep is the default because split measured slower on the development VM (2
// ranks on 2 cores: 8-12% more per step): a rank's collectives run on goroutines that then
// wait for its compute, where with every core they run beside it.
func setGoMaxProcs(j *job, con *console, cpus int) {
	v := j.cfg.gomaxprocs
	if v == "keep" || hasEnv(j.baseEnv, "GOMAXPROCS") {
		return
	}
	why := "--gomaxprocs"
	if v == "split" {
		v = strconv.Itoa(max(1, cpus/j.cfg.nproc))
		why = fmt.Sprintf("--gomaxprocs split: %d cores, %d ranks on this node", cpus, j.cfg.nproc)
	}
	j.addEnv("GOMAXPROCS=" + v)
	con.msg(fmt.Sprintf("ddprun: setting GOMAXPROCS=%s for each rank (%s)\n", v, why))
}

// setCoreType sets OPENBLAS_CORETYPE for the ranks, unless the environment sets it, to the
// OpenBLAS kernels that suit this CPU (package openblascore): Debian's OpenBLAS 0.3.21 takes
// a recent Xeon for a Prescott and runs several times slower. It says so in one line.
func setCoreType(j *job, con *console, f openblascore.Features) {
	ct := openblascore.CoreType(f)
	if ct == "" || hasEnv(j.baseEnv, "OPENBLAS_CORETYPE") {
		return
	}
	j.addEnv("OPENBLAS_CORETYPE=" + ct)
	con.msg(fmt.Sprintf("ddprun: setting OPENBLAS_CORETYPE=%s for each rank, the OpenBLAS kernels for this CPU (set it yourself to change this)\n", ct))
}

// lookupEnv returns the value env (KEY=VALUE entries) gives key: its last entry's, as for a
// process.
func lookupEnv(env []string, key string) (string, bool) {
	for i := len(env) - 1; i >= 0; i-- {
		if v, ok := strings.CutPrefix(env[i], key+"="); ok {
			return v, true
		}
	}
	return "", false
}

// hasEnv reports whether env (KEY=VALUE entries) sets key.
func hasEnv(env []string, key string) bool {
	_, ok := lookupEnv(env, key)
	return ok
}

// storeLogger logs the store's warnings and errors to the console.
func storeLogger(con *console) *zap.Logger {
	enc := zapcore.NewConsoleEncoder(zapcore.EncoderConfig{
		MessageKey: "msg", LevelKey: "level", NameKey: "logger",
		EncodeLevel: zapcore.LowercaseLevelEncoder,
	})
	return zap.New(zapcore.NewCore(enc, zapcore.AddSync(consoleWriter{con}), zapcore.WarnLevel)).Named("ddprun.store")
}

// consoleWriter adapts the console to an io.Writer for the logger.
type consoleWriter struct{ con *console }

func (w consoleWriter) Write(b []byte) (int, error) {
	w.con.msg(string(b))
	return len(b), nil
}
