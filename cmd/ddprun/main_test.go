package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	switch os.Getenv(roleEnv) {
	case "rank":
		os.Exit(helperMain(os.Args[1:]))
	case "ddprun":
		os.Setenv(roleEnv, "rank") // what its ranks inherit
		os.Exit(mainExit(os.Args[1:]))
	}
	goleak.VerifyTestMain(m)
}

// self is the test binary, which the tests launch as ranks.
func self(t *testing.T) string {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return exe
}

func rankEnvBase(extra ...string) []string {
	return append(append(os.Environ(), roleEnv+"=rank", "OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1"), extra...)
}

type result struct {
	code           int
	stdout, stderr string
}

// launch runs ddprun in-process with flags, then the helper with helperArgs.
func launch(t *testing.T, ctx context.Context, env []string, flags []string, helperArgs ...string) result {
	t.Helper()
	var out, errb syncBuffer
	args := append(append(append([]string{}, flags...), self(t)), helperArgs...)
	code := run(ctx, args, env, &out, &errb)
	return result{code, out.String(), errb.String()}
}

var pidRE = regexp.MustCompile(`(?m)(?:pid|grandchild)=(\d+)$`)

// pids returns every pid a helper printed.
func pids(t *testing.T, out string) []int {
	t.Helper()
	var ps []int
	for _, m := range pidRE.FindAllStringSubmatch(out, -1) {
		p, _ := strconv.Atoi(m[1])
		ps = append(ps, p)
	}
	return ps
}

// alive reports whether pid is a live (not zombie) process.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || (s[i+2] != 'Z' && s[i+2] != 'X')
}

// assertDead fails if any pid is still alive. Processes killed with SIGKILL by a process
// that is already gone (Pdeathsig) may take a moment: it polls up to 10 s, a liveness bound,
// not a timing assertion.
func assertDead(t *testing.T, ps []int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for _, p := range ps {
		for alive(p) {
			if time.Now().After(deadline) {
				t.Errorf("process %d is still alive", p)
				syscall.Kill(p, syscall.SIGKILL)
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// rankLines groups "[rankN]: text" lines by N.
func rankLines(t *testing.T, out string) map[int][]string {
	t.Helper()
	re := regexp.MustCompile(`^\[rank(\d+)\]: (.*)$`)
	got := map[int][]string{}
	for _, l := range strings.Split(strings.TrimSuffix(out, "\n"), "\n") {
		if l == "" {
			continue
		}
		m := re.FindStringSubmatch(l)
		if m == nil {
			t.Fatalf("line without a rank prefix: %.200q", l)
		}
		r, _ := strconv.Atoi(m[1])
		got[r] = append(got[r], m[2])
	}
	return got
}

// envOf parses the env helper's KEY=VALUE set=BOOL lines.
func envOf(lines []string) map[string]string {
	env := map[string]string{}
	for _, l := range lines {
		if kv, ok := strings.CutSuffix(l, " set=true"); ok {
			k, v, _ := strings.Cut(kv, "=")
			env[k] = v
		}
	}
	return env
}

func TestEnvironmentAndStore(t *testing.T) {
	const n = 3
	res := launch(t, context.Background(), rankEnvBase("GODDP_TOKEN=should-not-leak"),
		[]string{"--nproc_per_node", strconv.Itoa(n), "--standalone"}, "env")
	if res.code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", res.code, res.stdout, res.stderr)
	}
	byRank := rankLines(t, res.stdout)
	var storeAddr, runID, tokenFile string
	for r := range n {
		env := envOf(byRank[r])
		want := map[string]string{
			"RANK": strconv.Itoa(r), "WORLD_SIZE": strconv.Itoa(n), "LOCAL_RANK": strconv.Itoa(r),
			"LOCAL_WORLD_SIZE": strconv.Itoa(n), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
			"ROLE_RANK": strconv.Itoa(r), "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": "1",
			"MASTER_ADDR": "127.0.0.1",
		}
		for k, v := range want {
			if env[k] != v {
				t.Errorf("rank %d: %s=%q, want %q", r, k, env[k], v)
			}
		}
		if _, ok := env["GODDP_TOKEN"]; ok {
			t.Errorf("rank %d: GODDP_TOKEN is in the environment; the token must only travel in the file", r)
		}
		if env["GODDP_STORE_ADDR"] != net.JoinHostPort(env["MASTER_ADDR"], env["MASTER_PORT"]) {
			t.Errorf("rank %d: GODDP_STORE_ADDR=%q, MASTER_ADDR=%q MASTER_PORT=%q", r, env["GODDP_STORE_ADDR"], env["MASTER_ADDR"], env["MASTER_PORT"])
		}
		if r == 0 {
			storeAddr, runID, tokenFile = env["GODDP_STORE_ADDR"], env["GODDP_RUN_ID"], env["GODDP_TOKEN_FILE"]
		} else if env["GODDP_STORE_ADDR"] != storeAddr || env["GODDP_RUN_ID"] != runID || env["GODDP_TOKEN_FILE"] != tokenFile {
			t.Errorf("rank %d disagrees with rank 0 on the store, run id or token file: %v", r, env)
		}
		if !strings.HasSuffix(env["GODDP_RUN_ID"], "-attempt0") {
			t.Errorf("rank %d: GODDP_RUN_ID=%q, want ...-attempt0", r, env["GODDP_RUN_ID"])
		}
		if !contains(byRank[r], "TOKEN_FILE_MODE=600") || !contains(byRank[r], "STORE_OK") {
			t.Errorf("rank %d: want TOKEN_FILE_MODE=600 and STORE_OK in %q", r, byRank[r])
		}
	}
	if _, err := os.Stat(tokenFile); err == nil {
		t.Errorf("token file %s left behind", tokenFile)
	}
	assertDead(t, pids(t, res.stdout))
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

func TestMultiNode(t *testing.T) {
	const nodes, per = 2, 2
	port := freePort(t)
	env := rankEnvBase("GODDP_TOKEN=" + strings.Repeat("ab", 32))
	results := make(chan result, nodes)
	for node := range nodes {
		go func() {
			var out, errb syncBuffer
			args := []string{"--nnodes", "2", "--node_rank", strconv.Itoa(node), "--nproc_per_node", strconv.Itoa(per),
				"--master_addr", "127.0.0.1", "--master_port", strconv.Itoa(port), self(t), "env"}
			code := run(context.Background(), args, env, &out, &errb)
			results <- result{code, out.String(), errb.String()}
		}()
	}
	seen := map[int]map[string]string{}
	for range nodes {
		res := <-results
		if res.code != 0 {
			t.Errorf("a node exited %d\nstdout:\n%s\nstderr:\n%s", res.code, res.stdout, res.stderr)
			continue
		}
		for r, lines := range rankLines(t, res.stdout) {
			seen[r] = envOf(lines)
			if !contains(lines, "STORE_OK") {
				t.Errorf("rank %d did not meet the others in the store: %q", r, lines)
			}
		}
	}
	for r := range nodes * per {
		env := seen[r]
		if env == nil {
			t.Errorf("rank %d never ran", r)
			continue
		}
		if env["RANK"] != strconv.Itoa(r) || env["LOCAL_RANK"] != strconv.Itoa(r%per) ||
			env["GROUP_RANK"] != strconv.Itoa(r/per) || env["WORLD_SIZE"] != "4" ||
			env["GODDP_STORE_ADDR"] != net.JoinHostPort("127.0.0.1", strconv.Itoa(port)) ||
			env["GODDP_RUN_ID"] != seen[0]["GODDP_RUN_ID"] {
			t.Errorf("rank %d: env %v", r, env)
		}
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func TestOutputPrefixed(t *testing.T) {
	const n, lines = 2, 300
	dir := t.TempDir()
	for _, tc := range []struct {
		name  string
		flags []string
		// which streams reach the console
		stdout, stderr bool
	}{
		{"console", nil, true, true},
		{"log_dir tee both", []string{"--log_dir", dir + "/a"}, true, true},
		{"log_dir tee stderr", []string{"--log_dir", dir + "/b", "--tee", "2"}, false, true},
		{"log_dir tee none", []string{"--log_dir", dir + "/c", "--tee=0"}, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			flags := append([]string{"--nproc_per_node=2", "--standalone"}, tc.flags...)
			res := launch(t, context.Background(), rankEnvBase(), flags, "lines", strconv.Itoa(lines))
			if res.code != 0 {
				t.Fatalf("exit %d\nstderr:\n%s", res.code, res.stderr)
			}
			check := func(stream string, out string, want func(r int) []string) {
				got := rankLines(t, out)
				for r := range n {
					w := want(r)
					if len(got[r]) != len(w) {
						t.Fatalf("%s of rank %d: %d lines, want %d", stream, r, len(got[r]), len(w))
					}
					for i := range w {
						if got[r][i] != w[i] {
							t.Fatalf("%s of rank %d, line %d: %.80q, want %.80q", stream, r, i, got[r][i], w[i])
						}
					}
				}
			}
			wantOut := func(r int) []string {
				w := []string{}
				for i := range lines {
					w = append(w, fmt.Sprintf("out %d %d %s", r, i, strings.Repeat("x", (i%5)*3000)))
				}
				return append(w, fmt.Sprintf("long %d %s", r, strings.Repeat("y", 200000)), fmt.Sprintf("last %d", r))
			}
			wantErr := func(r int) []string {
				w := []string{}
				for i := 0; i < lines; i += 10 {
					w = append(w, fmt.Sprintf("err %d %d", r, i))
				}
				return w
			}
			withPid := func(f func(int) []string, pidsOut string) func(int) []string {
				byRank := rankLines(t, pidsOut)
				return func(r int) []string { return append([]string{byRank[r][0]}, f(r)...) }
			}
			logOf := func(r int, name string) string {
				b, err := os.ReadFile(filepath.Join(tc.flags[1], "attempt_0", strconv.Itoa(r), name))
				if err != nil {
					t.Fatal(err)
				}
				return string(b)
			}
			if tc.stdout {
				check("stdout", res.stdout, withPid(wantOut, res.stdout))
			} else if res.stdout != "" {
				t.Errorf("stdout reached the console: %.200q", res.stdout)
			}
			ddprunMsgs := regexp.MustCompile(`(?m)^ddprun: .*\n`)
			rankErr := ddprunMsgs.ReplaceAllString(res.stderr, "")
			if tc.stderr {
				check("stderr", rankErr, wantErr)
			} else if rankErr != "" {
				t.Errorf("stderr reached the console: %.200q", rankErr)
			}
			if tc.flags != nil {
				for r := range n {
					out := strings.Split(strings.TrimSuffix(logOf(r, "stdout.log"), "\n"), "\n")
					if want := wantOut(r); len(out) != len(want)+1 || strings.Join(out[1:], "\n") != strings.Join(want, "\n") {
						t.Errorf("rank %d stdout.log: %d lines, want %d (pid line + %d)", r, len(out), len(want)+1, len(want))
					}
					if got, want := logOf(r, "stderr.log"), strings.Join(wantErr(r), "\n")+"\n"; got != want {
						t.Errorf("rank %d stderr.log = %.200q, want %.200q", r, got, want)
					}
				}
			}
		})
	}
}

func TestRankFailureStopsOthers(t *testing.T) {
	for _, tc := range []struct {
		mode     string
		wantCode int
		wantMsg  string
	}{
		{"fail", 7, "exit code 7"},
		{"fail-noterm", 7, "exit code 7"},
		{"selfkill", 128 + 9, "killed by signal 9"},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			res := launch(t, context.Background(), rankEnvBase(),
				[]string{"--nproc_per_node", "3", "--standalone", "--stop_timeout", "300ms"}, tc.mode, "1", "7")
			if res.code != tc.wantCode {
				t.Fatalf("exit %d, want %d\nstdout:\n%s\nstderr:\n%s", res.code, tc.wantCode, res.stdout, res.stderr)
			}
			for _, want := range []string{
				"ddprun: rank 1 (local_rank 1, host ", tc.wantMsg, "failed on attempt 0",
				"last 10 lines of rank 1's stdout:\n    step 5\n", "    step 14\nddprun: last 1 lines of rank 1's stderr:\n    fatal: boom\n",
			} {
				if !strings.Contains(res.stderr, want) {
					t.Errorf("stderr lacks %q:\n%s", want, res.stderr)
				}
			}
			if strings.Count(res.stderr, "failed on attempt") != 1 {
				t.Errorf("want exactly one failure report (the first):\n%s", res.stderr)
			}
			if tc.mode == "fail-noterm" && !strings.Contains(res.stderr, "sending SIGKILL") {
				t.Errorf("ranks ignoring SIGTERM, but no SIGKILL reported:\n%s", res.stderr)
			}
			ps := pids(t, res.stdout)
			if len(ps) != 3 {
				t.Fatalf("want 3 pids, got %v\n%s", ps, res.stdout)
			}
			assertDead(t, ps)
		})
	}
}

func TestMaxRestarts(t *testing.T) {
	logDir := t.TempDir()
	res := launch(t, context.Background(), rankEnvBase(),
		[]string{"--nproc_per_node", "2", "--standalone", "--max_restarts", "2", "--log_dir", logDir}, "flaky", "1")
	if res.code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", res.code, res.stdout, res.stderr)
	}
	if !strings.Contains(res.stderr, "exit code 5") || !strings.Contains(res.stderr, "restarting the group (restart 1 of 2)") ||
		strings.Contains(res.stderr, "restart 2 of 2") {
		t.Errorf("stderr:\n%s", res.stderr)
	}
	for r := range 2 {
		b, err := os.ReadFile(filepath.Join(logDir, "attempt_1", strconv.Itoa(r), "stdout.log"))
		if err != nil {
			t.Fatal(err)
		}
		if !regexp.MustCompile(`(?m)^ok run=[0-9a-f]+-attempt1$`).Match(b) {
			t.Errorf("rank %d attempt 1 stdout.log: %q", r, b)
		}
	}
	b, err := os.ReadFile(filepath.Join(logDir, "attempt_0", "1", "stderr.log"))
	if err != nil || string(b) != "flaky: failing on the first attempt\n" {
		t.Errorf("attempt_0/1/stderr.log = %q, %v", b, err)
	}
	if _, err := os.Stat(filepath.Join(logDir, "attempt_2")); err == nil {
		t.Error("a third attempt ran")
	}
}

func TestGivesUp(t *testing.T) {
	res := launch(t, context.Background(), rankEnvBase(),
		[]string{"--nproc_per_node", "2", "--standalone", "--max_restarts=1", "--stop_timeout=200ms"}, "fail", "0", "3")
	if res.code != 3 {
		t.Fatalf("exit %d, want 3\nstderr:\n%s", res.code, res.stderr)
	}
	for _, want := range []string{"failed on attempt 0", "failed on attempt 1", "giving up after 1 restarts"} {
		if !strings.Contains(res.stderr, want) {
			t.Errorf("stderr lacks %q:\n%s", want, res.stderr)
		}
	}
	assertDead(t, pids(t, res.stdout))
}

func TestGrandchildrenStopped(t *testing.T) {
	res := launch(t, context.Background(), rankEnvBase(), []string{"--nproc_per_node", "2", "--standalone", "--stop_timeout", "5s"}, "grandchild")
	if res.code != 0 {
		t.Fatalf("exit %d\nstderr:\n%s", res.code, res.stderr)
	}
	ps := pids(t, res.stdout)
	if len(ps) != 6 { // per rank: its pid, the grandchild's pid as seen by both
		t.Fatalf("want 6 pids, got %v:\n%s", ps, res.stdout)
	}
	assertDead(t, ps)
}

func TestInterrupt(t *testing.T) {
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	var out, errb syncBuffer
	code := make(chan int, 1)
	go func() {
		code <- run(ctx, []string{"--nproc_per_node", "2", "--standalone", self(t), "block"}, rankEnvBase(), &out, &errb)
	}()
	out.waitCount(t, "]: ready", 2)
	cancel(&interruptError{syscall.SIGINT})
	if c := <-code; c != 130 {
		t.Errorf("exit %d, want 130\nstderr:\n%s", c, errb.String())
	}
	if !strings.Contains(errb.String(), "interrupted by interrupt; stopped every rank") {
		t.Errorf("stderr:\n%s", errb.String())
	}
	assertDead(t, pids(t, out.String()))
}

// startDDPRun starts ddprun as its own process (the test binary in its ddprun role).
func startDDPRun(t *testing.T, args ...string) (*exec.Cmd, *syncBuffer, *syncBuffer) {
	t.Helper()
	cmd := exec.Command(self(t), args...)
	cmd.Env = append(os.Environ(), roleEnv+"=ddprun", "OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1")
	var out, errb syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd, &out, &errb
}

func TestCtrlC(t *testing.T) {
	cmd, out, errb := startDDPRun(t, "--nproc_per_node", "2", "--standalone", self(t), "block")
	out.waitCount(t, "]: ready", 2)
	cmd.Process.Signal(syscall.SIGINT)
	err := cmd.Wait()
	if cmd.ProcessState.ExitCode() != 130 {
		t.Errorf("ddprun: %v, want exit 130\nstderr:\n%s", err, errb.String())
	}
	assertDead(t, pids(t, out.String()))
}

func TestDDPRunKilled(t *testing.T) {
	cmd, out, _ := startDDPRun(t, "--nproc_per_node", "2", "--standalone", self(t), "block")
	out.waitCount(t, "]: ready", 2)
	cmd.Process.Kill() // no chance to clean up: Pdeathsig must take the ranks down
	cmd.Wait()
	ps := pids(t, out.String())
	if len(ps) != 2 {
		t.Fatalf("want 2 pids, got %v", ps)
	}
	assertDead(t, ps)
}

func TestBadInput(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	busyPort := strconv.Itoa(busy.Addr().(*net.TCPAddr).Port)
	notExec := filepath.Join(t.TempDir(), "data.txt")
	os.WriteFile(notExec, []byte("x"), 0o644)
	exe := self(t)
	for _, tc := range []struct {
		name string
		args []string
		env  []string
		code int
		msg  string
	}{
		{"unknown flag", []string{"--nproc_per_nod", "2", exe}, nil, 2, "flag provided but not defined: -nproc_per_nod"},
		{"missing program", []string{"--nproc_per_node", "2"}, nil, 2, "missing PROGRAM"},
		{"flag value missing", []string{"--nproc_per_node"}, nil, 2, "flag needs an argument"},
		{"nproc 0", []string{"--nproc_per_node", "0", exe}, nil, 2, "--nproc_per_node 0: want at least 1"},
		{"nproc word", []string{"--nproc_per_node", "two", exe}, nil, 2, `invalid value "two"`},
		{"node_rank out of range", []string{"--nnodes", "2", "--node_rank", "2", exe}, nil, 2, "--node_rank 2"},
		{"elastic range backwards", []string{"--nnodes", "3:2", exe}, nil, 2, "the range 3:2: want 1 <= MIN <= MAX"},
		{"elastic with node_rank", []string{"--nnodes", "1:2", "--node_rank", "0", exe}, nil, 2, "come from the rendezvous; drop it"},
		{"bad rdzv backend", []string{"--rdzv_backend", "etcd", exe}, nil, 2, `--rdzv_backend "etcd": want static or c10d`},
		{"elastic without token", []string{"--nnodes", "1:2", "--rdzv_endpoint", "127.0.0.1:" + strconv.Itoa(freePort(t)), exe}, nil, 1, "set GODDP_TOKEN or GODDP_TOKEN_FILE"},
		{"tee without log_dir", []string{"--tee", "1", exe}, nil, 2, "--tee needs --log_dir"},
		{"bad tee", []string{"--log_dir", t.TempDir(), "--tee", "4", exe}, nil, 2, "want 0 (none)"},
		{"standalone multi-node", []string{"--standalone", "--nnodes", "2", exe}, nil, 2, "--standalone is for one node"},
		{"bad endpoint", []string{"--rdzv_endpoint", "host:99999", exe}, nil, 2, "bad port"},
		{"program is a flag", []string{"--", "--oops"}, nil, 2, "looks like a flag"},
		{"nonexistent program", []string{"--standalone", "./no/such/prog"}, nil, 1, "no such file or directory"},
		{"not in PATH", []string{"--standalone", "no-such-command-xyz"}, nil, 1, "not found in PATH"},
		{"not executable", []string{"--standalone", notExec}, nil, 1, "is not executable"},
		{"port in use", []string{"--master_port", busyPort, exe, "env"}, nil, 1, "address already in use"},
		{"multi-node without token", []string{"--nnodes", "2", "--master_port", busyPort, exe}, nil, 1, "set GODDP_TOKEN or GODDP_TOKEN_FILE"},
		{"node 1 store unreachable", []string{"--nnodes", "2", "--node_rank", "1", "--master_port", strconv.Itoa(freePort(t)), "--rdzv_timeout", "300ms", exe},
			[]string{"GODDP_TOKEN=t"}, 1, "not reachable within 300ms"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb syncBuffer
			env := append(rankEnvBase(), tc.env...)
			code := run(context.Background(), tc.args, env, &out, &errb)
			if code != tc.code || !strings.Contains(errb.String(), tc.msg) {
				t.Errorf("exit %d, stderr %q; want exit %d and %q", code, errb.String(), tc.code, tc.msg)
			}
			if out.String() != "" {
				t.Errorf("no rank should have run; stdout %q", out.String())
			}
		})
	}
}

func TestHelpAndFlagsAfterProgram(t *testing.T) {
	var out, errb syncBuffer
	if code := run(context.Background(), []string{"--help"}, nil, &out, &errb); code != 0 || !strings.Contains(out.String(), "--nproc_per_node") {
		t.Errorf("--help: exit %d, stdout %q", code, out.String())
	}
	// A ddprun flag after PROGRAM goes to the program, with a warning; "--" after PROGRAM
	// is dropped once; dashed aliases work.
	c, err := parseArgs([]string{"--nproc-per-node=3", "prog", "--max_restarts", "2"}, func(w string) { errb.Write([]byte(w)) })
	if err != nil || c.nproc != 3 || c.program != "prog" || strings.Join(c.args, " ") != "--max_restarts 2" || c.maxRestarts != 0 {
		t.Errorf("parse: %+v, %v", c, err)
	}
	if !strings.Contains(errb.String(), `"--max_restarts" comes after PROGRAM`) {
		t.Errorf("no warning: %q", errb.String())
	}
	c, err = parseArgs([]string{"--standalone", "prog", "--", "--", "-x"}, func(w string) { t.Errorf("unexpected warning %s", w) })
	if err != nil || strings.Join(c.args, " ") != "-- -x" {
		t.Errorf("parse: %+v, %v", c, err)
	}
	c, err = parseArgs([]string{"--rdzv_endpoint", "node0:1234", "--nnodes", "2", "p"}, func(string) {})
	if err != nil || c.storeHost != "node0" || c.storePort != 1234 {
		t.Errorf("parse endpoint: %+v, %v", c, err)
	}
}

func TestGoPackage(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module example.com/hello\n\ngo 1.22\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "main.go"), []byte(`package main

import (
	"fmt"
	"os"
)

func main() { fmt.Println("built", os.Getenv("RANK"), os.Args[1:]) }
`), 0o644)
	res := launch2(t, []string{"--nproc_per_node", "2", "--standalone", dir, "--", "a", "b"})
	if res.code != 0 {
		t.Fatalf("exit %d\nstderr:\n%s", res.code, res.stderr)
	}
	got := rankLines(t, res.stdout)
	for r := range 2 {
		if want := fmt.Sprintf("built %d [a b]", r); len(got[r]) != 1 || got[r][0] != want {
			t.Errorf("rank %d: %q, want %q", r, got[r], want)
		}
	}
	bad := filepath.Join(t.TempDir(), "bad")
	os.MkdirAll(bad, 0o755)
	os.WriteFile(filepath.Join(bad, "go.mod"), []byte("module example.com/bad\n"), 0o644)
	os.WriteFile(filepath.Join(bad, "main.go"), []byte("package main\nfunc main() { undefined() }\n"), 0o644)
	res = launch2(t, []string{"--standalone", bad})
	if res.code != 1 || !strings.Contains(res.stderr, "go build") || !strings.Contains(res.stderr, "undefined") {
		t.Errorf("build failure: exit %d, stderr %q", res.code, res.stderr)
	}
}

// launch2 runs ddprun in-process with full args.
func launch2(t *testing.T, args []string) result {
	t.Helper()
	var out, errb syncBuffer
	code := run(context.Background(), args, rankEnvBase(), &out, &errb)
	return result{code, out.String(), errb.String()}
}

// runNodes runs a 2-node job (2 ranks per node) in-process, one ddprun per node, and returns
// each node's result.
func runNodes(t *testing.T, flags []string, helperArgs ...string) [2]result {
	t.Helper()
	port := freePort(t)
	env := rankEnvBase("GODDP_TOKEN=" + strings.Repeat("cd", 32))
	ch := make(chan struct {
		node int
		res  result
	}, 2)
	for node := range 2 {
		go func() {
			var out, errb syncBuffer
			args := append([]string{"--nnodes", "2", "--node_rank", strconv.Itoa(node), "--nproc_per_node", "2",
				"--master_port", strconv.Itoa(port), "--rdzv_timeout", "1m", "--stop_timeout", "300ms"}, flags...)
			args = append(append(args, self(t)), helperArgs...)
			code := run(context.Background(), args, env, &out, &errb)
			ch <- struct {
				node int
				res  result
			}{node, result{code, out.String(), errb.String()}}
		}()
	}
	var res [2]result
	for range 2 {
		r := <-ch
		res[r.node] = r.res
	}
	return res
}

func TestMultiNodeRestart(t *testing.T) {
	res := runNodes(t, []string{"--max_restarts", "1"}, "flaky", "3")
	okRE := regexp.MustCompile(`^ok run=[0-9a-f]+-attempt1$`)
	runIDs := map[string]bool{}
	for node, r := range res {
		if r.code != 0 {
			t.Errorf("node %d: exit %d\nstdout:\n%s\nstderr:\n%s", node, r.code, r.stdout, r.stderr)
		}
		byRank := rankLines(t, r.stdout)
		for local := range 2 {
			rank := node*2 + local
			got := byRank[rank]
			if len(got) == 0 || !okRE.MatchString(got[len(got)-1]) {
				t.Errorf("node %d rank %d did not succeed in attempt 1: %q", node, rank, got)
				continue
			}
			runIDs[got[len(got)-1]] = true
		}
		if !strings.Contains(r.stderr, "restarting the group (restart 1 of 1)") {
			t.Errorf("node %d did not restart:\n%s", node, r.stderr)
		}
	}
	if len(runIDs) != 1 {
		t.Errorf("ranks disagree on GODDP_RUN_ID in attempt 1: %v", runIDs)
	}
	if !strings.Contains(res[0].stderr, "attempt 0 failed on another node: rank 3 (node 1, host ") ||
		!strings.Contains(res[1].stderr, "ddprun: rank 3 (local_rank 1, host ") {
		t.Errorf("failure reports:\nnode 0:\n%s\nnode 1:\n%s", res[0].stderr, res[1].stderr)
	}
}

func TestMultiNodeGivesUp(t *testing.T) {
	res := runNodes(t, nil, "fail", "3", "9")
	for node, r := range res {
		if r.code != 9 {
			t.Errorf("node %d: exit %d, want 9\nstderr:\n%s", node, r.code, r.stderr)
		}
		assertDead(t, pids(t, r.stdout))
	}
	if !strings.Contains(res[0].stderr, "failed on another node: rank 3 (node 1, host ") ||
		!strings.Contains(res[0].stderr, "exit code 9") {
		t.Errorf("node 0 stderr:\n%s", res[0].stderr)
	}
}
