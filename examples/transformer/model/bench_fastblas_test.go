package model

// The benchmarks (and tests) run on the BLAS the trainer uses: package sgemm by
// default, OpenBLAS with -tags openblas.
import _ "github.com/goddp/goddp/fastblas"
