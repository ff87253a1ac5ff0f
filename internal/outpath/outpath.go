// Package outpath checks the output paths that commands' flags name before the run that
// writes them starts, so that a bad path fails at once instead of after (or in the middle
// of) a long run. It creates the folders a path needs.
package outpath

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// File makes sure a file can be written at path: it creates the folders above it; then
// opens an existing file for writing without truncating it, or, when there is none, creates
// and removes a file of its own in the folder. Several processes may check one path at once
// (every rank of a job, on a shared folder): none of them creates the path itself, so none
// removes the file another one is opening. flag names the flag in the error, such as
// "--trace_merge". An empty path is nothing to check.
func File(flag, path string) error {
	if path == "" {
		return nil
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("%s: %w", flag, err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err == nil {
		return f.Close()
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%s: %w", flag, err)
	}
	return Dir(flag, dir)
}

// Dir makes sure files can be created in the folder path: it creates it (and the folders
// above it), then creates and removes a file in it. flag names the flag in the error. An
// empty path is nothing to check.
func Dir(flag, path string) error {
	if path == "" {
		return nil
	}
	if err := os.MkdirAll(path, 0o755); err != nil {
		return fmt.Errorf("%s: %w", flag, err)
	}
	f, err := os.CreateTemp(path, ".write-check-*")
	if err != nil {
		return fmt.Errorf("%s: %w", flag, err)
	}
	f.Close()
	return os.Remove(f.Name())
}
