package main

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/goddp/goddp/internal/openblascore"
)

// TestDefaultThreads: with several ranks per node, OMP_NUM_THREADS and OPENBLAS_NUM_THREADS
// default to 1 for the ranks, said in one line that names only the variables ddprun set;
// a variable the environment sets is passed on as it is.
func TestDefaultThreads(t *testing.T) {
	for _, tc := range []struct {
		env     []string
		wantOMP string
		line    string // the one line of stderr about threads; "" for none
	}{
		{nil, "1", "ddprun: setting OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 for each rank (set them yourself to change this)"},
		{[]string{"OMP_NUM_THREADS=3"}, "3", "ddprun: setting OPENBLAS_NUM_THREADS=1 for each rank (set them yourself to change this)"},
		{[]string{"OMP_NUM_THREADS=2", "OPENBLAS_NUM_THREADS=2"}, "2", ""},
	} {
		lines, byRank := launchEnv(t, []string{"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"}, tc.env, 2, "NUM_THREADS")
		if got := strings.Join(lines, "\n"); got != tc.line {
			t.Errorf("env %v: stderr lines about threads %q, want %q", tc.env, lines, tc.line)
		}
		for r := range 2 {
			if got := envOf(byRank[r])["OMP_NUM_THREADS"]; got != tc.wantOMP {
				t.Errorf("env %v: rank %d has OMP_NUM_THREADS=%q, want %q", tc.env, r, got, tc.wantOMP)
			}
		}
	}
}

// TestCoreType: ddprun gives its ranks the OPENBLAS_CORETYPE that suits this CPU (one rank
// or several), said in one line, unless the environment sets one, which is passed on.
func TestCoreType(t *testing.T) {
	want := openblascore.CoreType(openblascore.Host())
	if want == "" {
		t.Skip("this CPU has neither AVX2 nor AVX-512: ddprun sets no OPENBLAS_CORETYPE")
	}
	for _, tc := range []struct {
		env   []string
		nproc int
		want  string
		line  string
	}{
		{nil, 1, want, "ddprun: setting OPENBLAS_CORETYPE=" + want + " for each rank, the OpenBLAS kernels for this CPU (set it yourself to change this)"},
		{nil, 2, want, "ddprun: setting OPENBLAS_CORETYPE=" + want + " for each rank, the OpenBLAS kernels for this CPU (set it yourself to change this)"},
		{[]string{"OPENBLAS_CORETYPE=Haswell"}, 2, "Haswell", ""},
	} {
		lines, byRank := launchEnv(t, []string{"OPENBLAS_CORETYPE"}, tc.env, tc.nproc, "OPENBLAS_CORETYPE")
		if got := strings.Join(lines, "\n"); got != tc.line {
			t.Errorf("env %v: stderr lines about OPENBLAS_CORETYPE %q, want %q", tc.env, lines, tc.line)
		}
		if len(byRank) != tc.nproc {
			t.Errorf("env %v: %d ranks reported, want %d", tc.env, len(byRank), tc.nproc)
		}
		for r := range tc.nproc {
			if got := envOf(byRank[r])["OPENBLAS_CORETYPE"]; got != tc.want {
				t.Errorf("env %v: rank %d has OPENBLAS_CORETYPE=%q, want %q", tc.env, r, got, tc.want)
			}
		}
	}
}

// launchEnv runs ddprun --standalone with nproc "env" ranks, in this process's environment
// without the variables unset and with env added. It returns ddprun's stderr lines that
// contain about, and each rank's lines.
func launchEnv(t *testing.T, unset, env []string, nproc int, about string) ([]string, map[int][]string) {
	t.Helper()
	return launchEnvFlags(t, nil, unset, env, nproc, about)
}

// launchEnvFlags is launchEnv with more ddprun flags.
func launchEnvFlags(t *testing.T, flags, unset, env []string, nproc int, about string) ([]string, map[int][]string) {
	t.Helper()
	var base []string
	for _, kv := range os.Environ() {
		if !slices.ContainsFunc(unset, func(k string) bool { return strings.HasPrefix(kv, k+"=") }) {
			base = append(base, kv)
		}
	}
	base = append(append(base, roleEnv+"=rank"), env...)
	res := launch(t, context.Background(), base, append([]string{"--nproc_per_node", strconv.Itoa(nproc), "--standalone"}, flags...), "env")
	if res.code != 0 {
		t.Fatalf("env %v: exit %d\nstdout:\n%s\nstderr:\n%s", env, res.code, res.stdout, res.stderr)
	}
	var lines []string
	for _, l := range strings.Split(res.stderr, "\n") {
		if strings.Contains(l, about) {
			lines = append(lines, l)
		}
	}
	return lines, rankLines(t, res.stdout)
}

// TestGoMaxProcs: ddprun leaves GOMAXPROCS alone by default; --gomaxprocs split divides the
// cores among the node's ranks and a number is passed as it is, each said in one line; an
// environment that sets GOMAXPROCS wins.
func TestGoMaxProcs(t *testing.T) {
	split := strconv.Itoa(max(1, runtime.NumCPU()/2))
	for _, tc := range []struct {
		flag []string
		env  []string
		want string
		line string
	}{
		{nil, nil, "", ""},
		{[]string{"--gomaxprocs", "split"}, nil, split, fmt.Sprintf("ddprun: setting GOMAXPROCS=%s for each rank (--gomaxprocs split: %d cores, 2 ranks on this node)", split, runtime.NumCPU())},
		{[]string{"--gomaxprocs", "3"}, nil, "3", "ddprun: setting GOMAXPROCS=3 for each rank (--gomaxprocs)"},
		{[]string{"--gomaxprocs", "split"}, []string{"GOMAXPROCS=5"}, "5", ""},
	} {
		lines, byRank := launchEnvFlags(t, tc.flag, []string{"GOMAXPROCS"}, tc.env, 2, "GOMAXPROCS")
		if got := strings.Join(lines, "\n"); got != tc.line {
			t.Errorf("%v env %v: stderr lines about GOMAXPROCS %q, want %q", tc.flag, tc.env, lines, tc.line)
		}
		for r := range 2 {
			if got := envOf(byRank[r])["GOMAXPROCS"]; got != tc.want {
				t.Errorf("%v env %v: rank %d has GOMAXPROCS=%q, want %q", tc.flag, tc.env, r, got, tc.want)
			}
		}
	}
}
