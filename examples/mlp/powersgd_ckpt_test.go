package main

import (
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// psgdCkptArgs: 2 ranks' batches of 4, 12 steps, a checkpoint every 3, PowerSGD of rank 1
// on the 16×4 weight (the rest goes uncompressed), a bucket per parameter.
const psgdCkptArgs = "--hidden_size 16 --steps 12 --log_every 1 --lr 0.3 --batch_size 4 --bucket_cap_mb 0.0001 --first_bucket_cap_mb 0.0001 --checkpoint_every 3 --comm_hook powersgd --powersgd_rank 1"

// TestPowerSGDKillRestart: 2 ranks with --comm_hook powersgd under ddprun --max_restarts
// 1; one rank is killed (the follower after step 7, or rank 0, the writer, after step 10);
// the group resumes from the last checkpoint (step 6, an even PowerSGD step, or 9, an odd
// one) with each rank's own error feedback and the shared factors, and ends with the
// params_crc32 of the uninterrupted run, bit for bit. A resume with another
// --powersgd_rank, or with --comm_hook none, is refused, naming both hooks.
func TestPowerSGDKillRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun, kills a rank")
	}
	ddprun := buildDDPRun(t)
	stdout, stderr, err := launch(t, ddprun, ddprunFlags(2, 0), nil, psgdCkptArgs+" --checkpoint_dir "+t.TempDir())
	if err != nil {
		t.Fatalf("uninterrupted: ddprun: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	m := crcRE.FindStringSubmatch(stdout)
	if m == nil {
		t.Fatalf("uninterrupted: no params_crc32:\n%s", stdout)
	}
	want := m[2]
	wantCRC(t, "uninterrupted", 2, want, stdout, stderr)
	dirs := map[int]string{}
	for _, c := range []struct{ rank, step, from int }{{1, 7, 6}, {0, 10, 9}} {
		dir := t.TempDir() // the parent's: kept for the refusals
		dirs[c.from] = dir
		t.Run(fmt.Sprintf("rank %d after step %d", c.rank, c.step), func(t *testing.T) {
			stdout, stderr, err := launch(t, ddprun, ddprunFlags(2, 1), []string{fmt.Sprintf("%s=%d:%d", killEnv, c.rank, c.step)},
				psgdCkptArgs+" --checkpoint_dir "+dir)
			if err != nil {
				t.Fatalf("ddprun: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
			}
			if !strings.Contains(stderr, "restarting the group (restart 1 of 1)") || !strings.Contains(stdout, fmt.Sprintf("[rank0]: resumed from step %d\n", c.from)) {
				t.Fatalf("the second attempt did not resume from step %d:\nstdout:\n%s\nstderr:\n%s", c.from, stdout, stderr)
			}
			wantCRC(t, "after a restart", 2, want, stdout, stderr)
		})
	}
	dir := dirs[9]
	if dir == "" {
		t.Fatal("no checkpoints to resume")
	}
	hook := func(rank int) string {
		return fmt.Sprintf("comm_hook powersgd(rank %d, min_compression_rate 2, start_iter 0, seed 1)", rank)
	}
	for _, c := range []struct{ flags, msg string }{
		{"--powersgd_rank 2", "was written with " + hook(1) + " (this run has " + hook(2) + ")"},
		{"--comm_hook none", "holds the comm_hook state of powersgd(rank 1, min_compression_rate 2, start_iter 0, seed 1) (this run keeps no comm_hook state)"},
	} {
		args := strings.Replace(psgdCkptArgs, "--steps 12", "--steps 14", 1) + " " + c.flags + " --resume --checkpoint_dir " + copyDir(t, dir)
		stdout, stderr, err := launch(t, ddprun, ddprunFlags(2, 0), nil, args)
		if err == nil || !strings.Contains(stderr, c.msg) || regexp.MustCompile(`params_crc32`).MatchString(stdout) {
			t.Errorf("resumed with %s: ddprun %v, want a failure saying %q\nstdout:\n%s\nstderr:\n%s", c.flags, err, c.msg, stdout, stderr)
		}
	}
}

// TestPowerSGDResumeAtAnotherWorldSize: with --global_batch_size (6 shards of 4) and
// --comm_hook powersgd, the hook reduces the shards (hooked.go), so the data of a step do
// not depend on the world size and a checkpoint resumes at another. 3 ranks under ddprun
// checkpoint every 3 steps until rank 1 is killed after step 7; 2 ranks resume from step
// 6 (each taking the 3 ranks' summed error over 2, and the shared factors: Note
// [PowerSGD checkpoints]), train to step 30, agree bit for bit, and the loss goes on
// falling: the mean of steps 24-29 is below half that of steps 0-3.
func TestPowerSGDResumeAtAnotherWorldSize(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun, kills a rank")
	}
	ddprun := buildDDPRun(t)
	args := strings.Replace(ckptArgs, "--steps 12", "--steps 30", 1) + " --comm_hook powersgd --powersgd_rank 1"
	dir := t.TempDir()
	stdout1, stderr, err := launch(t, ddprun, ddprunFlags(3, 0), []string{killEnv + "=1:7"}, args+" --checkpoint_dir "+dir)
	if err == nil {
		t.Fatalf("3 ranks, rank 1 killed: ddprun succeeded\nstdout:\n%s\nstderr:\n%s", stdout1, stderr)
	}
	stdout2, stderr, err := launch(t, ddprun, ddprunFlags(2, 0), nil, args+" --resume --checkpoint_dir "+dir)
	if err != nil {
		t.Fatalf("2 ranks resuming: ddprun: %v\nstdout:\n%s\nstderr:\n%s", err, stdout2, stderr)
	}
	if !strings.Contains(stdout2, "[rank0]: resumed from step 6\n") {
		t.Fatalf("the 2 ranks did not resume from step 6:\n%s", stdout2)
	}
	m := crcRE.FindAllStringSubmatch(stdout2, -1)
	if len(m) != 2 || m[0][2] != m[1][2] {
		t.Fatalf("want the same params_crc32 from each of 2 ranks: %v\n%s", m, stdout2)
	}
	losses := map[int]float64{}
	for _, l := range regexp.MustCompile(`(?m)^\[rank0\]: step (\d+) loss ([0-9.e+-]+)$`).FindAllStringSubmatch(stdout1+stdout2, -1) {
		s, _ := strconv.Atoi(l[1])
		v, _ := strconv.ParseFloat(l[2], 64)
		losses[s] = v // the resumed run's, for steps both ran
	}
	mean := func(from, to int) float64 {
		var sum float64
		for s := from; s <= to; s++ {
			v, ok := losses[s]
			if !ok || math.IsNaN(v) {
				t.Fatalf("no finite loss of step %d:\n%s\n%s", s, stdout1, stdout2)
			}
			sum += v
		}
		return sum / float64(to-from+1)
	}
	early, late := mean(0, 3), mean(24, 29)
	t.Logf("mean loss: steps 0-3 (3 ranks) %.5f, steps 24-29 (2 ranks, resumed at 6) %.5f", early, late)
	if !(late < early/2) {
		t.Errorf("the loss did not fall after the resume at 2 ranks: steps 0-3 %.5f, steps 24-29 %.5f", early, late)
	}
}
