package bucket

import (
	"errors"
	"fmt"

	"github.com/goddp/goddp/procgroup/dtype"
)

// ErrInvalid is wrapped by every error about bad input to this package. It is its own, not
// procgroup's, as this package imports only the standard library (the reducer wraps it
// in reducer.ErrInvalidArgument).
var ErrInvalid = errors.New("bucket: invalid argument")

// Default caps, as in PyTorch DDP: 1 MiB for the first bucket, 25 MiB for the others.
const (
	DefaultFirstCapBytes int64 = 1 << 20
	DefaultCapBytes      int64 = 25 << 20
)

// Param describes one parameter's gradient: its element type and its number of elements.
type Param struct {
	Name  string
	DType dtype.DType
	Len   int
}

// Bytes is the size of the parameter's gradient in bytes.
func (p Param) Bytes() int64 { return int64(p.Len) * int64(p.DType.Size()) }

// Bucket is a group of parameters reduced together in one flat buffer.
type Bucket struct {
	// Index is the bucket's position in launch order.
	Index int
	// DType is shared by every parameter in the bucket.
	DType dtype.DType
	// Params lists the parameter indices in the bucket, in order; Offsets[j] is where
	// parameter Params[j] starts in the flat buffer (in elements).
	Params  []int
	Offsets []int
	// Len is the flat buffer's length in elements.
	Len int
}

// Bytes is the size of the bucket's flat buffer in bytes.
func (b *Bucket) Bytes() int64 { return int64(b.Len) * int64(b.DType.Size()) }

// Assign groups params into buckets in reverse registration order (Note [Bucket
// assignment]). It fails with an error wrapping ErrInvalid for an unknown element type, a
// negative length or a cap that is not positive.
func Assign(params []Param, firstCapBytes, capBytes int64) ([]Bucket, error) {
	order := make([]int, len(params))
	for i := range order {
		order[i] = len(params) - 1 - i
	}
	return AssignOrdered(params, order, firstCapBytes, capBytes)
}

// AssignOrdered is Assign with the parameters taken in the given order instead, for instance
// the order in which their gradients became ready in the first iteration. order must be a
// permutation of [0, len(params)).
func AssignOrdered(params []Param, order []int, firstCapBytes, capBytes int64) ([]Bucket, error) {
	if firstCapBytes <= 0 || capBytes <= 0 {
		return nil, fmt.Errorf("%w: caps %d and %d bytes, want both positive", ErrInvalid, firstCapBytes, capBytes)
	}
	if len(order) != len(params) {
		return nil, fmt.Errorf("%w: order has %d entries for %d parameters", ErrInvalid, len(order), len(params))
	}
	for i, p := range params {
		if p.DType.Size() == 0 {
			return nil, fmt.Errorf("%w: parameter %d (%s): unknown element type %v", ErrInvalid, i, p.Name, p.DType)
		}
		if p.Len < 0 {
			return nil, fmt.Errorf("%w: parameter %d (%s): negative length %d", ErrInvalid, i, p.Name, p.Len)
		}
	}
	seen := make([]bool, len(params))
	for _, i := range order {
		if i < 0 || i >= len(params) {
			return nil, fmt.Errorf("%w: order names parameter %d, outside [0, %d)", ErrInvalid, i, len(params))
		}
		if seen[i] {
			return nil, fmt.Errorf("%w: order names parameter %d (%s) twice", ErrInvalid, i, params[i].Name)
		}
		seen[i] = true
	}

	type open struct {
		b     *Bucket
		bytes int64
		cap   int64
	}
	var (
		all     []*Bucket // in order of creation = order of their first parameter
		current = map[dtype.DType]*open{}
	)
	for _, i := range order {
		p := params[i]
		o := current[p.DType]
		if o == nil {
			o = &open{cap: firstCapBytes}
			current[p.DType] = o
		}
		if o.b == nil {
			o.b = &Bucket{DType: p.DType}
			all = append(all, o.b)
		}
		o.b.Params = append(o.b.Params, i)
		o.b.Offsets = append(o.b.Offsets, o.b.Len)
		o.b.Len += p.Len
		o.bytes += p.Bytes()
		if o.bytes >= o.cap {
			o.b, o.bytes, o.cap = nil, 0, capBytes // close it; later buckets get the full cap
		}
	}
	out := make([]Bucket, len(all))
	for j, b := range all {
		b.Index = j
		out[j] = *b
	}
	return out, nil
}

// Loc is where one parameter's slot is: its bucket, its position among the bucket's
// parameters, and its offset and length in the bucket's flat buffer.
type Loc struct {
	Bucket int
	Slot   int
	Offset int
	Len    int
}

// Layout indexes buckets by parameter.
type Layout struct {
	Buckets []Bucket
	// Where[i] is parameter i's slot.
	Where []Loc
}

// NewLayout checks that buckets hold every parameter exactly once, with the parameter's
// element type and contiguous offsets, and indexes them.
func NewLayout(params []Param, buckets []Bucket) (*Layout, error) {
	where := make([]Loc, len(params))
	seen := make([]bool, len(params))
	for bi := range buckets {
		b := &buckets[bi]
		if b.Index != bi {
			return nil, fmt.Errorf("%w: bucket %d has index %d", ErrInvalid, bi, b.Index)
		}
		if len(b.Offsets) != len(b.Params) || len(b.Params) == 0 {
			return nil, fmt.Errorf("%w: bucket %d: %d parameters, %d offsets", ErrInvalid, bi, len(b.Params), len(b.Offsets))
		}
		off := 0
		for j, i := range b.Params {
			if i < 0 || i >= len(params) {
				return nil, fmt.Errorf("%w: bucket %d names parameter %d, outside [0, %d)", ErrInvalid, bi, i, len(params))
			}
			if seen[i] {
				return nil, fmt.Errorf("%w: parameter %d (%s) is in two buckets", ErrInvalid, i, params[i].Name)
			}
			seen[i] = true
			p := params[i]
			if p.DType != b.DType {
				return nil, fmt.Errorf("%w: parameter %d (%s, %v) in bucket %d of %v", ErrInvalid, i, p.Name, p.DType, bi, b.DType)
			}
			if b.Offsets[j] != off {
				return nil, fmt.Errorf("%w: bucket %d: parameter %d at offset %d, want %d", ErrInvalid, bi, i, b.Offsets[j], off)
			}
			where[i] = Loc{Bucket: bi, Slot: j, Offset: off, Len: p.Len}
			off += p.Len
		}
		if off != b.Len {
			return nil, fmt.Errorf("%w: bucket %d: length %d, parameters add up to %d", ErrInvalid, bi, b.Len, off)
		}
	}
	for i, ok := range seen {
		if !ok {
			return nil, fmt.Errorf("%w: parameter %d (%s) is in no bucket", ErrInvalid, i, params[i].Name)
		}
	}
	return &Layout{Buckets: buckets, Where: where}, nil
}

// Alloc returns a zeroed flat buffer for b.
func Alloc[T any](b Bucket) []T { return make([]T, b.Len) }

// View returns a parameter's slot in its bucket's flat buffer. Its capacity ends with the
// slot, so an append cannot spill into the next parameter's slot.
func View[T any](flat []T, loc Loc) []T {
	return flat[loc.Offset : loc.Offset+loc.Len : loc.Offset+loc.Len]
}
