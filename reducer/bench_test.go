package reducer

import (
	"context"
	"fmt"
	"testing"

	"github.com/goddp/goddp/procgroup"
)

// nopGroup is a process group whose collectives complete at once without moving data, so
// that benchmarks and allocation counts measure the reducer's own hook path.
type nopGroup struct {
	size int
	done *procgroup.Future
}

func newNopGroup(size int) *nopGroup { return &nopGroup{size: size, done: procgroup.Completed(nil)} }

func (g *nopGroup) Rank() int { return 0 }
func (g *nopGroup) Size() int { return g.size }
func (g *nopGroup) AllReduce(context.Context, any, procgroup.ReduceOp) procgroup.Work {
	return g.done
}
func (g *nopGroup) Broadcast(context.Context, any, int) procgroup.Work { return g.done }
func (g *nopGroup) AllGather(context.Context, any, any) procgroup.Work { return g.done }
func (g *nopGroup) ReduceScatter(context.Context, any, any, procgroup.ReduceOp) procgroup.Work {
	return g.done
}
func (g *nopGroup) Barrier(context.Context) procgroup.Work { return g.done }
func (g *nopGroup) Close() error                           { return nil }
func (g *nopGroup) Abort(error)                            {}

var _ procgroup.ProcessGroup = (*nopGroup)(nil)

// stepper runs whole synced steps over nParams float32 parameters of length n each.
type stepper struct {
	r     *Reducer
	grads [][]float32
}

func newStepper(tb testing.TB, nParams, n int, opts Options) *stepper {
	s := &stepper{}
	params := make([]Param, nParams)
	for i := range params {
		params[i] = Param{Name: fmt.Sprint(i), Grad: make([]float32, n)}
		g := make([]float32, n)
		for k := range g {
			g[k] = float32(k%7) + 0.5
		}
		s.grads = append(s.grads, g)
	}
	r, err := New(newNopGroup(2), params, opts)
	if err != nil {
		tb.Fatal(err)
	}
	s.r = r
	return s
}

func (s *stepper) step(tb testing.TB, mode Mode) {
	if err := s.r.BeginBackward(mode); err != nil {
		tb.Fatal(err)
	}
	for i := len(s.grads) - 1; i >= 0; i-- {
		if err := s.r.GradReady(i, s.grads[i]); err != nil {
			tb.Fatal(err)
		}
	}
	if err := s.r.Finalize(context.Background()); err != nil {
		tb.Fatal(err)
	}
}

// TestSteadyStateAllocs: after the first step (and its rebuild), a step — BeginBackward,
// every GradReady, Finalize, Stats — allocates nothing, in every mode.
func TestSteadyStateAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are not meaningful under the race detector")
	}
	for _, opts := range []Options{
		{FirstBucketCapMB: 1.0 / 64, BucketCapMB: 1.0 / 16},
		{FirstBucketCapMB: 1.0 / 64, BucketCapMB: 1.0 / 16, GradientAsBucketView: true, FindUnusedParameters: true},
		{CommHook: FP16CompressHook()},
	} {
		s := newStepper(t, 32, 1000, opts)
		s.step(t, Sync)
		s.step(t, Sync)
		if a := testing.AllocsPerRun(20, func() {
			s.step(t, Accumulate)
			s.step(t, Sync)
			_ = s.r.Stats()
		}); a != 0 {
			t.Errorf("%+v: %v allocations per step", opts, a)
		}
	}
}

// BenchmarkHookPath measures one synced step's hook path (BeginBackward, GradReady for each
// parameter, Finalize) against a group whose collectives cost nothing. ns/grad is the time
// per GradReady call, copy included; allocs/op are per step.
func BenchmarkHookPath(b *testing.B) {
	for _, c := range []struct{ params, n int }{{64, 16}, {64, 4096}, {16, 65536}} {
		b.Run(fmt.Sprintf("params=%d/len=%d", c.params, c.n), func(b *testing.B) {
			s := newStepper(b, c.params, c.n, Options{FirstBucketCapMB: 0.25, BucketCapMB: 1})
			s.step(b, Sync)
			s.step(b, Sync)
			b.SetBytes(int64(c.params * c.n * 4))
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				s.step(b, Sync)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*c.params), "ns/grad")
		})
	}
}

// BenchmarkPowerSGD measures the host PowerSGD hook's local work on one float32 matrix of
// the transformer's MLP shape: an even step's and an odd step's compression and
// reconstruction (no collective), per op. ns/elem is per gradient element and step.
func BenchmarkPowerSGD(b *testing.B) {
	const n, m = 2048, 512
	for _, r := range []int{1, 2, 4} {
		b.Run(fmt.Sprintf("%dx%d/rank=%d", n, m, r), func(b *testing.B) {
			h := PowerSGDHook(PowerSGDOptions{Rank: r, MinCompressionRate: 1}).(*powerSGD)
			if err := h.Setup(HookSetup{Params: []HookParam{{Name: "w", DType: procgroup.Float32, Shape: []int{n, m}}}, WorldSize: 1}); err != nil {
				b.Fatal(err)
			}
			grad := make([]float32, n*m)
			for k := range grad {
				grad[k] = float32(k%13) - 6
			}
			buf := make([]float32, n*m)
			v := &BucketView{DType: procgroup.Float32, Buffer: buf, Params: []int{0}, Offsets: []int{0}}
			b.SetBytes(2 * n * m * 4)
			b.ResetTimer()
			for b.Loop() {
				for range 2 { // an even step and an odd one
					copy(buf, grad)
					psgdCompress(h, v, buf)
					if err := h.Finish(v); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(2*b.N*n*m), "ns/elem")
		})
	}
}
