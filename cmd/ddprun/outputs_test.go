package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestOutputPathsCheckedFirst: a --trace_merge or --log_dir that cannot be written fails
// before any rank starts (exit 1, the flag named); folders that do not exist yet are made.
func TestOutputPathsCheckedFirst(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "a-file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	exe := self(t)
	for _, tc := range []struct {
		name string
		args []string
		msg  string
	}{
		{"trace_merge below a file", []string{"--standalone", "--trace_merge", filepath.Join(file, "out", "trace.json"), exe, "env"}, "ddprun: --trace_merge: mkdir " + file + ": not a directory"},
		{"log_dir below a file", []string{"--standalone", "--log_dir", filepath.Join(file, "logs"), exe, "env"}, "ddprun: --log_dir: mkdir " + file + ": not a directory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb syncBuffer
			code := run(context.Background(), tc.args, rankEnvBase(), &out, &errb)
			if code != 1 || !strings.Contains(errb.String(), tc.msg) {
				t.Errorf("exit %d, stderr %q; want exit 1 and %q", code, errb.String(), tc.msg)
			}
			if out.String() != "" || strings.Contains(errb.String(), "building") {
				t.Errorf("ranks ran: stdout %q", out.String())
			}
		})
	}
	// Folders that do not exist yet are made before the ranks start.
	merged := filepath.Join(dir, "new", "out", "trace.json")
	logs := filepath.Join(dir, "new", "logs")
	res := launch(t, context.Background(), rankEnvBase(), []string{"--standalone", "--nproc_per_node", "2", "--trace_merge", merged, "--log_dir", logs}, "env")
	if res.code != 0 {
		t.Fatalf("exit %d\nstderr:\n%s", res.code, res.stderr)
	}
	for _, d := range []string{filepath.Dir(merged), filepath.Join(logs, "attempt_0", "1")} {
		if fi, err := os.Stat(d); err != nil || !fi.IsDir() {
			t.Errorf("%s: %v", d, err)
		}
	}
	if !strings.Contains(res.stderr, "ddprun: --trace_merge: no rank wrote a trace") {
		t.Errorf("the env helper writes no trace; stderr:\n%s", res.stderr)
	}
}
