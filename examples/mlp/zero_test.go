package main

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// zeroArgs: AdamW on 385 parameters in buckets of about 200 bytes (several per step), 20
// steps.
const zeroArgs = "--hidden_size 64 --steps 20 --log_every 0 --optimizer adamw --lr 0.01 --bucket_cap_mb 0.0002 --first_bucket_cap_mb 0.0001"

// zeroTolerance bounds |--zero 2 − --zero 0| per parameter at 4 ranks (relative to
// max(1, |p|)): the reduce-scatter adds a block's 4 contributions in another order than
// the all-reduce, so each average may differ in its last bits, and AdamW's steps carry
// that on. At 2 ranks the sums are the same and so are the bits.
const zeroTolerance = 1e-5

// zeroRun launches n ranks at --zero zero under ddprun and returns rank 0's parameters
// (--save_params), the params_crc32 line every rank printed (the same, checked) and each
// rank's optimizer_state_bytes.
func zeroRun(t *testing.T, ddprun string, n, zero int, extra string) ([]float32, string, []int64) {
	t.Helper()
	saved := filepath.Join(t.TempDir(), "params.bin")
	args := fmt.Sprintf("%s --zero %d --save_params %s %s", zeroArgs, zero, saved, extra)
	last, stdout, stderr, err := ddprunTrainer(t, ddprun, n, args)
	if err != nil {
		t.Fatalf("--zero %d, %d ranks: %v\nstdout:\n%s\nstderr:\n%s", zero, n, err, stdout, stderr)
	}
	for r := 0; r < n; r++ {
		if l := last[fmt.Sprint("rank", r)]; l != last["rank0"] || !regexp.MustCompile(`^params_crc32=[0-9a-f]{8}$`).MatchString(l) {
			t.Fatalf("--zero %d, %d ranks: rank %d's last line %q, rank 0's %q\n%s", zero, n, r, l, last["rank0"], stdout)
		}
	}
	m := regexp.MustCompile(`\[rank(\d+)\]: optimizer_state_bytes=(\d+)`).FindAllStringSubmatch(stdout, -1)
	bytes := make([]int64, n)
	for _, s := range m {
		r, _ := strconv.Atoi(s[1])
		bytes[r], _ = strconv.ParseInt(s[2], 10, 64)
	}
	if len(m) != n {
		t.Fatalf("--zero %d: %d optimizer_state_bytes lines for %d ranks:\n%s", zero, len(m), n, stdout)
	}
	b, err := os.ReadFile(saved)
	if err != nil {
		t.Fatal(err)
	}
	p := make([]float32, len(b)/4)
	for k := range p {
		p[k] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*k:]))
	}
	return p, last["rank0"], bytes
}

// TestZeroUnderDDPRun launches this trainer under the real ddprun at 2 and 4 ranks with
// --zero 0, 1 and 2 (AdamW, 20 steps) and checks that --zero 1 prints the params_crc32 of
// --zero 0, as --zero 2 does at 2 ranks; at 4 ranks --zero 2's parameters are within
// zeroTolerance of --zero 0's. Each rank's optimizer state is at most 1/n of --zero 0's
// plus one bucket's (the largest, 200 bytes, twice for AdamW's two moments), and the
// parameters moved (AdamW's steps are not lost).
func TestZeroUnderDDPRun(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	ddprun := buildDDPRun(t)
	start := newMLP(64, sineInputs, 1, 1).flat()
	for _, n := range []int{2, 4} {
		plain, plainCRC, plainBytes := zeroRun(t, ddprun, n, 0, "")
		if d := maxDiff(t, start, plain); d < 1e-3 {
			t.Fatalf("%d ranks: the parameters moved %g in 20 steps", n, d)
		}
		for _, zero := range []int{1, 2} {
			p, crc, bytes := zeroRun(t, ddprun, n, zero, "")
			if zero == 1 || n == 2 {
				if crc != plainCRC {
					t.Errorf("%d ranks: --zero %d: %s, --zero 0: %s", n, zero, crc, plainCRC)
				}
			} else if d := maxDiff(t, plain, p); d > zeroTolerance {
				t.Errorf("%d ranks: --zero 2 is %g from --zero 0, more than %g", n, d, zeroTolerance)
			} else {
				t.Logf("%d ranks: --zero 2 within %g of --zero 0 (%s vs %s)", n, d, crc, plainCRC)
			}
			for r, b := range bytes {
				if limit := plainBytes[r]/int64(n) + 2*200; b > limit || b == 0 {
					t.Errorf("%d ranks: --zero %d: rank %d holds %d bytes of optimizer state; --zero 0 %d, limit %d", n, zero, r, b, plainBytes[r], limit)
				}
			}
			t.Logf("%d ranks: --zero %d: optimizer state per rank %v bytes, --zero 0 %v", n, zero, bytes, plainBytes)
		}
	}
}

// TestZeroCheckpointResume: a 2-rank run at --zero 2 checkpoints after 10 of its steps and
// is resumed (--resume) to 20 at --zero 1, and at --zero 0; both print the params_crc32 of
// the uninterrupted --zero 0 run, so the sharded AdamW state went through the checkpoint
// whole.
func TestZeroCheckpointResume(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	ddprun := buildDDPRun(t)
	_, want, _ := zeroRun(t, ddprun, 2, 0, "")
	for _, resumeZero := range []int{1, 0} {
		dir := filepath.Join(t.TempDir(), "ckpt")
		zeroRun(t, ddprun, 2, 2, "--steps 10 --checkpoint_dir "+dir) // the later --steps wins
		_, got, _ := zeroRun(t, ddprun, 2, resumeZero, "--checkpoint_dir "+dir+" --resume")
		if got != want {
			t.Errorf("--zero 2 for 10 steps, resumed at --zero %d to 20: %s, uninterrupted: %s", resumeZero, got, want)
		}
	}
}

// TestZeroFlags: bad --zero and --optimizer values are refused, naming the flag.
func TestZeroFlags(t *testing.T) {
	for args, want := range map[string]string{
		"--zero 3":                      "--zero 3",
		"--zero 1 --no_ddp":             "--zero 1",
		"--optimizer lamb":              `--optimizer "lamb"`,
		"--optimizer momentum --lr -1":  "lr -1",
		"--zero 2 --steps_per_rank 1,2": "--zero 2",
	} {
		if _, err := parseFlags(strings.Fields(args), &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error naming %q", args, err, want)
		}
	}
}
