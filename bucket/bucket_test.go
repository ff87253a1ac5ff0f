package bucket

import (
	"errors"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/goddp/goddp/procgroup/dtype"
)

func f32(name string, n int) Param { return Param{Name: name, DType: dtype.Float32, Len: n} }

func TestAssignTable(t *testing.T) {
	type want struct {
		params [][]int
		lens   []int
	}
	tests := []struct {
		name       string
		params     []Param
		first, cap int64
		want       want
	}{
		{
			name:   "one bucket holds everything",
			params: []Param{f32("a", 2), f32("b", 3), f32("c", 4)},
			first:  1 << 20, cap: 1 << 20,
			want: want{params: [][]int{{2, 1, 0}}, lens: []int{9}},
		},
		{
			name:   "first cap small, then big",
			params: []Param{f32("a", 4), f32("b", 4), f32("c", 4), f32("d", 4)},
			first:  16, cap: 32, // 16 bytes = one parameter; 32 = two
			want: want{params: [][]int{{3}, {2, 1}, {0}}, lens: []int{4, 8, 4}},
		},
		{
			name:   "exact fit stays together",
			params: []Param{f32("a", 2), f32("b", 2)},
			first:  16, cap: 16,
			want: want{params: [][]int{{1, 0}}, lens: []int{4}},
		},
		{
			name:   "the parameter that crosses the cap closes the bucket (PyTorch's rule)",
			params: []Param{f32("a", 1), f32("big", 100), f32("c", 1)},
			first:  8, cap: 8,
			want: want{params: [][]int{{2, 1}, {0}}, lens: []int{101, 1}},
		},
		{
			name:   "small parameters join the large one after them",
			params: []Param{f32("w1", 100), f32("b1", 1), f32("w2", 100), f32("b2", 1), f32("n", 1)},
			first:  16, cap: 8,
			want: want{params: [][]int{{4, 3, 2}, {1, 0}}, lens: []int{102, 101}},
		},
		{
			name: "dtypes never mix; buckets ordered by first parameter",
			params: []Param{
				{Name: "a", DType: dtype.Float64, Len: 1}, f32("b", 1),
				{Name: "c", DType: dtype.Float64, Len: 1}, f32("d", 1),
			},
			first: 1 << 10, cap: 1 << 10,
			want: want{params: [][]int{{3, 1}, {2, 0}}, lens: []int{2, 2}},
		},
		{
			name:   "no parameters",
			params: nil,
			first:  1, cap: 1,
			want: want{params: [][]int{}, lens: []int{}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bs, err := Assign(tt.params, tt.first, tt.cap)
			if err != nil {
				t.Fatal(err)
			}
			got := want{params: [][]int{}, lens: []int{}}
			for i, b := range bs {
				if b.Index != i {
					t.Errorf("bucket %d has index %d", i, b.Index)
				}
				got.params = append(got.params, b.Params)
				got.lens = append(got.lens, b.Len)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
			if _, err := NewLayout(tt.params, bs); err != nil {
				t.Errorf("NewLayout: %v", err)
			}
		})
	}
}

func TestAssignErrors(t *testing.T) {
	ok := []Param{f32("a", 1), f32("b", 1)}
	tests := []struct {
		name       string
		params     []Param
		order      []int
		first, cap int64
		want       string
	}{
		{"zero cap", ok, []int{0, 1}, 0, 1, "bucket: invalid argument: caps 0 and 1 bytes, want both positive"},
		{"unknown dtype", []Param{{Name: "x", Len: 1}}, []int{0}, 1, 1, "bucket: invalid argument: parameter 0 (x): unknown element type DType(0)"},
		{"negative length", []Param{f32("x", -1)}, []int{0}, 1, 1, "bucket: invalid argument: parameter 0 (x): negative length -1"},
		{"short order", ok, []int{0}, 1, 1, "bucket: invalid argument: order has 1 entries for 2 parameters"},
		{"out of range", ok, []int{0, 2}, 1, 1, "bucket: invalid argument: order names parameter 2, outside [0, 2)"},
		{"twice", ok, []int{1, 1}, 1, 1, "bucket: invalid argument: order names parameter 1 (b) twice"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := AssignOrdered(tt.params, tt.order, tt.first, tt.cap)
			if err == nil || err.Error() != tt.want || !errors.Is(err, ErrInvalid) {
				t.Fatalf("err = %v, want %q wrapping ErrInvalid", err, tt.want)
			}
		})
	}
}

func TestNewLayoutRejects(t *testing.T) {
	params := []Param{f32("a", 2), f32("b", 3)}
	good, err := Assign(params, 1<<10, 1<<10)
	if err != nil {
		t.Fatal(err)
	}
	clone := func() []Bucket {
		b := good[0]
		b.Params = append([]int(nil), b.Params...)
		b.Offsets = append([]int(nil), b.Offsets...)
		return []Bucket{b}
	}
	bad := map[string]func([]Bucket) []Bucket{
		"missing": func(b []Bucket) []Bucket {
			b[0].Params, b[0].Offsets, b[0].Len = b[0].Params[:1], b[0].Offsets[:1], 3
			return b
		},
		"twice":    func(b []Bucket) []Bucket { b[0].Params[1] = b[0].Params[0]; return b },
		"offset":   func(b []Bucket) []Bucket { b[0].Offsets[1]++; return b },
		"length":   func(b []Bucket) []Bucket { b[0].Len++; return b },
		"dtype":    func(b []Bucket) []Bucket { b[0].DType = dtype.Float64; return b },
		"index":    func(b []Bucket) []Bucket { b[0].Index = 3; return b },
		"range":    func(b []Bucket) []Bucket { b[0].Params[0] = 7; return b },
		"no slots": func(b []Bucket) []Bucket { b[0].Params, b[0].Offsets = nil, nil; return b },
	}
	for name, f := range bad {
		if _, err := NewLayout(params, f(clone())); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: err = %v, want ErrInvalid", name, err)
		}
	}
}

func TestViewIsTheSlot(t *testing.T) {
	params := []Param{f32("a", 2), f32("b", 3), f32("c", 1)}
	bs, _ := Assign(params, 1<<10, 1<<10)
	lay, err := NewLayout(params, bs)
	if err != nil {
		t.Fatal(err)
	}
	flat := Alloc[float32](bs[0])
	for i := range params {
		v := View(flat, lay.Where[i])
		if len(v) != params[i].Len || cap(v) != len(v) {
			t.Fatalf("param %d: len %d cap %d, want %d", i, len(v), cap(v), params[i].Len)
		}
		for k := range v {
			v[k] = float32(i*10 + k)
		}
	}
	// reverse order: c at 0, b at 1..3, a at 4..5
	want := []float32{20, 10, 11, 12, 0, 1}
	if !reflect.DeepEqual(flat, want) {
		t.Fatalf("flat = %v, want %v", flat, want)
	}
}

// checkAssignment verifies the invariants of any assignment: every parameter in exactly one
// bucket, homogeneous buckets, caps respected unless a bucket holds a single parameter, the
// order kept inside and across buckets, and a bucket closed only when the next parameter of
// its kind did not fit.
func checkAssignment(t *testing.T, params []Param, order []int, first, capb int64, bs []Bucket) {
	t.Helper()
	if _, err := NewLayout(params, bs); err != nil {
		t.Fatal(err)
	}
	pos := make([]int, len(params))
	for k, i := range order {
		pos[i] = k
	}
	// PyTorch's rule: a bucket is closed by the parameter that takes it to its cap or
	// beyond, so without its last parameter every bucket is below its cap, and every bucket
	// but the last of its element type reached it.
	count := map[dtype.DType]int{}
	for bi := range bs {
		count[bs[bi].DType]++
	}
	seen := map[dtype.DType]int{}
	lastFirst := -1
	for bi := range bs {
		b := &bs[bi]
		k := b.DType
		limit := capb
		if seen[k] == 0 {
			limit = first
		}
		seen[k]++
		last := params[b.Params[len(b.Params)-1]].Bytes()
		if b.Bytes()-last >= limit {
			t.Fatalf("bucket %d: %d bytes before its last parameter, at or over cap %d", bi, b.Bytes()-last, limit)
		}
		if seen[k] < count[k] && b.Bytes() < limit {
			t.Fatalf("bucket %d: closed at %d bytes, under cap %d, with more %v parameters to come", bi, b.Bytes(), limit, k)
		}
		if pos[b.Params[0]] <= lastFirst {
			t.Fatalf("bucket %d out of order", bi)
		}
		lastFirst = pos[b.Params[0]]
		for j := 1; j < len(b.Params); j++ {
			if pos[b.Params[j]] <= pos[b.Params[j-1]] {
				t.Fatalf("bucket %d: order not kept", bi)
			}
		}
	}
}

func randomParams(r *rand.Rand, n int) []Param {
	dts := []dtype.DType{dtype.Float32, dtype.Float64, dtype.BFloat16}
	ps := make([]Param, n)
	for i := range ps {
		ps[i] = Param{Name: "p", DType: dts[r.IntN(len(dts))], Len: r.IntN(64)}
	}
	return ps
}

func TestAssignRandom(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for it := 0; it < 500; it++ {
		params := randomParams(r, 1+r.IntN(40))
		order := r.Perm(len(params))
		first, capb := int64(1+r.IntN(300)), int64(1+r.IntN(600))
		bs, err := AssignOrdered(params, order, first, capb)
		if err != nil {
			t.Fatal(err)
		}
		checkAssignment(t, params, order, first, capb, bs)
	}
}

func FuzzAssign(f *testing.F) {
	f.Add([]byte{3, 4, 5, 1, 2, 200, 7}, uint16(16), uint16(32))
	f.Add([]byte{}, uint16(1), uint16(1))
	f.Fuzz(func(t *testing.T, spec []byte, first, capb uint16) {
		if len(spec) > 200 {
			spec = spec[:200]
		}
		params := make([]Param, len(spec))
		for i, b := range spec {
			params[i] = Param{DType: dtype.DType(1 + int(b)%6), Len: int(b >> 2)}
		}
		order := rand.New(rand.NewPCG(uint64(len(spec)), uint64(first))).Perm(len(params))
		bs, err := AssignOrdered(params, order, int64(first), int64(capb))
		if first == 0 || capb == 0 {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("zero cap accepted: %v", err)
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		checkAssignment(t, params, order, int64(first), int64(capb), bs)
	})
}
