package reducer

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/goddp/goddp/bucket"
)

// Note [Non-finite gradients]: a NaN or an infinity in one rank's gradient reaches every
// rank's average through the all-reduce, and the optimizer spreads it into every replica's
// parameters. The reducer names the source instead, at almost no cost and with no
// collective in a step whose gradients are finite:
//   - GradReady's copy into the bucket (scaleCheck) notes whether what it wrote, the
//     parameter's local contribution (after NoSync passes, their running sum), holds a NaN
//     or an Inf: the copy loop also sums x·0 over its values, which is NaN exactly when some
//     x is, in four accumulators so that the sum adds no dependency chain to the loop
//     (unrolled, it is no slower than the loop it replaced). The flag, one per parameter
//     (localBad), is kept across the accumulation window and reset at the synced Finalize.
//   - A non-finite contribution makes the reduced sum non-finite where it is (NaN + x is
//     NaN, Inf + x is Inf or NaN), and every rank holds the same reduced bits (as DDP's
//     replicas must anyway). So Finalize's unpack checks each reduced parameter the same
//     way, after its copy back into Param.Grad (while later buckets still reduce); with
//     GradientAsBucketView, where nothing is copied, it reads the bucket once instead.
//   - With Options.Scattered (a reduce-scatter in place: ZeRO stage 2) a rank holds the
//     reduction of its own block of each bucket only, so it checks that block alone and
//     the ranks' findings differ: every synced Finalize then runs the exchange below,
//     whatever this rank found, and the union of the ranks' reduced flags decides.
//   - Only if a reduced value is not finite, on every rank alike, Finalize runs one more
//     collective: an AllGather of every rank's flags, one bit per parameter, and returns the
//     same *NonFiniteError on every rank, naming the ranks and parameters whose local
//     gradient was not finite. A reduced value that is not finite while every local one
//     was (a compression hook's overflow, beyond ±65504 in fp16, or an overflowing sum) is
//     named as such, without a rank.
// At the seed's shape (examples/transformer's defaults, 1,711,104 float32 parameters in 2
// buckets) the check costs 0.44 ms per step on the hook path, nearly all of it the read of
// the reduced gradients: BenchmarkFiniteCheckSeedShape, 0.79 ms off and 1.23 ms on (medians
// of 5, 2026-12-06, a 2-core VM shared with other jobs), against 160–250 ms per step of the
// 2-rank run on that VM, so it is on by default (Options.NoFiniteCheck turns it off; the
// ranks must agree on it).
// The error leaves the Reducer usable (the ranks issued the same collectives), so the
// trainer may skip the step, as a loss scaler does after an overflow, or stop. The device
// path (Options.Device) has no check: the host never reads device gradients, and a check
// there would need a reduction kernel that procgroup.Device does not offer and a host
// synchronisation per step, which that path avoids (Note [Device buckets]).

// ErrNonFinite is wrapped by *NonFiniteError.
var ErrNonFinite = errors.New("reducer: non-finite gradient")

// NonFiniteError is Finalize's error for a synced step whose averaged gradient holds a NaN
// or an infinity: the same on every rank. Local lists where the ranks' own gradients (the
// step's sum over its NoSync passes) were not finite; Overflow the parameters whose
// reduced gradient is not finite although every rank's local one was (an overflow in the
// CommHook's compression, or in the sum). The gradients are left as the reduction left
// them, non-finite values included: do not step the optimizer on them.
type NonFiniteError struct {
	// Step counts the synced Finalizes before this one since New, from 0: a trainer's step
	// index if it started at 0 with this Reducer. A trainer that counts its steps
	// otherwise (a resumed run) may set it to its own count before reporting the error.
	Step int
	// Iter is the backward pass, counted from 1 over every BeginBackward (as in
	// UnusedError).
	Iter     int
	Local    []NonFiniteGrad // by rank, then parameter index
	Overflow []NonFiniteGrad // Rank is -1
}

// NonFiniteGrad is one rank's gradient of one parameter.
type NonFiniteGrad struct {
	Rank  int // -1 in NonFiniteError.Overflow
	Param int
	Name  string
}

func (e *NonFiniteError) Error() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "reducer: step %d: ", e.Step)
	named, total := 0, len(e.Local)+len(e.Overflow)
	// list writes one group of gs; false once maxNamed parameters are named.
	list := func(sep, head string, gs []NonFiniteGrad) bool {
		if named == maxNamed {
			fmt.Fprintf(&sb, "%s... and %d more", sep, total-named)
			return false
		}
		sb.WriteString(sep + head)
		if len(gs) == 1 {
			sb.WriteString("parameter ")
		} else {
			sb.WriteString("parameters ")
		}
		for k, g := range gs {
			if k > 0 {
				sb.WriteString(", ")
			}
			if named == maxNamed {
				fmt.Fprintf(&sb, "... and %d more", total-named)
				return false
			}
			fmt.Fprintf(&sb, "%d (%s)", g.Param, g.Name)
			named++
		}
		return true
	}
	sep := "non-finite local gradient: "
	for k := 0; k < len(e.Local); {
		j := k
		for j < len(e.Local) && e.Local[j].Rank == e.Local[k].Rank {
			j++
		}
		if !list(sep, fmt.Sprintf("rank %d: ", e.Local[k].Rank), e.Local[k:j]) {
			return sb.String()
		}
		sep, k = "; ", j
	}
	if len(e.Overflow) > 0 {
		if len(e.Local) > 0 {
			sep = "; and "
		} else {
			sep = ""
		}
		list(sep, "non-finite reduced gradient although every rank's local gradient was finite (an overflow in the comm hook's compression or in the sum): ", e.Overflow)
	}
	return sb.String()
}

// Unwrap makes errors.Is(err, ErrNonFinite) true.
func (e *NonFiniteError) Unwrap() error { return ErrNonFinite }

// finiteState is the Reducer's record of non-finite values in the current step (Note
// [Non-finite gradients]); its fields are guarded by Reducer.mu.
type finiteState struct {
	localBad   []bool // per parameter: its local contribution in this window was not finite
	reducedBad []bool // per parameter: its reduced gradient in this step is not finite
	anyLocal   bool
	anyReduced bool
	step       int     // synced Finalizes completed since New
	mine, all  []int64 // endStepFinite's flags: this rank's, and every rank's
}

// noteLocal records whether parameter i's local contribution is finite. r.mu must be
// held.
func (r *Reducer) noteLocal(i int, finite bool) {
	if !finite {
		r.fin.localBad[i] = true
		r.fin.anyLocal = true
	}
}

// noteReduced records that parameter i's reduced gradient is not finite. r.mu must be
// held.
func (r *Reducer) noteReduced(i int) {
	r.fin.reducedBad[i] = true
	r.fin.anyReduced = true
}

// checkBucket reads bucket b after its reduction, with GradientAsBucketView (nothing is
// copied back), and records its parameters whose gradient is not finite. r.mu must be
// held.
func (r *Reducer) checkBucket(b int) {
	s := &r.slots[b]
	n := max(len(s.f32), len(s.f64))
	lo, hi := r.checkedPart(bucket.Loc{Len: n}, n)
	if s.f32 != nil && allFinite(s.f32[lo:hi]) || s.f64 != nil && allFinite(s.f64[lo:hi]) {
		return
	}
	for _, i := range r.lay.Buckets[b].Params {
		loc := r.lay.Where[i]
		lo, hi := r.checkedPart(loc, n)
		if s.f32 != nil && !allFinite(bucket.View(s.f32, loc)[lo:hi]) || s.f64 != nil && !allFinite(bucket.View(s.f64, loc)[lo:hi]) {
			r.noteReduced(i)
		}
	}
}

// checkedPart is the part [lo, hi) of a parameter's view (at loc, in a bucket buffer of n
// elements) that holds reduced values: all of it, or with Options.Scattered what lies in
// this rank's block of the buffer (possibly nothing).
func (r *Reducer) checkedPart(loc bucket.Loc, n int) (lo, hi int) {
	if !r.opts.Scattered {
		return 0, loc.Len
	}
	blk := n / r.pg.Size()
	a, b := max(loc.Offset, r.pg.Rank()*blk), min(loc.Offset+loc.Len, (r.pg.Rank()+1)*blk)
	if a >= b {
		return 0, 0
	}
	return a - loc.Offset, b - loc.Offset
}

// endStepFinite ends a synced step's check: nil, nil if every reduced gradient is finite;
// else, after an AllGather of every rank's flags, the *NonFiniteError (the same on every
// rank), or the AllGather's error. It resets the flags. r.mu must be held.
func (r *Reducer) endStepFinite(ctx context.Context) (*NonFiniteError, error) {
	f := &r.fin
	step := f.step
	f.step++
	if !f.anyReduced && !r.opts.Scattered {
		if f.anyLocal { // a non-finite local value that the hook made finite: nothing to say
			clear(f.localBad)
			f.anyLocal = false
		}
		return nil, nil
	}
	// Each rank's flags: its local ones, then its reduced ones (with Options.Scattered
	// each rank has checked its own block only, so the ranks' reduced flags differ and
	// their union counts). The buffers are kept: with Scattered this runs every step.
	words := (len(r.params) + 63) / 64
	n := r.pg.Size()
	if len(f.mine) != 2*words {
		f.mine, f.all = make([]int64, 2*words), make([]int64, n*2*words)
	}
	mine := f.mine
	clear(mine)
	for i := range r.params {
		if f.localBad[i] {
			mine[i/64] |= 1 << (i % 64)
		}
		if f.reducedBad[i] {
			mine[words+i/64] |= 1 << (i % 64)
		}
	}
	defer func() {
		clear(f.localBad)
		clear(f.reducedBad)
		f.anyLocal, f.anyReduced = false, false
	}()
	if err := r.pg.AllGather(ctx, f.all, mine).Wait(ctx); err != nil {
		return nil, fmt.Errorf("reducer: step %d: gathering the ranks' flags of non-finite gradients: %w", step, err)
	}
	bit := func(rank, half, i int) bool { return f.all[(rank*2+half)*words+i/64]&(1<<(i%64)) != 0 }
	reduced := false
	for rank := range n {
		for i := range r.params {
			reduced = reduced || bit(rank, 1, i)
		}
	}
	if !reduced { // Scattered: every rank's block was finite
		return nil, nil
	}
	e := &NonFiniteError{Step: step, Iter: r.m.Iter()}
	someRank := make([]bool, len(r.params))
	for rank := range n {
		for i := range r.params {
			if bit(rank, 0, i) {
				e.Local = append(e.Local, NonFiniteGrad{Rank: rank, Param: i, Name: r.params[i].Name})
				someRank[i] = true
			}
		}
	}
	for i := range r.params {
		bad := false
		for rank := range n {
			bad = bad || bit(rank, 1, i)
		}
		if bad && !someRank[i] {
			e.Overflow = append(e.Overflow, NonFiniteGrad{Rank: -1, Param: i, Name: r.params[i].Name})
		}
	}
	return e, nil
}

// scaleCheck is scaleInto that also reports whether every value it wrote into dst is
// finite (Note [Non-finite gradients]). It writes the same values as scaleInto.
func scaleCheck[T float32 | float64](dst, src []T, inv T, add bool) (finite bool) {
	if inv == 1 && !add {
		copy(dst, src)
		return allFinite(dst)
	}
	src = src[:len(dst)]
	var a0, a1, a2, a3 T
	k := 0
	if add {
		for ; k+4 <= len(dst); k += 4 {
			d, s := dst[k:k+4:k+4], src[k:k+4:k+4]
			x0, x1, x2, x3 := d[0]+T(s[0]*inv), d[1]+T(s[1]*inv), d[2]+T(s[2]*inv), d[3]+T(s[3]*inv) // T(): never fused (FMA)
			d[0], d[1], d[2], d[3] = x0, x1, x2, x3
			a0, a1, a2, a3 = a0+x0*0, a1+x1*0, a2+x2*0, a3+x3*0
		}
		for ; k < len(dst); k++ {
			x := dst[k] + T(src[k]*inv)
			dst[k] = x
			a0 += x * 0
		}
	} else {
		for ; k+4 <= len(dst); k += 4 {
			d, s := dst[k:k+4:k+4], src[k:k+4:k+4]
			x0, x1, x2, x3 := s[0]*inv, s[1]*inv, s[2]*inv, s[3]*inv
			d[0], d[1], d[2], d[3] = x0, x1, x2, x3
			a0, a1, a2, a3 = a0+x0*0, a1+x1*0, a2+x2*0, a3+x3*0
		}
		for ; k < len(dst); k++ {
			x := src[k] * inv
			dst[k] = x
			a0 += x * 0
		}
	}
	a := a0 + a1 + a2 + a3
	return a == a // false for NaN only
}

// allFinite reports whether s holds no NaN and no infinity: Σ x·0 is 0 if so, NaN if not.
func allFinite[T float32 | float64](s []T) bool {
	var a0, a1, a2, a3 T
	k := 0
	for ; k+4 <= len(s); k += 4 {
		v := s[k : k+4 : k+4]
		a0, a1, a2, a3 = a0+v[0]*0, a1+v[1]*0, a2+v[2]*0, a3+v[3]*0
	}
	for ; k < len(s); k++ {
		a0 += s[k] * 0
	}
	a := a0 + a1 + a2 + a3
	return a == a
}
