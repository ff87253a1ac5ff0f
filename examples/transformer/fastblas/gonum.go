//go:build !(openblas && cgo)

package fastblas

// Name is the BLAS gorgonia uses in this build.
const Name = "gonum (pure Go)"

// Warning is for the OpenBLAS build's kernel choice; gonum has none to warn about.
func Warning() string { return "" }
