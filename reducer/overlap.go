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

// MemorySpan returns the memory buf occupies, [lo, hi) in bytes: a []float32's or
// []float64's in the process's memory, a procgroup.DeviceBuffer's in the device's. ok is
// false for an empty buffer (or another type), which shares memory with nothing. It is what
// New (and ddp.New, for Data too) compare to refuse tensors registered twice.
func MemorySpan(buf any) (lo, hi uintptr, ok bool) {
	var n int
	switch b := buf.(type) {
	case []float32:
		lo, n = uintptr(unsafe.Pointer(unsafe.SliceData(b))), len(b)*4
	case []float64:
		lo, n = uintptr(unsafe.Pointer(unsafe.SliceData(b))), len(b)*8
	case procgroup.DeviceBuffer:
		lo, n = uintptr(b.Ptr), b.Bytes()
	}
	if n <= 0 {
		return 0, 0, false
	}
	return lo, lo + uintptr(n), true
}

// spanOf is param's Grad as a span.
func spanOf(grad any, param int) (span, bool) {
	lo, hi, ok := MemorySpan(grad)
	return span{lo: lo, hi: hi, param: param}, ok
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
