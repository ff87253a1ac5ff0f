//go:build !amd64 || purego

package sgemm

// kernels lists the kernels this platform runs, the one Sgemm uses last.
func kernels() []microKernel { return []microKernel{goKernel} }
