// Package fastblas picks the BLAS behind gorgonia's matrix products: OpenBLAS (Debian's
// libopenblas-dev) when built with -tags openblas, gorgonia's pure-Go gonum BLAS otherwise.
// Importing it is enough; Name says which one is in use.
//
// # Usage
//
//	import "github.com/goddp/goddp/examples/transformer/fastblas"
//
//	fmt.Println("blas:", fastblas.Name)
package fastblas
