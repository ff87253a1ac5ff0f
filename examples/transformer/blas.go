package main

// blasName names the BLAS gorgonia uses: the pure-Go gonum one unless a build tag
// swaps it (blas_openblas.go).
var blasName = "gonum (pure Go)"
