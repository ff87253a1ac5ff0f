// Package launchtest builds the real launcher and runs a trainer's ranks under it, for the
// tests of the example trainers: what a user runs, with nothing configured by hand.
package launchtest

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// GoTool is the go command of the toolchain running the tests (GOROOT's, else PATH's).
func GoTool() string {
	if root := os.Getenv("GOROOT"); root != "" {
		if p := filepath.Join(root, "bin", "go"); fileExists(p) {
			return p
		}
	}
	return "go"
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// DDPRun builds cmd/ddprun into a temporary folder of t's and returns its path.
func DDPRun(t testing.TB) string {
	t.Helper()
	ddprun := filepath.Join(t.TempDir(), "ddprun")
	if out, err := exec.Command(GoTool(), "build", "-o", ddprun, "github.com/goddp/goddp/cmd/ddprun").CombinedOutput(); err != nil {
		t.Fatalf("building ddprun: %v\n%s", err, out)
	}
	return ddprun
}

// Ranks runs n ranks of exe under ddprun --standalone with args, env added to this
// process's environment, for at most timeout. It returns each rank's last line of stdout
// by rank ("rank0" → line, from ddprun's "[rank0]: " prefixes), the whole stdout and
// stderr, and ddprun's exit error.
func Ranks(t testing.TB, ddprun string, n int, exe string, env []string, timeout time.Duration, args string) (last map[string]string, stdout, stderr string, err error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, ddprun, append([]string{"--standalone", "--nproc_per_node", fmt.Sprint(n), exe, "--"}, strings.Fields(args)...)...)
	cmd.Env = append(os.Environ(), env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	last = map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		if rank, rest, ok := strings.Cut(line, "]: "); ok {
			last[strings.TrimPrefix(rank, "[")] = rest
		}
	}
	return last, out.String(), errOut.String(), err
}
