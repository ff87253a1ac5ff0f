//go:build openblas && cgo

package model

// With -tags openblas the benchmarks (and tests) run on OpenBLAS, as the trainer does.
import _ "github.com/goddp/goddp/examples/transformer/fastblas"
