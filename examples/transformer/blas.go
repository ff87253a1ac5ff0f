package main

import "github.com/goddp/goddp/fastblas"

// blasName names the BLAS gorgonia uses (package fastblas: OpenBLAS with -tags openblas).
var blasName = fastblas.Name

// blasWarning is the OpenBLAS build's advice when OpenBLAS picked slow kernels for this CPU.
var blasWarning = fastblas.Warning
