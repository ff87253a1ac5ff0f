//go:build !amd64 || purego

package kernels

var useAVX2 = false

func addF32(d, s []float32) int { return 0 }
func addF64(d, s []float64) int { return 0 }

func addF32To(d, a, b []float32) int { return 0 }
func addF64To(d, a, b []float64) int { return 0 }
