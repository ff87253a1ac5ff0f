package main

import (
	"bytes"
	"fmt"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestZeroUnderDDPRun launches this trainer under the real ddprun on 2 ranks with --zero
// 0, 1 and 2 (one layer, hidden 64, buckets of about 50 KB so that the rebuild moves them,
// dropout on) and checks that every rank of each run ends with the params_crc32 of --zero
// 0 (at 2 ranks a reduce-scatter adds what the all-reduce adds), and that each rank's
// optimizer state is at most half of --zero 0's plus two buckets' worth (AdamW's two
// moments of one bucket).
func TestZeroUnderDDPRun(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	ddprun := shardsLauncher(t)
	const args = "--num_layers 1 --hidden_size 64 --warmup_steps 1 --bench_steps 4 --lr 1e-3 --bucket_cap_mb 0.05 --first_bucket_cap_mb 0.01 --log_every 0"
	stateRE := regexp.MustCompile(`\[rank(\d)\]: rank \d optimizer_state_bytes=(\d+)`)
	var want string
	var plain [2]int64
	for zero := 0; zero <= 2; zero++ {
		last, stdout, stderr, err := launchRanks(t, ddprun, 2, fmt.Sprintf("%s --zero %d", args, zero))
		if err != nil {
			t.Fatalf("--zero %d: %v\n%s\n%s", zero, err, stdout, stderr)
		}
		if zero == 0 {
			want = last["rank0"]
		}
		if last["rank0"] != want || last["rank1"] != want || !regexp.MustCompile(`^params_crc32=`).MatchString(want) {
			t.Errorf("--zero %d: last lines %q, --zero 0's %q", zero, last, want)
		}
		m := stateRE.FindAllStringSubmatch(stdout, -1)
		if len(m) != 2 {
			t.Fatalf("--zero %d: %d optimizer_state_bytes lines:\n%s", zero, len(m), stdout)
		}
		for _, s := range m {
			r, _ := strconv.Atoi(s[1])
			b, _ := strconv.ParseInt(s[2], 10, 64)
			if zero == 0 {
				plain[r] = b
			} else if limit := plain[r]/2 + 2*52429; b > limit || b == 0 {
				t.Errorf("--zero %d: rank %d holds %d bytes of AdamW state, --zero 0 %d, limit %d", zero, r, b, plain[r], limit)
			}
		}
	}
}

// TestZeroFlags: --zero out of range, or with what it cannot take yet, is refused naming
// the flag; so is --zero_overlap without --zero or with --inject_nan, and
// --zero_forward_overlap without --zero or with --zero_overlap.
func TestZeroFlags(t *testing.T) {
	for _, args := range []string{"--zero 3", "--zero 2 --no_ddp", "--zero 1 --bucket_cap_mb auto", "--zero_overlap", "--zero 2 --zero_overlap --inject_nan 0:1:0",
		"--zero_forward_overlap", "--zero 2 --zero_overlap --zero_forward_overlap"} {
		if _, err := parseFlags(strings.Fields(args), &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "--zero") {
			t.Errorf("%s: %v, want an error naming --zero", args, err)
		}
	}
}

// TestZeroOverlapUnderDDPRun launches this trainer under the real ddprun on 2 ranks with
// --zero 1 and 2 and --zero_overlap (TestZeroUnderDDPRun's model: the rebuild moves the
// buckets, dropout on): every rank ends with the params_crc32 of --zero 0, the bits of
// --zero without the overlap; so does --zero_forward_overlap, whose all-gathers the next
// forward waits for. A --zero 2 --zero_overlap run checkpointed after 3 steps and resumed
// with --zero_overlap to 6 ends with the uninterrupted run's params_crc32: the per-bucket
// optimizers' state goes through the file whole; and so does one with
// --zero_forward_overlap, whose file is written with the last step's all-gathers in
// flight (GatherOptimizerState completes them first).
func TestZeroOverlapUnderDDPRun(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	ddprun := shardsLauncher(t)
	const args = "--num_layers 1 --hidden_size 64 --warmup_steps 1 --lr 1e-3 --bucket_cap_mb 0.05 --first_bucket_cap_mb 0.01 --log_every 0 --checkpoint_every 100"
	run := func(extra string) string {
		t.Helper()
		last, stdout, stderr, err := launchRanks(t, ddprun, 2, args+" "+extra)
		if err != nil {
			t.Fatalf("%s: %v\n%s\n%s", extra, err, stdout, stderr)
		}
		if last["rank1"] != last["rank0"] || !regexp.MustCompile(`^params_crc32=`).MatchString(last["rank0"]) {
			t.Fatalf("%s: last lines %q", extra, last)
		}
		return last["rank0"]
	}
	want := run("--bench_steps 5 --zero 0")
	for zero := 1; zero <= 2; zero++ {
		for _, o := range []string{"--zero_overlap", "--zero_forward_overlap"} {
			if got := run(fmt.Sprintf("--bench_steps 5 --zero %d %s", zero, o)); got != want {
				t.Errorf("--zero %d %s: %s, --zero 0: %s", zero, o, got, want)
			}
		}
	}
	dir := filepath.Join(t.TempDir(), "ckpt")
	run("--bench_steps 2 --zero 2 --zero_overlap --checkpoint_dir " + dir)
	if got := run("--bench_steps 5 --zero 2 --zero_overlap --resume --checkpoint_dir " + dir); got != want {
		t.Errorf("--zero 2 --zero_overlap for 3 steps, resumed to 6: %s, uninterrupted --zero 0: %s", got, want)
	}
	dir = filepath.Join(t.TempDir(), "ckpt")
	run("--bench_steps 2 --zero 1 --zero_forward_overlap --checkpoint_dir " + dir)
	if got := run("--bench_steps 5 --zero 1 --zero_forward_overlap --resume --checkpoint_dir " + dir); got != want {
		t.Errorf("--zero 1 --zero_forward_overlap for 3 steps, resumed to 6: %s, uninterrupted --zero 0: %s", got, want)
	}
}

// TestZeroCheckpointResume launches this trainer under the real ddprun on 2 ranks: a run
// checkpoints after 3 of its 6 steps at one --zero stage and is resumed (--resume) to 6 at
// another (2 → 1, 2 → 0, 0 → 2, 1 → 2); each prints the params_crc32 of the uninterrupted
// --zero 0 run, so the shards' AdamW state went through the file whole. So do the runs
// that change the world size with the samples per step: 2 ranks at --zero 2 resumed by 1
// rank with --accum_steps 2 at --zero 1, and the reverse (at 2 ranks, or 2 micro-batches,
// the sums are the same bits). 1 rank with --accum_steps 1 is refused, naming the setting.
func TestZeroCheckpointResume(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	ddprun := shardsLauncher(t)
	const args = "--num_layers 1 --hidden_size 64 --warmup_steps 1 --lr 1e-3 --bucket_cap_mb 0.05 --first_bucket_cap_mb 0.01 --log_every 0 --checkpoint_every 100"
	run := func(n int, extra string) (string, string) {
		t.Helper()
		last, stdout, stderr, err := launchRanks(t, ddprun, n, args+" "+extra)
		if err != nil {
			t.Fatalf("%s: %v\n%s\n%s", extra, err, stdout, stderr)
		}
		for r := range n {
			if last[fmt.Sprint("rank", r)] != last["rank0"] || !regexp.MustCompile(`^params_crc32=`).MatchString(last["rank0"]) {
				t.Fatalf("%s: last lines %q", extra, last)
			}
		}
		return last["rank0"], stdout
	}
	want, _ := run(2, "--bench_steps 5 --zero 0")
	short, _ := run(2, "--bench_steps 2 --zero 0")
	if short == want {
		t.Fatalf("3 and 6 steps end with the same %s", want)
	}
	for _, c := range [][2]int{{2, 1}, {2, 0}, {0, 2}, {1, 2}} {
		dir := filepath.Join(t.TempDir(), "ckpt")
		run(2, fmt.Sprintf("--bench_steps 2 --zero %d --checkpoint_dir %s", c[0], dir))
		got, stdout := run(2, fmt.Sprintf("--bench_steps 5 --zero %d --checkpoint_dir %s --resume", c[1], dir))
		if !strings.Contains(stdout, "start_step=3") {
			t.Fatalf("--zero %d → %d: did not resume at step 3:\n%s", c[0], c[1], stdout)
		}
		if got != want {
			t.Errorf("--zero %d for 3 steps, resumed at --zero %d to 6: %s, uninterrupted --zero 0: %s", c[0], c[1], got, want)
		}
	}
	for _, c := range [][2]string{
		{"2 --zero 2", "1 --zero 1 --accum_steps 2"},
		{"1 --zero 1 --accum_steps 2", "2 --zero 2"},
	} {
		first, then := strings.SplitN(c[0], " ", 2), strings.SplitN(c[1], " ", 2)
		n0, n1 := int(first[0][0]-'0'), int(then[0][0]-'0')
		dir := filepath.Join(t.TempDir(), "ckpt")
		run(n0, "--bench_steps 2 --checkpoint_dir "+dir+" "+first[1])
		if got, _ := run(n1, "--bench_steps 5 --resume --checkpoint_dir "+dir+" "+then[1]); got != want {
			t.Errorf("%d rank(s) %s for 3 steps, resumed by %d rank(s) %s to 6: %s, uninterrupted: %s", n0, first[1], n1, then[1], got, want)
		}
	}
	dir := filepath.Join(t.TempDir(), "ckpt")
	run(2, "--bench_steps 2 --zero 2 --checkpoint_dir "+dir)
	_, stdout, stderr, err := launchRanks(t, ddprun, 1, args+" --bench_steps 5 --zero 1 --resume --checkpoint_dir "+dir)
	if err == nil || !strings.Contains(stdout+stderr, "world size × --accum_steps") {
		t.Errorf("resume at 1 rank of a 2-rank checkpoint: %v, want a refusal naming world size × --accum_steps\n%s\n%s", err, stdout, stderr)
	}
}
