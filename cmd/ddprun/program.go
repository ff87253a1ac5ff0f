package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// resolveProgram turns PROGRAM into an executable path. PROGRAM may be
//   - a path to an executable file: run as is;
//   - a directory holding a Go main package, or a .go file: built once with 'go build';
//   - a Go import path with a dot in its first element (github.com/x/y/cmd/z): built;
//   - a bare name: looked up in PATH.
//
// Builds go into workDir. buildFlags are extra 'go build' flags; tags (GODDP_GO_TAGS) adds
// -tags=tags before them.
func resolveProgram(ctx context.Context, prog, workDir, buildFlags, tags string, con *console) (string, error) {
	fi, err := os.Stat(prog)
	switch {
	case err == nil && fi.IsDir():
		return goBuild(ctx, prog, ".", workDir, buildFlags, tags, con)
	case err == nil && fi.Mode().IsRegular() && strings.HasSuffix(prog, ".go"):
		return goBuild(ctx, filepath.Dir(prog), filepath.Base(prog), workDir, buildFlags, tags, con)
	case err == nil && fi.Mode().IsRegular():
		if fi.Mode().Perm()&0o111 == 0 {
			return "", fmt.Errorf("program %s is not executable", prog)
		}
		return filepath.Abs(prog)
	case err == nil:
		return "", fmt.Errorf("program %s is not a regular file or a directory", prog)
	case !errors.Is(err, fs.ErrNotExist):
		return "", fmt.Errorf("program: %w", err)
	case !strings.Contains(prog, "/"):
		path, lerr := exec.LookPath(prog)
		if lerr != nil {
			return "", fmt.Errorf("program %q: not a file here and not found in PATH", prog)
		}
		return filepath.Abs(path)
	case isImportPath(prog):
		return goBuild(ctx, ".", prog, workDir, buildFlags, tags, con)
	default:
		return "", fmt.Errorf("program %s: no such file or directory", prog)
	}
}

// isImportPath reports whether p looks like a remote Go import path (a dot in its first
// element, not a relative or absolute file path).
func isImportPath(p string) bool {
	if strings.HasPrefix(p, ".") || strings.HasPrefix(p, "/") {
		return false
	}
	first, _, _ := strings.Cut(p, "/")
	return strings.Contains(first, ".")
}

// goBuild runs 'go build -o workDir/NAME [-tags=tags] buildFlags target' in dir.
func goBuild(ctx context.Context, dir, target, workDir, buildFlags, tags string, con *console) (string, error) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		if goroot := os.Getenv("GOROOT"); goroot != "" {
			goBin = filepath.Join(goroot, "bin", "go")
		} else {
			return "", errors.New("PROGRAM is a Go package, but the go command is not in PATH")
		}
	}
	name := strings.TrimSuffix(filepath.Base(target), ".go")
	if target == "." {
		abs, err := filepath.Abs(dir)
		if err != nil {
			return "", fmt.Errorf("program: %w", err)
		}
		name = filepath.Base(abs)
	}
	if err := os.MkdirAll(filepath.Join(workDir, "bin"), 0o700); err != nil {
		return "", fmt.Errorf("build dir: %w", err)
	}
	out := filepath.Join(workDir, "bin", name)
	args := []string{"build", "-o", out}
	if tags != "" {
		args = append(args, "-tags="+tags)
	}
	args = append(args, strings.Fields(buildFlags)...)
	args = append(args, target)
	con.msg(fmt.Sprintf("ddprun: building %s: go %s\n", filepath.Join(dir, target), strings.Join(args, " ")))
	cmd := exec.CommandContext(ctx, goBin, args...)
	cmd.Dir = dir
	var output bytes.Buffer
	cmd.Stdout, cmd.Stderr = &output, &output
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("go build %s: %w\n%s", filepath.Join(dir, target), err, strings.TrimRight(output.String(), "\n"))
	}
	return out, nil
}
