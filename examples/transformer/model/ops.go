package model

import (
	"fmt"
	"hash"
	"hash/fnv"
	"sync/atomic"

	"github.com/chewxy/hm"
	"gonum.org/v1/gonum/blas"
	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"
)

// Note [Fused ops]: the layers are built from a handful of custom gorgonia Ops (this
// file and fused.go) rather than from gorgonia's primitives, which clone, transpose,
// broadcast-repeat and allocate on every element-wise step (together about twice the
// time of the matrix products at the seed shape). Each fused op
//
//   - runs typed loops over []float32 or []float64 (kernels.go), with the big
//     products on the BLAS gorgonia uses (gorgonia.Use / WhichBLAS: in the trainer,
//     package fastblas's Go-assembly SGEMM, or OpenBLAS with -tags openblas);
//   - owns its output tensor and returns the same one every run. The tape machine's
//     Reset drops its registers, so gorgonia's own ops allocate every value anew each
//     run; ours do not. Reusing is safe because gorgonia only overwrites a value (in
//     place, through another op's prealloc or unsafe path) once its node is dead for
//     the run, and every op rewrites its whole output when it runs;
//   - keeps what its backward needs beyond its inputs (softmax probabilities,
//     LayerNorm's normalised input and inverse deviations) in private buffers that are
//     never handed to gorgonia, and gives the backward ops a pointer to them. The
//     backward ops read them after the forward op has run (their gradient input
//     depends on its output) and before the next run's forward;
//   - has a hash unique to its instance: gorgonia merges nodes whose op hashes and
//     children are equal, and two of our ops with equal inputs (a LayerNorm's
//     gamma-gradient and beta-gradient read the same dy) must stay distinct.
//
// Forward tensors a backward op needs (a linear layer's input, attention's qkv) are
// passed to it as inputs, so gorgonia's liveness analysis keeps them intact.

var opIDs atomic.Uint64

// opBase holds what every fused op shares: its name, instance id, dtype, the number
// of dimensions of each input, its output shape and which inputs it differentiates.
type opBase struct {
	name string
	id   uint64
	dt   tensor.Dtype
	in   []int // dims of each input
	out  tensor.Shape
	diff []bool // DiffWRT; nil for backward ops

	val *tensor.Dense // owned output, allocated on first run
}

func newBase(name string, dt tensor.Dtype, out tensor.Shape, in ...*G.Node) opBase {
	dims := make([]int, len(in))
	for i, n := range in {
		dims[i] = n.Dims()
	}
	return opBase{name: name, id: opIDs.Add(1), dt: dt, in: dims, out: out.Clone()}
}

func (o *opBase) Arity() int { return len(o.in) }

func (o *opBase) Type() hm.Type {
	ts := make([]hm.Type, 0, len(o.in)+1)
	for _, d := range o.in {
		ts = append(ts, G.TensorType{Dims: d, Of: o.dt})
	}
	ts = append(ts, G.TensorType{Dims: len(o.out), Of: o.dt})
	return hm.NewFnType(ts...)
}

func (o *opBase) InferShape(...G.DimSizer) (tensor.Shape, error) { return o.out.Clone(), nil }
func (o *opBase) ReturnsPtr() bool                               { return false }
func (o *opBase) CallsExtern() bool                              { return false }
func (o *opBase) OverwritesInput() int                           { return -1 }
func (o *opBase) WriteHash(h hash.Hash)                          { fmt.Fprintf(h, "goddp.%s#%d", o.name, o.id) }
func (o *opBase) String() string                                 { return o.name }

func (o *opBase) Hashcode() uint32 {
	h := fnv.New32a()
	o.WriteHash(h)
	return h.Sum32()
}

func (o *opBase) DiffWRT(n int) []bool {
	if len(o.diff) == n {
		return o.diff
	}
	return make([]bool, n)
}

// output returns the op's own output tensor with its shape restored (a later
// gorgonia op may have reshaped it in place after it died last run).
func (o *opBase) output() *tensor.Dense {
	if o.val == nil {
		o.val = tensor.New(tensor.Of(o.dt), tensor.WithShape(o.out.Clone()...))
	} else if !o.val.Shape().Eq(o.out) {
		_ = o.val.Reshape(o.out.Clone()...) // same element count: cannot fail
	}
	return o.val
}

// inputs checks the arity and returns the backing slices of vs, each of which must be
// a dense tensor of type T with the element count of want (-1: any).
func inputs[T float32 | float64](name string, vs []G.Value, want ...int) ([][]T, error) {
	if len(vs) != len(want) {
		return nil, fmt.Errorf("model: %s: %d inputs, want %d", name, len(vs), len(want))
	}
	out := make([][]T, len(vs))
	for i, v := range vs {
		d, ok := v.(*tensor.Dense)
		if !ok {
			return nil, fmt.Errorf("model: %s: input %d is %T, want *tensor.Dense", name, i, v)
		}
		s, ok := d.Data().([]T)
		if !ok {
			return nil, fmt.Errorf("model: %s: input %d is %v, want %T", name, i, d.Dtype(), s)
		}
		if (want[i] >= 0 && len(s) != want[i]) || d.IsMaterializable() || !d.DataOrder().IsRowMajor() {
			return nil, fmt.Errorf("model: %s: input %d has %d elements (shape %v), want %d", name, i, len(s), d.Shape(), want[i])
		}
		out[i] = s
	}
	return out, nil
}

func isF64(dt tensor.Dtype) bool { return dt == tensor.Float64 }

func trans(t bool) blas.Transpose {
	if t {
		return blas.Trans
	}
	return blas.NoTrans
}

// gemm is C = alpha·op(A)·op(B) + beta·C (row-major, op(X) = Xᵀ when tX), m×n result
// and inner dimension k, on the BLAS gorgonia is set to use.
func gemm[T float32 | float64](tA, tB bool, m, n, k int, alpha T, a []T, lda int, b []T, ldb int, beta T, c []T, ldc int) {
	impl := G.WhichBLAS()
	switch a := any(a).(type) {
	case []float32:
		impl.Sgemm(trans(tA), trans(tB), m, n, k, float32(alpha), a, lda, any(b).([]float32), ldb, float32(beta), any(c).([]float32), ldc)
	case []float64:
		impl.Dgemm(trans(tA), trans(tB), m, n, k, float64(alpha), a, lda, any(b).([]float64), ldb, float64(beta), any(c).([]float64), ldc)
	}
}

// gemv is y = alpha·op(A)·x + beta·y for A [m, n] row-major (op(A) = Aᵀ when tA), unit
// strides.
func gemv[T float32 | float64](tA bool, m, n int, alpha T, a []T, lda int, x []T, beta T, y []T) {
	impl := G.WhichBLAS()
	switch a := any(a).(type) {
	case []float32:
		impl.Sgemv(trans(tA), m, n, float32(alpha), a, lda, any(x).([]float32), 1, float32(beta), any(y).([]float32), 1)
	case []float64:
		impl.Dgemv(trans(tA), m, n, float64(alpha), a, lda, any(x).([]float64), 1, float64(beta), any(y).([]float64), 1)
	}
}
