//go:build !amd64 || purego

package lowrank

func dot2F32(x []float32, y0, y1 []float64, s0, s1 *[8]float64) int             { return 0 }
func axpy2F32[Y Float](x []float32, a0 float64, y0 []Y, a1 float64, y1 []Y) int { return 0 }
func axpyTo2F32(s0 []float64, a0 float64, s1 []float64, a1 float64, x []float32) int {
	return 0
}

var useAVX2 = false
