package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"go.uber.org/zap"

	"github.com/goddp/goddp/examples/transformer/optim"
	"github.com/goddp/goddp/procgroup"
)

// Note [Checkpoints]: every rank writes its own files, rank<R>-step<S>.ckpt in
// --checkpoint_dir (so ranks on several hosts need no shared file system), every
// --checkpoint_every steps and after the last step. A file holds everything a step depends
// on: the parameters, AdamW's step count and moments, the step to continue from, and the
// run's seed, world size, batch and accumulation, which with the step fix the data and the
// dropout masks (the model draws them from (seed, global sample index, step), so the step
// *is* the RNG and data position). Writing is atomic: a temporary file, fsync, rename, then
// an fsync of the directory, so a crash mid-write leaves the previous files intact. Each
// rank keeps its last two files: a rank can be at most one checkpoint ahead of another (the
// next step's all-reduce waits for every rank, and every rank saves before it), so the two
// newest files of every rank always include a step that all ranks have.
//
// Note [Resume]: with --resume, or when ddprun restarts the group
// (TORCHELASTIC_RESTART_COUNT > 0), each rank finds its newest readable checkpoint (a
// corrupt or truncated newest file is skipped with a warning: its CRC-32 does not match),
// the ranks agree on the smallest of these steps (an all-reduce), and each rank loads its
// file of that step. No file anywhere (an empty or missing directory, or a rank without
// any) means a fresh start from step 0, which is also correct: the run is deterministic. A
// rank lacking a readable file of the agreed step fails every rank with an error naming it.
// Without --resume on a first attempt, a directory that already holds this rank's
// checkpoints is an error rather than silently mixing two runs' files.

// ckptMagic starts every checkpoint file ("gddpckpt" little endian).
const ckptMagic = 0x74706b63_70646467

// ckptVersion is the file format: magic, version, then the ckptHeader fields (uint64 each,
// little endian), the n parameters, AdamW's n first and n second moments (float32 little
// endian), then a CRC-32 (IEEE) of everything before it.
const ckptVersion = 2

// ckptHeader is what a checkpoint says about itself.
type ckptHeader struct {
	Step    uint64 // the step to continue from (steps 0 … Step−1 are done)
	N       uint64 // parameters
	OptStep uint64 // AdamW's step count
	Seed    uint64 // --seed: with Step, the data and dropout position
	World   uint64 // world size
	Batch   uint64 // --batch_size
	Accum   uint64 // --accum_steps
	Rank    uint64 // the writer's rank
}

// checkpoint is one file's contents.
type checkpoint struct {
	hdr     ckptHeader
	params  []float32
	m, v    []float32 // AdamW's moments
	optStep int
}

// ckptKeep is the number of checkpoints each rank keeps (Note [Checkpoints]).
const ckptKeep = 2

func ckptName(rank, step int) string { return fmt.Sprintf("rank%d-step%09d.ckpt", rank, step) }

// listCheckpoints returns the steps of rank's checkpoint files in dir, newest first; a
// missing directory has none.
func listCheckpoints(dir string, rank int) ([]int, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("checkpoint: %w", err)
	}
	prefix := fmt.Sprintf("rank%d-step", rank)
	var steps []int
	for _, e := range ents {
		rest, ok := strings.CutPrefix(e.Name(), prefix)
		if !ok || e.IsDir() {
			continue
		}
		num, ok := strings.CutSuffix(rest, ".ckpt")
		if !ok {
			continue
		}
		s, err := strconv.Atoi(num)
		if err != nil || s < 0 || ckptName(rank, s) != e.Name() {
			continue
		}
		steps = append(steps, s)
	}
	slices.Sort(steps)
	slices.Reverse(steps)
	return steps, nil
}

// writeCheckpoint writes c as rank's checkpoint of step c.hdr.Step in dir, atomically
// (Note [Checkpoints]), then removes the rank's older files beyond the newest ckptKeep and
// any of a later step (left by an abandoned attempt).
func writeCheckpoint(dir string, c *checkpoint) error {
	rank, step := int(c.hdr.Rank), int(c.hdr.Step)
	path := filepath.Join(dir, ckptName(rank, step))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("rank %d: checkpoint step %d: %w", rank, step, err)
	}
	tmp, err := os.CreateTemp(dir, fmt.Sprintf(".rank%d-*.tmp", rank))
	if err != nil {
		return fmt.Errorf("rank %d: checkpoint step %d: %w", rank, step, err)
	}
	defer os.Remove(tmp.Name()) // fails harmlessly after the rename
	werr := encodeCheckpoint(tmp, c)
	if err := errors.Join(werr, tmp.Sync(), tmp.Close()); err != nil {
		return fmt.Errorf("rank %d: checkpoint %s: %w", rank, path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("rank %d: checkpoint step %d: %w", rank, step, err)
	}
	if err := syncDir(dir); err != nil {
		return fmt.Errorf("rank %d: checkpoint step %d: %w", rank, step, err)
	}
	steps, err := listCheckpoints(dir, rank)
	if err != nil {
		return err
	}
	kept := 0
	for _, s := range steps {
		switch {
		case s > step:
		case kept < ckptKeep:
			kept++
			continue
		}
		if err := os.Remove(filepath.Join(dir, ckptName(rank, s))); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("rank %d: removing an old checkpoint: %w", rank, err)
		}
	}
	return nil
}

// syncDir makes a rename in dir durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	return errors.Join(d.Sync(), d.Close())
}

func encodeCheckpoint(w io.Writer, c *checkpoint) error {
	bw := bufio.NewWriterSize(w, 1<<20)
	crc := &crcWriter{w: bw}
	h := c.hdr
	hdr := []uint64{ckptMagic, ckptVersion, h.Step, h.N, h.OptStep, h.Seed, h.World, h.Batch, h.Accum, h.Rank}
	for _, x := range []any{hdr, c.params, c.m, c.v} {
		if err := binary.Write(crc, binary.LittleEndian, x); err != nil {
			return err
		}
	}
	if err := binary.Write(bw, binary.LittleEndian, crc.crc); err != nil {
		return err
	}
	return bw.Flush()
}

// readCheckpoint reads and verifies the file at path, which must hold n parameters.
func readCheckpoint(path string, n int) (*checkpoint, error) {
	fh, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("checkpoint: %w", err)
	}
	defer fh.Close()
	if fi, err := fh.Stat(); err == nil {
		// The size is known from n: a truncated or padded file fails before any allocation.
		if want := int64(8*10 + 3*4*n + 4); fi.Size() != want {
			return nil, fmt.Errorf("checkpoint %s: %d bytes, want %d for %d parameters (truncated or not this model's)", path, fi.Size(), want, n)
		}
	}
	crc := &crcReader{r: bufio.NewReaderSize(fh, 1<<20)}
	hdr := make([]uint64, 10)
	if err := binary.Read(crc, binary.LittleEndian, hdr); err != nil {
		return nil, fmt.Errorf("checkpoint %s: header: %w", path, err)
	}
	if hdr[0] != ckptMagic || hdr[1] != ckptVersion {
		return nil, fmt.Errorf("checkpoint %s: not a version-%d checkpoint", path, ckptVersion)
	}
	c := &checkpoint{hdr: ckptHeader{Step: hdr[2], N: hdr[3], OptStep: hdr[4], Seed: hdr[5], World: hdr[6],
		Batch: hdr[7], Accum: hdr[8], Rank: hdr[9]}}
	if c.hdr.N != uint64(n) {
		return nil, fmt.Errorf("checkpoint %s: %d parameters, model has %d", path, c.hdr.N, n)
	}
	c.params, c.m, c.v = make([]float32, n), make([]float32, n), make([]float32, n)
	for _, x := range [][]float32{c.params, c.m, c.v} {
		if err := binary.Read(crc, binary.LittleEndian, x); err != nil {
			return nil, fmt.Errorf("checkpoint %s: %w", path, err)
		}
	}
	want := crc.crc
	var got uint32
	if err := binary.Read(crc.r, binary.LittleEndian, &got); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", path, err)
	}
	if got != want {
		return nil, fmt.Errorf("checkpoint %s: corrupt (crc %08x, computed %08x)", path, got, want)
	}
	c.optStep = int(c.hdr.OptStep)
	return c, nil
}

// saveCheckpoint writes rank's checkpoint of step (the step to continue from).
func saveCheckpoint(f flags, w world, step int, params []float32, opt *optim.AdamW) error {
	optStep, m, v := opt.State()
	return writeCheckpoint(f.checkpointDir, &checkpoint{
		hdr: ckptHeader{Step: uint64(step), N: uint64(len(params)), OptStep: uint64(optStep), Seed: f.seed,
			World: uint64(w.size), Batch: uint64(f.batch), Accum: uint64(f.accum), Rank: uint64(w.rank)},
		params: params, m: m, v: v,
	})
}

// restartCount is TORCHELASTIC_RESTART_COUNT, ddprun's (and torchrun's) attempt number.
func restartCount(getenv func(string) string) (int, error) {
	s := getenv("TORCHELASTIC_RESTART_COUNT")
	if s == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("TORCHELASTIC_RESTART_COUNT=%q: want a count", s)
	}
	return n, nil
}

// restore prepares this rank's --checkpoint_dir and, when resuming, loads the checkpoint
// every rank agrees on (Note [Resume]) into params and opt. It returns the step to start
// from (0: a fresh start). pg is nil without ddp; with ddp every rank must call restore.
func restore(ctx context.Context, f flags, w world, pg procgroup.ProcessGroup, params []float32, opt *optim.AdamW, log *zap.Logger) (int, error) {
	dir := f.checkpointDir
	attempt, err := restartCount(f.getenv)
	if err != nil {
		return 0, err
	}
	// Temporary files of an interrupted write are garbage.
	if tmps, _ := filepath.Glob(filepath.Join(dir, fmt.Sprintf(".rank%d-*.tmp", w.rank))); len(tmps) > 0 {
		for _, t := range tmps {
			os.Remove(t)
		}
	}
	steps, err := listCheckpoints(dir, w.rank)
	if err != nil {
		return 0, fmt.Errorf("rank %d: %w", w.rank, err)
	}
	if !f.resume && attempt == 0 {
		if len(steps) > 0 {
			return 0, fmt.Errorf("rank %d: %s holds checkpoints up to step %d: pass --resume to continue from them, or use an empty --checkpoint_dir",
				w.rank, dir, steps[0])
		}
		return 0, nil
	}

	// This rank's newest readable checkpoint.
	var cur *checkpoint
	for _, s := range steps {
		c, err := readCheckpoint(filepath.Join(dir, ckptName(w.rank, s)), len(params))
		if err == nil {
			err = checkCompatible(c, f, w)
			if err != nil {
				return 0, fmt.Errorf("rank %d: %w", w.rank, err)
			}
			cur = c
			break
		}
		log.Warn("skipping an unreadable checkpoint", zap.Int("rank", w.rank), zap.Int("step", s), zap.Error(err))
	}
	mine := int64(-1)
	if cur != nil {
		mine = int64(cur.hdr.Step)
	}
	target := mine
	if pg != nil {
		// The smallest newest step over the ranks (Min of mine, Max of mine as −Min(−mine)).
		agree := []int64{mine, -mine}
		if err := pg.AllReduce(ctx, agree, procgroup.Min).Wait(ctx); err != nil {
			return 0, fmt.Errorf("rank %d: agreeing on the checkpoint to resume from: %w", w.rank, err)
		}
		target = agree[0]
		if target < 0 && -agree[1] >= 0 {
			log.Warn("a rank has no checkpoint: starting afresh", zap.Int("rank", w.rank), zap.Int64("newest_elsewhere", -agree[1]))
		}
	}
	if target < 0 {
		return 0, nil
	}
	var lerr error
	if mine != target {
		// An older file of this rank: another rank's newest is older than ours.
		cur, lerr = readCheckpoint(filepath.Join(dir, ckptName(w.rank, int(target))), len(params))
		if lerr == nil {
			lerr = checkCompatible(cur, f, w)
		}
	}
	if pg != nil {
		ok := []int64{1}
		if lerr != nil {
			ok[0] = 0
		}
		all := make([]int64, w.size)
		if err := pg.AllGather(ctx, all, ok).Wait(ctx); err != nil {
			return 0, fmt.Errorf("rank %d: agreeing on the checkpoint to resume from: %w", w.rank, err)
		}
		var bad []int
		for r, v := range all {
			if v == 0 {
				bad = append(bad, r)
			}
		}
		if len(bad) > 0 {
			if lerr != nil {
				return 0, fmt.Errorf("rank %d: resuming from step %d: %w", w.rank, target, lerr)
			}
			return 0, fmt.Errorf("rank %d: resuming from step %d: ranks %v have no readable checkpoint of that step", w.rank, target, bad)
		}
	}
	if lerr != nil {
		return 0, fmt.Errorf("rank %d: resuming from step %d: %w", w.rank, target, lerr)
	}
	if err := opt.SetState(cur.optStep, cur.m, cur.v); err != nil {
		return 0, fmt.Errorf("rank %d: checkpoint of step %d: %w", w.rank, target, err)
	}
	copy(params, cur.params)
	return int(target), nil
}

// checkCompatible refuses a checkpoint written by a run that sees different data.
func checkCompatible(c *checkpoint, f flags, w world) error {
	h := c.hdr
	if h.Seed != f.seed || h.World != uint64(w.size) || h.Batch != uint64(f.batch) || h.Accum != uint64(f.accum) {
		return fmt.Errorf("checkpoint of step %d was written with --seed %d, world size %d, --batch_size %d, --accum_steps %d; this run has %d, %d, %d, %d",
			h.Step, h.Seed, h.World, h.Batch, h.Accum, f.seed, w.size, f.batch, f.accum)
	}
	return nil
}

type crcWriter struct {
	w   io.Writer
	crc uint32
}

func (c *crcWriter) Write(b []byte) (int, error) {
	c.crc = crc32Update(c.crc, b)
	return c.w.Write(b)
}

type crcReader struct {
	r   io.Reader
	crc uint32
}

func (c *crcReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.crc = crc32Update(c.crc, b[:n])
	return n, err
}
