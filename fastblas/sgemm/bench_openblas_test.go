//go:build openblas && cgo

package sgemm_test

import (
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/netlib/blas/netlib"

	// Its cgo preamble links -lopenblas, which netlib's bindings need.
	_ "github.com/goddp/goddp/fastblas"
)

func init() {
	benchImpls = append(benchImpls, struct {
		name string
		impl blas.Float32Level3
	}{"openblas", netlib.Implementation{}})
}
