package checkpoint

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// blob is a RankState: bytes of its own per rank. resized records UnmarshalResized's
// arguments (nil: not a Resizer).
type blob struct {
	b       []byte
	resized *resizeCall
	fail    error // MarshalBinary's
}

type resizeCall struct {
	saved       [][]byte
	rank, world int
}

func (s *blob) MarshalBinary() ([]byte, error)    { return slices.Clone(s.b), s.fail }
func (s *blob) UnmarshalBinary(data []byte) error { s.b = slices.Clone(data); return nil }

type resizable struct{ blob }

func (s *resizable) UnmarshalResized(saved [][]byte, rank, world int) error {
	s.resized = &resizeCall{saved, rank, world}
	return nil
}

// rankBytes are rank r's state: of a length of its own (not a multiple of 8), from seed.
func rankBytes(r int, seed byte) []byte {
	b := make([]byte, 5+9*r)
	for i := range b {
		b[i] = seed + byte(31*i+r)
	}
	return b
}

// TestPerRankState: 3 ranks save per-rank states of different lengths with the shared
// state; resumed by 3 ranks (each with the file, or only rank 0 with it) every rank gets
// its own bytes back and the shared state; resumed by 2, a Resizer gets all 3 ranks'
// bytes in rank order with its rank and world, and a state without it is refused naming
// it. The file is atomic: the ranks' bytes are in the one file of the step.
func TestPerRankState(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	want := newState(4)
	want.fill(4)
	cl := pgtest.NewCluster(3)
	err := cl.Each(func(r int, pg procgroup.ProcessGroup) error {
		s := newState(4)
		s.fill(4)
		c := newCk(t, pg, Options{Dir: dir}, s, 4)
		c.PerRank("hook", "powersgd(rank 2)", &resizable{blob{b: rankBytes(r, 1)}})
		c.PerRank("other", "stateful", &blob{b: rankBytes(2-r, 7)})
		return c.SaveContext(ctx, 6)
	})
	cl.Close()
	if err != nil {
		t.Fatal(err)
	}
	if steps, _ := List(dir); !slices.Equal(steps, []int64{6}) {
		t.Fatalf("files of steps %v, want [6]", steps)
	}
	resume := func(dirs []string) ([]*resizable, []*blob, []error) {
		n := len(dirs)
		hooks, others, errs := make([]*resizable, n), make([]*blob, n), make([]error, n)
		cl := pgtest.NewCluster(n)
		defer cl.Close()
		cl.Each(func(r int, pg procgroup.ProcessGroup) error {
			s := newState(4)
			c := newCk(t, pg, Options{Dir: dirs[r], Resume: true}, s, 4)
			hooks[r], others[r] = &resizable{}, &blob{}
			c.PerRank("hook", "powersgd(rank 2)", hooks[r])
			c.PerRank("other", "stateful", others[r])
			var step int64
			step, errs[r] = c.Restore(ctx)
			if errs[r] == nil && (step != 6 || !s.equal(want)) {
				errs[r] = fmt.Errorf("step %d, state %+v; want step 6, %+v", step, s, want)
			}
			return nil
		})
		return hooks, others, errs
	}
	for _, dirs := range [][]string{{dir, dir, dir}, {dir, t.TempDir(), t.TempDir()}} {
		hooks, others, errs := resume(dirs)
		for r := range 3 {
			switch {
			case errs[r] != nil:
				t.Errorf("rank %d: %v", r, errs[r])
			case hooks[r].resized != nil || !bytes.Equal(hooks[r].b, rankBytes(r, 1)) || !bytes.Equal(others[r].b, rankBytes(2-r, 7)):
				t.Errorf("rank %d resumed with %v and %v (resized %v), want its own %v and %v", r, hooks[r].b, others[r].b, hooks[r].resized, rankBytes(r, 1), rankBytes(2-r, 7))
			}
		}
	}
	// At 2 ranks: the state without UnmarshalResized is refused.
	_, _, errs := resume([]string{dir, dir})
	if errs[0] == nil || !strings.Contains(errs[0].Error(), "other stateful was saved by 3 ranks and cannot resume at 2") {
		t.Errorf("2 ranks, a state that cannot resize: %v", errs[0])
	}
	// Without it, the Resizer gets every saved rank's bytes, its rank and world.
	cl = pgtest.NewCluster(2)
	got := make([]*resizable, 2)
	err = cl.Each(func(r int, pg procgroup.ProcessGroup) error {
		c := newCk(t, pg, Options{Dir: []string{t.TempDir(), dir}[r], Resume: true}, newState(4), 4)
		got[r] = &resizable{}
		c.PerRank("hook", "powersgd(rank 2)", got[r])
		c.PerRank("other", "stateful", &resizable{})
		_, err := c.Restore(ctx)
		return err
	})
	cl.Close()
	if err != nil {
		t.Fatal(err)
	}
	for r, h := range got {
		if h.resized == nil || h.resized.rank != r || h.resized.world != 2 || len(h.resized.saved) != 3 {
			t.Fatalf("rank %d of 2: resized %+v, want the 3 saved states, rank %d of 2", r, h.resized, r)
		}
		for w := range 3 {
			if !bytes.Equal(h.resized.saved[w], rankBytes(w, 1)) {
				t.Errorf("rank %d of 2: saved rank %d's state %v, want %v", r, w, h.resized.saved[w], rankBytes(w, 1))
			}
		}
	}
}

// TestPerRankRefused: a checkpoint whose per-rank state has another description, lacks
// one this run registers, or holds one it does not, is refused on every rank with an
// error naming both sides; a rank whose state cannot marshal fails Save on every rank,
// and no file is written.
func TestPerRankRefused(t *testing.T) {
	ctx := context.Background()
	save := func(desc string) string {
		dir := t.TempDir()
		c := newCk(t, nil, Options{Dir: dir}, newState(2), 2)
		if desc != "" {
			c.PerRank("comm_hook", desc, &blob{b: []byte{1, 2, 3}})
		}
		if err := c.Save(4); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	for _, tc := range []struct {
		saved, resumed, want string
	}{
		{"powersgd(rank 1)", "powersgd(rank 2)", "was written with comm_hook powersgd(rank 1) (this run has comm_hook powersgd(rank 2))"},
		{"", "powersgd(rank 2)", "holds no comm_hook state (this run has comm_hook powersgd(rank 2))"},
		{"powersgd(rank 1)", "", "holds the comm_hook state of powersgd(rank 1) (this run keeps no comm_hook state)"},
	} {
		dir := save(tc.saved)
		cl := pgtest.NewCluster(2)
		errs := make([]error, 2)
		cl.Each(func(r int, pg procgroup.ProcessGroup) error {
			c := newCk(t, pg, Options{Dir: dir, Resume: true}, newState(2), 2)
			if tc.resumed != "" {
				c.PerRank("comm_hook", tc.resumed, &blob{})
			}
			_, errs[r] = c.Restore(ctx)
			return nil
		})
		cl.Close()
		for r, err := range errs {
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("saved with %q, resumed with %q: rank %d: %v, want %q", tc.saved, tc.resumed, r, err, tc.want)
			}
		}
	}

	dir := t.TempDir()
	cl := pgtest.NewCluster(3)
	errs := make([]error, 3)
	cl.Each(func(r int, pg procgroup.ProcessGroup) error {
		c := newCk(t, pg, Options{Dir: dir}, newState(2), 2)
		s := &blob{b: []byte{byte(r)}}
		if r == 1 {
			s.fail = errors.New("no state before New")
		}
		c.PerRank("comm_hook", "powersgd(rank 1)", s)
		errs[r] = c.SaveContext(ctx, 3)
		return nil
	})
	cl.Close()
	for r, err := range errs {
		want := "ranks [1] could not save their per-rank states"
		if r == 1 {
			want = `per-rank state "comm_hook": no state before New`
		}
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("rank %d: Save %v, want %q", r, err, want)
		}
	}
	if steps, _ := List(dir); len(steps) != 0 {
		t.Errorf("a failed Save left checkpoints of steps %v", steps)
	}
}

// TestVersion1File: a file in the format before per-rank states (version 1, which has no
// table of them) is still read.
func TestVersion1File(t *testing.T) {
	var b []byte
	str := func(s string) { b = binary.LittleEndian.AppendUint32(b, uint32(len(s))); b = append(b, s...) }
	b = append(b, magic...)
	b = binary.LittleEndian.AppendUint32(b, 1)
	b = binary.LittleEndian.AppendUint64(b, 5)
	b = binary.LittleEndian.AppendUint32(b, 1) // configs
	str("--seed")
	str("5")
	b = binary.LittleEndian.AppendUint32(b, 1) // values
	str("pos")
	b = binary.LittleEndian.AppendUint64(b, 77)
	b = binary.LittleEndian.AppendUint32(b, 1) // tensors
	str("b")
	b = binary.LittleEndian.AppendUint32(b, 1)
	b = binary.LittleEndian.AppendUint64(b, 2)
	for _, v := range []float32{1.5, -2} {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
	}
	b = binary.LittleEndian.AppendUint32(b, crc32.ChecksumIEEE(b))
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, FileName(5)), b, 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := New(nil, Options{Dir: dir, Resume: true})
	if err != nil {
		t.Fatal(err)
	}
	vals, pos := make([]float32, 2), int64(0)
	c.Float32("b", vals)
	c.Int64("pos", &pos)
	c.Config("--seed", "5")
	step, err := c.Restore(context.Background())
	if err != nil || step != 5 || pos != 77 || !slices.Equal(vals, []float32{1.5, -2}) {
		t.Fatalf("Restore: step %d, %v, pos %d, %v; want step 5, [1.5 -2], pos 77", step, vals, pos, err)
	}
}
