package main

import (
	"bytes"
	"context"
	"fmt"
	"hash/crc32"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/goddp/goddp/ddp/checkpoint"
)

// killEnv, "RANK:STEP", makes the trainer's rank RANK kill itself with SIGKILL after step
// STEP (and its checkpoint), on a launcher's first attempt only.
const killEnv = "GODDP_MLP_TEST_KILL"

func killHook() {
	spec := os.Getenv(killEnv)
	if spec == "" {
		return
	}
	r, s, _ := strings.Cut(spec, ":")
	rank, err1 := strconv.Atoi(r)
	step, err2 := strconv.Atoi(s)
	if err1 != nil || err2 != nil {
		panic(killEnv + "=" + spec + ": want RANK:STEP")
	}
	afterStep = func(r, s int) {
		if a := os.Getenv("TORCHELASTIC_RESTART_COUNT"); r == rank && s == step && (a == "" || a == "0") {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
	}
}

// ckptArgs: 6 logical shards (shardArgs), 12 steps, a checkpoint every 3.
var ckptArgs = strings.Replace(shardArgs, "--steps 8 --log_every 7", "--steps 12 --log_every 1 --checkpoint_every 3", 1)

// launch runs n ranks of this trainer under launcher (ddprun or torchrun) with launcher's
// flags, the trainer's args and extra environment.
func launch(t *testing.T, launcher string, lflags []string, env []string, args string) (stdout, stderr string, err error) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, launcher, append(append(lflags, exe), strings.Fields(args)...)...)
	cmd.Env = append(append(os.Environ(), asMainEnv+"=1"), env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	return out.String(), errOut.String(), err
}

func ddprunFlags(n, restarts int) []string {
	return []string{"--standalone", "--nproc_per_node", strconv.Itoa(n), "--max_restarts", strconv.Itoa(restarts)}
}

var crcRE = regexp.MustCompile(`(?m)^\[rank(\d+)\]: (params_crc32=[0-9a-f]{8})$`)

// wantCRC checks that each of n ranks printed want, once.
func wantCRC(t *testing.T, what string, n int, want, stdout, stderr string) {
	t.Helper()
	m := crcRE.FindAllStringSubmatch(stdout, -1)
	if len(m) != n {
		t.Fatalf("%s: want a params_crc32 from each of %d ranks:\n%s\nstderr:\n%s", what, n, stdout, stderr)
	}
	for _, l := range m {
		if l[2] != want {
			t.Errorf("%s: rank %s ends with %s, the uninterrupted run %s", what, l[1], l[2], want)
		}
	}
}

// uninterrupted is the params_crc32 line of one process running ckptArgs's 6 shards (the
// same bits at every world size: TestShardsSameBitsAtEveryWorldSize).
func uninterrupted(t *testing.T, args string) string {
	t.Helper()
	m, err := train(context.Background(), mustParse(t, args+" --no_ddp"), nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("params_crc32=%08x", crc32.ChecksumIEEE(paramBytes(m.flat())))
}

func copyDir(t *testing.T, from string) string {
	t.Helper()
	to := t.TempDir()
	ents, err := os.ReadDir(from)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(from, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(to, e.Name()), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return to
}

// TestResumeAtAnotherWorldSize: 3 ranks under ddprun --max_restarts 0 checkpoint every 3
// steps until rank 1 is killed (kill -9) after step 7; the job fails. From its checkpoints
// (step 6), 2 ranks, 1 rank and one process without ddp each resume with --resume and
// end, every rank, with the params_crc32 of the uninterrupted run. With the newest
// checkpoint corrupt (a flipped byte) they resume from step 3, with a warning, and end the
// same; a model of another width is refused, naming the tensor.
func TestResumeAtAnotherWorldSize(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun, kills a rank")
	}
	ddprun := buildDDPRun(t)
	want := uninterrupted(t, ckptArgs)
	dir := t.TempDir()
	stdout, stderr, err := launch(t, ddprun, ddprunFlags(3, 0), []string{killEnv + "=1:7"}, ckptArgs+" --checkpoint_dir "+dir)
	if err == nil || !strings.Contains(stderr, "rank 1 (local_rank 1") || strings.Contains(stdout, "params_crc32") {
		t.Fatalf("3 ranks, rank 1 killed: ddprun %v, want a failure naming rank 1\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	if steps, err := checkpoint.List(dir); err != nil || !slices.Equal(steps, []int64{6, 3}) {
		t.Fatalf("checkpoints of the killed run: steps %v, %v; want [6 3]", steps, err)
	}

	resume := func(t *testing.T, what string, n int, dir, args string) (string, string) {
		t.Helper()
		if n == 0 { // one process, no process group
			var out bytes.Buffer
			m, err := train(context.Background(), mustParse(t, args+" --no_ddp --resume --checkpoint_dir "+dir), nil, &out)
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			fmt.Fprintf(&out, "params_crc32=%08x\n", crc32.ChecksumIEEE(paramBytes(m.flat())))
			return regexp.MustCompile(`(?m)^`).ReplaceAllString(out.String(), "[rank0]: "), "" // as ddprun shows it
		}
		stdout, stderr, err := launch(t, ddprun, ddprunFlags(n, 0), nil, args+" --resume --checkpoint_dir "+dir)
		if err != nil {
			t.Fatalf("%s: ddprun: %v\nstdout:\n%s\nstderr:\n%s", what, err, stdout, stderr)
		}
		return stdout, stderr
	}
	for _, n := range []int{2, 1, 0} {
		what := fmt.Sprintf("resumed by %d ranks", n)
		if n == 0 {
			what = "resumed by one process without ddp"
		}
		stdout, stderr := resume(t, what, n, copyDir(t, dir), ckptArgs)
		if !strings.Contains(stdout, "[rank0]: resumed from step 6\n") || strings.Contains(stdout, "step 5 loss") {
			t.Errorf("%s: not from step 6:\n%s", what, stdout)
		}
		wantCRC(t, what, max(n, 1), want, stdout, stderr)
	}

	t.Run("corrupt newest", func(t *testing.T) {
		d := copyDir(t, dir)
		path := filepath.Join(d, checkpoint.FileName(6))
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		b[len(b)/2] ^= 0x01
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		stdout, stderr := resume(t, "2 ranks over a corrupt step 6", 2, d, ckptArgs)
		if !strings.Contains(stdout, "[rank0]: resumed from step 3\n") || !strings.Contains(stderr, "skipping an unreadable checkpoint") ||
			!strings.Contains(stderr, path) || !strings.Contains(stderr, "corrupt") {
			t.Errorf("did not skip the corrupt step 6 with a warning:\nstdout:\n%s\nstderr:\n%s", stdout, stderr)
		}
		wantCRC(t, "2 ranks over a corrupt step 6", 2, want, stdout, stderr)
	})
	t.Run("another model", func(t *testing.T) {
		stdout, stderr, err := launch(t, ddprun, ddprunFlags(2, 0), nil,
			strings.Replace(ckptArgs, "--hidden_size 16", "--hidden_size 8", 1)+" --resume --checkpoint_dir "+copyDir(t, dir))
		const msg = `tensor "w1" has shape [16 4], in this model [8 4]`
		if err == nil || !strings.Contains(stderr, msg) || strings.Contains(stdout, "params_crc32") {
			t.Errorf("a narrower model: ddprun %v, want a failure saying %q\nstdout:\n%s\nstderr:\n%s", err, msg, stdout, stderr)
		}
	})
}

// TestKillRestart: 2 ranks under ddprun --max_restarts 1; one rank is killed (kill -9:
// the follower after step 7, or rank 0, the writer, after step 10); ddprun restarts the
// group, which resumes from the last checkpoint (step 6, or 9) and ends with the
// params_crc32 of the uninterrupted run.
func TestKillRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun, kills a rank")
	}
	ddprun := buildDDPRun(t)
	want := uninterrupted(t, ckptArgs)
	for _, c := range []struct{ rank, step, from int }{{1, 7, 6}, {0, 10, 9}} {
		t.Run(fmt.Sprintf("rank %d after step %d", c.rank, c.step), func(t *testing.T) {
			stdout, stderr, err := launch(t, ddprun, ddprunFlags(2, 1), []string{fmt.Sprintf("%s=%d:%d", killEnv, c.rank, c.step)},
				ckptArgs+" --checkpoint_dir "+t.TempDir())
			if err != nil {
				t.Fatalf("ddprun: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
			}
			// ddprun names the first rank it sees fail: the killed one, or its peer, which
			// may notice the lost connection and exit before the killed rank is reaped.
			if !strings.Contains(stderr, "failed on attempt 0") || !strings.Contains(stderr, "restarting the group (restart 1 of 1)") {
				t.Errorf("ddprun did not report a failure on attempt 0 and restart after rank %d's death:\n%s", c.rank, stderr)
			}
			if !strings.Contains(stdout, fmt.Sprintf("[rank0]: resumed from step %d\n", c.from)) {
				t.Errorf("the second attempt did not resume from step %d:\n%s", c.from, stdout)
			}
			wantCRC(t, "after a restart", 2, want, stdout, stderr)
		})
	}
}

// TestTorchrunKillRestart is TestKillRestart under torchrun --max_restarts 1.
func TestTorchrunKillRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("starts torchrun")
	}
	torchrun, err := exec.LookPath("torchrun")
	if err != nil {
		t.Skip("torchrun not found (Debian: apt-get install python3-torch): skipped")
	}
	want := uninterrupted(t, ckptArgs)
	// As in examples/transformer's launcher tests: Debian's torch 1.13 under Python 3.11
	// needs --redirects and --tee other than 0; the agent looks at its workers every 0.2 s.
	flags := []string{"--redirects", "1", "--tee", "1", "--log_dir", t.TempDir(), "--monitor_interval", "0.2", "--no_python",
		"--standalone", "--nnodes", "1", "--nproc_per_node", "2", "--max_restarts", "1"}
	stdout, stderr, err := launch(t, torchrun, flags, []string{killEnv + "=1:7"}, ckptArgs+" --checkpoint_dir "+t.TempDir())
	if err != nil {
		t.Fatalf("torchrun: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	if !strings.Contains(stdout, "resumed from step 6") {
		t.Errorf("the second attempt did not resume from step 6:\n%s", stdout)
	}
	crcs := regexp.MustCompile(`params_crc32=[0-9a-f]{8}`).FindAllString(stdout, -1)
	if len(crcs) != 2 || crcs[0] != want || crcs[1] != want {
		t.Errorf("torchrun: %v, want %s from each of 2 ranks\n%s", crcs, want, stdout)
	}
}
