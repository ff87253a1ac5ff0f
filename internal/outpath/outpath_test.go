package outpath

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestFileAndDir(t *testing.T) {
	root := t.TempDir()
	// A file in folders that do not exist: the folders are made, the file is not left.
	p := filepath.Join(root, "a", "b", "out.json")
	if err := File("--out", p); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Dir(p)); err != nil || !fi.IsDir() {
		t.Fatalf("folder of %s: %v", p, err)
	}
	if _, err := os.Stat(p); !os.IsNotExist(err) {
		t.Errorf("File left %s behind: %v", p, err)
	}
	// An existing file is kept as it is.
	if err := os.WriteFile(p, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := File("--out", p); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(p); string(b) != "keep" {
		t.Errorf("File changed an existing file: %q", b)
	}
	// A folder, made, and left empty.
	d := filepath.Join(root, "logs", "x")
	if err := Dir("--log_dir", d); err != nil {
		t.Fatal(err)
	}
	if ents, err := os.ReadDir(d); err != nil || len(ents) != 0 {
		t.Errorf("Dir: entries %v, %v", ents, err)
	}
	// Paths below a regular file cannot be made: the error names the flag.
	for _, err := range []error{File("--out", filepath.Join(p, "sub", "f")), Dir("--log_dir", filepath.Join(p, "d"))} {
		if err == nil || !strings.HasPrefix(err.Error(), "--") || !strings.Contains(err.Error(), "not a directory") {
			t.Errorf("below a file: %v", err)
		}
	}
	// A folder path given as a file.
	if err := File("--out", d); err == nil {
		t.Errorf("File on a folder: no error")
	}
	if File("--out", "") != nil || Dir("--d", "") != nil {
		t.Errorf("empty paths must be no-ops")
	}
}

// TestFileConcurrent: processes checking one path at once all succeed (each rank of a job
// checks its --save_params; one probing with the path itself removed it under another).
func TestFileConcurrent(t *testing.T) {
	p := filepath.Join(t.TempDir(), "out", "params.bin")
	errs := make(chan error, 16)
	for range 16 {
		go func() { errs <- File("--save_params", p) }()
	}
	for range 16 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	if _, err := os.Stat(p); !os.IsNotExist(err) {
		t.Errorf("File left %s behind: %v", p, err)
	}
}
