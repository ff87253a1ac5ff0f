package slurmtest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

var (
	// skipReason, when set, is why SLURM cannot be had here; every test skips with it.
	skipReason string
	// slurmConf is the cluster's SLURM_CONF, as scripts/slurm.sh prints it.
	slurmConf string
	// bin holds the binaries the tests launch: mlp, transformer and ddprun.
	bin string
	// repo is the repository's root.
	repo string
	// token is the job token the tests' jobs use (GODDP_TOKEN).
	token string
)

func TestMain(m *testing.M) {
	flag.Parse()
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	if skipReason = unavailable(); skipReason != "" {
		return m.Run()
	}
	var err error
	if repo, err = filepath.Abs(filepath.Join("..", "..")); err != nil {
		fmt.Fprintln(os.Stderr, "slurmtest:", err)
		return 1
	}
	script := filepath.Join(repo, "scripts", "slurm.sh")
	// A cluster that is up already (someone's, by hand) is used and left up; one this run
	// starts is taken down at its end.
	out, err := command(time.Minute, "", nil, script, "status")
	if err != nil {
		if out, err = command(2*time.Minute, "", nil, script, "up"); err != nil {
			fmt.Fprintf(os.Stderr, "slurmtest: scripts/slurm.sh up: %v\n%s", err, out)
			command(2*time.Minute, "", nil, script, "down")
			return 1
		}
		defer func() {
			if out, err := command(2*time.Minute, "", nil, script, "down"); err != nil {
				fmt.Fprintf(os.Stderr, "slurmtest: scripts/slurm.sh down: %v\n%s", err, out)
			}
		}()
	}
	if m := regexp.MustCompile(`(?m)^export SLURM_CONF=(\S+)$`).FindStringSubmatch(out); m != nil {
		slurmConf = m[1]
	} else {
		fmt.Fprintf(os.Stderr, "slurmtest: scripts/slurm.sh printed no SLURM_CONF:\n%s", out)
		return 1
	}
	if bin, err = os.MkdirTemp("", "slurmtest"); err != nil {
		fmt.Fprintln(os.Stderr, "slurmtest:", err)
		return 1
	}
	defer os.RemoveAll(bin)
	if out, err := command(5*time.Minute, repo, nil, goTool(), "build", "-o", bin+string(filepath.Separator),
		"./examples/mlp", "./examples/transformer", "./cmd/ddprun"); err != nil {
		fmt.Fprintf(os.Stderr, "slurmtest: building the trainers: %v\n%s", err, out)
		return 1
	}
	b := make([]byte, 16)
	rand.Read(b)
	token = "slurmtest-" + hex.EncodeToString(b)
	return m.Run()
}

// unavailable says why a SLURM cluster cannot be had here, or "" when it can.
func unavailable() string {
	if testing.Short() {
		return "-short: these tests start a SLURM cluster"
	}
	for _, c := range []string{"srun", "sbatch", "scancel", "squeue", "scontrol", "slurmctld", "slurmd", "munged", "flock", "runuser"} {
		if _, err := exec.LookPath(c); err != nil {
			return c + " not found: apt-get install -y --no-install-recommends slurm-wlm munge"
		}
	}
	if os.Geteuid() != 0 {
		return "not root: scripts/slurm.sh runs SLURM's daemons as root"
	}
	return ""
}

func need(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}

// goTool is the go command of this toolchain.
func goTool() string {
	if p := filepath.Join(os.Getenv("GOROOT"), "bin", "go"); os.Getenv("GOROOT") != "" {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return "go"
}

// jobEnv is the tests' environment for SLURM's commands and the trainers: this process's,
// less any launcher's variables (a run inside a SLURM job, say), with the cluster's
// SLURM_CONF and the tests' GODDP_TOKEN (unless withToken is false), then extra.
func jobEnv(withToken bool, extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch {
		case strings.HasPrefix(k, "SLURM_"), strings.HasPrefix(k, "GODDP_"), strings.HasPrefix(k, "OMPI_"),
			strings.HasPrefix(k, "TORCHELASTIC_"), strings.HasPrefix(k, "MASTER_"):
			continue
		case k == "RANK", k == "WORLD_SIZE", k == "LOCAL_RANK", k == "LOCAL_WORLD_SIZE", k == "GROUP_RANK":
			continue
		}
		env = append(env, kv)
	}
	env = append(env, "SLURM_CONF="+slurmConf)
	if withToken {
		env = append(env, "GODDP_TOKEN="+token)
	}
	return append(env, extra...)
}

// command runs name with args in dir (this process's directory if "") and env (this
// process's if nil), for at most timeout, and returns its stdout and stderr together.
func command(timeout time.Duration, dir string, env []string, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir, cmd.Env = dir, env
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	// srun and sbatch cancel their job on SIGINT; SIGKILL would leave it running.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGINT) }
	cmd.WaitDelay = 10 * time.Second
	err := cmd.Run()
	if ctx.Err() != nil {
		err = fmt.Errorf("%s %s: still running after %v (%v)", name, strings.Join(args, " "), timeout, err)
	}
	return out.String(), err
}

// srun runs srun with args (its options, the trainer and its flags) and returns its output.
func srun(t *testing.T, args string) (string, error) {
	t.Helper()
	return command(2*time.Minute, bin, jobEnv(true), "srun", strings.Fields(args)...)
}

var (
	srunCRC   = regexp.MustCompile(`(?m)^\s*(\d+): params_crc32=([0-9a-f]{8})$`)
	ddprunCRC = regexp.MustCompile(`(?m)^\[rank(\d+)\]: params_crc32=([0-9a-f]{8})$`)
)

// agreedCRC returns the params_crc32 that ranks 0 … n−1 printed in out (lines matched by
// re, whose groups are the rank and the crc), failing the test unless each printed one
// and all of them the same.
func agreedCRC(t *testing.T, what, out string, re *regexp.Regexp, n int) string {
	t.Helper()
	byRank := map[int]string{}
	for _, m := range re.FindAllStringSubmatch(out, -1) {
		r, _ := strconv.Atoi(m[1])
		byRank[r] = m[2]
	}
	for r := range n {
		if byRank[r] == "" || byRank[r] != byRank[0] || len(byRank) != n {
			t.Fatalf("%s: params_crc32 per rank %v, want the same from each of %d ranks; output:\n%s", what, byRank, n, out)
		}
	}
	return byRank[0]
}

// references caches ddprun's params_crc32 by trainer, ranks and flags.
var references = map[string]string{}

// ddprunCRC32 runs trainer (in bin) with flags on n ranks under ddprun and returns the
// params_crc32 they agree on.
func ddprunCRC32(t *testing.T, trainer string, n int, flags string) string {
	t.Helper()
	key := fmt.Sprintf("%s %d %s", trainer, n, flags)
	if crc, ok := references[key]; ok {
		return crc
	}
	args := append([]string{"--standalone", "--nproc_per_node", strconv.Itoa(n), filepath.Join(bin, trainer), "--"}, strings.Fields(flags)...)
	out, err := command(2*time.Minute, bin, jobEnv(true), filepath.Join(bin, "ddprun"), args...)
	if err != nil {
		t.Fatalf("ddprun %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	references[key] = agreedCRC(t, "ddprun "+key, out, ddprunCRC, n)
	return references[key]
}

// noPublicToken fails the test if out holds goddp's warning that it used the public
// development token (the jobs here are given a secret).
func noPublicToken(t *testing.T, what, out string) {
	t.Helper()
	if strings.Contains(out, "public development token") {
		t.Errorf("%s: a rank used the public development token:\n%s", what, out)
	}
}

// liveProcs returns "pid cmdline" of each live (not zombie) process, other than this one,
// whose command line contains s.
func liveProcs(t *testing.T, s string) []string {
	t.Helper()
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", d.Name(), "stat"))
		if err != nil {
			continue // gone
		}
		if i := bytes.LastIndexByte(stat, ')'); i < 0 || i+2 >= len(stat) || stat[i+2] == 'Z' {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", d.Name(), "cmdline"))
		if err != nil {
			continue
		}
		if c := strings.TrimSpace(strings.ReplaceAll(string(cmdline), "\x00", " ")); strings.Contains(c, s) {
			found = append(found, d.Name()+" "+c)
		}
	}
	return found
}

// ranks returns "pid cmdline" of each live process that runs trainer.
func ranks(t *testing.T, trainer string) []string {
	t.Helper()
	var rs []string
	for _, p := range liveProcs(t, trainer) {
		if _, c, _ := strings.Cut(p, " "); strings.HasPrefix(c, trainer+" ") {
			rs = append(rs, p)
		}
	}
	return rs
}

// noneLeft fails the test unless, within 15 s, no live process's command line holds any
// of ss.
func noneLeft(t *testing.T, ss ...string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		var left []string
		for _, s := range ss {
			left = append(left, liveProcs(t, s)...)
		}
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("processes left 15s after the job ended:\n%s", strings.Join(left, "\n"))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// mlpFlags: 30 steps of a 97-parameter model with 4 samples per rank, so the data, and the
// crc, depend on the world size.
const mlpFlags = "--hidden_size 16 --steps 30 --log_every 10 --batch_size 4"

// transformerFlags: the tiny transformer (1 layer, width 16), 4 steps.
const transformerFlags = "--num_layers 1 --hidden_size 16 --seq_len 4 --batch_size 2 --warmup_steps 1 --bench_steps 3 --log_every 1"

// TestSrunMatchesDDPRun: srun -N1 -n2, and -n4 -O (more tasks than the node's 2 CPUs:
// without -O the step would pend), of examples/mlp and examples/transformer: every rank
// ends with the same params_crc32 as the same job under ddprun, and the 2- and 4-rank runs
// end differently (the data depend on the world size), so each rank must have been in a
// group of the right size.
func TestSrunMatchesDDPRun(t *testing.T) {
	need(t)
	for _, tc := range []struct{ trainer, flags string }{
		{"mlp", mlpFlags},
		{"transformer", transformerFlags},
	} {
		t.Run(tc.trainer, func(t *testing.T) {
			seen := map[string]int{}
			for _, c := range []struct {
				opts string
				n    int
			}{{"-N1 -n2", 2}, {"-n4 -O", 4}} {
				want := ddprunCRC32(t, tc.trainer, c.n, tc.flags)
				args := "-l " + c.opts + " " + filepath.Join(bin, tc.trainer) + " " + tc.flags
				out, err := srun(t, args)
				if err != nil {
					t.Fatalf("srun %s: %v\n%s", args, err, out)
				}
				got := agreedCRC(t, "srun "+args, out, srunCRC, c.n)
				if got != want {
					t.Errorf("srun %s: params_crc32=%s; ddprun --nproc_per_node %d: %s", c.opts, got, c.n, want)
				} else {
					t.Logf("srun %s %s: %d ranks at params_crc32=%s, as under ddprun", c.opts, tc.trainer, c.n, got)
				}
				noPublicToken(t, "srun "+args, out)
				if n, dup := seen[got]; dup {
					t.Errorf("%d and %d ranks end at the same params_crc32=%s: the test cannot tell the world sizes apart", n, c.n, got)
				}
				seen[got] = c.n
			}
		})
	}
}

// TestSbatch submits deploy/slurm/cpu.sbatch, the example batch script, with the tiny
// transformer, waits for it (sbatch --wait), and checks its output file: the script's
// line naming the job, both ranks at ddprun's params_crc32, and no public-token warning
// (no GODDP_TOKEN is set: the script makes the job's secret).
func TestSbatch(t *testing.T) {
	need(t)
	want := ddprunCRC32(t, "transformer", 2, transformerFlags)
	dir := t.TempDir()
	script := filepath.Join(repo, "deploy", "slurm", "cpu.sbatch")
	args := append([]string{"--wait", script}, strings.Fields(transformerFlags)...)
	out, err := command(2*time.Minute, dir, jobEnv(false, "GODDP_TRAINER="+filepath.Join(bin, "transformer")), "sbatch", args...)
	m := regexp.MustCompile(`Submitted batch job (\d+)`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("sbatch %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	file := filepath.Join(dir, "goddp-"+m[1]+".out")
	b, rerr := os.ReadFile(file)
	if err != nil || rerr != nil {
		t.Fatalf("sbatch --wait: %v\n%s\n%s (%v):\n%s", err, out, file, rerr, b)
	}
	job := string(b)
	if head := "goddp: job " + m[1] + ": 2 ranks on 1 node(s)"; !strings.Contains(job, head) {
		t.Errorf("%s has no line %q:\n%s", file, head, job)
	}
	if got := agreedCRC(t, file, job, srunCRC, 2); got != want {
		t.Errorf("sbatch: params_crc32=%s; ddprun --nproc_per_node 2: %s", got, want)
	} else {
		t.Logf("sbatch --wait cpu.sbatch: job %s, 2 ranks at params_crc32=%s, as under ddprun", m[1], got)
	}
	noPublicToken(t, file, job)
}

// TestSrunKillOnBadExit: under srun --kill-on-bad-exit, a rank that fails ends the job
// with its error in the output. With a bad flag on rank 1 (srun --multi-prog), rank 0,
// set to train for ever and left waiting for rank 1, is killed by SLURM; with a NaN in
// rank 1's gradient both ranks name it and exit 1. No trainer process is left.
func TestSrunKillOnBadExit(t *testing.T) {
	need(t)
	mlp := filepath.Join(bin, "mlp")
	t.Run("bad flag", func(t *testing.T) {
		conf := filepath.Join(t.TempDir(), "multi.conf")
		prog := fmt.Sprintf("0 %s --hidden_size 16 --steps 100000000\n1 %s --hidden_size 16 --no_such_flag\n", mlp, mlp)
		if err := os.WriteFile(conf, []byte(prog), 0o644); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		out, err := srun(t, "-l --kill-on-bad-exit=1 -n2 --multi-prog "+conf)
		if err == nil || strings.Contains(err.Error(), "still running") {
			t.Fatalf("srun --multi-prog (rank 1 with a bad flag): %v, want a failure at once\n%s", err, out)
		}
		for _, want := range []string{
			"1: mlp: flag provided but not defined: -no_such_flag",
			"task 1: Exited with exit code 2",
		} {
			if !strings.Contains(out, want) {
				t.Errorf("output lacks %q:\n%s", want, out)
			}
		}
		if !regexp.MustCompile(`task 0: (Terminated|Killed)`).MatchString(out) {
			t.Errorf("output does not say that SLURM ended task 0:\n%s", out)
		}
		t.Logf("srun --kill-on-bad-exit, rank 1 with a bad flag: %v after %v; %s", err, time.Since(start).Round(time.Millisecond),
			strings.Join(regexp.MustCompile(`(?m)^srun: error: .*$`).FindAllString(out, -1), "; "))
		noneLeft(t, mlp)
	})
	t.Run("nan", func(t *testing.T) {
		out, err := srun(t, "-l --kill-on-bad-exit=1 -n2 "+mlp+" "+mlpFlags+" --inject_nan 1:5:w2")
		if err == nil || strings.Contains(err.Error(), "still running") {
			t.Fatalf("srun (a NaN on rank 1): %v, want a failure at once\n%s", err, out)
		}
		for _, want := range []string{
			"0: mlp: reducer: step 5: non-finite local gradient: rank 1: parameter 2 (w2)",
			"1: mlp: reducer: step 5: non-finite local gradient: rank 1: parameter 2 (w2)",
			"tasks 0-1: Exited with exit code 1",
		} {
			if !strings.Contains(out, want) {
				t.Errorf("output lacks %q:\n%s", want, out)
			}
		}
		if strings.Contains(out, "params_crc32=") {
			t.Errorf("a rank finished after the NaN:\n%s", out)
		}
		noneLeft(t, mlp)
	})
}

// TestScancel submits a 2-rank job that would train for ever, waits until it trains (rank
// 0's loss lines in its output, both ranks' processes up), cancels it with scancel, and
// checks that the job ends CANCELLED and that neither a rank nor the job's slurmstepd is
// left.
func TestScancel(t *testing.T) {
	need(t)
	dir := t.TempDir()
	// A copy of the trainer of its own, so that the processes looked for are this job's.
	mlp := filepath.Join(dir, "mlp-scancel")
	b, err := os.ReadFile(filepath.Join(bin, "mlp"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(mlp, b, 0o755); err != nil {
		t.Fatal(err)
	}
	outFile := filepath.Join(dir, "job.out")
	wrap := "srun -l " + mlp + " --hidden_size 16 --steps 100000000 --log_every 1000"
	out, err := command(time.Minute, dir, jobEnv(true), "sbatch", "--parsable", "-n2", "--output", outFile, "--wrap", wrap)
	if err != nil {
		t.Fatalf("sbatch: %v\n%s", err, out)
	}
	id := strings.TrimSpace(out)
	if _, err := strconv.Atoi(id); err != nil {
		t.Fatalf("sbatch --parsable printed %q", out)
	}
	cancelled := false
	defer func() {
		if !cancelled {
			command(time.Minute, "", jobEnv(true), "scancel", id)
		}
	}()
	deadline := time.Now().Add(time.Minute)
	for {
		b, _ := os.ReadFile(outFile)
		if strings.Contains(string(b), "0: step 1000 loss") && len(ranks(t, mlp)) == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("job %s not training after a minute; processes %q; output:\n%s", id, liveProcs(t, mlp), b)
		}
		time.Sleep(100 * time.Millisecond)
	}
	stepd := "slurmstepd: [" + id + "."
	if len(liveProcs(t, stepd)) == 0 {
		t.Fatalf("no %q process while job %s runs: the check below could not fail", stepd, id)
	}
	if out, err := command(time.Minute, "", jobEnv(true), "scancel", id); err != nil {
		t.Fatalf("scancel %s: %v\n%s", id, err, out)
	}
	cancelled = true
	start := time.Now()
	deadline = time.Now().Add(30 * time.Second)
	for {
		out, _ := command(time.Minute, "", jobEnv(true), "scontrol", "-o", "show", "job", id)
		if strings.Contains(out, "JobState=CANCELLED") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("job %s not CANCELLED 30s after scancel: %s", id, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
	noneLeft(t, mlp, stepd)
	b, _ = os.ReadFile(outFile)
	if !strings.Contains(string(b), "JOB "+id+" ON") || !strings.Contains(string(b), "CANCELLED") {
		t.Errorf("job output does not say it was cancelled:\n%s", b)
	}
	t.Logf("scancel %s: job CANCELLED, its ranks and slurmstepd gone %v after scancel", id, time.Since(start).Round(time.Millisecond))
}
