//go:build linux

package main

import (
	"bufio"
	"bytes"
	"context"
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

	"github.com/goddp/goddp/internal/launchtest"
)

// TestKillRestart is scripts/kill_test.sh at tiny size: under the real ddprun with
// --max_restarts 1 (this test binary acting as the trainer), one rank's process gets a real
// SIGKILL as soon as rank 0 reports a given step; ddprun restarts the group, the ranks
// resume from their agreed checkpoint, and the run ends with the params_crc32 of an
// uninterrupted run.
func TestKillRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun, kills ranks")
	}
	dir := t.TempDir()
	ddprun := launchtest.DDPRun(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	args := tinyDDPFlags + " --batch_size 2 --warmup_steps 0 --bench_steps 16 --checkpoint_every 3"
	ref, _ := trainRanks(t, 2, args)
	want := fmt.Sprintf("%08x", paramsCRC32(ref[0]))
	crcRE := regexp.MustCompile(`(?m)^\[rank(\d)\]: params_crc32=([0-9a-f]{8})$`)
	startRE := regexp.MustCompile(`(?m)^\[rank0\]: params=.* start_step=(\d+)$`)

	for _, c := range []struct{ rank, step int }{{1, 7}, {0, 11}} {
		t.Run(fmt.Sprintf("rank %d at step %d", c.rank, c.step), func(t *testing.T) {
			ckpt := filepath.Join(dir, fmt.Sprintf("r%d_s%d", c.rank, c.step))
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, ddprun, append([]string{"--standalone", "--nproc_per_node", "2", "--max_restarts", "1", exe, "--"},
				strings.Fields(args+" --checkpoint_dir "+ckpt)...)...)
			cmd.Env = append(os.Environ(), asMainEnv+"=1")
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			pipe, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			var stdout strings.Builder
			killed := -1
			trigger := fmt.Sprintf("[rank0]: step %d loss ", c.step)
			sc := bufio.NewScanner(pipe)
			for sc.Scan() {
				line := sc.Text()
				stdout.WriteString(line + "\n")
				if killed < 0 && strings.HasPrefix(line, trigger) {
					b, err := os.ReadFile(filepath.Join(ckpt, fmt.Sprintf("rank%d.pid", c.rank)))
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
			if err := cmd.Wait(); err != nil {
				t.Fatalf("ddprun: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
			}
			out := stdout.String()
			if killed < 0 {
				t.Fatalf("rank 0 never reported step %d:\n%s", c.step, out)
			}
			if !strings.Contains(stderr.String(), fmt.Sprintf("rank %d (local_rank %d, host", c.rank, c.rank)) ||
				!strings.Contains(stderr.String(), "failed on attempt 0") {
				t.Errorf("ddprun did not report rank %d's death:\n%s", c.rank, stderr.String())
			}
			starts := startRE.FindAllStringSubmatch(out, -1)
			if len(starts) != 2 || starts[0][1] != "0" || starts[1][1] == "0" {
				t.Errorf("want a first attempt from step 0 and a resumed second one: %v\n%s", starts, out)
			}
			crcs := crcRE.FindAllStringSubmatch(out, -1)
			if len(crcs) != 2 {
				t.Fatalf("want one params_crc32 per rank (of the second attempt):\n%s", out)
			}
			for _, m := range crcs {
				if m[2] != want {
					t.Errorf("rank %s: params_crc32=%s, uninterrupted run %s", m[1], m[2], want)
				}
			}
			t.Logf("killed rank %d (pid %d) at step %d; resumed from step %s; params_crc32=%s (uninterrupted %s)",
				c.rank, killed, c.step, starts[len(starts)-1][1], crcs[0][2], want)
		})
	}
}
