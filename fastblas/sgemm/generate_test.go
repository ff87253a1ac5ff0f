package sgemm

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestGeneratedUpToDate runs the avo generator into a temporary folder and checks that
// the committed assembly, stubs and tables are what it writes (go generate after
// changing _gen).
func TestGeneratedUpToDate(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: not running the generator")
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command on PATH")
	}
	dir := t.TempDir()
	files := map[string]string{"-out": "kernel_amd64.s", "-stubs": "kernel_amd64.go", "-table": "ktable_amd64.go"}
	args := []string{"run", "."}
	for flag, name := range files {
		args = append(args, flag, filepath.Join(dir, name))
	}
	args = append(args, "-pkg", "sgemm")
	cmd := exec.Command(goBin, args...)
	cmd.Dir = "_gen"
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go %v in _gen: %v\n%s", args, err, out)
	}
	for _, name := range files {
		want, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		// avo's first line names the command's arguments (here, temporary paths).
		if !bytes.Equal(afterFirstLine(got), afterFirstLine(want)) {
			t.Errorf("%s differs from what _gen writes now: run go generate in this package", name)
		}
	}
}

func afterFirstLine(b []byte) []byte {
	if i := bytes.IndexByte(b, '\n'); i >= 0 {
		return b[i+1:]
	}
	return b
}
