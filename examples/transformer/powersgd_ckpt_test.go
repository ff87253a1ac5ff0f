package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/ddp/checkpoint"
	"github.com/goddp/goddp/internal/launchtest"
)

// TestPowerSGDCheckpointResume: under the real ddprun, 2 ranks with --comm_hook powersgd
// stop after 5 steps (the checkpoint of step 5: an odd PowerSGD step comes next) and
// resume to step 10 with --resume; every rank ends with the params_crc32 of the 10 steps
// run without a stop, bit for bit, since each rank gets back its own error feedback and
// the shared factors. A resume with another --powersgd_rank is refused, naming both.
func TestPowerSGDCheckpointResume(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	run := twoRanks(t)
	crcRE := regexp.MustCompile(`(?m)^\[rank(\d)\]: params_crc32=([0-9a-f]{8})$`)
	crcs := func(what, args string) (got []string, stdout string) {
		t.Helper()
		stdout, stderr, err := run(args)
		if err != nil {
			t.Fatalf("%s: ddprun: %v\nstdout:\n%s\nstderr:\n%s", what, err, stdout, stderr)
		}
		for _, m := range crcRE.FindAllStringSubmatch(stdout, -1) {
			got = append(got, m[2])
		}
		if len(got) != 2 || got[0] != got[1] {
			t.Fatalf("%s: want one params_crc32 per rank, the same: %v\n%s", what, got, stdout)
		}
		return got, stdout
	}
	args := tinyDDPFlags + " --batch_size 2 --warmup_steps 0 --checkpoint_every 5 --comm_hook powersgd --powersgd_rank 1 --bench_steps "
	ref, _ := crcs("uninterrupted", args+"10 --checkpoint_dir "+t.TempDir())
	want := ref[0]
	dir := t.TempDir()
	crcs("the first 5 steps", args+"5 --checkpoint_dir "+dir)
	got, stdout := crcs("resumed", args+"10 --resume --checkpoint_dir "+dir)
	if got[0] != want {
		t.Errorf("resumed at step 5: params_crc32=%s, the uninterrupted run %s", got[0], want)
	}
	if !strings.Contains(stdout, " start_step=5\n") {
		t.Errorf("the second run did not resume from step 5:\n%s", stdout)
	}
	hook := func(r int) string {
		return fmt.Sprintf("comm_hook powersgd(rank %d, min_compression_rate 2, start_iter 0, seed 0)", r)
	}
	msg := "was written with " + hook(1) + " (this run has " + hook(2) + ")"
	stdout, stderr, err := run(strings.Replace(args, "--powersgd_rank 1", "--powersgd_rank 2", 1) + "10 --resume --checkpoint_dir " + dir)
	if err == nil || !strings.Contains(stderr, msg) || crcRE.MatchString(stdout) {
		t.Errorf("resumed with --powersgd_rank 2: ddprun %v, want a failure saying %q\nstdout:\n%s\nstderr:\n%s", err, msg, stdout, stderr)
	}
}

// TestAutoHookCheckpointResume: under the real ddprun, 2 ranks with --comm_hook auto
// decide after 3 synced steps and run 10 steps, writing the checkpoints of steps 5 and 10.
// With step 10's file removed, a resumed run starts from step 5: it takes the decision from
// the checkpoint instead of measuring again (it says so), and every rank ends with the
// uninterrupted run's params_crc32. The resumed run starts from that run's own file: the
// decision comes from timings, and two runs that each measured may choose differently.
func TestAutoHookCheckpointResume(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	launch := twoRanks(t)
	run := func(what, args string) (crc, stdout string) {
		t.Helper()
		stdout, stderr, err := launch(args)
		if err != nil {
			t.Fatalf("%s: ddprun: %v\nstdout:\n%s\nstderr:\n%s", what, err, stdout, stderr)
		}
		m := regexp.MustCompile(`(?m)^\[rank(\d)\]: params_crc32=([0-9a-f]{8})$`).FindAllStringSubmatch(stdout, -1)
		if len(m) != 2 || m[0][2] != m[1][2] {
			t.Fatalf("%s: want one params_crc32 per rank, the same:\n%s", what, stdout)
		}
		return m[0][2], stdout
	}
	args := tinyDDPFlags + " --batch_size 2 --warmup_steps 0 --checkpoint_every 5 --comm_hook auto --bench_steps "
	dir := t.TempDir()
	want, first := run("uninterrupted", args+"10 --checkpoint_dir "+dir)
	if !strings.Contains(first, "auto hook after 3 synced steps") {
		t.Fatalf("the uninterrupted run did not decide:\n%s", first)
	}
	if err := os.Remove(filepath.Join(dir, checkpoint.FileName(10))); err != nil {
		t.Fatal(err)
	}
	got, stdout := run("resumed", args+"10 --resume --checkpoint_dir "+dir)
	if got != want {
		t.Errorf("resumed at step 5: params_crc32=%s, the uninterrupted run %s", got, want)
	}
	if !strings.Contains(stdout, "auto decision restored from the saved state") || strings.Contains(stdout, "auto hook after 3 synced steps") {
		t.Errorf("the resumed run did not take the saved decision:\n%s", stdout)
	}
}

// twoRanks returns a launcher of this test binary, as the trainer, on 2 ranks under the
// real ddprun (built once) with the given flags: its stdout, its stderr, and how it ended.
func twoRanks(t *testing.T) func(args string) (string, string, error) {
	ddprun := launchtest.DDPRun(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return func(args string) (string, string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, ddprun, append([]string{"--standalone", "--nproc_per_node", "2", exe, "--"}, strings.Fields(args)...)...)
		cmd.Env = append(os.Environ(), asMainEnv+"=1")
		var out, errOut bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errOut
		err := cmd.Run()
		return out.String(), errOut.String(), err
	}
}
