//go:build openblas && cgo

package fastblas

/*
#cgo LDFLAGS: -lopenblas
void openblas_set_num_threads(int);
char* openblas_get_corename(void);
*/
import "C"

import (
	"os"

	"github.com/goddp/goddp/internal/openblascore"

	"gonum.org/v1/netlib/blas/netlib"
	"gorgonia.org/gorgonia"
)

// Name is the BLAS gorgonia uses in this build.
var Name = "openblas"

// With -tags openblas, gorgonia's matrix products (BatchedMatMul included) run on
// OpenBLAS through gonum's cgo bindings. One thread per rank, like ddp_bench.py's
// --threads 1, unless OPENBLAS_NUM_THREADS says otherwise. OpenBLAS reads that variable
// when the library loads, before main, hence the explicit call.
func init() {
	if os.Getenv("OPENBLAS_NUM_THREADS") == "" {
		os.Setenv("OPENBLAS_NUM_THREADS", "1")
		C.openblas_set_num_threads(1)
	}
	gorgonia.Use(netlib.Implementation{})
}

// Warning says, when OpenBLAS chose kernels without AVX2 on a CPU that has it (Debian's
// OpenBLAS 0.3.21 on a recent Xeon: Prescott), how to fix it; "" when its choice is right.
func Warning() string {
	core := C.GoString(C.openblas_get_corename())
	return openblascore.Advice(core, openblascore.Host(), os.Getenv("OPENBLAS_CORETYPE"))
}
