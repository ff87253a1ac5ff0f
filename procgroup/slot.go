package procgroup

import "fmt"

// CheckSlot checks where an AllGather's or a ReduceScatter's two buffers lie, given by
// address and length in bytes: whole is the large one (AllGather's out, ReduceScatter's in),
// part the small one (len(whole)/Size() bytes). The two may be apart, or part may be rank's
// own slot of whole, which is the in-place layout. Any other overlap is ErrInvalidArgument:
// the result would depend on the order in which the backend reads one and writes the other,
// which differs between its paths.
func CheckSlot(whole uintptr, wholeLen int, part uintptr, partLen int, rank int) error {
	if wholeLen == 0 || partLen == 0 || part+uintptr(partLen) <= whole || whole+uintptr(wholeLen) <= part {
		return nil
	}
	at := whole + uintptr(rank*partLen)
	if part == at {
		return nil
	}
	return fmt.Errorf("%w: the buffers overlap, and the small one starts %d bytes into the large one "+
		"where in place it would start at rank %d's slot, %d bytes in", ErrInvalidArgument,
		int64(part)-int64(whole), rank, rank*partLen)
}
