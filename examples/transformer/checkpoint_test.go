package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"go.uber.org/zap"
)

// trainEdit is trainArgs with the flags passed through edit first; it returns the error.
func trainEdit(t *testing.T, args string, edit func(f *flags)) ([]float32, string, error) {
	t.Helper()
	f, err := parseFlags(strings.Fields(args), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if edit != nil {
		edit(&f)
	}
	var out bytes.Buffer
	m, err := train(context.Background(), f, &out, &bytes.Buffer{})
	if err != nil {
		return nil, out.String(), err
	}
	return append([]float32(nil), m.Data32()...), out.String(), nil
}

func assertSame(t *testing.T, what string, want, got []float32) {
	t.Helper()
	if len(want) != len(got) {
		t.Fatalf("%s: %d vs %d parameters", what, len(want), len(got))
	}
	for i := range want {
		if want[i] != got[i] {
			t.Fatalf("%s: parameter %d is %v, uninterrupted run %v", what, i, got[i], want[i])
		}
	}
}

func assertSteps(t *testing.T, dir string, rank int, want ...int) {
	t.Helper()
	got, err := listCheckpoints(dir, rank)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("rank %d's checkpoints: steps %v, want %v", rank, got, want)
	}
}

const ckptBase = tinyFlags + " --batch_size 2 --warmup_steps 0 --checkpoint_every 2"

// TestCheckpointCorruptNewest: a newest checkpoint that is damaged (a flipped byte, cut
// short, empty) is skipped and the run resumes from the one before, ending bit for bit where
// the uninterrupted run does; each rank keeps only its two newest files.
func TestCheckpointCorruptNewest(t *testing.T) {
	want, _ := trainArgs(t, tinyFlags+" --batch_size 2 --warmup_steps 0 --bench_steps 8")
	for _, c := range []struct {
		name    string
		corrupt func(path string) error
	}{
		{"flipped byte", func(p string) error {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			b[len(b)/2] ^= 0x10
			return os.WriteFile(p, b, 0o600)
		}},
		{"truncated", func(p string) error { return os.Truncate(p, 1000) }},
		{"empty", func(p string) error { return os.Truncate(p, 0) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			trainArgs(t, ckptBase+" --bench_steps 6 --checkpoint_dir "+dir)
			assertSteps(t, dir, 0, 6, 4)
			if err := c.corrupt(filepath.Join(dir, ckptName(0, 6))); err != nil {
				t.Fatal(err)
			}
			got, out := trainArgs(t, ckptBase+" --bench_steps 8 --resume --checkpoint_dir "+dir)
			if !strings.Contains(out, " start_step=4\n") {
				t.Fatalf("did not resume from step 4:\n%s", out)
			}
			assertSame(t, "resumed after a corrupt newest checkpoint", want, got)
			assertSteps(t, dir, 0, 8, 6)
		})
	}
	t.Run("all corrupt", func(t *testing.T) {
		dir := t.TempDir()
		trainArgs(t, ckptBase+" --bench_steps 6 --checkpoint_dir "+dir)
		for _, s := range []int{4, 6} {
			if err := os.Truncate(filepath.Join(dir, ckptName(0, s)), 7); err != nil {
				t.Fatal(err)
			}
		}
		got, out := trainArgs(t, ckptBase+" --bench_steps 8 --resume --checkpoint_dir "+dir)
		if !strings.Contains(out, " start_step=0\n") {
			t.Fatalf("did not start afresh:\n%s", out)
		}
		assertSame(t, "fresh start after unreadable checkpoints", want, got)
	})
}

// TestCheckpointFreshStart: --resume with a missing or empty directory starts at step 0;
// a first attempt without --resume refuses a directory holding checkpoints, and a
// checkpoint of a run with other data is refused.
func TestCheckpointFreshStart(t *testing.T) {
	want, _ := trainArgs(t, tinyFlags+" --batch_size 2 --warmup_steps 0 --bench_steps 3")
	for _, dir := range []string{filepath.Join(t.TempDir(), "missing", "dir"), t.TempDir()} {
		got, out := trainArgs(t, ckptBase+" --bench_steps 3 --resume --checkpoint_dir "+dir)
		if !strings.Contains(out, " start_step=0\n") {
			t.Fatalf("%s: did not start at step 0:\n%s", dir, out)
		}
		assertSame(t, "fresh start", want, got)
		assertSteps(t, dir, 0, 3, 2)
		if b, err := os.ReadFile(filepath.Join(dir, "rank0.pid")); err != nil || strings.TrimSpace(string(b)) != fmt.Sprint(os.Getpid()) {
			t.Errorf("pid file: %q, %v", b, err)
		}
		_, _, err := trainEdit(t, ckptBase+" --bench_steps 3 --checkpoint_dir "+dir, nil)
		if err == nil || !strings.Contains(err.Error(), "--resume") || !strings.Contains(err.Error(), "step 3") {
			t.Errorf("fresh start over old checkpoints: %v, want an error suggesting --resume", err)
		}
		_, _, err = trainEdit(t, ckptBase+" --bench_steps 4 --resume --seed 7 --checkpoint_dir "+dir, nil)
		if err == nil || !strings.Contains(err.Error(), "--seed 0") {
			t.Errorf("resuming another seed's checkpoint: %v, want an error naming the seeds", err)
		}
	}
}

// TestCheckpointRestartCount: under a launcher's restart (TORCHELASTIC_RESTART_COUNT > 0)
// the trainer resumes without --resume.
func TestCheckpointRestartCount(t *testing.T) {
	want, _ := trainArgs(t, tinyFlags+" --batch_size 2 --warmup_steps 0 --bench_steps 5")
	dir := t.TempDir()
	trainArgs(t, ckptBase+" --bench_steps 3 --checkpoint_dir "+dir)
	restarted := func(f *flags) {
		f.getenv = func(k string) string {
			if k == "TORCHELASTIC_RESTART_COUNT" {
				return "1"
			}
			return ""
		}
	}
	got, out, err := trainEdit(t, ckptBase+" --bench_steps 5 --checkpoint_dir "+dir, restarted)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, " start_step=3\n") {
		t.Fatalf("did not resume from step 3:\n%s", out)
	}
	assertSame(t, "resumed on restart", want, got)
	_, _, err = trainEdit(t, ckptBase+" --bench_steps 5 --checkpoint_dir "+dir, func(f *flags) {
		f.getenv = func(k string) string { return map[string]string{"TORCHELASTIC_RESTART_COUNT": "x"}[k] }
	})
	if err == nil || !strings.Contains(err.Error(), "TORCHELASTIC_RESTART_COUNT") {
		t.Errorf("bad restart count: %v", err)
	}
}

// TestDDPResumeAgreement: the ranks resume from the newest step every rank has a readable
// checkpoint of, whatever each rank's own newest is, and end bit for bit where the
// uninterrupted run does.
func TestDDPResumeAgreement(t *testing.T) {
	args := tinyDDPFlags + " --batch_size 2 --warmup_steps 0 --checkpoint_every 2 --bench_steps "
	want, _ := trainRanks(t, 2, args+"8")
	for _, c := range []struct {
		name  string
		setup func(dir string) error // after the 6 first steps: every rank has steps 6 and 4
		start int
		err   string // an error every rank must report instead
	}{
		{"rank 1 died before writing step 6", func(dir string) error {
			return os.Remove(filepath.Join(dir, ckptName(1, 6)))
		}, 4, ""},
		{"rank 0's newest corrupt", func(dir string) error {
			return os.Truncate(filepath.Join(dir, ckptName(0, 6)), 100)
		}, 4, ""},
		{"rank 1 has none", func(dir string) error {
			return errJoin(os.Remove(filepath.Join(dir, ckptName(1, 6))), os.Remove(filepath.Join(dir, ckptName(1, 4))))
		}, 0, ""},
		{"rank 0 lacks the agreed step", func(dir string) error {
			return errJoin(os.Remove(filepath.Join(dir, ckptName(1, 6))), os.Truncate(filepath.Join(dir, ckptName(0, 4)), 100))
		}, -1, "resuming from step 4"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			trainRanks(t, 2, args+"6 --checkpoint_dir "+dir)
			assertSteps(t, dir, 0, 6, 4)
			assertSteps(t, dir, 1, 6, 4)
			if err := c.setup(dir); err != nil {
				t.Fatal(err)
			}
			resume := args + "8 --resume --checkpoint_dir " + dir
			if c.err != "" {
				_, outs, errs := runRanks(t, 2, resume, nil)
				for r, err := range errs {
					if err == nil || !strings.Contains(err.Error(), c.err) {
						t.Errorf("rank %d: %v, want an error with %q\n%s", r, err, c.err, outs[r])
					}
				}
				if errs[0] != nil && !strings.Contains(errs[0].Error(), "corrupt") && !strings.Contains(errs[0].Error(), "bytes") {
					t.Errorf("rank 0's error does not say what is wrong with its file: %v", errs[0])
				}
				if errs[1] != nil && !strings.Contains(errs[1].Error(), "ranks [0]") {
					t.Errorf("rank 1's error does not name rank 0: %v", errs[1])
				}
				return
			}
			ps, outs := trainRanks(t, 2, resume)
			if s := fmt.Sprintf(" start_step=%d\n", c.start); !strings.Contains(outs[0], s) {
				t.Fatalf("want%s:\n%s", s, outs[0])
			}
			for r := range 2 {
				assertSame(t, fmt.Sprintf("rank %d resumed", r), want[0], ps[r])
			}
		})
	}
}

func errJoin(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

// TestCheckpointFormat: a checkpoint reads back what was written; a file of another model
// size is refused before it is read.
func TestCheckpointFormat(t *testing.T) {
	dir := t.TempDir()
	const n = 1000
	c := &checkpoint{hdr: ckptHeader{Step: 12, N: n, OptStep: 11, Seed: 3, World: 4, Batch: 5, Accum: 6, Rank: 2}}
	c.params, c.m, c.v = make([]float32, n), make([]float32, n), make([]float32, n)
	for i := range n {
		c.params[i], c.m[i], c.v[i] = float32(i)*0.5-7, float32(i)*1e-3, float32(i)*1e-6+1e-9
	}
	if err := writeCheckpoint(dir, c); err != nil {
		t.Fatal(err)
	}
	got, err := readCheckpoint(filepath.Join(dir, ckptName(2, 12)), n)
	if err != nil {
		t.Fatal(err)
	}
	if got.hdr != c.hdr || got.optStep != 11 || !slices.Equal(got.params, c.params) || !slices.Equal(got.m, c.m) || !slices.Equal(got.v, c.v) {
		t.Fatalf("read back %+v", got.hdr)
	}
	if _, err := readCheckpoint(filepath.Join(dir, ckptName(2, 12)), n+1); err == nil || !strings.Contains(err.Error(), "truncated or not this model's") {
		t.Errorf("wrong size: %v", err)
	}
	// Stale temporary files of an interrupted write are removed on the next start.
	tmp := filepath.Join(dir, ".rank0-123.tmp")
	if err := os.WriteFile(tmp, []byte("partial"), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := parseFlags(strings.Fields(ckptBase+" --resume --checkpoint_dir "+dir), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	// (rank 0 has no checkpoint in dir: restore touches neither the optimizer nor the log)
	if _, err := restore(context.Background(), f, world{0, 1}, nil, make([]float32, 10), nil, zap.NewNop()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(tmp); !os.IsNotExist(err) {
		t.Errorf("stale temporary file still there: %v", err)
	}
}
