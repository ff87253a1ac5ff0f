package procgroup

import (
	"fmt"
	"math"

	"github.com/goddp/goddp/procgroup/dtype"
)

// DType is the element type of a collective's buffer (package dtype declares the types).
type DType = dtype.DType

// Element types. BFloat16 and Float16 are storage types: backends reduce them in float32.
const (
	Float32  = dtype.Float32
	Float64  = dtype.Float64
	Int32    = dtype.Int32
	Int64    = dtype.Int64
	BFloat16 = dtype.BFloat16
	Float16  = dtype.Float16
)

// DTypes lists every element type, in declaration order.
var DTypes = dtype.All

// ParseDType maps a name such as "float32" (or "fp32", "bf16", "half") to its DType.
func ParseDType(s string) (DType, error) {
	d, err := dtype.Parse(s)
	if err != nil {
		return 0, fmt.Errorf("procgroup: %w", err)
	}
	return d, nil
}

// BF16 is a bfloat16 value stored in its 16 raw bits.
type BF16 uint16

// F16 is an IEEE 754 half-precision value stored in its 16 raw bits.
type F16 uint16

// BF16FromFloat32 rounds f to the nearest bfloat16 (ties to even); NaN stays NaN.
func BF16FromFloat32(f float32) BF16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep it quiet and non-zero in the top half
		return BF16(b>>16 | 0x40)
	}
	b += 0x7fff + (b>>16)&1
	return BF16(b >> 16)
}

// Float32 widens b exactly.
func (b BF16) Float32() float32 { return math.Float32frombits(uint32(b) << 16) }

// F16FromFloat32 rounds f to the nearest half (ties to even), overflowing to ±Inf.
func F16FromFloat32(f float32) F16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	man := b & 0x7fffff
	switch {
	case exp == 0xff: // Inf or NaN
		if man != 0 {
			return F16(sign | 0x7e00)
		}
		return F16(sign | 0x7c00)
	case exp == 0 && man == 0:
		return F16(sign)
	}
	e := exp - 127 + 15
	if e >= 0x1f {
		return F16(sign | 0x7c00)
	}
	if e <= 0 { // subnormal half (or underflow to zero)
		if e < -10 {
			return F16(sign)
		}
		man |= 0x800000
		shift := uint32(14 - e)
		half := uint32(1) << (shift - 1)
		rest := man & (1<<shift - 1)
		h := man >> shift
		if rest > half || (rest == half && h&1 == 1) {
			h++
		}
		return F16(sign | uint16(h))
	}
	h := uint32(e)<<10 | man>>13
	rest := man & 0x1fff
	if rest > 0x1000 || (rest == 0x1000 && h&1 == 1) {
		h++ // may carry into the exponent, which is the correct rounding (up to Inf)
	}
	return F16(sign | uint16(h))
}

// Float32 widens h exactly.
func (h F16) Float32() float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	man := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	case exp == 0:
		if man == 0 {
			return math.Float32frombits(sign)
		}
		// subnormal: value = man * 2^-24
		f := float32(man) * (1.0 / (1 << 24))
		if sign != 0 {
			f = -f
		}
		return f
	}
	return math.Float32frombits(sign | (exp+127-15)<<23 | man<<13)
}

// DTypeOf reports the element type and length of a host buffer: a []float32, []float64,
// []int32, []int64, []BF16 or []F16. Backends may accept further buffer types of their own
// (device memory, say) that implement Buffer.
func DTypeOf(buf any) (DType, int, error) {
	switch b := buf.(type) {
	case []float32:
		return Float32, len(b), nil
	case []float64:
		return Float64, len(b), nil
	case []int32:
		return Int32, len(b), nil
	case []int64:
		return Int64, len(b), nil
	case []BF16:
		return BFloat16, len(b), nil
	case []F16:
		return Float16, len(b), nil
	case Buffer:
		return b.DType(), b.Len(), nil
	case nil:
		return 0, 0, fmt.Errorf("%w: nil buffer", ErrInvalidArgument)
	}
	return 0, 0, fmt.Errorf("%w: unsupported buffer type %T", ErrInvalidArgument, buf)
}

// Buffer is a backend-specific buffer (for instance device memory) that a backend may accept
// in place of a host slice. Backends that do not know the concrete type fail the Work with
// ErrInvalidArgument.
type Buffer interface {
	DType() DType
	Len() int
}

// ReduceOp is the reduction of AllReduce and ReduceScatter.
type ReduceOp int

// Reduction operations. Avg divides the sum by the world size (integers: truncating).
const (
	Sum ReduceOp = iota + 1
	Avg
	Min
	Max
	Prod
)

// ReduceOps lists every reduction, in declaration order.
var ReduceOps = []ReduceOp{Sum, Avg, Min, Max, Prod}

func (o ReduceOp) String() string {
	switch o {
	case Sum:
		return "sum"
	case Avg:
		return "avg"
	case Min:
		return "min"
	case Max:
		return "max"
	case Prod:
		return "prod"
	}
	return fmt.Sprintf("ReduceOp(%d)", int(o))
}

// ParseReduceOp maps "sum", "avg", "min", "max" or "prod" to its ReduceOp.
func ParseReduceOp(s string) (ReduceOp, error) {
	for _, o := range ReduceOps {
		if o.String() == s {
			return o, nil
		}
	}
	return 0, fmt.Errorf("procgroup: unknown reduce op %q (want sum, avg, min, max or prod)", s)
}

// NewBuffer returns a zeroed host buffer of n elements of type dt (the slice type DTypeOf
// maps back to dt). It panics on an unknown dt, a programmer error.
func NewBuffer(dt DType, n int) any {
	switch dt {
	case Float32:
		return make([]float32, n)
	case Float64:
		return make([]float64, n)
	case Int32:
		return make([]int32, n)
	case Int64:
		return make([]int64, n)
	case BFloat16:
		return make([]BF16, n)
	case Float16:
		return make([]F16, n)
	}
	panic(fmt.Sprintf("procgroup: NewBuffer of unknown %v", dt))
}

// SliceBuffer returns buf[lo:hi:hi] for a host buffer of any type NewBuffer makes (for the
// in-place AllGather and ReduceScatter, whose small buffer is a slice of the large one); its
// capacity ends at hi, so an append cannot write over the rest of buf. It panics on another
// type, a programmer error.
func SliceBuffer(buf any, lo, hi int) any {
	switch b := buf.(type) {
	case []float32:
		return b[lo:hi:hi]
	case []float64:
		return b[lo:hi:hi]
	case []int32:
		return b[lo:hi:hi]
	case []int64:
		return b[lo:hi:hi]
	case []BF16:
		return b[lo:hi:hi]
	case []F16:
		return b[lo:hi:hi]
	}
	panic(fmt.Sprintf("procgroup: SliceBuffer of %T", buf))
}
