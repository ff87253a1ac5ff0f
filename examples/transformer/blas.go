package main

import "github.com/goddp/goddp/examples/transformer/fastblas"

// blasName names the BLAS gorgonia uses (package fastblas: OpenBLAS with -tags openblas).
var blasName = fastblas.Name
