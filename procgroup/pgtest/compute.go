package pgtest

import "github.com/goddp/goddp/procgroup"

// run computes the collective rec once every rank's op has arrived (ops is indexed by rank,
// all of them matching rec). Results are computed into fresh memory before any rank's output
// is written, so an input that aliases an output (an in-place AllGather, say) is safe.
func run(rec Record, ops []*op) {
	switch rec.Op {
	case procgroup.OpBarrier:
	case procgroup.OpBroadcast:
		switch rec.DType {
		case procgroup.Float32:
			broadcast[float32](ops, rec.Root)
		case procgroup.Float64:
			broadcast[float64](ops, rec.Root)
		case procgroup.Int32:
			broadcast[int32](ops, rec.Root)
		case procgroup.Int64:
			broadcast[int64](ops, rec.Root)
		case procgroup.BFloat16:
			broadcast[procgroup.BF16](ops, rec.Root)
		case procgroup.Float16:
			broadcast[procgroup.F16](ops, rec.Root)
		}
	case procgroup.OpAllGather:
		switch rec.DType {
		case procgroup.Float32:
			allGather[float32](ops)
		case procgroup.Float64:
			allGather[float64](ops)
		case procgroup.Int32:
			allGather[int32](ops)
		case procgroup.Int64:
			allGather[int64](ops)
		case procgroup.BFloat16:
			allGather[procgroup.BF16](ops)
		case procgroup.Float16:
			allGather[procgroup.F16](ops)
		}
	case procgroup.OpAllReduce, procgroup.OpReduceScatter:
		switch rec.DType {
		case procgroup.Float32:
			reduceNative[float32](rec, ops)
		case procgroup.Float64:
			reduceNative[float64](rec, ops)
		case procgroup.Int32:
			reduceNative[int32](rec, ops)
		case procgroup.Int64:
			reduceNative[int64](rec, ops)
		case procgroup.BFloat16:
			reduceHalf(rec, ops, procgroup.BF16.Float32, procgroup.BF16FromFloat32)
		case procgroup.Float16:
			reduceHalf(rec, ops, procgroup.F16.Float32, procgroup.F16FromFloat32)
		}
	}
}

func broadcast[T any](ops []*op, root int) {
	src := append([]T(nil), ops[root].in.([]T)...)
	for r, o := range ops {
		if r != root {
			copy(o.out.([]T), src)
		}
	}
}

func allGather[T any](ops []*op) {
	var all []T
	for _, o := range ops {
		all = append(all, o.in.([]T)...)
	}
	for _, o := range ops {
		copy(o.out.([]T), all)
	}
}

type number interface {
	~float32 | ~float64 | ~int32 | ~int64
}

// reduce combines ins element-wise into a new slice, in rank order, in T's own arithmetic
// (integers wrap; Avg divides the sum by the number of ranks, truncating for integers).
func reduce[T number](op procgroup.ReduceOp, ins [][]T) []T {
	res := append([]T(nil), ins[0]...)
	for _, in := range ins[1:] {
		switch op {
		case procgroup.Sum, procgroup.Avg:
			for i, v := range in {
				res[i] += v
			}
		case procgroup.Prod:
			for i, v := range in {
				res[i] *= v
			}
		case procgroup.Min:
			for i, v := range in {
				res[i] = min(res[i], v)
			}
		case procgroup.Max:
			for i, v := range in {
				res[i] = max(res[i], v)
			}
		}
	}
	if op == procgroup.Avg {
		n := T(len(ins))
		for i := range res {
			res[i] /= n
		}
	}
	return res
}

// scatter writes the reduced result res to every rank: all of it for AllReduce, rank r's
// block for ReduceScatter.
func scatter[T any](rec Record, ops []*op, res []T) {
	for r, o := range ops {
		out := o.out.([]T)
		if rec.Op == procgroup.OpReduceScatter {
			copy(out, res[r*len(out):(r+1)*len(out)])
		} else {
			copy(out, res)
		}
	}
}

func reduceNative[T number](rec Record, ops []*op) {
	ins := make([][]T, len(ops))
	for r, o := range ops {
		ins[r] = o.in.([]T)
	}
	scatter(rec, ops, reduce(rec.ReduceOp, ins))
}

// reduceHalf reduces 16-bit floats in float32 and rounds the result once.
func reduceHalf[H procgroup.BF16 | procgroup.F16](rec Record, ops []*op, widen func(H) float32, narrow func(float32) H) {
	ins := make([][]float32, len(ops))
	for r, o := range ops {
		in := o.in.([]H)
		ins[r] = make([]float32, len(in))
		for i, v := range in {
			ins[r][i] = widen(v)
		}
	}
	res32 := reduce(rec.ReduceOp, ins)
	res := make([]H, len(res32))
	for i, v := range res32 {
		res[i] = narrow(v)
	}
	scatter(rec, ops, res)
}
