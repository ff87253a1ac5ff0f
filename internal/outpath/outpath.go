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

// File makes sure a file can be written at path: it creates the folders above it, then
// opens the file for writing without truncating it (a file it had to create is removed
// again). flag names the flag in the error, such as "--trace_merge". An empty path is
// nothing to check.
func File(flag, path string) error {
	if path == "" {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("%s: %w", flag, err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if errors.Is(err, fs.ErrExist) {
		if f, err = os.OpenFile(path, os.O_WRONLY, 0); err == nil {
			return f.Close()
		}
	}
	if err != nil {
		return fmt.Errorf("%s: %w", flag, err)
	}
	f.Close()
	return os.Remove(path)
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
