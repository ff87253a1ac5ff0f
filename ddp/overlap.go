package ddp

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/goddp/goddp/reducer"
)

// span is the memory of one parameter's Data or Grad, [lo, hi) in bytes: a host slice's in
// the process's memory, a procgroup.DeviceBuffer's in the device's.
type span struct {
	lo, hi uintptr
	param  int
	grad   bool // Grad, not Data
}

func (s span) what() string {
	if s.grad {
		return "Grad"
	}
	return "Data"
}

// spanOf is param's Data (or, with grad, its Grad) as a span (reducer.MemorySpan).
func spanOf(buf any, param int, grad bool) (span, bool) {
	lo, hi, ok := reducer.MemorySpan(buf)
	return span{lo: lo, hi: hi, param: param, grad: grad}, ok
}

// checkOverlap refuses parameters whose Data or Grad share memory, with each other or
// across (one parameter's Data with its own Grad, too). A tensor registered twice (a tied
// weight) would get two gradients averaged apart, each copied back over the other (one
// contribution lost, in silence), and an optimizer would step it twice; a Grad on a Data
// would have Finalize write gradients over the values. Sorting the spans by address makes
// it O(n log n), once at New.
func checkOverlap(params []Param) error {
	ss := make([]span, 0, 2*len(params))
	for i, p := range params {
		if s, ok := spanOf(p.Data, i, false); ok {
			ss = append(ss, s)
		}
		if s, ok := spanOf(p.Grad, i, true); ok {
			ss = append(ss, s)
		}
	}
	slices.SortFunc(ss, func(x, y span) int {
		return cmp.Or(cmp.Compare(x.lo, y.lo), cmp.Compare(x.param, y.param))
	})
	// Spans before k are disjoint and sorted, so ss[k-1] reaches furthest among them.
	for k := 1; k < len(ss); k++ {
		if ss[k].lo >= ss[k-1].hi {
			continue
		}
		a, b := ss[k-1], ss[k]
		if b.param < a.param || (a.param == b.param && a.grad) {
			a, b = b, a
		}
		la := descLabel(params, a.param)
		if a.param == b.param {
			return fmt.Errorf("%w: %s: its Data and Grad share memory; Grad must be a buffer of its own", ErrInvalidArgument, la)
		}
		return fmt.Errorf("%w: %s's %s and %s's %s share memory; a tensor used twice (a tied weight) must be one Param, its gradient summed and reported once",
			ErrInvalidArgument, la, a.what(), descLabel(params, b.param), b.what())
	}
	return nil
}

func descLabel(params []Param, i int) string {
	return desc{kind: kindParam, index: i, name: params[i].Name}.label()
}
