// Package fastblas picks the BLAS behind gorgonia's matrix products: by default
// package sgemm's Go-assembly SGEMM (AVX-512 or AVX2 kernels, no cgo) with gonum for
// the other routines; OpenBLAS (Debian's libopenblas-dev) when built with -tags
// openblas. Importing it is enough; Name says which one is in use.
//
// # Usage
//
//	import "github.com/goddp/goddp/fastblas"
//
//	fmt.Println("blas:", fastblas.Name)
package fastblas
