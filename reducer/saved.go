package reducer

import "encoding/binary"

// savedReader reads the little-endian words of a hook's saved state (PowerSGDHook's and
// AutoHook's MarshalBinary), front to back.
type savedReader struct{ d []byte }

// u64 reads the next word; false if fewer than 8 bytes are left.
func (s *savedReader) u64() (uint64, bool) {
	if len(s.d) < 8 {
		return 0, false
	}
	v := binary.LittleEndian.Uint64(s.d)
	s.d = s.d[8:]
	return v, true
}
