package reducer

import (
	"cmp"
	"fmt"
	"slices"
	"unsafe"

	"github.com/goddp/goddp/procgroup"
)

// span is the memory parameter param's Grad occupies, [lo, hi) in bytes: a host slice's in
// the process's memory, a procgroup.DeviceBuffer's in the device's.
type span struct {
	lo, hi uintptr
	param  int
}

// spanOf returns the memory of grad, a []float32, []float64 or procgroup.DeviceBuffer;
// ok is false for an empty buffer, which shares memory with nothing.
func spanOf(grad any, param int) (s span, ok bool) {
	var lo uintptr
	var n int
	switch g := grad.(type) {
	case []float32:
		lo, n = uintptr(unsafe.Pointer(unsafe.SliceData(g))), len(g)*4
	case []float64:
		lo, n = uintptr(unsafe.Pointer(unsafe.SliceData(g))), len(g)*8
	case procgroup.DeviceBuffer:
		lo, n = uintptr(g.Ptr), g.Bytes()
	}
	if n <= 0 {
		return span{}, false
	}
	return span{lo: lo, hi: lo + uintptr(n), param: param}, true
}

// checkOverlap refuses parameters whose Grad share memory. Two Params on one tensor (a tied
// weight registered twice) would each have their gradient copied into a slot of its own and
// averaged there, and each copy back would overwrite the other's: one contribution lost, in
// silence. Sorting the spans by address makes it O(n log n), once at New.
func checkOverlap(params []Param) error {
	ss := make([]span, 0, len(params))
	for i, p := range params {
		if s, ok := spanOf(p.Grad, i); ok {
			ss = append(ss, s)
		}
	}
	slices.SortFunc(ss, func(x, y span) int { return cmp.Compare(x.lo, y.lo) })
	// Spans before k are disjoint and sorted, so ss[k-1] reaches furthest among them.
	for k := 1; k < len(ss); k++ {
		if ss[k].lo < ss[k-1].hi {
			i, j := min(ss[k-1].param, ss[k].param), max(ss[k-1].param, ss[k].param)
			return fmt.Errorf("%w: parameters %d (%s) and %d (%s): their Grad share memory; a tensor used twice (a tied weight) must be one Param, its gradient summed and reported once",
				ErrInvalidArgument, i, params[i].Name, j, params[j].Name)
		}
	}
	return nil
}
