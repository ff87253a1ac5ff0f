package main

import (
	"bytes"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/internal/launchtest"
)

// shardArgs: 6 logical shards of 2 samples (a global batch of 12) of a small model with
// dropout on (the default 0.1), buckets of about 2 KB (so that each step gathers several),
// 4 steps.
const shardArgs = "--num_layers 1 --hidden_size 32 --seq_len 16 --warmup_steps 0 --bench_steps 4 --log_every 1 --lr 1e-3" +
	" --global_batch_size 12 --micro_batch_size 2 --bucket_cap_mb 0.002 --first_bucket_cap_mb 0.002"

// shardsLauncher builds the real ddprun into a temporary folder.
func shardsLauncher(t *testing.T) string { return launchtest.DDPRun(t) }

// launchRanks runs n ranks of this trainer (this test binary) under ddprun with args and
// returns each rank's last line of stdout ("rank0" → line), and its stdout and stderr.
func launchRanks(t *testing.T, ddprun string, n int, args string) (last map[string]string, stdout, stderr string, err error) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return launchtest.Ranks(t, ddprun, n, exe, []string{asMainEnv + "=1"}, 3*time.Minute, args)
}

var lossRE = regexp.MustCompile(`(?m)^(?:\[rank0\]: )?(step \d+ loss [0-9.e+-]+)`)

// losses are the "step N loss L" lines of out, without their timings.
func losses(out string) []string {
	var l []string
	for _, m := range lossRE.FindAllStringSubmatch(out, -1) {
		l = append(l, m[1])
	}
	return l
}

// TestShardsSameBitsAtEveryWorldSize launches this trainer under the real ddprun with 6
// logical shards at world sizes 1, 2, 3 and 6, for both tasks with dropout on, and checks
// that every rank of every run ends with one params_crc32 and that rank 0 prints the same
// losses, those of one process (--no_ddp) that runs the 6 shards and sums their gradients
// in shard order itself. The same samples with today's all-reduce (3 ranks, --batch_size 2
// --accum_steps 2) end with another crc, so the comparison can tell.
func TestShardsSameBitsAtEveryWorldSize(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	ddprun := shardsLauncher(t)
	for _, task := range []string{"mse", "copy"} {
		args := shardArgs + " --task " + task
		p, out := trainArgs(t, args+" --no_ddp")
		want := fmt.Sprintf("params_crc32=%08x", paramsCRC32(p))
		wantLoss := losses(out)
		if len(wantLoss) != 4 {
			t.Fatalf("%s --no_ddp: %d loss lines, want 4:\n%s", task, len(wantLoss), out)
		}
		for _, n := range []int{1, 2, 3, 6} {
			last, stdout, stderr, err := launchRanks(t, ddprun, n, args)
			if err != nil {
				t.Fatalf("%s, world %d: ddprun: %v\nstdout:\n%s\nstderr:\n%s", task, n, err, stdout, stderr)
			}
			if len(last) != n {
				t.Fatalf("%s, world %d: last lines of %d ranks: %q", task, n, len(last), last)
			}
			for rank, line := range last {
				if line != want {
					t.Errorf("%s, world %d: %s ends with %q; one process with the same 6 shards: %q", task, n, rank, line, want)
				}
			}
			if got := losses(stdout); strings.Join(got, "\n") != strings.Join(wantLoss, "\n") {
				t.Errorf("%s, world %d: rank 0's losses %q, one process's %q", task, n, got, wantLoss)
			}
		}
		if task != "mse" {
			continue
		}
		today := strings.Replace(args, "--global_batch_size 12 --micro_batch_size 2", "--batch_size 2 --accum_steps 2", 1)
		last, stdout, stderr, err := launchRanks(t, ddprun, 3, today)
		if err != nil {
			t.Fatalf("today's all-reduce: ddprun: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
		}
		if last["rank0"] == want || !strings.HasPrefix(last["rank0"], "params_crc32=") {
			t.Errorf("today's all-reduce over 3 ranks ends with %q, the shards' crc %q: the comparison cannot tell\nstdout:\n%s", last["rank0"], want, stdout)
		}
	}
}

// TestShardsWorldSizeRefused: 4 ranks cannot share 6 shards; the ranks fail at start with
// an error that names the flags and says which world sizes work (ddprun stops the others
// at the first failure, so a rank may go before it says it), and none trains.
func TestShardsWorldSizeRefused(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	_, stdout, stderr, err := launchRanks(t, shardsLauncher(t), 4, shardArgs)
	const msg = "transformer: --global_batch_size 12 / --micro_batch_size 2: ddp: invalid argument: Options.Shards: 6 shards cannot be spread over a world of 4 ranks: every rank runs the same number of shards, so the world size must divide 6; world sizes that work: 1, 2, 3, 6"
	if err == nil || !strings.Contains(stdout+stderr, msg) || strings.Contains(stdout, "params_crc32=") || strings.Contains(stdout, " loss ") {
		t.Fatalf("ddprun: %v, want the ranks to fail saying %q\nstdout:\n%s\nstderr:\n%s", err, msg, stdout, stderr)
	}
}

// TestShardsResumeAtAnotherWorldSize: with --global_batch_size a checkpoint written by 3
// ranks after 2 steps resumes on 2 ranks, and one written by 2 ranks after 4 steps resumes
// in one process (--no_ddp), each ending with the bits of the uninterrupted run.
func TestShardsResumeAtAnotherWorldSize(t *testing.T) {
	args := strings.Replace(shardArgs, " --bench_steps 4", "", 1) + " --checkpoint_every 2 --bench_steps "
	want, _ := trainArgs(t, args+"6 --no_ddp")
	dir := t.TempDir()
	trainRanks(t, 3, args+"2 --checkpoint_dir "+dir)
	ps, outs := trainRanks(t, 2, args+"4 --resume --checkpoint_dir "+dir)
	if !strings.Contains(outs[0], " world=2 ") || !strings.Contains(outs[0], " start_step=2\n") {
		t.Fatalf("2 ranks did not resume at step 2:\n%s", outs[0])
	}
	for r := range 2 {
		assertSame(t, fmt.Sprintf("rank %d of 2, resumed from 3 ranks' step 2, at step 4", r), wantAt(t, args, 4), ps[r])
	}
	p, out := trainArgs(t, args+"6 --no_ddp --resume --checkpoint_dir "+dir)
	if !strings.Contains(out, " start_step=4\n") {
		t.Fatalf("one process did not resume at step 4:\n%s", out)
	}
	assertSame(t, "one process, resumed from 2 ranks' step 4", want, p)
}

// wantAt is the parameters of one uninterrupted process after steps steps of args.
func wantAt(t *testing.T, args string, steps int) []float32 {
	t.Helper()
	p, _ := trainArgs(t, fmt.Sprintf("%s%d --no_ddp", args, steps))
	return p
}

// TestShardFlags: --global_batch_size and --micro_batch_size are checked together, and
// refuse the flags that cannot go beside them.
func TestShardFlags(t *testing.T) {
	f, err := parseFlags(strings.Fields("--global_batch_size 12 --micro_batch_size 2"), &bytes.Buffer{})
	if err != nil || f.shards() != 6 {
		t.Fatalf("12 / 2: %d shards, %v", f.shards(), err)
	}
	if f, err := parseFlags(nil, &bytes.Buffer{}); err != nil || f.shards() != 0 {
		t.Fatalf("without --global_batch_size: %d shards, %v", f.shards(), err)
	}
	if f, err := parseFlags(strings.Fields("--global_batch_size 12 --micro_batch_size 2 --comm_hook powersgd"), &bytes.Buffer{}); err != nil || f.shards() != 6 {
		t.Fatalf("12 / 2 with --comm_hook powersgd (the hook reduces the shards): %d shards, %v", f.shards(), err)
	}
	for args, want := range map[string]string{
		"--global_batch_size 12":                                           "--global_batch_size 12, --micro_batch_size 0: want both positive",
		"--micro_batch_size 2":                                             "--global_batch_size 0, --micro_batch_size 2: want both positive",
		"--global_batch_size 13 --micro_batch_size 2":                      "the global batch a multiple of the micro-batch",
		"--global_batch_size 12 --micro_batch_size 2 --batch_size 8":       "drop --batch_size and --accum_steps",
		"--global_batch_size 12 --micro_batch_size 2 --accum_steps 2":      "drop --batch_size and --accum_steps",
		"--global_batch_size 12 --micro_batch_size 2 --bucket_cap_mb auto": "a fixed --bucket_cap_mb, not auto",
	} {
		if _, err := parseFlags(strings.Fields(args), &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error saying %q", args, err, want)
		}
	}
}
