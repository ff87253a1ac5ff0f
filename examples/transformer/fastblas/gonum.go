//go:build !(openblas && cgo)

package fastblas

// Name is the BLAS gorgonia uses in this build.
const Name = "gonum (pure Go)"
