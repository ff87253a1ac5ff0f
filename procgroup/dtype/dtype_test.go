package dtype

import "testing"

// TestNames: every type's name parses back to it, its width is one of 2, 4, 8, and an
// unknown value is neither sized nor parsed.
func TestNames(t *testing.T) {
	for _, d := range All {
		got, err := Parse(d.String())
		if err != nil || got != d {
			t.Errorf("Parse(%q) = %v, %v; want %v", d.String(), got, err, d)
		}
		if s := d.Size(); s != 2 && s != 4 && s != 8 {
			t.Errorf("%v.Size() = %d", d, s)
		}
	}
	if s := DType(0).Size(); s != 0 {
		t.Errorf("DType(0).Size() = %d, want 0", s)
	}
	if _, err := Parse("complex64"); err == nil {
		t.Error("Parse(complex64) succeeded")
	}
}
