//go:build !purego

package sgemm

import "golang.org/x/sys/cpu"

var (
	avx512Kernel = microKernel{name: "avx512 12x32", mr: 12, nr: 32, colA: avx512ColA[:], rowA: avx512RowA[:],
		copy32: copyPanel32AVX512, transpose16: transpose16AVX512}
	avx2Kernel = microKernel{name: "avx2 6x16", mr: 6, nr: 16, colA: avx2ColA[:], rowA: avx2RowA[:]}
)

// kernels lists the kernels this CPU can run, the one Sgemm uses last.
func kernels() []microKernel {
	ks := []microKernel{goKernel}
	if cpu.X86.HasAVX2 && cpu.X86.HasFMA {
		ks = append(ks, avx2Kernel)
	}
	if cpu.X86.HasAVX512F && cpu.X86.HasBMI2 { // transpose16AVX512 uses SHLX
		ks = append(ks, avx512Kernel)
	}
	return ks
}
