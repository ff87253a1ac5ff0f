package checkpoint

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// state is a trainer's registered state: two tensors and two scalars.
type state struct {
	w, b     []float32
	pos, opt int64
}

func newState(rows int) *state {
	return &state{w: make([]float32, rows*3), b: make([]float32, rows)}
}

// fill sets every value from seed, as a trainer at some step would hold.
func (s *state) fill(seed uint64) {
	r := rand.New(rand.NewPCG(seed, 2))
	for _, t := range [][]float32{s.w, s.b} {
		for i := range t {
			t[i] = r.Float32()*2 - 1
		}
	}
	s.pos, s.opt = int64(r.Uint32()), int64(r.Uint32())
}

func (s *state) equal(o *state) bool {
	return slices.Equal(s.w, o.w) && slices.Equal(s.b, o.b) && s.pos == o.pos && s.opt == o.opt
}

func (s *state) register(c *Checkpointer, rows int) {
	c.Float32("w", s.w, rows, 3)
	c.Float32("b", s.b)
	c.Int64("data.next_sample", &s.pos)
	c.Int64("opt.step", &s.opt)
	c.Config("--seed", "5")
}

func newCk(t *testing.T, pg procgroup.ProcessGroup, o Options, s *state, rows int) *Checkpointer {
	t.Helper()
	c, err := New(pg, o)
	if err != nil {
		t.Fatal(err)
	}
	s.register(c, rows)
	return c
}

// TestRoundTrip: Restore reads back, bit for bit, what Save wrote at each step, from the
// newest file; only the Keep newest files stay.
func TestRoundTrip(t *testing.T) {
	dir := t.TempDir()
	src := newState(4)
	w := newCk(t, nil, Options{Dir: dir}, src, 4)
	var want *state
	for step := int64(1); step <= 5; step++ {
		src.fill(uint64(step))
		if err := w.Save(step); err != nil {
			t.Fatal(err)
		}
		want = &state{w: slices.Clone(src.w), b: slices.Clone(src.b), pos: src.pos, opt: src.opt}
	}
	if steps, err := List(dir); err != nil || !slices.Equal(steps, []int64{5, 4}) {
		t.Fatalf("files: steps %v, %v; want [5 4]", steps, err)
	}
	// A temporary file of a write a crash interrupted goes at the next Restore.
	tmp := filepath.Join(dir, ".ckpt-123.tmp")
	if err := os.WriteFile(tmp, []byte("partial"), 0o600); err != nil {
		t.Fatal(err)
	}
	got := newState(4)
	step, err := newCk(t, nil, Options{Dir: dir, Resume: true}, got, 4).Restore(context.Background())
	if err != nil || step != 5 {
		t.Fatalf("Restore: step %d, %v; want 5", step, err)
	}
	if !got.equal(want) {
		t.Fatalf("read back %+v, wrote %+v", got, want)
	}
	if _, err := os.Stat(tmp); !os.IsNotExist(err) {
		t.Errorf("stale temporary file still there: %v", err)
	}
}

// TestCorruptNewestSkipped: a newest file with a flipped byte (anywhere: in the data, in
// a shape, in the CRC), cut short or empty is skipped with a warning naming it, and the one
// before is restored.
func TestCorruptNewestSkipped(t *testing.T) {
	for _, c := range []struct {
		name string
		at   func(n int) int // the byte to flip, of n
	}{
		{"data", func(n int) int { return n - 10 }},
		{"shape", func(n int) int {
			return 8 + 4 + 8 + 4 + 4 + len("--seed") + 4 + 1 + 4 + 4 + len("data.next_sample") + 8 + 4 + len("opt.step") + 8 + 4 + 4 + 1 + 4
		}},
		{"crc", func(n int) int { return n - 1 }},
		{"cut", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			s := newState(4)
			w := newCk(t, nil, Options{Dir: dir}, s, 4)
			s.fill(1)
			want := &state{w: slices.Clone(s.w), b: slices.Clone(s.b), pos: s.pos, opt: s.opt}
			if err := w.Save(3); err != nil {
				t.Fatal(err)
			}
			s.fill(2)
			if err := w.Save(6); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(dir, FileName(6))
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if c.at == nil {
				b = b[:len(b)/2]
			} else {
				b[c.at(len(b))] ^= 0x04
			}
			if err := os.WriteFile(path, b, 0o600); err != nil {
				t.Fatal(err)
			}
			core, logs := observer.New(zapcore.WarnLevel)
			got := newState(4)
			step, err := newCk(t, nil, Options{Dir: dir, Resume: true, Logger: zap.New(core)}, got, 4).Restore(context.Background())
			if err != nil || step != 3 {
				t.Fatalf("Restore: step %d, %v; want step 3", step, err)
			}
			if !got.equal(want) {
				t.Fatalf("restored %+v, step 3 was %+v", got, want)
			}
			if l := logs.All(); len(l) != 1 || !strings.Contains(l[0].Message, "skipping") || l[0].ContextMap()["path"] != path {
				t.Fatalf("want one warning naming %s, got %v", path, l)
			}
		})
	}
}

// TestRefused: a checkpoint of another model or run is refused with an error naming the
// tensor or the setting, and the state is left alone; a first attempt without Resume
// refuses a directory with checkpoints; no file at all is a fresh start.
func TestRefused(t *testing.T) {
	dir := t.TempDir()
	s := newState(4)
	s.fill(1)
	if err := newCk(t, nil, Options{Dir: dir}, s, 4).Save(6); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	other := newState(5) // rows 5, not 4
	_, err := newCk(t, nil, Options{Dir: dir, Resume: true}, other, 5).Restore(ctx)
	if err == nil || !strings.Contains(err.Error(), `tensor "w" has shape [4 3], in this model [5 3]`) {
		t.Errorf("another model: %v", err)
	}
	if slices.ContainsFunc(other.w, func(v float32) bool { return v != 0 }) {
		t.Errorf("a refused checkpoint changed the state")
	}
	c, _ := New(nil, Options{Dir: dir, Resume: true})
	got := newState(4)
	got.register(c, 4)
	c.Float32("extra", make([]float32, 2))
	if _, err := c.Restore(ctx); err == nil || !strings.Contains(err.Error(), `no tensor "extra"`) {
		t.Errorf("a tensor the file lacks: %v", err)
	}
	c, _ = New(nil, Options{Dir: dir, Resume: true})
	c.Float32("w", got.w, 4, 3)
	c.Int64("data.next_sample", &got.pos)
	c.Int64("opt.step", &got.opt)
	c.Config("--seed", "5")
	if _, err := c.Restore(ctx); err == nil || !strings.Contains(err.Error(), `holds tensor "b"`) {
		t.Errorf("a tensor the model lacks: %v", err)
	}
	c, _ = New(nil, Options{Dir: dir, Resume: true})
	c.Float32("w", got.w, 4, 3)
	c.Float32("b", got.b)
	c.Int64("data.next_sample", &got.pos)
	c.Int64("opt.step", &got.opt)
	c.Config("--seed", "7")
	if _, err := c.Restore(ctx); err == nil || !strings.Contains(err.Error(), "written with --seed 5 (this run has --seed 7)") {
		t.Errorf("another seed: %v", err)
	}
	if _, err := newCk(t, nil, Options{Dir: dir}, newState(4), 4).Restore(ctx); !errors.Is(err, ErrExists) || !strings.Contains(err.Error(), "up to step 6") {
		t.Errorf("a first attempt over checkpoints: %v", err)
	}
	restarted := func(k string) string { return map[string]string{"TORCHELASTIC_RESTART_COUNT": "1"}[k] }
	if step, err := newCk(t, nil, Options{Dir: dir, Getenv: restarted}, newState(4), 4).Restore(ctx); err != nil || step != 6 {
		t.Errorf("a restart resumes without Resume: step %d, %v", step, err)
	}
	for _, d := range []string{t.TempDir(), filepath.Join(t.TempDir(), "missing")} {
		if step, err := newCk(t, nil, Options{Dir: d, Resume: true}, newState(4), 4).Restore(ctx); err != nil || step != 0 {
			t.Errorf("%s: step %d, %v; want a fresh start", d, step, err)
		}
	}
	c, _ = New(nil, Options{Dir: dir})
	c.Float32("w", make([]float32, 5), 2, 3)
	if err := c.Save(1); err == nil || !strings.Contains(err.Error(), `tensor "w": shape [2 3]`) {
		t.Errorf("a bad registration: %v", err)
	}
}

// TestRanksWithoutTheFile: ranks whose directories lack the newest checkpoint (hosts
// without a shared file system) get the state from the lowest rank that has it, over the
// process group, whichever rank that is; a rank that finds another model's checkpoint fails
// every rank.
func TestRanksWithoutTheFile(t *testing.T) {
	ctx := context.Background()
	want := newState(4)
	want.fill(9)
	written := t.TempDir()
	if err := newCk(t, nil, Options{Dir: written}, want, 4).Save(6); err != nil {
		t.Fatal(err)
	}
	older := t.TempDir()
	old := newState(4)
	old.fill(3)
	if err := newCk(t, nil, Options{Dir: older}, old, 4).Save(3); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		dirs []string // per rank
	}{
		{"rank 0 has it", []string{written, t.TempDir(), older}},
		{"rank 2 has it", []string{older, t.TempDir(), written}},
		{"every rank has it", []string{written, written, written}},
	} {
		t.Run(c.name, func(t *testing.T) {
			cl := pgtest.NewCluster(3)
			defer cl.Close()
			got := make([]*state, 3)
			steps := make([]int64, 3)
			err := cl.Each(func(r int, pg procgroup.ProcessGroup) error {
				got[r] = newState(4)
				var err error
				steps[r], err = newCk(t, pg, Options{Dir: c.dirs[r], Resume: true}, got[r], 4).Restore(ctx)
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			for r := range 3 {
				if steps[r] != 6 || !got[r].equal(want) {
					t.Errorf("rank %d: step %d, state %+v; want step 6, %+v", r, steps[r], got[r], want)
				}
			}
		})
	}
	t.Run("another model on one rank", func(t *testing.T) {
		wide := t.TempDir()
		s := newState(5)
		if err := newCk(t, nil, Options{Dir: wide}, s, 5).Save(9); err != nil {
			t.Fatal(err)
		}
		cl := pgtest.NewCluster(2)
		defer cl.Close()
		errs := make([]error, 2)
		dirs := []string{written, wide}
		cl.Each(func(r int, pg procgroup.ProcessGroup) error {
			_, errs[r] = newCk(t, pg, Options{Dir: dirs[r], Resume: true}, newState(4), 4).Restore(ctx)
			return nil
		})
		if errs[1] == nil || !strings.Contains(errs[1].Error(), `tensor "w" has shape [5 3]`) {
			t.Errorf("rank 1: %v", errs[1])
		}
		if errs[0] == nil || !strings.Contains(errs[0].Error(), "ranks [1] cannot resume") {
			t.Errorf("rank 0: %v", errs[0])
		}
	})
}
