package main

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/goddp/goddp/internal/openblascore"
)

// TestDefaultThreads: with several ranks per node, OMP_NUM_THREADS and OPENBLAS_NUM_THREADS
// default to 1 for the ranks, said in one line that names only the variables ddprun set;
// a variable the environment sets is passed on as it is.
func TestDefaultThreads(t *testing.T) {
	var base []string // ddprun's environment without the two variables
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OMP_NUM_THREADS=") && !strings.HasPrefix(kv, "OPENBLAS_NUM_THREADS=") {
			base = append(base, kv)
		}
	}
	base = append(base, roleEnv+"=rank")
	for _, tc := range []struct {
		env     []string
		wantOMP string
		line    string // the one line of stderr about threads; "" for none
	}{
		{nil, "1", "ddprun: setting OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 for each rank (set them yourself to change this)"},
		{[]string{"OMP_NUM_THREADS=3"}, "3", "ddprun: setting OPENBLAS_NUM_THREADS=1 for each rank (set them yourself to change this)"},
		{[]string{"OMP_NUM_THREADS=2", "OPENBLAS_NUM_THREADS=2"}, "2", ""},
	} {
		res := launch(t, context.Background(), append(base[:len(base):len(base)], tc.env...),
			[]string{"--nproc_per_node", "2", "--standalone"}, "env")
		if res.code != 0 {
			t.Fatalf("env %v: exit %d\nstdout:\n%s\nstderr:\n%s", tc.env, res.code, res.stdout, res.stderr)
		}
		var lines []string
		for _, l := range strings.Split(res.stderr, "\n") {
			if strings.Contains(l, "NUM_THREADS") {
				lines = append(lines, l)
			}
		}
		if got := strings.Join(lines, "\n"); got != tc.line {
			t.Errorf("env %v: stderr lines about threads %q, want %q", tc.env, lines, tc.line)
		}
		byRank := rankLines(t, res.stdout)
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
	var base []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OPENBLAS_CORETYPE=") {
			base = append(base, kv)
		}
	}
	base = append(base, roleEnv+"=rank")
	for _, tc := range []struct {
		env   []string
		nproc string
		want  string
		line  string
	}{
		{nil, "1", want, "ddprun: setting OPENBLAS_CORETYPE=" + want + " for each rank, the OpenBLAS kernels for this CPU (set it yourself to change this)"},
		{nil, "2", want, "ddprun: setting OPENBLAS_CORETYPE=" + want + " for each rank, the OpenBLAS kernels for this CPU (set it yourself to change this)"},
		{[]string{"OPENBLAS_CORETYPE=Haswell"}, "2", "Haswell", ""},
	} {
		res := launch(t, context.Background(), append(base[:len(base):len(base)], tc.env...),
			[]string{"--nproc_per_node", tc.nproc, "--standalone"}, "env")
		if res.code != 0 {
			t.Fatalf("env %v: exit %d\nstderr:\n%s", tc.env, res.code, res.stderr)
		}
		var lines []string
		for _, l := range strings.Split(res.stderr, "\n") {
			if strings.Contains(l, "OPENBLAS_CORETYPE") {
				lines = append(lines, l)
			}
		}
		if got := strings.Join(lines, "\n"); got != tc.line {
			t.Errorf("env %v: stderr lines about OPENBLAS_CORETYPE %q, want %q", tc.env, lines, tc.line)
		}
		byRank := rankLines(t, res.stdout)
		for r := range len(byRank) {
			if got := envOf(byRank[r])["OPENBLAS_CORETYPE"]; got != tc.want {
				t.Errorf("env %v: rank %d has OPENBLAS_CORETYPE=%q, want %q", tc.env, r, got, tc.want)
			}
		}
		if n := len(byRank); n != map[string]int{"1": 1, "2": 2}[tc.nproc] {
			t.Errorf("env %v: %d ranks reported", tc.env, n)
		}
	}
}
