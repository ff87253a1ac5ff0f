//go:build openblas && cgo

package sgemm

import (
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/netlib/blas/netlib"
)

func init() {
	benchImpls = append(benchImpls, struct {
		name string
		impl blas.Float32Level3
	}{"openblas", netlib.Implementation{}})
}
