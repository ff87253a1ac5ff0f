//go:build linux

package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The trainer under the launchers clusters use, as they start it: the real torchrun
// (Debian python3-torch), the real mpirun (Debian openmpi-bin), and srun's variables. This
// test binary is the trainer (asMainEnv); each run's params_crc32 on every rank must equal
// that of the same training in-process (trainRanks).

const launcherFlags = tinyDDPFlags + " --batch_size 2 --warmup_steps 0"

var crcLineRE = regexp.MustCompile(`params_crc32=([0-9a-f]{8})`)

// launcherEnv is this process's environment without any launcher's variables, plus
// asMainEnv and extra.
func launcherEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch {
		case strings.HasPrefix(k, "SLURM_"), strings.HasPrefix(k, "OMPI_"), strings.HasPrefix(k, "PMIX_"),
			strings.HasPrefix(k, "TORCHELASTIC_"), strings.HasPrefix(k, "GODDP_STORE"):
			continue
		}
		switch k {
		case "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
			"JOB_COMPLETION_INDEX", asMainEnv:
			continue
		}
		env = append(env, kv)
	}
	return append(append(env, asMainEnv+"=1"), extra...)
}

// referenceCRC is the params_crc32 of args trained in-process on n ranks.
func referenceCRC(t *testing.T, n int, args string) string {
	t.Helper()
	ref, _ := trainRanks(t, n, args)
	return fmt.Sprintf("%08x", paramsCRC32(ref[0]))
}

// checkCRCs asserts that out holds n params_crc32 lines, all equal to want.
func checkCRCs(t *testing.T, out string, n int, want string) {
	t.Helper()
	m := crcLineRE.FindAllStringSubmatch(out, -1)
	if len(m) != n {
		t.Fatalf("%d params_crc32 lines, want %d:\n%s", len(m), n, out)
	}
	for _, c := range m {
		if c[1] != want {
			t.Fatalf("params_crc32=%s, want %s (in-process):\n%s", c[1], want, out)
		}
	}
}

func freeTCPPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// runCmd runs a command with env, both output streams in one buffer.
func runCmd(t *testing.T, env []string, name string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = env
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

func lookTorchrun(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("starts torchrun")
	}
	p, err := exec.LookPath("torchrun")
	if err != nil {
		t.Skip("torchrun not found (Debian: apt-get install python3-torch): the torchrun tests are skipped")
	}
	return p
}

// torchrunFlags are common to every torchrun here. Debian's torch 1.13 under Python 3.11
// cannot parse --redirects or --tee 0 (its default; Python 3.11's enum.Flag iteration
// skips the zero member): passing 1 for both keeps stdout on the console. The agent checks
// its workers every 0.2 s instead of 5.
func torchrunFlags(t *testing.T) []string {
	return []string{"--redirects", "1", "--tee", "1", "--log_dir", t.TempDir(), "--monitor_interval", "0.2", "--no_python"}
}

// TestTorchrun: the job starts and trains under torchrun's default static rendezvous
// (the agent's TCPStore on MASTER_PORT), under --standalone (c10d rendezvous: rank 0 hosts
// goddp's store on the port the agent picks), and as two agents meeting through a c10d
// rendezvous endpoint.
func TestTorchrun(t *testing.T) {
	torchrun := lookTorchrun(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	args := launcherFlags + " --bench_steps 4"
	want := referenceCRC(t, 2, args)
	env := launcherEnv()

	t.Run("static agent store", func(t *testing.T) {
		cmd := append(torchrunFlags(t), "--nproc_per_node", "2", "--master_port", strconv.Itoa(freeTCPPort(t)), exe)
		out, err := runCmd(t, env, torchrun, append(cmd, strings.Fields(args)...)...)
		if err != nil {
			t.Fatalf("torchrun: %v\n%s", err, out)
		}
		checkCRCs(t, out, 2, want)
		if !strings.Contains(out, "PyTorch TCPStore, which has no authentication") {
			t.Errorf("no warning about the TCPStore's missing authentication:\n%s", out)
		}
	})
	t.Run("standalone", func(t *testing.T) {
		cmd := append(torchrunFlags(t), "--standalone", "--nproc_per_node", "2", exe)
		out, err := runCmd(t, env, torchrun, append(cmd, strings.Fields(args)...)...)
		if err != nil {
			t.Fatalf("torchrun: %v\n%s", err, out)
		}
		checkCRCs(t, out, 2, want)
	})
	t.Run("two agents, c10d rendezvous", func(t *testing.T) {
		endpoint := net.JoinHostPort("127.0.0.1", strconv.Itoa(freeTCPPort(t)))
		// Two nodes: without a shared token goddp refuses to start, as on two real hosts.
		env := append(env[:len(env):len(env)], "GODDP_TOKEN=two-agents-test-token")
		outs := make([]string, 2)
		errs := make([]error, 2)
		var wg sync.WaitGroup
		for node := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				cmd := append(torchrunFlags(t), "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
					"--rdzv_endpoint", endpoint, "--rdzv_id", "goddp-test", exe)
				outs[node], errs[node] = runCmd(t, env, torchrun, append(cmd, strings.Fields(args)...)...)
			}()
		}
		wg.Wait()
		for node, err := range errs {
			if err != nil {
				t.Fatalf("agent %d: %v\n%s", node, err, outs[node])
			}
		}
		checkCRCs(t, outs[0]+outs[1], 2, want)
	})
}

// TestTorchrunFailureSummary: a worker that fails writes TORCHELASTIC_ERROR_FILE, so that
// torchrun's failure summary shows goddp's error as the root cause.
func TestTorchrunFailureSummary(t *testing.T) {
	torchrun := lookTorchrun(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "a-file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := append(torchrunFlags(t), "--nproc_per_node", "2", "--master_port", strconv.Itoa(freeTCPPort(t)), exe)
	out, err := runCmd(t, launcherEnv(), torchrun, append(cmd, strings.Fields(launcherFlags+" --bench_steps 2 --checkpoint_dir "+file+"/sub")...)...)
	if err == nil {
		t.Fatalf("torchrun succeeded with an unusable --checkpoint_dir:\n%s", out)
	}
	for _, want := range []string{"Root Cause (first observed failure)", "exitcode  : 1", "error_file: /",
		"traceback : transformer: --checkpoint_dir: mkdir ", "a-file: not a directory"} {
		if !strings.Contains(out, want) {
			t.Errorf("torchrun's summary lacks %q:\n%s", want, out)
		}
	}
}

// TestTorchrunKillRestart: under torchrun --max_restarts 1, one worker gets a real
// SIGKILL as soon as rank 0 reports a step; the agent restarts the group (its store keeps
// the first attempt's keys: the new attempt uses a new key prefix), the ranks resume from
// their agreed checkpoint, and the run ends with the params_crc32 of an uninterrupted run.
func TestTorchrunKillRestart(t *testing.T) {
	torchrun := lookTorchrun(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	const killRank, killStep = 1, 7
	args := launcherFlags + " --bench_steps 16 --checkpoint_every 3"
	want := referenceCRC(t, 2, args)
	// torchrun's --tee forwards output in batches: slow the steps down (a sleep, which
	// changes no result) so that the kill lands mid-run.
	args += " --straggle_ms 0:100"
	ckpt := t.TempDir()
	cmdArgs := append(torchrunFlags(t), "--nproc_per_node", "2", "--max_restarts", "1",
		"--master_port", strconv.Itoa(freeTCPPort(t)), exe)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, torchrun, append(cmdArgs, strings.Fields(args+" --checkpoint_dir "+ckpt)...)...)
	cmd.Env = launcherEnv()
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pw.Close()
	var out strings.Builder
	killed := -1
	trigger := fmt.Sprintf("[default0]:step %d loss ", killStep)
	sc := bufio.NewScanner(pr)
	for sc.Scan() {
		line := sc.Text()
		out.WriteString(line + "\n")
		if killed < 0 && strings.HasPrefix(line, trigger) {
			b, err := os.ReadFile(filepath.Join(ckpt, fmt.Sprintf("rank%d.pid", killRank)))
			if err != nil {
				t.Fatal(err)
			}
			if killed, err = strconv.Atoi(strings.TrimSpace(string(b))); err != nil {
				t.Fatal(err)
			}
			if err := syscall.Kill(killed, syscall.SIGKILL); err != nil {
				t.Fatalf("kill -9 %d: %v", killed, err)
			}
		}
	}
	pr.Close()
	if err := cmd.Wait(); err != nil {
		t.Fatalf("torchrun: %v\n%s", err, out.String())
	}
	if killed < 0 {
		t.Fatalf("rank 0 never reported step %d:\n%s", killStep, out.String())
	}
	starts := regexp.MustCompile(`(?m)^\[default0\]:params=.* start_step=(\d+)$`).FindAllStringSubmatch(out.String(), -1)
	if len(starts) != 2 || starts[0][1] != "0" || starts[1][1] == "0" {
		t.Fatalf("want a first attempt from step 0 and a resumed second one: %v\n%s", starts, out.String())
	}
	checkCRCs(t, out.String(), 2, want)
	t.Logf("killed rank %d (pid %d) after step %d; torchrun restarted; resumed from step %s; params_crc32=%s (uninterrupted %s)",
		killRank, killed, killStep, starts[1][1], want, want)
}

// TestMpirun: the real mpirun at 2 and 3 ranks on this host; the output carries no
// terminal control, although mpirun gives each rank a pseudo-terminal.
func TestMpirun(t *testing.T) {
	if testing.Short() {
		t.Skip("starts mpirun")
	}
	mpirun, err := exec.LookPath("mpirun")
	if err != nil {
		t.Skip("mpirun not found (Debian: apt-get install openmpi-bin): the mpirun tests are skipped")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	args := launcherFlags + " --bench_steps 3"
	for _, n := range []int{2, 3} {
		t.Run(fmt.Sprintf("np %d", n), func(t *testing.T) {
			want := referenceCRC(t, n, args)
			cmd := []string{"--oversubscribe", "-np", strconv.Itoa(n)}
			if os.Geteuid() == 0 {
				cmd = append(cmd, "--allow-run-as-root") // Open MPI refuses root without it
			}
			out, err := runCmd(t, launcherEnv(), mpirun, append(append(cmd, exe), strings.Fields(args)...)...)
			if err != nil {
				t.Fatalf("mpirun: %v\n%s", err, out)
			}
			checkCRCs(t, out, n, want)
			if strings.ContainsAny(out, "\r\x1b") {
				t.Errorf("terminal control in mpirun's output: %q", out)
			}
		})
	}
}

// TestSrunEnv: the ranks started with exactly the variables srun sets (a compressed node
// list whose first host, the master, is this one).
func TestSrunEnv(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the trainer")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// SLURM's port is 20000 + SLURM_JOB_ID % 20000: pick a job id whose port is free.
	jobID := -1
	for range 200 {
		if p := freeTCPPort(t); p >= 20000 && p < 40000 {
			jobID = 100000 + p - 20000
			break
		}
	}
	if jobID < 0 {
		t.Skip("no free port in [20000, 40000) for SLURM's job-id port")
	}
	args := launcherFlags + " --bench_steps 3"
	want := referenceCRC(t, 2, args)
	var wg sync.WaitGroup
	outs := make([]string, 2)
	errs := make([]error, 2)
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			env := launcherEnv(
				"SLURM_PROCID="+strconv.Itoa(r), "SLURM_LOCALID="+strconv.Itoa(r), "SLURM_NODEID=0",
				"SLURM_NTASKS=2", "SLURM_NPROCS=2", "SLURM_NNODES=1", "SLURM_TASKS_PER_NODE=2",
				"SLURM_STEP_TASKS_PER_NODE=2", "SLURM_JOB_ID="+strconv.Itoa(jobID), "SLURM_STEP_ID=0",
				// A compressed list whose first host is this one.
				"SLURM_NODELIST=127.0.0.[1,3-4]", "SLURM_JOB_NODELIST=127.0.0.[1,3-4]",
				"SLURM_STEP_NODELIST=127.0.0.1", "SLURM_LAUNCH_NODE_IPADDR=127.0.0.1",
				"SLURM_SRUN_COMM_HOST=127.0.0.1", "SLURM_CPUS_ON_NODE=2", "SLURM_TASK_PID="+strconv.Itoa(os.Getpid()))
			outs[r], errs[r] = runCmd(t, env, exe, strings.Fields(args)...)
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v\n%s", r, err, outs[r])
		}
	}
	checkCRCs(t, outs[0]+outs[1], 2, want)
}
