package main

import (
	"bytes"
	"fmt"
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
// the flag.
func TestZeroFlags(t *testing.T) {
	for _, args := range []string{"--zero 3", "--zero 1 --checkpoint_dir /tmp/x", "--zero 2 --no_ddp", "--zero 1 --bucket_cap_mb auto"} {
		if _, err := parseFlags(strings.Fields(args), &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "--zero") {
			t.Errorf("%s: %v, want an error naming --zero", args, err)
		}
	}
}
