package checkpoint

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"hash/crc32"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"go.uber.org/zap"

	"github.com/goddp/goddp/procgroup"
)

// ErrExists is the error of Restore on a first attempt without Options.Resume when the
// directory already holds checkpoints: continuing them, or starting over them, is the
// user's choice, not the library's.
var ErrExists = errors.New("checkpoint: the directory holds checkpoints, and this run is not resuming")

// Options configure a Checkpointer.
type Options struct {
	// Dir holds the checkpoint files (made if missing). Required.
	Dir string
	// Keep is the number of newest checkpoints Save leaves in Dir; 0 means 2.
	Keep int
	// Resume makes a first attempt resume from Dir's newest checkpoint. A launcher's
	// restart ($TORCHELASTIC_RESTART_COUNT > 0: ddprun, torchrun) always resumes.
	Resume bool
	// Getenv reads the launcher's environment; nil means os.Getenv.
	Getenv func(string) string
	// Logger receives the warning about a checkpoint that is skipped and a line on resuming;
	// nil means zap.NewNop().
	Logger *zap.Logger
}

// Checkpointer saves and restores the state a trainer registers. See the package doc.
type Checkpointer struct {
	pg   procgroup.ProcessGroup // nil: one process
	rank int
	o    Options
	log  *zap.Logger

	tensors []tensor
	ints    []scalar
	config  []kv
	ranks   []*perRank // PerRank's
	names   map[string]bool
	regErr  error // the first bad registration, reported by Restore and Save
	buf     []byte
}

type tensor struct {
	name  string
	shape []int64
	data  []float32
}

type scalar struct {
	name string
	p    *int64
}

type kv struct{ key, value string }

// New returns a Checkpointer over Options.Dir for this rank of pg (nil: a process on its
// own). It touches no file; Restore and Save do.
func New(pg procgroup.ProcessGroup, o Options) (*Checkpointer, error) {
	if o.Dir == "" {
		return nil, errors.New("checkpoint: Options.Dir is empty")
	}
	if o.Keep < 0 {
		return nil, fmt.Errorf("checkpoint: Options.Keep %d is negative", o.Keep)
	}
	if o.Keep == 0 {
		o.Keep = 2
	}
	if o.Getenv == nil {
		o.Getenv = os.Getenv
	}
	c := &Checkpointer{pg: pg, o: o, log: o.Logger, names: map[string]bool{}}
	if c.log == nil {
		c.log = zap.NewNop()
	}
	if pg != nil {
		c.rank = pg.Rank()
	}
	return c, nil
}

func (c *Checkpointer) register(kind, name string) bool {
	switch {
	case c.regErr != nil:
		return false
	case name == "" || len(name) > maxName:
		c.regErr = fmt.Errorf("checkpoint: %s name %q: want 1 to %d bytes", kind, name, maxName)
		return false
	case c.names[name]:
		c.regErr = fmt.Errorf("checkpoint: %s %q registered twice", kind, name)
		return false
	}
	c.names[name] = true
	return true
}

// Float32 registers a tensor: Save writes data, Restore overwrites it in place. shape is
// its dimensions (none: one of len(data)); a checkpoint whose tensor of this name has
// another shape is refused. Parameters and optimizer state are registered this way.
func (c *Checkpointer) Float32(name string, data []float32, shape ...int) {
	if !c.register("tensor", name) {
		return
	}
	if len(shape) == 0 {
		shape = []int{len(data)}
	}
	n, dims := int64(1), make([]int64, len(shape))
	for i, d := range shape {
		if d < 0 {
			n = -1
			break
		}
		dims[i], n = int64(d), n*int64(d)
	}
	if n != int64(len(data)) || len(shape) > maxDims {
		c.regErr = fmt.Errorf("checkpoint: tensor %q: shape %v does not hold its %d values", name, shape, len(data))
		return
	}
	c.tensors = append(c.tensors, tensor{name: name, shape: dims, data: data})
}

// Int64 registers a scalar that Save writes and Restore sets: an optimizer's step count,
// the data position, an RNG's state.
func (c *Checkpointer) Int64(name string, p *int64) {
	if !c.register("value", name) {
		return
	}
	c.ints = append(c.ints, scalar{name: name, p: p})
}

// Config registers a setting that the saved state depends on (a seed, a batch size; the
// world size only if the data depend on it): Restore refuses a checkpoint written with
// another value, naming the setting.
func (c *Checkpointer) Config(key, value string) {
	if !c.register("config", key) {
		return
	}
	c.config = append(c.config, kv{key, value})
}

// FileName is the name of the checkpoint of step in Options.Dir.
func FileName(step int64) string { return fmt.Sprintf("step%09d.ckpt", step) }

// List returns the steps of the checkpoint files in dir, newest first; a missing directory
// has none.
func List(dir string) ([]int64, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("checkpoint: %w", err)
	}
	var steps []int64
	for _, e := range ents {
		num, ok := strings.CutPrefix(e.Name(), "step")
		if !ok || e.IsDir() {
			continue
		}
		if num, ok = strings.CutSuffix(num, ".ckpt"); !ok {
			continue
		}
		s, err := strconv.ParseInt(num, 10, 64)
		if err != nil || s < 0 || FileName(s) != e.Name() {
			continue
		}
		steps = append(steps, s)
	}
	slices.Sort(steps)
	slices.Reverse(steps)
	return steps, nil
}

// Save writes the registered state as the checkpoint of step (the step to continue from:
// steps 0 … step−1 are done), on rank 0 only; on the other ranks it returns nil at once.
// The write is atomic (a temporary file, fsync, rename, fsync of the directory), so a crash
// leaves the earlier files intact; then the files beyond the Keep newest, and any of a
// later step (of an abandoned attempt), are removed. Save is not a collective, unless a
// PerRank state is registered: then every rank calls it (SaveContext) and it gathers their
// states into rank 0's file.
func (c *Checkpointer) Save(step int64) error { return c.SaveContext(context.Background(), step) }

// SaveContext is Save, whose collective (with a PerRank state) ends with ctx.
func (c *Checkpointer) SaveContext(ctx context.Context, step int64) error {
	if c.regErr != nil {
		return c.regErr
	}
	if err := c.gatherRanks(ctx); err != nil {
		return fmt.Errorf("checkpoint of step %d: %w", step, err)
	}
	defer c.dropSaved()
	if c.rank != 0 {
		return nil
	}
	if step < 0 {
		return fmt.Errorf("checkpoint: step %d is negative", step)
	}
	dir := c.o.Dir
	path := filepath.Join(dir, FileName(step))
	wrap := func(err error) error { return fmt.Errorf("checkpoint of step %d: %w", step, err) }
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return wrap(err)
	}
	tmp, err := os.CreateTemp(dir, tmpPattern)
	if err != nil {
		return wrap(err)
	}
	defer os.Remove(tmp.Name()) // fails harmlessly after the rename
	werr := c.encode(tmp, step)
	if err := errors.Join(werr, tmp.Sync(), tmp.Close()); err != nil {
		return wrap(err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return wrap(err)
	}
	if err := syncDir(dir); err != nil {
		return wrap(err)
	}
	steps, err := List(dir)
	if err != nil {
		return err
	}
	kept := 0
	for _, s := range steps {
		if s <= step && kept < c.o.Keep {
			kept++
			continue
		}
		if err := os.Remove(filepath.Join(dir, FileName(s))); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("checkpoint: removing an old checkpoint: %w", err)
		}
	}
	return nil
}

// dropSaved forgets the gathered per-rank states once they are written.
func (c *Checkpointer) dropSaved() {
	for _, p := range c.ranks {
		p.saved = nil
	}
}

// tmpPattern names the temporary files of a write in progress.
const tmpPattern = ".ckpt-*.tmp"

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	return errors.Join(d.Sync(), d.Close())
}

// Restore loads the newest checkpoint any rank can read into the registered state and
// returns its step, the step to continue from; 0 with no checkpoint anywhere (a fresh
// start, which is also correct for a deterministic run). With a process group it is a
// collective: every rank calls it.
//
// Each rank reads the newest file of its Options.Dir whose CRC is right (a corrupt or
// truncated one is skipped with a warning) and the ranks exchange their steps: the newest
// step of them all wins, and the lowest rank that holds it broadcasts the state to the
// ranks that do not, so ranks on hosts without a shared file system, or with a directory
// of their own, resume too. A checkpoint of another run (a registered Config differs) or
// of another model (a tensor is missing, extra or of another shape) fails every rank with
// an error naming the setting or the tensor. On a first attempt without Options.Resume, a
// directory that holds checkpoints fails with ErrExists.
func (c *Checkpointer) Restore(ctx context.Context) (int64, error) {
	if c.regErr != nil {
		return 0, c.regErr
	}
	dir := c.o.Dir
	attempt := 0
	if s := c.o.Getenv("TORCHELASTIC_RESTART_COUNT"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("checkpoint: TORCHELASTIC_RESTART_COUNT=%q: want a count", s)
		}
		attempt = n
	}
	resuming := c.o.Resume || attempt > 0
	if c.rank == 0 { // the writer's temporary files, of a write a crash interrupted
		tmps, _ := filepath.Glob(filepath.Join(dir, tmpPattern))
		for _, t := range tmps {
			os.Remove(t)
		}
	}

	// This rank's part: a status and a step.
	const (
		none  = 0 // no checkpoint (step −1)
		found = 1 // the state of step is loaded
		exist = 2 // not resuming, and dir holds checkpoints up to step
		fail  = 3 // lerr
	)
	status, step := int64(none), int64(-1)
	var lerr error
	steps, err := List(dir)
	switch {
	case err != nil:
		status, lerr = fail, err
	case !resuming:
		if len(steps) > 0 {
			status, step = exist, steps[0]
		}
	default:
		for _, s := range steps {
			path := filepath.Join(dir, FileName(s))
			err := c.load(path, s)
			var skip *unreadableError
			if errors.As(err, &skip) {
				c.log.Warn("checkpoint: skipping an unreadable checkpoint", zap.String("path", path), zap.Int64("step", s), zap.Error(err))
				continue
			}
			if err != nil {
				status, lerr = fail, err
			} else {
				status, step = found, s
			}
			break
		}
	}

	all := []int64{status, step}
	if c.pg != nil {
		all = make([]int64, 2*c.pg.Size())
		if err := c.pg.AllGather(ctx, all, []int64{status, step}).Wait(ctx); err != nil {
			return 0, fmt.Errorf("rank %d: checkpoint: agreeing on the step to resume from: %w", c.rank, err)
		}
	}
	var failed []int
	target, src, newestExist, have := int64(-1), -1, int64(-1), 0
	for r := 0; r < len(all)/2; r++ {
		st, s := all[2*r], all[2*r+1]
		switch st {
		case fail:
			failed = append(failed, r)
		case exist:
			newestExist = max(newestExist, s)
		case found:
			if s > target {
				target, src, have = s, r, 0
			}
			if s == target {
				have++
			}
		}
	}
	switch {
	case lerr != nil:
		return 0, fmt.Errorf("rank %d: %w", c.rank, lerr)
	case len(failed) > 0:
		return 0, fmt.Errorf("rank %d: checkpoint: ranks %v cannot resume from %s (see their errors)", c.rank, failed, dir)
	case newestExist >= 0:
		return 0, fmt.Errorf("%w: %s holds checkpoints up to step %d", ErrExists, dir, newestExist)
	case target < 0:
		return 0, nil
	}
	if have < len(all)/2 {
		// Some ranks have no file of the target step: src's state goes to every rank.
		if err := c.broadcast(ctx, src); err != nil {
			return 0, fmt.Errorf("rank %d: checkpoint: the state of step %d from rank %d: %w", c.rank, target, src, err)
		}
		if err := c.broadcastRanks(ctx, src); err != nil {
			return 0, fmt.Errorf("rank %d: checkpoint: the state of step %d from rank %d: %w", c.rank, target, src, err)
		}
	}
	if err := c.restoreRanks(ctx); err != nil {
		return 0, err
	}
	c.log.Info("checkpoint: resuming", zap.Int64("step", target), zap.Int("from_rank", src), zap.Int("ranks_with_file", have))
	return target, nil
}

// broadcast sends the registered state from rank src to every rank.
func (c *Checkpointer) broadcast(ctx context.Context, src int) error {
	ints := make([]int64, len(c.ints))
	for i, s := range c.ints {
		ints[i] = *s.p
	}
	if len(ints) > 0 {
		if err := c.pg.Broadcast(ctx, ints, src).Wait(ctx); err != nil {
			return err
		}
	}
	for i, s := range c.ints {
		*s.p = ints[i]
	}
	for _, t := range c.tensors {
		if len(t.data) == 0 {
			continue
		}
		if err := c.pg.Broadcast(ctx, t.data, src).Wait(ctx); err != nil {
			return fmt.Errorf("tensor %q: %w", t.name, err)
		}
	}
	return nil
}

// The file format, little endian: magic, version (uint32), the step (int64); the configs
// (a uint32 count, then key and value), the values (a count, then name and int64), the
// tensors (a count, then name, the number of dimensions as a uint32 and each as an int64),
// the per-rank states (version 2: a count, then name, description, the number of saving
// ranks as a uint32 and each one's length in bytes as an int64); the tensors' float32
// values in table order; the per-rank states' bytes, in table and rank order; a CRC-32
// (IEEE) of everything before it. A string is a uint32 length and its bytes. Version 1
// (no per-rank states) is read too.
const (
	magic   = "goddpckp"
	version = 2
	maxName = 1 << 12 // bytes of a name, key or value
	maxDims = 16
	maxRecs = 1 << 20 // configs, values or tensors
)

// unreadableError is a file whose bytes are damaged (its CRC does not match, or it is cut
// short): Restore skips it.
type unreadableError struct{ err error }

func (e *unreadableError) Error() string { return e.err.Error() }
func (e *unreadableError) Unwrap() error { return e.err }

type encoder struct {
	w   *bufio.Writer
	crc hash.Hash32
	b   [8]byte
	err error
}

func (e *encoder) write(p []byte) {
	if e.err == nil {
		e.crc.Write(p)
		_, e.err = e.w.Write(p)
	}
}
func (e *encoder) u32(v uint32) { binary.LittleEndian.PutUint32(e.b[:], v); e.write(e.b[:4]) }
func (e *encoder) i64(v int64)  { binary.LittleEndian.PutUint64(e.b[:], uint64(v)); e.write(e.b[:8]) }
func (e *encoder) str(s string) { e.u32(uint32(len(s))); e.write([]byte(s)) }

func (c *Checkpointer) encode(w io.Writer, step int64) error {
	e := &encoder{w: bufio.NewWriterSize(w, 1<<16), crc: crc32.NewIEEE()}
	e.write([]byte(magic))
	e.u32(version)
	e.i64(step)
	e.u32(uint32(len(c.config)))
	for _, kv := range c.config {
		e.str(kv.key)
		e.str(kv.value)
	}
	e.u32(uint32(len(c.ints)))
	for _, s := range c.ints {
		e.str(s.name)
		e.i64(*s.p)
	}
	e.u32(uint32(len(c.tensors)))
	for _, t := range c.tensors {
		e.str(t.name)
		e.u32(uint32(len(t.shape)))
		for _, d := range t.shape {
			e.i64(d)
		}
	}
	e.u32(uint32(len(c.ranks)))
	for _, p := range c.ranks {
		e.str(p.name)
		e.str(p.desc)
		e.u32(uint32(len(p.saved)))
		for _, b := range p.saved {
			e.i64(int64(len(b)))
		}
	}
	if c.buf == nil {
		c.buf = make([]byte, 1<<16)
	}
	for _, t := range c.tensors {
		for p := t.data; len(p) > 0 && e.err == nil; {
			n := min(len(p), len(c.buf)/4)
			for i, v := range p[:n] {
				binary.LittleEndian.PutUint32(c.buf[4*i:], math.Float32bits(v))
			}
			e.write(c.buf[:4*n])
			p = p[n:]
		}
	}
	for _, p := range c.ranks {
		for _, b := range p.saved {
			e.write(b)
		}
	}
	if e.err != nil {
		return e.err
	}
	binary.LittleEndian.PutUint32(e.b[:], e.crc.Sum32())
	if _, err := e.w.Write(e.b[:4]); err != nil {
		return err
	}
	return e.w.Flush()
}

// load verifies the file at path (its CRC first: a damaged file is an *unreadableError),
// checks it against the registration and reads it into the registered state.
func (c *Checkpointer) load(path string, step int64) error {
	fh, err := os.Open(path)
	if err != nil {
		return &unreadableError{fmt.Errorf("checkpoint: %w", err)}
	}
	defer fh.Close()
	fi, err := fh.Stat()
	if err != nil {
		return &unreadableError{fmt.Errorf("checkpoint %s: %w", path, err)}
	}
	return c.decode(fh, fi.Size(), path, step)
}

// decode is load's reader of the size bytes of r, the file at path.
func (c *Checkpointer) decode(fh io.ReadSeeker, size int64, path string, step int64) error {
	if size < int64(len(magic))+4+8+3*4+4 {
		return &unreadableError{fmt.Errorf("checkpoint %s: %d bytes: cut short", path, size)}
	}
	// Pass 1: the CRC of the whole file, before any of it is believed.
	h := crc32.NewIEEE()
	if _, err := io.Copy(h, io.LimitReader(fh, size-4)); err != nil {
		return &unreadableError{fmt.Errorf("checkpoint %s: %w", path, err)}
	}
	var sum [4]byte
	if _, err := io.ReadFull(fh, sum[:]); err != nil {
		return &unreadableError{fmt.Errorf("checkpoint %s: %w", path, err)}
	}
	if got, want := binary.LittleEndian.Uint32(sum[:]), h.Sum32(); got != want {
		return &unreadableError{fmt.Errorf("checkpoint %s: corrupt (crc %08x, computed %08x)", path, got, want)}
	}
	if _, err := fh.Seek(0, io.SeekStart); err != nil {
		return &unreadableError{fmt.Errorf("checkpoint %s: %w", path, err)}
	}
	// Pass 2: the header, checked against the registration, then the values.
	d := &decoder{r: bufio.NewReaderSize(io.LimitReader(fh, size-4), 1<<16), left: size - 4}
	ver := uint32(0)
	if string(d.bytes(len(magic))) == magic {
		ver = d.u32()
	}
	if ver != 1 && ver != version {
		if d.err != nil {
			return fmt.Errorf("checkpoint %s: %w", path, d.err)
		}
		return fmt.Errorf("checkpoint %s: not a version-1 or version-%d goddp checkpoint", path, version)
	}
	if s := d.i64(); d.err == nil && s != step {
		return fmt.Errorf("checkpoint %s: holds step %d", path, s)
	}
	cfg := map[string]string{}
	for n := d.count(); n > 0 && d.err == nil; n-- {
		k := d.str()
		cfg[k] = d.str()
	}
	ints := map[string]int64{}
	for n := d.count(); n > 0 && d.err == nil; n-- {
		k := d.str()
		ints[k] = d.i64()
	}
	type entry struct {
		name  string
		shape []int64
		n     int64
	}
	var table []entry
	total := int64(0)
	for n := d.count(); n > 0 && d.err == nil; n-- {
		e := entry{name: d.str(), n: 1}
		nd := d.u32()
		if nd > maxDims {
			d.fail("tensor %q: %d dimensions", e.name, nd)
			break
		}
		for range nd {
			v := d.i64()
			if v < 0 || (v > 0 && e.n > math.MaxInt64/4/v) {
				d.fail("tensor %q: dimension %d", e.name, v)
				break
			}
			e.shape, e.n = append(e.shape, v), e.n*v
		}
		total += e.n
		table = append(table, e)
	}
	var recs []rankRecord
	rankBytes := int64(0)
	if ver >= 2 { // the per-rank states
		for n := d.count(); n > 0 && d.err == nil; n-- {
			r := rankRecord{name: d.str(), desc: d.str()}
			for w := d.count(); w > 0 && d.err == nil; w-- {
				l := d.i64()
				if l < 0 || l > d.left-rankBytes {
					d.fail("per-rank state %q: %d bytes", r.name, l)
					break
				}
				r.lens, rankBytes = append(r.lens, l), rankBytes+l
			}
			if len(r.lens) == 0 {
				d.fail("per-rank state %q: saved by no rank", r.name)
			}
			recs = append(recs, r)
		}
	}
	if d.err != nil {
		return fmt.Errorf("checkpoint %s: %w", path, d.err)
	}
	if total < 0 || rankBytes > d.left || total*4 != d.left-rankBytes {
		return fmt.Errorf("checkpoint %s: its tensors hold %d values and its per-rank states %d bytes, the file %d bytes of them", path, total, rankBytes, d.left)
	}

	// The registration against the file.
	var diffs []string
	for _, kv := range c.config {
		if v, ok := cfg[kv.key]; !ok {
			diffs = append(diffs, fmt.Sprintf("no %s (this run has %s %s)", kv.key, kv.key, kv.value))
		} else if v != kv.value {
			diffs = append(diffs, fmt.Sprintf("%s %s (this run has %s %s)", kv.key, v, kv.key, kv.value))
		}
	}
	if len(diffs) > 0 {
		return fmt.Errorf("checkpoint %s of step %d was written with %s", path, step, strings.Join(diffs, ", "))
	}
	byName := map[string]*tensor{}
	for i := range c.tensors {
		byName[c.tensors[i].name] = &c.tensors[i]
	}
	for _, e := range table {
		t := byName[e.name]
		switch {
		case t == nil:
			return fmt.Errorf("checkpoint %s: holds tensor %q, which this model does not have", path, e.name)
		case !slices.Equal(t.shape, e.shape):
			return fmt.Errorf("checkpoint %s: tensor %q has shape %v, in this model %v (a checkpoint of another model)", path, e.name, e.shape, t.shape)
		}
		delete(byName, e.name)
	}
	for _, t := range c.tensors {
		if byName[t.name] != nil {
			return fmt.Errorf("checkpoint %s: has no tensor %q of shape %v (a checkpoint of another model)", path, t.name, t.shape)
		}
	}
	for _, s := range c.ints {
		if _, ok := ints[s.name]; !ok {
			return fmt.Errorf("checkpoint %s: has no value %q", path, s.name)
		}
	}
	if err := c.checkRanks(recs, path, step); err != nil {
		return err
	}

	// The values (the file is verified and matches: nothing below can fail but I/O).
	if c.buf == nil {
		c.buf = make([]byte, 1<<16)
	}
	byName = map[string]*tensor{}
	for i := range c.tensors {
		byName[c.tensors[i].name] = &c.tensors[i]
	}
	for _, e := range table {
		for p := byName[e.name].data; len(p) > 0; {
			n := min(len(p), len(c.buf)/4)
			if _, err := io.ReadFull(d.r, c.buf[:4*n]); err != nil {
				return &unreadableError{fmt.Errorf("checkpoint %s: %w", path, err)}
			}
			for i := range p[:n] {
				p[i] = math.Float32frombits(binary.LittleEndian.Uint32(c.buf[4*i:]))
			}
			p = p[n:]
		}
	}
	byRank := map[string]*perRank{}
	for _, p := range c.ranks {
		byRank[p.name] = p
	}
	for _, r := range recs {
		saved := make([][]byte, len(r.lens))
		for w, l := range r.lens {
			saved[w] = make([]byte, l)
			if _, err := io.ReadFull(d.r, saved[w]); err != nil {
				return &unreadableError{fmt.Errorf("checkpoint %s: %w", path, err)}
			}
		}
		byRank[r.name].saved = saved
	}
	for _, s := range c.ints {
		*s.p = ints[s.name]
	}
	return nil
}

type decoder struct {
	r    *bufio.Reader
	left int64 // bytes before the CRC not yet read
	b    [8]byte
	err  error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf(format, args...)
	}
}

func (d *decoder) bytes(n int) []byte {
	if d.err != nil {
		return nil
	}
	if int64(n) > d.left {
		d.fail("header runs past the end of the file")
		return nil
	}
	var b []byte
	if n > len(d.b) {
		b = make([]byte, n)
	} else {
		b = d.b[:n]
	}
	if _, err := io.ReadFull(d.r, b); err != nil {
		d.err = err
		return nil
	}
	d.left -= int64(n)
	return b
}

func (d *decoder) u32() uint32 {
	if b := d.bytes(4); b != nil {
		return binary.LittleEndian.Uint32(b)
	}
	return 0
}

func (d *decoder) i64() int64 {
	if b := d.bytes(8); b != nil {
		return int64(binary.LittleEndian.Uint64(b))
	}
	return 0
}

func (d *decoder) count() uint32 {
	n := d.u32()
	if n > maxRecs {
		d.fail("%d records", n)
		return 0
	}
	return n
}

func (d *decoder) str() string {
	n := d.u32()
	if n > maxName {
		d.fail("a name of %d bytes", n)
		return ""
	}
	return string(d.bytes(int(n)))
}
