package reducer

import (
	"math"
	"slices"
	"time"

	"github.com/goddp/goddp/bucket/sim"
	"github.com/goddp/goddp/procgroup"
)

// measureElems bounds the matrix measureCompression times.
const measureElems = 1 << 20

// measureCompression times the hooks' kernels for Note [Auto hook]: PowerSGD at each of
// ranks on the largest parameter that rank 1 compresses (cut to whole rows, about
// measureElems elements but more rows than the highest rank), an even and an odd step's launch and finish, and bf16's casts of
// as many elements; each the least of two tries, per element. It allocates its matrix, the
// hook's state and the message for the time it takes.
func measureCompression(params []HookParam, ranks []int, rate float64) (*sim.Compression, error) {
	c := &sim.Compression{Shapes: make([][]int, len(params)), MinCompressionRate: rate}
	big, bigN, bigM := -1, 0, 0
	for i, p := range params {
		if len(p.Shape) >= 2 {
			c.Shapes[i] = p.Shape
			n, m := p.Shape[0], lenOf(p.Shape[1:])
			if float64(n+m)*rate < float64(n*m) && n*m > bigN*bigM {
				big, bigN, bigM = i, n, m
			}
		}
	}
	elems := measureElems
	dt := procgroup.Float32
	if big >= 0 {
		// About measureElems elements, but more rows than the highest rank: one row is
		// never compressed, and a few rows of a very wide matrix not at every rank.
		bigN = min(bigN, max(measureElems/bigM, slices.Max(ranks)+1))
		elems = bigN * bigM
		dt = params[big].DType
	}
	var buf any
	if dt == procgroup.Float64 {
		b := make([]float64, elems)
		for k := range b {
			b[k] = float64(k%7) - 3
		}
		buf = b
	} else {
		b := make([]float32, elems)
		for k := range b {
			b[k] = float32(k%7) - 3
		}
		buf = b
	}
	c.Cast16Pre, c.Cast16Post = timeCasts(buf)
	if big < 0 {
		return c, nil // nothing PowerSGD would compress
	}
	for _, r := range ranks {
		h := PowerSGDHook(PowerSGDOptions{Rank: r, MinCompressionRate: 1}).(*powerSGD)
		if err := h.Setup(HookSetup{Params: []HookParam{{Name: "measure", DType: dt, Shape: []int{bigN, bigM}}}, WorldSize: 1}); err != nil {
			return nil, err
		}
		if h.mats[0] == nil {
			continue // rank r does not compress a matrix this small
		}
		v := &BucketView{DType: dt, Buffer: buf, Params: []int{0}, Offsets: []int{0}}
		pre, post := math.Inf(1), math.Inf(1)
		for range 2 {
			var a, z time.Duration
			for range 2 { // an even step and an odd one
				t0 := time.Now()
				switch b := buf.(type) {
				case []float32:
					psgdCompress(h, v, b)
				case []float64:
					psgdCompress(h, v, b)
				}
				t1 := time.Now()
				_ = h.Finish(v)
				a, z = a+t1.Sub(t0), z+time.Since(t1)
			}
			pre, post = math.Min(pre, a.Seconds()/2), math.Min(post, z.Seconds()/2)
		}
		c.PowerSGD = append(c.PowerSGD, sim.RankCost{Rank: r, Pre: pre / float64(elems), Post: post / float64(elems)})
	}
	return c, nil
}

// timeCasts times bf16's casts of buf (float32 or float64), as its hook does them, per
// element: the least of two tries.
func timeCasts(buf any) (pre, post float64) {
	h := BF16CompressHook().(compressHook[procgroup.BF16])
	pre, post = math.Inf(1), math.Inf(1)
	var n int
	for range 2 {
		var a, z time.Duration
		switch b := buf.(type) {
		case []float32:
			n = len(b)
			s := make([]procgroup.BF16, n)
			t0 := time.Now()
			for k, v := range b {
				s[k] = h.narrow(v)
			}
			t1 := time.Now()
			for k := range b {
				b[k] = h.widen(s[k])
			}
			a, z = t1.Sub(t0), time.Since(t1)
		case []float64:
			n = len(b)
			s := make([]procgroup.BF16, n)
			t0 := time.Now()
			for k, v := range b {
				s[k] = h.narrow(float32(v))
			}
			t1 := time.Now()
			for k := range b {
				b[k] = float64(h.widen(s[k]))
			}
			a, z = t1.Sub(t0), time.Since(t1)
		}
		pre, post = math.Min(pre, a.Seconds()), math.Min(post, z.Seconds())
	}
	return pre / float64(n), post / float64(n)
}
