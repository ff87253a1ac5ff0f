package main

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestSoakInProcess runs the soak loop over the in-memory cluster (with the watchdog and
// the debug wrapper) for a fixed number of batches: every result checks.
func TestSoakInProcess(t *testing.T) {
	for _, debug := range []bool{false, true} {
		t.Run("debug="+strconv.FormatBool(debug), func(t *testing.T) {
			const n = 4
			c := pgtest.NewCluster(n)
			defer c.Close()
			store := procgroup.NewMemStore()
			defer store.Close()
			gs := make([]procgroup.ProcessGroup, n)
			for r := range gs {
				g := c.Group(r)
				if debug {
					var err error
					if g, err = procgroup.WithDebug(g, procgroup.DebugOptions{}); err != nil {
						t.Fatal(err)
					}
				}
				w, err := procgroup.WithWatchdog(g, store, procgroup.WatchdogOptions{Timeout: time.Minute})
				if err != nil {
					t.Fatal(err)
				}
				gs[r] = w
			}
			var batches atomic.Int64
			stop := func() bool { return batches.Add(1) > 60 }
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			errs := make([]error, n)
			sts := make([]stats, n)
			var wg sync.WaitGroup
			for r, g := range gs {
				wg.Go(func() {
					errs[r] = soak(ctx, g, 42, 3000, stop, &sts[r])
					if err := g.Close(); err != nil && errs[r] == nil {
						errs[r] = err
					}
				})
			}
			wg.Wait()
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
			for r := range n {
				if got := sts[r].collectives.Load(); got < 61 || got != sts[0].collectives.Load() {
					t.Errorf("rank %d: %d collectives, rank 0 %d", r, got, sts[0].collectives.Load())
				}
			}
		})
	}
}

// TestCheckCatchesWrongResults: a result with one element changed fails the check, for
// every kind of collective.
func TestCheckCatchesWrongResults(t *testing.T) {
	const n = 3
	r := rand.New(rand.NewPCG(5, 6))
	tested := map[procgroup.CollectiveOp]bool{}
	for range 400 {
		s := draw(r, n, 50)
		if s.kind == procgroup.OpBarrier || s.count == 0 {
			continue
		}
		// Build every rank's correct result with the in-memory cluster, then corrupt it.
		c := pgtest.NewCluster(n)
		jobs := make([]*job, n)
		var wg sync.WaitGroup
		for rank := range n {
			wg.Go(func() {
				jobs[rank] = issue(context.Background(), c.Group(rank), s)
				jobs[rank].work.Wait(context.Background())
			})
		}
		wg.Wait()
		c.Close()
		for rank, j := range jobs {
			if err := j.work.Err(); err != nil {
				t.Fatalf("%v: %v", s, err)
			}
			if err := check(j, rank, n); err != nil {
				t.Fatalf("rank %d: correct result rejected: %v", rank, err)
			}
		}
		_, cnt, _ := procgroup.DTypeOf(jobs[1].out)
		i := r.IntN(cnt)
		v := at(jobs[1].out, i)
		fill(jobs[1].out, func(k int) float64 {
			if k == i {
				return v + 3
			}
			return at(jobs[1].out, k)
		})
		if err := check(jobs[1], 1, n); err == nil || !strings.Contains(err.Error(), "element "+strconv.Itoa(i)) {
			t.Fatalf("%v: corrupted element %d not caught: %v", s, i, err)
		}
		tested[s.kind] = true
	}
	if len(tested) != 4 {
		t.Errorf("tested only %v", tested)
	}
}

func TestFlags(t *testing.T) {
	for _, args := range []string{"--nproc -1", "--duration 0s", "--max-count 0", "extra", "--bogus", "--backend nope"} {
		if code := run(strings.Fields(args), &bytes.Buffer{}, &bytes.Buffer{}); code != 2 {
			t.Errorf("run %q: exit %d, want 2", args, code)
		}
	}
	if code := run([]string{"-h"}, &bytes.Buffer{}, &bytes.Buffer{}); code != 0 {
		t.Errorf("run -h: exit %d, want 0", code)
	}
}

// TestSoakCommand builds the command and soaks 4 local gloo ranks for about 5 s.
func TestSoakCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the command for 5 s")
	}
	bin := filepath.Join(t.TempDir(), "collective-soak")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, "--nproc", "4", "--duration", "5s", "--report", "2s", "--max-count", "16384", "--debug")
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("collective-soak: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	t.Logf("output:\n%s", stdout.String())
	done := regexp.MustCompile(`(?m)^rank (\d) done: collectives=(\d+) errors=0 in `)
	ms := done.FindAllStringSubmatch(stdout.String(), -1)
	if len(ms) != 4 {
		t.Fatalf("want 4 \"done\" lines, got %d:\n%s", len(ms), stdout.String())
	}
	for _, m := range ms {
		if m[2] != ms[0][2] || m[2] == "0" {
			t.Errorf("rank %s ran %s collectives, rank %s %s", m[1], m[2], ms[0][1], ms[0][2])
		}
	}
	if !regexp.MustCompile(`(?m)^rank \d t=\d+s collectives=\d+ errors=0 goroutines=\d+ heap_inuse=`).MatchString(stdout.String()) {
		t.Errorf("no progress line in:\n%s", stdout.String())
	}
}
