// Package model is the example's Transformer in gorgonia: parameters in one flat
// buffer in PyTorch's registration order and names, a graph per batch shape with
// optional grad-ready taps (gorgoniaddp.Tap) on every learnable, deterministic synthetic data
// and dropout masks.
//
// # Usage
//
//	m, err := model.New(model.DefaultConfig())            // init from cfg.Seed
//	g, err := m.NewGraph(model.GraphOptions{Batch: 8, SeqLen: 64, Train: true,
//		Hook: func(i int, grad *tensor.Dense) { /* param i's gradient is final */ }})
//	defer g.Close()
//	for step := 0; ; step++ {
//		g.Load(step, rank*8)        // this rank's samples of the global batch
//		loss, err := g.Run()         // forward + backward; hooks fire in reverse layer order
//		opt.Step(m.Data32(), grads)  // update the flat buffer in place
//	}
//
// The encoder layers are fused custom gorgonia ops (Note [Fused ops] in ops.go):
// linear (matmul + bias + optional relu and dropout), multi-head attention on the
// packed qkv projection (scaling, softmax, dropout, head split and merge without
// transposes), and residual + dropout + LayerNorm, each with a hand-written backward
// checked against finite differences. The matrix products run on the BLAS gorgonia
// is set to (in the trainer, package fastblas: goddp's Go-assembly SGEMM, or OpenBLAS
// with -tags openblas); the ops reuse their output buffers from run to run. The loss (MSE, or
// log-softmax cross-entropy for TaskCopy) and the copy task's embedding are gorgonia
// primitives.
//
// Workarounds for gorgonia's faults (the examples/transformer doc lists them): dropout
// multiplies by mask inputs filled by Load (gorgonia's Dropout reuses a stale output), Run
// calls vm.Reset() before RunAll, and the tape machine is built without BindDualValues, so a
// gradient is the value of one step, not accumulated across steps. Runs are bit-for-bit
// repeatable.
package model
