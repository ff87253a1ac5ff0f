package observe

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/tracefile"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestOpenTracePaths: OpenTrace makes the folders its file needs; with a path and
// GODDP_TRACE (ddprun --trace_merge) both set, the trace is written to the path and
// GODDP_TRACE's path is a link to it, replacing a stale file there.
func TestOpenTracePaths(t *testing.T) {
	c := pgtest.NewCluster(1)
	defer c.Close()
	d, err := ddp.New(context.Background(), c.Group(0), []ddp.Param{{Name: "w", Data: make([]float32, 2), Grad: make([]float32, 2)}}, ddp.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	dir := t.TempDir()
	t.Setenv("TORCHELASTIC_RESTART_COUNT", "1")

	// GODDP_TRACE alone: a file in folders that do not exist yet.
	envPath := filepath.Join(dir, "merge", "trace.rank{rank}.a{attempt}.json")
	t.Setenv(TraceEnvVar, envPath)
	readBack := func(path string) {
		t.Helper()
		tf, err := tracefile.ReadFile(path)
		if err != nil || len(tf.TraceEvents) == 0 {
			t.Fatalf("%s: %v", path, err)
		}
	}
	open := func(path string) {
		t.Helper()
		tr, err := OpenTrace(path, d)
		if err != nil {
			t.Fatal(err)
		}
		tr.Span("forward")()
		if err := tr.Close(); err != nil {
			t.Fatal(err)
		}
	}
	open("")
	merged := filepath.Join(dir, "merge", "trace.rank0.a1.json")
	readBack(merged)

	// Both: the file at the path (in new folders), a link to it at GODDP_TRACE's path.
	mine := filepath.Join(dir, "mine", "sub", "x.json")
	open(mine)
	readBack(mine)
	fi, err := os.Lstat(merged)
	if err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Fatalf("%s: %v, mode %v; want a symbolic link", merged, err, fi.Mode())
	}
	if target, _ := os.Readlink(merged); target != mine {
		t.Errorf("link %s → %s, want %s", merged, target, mine)
	}
	readBack(merged)

	// The same path in both: no link to itself.
	open(envPath)
	if fi, err := os.Lstat(merged); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("%s: %v, mode %v; want the file itself", merged, err, fi.Mode())
	}
	readBack(merged)
}
