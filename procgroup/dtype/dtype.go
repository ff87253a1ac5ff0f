// Package dtype names the element types of gradients and collective buffers. It is the
// one place a type is declared, with its width and its name: package procgroup
// re-exports it for collectives, and package bucket, which imports nothing outside the
// standard library but this, sizes its buckets with it.
//
// Adding a type: a constant here (and in All, Size, String and Parse), its alias in
// package procgroup, and its host slice in procgroup.DTypeOf and procgroup.NewBuffer.
package dtype

import "fmt"

// DType is an element type.
type DType int

// Element types. BFloat16 and Float16 are storage types: backends reduce them in float32.
const (
	Float32 DType = iota + 1
	Float64
	Int32
	Int64
	BFloat16
	Float16
)

// All lists every element type, in declaration order.
var All = []DType{Float32, Float64, Int32, Int64, BFloat16, Float16}

// Size is the width of one element in bytes, or 0 for an unknown type.
func (d DType) Size() int {
	switch d {
	case Float32, Int32:
		return 4
	case Float64, Int64:
		return 8
	case BFloat16, Float16:
		return 2
	}
	return 0
}

func (d DType) String() string {
	switch d {
	case Float32:
		return "float32"
	case Float64:
		return "float64"
	case Int32:
		return "int32"
	case Int64:
		return "int64"
	case BFloat16:
		return "bfloat16"
	case Float16:
		return "float16"
	}
	return fmt.Sprintf("DType(%d)", int(d))
}

// Parse maps a name such as "float32" (or "fp32", "bf16", "half") to its DType.
func Parse(s string) (DType, error) {
	switch s {
	case "float32", "float", "fp32", "f32":
		return Float32, nil
	case "float64", "double", "fp64", "f64":
		return Float64, nil
	case "int32", "int":
		return Int32, nil
	case "int64", "long":
		return Int64, nil
	case "bfloat16", "bf16":
		return BFloat16, nil
	case "float16", "half", "fp16", "f16":
		return Float16, nil
	}
	return 0, fmt.Errorf("unknown dtype %q (want float32, float64, int32, int64, bfloat16 or float16)", s)
}
