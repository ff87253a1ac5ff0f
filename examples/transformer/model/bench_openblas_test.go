//go:build openblas && cgo

package model

import (
	"gonum.org/v1/netlib/blas/netlib"
	G "gorgonia.org/gorgonia"
)

// With -tags openblas the benchmarks (and tests) run on OpenBLAS, as the trainer
// does; link it with CGO_LDFLAGS=-lopenblas.
func init() { G.Use(netlib.Implementation{}) }
