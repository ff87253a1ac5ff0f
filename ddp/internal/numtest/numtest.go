// Package numtest holds the numeric helpers of the tests around ddp: package ddp's own
// tests, and ddptest's users. It imports nothing of goddp, so package ddp's tests can use it.
package numtest

import (
	"fmt"
	"math"
	"math/rand/v2"
)

// ToF64 widens v to float64.
func ToF64[T float32 | float64](v []T) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

// CloseTo reports the first index where got and want differ by more than tol·(1+|want|).
func CloseTo[T float32 | float64](got []T, want []float64, tol float64) error {
	if len(got) != len(want) {
		return fmt.Errorf("length %d, want %d", len(got), len(want))
	}
	for i := range want {
		if math.Abs(float64(got[i])-want[i]) > tol*(1+math.Abs(want[i])) {
			return fmt.Errorf("[%d] = %v, want %v", i, got[i], want[i])
		}
	}
	return nil
}

// RandF32 returns n normal deviates.
func RandF32(r *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.NormFloat64())
	}
	return v
}
