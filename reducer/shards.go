package reducer

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/goddp/goddp/procgroup"
)

// Note [Shards]: with Options.Shards = L the global batch is cut into L logical shards and
// the gradient the reducer leaves is the same bits at every world size. A rank of a world
// of n runs the shards [r·L/n, (r+1)·L/n) (CheckShards refuses an n that does not divide
// L), one backward pass each (BeginShard), and each pass's gradients go, undivided, into
// a buffer of their own: per bucket, the rank holds its L/n shards shard-major (in). The
// last of the rank's passes is the synced one: as its buckets fill they launch, in bucket
// order, as one AllGather each of in into all (L × the bucket, shard-major, so shard s's
// slice is at s·len whatever rank computed it). Finalize then folds every bucket the same
// way on every rank: ((g0 + g1) + g2) + … + g(L−1) in the element type, times 1/L. The
// order of the sum is the shard index, never the rank or the ring, so 1, 2, 3 or 6 ranks
// over 6 shards give the same bits (with one rank there is no collective: in is all).
// The price is the wire: a rank receives (n−1)/n·L·S bytes per step for S bytes of
// gradients, against the ring all-reduce's 2·(n−1)/n·S, and holds (L + L/n)·S bytes of
// shard buffers. Cheaper collectives are future work: an all-to-all that sends each rank
// every shard's 1/n slice of the bucket, folded there in shard order and then all-gathered,
// receives (n−1)/n·S·(L/n + 1) bytes (the ring's when L = n); a chained fold, rank r adding
// its shards to the running sum and passing it on, moves S per hop but serialises the
// ranks.

// ShardsError says that Options.Shards cannot be spread over the world size: every rank
// runs the same number of shards, so the world size must divide Shards. Fit lists the
// world sizes that do.
type ShardsError struct {
	Shards, WorldSize int
	Fit               []int
}

func (e *ShardsError) Error() string {
	fit := make([]string, len(e.Fit))
	for k, n := range e.Fit {
		fit[k] = strconv.Itoa(n)
	}
	return fmt.Sprintf("%d shards cannot be spread over a world of %d ranks: every rank runs the same number of shards, so the world size must divide %d; world sizes that work: %s",
		e.Shards, e.WorldSize, e.Shards, strings.Join(fit, ", "))
}

// Unwrap makes errors.Is(err, ErrInvalidArgument) true.
func (e *ShardsError) Unwrap() error { return ErrInvalidArgument }

// CheckShards returns a *ShardsError if shards logical shards cannot be spread evenly over
// a world of world ranks, nil if they can (or if shards is 0: no shards).
func CheckShards(shards, world int) error {
	if shards == 0 || (world > 0 && shards%world == 0) {
		return nil
	}
	e := &ShardsError{Shards: shards, WorldSize: world}
	for n := 1; n <= shards; n++ {
		if shards%n == 0 {
			e.Fit = append(e.Fit, n)
		}
	}
	return e
}

// shardState is the Reducer's state with Options.Shards (nil without).
type shardState struct {
	total int // L
	lo, k int // this rank's shards are [lo, lo+k)
	inv32 float32
	inv64 float64
	seen  []bool // per local shard: begun in this step
	nSeen int
	cur   int            // the local index of the shard whose pass is running; -1 before the first
	done  procgroup.Work // a completed Work: with one rank there is nothing to gather
}

func newShardState(total, rank, world int) *shardState {
	k := total / world
	return &shardState{total: total, lo: rank * k, k: k, inv32: 1 / float32(total), inv64: 1 / float64(total),
		seen: make([]bool, k), cur: -1, done: procgroup.Completed(nil)}
}

// shardBufs are one bucket's shard buffers (Note [Shards]): in holds this rank's shards,
// all every shard (all is in with one rank). The boxes are the interface values passed to
// AllGather, made once so that a launch does not allocate.
type shardBufs struct {
	in32, all32   []float32
	in64, all64   []float64
	inBox, allBox any
}

// newShardBufs allocates the shard buffers of a bucket of n elements of type f64 or not.
func (st *shardState) newShardBufs(n int, f64 bool, world int) *shardBufs {
	b := &shardBufs{}
	if f64 {
		b.in64 = make([]float64, st.k*n)
		b.all64 = b.in64
		if world > 1 {
			b.all64 = make([]float64, st.total*n)
		}
		b.inBox, b.allBox = b.in64, b.all64
	} else {
		b.in32 = make([]float32, st.k*n)
		b.all32 = b.in32
		if world > 1 {
			b.all32 = make([]float32, st.total*n)
		}
		b.inBox, b.allBox = b.in32, b.all32
	}
	return b
}

// BeginShard starts the backward pass of shard s, one of this rank's (LocalShards), with
// Options.Shards: report each of the pass's gradients with GradReady, then begin the next
// shard. Each of the rank's shards is run once per step, in any order; the pass of the
// last one is the synced one (sync is true), after which Finalize leaves the gradient
// averaged over all the shards (Note [Shards]). A shard that is not this rank's, a shard
// begun twice in a step, and an earlier pass of the step that did not report every
// parameter fail the Reducer (see Reducer).
func (r *Reducer) BeginShard(s int) (sync bool, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false, ErrClosed
	}
	st := r.sh
	if st == nil {
		return false, fmt.Errorf("%w: BeginShard(%d) without Options.Shards: use BeginBackward", ErrInvalidArgument, s)
	}
	if err := r.m.Err(); err != nil {
		return false, err
	}
	j := s - st.lo
	if j < 0 || j >= st.k {
		return false, r.failLocked(fmt.Errorf("%w: BeginShard(%d): rank %d of %d runs shards [%d, %d) of %d",
			ErrInvalidArgument, s, r.pg.Rank(), r.pg.Size(), st.lo, st.lo+st.k, st.total))
	}
	if st.seen[j] {
		return false, r.failLocked(fmt.Errorf("%w: BeginShard(%d): shard %d was already run in this step (each of shards [%d, %d) runs once, then Finalize)",
			ErrInvalidArgument, s, s, st.lo, st.lo+st.k))
	}
	if st.cur >= 0 && r.m.InBackward() {
		if err := r.m.Missing(); err != nil {
			return false, r.failLocked(fmt.Errorf("reducer: shard %d: every shard's pass must report every parameter: %w", st.lo+st.cur, err))
		}
	}
	mode := Accumulate
	if st.nSeen == st.k-1 {
		mode = Sync
	}
	if err := r.beginLocked(mode); err != nil {
		return false, err
	}
	st.seen[j] = true
	st.nSeen++
	st.cur = j
	return mode == Sync, nil
}

// LocalShards returns the shards this rank runs, [lo, hi), with Options.Shards; 0, 0
// without.
func (r *Reducer) LocalShards() (lo, hi int) {
	if r.sh == nil {
		return 0, 0
	}
	return r.sh.lo, r.sh.lo + r.sh.k
}

// checkShardsRun fails Finalize if the step began some of this rank's shards but not all.
// r.mu must be held.
func (r *Reducer) checkShardsRun() error {
	st := r.sh
	if st.nSeen == 0 || st.nSeen == st.k {
		return nil
	}
	var missing []string
	for j, ok := range st.seen {
		if !ok {
			missing = append(missing, strconv.Itoa(st.lo+j))
		}
	}
	return r.failLocked(fmt.Errorf("%w: Finalize before every shard of this rank ran: shards %s of [%d, %d) were not begun (BeginShard)",
		ErrPhase, strings.Join(missing, ", "), st.lo, st.lo+st.k))
}

// endStep forgets the shards begun in the step that just ended.
func (st *shardState) endStep() {
	clear(st.seen)
	st.nSeen, st.cur = 0, -1
}

// launchShards gathers every rank's shards of bucket s (Note [Shards]).
func (r *Reducer) launchShards(s *slot) procgroup.Work {
	if r.pg.Size() == 1 {
		return r.sh.done
	}
	return r.pg.AllGather(context.Background(), s.sh.allBox, s.sh.inBox)
}

// foldShards leaves in bucket s's buffer the fold of its gathered shards, in shard order,
// times 1/L (Note [Shards]).
func (r *Reducer) foldShards(s *slot) {
	if s.f32 != nil {
		foldInto(s.f32, s.sh.all32, r.sh.total, r.sh.inv32)
	} else {
		foldInto(s.f64, s.sh.all64, r.sh.total, r.sh.inv64)
	}
}

// foldInto sets dst to (((all_0 + all_1) + all_2) + … + all_{L−1})·inv, where all_s is
// the s-th block of len(dst) elements of all: each element's sum is taken in shard order,
// rounded to T at every addition.
func foldInto[T float32 | float64](dst, all []T, L int, inv T) {
	n := len(dst)
	copy(dst, all[:n])
	for s := 1; s < L; s++ {
		src := all[s*n : (s+1)*n]
		for e, v := range src {
			dst[e] += v
		}
	}
	for e := range dst {
		dst[e] *= inv
	}
}
