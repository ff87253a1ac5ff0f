package reducer

import (
	"errors"
	"testing"

	"github.com/goddp/goddp/procgroup/pgtest"
)

// TestOverlappingGrads: New refuses two Params whose Grad share memory, naming both (a
// tied weight registered twice: with gradients 1 and 10 reported, its Grad used to end at
// 10, not 11); disjoint pieces of one buffer, and empty ones, are accepted.
func TestOverlappingGrads(t *testing.T) {
	c := pgtest.NewCluster(1)
	defer c.Close()
	buf := make([]float32, 32)
	f64 := make([]float64, 8)
	for _, tc := range []struct {
		name   string
		params []Param
		want   string
	}{
		{"tied", []Param{{Name: "embed", Grad: buf[:8]}, {Name: "x", Grad: buf[8:16]}, {Name: "head", Grad: buf[:8]}},
			"reducer: invalid argument: parameters 0 (embed) and 2 (head): their Grad share memory; a tensor used twice (a tied weight) must be one Param, its gradient summed and reported once"},
		{"partial", []Param{{Name: "a", Grad: buf[4:12]}, {Name: "b", Grad: buf[:5]}},
			"reducer: invalid argument: parameters 0 (a) and 1 (b): their Grad share memory; a tensor used twice (a tied weight) must be one Param, its gradient summed and reported once"},
		{"float64", []Param{{Name: "a", Grad: f64[:4]}, {Name: "b", Grad: f64[3:]}},
			"reducer: invalid argument: parameters 0 (a) and 1 (b): their Grad share memory; a tensor used twice (a tied weight) must be one Param, its gradient summed and reported once"},
	} {
		r, err := New(c.Group(0), tc.params, Options{})
		if err == nil {
			r.Close()
		}
		if err == nil || err.Error() != tc.want || !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s:\n got %v\nwant %s", tc.name, err, tc.want)
		}
	}
	r, err := New(c.Group(0), []Param{{Name: "a", Grad: buf[:8]}, {Name: "e", Grad: buf[8:8]}, {Name: "b", Grad: buf[8:16]}, {Name: "c", Grad: f64}}, Options{})
	if err != nil {
		t.Fatalf("disjoint pieces of one buffer: %v", err)
	}
	r.Close()
}
