package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/ddp/tracefile"
	"github.com/goddp/goddp/internal/launchtest"
)

// TestOutputFlagsCheckedFirst: a --trace, --checkpoint_dir or --cpuprofile that cannot be
// written fails before training starts (here before the process group, which this
// environment could not even form), naming the flag.
func TestOutputFlagsCheckedFirst(t *testing.T) {
	file := filepath.Join(t.TempDir(), "a-file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, flag := range []string{"--trace", "--checkpoint_dir", "--cpuprofile"} {
		var out, errb bytes.Buffer
		err := run(context.Background(), []string{flag, filepath.Join(file, "sub", "x")}, &out, &errb)
		if err == nil || !strings.HasPrefix(err.Error(), flag+": mkdir "+file) {
			t.Errorf("%s below a file: %v", flag, err)
		}
	}
}

// TestTraceWithTraceMerge: under the real ddprun, --trace (per-rank files in a folder that
// does not exist yet) and ddprun's --trace_merge (into another new folder) work together:
// each rank's trace is at --trace's path, and ddprun merges both ranks' into one file.
func TestTraceWithTraceMerge(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	dir := t.TempDir()
	ddprun := launchtest.DDPRun(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	mine := filepath.Join(dir, "traces", "run.json")
	merged := filepath.Join(dir, "out", "trace.json")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, ddprun, append([]string{"--standalone", "--nproc_per_node", "2", "--trace_merge", merged, exe, "--"},
		strings.Fields(tinyDDPFlags+" --batch_size 2 --warmup_steps 0 --bench_steps 2 --trace "+mine)...)...)
	cmd.Env = append(os.Environ(), asMainEnv+"=1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("ddprun: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	if !strings.Contains(stderr.String(), "ddprun: merged 2 ranks' traces into "+merged) {
		t.Errorf("stderr:\n%s", stderr.String())
	}
	for _, p := range []string{filepath.Join(dir, "traces", "run.rank0.json"), filepath.Join(dir, "traces", "run.rank1.json")} {
		if fi, err := os.Lstat(p); err != nil || !fi.Mode().IsRegular() {
			t.Errorf("%s: %v; want the rank's trace file", p, err)
		}
	}
	tf, err := tracefile.ReadFile(merged)
	if err != nil {
		t.Fatal(err)
	}
	if got := tf.OtherData.Ranks; len(got) != 2 || got[0] != 0 || got[1] != 1 {
		t.Errorf("merged trace's ranks %v, want [0 1]", got)
	}
}
