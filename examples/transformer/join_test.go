package main

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
)

// joinArgs: a small model with dropout on, buckets of about 2 KB (several per step, so
// that a joined rank shadows several all-reduces and the first step's rebuild moves them).
const joinArgs = "--num_layers 1 --hidden_size 32 --seq_len 8 --warmup_steps 0 --log_every 1 --lr 1e-3" +
	" --bucket_cap_mb 0.002 --first_bucket_cap_mb 0.002"

// TestUnevenStepsUnderDDPRun launches this trainer under the real ddprun with
// --steps_per_rank 3,5 on 2 ranks and 0,0,3,5 on 4 (two ranks with no data at all). Each
// job finishes, every rank ends with one params_crc32, and it is the crc of one process
// (--no_ddp --steps_per_rank) that runs, in each step, the micro-batches of the ranks
// that still have data, each loss scaled by 1/world: with zeros from the joined ranks and
// two real contributions the sums are the same bits. The same process with every rank's
// data in every step (5,5), or with the steps of the shortest rank only (3,3), ends with
// another crc, so the comparison can tell that the joined rank neither added data nor
// cut the others' steps short.
func TestUnevenStepsUnderDDPRun(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	ddprun := shardsLauncher(t)
	crc := func(steps string) string {
		p, _ := trainArgs(t, joinArgs+" --no_ddp --steps_per_rank "+steps)
		return fmt.Sprintf("params_crc32=%08x", paramsCRC32(p))
	}
	for _, c := range []struct {
		n           int
		steps, even string
		short       string
	}{{2, "3,5", "5,5", "3,3"}, {4, "0,0,3,5", "5,5,5,5", "0,0,3,3"}} {
		want := crc(c.steps)
		for _, other := range []string{c.even, c.short} {
			if got := crc(other); got == want {
				t.Fatalf("--no_ddp --steps_per_rank %s and %s both end with %s: the test cannot tell", c.steps, other, got)
			}
		}
		last, stdout, stderr, err := launchRanks(t, ddprun, c.n, joinArgs+" --steps_per_rank "+c.steps)
		if err != nil {
			t.Fatalf("--steps_per_rank %s: %v\nstdout:\n%s\nstderr:\n%s", c.steps, err, stdout, stderr)
		}
		for r := range c.n {
			if got := last[fmt.Sprint("rank", r)]; got != want {
				t.Errorf("--steps_per_rank %s: rank %d ends with %q, one process with the same batches %q\nstdout:\n%s", c.steps, r, got, want, stdout)
			}
		}
	}
}

// TestStepsPerRankFlags: bad --steps_per_rank values, and what it cannot go beside, are
// refused naming the flag; so is a count per rank that does not match the world.
func TestStepsPerRankFlags(t *testing.T) {
	for _, args := range []string{
		"--steps_per_rank 3,x", "--steps_per_rank 3,-1", "--steps_per_rank ''", "--steps_per_rank 3,5 --bench_steps 4",
		"--steps_per_rank 3,5 --zero 1", "--steps_per_rank 3,5 --checkpoint_dir /tmp/x",
		"--steps_per_rank 3,5 --bucket_cap_mb auto", "--steps_per_rank 3,5 --inject_nan 0:1:0",
		"--steps_per_rank 4,4 --global_batch_size 8 --micro_batch_size 2",
	} {
		if _, err := parseFlags(strings.Fields(args), &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "--steps_per_rank") {
			t.Errorf("%s: %v, want an error naming --steps_per_rank", args, err)
		}
	}
	_, _, errs := runRanks(t, 2, tinyDDPFlags+" --steps_per_rank 1,2,3", nil)
	for r, err := range errs {
		if err == nil || !strings.Contains(err.Error(), "--steps_per_rank [1 2 3]: 3 counts for a world of 2 ranks") {
			t.Errorf("rank %d: %v, want the counts named against the world", r, err)
		}
	}
}
