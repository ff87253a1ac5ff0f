package reducer

import (
	"fmt"

	"go.uber.org/zap"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/procgroup"
)

// Options configure a Reducer.
type Options struct {
	// BucketCapMB caps every bucket but the first, in MiB (default 25). AutoBucketCap lets
	// the reducer choose the layout from what it measures in the first synced passes
	// (Note [Auto buckets]); FirstBucketCapMB is then chosen too.
	BucketCapMB float64
	// FirstBucketCapMB caps the first bucket, in MiB (default 1), so that the first
	// all-reduce starts early in backward.
	FirstBucketCapMB float64
	// FindUnusedParameters: parameters that get no gradient in a synced backward are reduced
	// as zeros at Finalize (and listed in IterStats.Unused) instead of failing it.
	FindUnusedParameters bool
	// GradientAsBucketView: parameters' gradients live in the buckets (see GradView);
	// Finalize copies nothing back and Param.Grad is not used.
	GradientAsBucketView bool
	// CommHook reduces each bucket (default AllReduceHook). Its buckets hold the gradients
	// divided by the world size, unless it is a DividingHook that asks for them undivided.
	CommHook CommHook
	// Device: the gradients live in device memory (Note [Device buckets]). The group must
	// offer procgroup.Device (procgroup.FindDevice: the nccl backend, through any
	// wrappers); the buckets are allocated on the device, gradients are reported with
	// GradReadyDevice, and every Param.Grad is a procgroup.DeviceBuffer (or nil with
	// GradientAsBucketView).
	Device bool
	// Stream is the trainer's compute stream (with Device): the stream its backward
	// kernels produce the gradients on and its optimizer reads them from. The reducer
	// enqueues its copies there, and makes it wait for the buckets' all-reduces.
	Stream procgroup.Stream
	// Logger receives the rare log lines (layout, rebuild); nil means zap.NewNop().
	Logger *zap.Logger
	// Shards, if positive, cuts each step's global batch into that many logical shards and
	// makes the averaged gradient the same bits at every world size (Note [Shards]): the
	// world size must divide Shards (CheckShards), each rank runs its shards with
	// BeginShard instead of BeginBackward, and Finalize leaves the mean over the shards
	// of their gradients, summed in shard order. 0: no shards (the all-reduce of
	// CommHook). It takes the default CommHook, fixed bucket caps and host gradients,
	// without FindUnusedParameters.
	Shards int
	// NoFiniteCheck turns off the check for NaN and infinite gradients (Note [Non-finite
	// gradients]): a synced Finalize then never returns a *NonFiniteError, and a NaN in
	// one rank's gradient reaches every rank's average silently. The check is on host
	// gradients only; with Device there is none.
	NoFiniteCheck bool
	// PadBuckets, if above 1, pads each host bucket's buffer (BucketView.Buffer) with
	// zeros to a multiple of PadBuckets elements, so that a hook can reduce-scatter it
	// in equal blocks (package ddp's ZeRO stage 2 pads to the world size). The padding
	// stays zero: no gradient is copied there, and a sum of zeros is zero. Host buckets
	// only.
	PadBuckets int
	// Scattered says that the CommHook reduce-scatters each padded bucket in place
	// (package ddp's ZeRO stage 2, with PadBuckets the world size): afterwards only this
	// rank's block of each bucket holds the reduction, and the rest its own local values.
	// The check for non-finite gradients then reads that block alone, and every synced
	// Finalize exchanges the ranks' flags, since no rank sees every reduced value (Note
	// [Non-finite gradients]).
	Scattered bool
}

// WithDefaults returns o with its zero fields set to their defaults: BucketCapMB 25,
// FirstBucketCapMB 1 (bucket.DefaultCapBytes and DefaultFirstCapBytes), CommHook
// AllReduceHook, Logger zap.NewNop(). It is the one place those defaults are set (package
// ddp fills its Options from it).
func (o Options) WithDefaults() Options {
	if o.BucketCapMB == 0 {
		o.BucketCapMB = float64(bucket.DefaultCapBytes) / (1 << 20)
	}
	if o.FirstBucketCapMB == 0 {
		o.FirstBucketCapMB = float64(bucket.DefaultFirstCapBytes) / (1 << 20)
	}
	if o.CommHook == nil {
		o.CommHook = AllReduceHook()
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	return o
}

func (o *Options) validate() error {
	*o = o.WithDefaults()
	if !(o.BucketCapMB > 0 || o.BucketCapMB == AutoBucketCap) || !(o.FirstBucketCapMB > 0) {
		return fmt.Errorf("%w: bucket caps %v MiB and first %v MiB, want both positive (or the cap AutoBucketCap)", ErrInvalidArgument, o.BucketCapMB, o.FirstBucketCapMB)
	}
	if o.BucketCapMB == AutoBucketCap && o.Device {
		return fmt.Errorf("%w: AutoBucketCap is not available with Options.Device yet: give BucketCapMB", ErrInvalidArgument)
	}
	if o.PadBuckets < 0 || (o.PadBuckets > 1 && o.Device) {
		return fmt.Errorf("%w: PadBuckets %d, want 0 or positive, with host buckets", ErrInvalidArgument, o.PadBuckets)
	}
	if o.Shards < 0 {
		return fmt.Errorf("%w: Shards %d, want 0 (no shards) or positive", ErrInvalidArgument, o.Shards)
	}
	if o.Shards > 0 {
		var with string
		switch {
		case o.CommHook != AllReduceHook():
			with = "a CommHook (the shards are gathered and summed in shard order instead)"
		case o.BucketCapMB == AutoBucketCap:
			with = "AutoBucketCap (give BucketCapMB)"
		case o.Device:
			with = "Options.Device (not yet)"
		case o.FindUnusedParameters:
			with = "FindUnusedParameters (every shard's pass must report every parameter)"
		case o.PadBuckets > 1:
			with = "PadBuckets"
		}
		if with != "" {
			return fmt.Errorf("%w: Shards cannot be combined with %s", ErrInvalidArgument, with)
		}
	}
	return nil
}

func mib(mb float64) int64 {
	b := int64(mb * (1 << 20))
	if b < 1 {
		b = 1
	}
	return b
}
