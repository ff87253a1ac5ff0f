package ddp

import (
	"fmt"

	"github.com/goddp/goddp/reducer"
)

// The reducer's names a trainer uses, so that it needs no other import than ddp.

// SyncMode says what a backward pass does with its gradients: Sync or Accumulate
// (BeginBackward; IterStats.Mode).
type SyncMode = reducer.Mode

const (
	// Sync: the pass's gradients, added to those of the Accumulate passes since the last
	// synced Finalize, are averaged across ranks by Finalize.
	Sync = reducer.Sync
	// Accumulate: PyTorch's no_sync. The pass's gradients only add up locally; nothing is
	// communicated.
	Accumulate = reducer.Accumulate
)

// IterStats are the measurements of one backward pass (DDP.Stats): when each gradient was
// reported, when each bucket was ready, launched and seen complete, and the communication
// and its overlap with backward (Comm, Overlap, Exposed). See reducer.IterStats.
type IterStats = reducer.IterStats

// AutoBucketCap, as Options.BucketCapMB, lets the DDP choose its bucket layout.
const AutoBucketCap = reducer.AutoBucketCap

// ShardsError is New's error for Options.Shards that the world size does not divide:
// Fit lists the world sizes that work.
type ShardsError = reducer.ShardsError

// AutoPlan is what the automatic bucket sizing measured and chose.
type AutoPlan = reducer.AutoPlan

// CommHook reduces the gradient buckets (Options.CommHook); BucketView is what it sees of
// one bucket. See reducer.CommHook.
//
// A CommHook's buckets hold the gradients already divided by the world size: a plain sum
// over the ranks is the average. PyTorch's hooks get them undivided and divide themselves
// (allreduce_hook divides, then all-reduces), so a hook ported as it is returns the
// average divided by the world size again. Such a hook either drops its division, or is a
// DividingHook whose DividesByWorldSize reports true: its buckets then hold each rank's
// gradients undivided, as in PyTorch, and it leaves the average itself.
type (
	CommHook   = reducer.CommHook
	BucketView = reducer.BucketView
	// DividingHook is a CommHook that may ask for its buckets undivided (see CommHook and
	// reducer.DividingHook).
	DividingHook = reducer.DividingHook
)

// AllReduceHook is the default CommHook: one all-reduce (sum) of each bucket.
func AllReduceHook() CommHook { return reducer.AllReduceHook() }

// FP16CompressHook all-reduces each bucket in IEEE half precision: half the bytes on the
// wire, about 3 significant digits kept, and values beyond ±65504 overflow to infinity.
func FP16CompressHook() CommHook { return reducer.FP16CompressHook() }

// BF16CompressHook is FP16CompressHook with bfloat16: float32's range, about 2 significant
// digits.
func BF16CompressHook() CommHook { return reducer.BF16CompressHook() }

// PowerSGDOptions configure PowerSGDHook: Rank (PyTorch's matrix_approximation_rank),
// MinCompressionRate (min_compression_rate, default 2), StartIter (start_powerSGD_iter,
// default 0 here) and Seed. See reducer.PowerSGDOptions.
type PowerSGDOptions = reducer.PowerSGDOptions

// PowerSGDHook all-reduces low-rank approximations of the gradients, with error feedback
// and warm start (PowerSGD, Vogels et al. 2019; reducer Note [PowerSGD]): each parameter
// of shape (n, d1, …) is an n×(d1·…) matrix sent as a rank-r factor, alternately P (n×r)
// and Q (m×r), one all-reduce per bucket per step; 1-D parameters and matrices too small
// to gain go uncompressed in the same message. Its state (the errors, the factors, the
// step) lives with the hook, by parameter, across bucket rebuilds and NoSync windows: give
// each DDP its own hook. It is an encoding.BinaryMarshaler and BinaryUnmarshaler: each
// rank saves its own state with a checkpoint and restores it after New. Host buckets
// only, for now.
func PowerSGDHook(o PowerSGDOptions) CommHook { return reducer.PowerSGDHook(o) }

// AutoHookOptions configure AutoHook: the PowerSGD ranks it may choose (default 1, 2 and
// 4) and PowerSGD's other settings. See reducer.AutoHookOptions.
type AutoHookOptions = reducer.AutoHookOptions

// AutoHook chooses each bucket's hook from the step model, as Options.BucketCapMB =
// AutoBucketCap chooses the caps: the plain all-reduce, bf16, or PowerSGD at one of the
// ranks, wherever the model predicts a step at least 5% shorter than the plain
// all-reduce's (reducer Note [Auto hook]). It decides after three synced steps, measured
// as the automatic bucket sizing measures them (with caps of their own even where
// BucketCapMB is fixed, which the steps after the decision keep); AutoPlan says what it
// chose and why. On one host it keeps the plain all-reduce; over a slow link it
// compresses. Host buckets only; give each DDP its own.
func AutoHook(o AutoHookOptions) CommHook { return reducer.AutoHook(o) }

// CommHookNames are the names CommHookNamed knows, as a trainer's --comm_hook flag takes
// them (PyTorch's hook names, without _hook).
const CommHookNames = "none, fp16, bf16, powersgd, auto"

// CommHookNamed returns the CommHook a trainer's --comm_hook flag names: "none" (or "":
// AllReduceHook), "fp16", "bf16", "powersgd" (PowerSGDHook with ps; rank 1 where ps.Rank
// is 0), or "auto" (AutoHook with ps's settings, choosing between the ranks 2 and 4, or
// only ps.Rank where it is set). Another name is an error wrapping ErrInvalidArgument
// that lists the names.
func CommHookNamed(name string, ps PowerSGDOptions) (CommHook, error) {
	switch name {
	case "", "none":
		return AllReduceHook(), nil
	case "fp16":
		return FP16CompressHook(), nil
	case "bf16":
		return BF16CompressHook(), nil
	case "powersgd":
		if ps.Rank == 0 {
			ps.Rank = 1
		}
		return PowerSGDHook(ps), nil
	case "auto":
		o := AutoHookOptions{PowerSGD: ps}
		if ps.Rank != 0 {
			o.Ranks = []int{ps.Rank}
		}
		return AutoHook(o), nil
	}
	return nil, fmt.Errorf("%w: comm hook %q, want one of %s", ErrInvalidArgument, name, CommHookNames)
}

// DescribeHook is the line New compares across the ranks, which must all run the same hook
// with the same settings: "allreduce", "fp16", "bf16", "powersgd(rank 2, …)", or the Go
// type of a hook that does not describe itself (reducer.DescribedHook).
func DescribeHook(h CommHook) string { return reducer.DescribeHook(h) }

var (
	// ErrUnusedParameters is wrapped by *UnusedError: parameters got no gradient in a synced
	// pass without Options.FindUnusedParameters.
	ErrUnusedParameters = reducer.ErrUnusedParameters
	// ErrMarkedTwice: a parameter's gradient was reported twice in one backward pass.
	ErrMarkedTwice = reducer.ErrMarkedTwice
	// ErrNonFinite is wrapped by *NonFiniteError.
	ErrNonFinite = reducer.ErrNonFinite
)

// NonFiniteError is Finalize's error for a synced step whose averaged gradients hold a NaN
// or an infinity: the same on every rank, it names the step and, for each rank whose own
// gradient was not finite, the parameters (index and name); an overflow in the CommHook's
// compression is named without a rank. It does not fail the DDP. See
// reducer.NonFiniteError.
type (
	NonFiniteError = reducer.NonFiniteError
	NonFiniteGrad  = reducer.NonFiniteGrad
)

// UnusedError names the parameters that got no gradient in a synced pass run without
// Options.FindUnusedParameters (errors.Is(err, ErrUnusedParameters) holds).
type UnusedError = reducer.UnusedError
