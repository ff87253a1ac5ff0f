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

	"github.com/goddp/goddp/ddp/checkpoint"
	"github.com/goddp/goddp/procgroup"
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

func assertSteps(t *testing.T, dir string, want ...int64) {
	t.Helper()
	got, err := checkpoint.List(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("checkpoints: steps %v, want %v", got, want)
	}
}

const ckptBase = tinyFlags + " --batch_size 2 --warmup_steps 0 --checkpoint_every 2"

// TestCheckpointCorruptNewest: a newest checkpoint that is damaged (a flipped byte, cut
// short, empty) is skipped and the run resumes from the one before, ending bit for bit where
// the uninterrupted run does; only the two newest files stay.
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
			assertSteps(t, dir, 6, 4)
			if err := c.corrupt(filepath.Join(dir, checkpoint.FileName(6))); err != nil {
				t.Fatal(err)
			}
			got, out := trainArgs(t, ckptBase+" --bench_steps 8 --resume --checkpoint_dir "+dir)
			if !strings.Contains(out, " start_step=4\n") {
				t.Fatalf("did not resume from step 4:\n%s", out)
			}
			assertSame(t, "resumed after a corrupt newest checkpoint", want, got)
			assertSteps(t, dir, 8, 6)
		})
	}
	t.Run("all corrupt", func(t *testing.T) {
		dir := t.TempDir()
		trainArgs(t, ckptBase+" --bench_steps 6 --checkpoint_dir "+dir)
		for _, s := range []int64{4, 6} {
			if err := os.Truncate(filepath.Join(dir, checkpoint.FileName(s)), 7); err != nil {
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
		assertSteps(t, dir, 3, 2)
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

// TestDDPResumeAgreement: the ranks resume from the newest checkpoint any of them can
// read, whichever directory it is in (ranks on hosts without a shared file system get the
// state from the rank that has it), and end bit for bit where the uninterrupted run does;
// a checkpoint of another model fails every rank, naming the tensor.
func TestDDPResumeAgreement(t *testing.T) {
	args := tinyDDPFlags + " --batch_size 2 --warmup_steps 0 --checkpoint_every 2 --bench_steps "
	want, _ := trainRanks(t, 2, args+"8")
	wide := t.TempDir() // a checkpoint of a wider model
	trainRanks(t, 2, strings.Replace(args, "--hidden_size 16", "--hidden_size 8", 1)+"2 --checkpoint_dir "+wide)
	for _, c := range []struct {
		name  string
		dirs  func(dir string) ([2]string, error) // after the 6 first steps: dir has steps 6 and 4
		start int
		err   string // an error rank 1 must report instead (rank 0: that rank 1 cannot resume)
	}{
		{"newest corrupt", func(dir string) ([2]string, error) {
			return [2]string{dir, dir}, os.Truncate(filepath.Join(dir, checkpoint.FileName(6)), 100)
		}, 4, ""},
		{"rank 1's directory empty", func(dir string) ([2]string, error) {
			return [2]string{dir, t.TempDir()}, nil
		}, 6, ""},
		{"rank 0's directory empty", func(dir string) ([2]string, error) {
			return [2]string{t.TempDir(), dir}, nil
		}, 6, ""},
		{"all unreadable", func(dir string) ([2]string, error) {
			return [2]string{dir, dir}, errJoin(os.Truncate(filepath.Join(dir, checkpoint.FileName(6)), 0), os.Truncate(filepath.Join(dir, checkpoint.FileName(4)), 9))
		}, 0, ""},
		{"another model on rank 1", func(dir string) ([2]string, error) {
			return [2]string{dir, wide}, nil
		}, -1, `tensor "0.weight" has shape [8 8], in this model [16 16]`},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			trainRanks(t, 2, args+"6 --checkpoint_dir "+dir)
			assertSteps(t, dir, 6, 4)
			dirs, err := c.dirs(dir)
			if err != nil {
				t.Fatal(err)
			}
			edit := func(rank int, _ procgroup.ProcessGroup, f *flags) { f.checkpointDir = dirs[rank] }
			resume := args + "8 --resume --checkpoint_dir " + dir
			if c.err != "" {
				_, outs, errs := runRanks(t, 2, resume, edit)
				if errs[1] == nil || !strings.Contains(errs[1].Error(), c.err) {
					t.Errorf("rank 1: %v, want an error with %q\n%s", errs[1], c.err, outs[1])
				}
				if errs[0] == nil || !strings.Contains(errs[0].Error(), "ranks [1] cannot resume") {
					t.Errorf("rank 0's error does not name rank 1: %v", errs[0])
				}
				return
			}
			ps, outs := trainRanksWith(t, 2, resume, edit)
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
