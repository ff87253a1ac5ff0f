package model

import (
	"testing"

	"gorgonia.org/tensor"

	"github.com/goddp/goddp/ddp/optim"
)

// BenchmarkTrainStep is one --no_ddp training step of the default (seed) config:
// Load, forward and backward with grad-ready hooks copying into a flat gradient
// buffer, and AdamW. With OpenBLAS (bench_openblas_test.go):
//
//	CGO_LDFLAGS=-lopenblas OPENBLAS_NUM_THREADS=1 go test -tags openblas -run '^$' \
//		-bench TrainStep ./examples/transformer/model
func BenchmarkTrainStep(b *testing.B) {
	m, err := New(DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	params := m.Params()
	grads := make([]float32, m.NumParams())
	hook := func(i int, d *tensor.Dense) { copy(grads[params[i].Offset:], d.Data().([]float32)) }
	g, err := m.NewGraph(GraphOptions{Batch: 8, SeqLen: 64, Train: true, Hook: hook})
	if err != nil {
		b.Fatal(err)
	}
	defer g.Close()
	opt, _ := optim.NewAdamW(m.NumParams(), optim.AdamWOptions{})
	step := func(i int) {
		if err := g.Load(i, 0); err != nil {
			b.Fatal(err)
		}
		if _, err := g.Run(); err != nil {
			b.Fatal(err)
		}
		if err := opt.Step(m.Data32(), grads); err != nil {
			b.Fatal(err)
		}
	}
	step(0) // first run allocates the ops' buffers
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		step(i + 1)
	}
	b.ReportMetric(float64(b.Elapsed().Milliseconds())/float64(b.N), "ms/step")
}
