package ddp

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"strings"

	"github.com/goddp/goddp/procgroup"
)

type kind byte

const (
	kindParam  kind = 'p'
	kindBuffer kind = 'b'
)

func (k kind) String() string {
	if k == kindBuffer {
		return "buffer"
	}
	return "parameter"
}

// desc is what the ranks compare of one tensor.
type desc struct {
	kind  kind
	index int // in its list
	name  string
	dtype procgroup.DType
	n     int
	shape []int
}

func (d desc) label() string {
	if d.name == "" {
		return fmt.Sprintf("%v %d", d.kind, d.index)
	}
	return fmt.Sprintf("%v %d (%s)", d.kind, d.index, d.name)
}

// describe checks one tensor locally and returns its description (Shape defaulted).
func describe(k kind, i int, name string, data any, shape []int) (desc, error) {
	d := desc{kind: k, index: i, name: name}
	if data == nil {
		return d, fmt.Errorf("%w: %s: nil Data", ErrInvalidArgument, d.label())
	}
	dt, n, err := procgroup.DTypeOf(data)
	if err != nil {
		return d, fmt.Errorf("%w: %s: Data: %w", ErrInvalidArgument, d.label(), err)
	}
	d.dtype, d.n = dt, n
	if shape == nil {
		shape = []int{n}
	}
	size := 1
	for _, s := range shape {
		if s < 0 {
			return d, fmt.Errorf("%w: %s: negative dimension in shape %v", ErrInvalidArgument, d.label(), shape)
		}
		size *= s
	}
	if size != n {
		return d, fmt.Errorf("%w: %s: shape %v holds %d elements but Data has %d", ErrInvalidArgument, d.label(), shape, size, n)
	}
	d.shape = append([]int(nil), shape...)
	return d, nil
}

// hash is d's fingerprint; never 0 (which marks an absent tensor).
func (d desc) hash() int64 {
	h := fnv.New64a()
	var b [8]byte
	put := func(v int) {
		binary.LittleEndian.PutUint64(b[:], uint64(v))
		h.Write(b[:])
	}
	put(int(d.kind))
	put(len(d.name))
	h.Write([]byte(d.name))
	put(int(d.dtype))
	put(len(d.shape))
	for _, s := range d.shape {
		put(s)
	}
	return int64(h.Sum64() | 1)
}

// MismatchError says how the ranks' models differ: the first differing parameter or buffer
// (Index ≥ 0), or their count (Index = -1), as rank 0 has it (Want) and as Rank has it
// (Got). Other lists further ranks that differ from rank 0 in the same place.
type MismatchError struct {
	Kind  string // "parameter" or "buffer"
	Index int    // -1 for a count mismatch
	Name  string // rank 0's name for the tensor
	Rank  int    // the first rank that differs from rank 0
	Other []int  // further ranks that differ from rank 0 there
	Want  string // rank 0's side, as in the message
	Got   string // Rank's side
	msg   string
}

func (e *MismatchError) Error() string { return e.msg }

// Unwrap returns ErrMismatch.
func (e *MismatchError) Unwrap() error { return ErrMismatch }

// finish composes the message "ddp: <subject> <verb><Want> on rank 0 but <Got> on rank R".
func (e *MismatchError) finish(subject, verb string) *MismatchError {
	var b strings.Builder
	fmt.Fprintf(&b, "ddp: %s %s%s on rank 0 but %s on rank %d", subject, verb, e.Want, e.Got, e.Rank)
	b.WriteString(alsoDiffer(e.Other))
	e.msg = b.String()
	return e
}

// alsoDiffer is the message's note on further ranks that differ, or "".
func alsoDiffer(other []int) string {
	switch len(other) {
	case 0:
		return ""
	case 1:
		return fmt.Sprintf(" (rank %d also differs from rank 0)", other[0])
	}
	return fmt.Sprintf(" (ranks %s also differ from rank 0)", joinInts(other))
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, ", ")
}

// Note [Model check]: every rank must wrap the same model, or the buckets (and the
// collectives) would not line up. New compares the ranks in at most three AllGathers that
// every rank issues in the same order, deciding from the same gathered data, so all ranks
// return the same error and none hangs:
//  1. counts of parameters and buffers, a hash of every description, Options.Shards, a
//     hash of the CommHook's description (DescribeHook), Options.NoFiniteCheck and
//     Options.UnevenInputs (one AllGather of seven int64s per rank); if they are all
//     equal, that is the end;
//  2. otherwise one hash per tensor (absent ones as 0), to find the first differing tensor
//     and the ranks that differ from rank 0 there;
//  3. that tensor's description as a fixed-size record (element type, length, up to
//     recDims dimensions, up to recName bytes of name), for a message that names both sides.
//
// A count mismatch is reported first; then the first differing parameter, then buffer;
// then Options.Shards, since ranks that cut the batch differently would issue different
// collectives; then Options.NoFiniteCheck, since at a non-finite step only the ranks that
// check would issue the collective that names the sources (Note [Non-finite gradients] in
// package reducer); then Options.UnevenInputs, since only the ranks that set it issue the
// per-step count of Note [Join]; then the CommHook, whose description every rank then gathers (one more
// AllGather of hookRec bytes each) for a message that names both sides: ranks that
// compress differently (another hook, PowerSGD's rank) would all-reduce messages of
// different lengths, or average differently compressed gradients.

const (
	recDims   = 8
	recName   = 96
	recLen    = 3 + recDims + 1 + recName/8
	recHeader = 3 + recDims + 1
)

// verify compares the ranks' models (Note [Model check]): nil if they agree, otherwise a
// *MismatchError (or an error wrapping ErrMismatch) that every rank returns alike.
func verify(ctx context.Context, pg procgroup.ProcessGroup, descs []desc, shards int, hook string, noFinite, uneven bool) error {
	size := pg.Size()
	var ps, bs []desc
	for _, d := range descs {
		if d.kind == kindParam {
			ps = append(ps, d)
		} else {
			bs = append(bs, d)
		}
	}
	sum, err := gatherSummary(ctx, pg, descs, len(ps), len(bs), shards, hook, noFinite, uneven)
	if err != nil {
		return err
	}
	same := true
	maxP, maxB := 0, 0
	var otherShards []int // ranks whose Options.Shards differ from rank 0's
	var otherHooks []int  // ranks whose CommHook differs from rank 0's
	var otherCheck []int  // ranks whose Options.NoFiniteCheck differs from rank 0's
	var otherJoin []int   // ranks whose Options.UnevenInputs differs from rank 0's
	for r := 0; r < size; r++ {
		row := sum[summaryLen*r : summaryLen*r+summaryLen]
		same = same && row[0] == sum[0] && row[1] == sum[1] && row[2] == sum[2]
		maxP, maxB = max(maxP, int(row[0])), max(maxB, int(row[1]))
		if row[3] != sum[3] {
			otherShards = append(otherShards, r)
		}
		if row[4] != sum[4] {
			otherHooks = append(otherHooks, r)
		}
		if row[5] != sum[5] {
			otherCheck = append(otherCheck, r)
		}
		if row[6] != sum[6] {
			otherJoin = append(otherJoin, r)
		}
	}
	if same {
		if len(otherShards) > 0 {
			r := otherShards[0]
			return fmt.Errorf("%w: Options.Shards is %d on rank 0 but %d on rank %d%s", ErrMismatch, sum[3], sum[summaryLen*r+3], r, alsoDiffer(otherShards[1:]))
		}
		if len(otherCheck) > 0 {
			r := otherCheck[0]
			return fmt.Errorf("%w: Options.NoFiniteCheck is %v on rank 0 but %v on rank %d%s", ErrMismatch, sum[5] != 0, sum[summaryLen*r+5] != 0, r, alsoDiffer(otherCheck[1:]))
		}
		if len(otherJoin) > 0 {
			r := otherJoin[0]
			return fmt.Errorf("%w: Options.UnevenInputs is %v on rank 0 but %v on rank %d%s", ErrMismatch, sum[6] != 0, sum[summaryLen*r+6] != 0, r, alsoDiffer(otherJoin[1:]))
		}
		if len(otherHooks) > 0 {
			return hookMismatch(ctx, pg, hook, otherHooks)
		}
		return nil
	}

	hs, err := gatherHashes(ctx, pg, ps, bs, maxP, maxB)
	if err != nil {
		return err
	}
	at := firstDiffering(sum, hs, maxP)
	if err := countMismatch(sum); err != nil { // count mismatches come first
		return err
	}
	if at == nil {
		// Same counts and per-tensor hashes but different summaries cannot happen; say so
		// rather than pretend the models agree.
		return fmt.Errorf("%w: model summaries differ across ranks", ErrMismatch)
	}
	list := ps
	if at.k == kindBuffer {
		list = bs
	}
	return tensorMismatch(ctx, pg, list[at.index], at, hs)
}

// summaryLen is the length of a rank's row in round 1 of the model check.
const summaryLen = 7

// hookRec is the length in bytes of a CommHook's description in the check (a longer one
// keeps its first hookRec bytes in the message; the hash compares it whole).
const hookRec = 192

// gatherSummary runs round 1 of the model check: every rank's counts of parameters (np) and
// buffers (nb), a hash of all its descriptions, its Options.Shards, a hash of its
// CommHook's description and its Options.NoFiniteCheck, summaryLen int64s per rank.
func gatherSummary(ctx context.Context, pg procgroup.ProcessGroup, descs []desc, np, nb, shards int, hook string, noFinite, uneven bool) ([]int64, error) {
	all := fnv.New64a()
	for _, d := range descs {
		binary.Write(all, binary.LittleEndian, d.hash())
	}
	hh := fnv.New64a()
	hh.Write([]byte(hook))
	var check int64
	if noFinite {
		check = 1
	}
	var join int64
	if uneven {
		join = 1
	}
	mine := []int64{int64(np), int64(nb), int64(all.Sum64()), int64(shards), int64(hh.Sum64()), check, join}
	sum := make([]int64, summaryLen*pg.Size())
	if err := gather(ctx, pg, sum, mine, "model summary"); err != nil {
		return nil, err
	}
	return sum, nil
}

// hashTable is round 2 of the model check: a row per rank of one hash per tensor, its
// parameters padded to maxP and then its buffers (an absent tensor's hash is 0).
type hashTable struct {
	all   []int64
	width int
}

func (t hashTable) row(r int) []int64 { return t.all[r*t.width : (r+1)*t.width] }

// gatherHashes runs round 2: every rank's per-tensor hashes.
func gatherHashes(ctx context.Context, pg procgroup.ProcessGroup, ps, bs []desc, maxP, maxB int) (hashTable, error) {
	t := hashTable{width: maxP + maxB}
	hs := make([]int64, t.width)
	for i, d := range ps {
		hs[i] = d.hash()
	}
	for i, d := range bs {
		hs[maxP+i] = d.hash()
	}
	t.all = make([]int64, t.width*pg.Size())
	if err := gather(ctx, pg, t.all, hs, "tensor hashes"); err != nil {
		return hashTable{}, err
	}
	return t, nil
}

// site is a tensor where the ranks differ.
type site struct {
	k     kind
	index int // in its list
	col   int // in the hash rows
}

// firstDiffering returns the first tensor whose hash differs between the ranks within the
// common prefix of each list (the parameters first), or nil. sum is round 1's gather.
func firstDiffering(sum []int64, hs hashTable, maxP int) *site {
	size := len(sum) / summaryLen
	for _, l := range []struct {
		k        kind
		off, col int
	}{{kindParam, 0, 0}, {kindBuffer, 1, maxP}} {
		n := math.MaxInt
		for r := 0; r < size; r++ {
			n = min(n, int(sum[summaryLen*r+l.off]))
		}
		for i := 0; i < n; i++ {
			for r := 1; r < size; r++ {
				if hs.row(r)[l.col+i] != hs.row(0)[l.col+i] {
					return &site{l.k, i, l.col + i}
				}
			}
		}
	}
	return nil
}

// countMismatch reports the first list (parameters, then buffers) whose length differs
// between rank 0 and another rank, or nil. sum is round 1's gather.
func countMismatch(sum []int64) error {
	size := len(sum) / summaryLen
	for _, l := range []struct {
		k   kind
		off int
	}{{kindParam, 0}, {kindBuffer, 1}} {
		var diff []int
		for r := 1; r < size; r++ {
			if sum[summaryLen*r+l.off] != sum[l.off] {
				diff = append(diff, r)
			}
		}
		if len(diff) > 0 {
			e := &MismatchError{Kind: l.k.String(), Index: -1, Rank: diff[0], Other: diff[1:],
				Want: fmt.Sprint(sum[l.off]), Got: fmt.Sprint(sum[summaryLen*diff[0]+l.off])}
			noun := l.k.String()
			if sum[l.off] != 1 {
				noun += "s"
			}
			e.msg = fmt.Sprintf("ddp: %v %s on rank 0 but %v on rank %d%s", e.Want, noun, e.Got, e.Rank, alsoDiffer(e.Other))
			return e
		}
	}
	return nil
}

// tensorMismatch runs round 3, the records of the differing tensor at (d on this rank),
// and says how rank 0's differs from the first other rank's.
func tensorMismatch(ctx context.Context, pg procgroup.ProcessGroup, d desc, at *site, hs hashTable) error {
	size := pg.Size()
	recs := make([]int64, recLen*size)
	if err := gather(ctx, pg, recs, encode(d), "description of "+d.label()); err != nil {
		return err
	}
	zero := decode(recs[:recLen])
	var diff []int
	for r := 1; r < size; r++ {
		if hs.row(r)[at.col] != hs.row(0)[at.col] {
			diff = append(diff, r)
		}
	}
	other := decode(recs[recLen*diff[0] : recLen*(diff[0]+1)])
	e := &MismatchError{Kind: at.k.String(), Index: at.index, Name: zero.name, Rank: diff[0], Other: diff[1:]}
	subject := fmt.Sprintf("%v %d", at.k, at.index)
	if zero.name != "" {
		subject += " (" + zero.name + ")"
	}
	var want, got []string
	if !slices.Equal(zero.shape, other.shape) {
		want, got = append(want, fmt.Sprintf("shape %v", zero.shape)), append(got, fmt.Sprintf("shape %v", other.shape))
	}
	if zero.dtype != other.dtype {
		want, got = append(want, fmt.Sprintf("type %v", zero.dtype)), append(got, fmt.Sprintf("type %v", other.dtype))
	}
	switch {
	case zero.name != other.name:
		e.Want, e.Got = fmt.Sprintf("%q", zero.name), fmt.Sprintf("%q", other.name)
		return e.finish(fmt.Sprintf("%v %d", at.k, at.index), "is named ")
	case len(want) == 1:
		// "has shape [2 3] on rank 0 but [3 2] on rank 1": the attribute is named once.
		attr := strings.SplitN(want[0], " ", 2)[0]
		e.Want, e.Got = strings.TrimPrefix(want[0], attr+" "), strings.TrimPrefix(got[0], attr+" ")
		return e.finish(subject, "has "+attr+" ")
	case len(want) > 1:
		e.Want, e.Got = strings.Join(want, " and "), strings.Join(got, " and ")
		return e.finish(subject, "has ")
	}
	e.Want, e.Got = "one description", "another (beyond the compared detail)"
	return e.finish(subject, "has ")
}

// hookMismatch gathers every rank's CommHook description (others: the ranks whose hash
// differs from rank 0's) and says how rank 0's differs from the first other rank's.
func hookMismatch(ctx context.Context, pg procgroup.ProcessGroup, hook string, others []int) error {
	var buf [hookRec]byte
	n := copy(buf[:], hook)
	mine := make([]int64, 1+hookRec/8)
	mine[0] = int64(n)
	for i := 0; i < hookRec/8; i++ {
		mine[1+i] = int64(binary.LittleEndian.Uint64(buf[8*i:]))
	}
	all := make([]int64, len(mine)*pg.Size())
	if err := gather(ctx, pg, all, mine, "comm hook descriptions"); err != nil {
		return err
	}
	name := func(r int) string {
		row := all[r*len(mine) : (r+1)*len(mine)]
		var b [hookRec]byte
		for i := 0; i < hookRec/8; i++ {
			binary.LittleEndian.PutUint64(b[8*i:], uint64(row[1+i]))
		}
		return string(b[:min(max(int(row[0]), 0), hookRec)])
	}
	return fmt.Errorf("%w: Options.CommHook is %s on rank 0 but %s on rank %d%s", ErrMismatch, name(0), name(others[0]), others[0], alsoDiffer(others[1:]))
}

func gather(ctx context.Context, pg procgroup.ProcessGroup, out, in []int64, what string) error {
	if err := pg.AllGather(ctx, out, in).Wait(ctx); err != nil {
		return fmt.Errorf("ddp: rank %d: model check: all-gather of the %s: %w", pg.Rank(), what, err)
	}
	return nil
}

// encode packs d into a record (Note [Model check]).
func encode(d desc) []int64 {
	rec := make([]int64, recLen)
	rec[0], rec[1], rec[2] = int64(d.dtype), int64(d.n), int64(len(d.shape))
	for i := 0; i < len(d.shape) && i < recDims; i++ {
		rec[3+i] = int64(d.shape[i])
	}
	name := d.name
	if len(name) > recName {
		name = name[:recName]
	}
	rec[recHeader-1] = int64(len(name))
	var buf [recName]byte
	copy(buf[:], name)
	for i := 0; i < recName/8; i++ {
		rec[recHeader+i] = int64(binary.LittleEndian.Uint64(buf[8*i:]))
	}
	return rec
}

// decode unpacks a record; a shape of more than recDims dimensions keeps its first
// recDims, and a long name its first recName bytes.
func decode(rec []int64) desc {
	d := desc{dtype: procgroup.DType(rec[0]), n: int(rec[1])}
	nd := int(rec[2])
	d.shape = make([]int, 0, min(nd, recDims))
	for i := 0; i < nd && i < recDims; i++ {
		d.shape = append(d.shape, int(rec[3+i]))
	}
	var buf [recName]byte
	for i := 0; i < recName/8; i++ {
		binary.LittleEndian.PutUint64(buf[8*i:], uint64(rec[recHeader+i]))
	}
	n := min(max(int(rec[recHeader-1]), 0), recName)
	d.name = string(buf[:n])
	return d
}
