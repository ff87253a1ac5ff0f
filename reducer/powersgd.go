package reducer

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/goddp/goddp/procgroup"
)

// PowerSGDOptions configure PowerSGDHook. The names are PyTorch's (PowerSGDState).
type PowerSGDOptions struct {
	// Rank is r, the rank of each matrix's approximation (PyTorch's
	// matrix_approximation_rank); at least 1.
	Rank int
	// MinCompressionRate: a matrix of n×m elements is compressed only if
	// (n+m)·Rank·MinCompressionRate < n·m; the others go uncompressed, in the same message
	// (PyTorch's min_compression_rate). At least 1; 0 means 2, PyTorch's default. A
	// matrix whose smaller side is at most Rank is therefore always sent as it is: rank r
	// would not compress it (where PyTorch clamps r to the smaller side, with the same
	// outcome).
	MinCompressionRate float64
	// StartIter: the first StartIter synced steps all-reduce the buckets uncompressed
	// (PyTorch's start_powerSGD_iter; here 0 by default: compression from the first step).
	StartIter int
	// Seed seeds the initial Q factors, the same on every rank.
	Seed uint64
}

// PowerSGDHook returns a CommHook that all-reduces low-rank approximations of the
// gradients, with error feedback and warm start (Vogels et al., "PowerSGD: Practical
// Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019). See Note
// [PowerSGD]. The hook holds per-parameter state, so it serves one Reducer (one DDP): give
// every DDP its own. Its options are checked at New (errors wrap ErrInvalidArgument).
//
// The hook is an encoding.BinaryMarshaler and BinaryUnmarshaler, for checkpoints: its
// state between steps (each parameter's step, factors and error) as bytes, and back into
// a hook with the same options over the same parameters, after New. The factors and the
// step are the same on every rank, the error is each rank's own: a rank saves and restores
// its own state, and UnmarshalResized restores a state saved at another world size (Note
// [PowerSGD checkpoints]).
func PowerSGDHook(o PowerSGDOptions) CommHook {
	if o.MinCompressionRate == 0 {
		o.MinCompressionRate = 2
	}
	return &powerSGD{o: o}
}

// Note [PowerSGD]: each parameter of shape (n, d1, d2, …) is a matrix M of n rows and
// m = d1·d2·… columns; a 1-D parameter, or a matrix that rank r would not compress
// (PowerSGDOptions.MinCompressionRate), is reduced as it is. A compressed matrix keeps,
// per parameter (so that it outlives bucket rebuilds and NoSync windows, during which
// the hook is not called), its error E (n×m, the bucket's element type) and the two
// factors P (n×r) and Q (m×r, float64), Q drawn at New from PowerSGDOptions.Seed and the
// parameter's index, the same on every rank.
//
// Each synced step performs one half of a power iteration, alternating as the reference
// implementation (epfml/powersgd) does, so that a bucket costs one all-reduce per step:
//
//	even steps: Q̂ = orth(Q); M' = M + E; P_w = M'·Q̂; E = M' − P_w·Q̂ᵀ;
//	            P = Σ_w P_w (all-reduce); the result is P·Q̂ᵀ.
//	odd steps:  P̂ = orth(P); M' = M + E; Q_w = M'ᵀ·P̂; E = M' − P̂·Q_wᵀ;
//	            Q = Σ_w Q_w (all-reduce); the result is P̂·Qᵀ.
//
// The bucket holds M divided by the world size, so the sums are means. The factor that is
// orthonormalised (modified Gram-Schmidt in float64) is the previous step's all-reduced
// one, the same bits on every rank, so every rank computes the same result. The error is
// each rank's own residual, as in the paper's Algorithm 2: M' minus its local
// approximation, computed before the all-reduce. Its mean over the ranks is M̄' minus
// the result, so the sum over steps of the results plus the mean error is the sum over
// steps of the mean gradients: what is not sent now is sent later. (The reference keeps
// M' minus the all-reduced approximation instead; the ranks' errors differ, but their sum,
// the only thing the next all-reduce sees, is the same.) A column that
// orthonormalisation finds degenerate (a zero gradient, a matrix of lower rank than r) is
// replaced by a pseudo-random one drawn from the seed, the parameter and the step, the
// same on every rank, so that the factors never collapse to zero. Alternation has a cost:
// a P step's error enters the next Q factor, so a gradient of exactly rank r is approached
// over many steps rather than found in two.
//
// The message of a bucket is its uncompressed elements followed by each compressed
// matrix's P_w (even steps) or Q_w (odd steps), in the bucket's element type: one
// all-reduce, launched when the bucket is ready, overlapped with backward as every bucket
// is. Every parameter goes through the same synced steps, so a bucket's parameters agree
// on the step's parity. The message buffers are allocated at a bucket's first launch;
// after that a step allocates nothing. On device buckets the same steps run on the
// device, in float32 (Note [PowerSGD on the device]).

type powerSGD struct {
	o     PowerSGDOptions
	ready bool
	mats  []*psgdMat // by parameter; nil: reduced as it is
	lens  []int      // by parameter: its length in elements
	steps []int      // by parameter: the synced steps it has been through
	// With device buckets (Note [PowerSGD on the device]): the group's device operations
	// and the compute stream, on which all the hook's device work goes.
	dev    procgroup.DeviceBLAS
	stream procgroup.Stream
}

// psgdMat is one compressed parameter's state. On the host path p, q and e are the state;
// on the device path it is de, dp and dq, and p, q and e are the copies a checkpoint reads
// and writes (e allocated at the first).
type psgdMat struct {
	index, n, m, r int
	p, q           []float64 // n×r and m×r, column-major (column c of P is p[c·n:(c+1)·n])
	e              any       // []float32 or []float64, n×m row-major: the error feedback
	acc            []float64 // m×r, column-major: a Q step's sums (host path)
	de, dp, dq     procgroup.DeviceBuffer
}

func (h *powerSGD) Describe() string {
	return fmt.Sprintf("powersgd(rank %d, min_compression_rate %v, start_iter %d, seed %d)", h.o.Rank, h.o.MinCompressionRate, h.o.StartIter, h.o.Seed)
}

// Setup implements ShapedHook: it checks the options and allocates each compressed
// parameter's state.
func (h *powerSGD) Setup(s HookSetup) error {
	switch {
	case h.ready:
		return errors.New("already set up by another Reducer: give each DDP its own hook")
	case h.o.Rank < 1:
		return fmt.Errorf("Rank %d, want at least 1", h.o.Rank)
	case !(h.o.MinCompressionRate >= 1) || math.IsInf(h.o.MinCompressionRate, 0):
		return fmt.Errorf("MinCompressionRate %v, want at least 1 (and finite)", h.o.MinCompressionRate)
	case h.o.StartIter < 0:
		return fmt.Errorf("StartIter %d, want 0 or more", h.o.StartIter)
	}
	if s.Device {
		blas, ok := s.DeviceOps.(procgroup.DeviceBLAS)
		if !ok {
			return fmt.Errorf("device buckets (Options.Device) need device linear algebra (procgroup.DeviceBLAS: cuBLAS GEMM and orthonormalisation, as the nccl backend offers), which %T lacks: use host buckets or another hook", s.DeviceOps)
		}
		h.dev, h.stream = blas, s.Stream
	}
	h.mats = make([]*psgdMat, len(s.Params))
	h.lens = make([]int, len(s.Params))
	h.steps = make([]int, len(s.Params))
	r := h.o.Rank
	for i, p := range s.Params {
		n, m := 1, 1
		if len(p.Shape) > 0 {
			n = p.Shape[0]
			for _, d := range p.Shape[1:] {
				m *= d
			}
		}
		h.lens[i] = n * m
		if len(p.Shape) < 2 || float64(n+m)*float64(r)*h.o.MinCompressionRate >= float64(n)*float64(m) {
			continue // 1-D, or too small to gain: reduced as it is
		}
		mt := &psgdMat{index: i, n: n, m: m, r: r, p: make([]float64, n*r), q: make([]float64, m*r)}
		switch {
		case h.dev != nil && p.DType != procgroup.Float32:
			return fmt.Errorf("parameter %d (%s): element type %v; on device buckets PowerSGD compresses float32 matrices only (cuBLAS SGEMM)", i, p.Name, p.DType)
		case h.dev != nil: // the state is on the device: setupDevice
		case p.DType == procgroup.Float32:
			mt.e, mt.acc = make([]float32, n*m), make([]float64, m*r)
		case p.DType == procgroup.Float64:
			mt.e, mt.acc = make([]float64, n*m), make([]float64, m*r)
		default:
			return fmt.Errorf("parameter %d (%s): element type %v, want float32 or float64", i, p.Name, p.DType)
		}
		g := splitmix{h.o.Seed ^ 0x9e3779b97f4a7c15*uint64(i+1)}
		for k := range mt.q {
			mt.q[k] = g.uniform()
		}
		h.mats[i] = mt
	}
	if h.dev != nil {
		if err := h.setupDevice(); err != nil {
			h.ReleaseDevice()
			return err
		}
	}
	h.ready = true
	return nil
}

// Note [PowerSGD checkpoints]: a resumed job should go on as if it had not stopped. Of the
// hook's state, the steps and the factors P and Q are the same bits on every rank; the
// error E_w is each rank's own. The results depend on the errors only through their sum
// over the ranks: once the factor a step multiplies by is fixed (the previous step's
// all-reduced one, orthonormalised), the step is linear in M'_w = M_w/W + E_w, and the
// all-reduce sums. The invariant of Note [PowerSGD] is about that sum too: the results
// plus Σ_w E_w are the sum of the mean gradients. So a checkpoint keeps every rank's state
// (ddp/checkpoint's PerRank: Save gathers them into rank 0's file, in the one atomic write
// of the step). At the same world size each rank restores its own (UnmarshalBinary) and
// the run goes on bit for bit. At another world size W' each rank takes Σ_w E_w / W'
// (UnmarshalResized): the ranks' errors still sum to Σ_w E_w, so what the error feedback
// owes is neither lost nor counted twice; the run then differs from an uninterrupted one by
// rounding, and by whatever else the world size changes (a per-rank batch). One averaged
// error would have made the file smaller (it holds W errors, each the size of the
// compressed parameters), but no resume would be bit for bit. PyTorch's PowerSGDState is
// picklable (PR #79334), less its process group, and which rank's copy is saved and loaded
// is the user's choice; a rank 0 copy loaded on every rank gives each rank rank 0's error,
// which sums to W·E_0, not Σ_w E_w.

// psgdMagic starts the hook's saved state (version 1).
const psgdMagic = "goddp-powersgd-1"

// MarshalBinary returns the hook's state between two steps: a header (psgdMagic, the rank
// and the parameter count), then per parameter its step and, if compressed, its n and m,
// P, Q (float64) and error (the element type), little-endian.
func (h *powerSGD) MarshalBinary() ([]byte, error) { return h.AppendBinary(nil) }

// AppendBinary appends MarshalBinary's bytes to b (encoding.BinaryAppender): a copy after
// every step (ddp/elastic's commits) reuses its buffer.
func (h *powerSGD) AppendBinary(b []byte) ([]byte, error) {
	if !h.ready {
		return nil, errors.New("reducer: PowerSGD hook: no state before New")
	}
	if err := h.download(); err != nil {
		return nil, err
	}
	b = append(b, psgdMagic...)
	b = binary.LittleEndian.AppendUint64(b, uint64(h.o.Rank))
	b = binary.LittleEndian.AppendUint64(b, uint64(len(h.mats)))
	for i, mt := range h.mats {
		b = binary.LittleEndian.AppendUint64(b, uint64(h.steps[i]))
		if mt == nil {
			b = binary.LittleEndian.AppendUint64(b, 0)
			continue
		}
		b = binary.LittleEndian.AppendUint64(b, uint64(mt.n))
		b = binary.LittleEndian.AppendUint64(b, uint64(mt.m))
		for _, f := range [][]float64{mt.p, mt.q} {
			for _, v := range f {
				b = binary.LittleEndian.AppendUint64(b, math.Float64bits(v))
			}
		}
		switch e := mt.e.(type) {
		case []float32:
			for _, v := range e {
				b = binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
			}
		case []float64:
			for _, v := range e {
				b = binary.LittleEndian.AppendUint64(b, math.Float64bits(v))
			}
		}
	}
	return b, nil
}

// UnmarshalBinary restores a state from MarshalBinary into a hook set up (by New) with
// the same rank over the same parameters; it checks all of it before it changes anything.
func (h *powerSGD) UnmarshalBinary(data []byte) error {
	if !h.ready {
		return errors.New("reducer: PowerSGD hook: restore its state after New")
	}
	h.hostCopies()
	for pass := 0; pass < 2; pass++ { // check, then copy
		bad := func(format string, a ...any) error {
			return fmt.Errorf("reducer: PowerSGD hook: saved state: "+format, a...)
		}
		if len(data) < len(psgdMagic) || string(data[:len(psgdMagic)]) != psgdMagic {
			return bad("not a PowerSGD state (version 1)")
		}
		rd := &savedReader{data[len(psgdMagic):]}
		u64 := rd.u64
		r, ok1 := u64()
		np, ok2 := u64()
		switch {
		case !ok1 || !ok2:
			return bad("truncated")
		case r != uint64(h.o.Rank):
			return bad("rank %d, but this hook's is %d", r, h.o.Rank)
		case np != uint64(len(h.mats)):
			return bad("%d parameters, but this hook has %d", np, len(h.mats))
		}
		for i, mt := range h.mats {
			step, ok1 := u64()
			n, ok2 := u64()
			if !ok1 || !ok2 {
				return bad("truncated at parameter %d", i)
			}
			if mt == nil {
				if n != 0 {
					return bad("parameter %d is compressed, but not by this hook", i)
				}
				if pass == 1 {
					h.steps[i] = int(step)
				}
				continue
			}
			m, ok := u64()
			if !ok || n != uint64(mt.n) || m != uint64(mt.m) {
				return bad("parameter %d is a %d×%d matrix, but this hook's is %d×%d", i, n, m, mt.n, mt.m)
			}
			es := 8
			if _, f32 := mt.e.([]float32); f32 {
				es = 4
			}
			need := 8*(mt.n+mt.m)*mt.r + es*mt.n*mt.m
			if len(rd.d) < need {
				return bad("truncated at parameter %d", i)
			}
			if pass == 0 {
				rd.d = rd.d[need:]
				continue
			}
			h.steps[i] = int(step)
			for _, f := range [][]float64{mt.p, mt.q} {
				for k := range f {
					f[k] = math.Float64frombits(binary.LittleEndian.Uint64(rd.d))
					rd.d = rd.d[8:]
				}
			}
			switch e := mt.e.(type) {
			case []float32:
				for k := range e {
					e[k] = math.Float32frombits(binary.LittleEndian.Uint32(rd.d[4*k:]))
				}
			case []float64:
				for k := range e {
					e[k] = math.Float64frombits(binary.LittleEndian.Uint64(rd.d[8*k:]))
				}
			}
			rd.d = rd.d[es*mt.n*mt.m:]
		}
		if len(rd.d) != 0 {
			return bad("%d bytes after the last parameter", len(rd.d))
		}
	}
	return h.upload()
}

// UnmarshalResized restores this hook, rank of world, from the states (MarshalBinary's)
// that the ranks of a job of another world size saved after the same step, in rank order:
// the resume of a checkpoint at another world size (ddp/checkpoint's Resizer). The step
// and the factors P and Q, the same on every rank, are taken from the states, which must
// agree on them; the error of each rank becomes the sum of the saved errors divided by
// world, so that the ranks' errors still sum to what they summed to (Note [PowerSGD
// checkpoints]). It checks everything before it changes the hook.
func (h *powerSGD) UnmarshalResized(saved [][]byte, rank, world int) error {
	switch {
	case !h.ready:
		return errors.New("reducer: PowerSGD hook: restore its state after New")
	case len(saved) == 0:
		return errors.New("reducer: PowerSGD hook: no saved states to restore from")
	case world < 1 || rank < 0 || rank >= world:
		return fmt.Errorf("reducer: PowerSGD hook: rank %d of a world of %d", rank, world)
	}
	orig, err := h.MarshalBinary()
	if err != nil {
		return err
	}
	sums := make([][]float64, len(h.mats))
	var first *powerSGD
	for w, st := range saved {
		if err := h.UnmarshalBinary(st); err != nil {
			return errors.Join(fmt.Errorf("saved rank %d: %w", w, err), h.UnmarshalBinary(orig))
		}
		if first == nil {
			first = h.factors()
		} else if i := first.differs(h); i >= 0 {
			return errors.Join(fmt.Errorf("reducer: PowerSGD hook: the saved states of ranks 0 and %d disagree on parameter %d's step or factors, which every rank of a job shares: not the states of one job and step", w, i), h.UnmarshalBinary(orig))
		}
		for i, mt := range h.mats {
			if mt == nil {
				continue
			}
			if sums[i] == nil {
				sums[i] = make([]float64, mt.n*mt.m)
			}
			switch e := mt.e.(type) {
			case []float32:
				for k, v := range e {
					sums[i][k] += float64(v)
				}
			case []float64:
				for k, v := range e {
					sums[i][k] += v
				}
			}
		}
	}
	for i, mt := range h.mats {
		if mt == nil {
			continue
		}
		switch e := mt.e.(type) {
		case []float32:
			for k, v := range sums[i] {
				e[k] = float32(v / float64(world))
			}
		case []float64:
			for k, v := range sums[i] {
				e[k] = v / float64(world)
			}
		}
	}
	return h.upload()
}

// factors copies h's steps and factors (not its errors), for differs.
func (h *powerSGD) factors() *powerSGD {
	c := &powerSGD{steps: append([]int(nil), h.steps...), mats: make([]*psgdMat, len(h.mats))}
	for i, mt := range h.mats {
		if mt != nil {
			c.mats[i] = &psgdMat{p: append([]float64(nil), mt.p...), q: append([]float64(nil), mt.q...)}
		}
	}
	return c
}

// differs returns the first parameter whose step or factors differ, bit for bit, between
// the copy c and h; −1 if none.
func (c *powerSGD) differs(h *powerSGD) int {
	same := func(a, b []float64) bool {
		for k := range a {
			if math.Float64bits(a[k]) != math.Float64bits(b[k]) {
				return false
			}
		}
		return true
	}
	for i, mt := range h.mats {
		if c.steps[i] != h.steps[i] || (mt != nil && (!same(c.mats[i].p, mt.p) || !same(c.mats[i].q, mt.q))) {
			return i
		}
	}
	return -1
}

// psgdBucket is a bucket's message (BucketView.Scratch).
type psgdBucket[T float32 | float64] struct {
	msg       []T
	even, odd any  // msg cut to an even and an odd step's length, boxed once
	plain     bool // this step all-reduced the bucket as it is (StartIter)
	empty     bool // this step's message is empty: nothing was issued
}

func (h *powerSGD) Launch(ctx context.Context, pg procgroup.ProcessGroup, b *BucketView) procgroup.Work {
	if !h.ready {
		return procgroup.Completed(fmt.Errorf("%w: PowerSGD hook: bucket %d launched before Setup (the hook was not given to New)", ErrInvalidArgument, b.Index))
	}
	var msg any
	switch buf := b.Buffer.(type) {
	case procgroup.DeviceBuffer:
		return h.launchDevice(ctx, pg, b, buf)
	case []float32:
		msg = psgdCompress(h, b, buf)
	case []float64:
		msg = psgdCompress(h, b, buf)
	default:
		return procgroup.Completed(fmt.Errorf("%w: PowerSGD hook: bucket %d holds %T, want []float32 or []float64", ErrInvalidArgument, b.Index, b.Buffer))
	}
	if msg == nil { // zero-length parameters only: nothing to send (every rank agrees)
		return procgroup.Completed(nil)
	}
	return pg.AllReduce(ctx, msg, procgroup.Sum)
}

func (h *powerSGD) Finish(b *BucketView) error {
	switch buf := b.Buffer.(type) {
	case procgroup.DeviceBuffer:
		if err := h.finishDevice(b, buf); err != nil {
			return err
		}
	case []float32:
		psgdFinish(h, b, buf)
	case []float64:
		psgdFinish(h, b, buf)
	}
	for _, i := range b.Params {
		h.steps[i]++
	}
	return nil
}

// step returns the bucket's step count (its parameters agree on it).
func (h *powerSGD) step(b *BucketView) int {
	if len(b.Params) == 0 {
		return 0
	}
	return h.steps[b.Params[0]]
}

// msgLens are the lengths of bucket b's message on an even step (P) and an odd one (Q):
// its uncompressed parameters, then each compressed one's factor.
func (h *powerSGD) msgLens(b *BucketView) (even, odd int) {
	for _, i := range b.Params {
		if mt := h.mats[i]; mt != nil {
			even += mt.n * mt.r
			odd += mt.m * mt.r
		} else {
			even += h.lens[i]
			odd += h.lens[i]
		}
	}
	return even, odd
}

// eachPlain calls f for each uncompressed parameter of b, in the message's order, with
// its offset in the bucket (at), its offset in the message (off) and its length; it
// returns the uncompressed part's length, where the factors begin, or f's first error.
func (h *powerSGD) eachPlain(b *BucketView, f func(at, off, n int) error) (int, error) {
	off := 0
	for k, i := range b.Params {
		if h.mats[i] == nil {
			if err := f(b.Offsets[k], off, h.lens[i]); err != nil {
				return off, err
			}
			off += h.lens[i]
		}
	}
	return off, nil
}

// psgdScratch returns b's message, allocated at the layout's first launch.
func psgdScratch[T float32 | float64](h *powerSGD, b *BucketView) *psgdBucket[T] {
	if s, ok := b.Scratch.(*psgdBucket[T]); ok {
		return s
	}
	even, odd := h.msgLens(b)
	s := &psgdBucket[T]{msg: make([]T, max(even, odd))}
	s.even, s.odd = s.msg[:even], s.msg[:odd]
	b.Scratch = s
	return s
}

// psgdCompress is a launch's local part: it returns the message to all-reduce (b.Buffer
// itself before StartIter), or nil if there is nothing to send.
func psgdCompress[T float32 | float64](h *powerSGD, b *BucketView, buf []T) any {
	s := psgdScratch[T](h, b)
	step := h.step(b)
	s.plain = step < h.o.StartIter
	if s.plain {
		return b.Buffer
	}
	even := (step-h.o.StartIter)%2 == 0
	msg, boxed := s.msg, s.odd
	if even {
		boxed = s.even
	}
	off, _ := h.eachPlain(b, func(at, off, n int) error { // the uncompressed elements first
		copy(msg[off:off+n], buf[at:at+n])
		return nil
	})
	for k, i := range b.Params {
		mt := h.mats[i]
		if mt == nil {
			continue
		}
		at := b.Offsets[k]
		grad, e := buf[at:at+mt.n*mt.m], mt.e.([]T)
		if even {
			orthonormalize(mt.q, mt.m, mt.r, h.o.Seed, mt.index, step)
			off += leftStep(mt, grad, e, msg[off:off+mt.n*mt.r])
		} else {
			orthonormalize(mt.p, mt.n, mt.r, h.o.Seed, mt.index, step)
			off += rightStep(mt, grad, e, msg[off:off+mt.m*mt.r])
		}
	}
	s.empty = off == 0
	if s.empty {
		return nil
	}
	return boxed
}

func psgdFinish[T float32 | float64](h *powerSGD, b *BucketView, buf []T) {
	s, _ := b.Scratch.(*psgdBucket[T])
	if s == nil || s.plain || s.empty {
		return
	}
	even := (h.step(b)-h.o.StartIter)%2 == 0
	msg := s.msg
	off, _ := h.eachPlain(b, func(at, off, n int) error {
		copy(buf[at:at+n], msg[off:off+n])
		return nil
	})
	for k, i := range b.Params {
		mt := h.mats[i]
		if mt == nil {
			continue
		}
		at := b.Offsets[k]
		out := buf[at : at+mt.n*mt.m]
		n, m, r := mt.n, mt.m, mt.r
		if even { // P = the sum of the P_w; the result P·Q̂ᵀ
			for j := range mt.p {
				mt.p[j] = float64(msg[off+j])
			}
			off += n * r
		} else { // Q = the sum of the Q_w; the result P̂·Qᵀ
			for j := range mt.q {
				mt.q[j] = float64(msg[off+j])
			}
			off += m * r
		}
		reconstruct(out, mt.p, mt.q, n, m, r)
	}
}

// orthonormalize makes the r columns of a (rows×r, column-major) orthonormal, in place,
// by modified Gram-Schmidt. A column left with no length of its own (at most 1e-10 of its
// norm before the projections, or not finite) is replaced by a pseudo-random one drawn
// from seed, param, step and the column, and orthonormalised again: the same on every
// rank, as a is.
func orthonormalize(a []float64, rows, r int, seed uint64, param, step int) {
	for c := 0; c < r; c++ {
		col := a[c*rows : (c+1)*rows]
		for try := 0; ; try++ {
			before := math.Sqrt(dot(col, col))
			for k := 0; k < c; k++ {
				prev := a[k*rows : (k+1)*rows]
				axpy1(col, -dot(col, prev), prev)
			}
			norm := math.Sqrt(dot(col, col))
			if good := norm > 1e-10*before && norm > 0 && !math.IsInf(norm, 0); good || try == 3 {
				inv := 1 / norm
				if !good {
					inv = 0 // cannot happen with rows > r; never a NaN
				}
				for i := range col {
					col[i] *= inv
				}
				break
			}
			g := splitmix{seed ^ uint64(param+1)*0xbf58476d1ce4e5b9 ^ uint64(step+1)*0x94d049bb133111eb ^ uint64(c+1+try<<32)}
			for i := range col {
				col[i] = g.uniform()
			}
		}
	}
}

// splitmix is SplitMix64: a deterministic generator that allocates nothing.
type splitmix struct{ s uint64 }

func (g *splitmix) next() uint64 {
	g.s += 0x9e3779b97f4a7c15
	z := g.s
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// uniform is in [-1, 1).
func (g *splitmix) uniform() float64 { return float64(g.next()>>11)/(1<<52) - 1 }
