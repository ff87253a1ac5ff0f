package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestOutputsCheckedFirst: an -out or -merge that cannot be written fails before the
// traces are read (the input here does not even exist), naming the flag.
func TestOutputsCheckedFirst(t *testing.T) {
	file := filepath.Join(t.TempDir(), "a-file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, flag := range []string{"-out", "-merge"} {
		var stdout, stderr bytes.Buffer
		code := run([]string{"-in", filepath.Join(file, "no-trace.json"), flag, filepath.Join(file, "sub", "x.png")}, &stdout, &stderr)
		if want := "trace-plot: " + flag + ": mkdir " + file; code != 1 || !strings.HasPrefix(stderr.String(), want) {
			t.Errorf("%s below a file: exit %d, stderr %q; want 1 and %s…", flag, code, stderr.String(), want)
		}
	}
}
