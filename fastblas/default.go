//go:build !(openblas && cgo)

package fastblas

import (
	"gorgonia.org/gorgonia"

	"github.com/goddp/goddp/fastblas/sgemm"
)

// Name is the BLAS gorgonia uses in this build.
var Name = "goddp sgemm (Go assembly, " + sgemm.Kernel() + " kernel; gonum for the rest)"

// The default build: gorgonia's matrix products run on package sgemm's Go-assembly
// SGEMM, one thread per rank; every other BLAS routine is gonum's.
func init() { gorgonia.Use(sgemm.Implementation{}) }

// Warning is for the OpenBLAS build's kernel choice; this build has none to warn about.
func Warning() string { return "" }
