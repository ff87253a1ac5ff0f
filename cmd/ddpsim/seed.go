package main

import (
	"fmt"
	"io"
	"math"

	"github.com/goddp/goddp/bucket"
	"github.com/goddp/goddp/bucket/sim"
	"github.com/goddp/goddp/procgroup/dtype"
)

// The seed article's experiment (docs/seed-extrapolation.md): PyTorch's ddp_bench.py on
// 8 AMD MI300X, fp32, batch 32, sequence 128, AdamW. Figures and their sources:
const (
	// MI300X peak FP32 (matrix and vector alike), FLOP/s: ROCm docs, "MI300 microarchitecture"
	// (rocm.docs.amd.com/en/docs-6.2.2/conceptual/gpu-arch/mi300.html). The script never
	// enables TF32. Compute is modelled at this peak: every prediction is a lower bound.
	mi300xFP32 = 163.4e12
	// HBM3 bandwidth, bytes/s: same page (5.3 TB/s).
	mi300xHBM = 5.3e12
	// One hop between nodes, seconds: an assumption within NCCL's own cost model's
	// 2.7–9.6 µs per network step (src/graph/tuning.cc).
	netLatency = 5e-6
	// The copy into a bucket and back reads and writes each byte once, at HBM speed.
	seedCopyPerByte = 2 / mi300xHBM
	// Compute slows while RCCL kernels hold CUs: an assumption (10%), no source.
	seedSlowdown = 0.1
	// Tokens per rank per step: batch 32 × sequence 128.
	seedBatch, seedSeq = 32, 128
)

// rcclAllReduce8 is the all-reduce time on 8 MI300X against size: rccl-tests all_reduce_perf,
// out-of-place, float sum (AMD ROCm blog "MI300X RCCL xGMI",
// rocm.blogs.amd.com/software-tools-optimization/mi300x-rccl-xgmi/README.html).
var rcclAllReduce8 = []sim.Point{
	{Bytes: 1 << 10, Seconds: 13.1e-6}, {Bytes: 64 << 10, Seconds: 13.8e-6}, {Bytes: 256 << 10, Seconds: 16.9e-6},
	{Bytes: 1 << 20, Seconds: 27.4e-6}, {Bytes: 4 << 20, Seconds: 51.7e-6}, {Bytes: 16 << 20, Seconds: 148.8e-6},
	{Bytes: 64 << 20, Seconds: 429.1e-6}, {Bytes: 128 << 20, Seconds: 797.4e-6}, {Bytes: 256 << 20, Seconds: 1537e-6},
	{Bytes: 1 << 30, Seconds: 5971e-6}, {Bytes: 2 << 30, Seconds: 11891e-6}, {Bytes: 16 << 30, Seconds: 94254e-6},
}

// seedTable is one of the article's tables: ms/step per bucket_cap_mb.
type seedTable struct {
	title    string
	layers   int
	hidden   int
	statedMB float64 // the model size the article states
	ms       map[float64]float64
}

var seedCaps = []float64{1, 5, 10, 25, 50, 100, 200}

var seedTables = []seedTable{
	{"small model (stated: 88 MB, 6 layers, 2048 hidden)", 6, 2048, 88,
		map[float64]float64{1: 12.87, 5: 10.55, 10: 7.90, 25: 9.82, 50: 6.18, 100: 7.78, 200: 7.32}},
	{"large model (stated: 1628 MB, 24 layers, 4096 hidden)", 24, 4096, 1628,
		map[float64]float64{1: 28.57, 5: 26.95, 10: 27.36, 25: 28.35, 50: 36.83, 100: 35.73, 200: 35.90}},
}

// seedModel is the script's SimpleTransformer: its gradients in registration order, the
// order backward makes them ready, and the compute before each (FLOPs).
type seedModel struct {
	layers, hidden int
	names          []string
	lens           []int
	order          []int
	flops          []float64 // backward FLOPs from the previous ready gradient to this one (by order index)
	forward        float64   // forward FLOPs
}

// newSeedModel builds Linear(h,h) → L × TransformerEncoderLayer(h, 8 heads, ffn 4h, post-norm)
// → Linear(h,h). A weight of n elements costs 2·n·T FLOPs forward and 4·n·T backward (input
// and weight gradients); attention's two batched products cost 4·b·s²·h forward per layer
// and twice that backward, counted before the in-projection's gradient.
func newSeedModel(layers, hidden int) *seedModel {
	h := hidden
	m := &seedModel{layers: layers, hidden: hidden}
	add := func(name string, n int) int {
		m.names = append(m.names, name)
		m.lens = append(m.lens, n)
		return len(m.lens) - 1
	}
	type layer struct{ inW, inB, outW, outB, l1W, l1B, l2W, l2B, n1W, n1B, n2W, n2B int }
	embW, embB := add("embed.weight", h*h), add("embed.bias", h)
	ls := make([]layer, layers)
	for i := range ls {
		p := fmt.Sprintf("encoder.layers.%d.", i)
		ls[i] = layer{
			inW: add(p+"self_attn.in_proj_weight", 3*h*h), inB: add(p+"self_attn.in_proj_bias", 3*h),
			outW: add(p+"self_attn.out_proj.weight", h*h), outB: add(p+"self_attn.out_proj.bias", h),
			l1W: add(p+"linear1.weight", 4*h*h), l1B: add(p+"linear1.bias", 4*h),
			l2W: add(p+"linear2.weight", 4*h*h), l2B: add(p+"linear2.bias", h),
			n1W: add(p+"norm1.weight", h), n1B: add(p+"norm1.bias", h),
			n2W: add(p+"norm2.weight", h), n2B: add(p+"norm2.bias", h),
		}
	}
	headW, headB := add("head.weight", h*h), add("head.bias", h)
	tokens := float64(seedBatch * seedSeq)
	attn := 4 * float64(seedBatch) * float64(seedSeq) * float64(seedSeq) * float64(h)
	ready := func(i int, flops float64) {
		m.order = append(m.order, i)
		m.flops = append(m.flops, flops)
	}
	wgrad := func(i int) float64 { return 4 * float64(m.lens[i]) * tokens }
	ready(headW, wgrad(headW))
	ready(headB, 0)
	for i := layers - 1; i >= 0; i-- {
		l := ls[i]
		for _, j := range []int{l.n2W, l.n2B, l.l2W, l.l2B, l.l1W, l.l1B, l.n1W, l.n1B, l.outW, l.outB} {
			ready(j, wgrad(j)*boolf(m.lens[j] >= h*h))
		}
		ready(l.inW, wgrad(l.inW)+2*attn)
		ready(l.inB, 0)
	}
	ready(embW, wgrad(embW))
	ready(embB, 0)
	for _, n := range m.lens {
		if n >= h*h {
			m.forward += 2 * float64(n) * tokens
		}
	}
	m.forward += attn * float64(layers)
	return m
}

func boolf(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

func (m *seedModel) bytes() int64 {
	var t int64
	for _, n := range m.lens {
		t += 4 * int64(n)
	}
	return t
}

// profile is the model's step on one MI300X with the given all-reduce.
func (m *seedModel) profile(comm sim.Comm, world int) *sim.Profile {
	p := &sim.Profile{Params: bucketParams(m.names, m.lens), Order: m.order, Ready: make([]float64, len(m.lens)), World: world}
	t := 0.0
	for k, i := range m.order {
		t += m.flops[k] / mi300xFP32
		p.Ready[i] = t
	}
	p.Backward = t
	// forward, then AdamW: read parameter, gradient and two moments, write three (28 B/param)
	p.Other = m.forward/mi300xFP32 + 28*float64(m.bytes()/4)/mi300xHBM
	p.CopyPerByte, p.UnpackPerByte = seedCopyPerByte, seedCopyPerByte
	p.Slowdown = seedSlowdown
	p.Comm = comm
	return p
}

// torchBuckets assigns buckets as PyTorch's reducer does (compute_bucket_assignment_by_size
// in reducer.cpp, read for its rule): gradients are added in the given order until the
// bucket's size reaches its limit, so a bucket may overshoot it by one gradient; the first
// bucket's limit is firstCap, the others' capBytes. (goddp's bucket.Assign closes a bucket
// before a gradient that would overflow it instead.)
func torchBuckets(p *sim.Profile, firstCap, capBytes int64) []bucket.Bucket {
	var out []bucket.Bucket
	cur := bucket.Bucket{DType: dtype.Float32}
	var size int64
	limit := firstCap
	for _, i := range p.Order {
		cur.Params = append(cur.Params, i)
		cur.Offsets = append(cur.Offsets, cur.Len)
		cur.Len += p.Params[i].Len
		size += p.Params[i].Bytes()
		if size >= limit {
			cur.Index = len(out)
			out = append(out, cur)
			cur, size, limit = bucket.Bucket{DType: dtype.Float32}, 0, capBytes
		}
	}
	if len(cur.Params) > 0 {
		cur.Index = len(out)
		out = append(out, cur)
	}
	return out
}

// torchStep simulates p with PyTorch's buckets for the cap (1 MiB first bucket).
func torchStep(p *sim.Profile, capMB float64) (sim.Result, error) {
	return p.Simulate(torchBuckets(p, 1<<20, mib(capMB)))
}

// stated finds the layers×hidden shape nearest the stated size with the stated layer count.
func stated(layers int, mb float64) int {
	best, bestErr := 0, math.Inf(1)
	for h := 64; h <= 8192; h += 8 {
		m := float64(layers*(12*h*h+13*h)+2*(h*h+h)) * 4 / 1e6
		if e := math.Abs(m - mb); e < bestErr {
			best, bestErr = h, e
		}
	}
	return best
}

func seedReport(w io.Writer) error {
	fmt.Fprintln(w, "# The seed article's bucket_cap_mb experiment, predicted (ddpsim -seed)")
	fmt.Fprintln(w, "\nInputs (docs/seed-extrapolation.md): 8 × MI300X; compute at the FP32 peak, 163.4 TFLOP/s (ROCm docs), so")
	fmt.Fprintln(w, "every time is a lower bound; AdamW at 28 B/param over 5.3 TB/s HBM; bucket copies at HBM speed; all-reduce")
	fmt.Fprintln(w, "from AMD's measured rccl-tests curve on 8 MI300X; compute 10% slower while RCCL runs (assumed).")
	comm8, err := sim.Fit(rcclAllReduce8)
	if err != nil {
		return err
	}
	for _, tb := range seedTables {
		script := newSeedModel(tb.layers, tb.hidden)
		h2 := stated(tb.layers, tb.statedMB)
		small := newSeedModel(tb.layers, h2)
		ps := script.profile(comm8, 8)
		pt := small.profile(comm8, 8)
		fmt.Fprintf(w, "\n## %s\n\n", tb.title)
		fmt.Fprintf(w, "The script builds %d layers × %d hidden: %.0f MB of fp32 parameters, not %.0f MB. %d layers × %d hidden is %.0f MB.\n\n",
			tb.layers, tb.hidden, float64(script.bytes())/1e6, tb.statedMB, tb.layers, h2, float64(small.bytes())/1e6)
		fmt.Fprintf(w, "| bucket_cap_mb | seed ms/step | predicted, script's model (buckets, exposed ms) | predicted, %dL×%d (buckets, exposed ms) |\n|---:|---:|---:|---:|\n", tb.layers, h2)
		for _, c := range seedCaps {
			a, err := torchStep(ps, c)
			if err != nil {
				return err
			}
			b, err := torchStep(pt, c)
			if err != nil {
				return err
			}
			fmt.Fprintf(w, "| %g | %.2f | %.1f (%d, %.2f) | %.2f (%d, %.2f) |\n", c, tb.ms[c], a.Step*1e3, a.Buckets, a.Exposed*1e3, b.Step*1e3, b.Buckets, b.Exposed*1e3)
		}
		fmt.Fprintf(w, "\nFLOPs per step and rank: script's model %.2f TFLOP (at least %.1f ms at the FP32 peak); %dL×%d %.3f TFLOP (%.2f ms).\n",
			(script.forward+ps.Backward*mi300xFP32)/1e12, (script.forward/mi300xFP32+ps.Backward)*1e3, tb.layers, h2,
			(small.forward+pt.Backward*mi300xFP32)/1e12, (small.forward/mi300xFP32+pt.Backward)*1e3)
	}
	return whatIf(w, comm8)
}

// whatIf predicts, for 2–64 nodes of 8 MI300X joined at 100 or 400 Gbit/s with one NIC per
// GPU, the best cap and its exposed communication. The all-reduce is hierarchical: inside
// each node the measured 8-GPU curve (a reduce-scatter and an all-gather), between nodes 8
// parallel all-reduces of 1/8 of the bucket, each the cheaper of a ring and a tree. comm8 is
// the measured 8-GPU curve.
func whatIf(w io.Writer, comm8 sim.Comm) error {
	fmt.Fprintln(w, "\n## What-if: nodes of 8 MI300X, one NIC per GPU (as on Azure ND MI300X v5)")
	fmt.Fprintln(w, "\nAll-reduce: the measured 8-GPU curve inside the node, then 8 parallel all-reduces of 1/8 of the bucket")
	fmt.Fprintln(w, "between nodes, each the cheaper of a ring and a double binary tree, 5 µs per hop (assumed), line rate.")
	var shapes [][2]int // the stated sizes' shapes, then the script's
	for _, tb := range seedTables {
		shapes = append(shapes, [2]int{tb.layers, stated(tb.layers, tb.statedMB)})
	}
	for _, tb := range seedTables {
		shapes = append(shapes, [2]int{tb.layers, tb.hidden})
	}
	for _, shape := range shapes {
		m := newSeedModel(shape[0], shape[1])
		fmt.Fprintf(w, "\n### %d layers × %d hidden (%.0f MB of gradients)\n\n", shape[0], shape[1], float64(m.bytes())/1e6)
		fmt.Fprintln(w, "| nodes | GPUs | Gbit/s | best cap MB | buckets | ms/step | exposed ms | at 25 MB: ms/step | exposed ms |")
		fmt.Fprintln(w, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
		for _, gbit := range []float64{100, 400} {
			for nodes := 2; nodes <= 64; nodes *= 2 {
				comm := hierComm(comm8, nodes, gbit, m.bytes())
				p := m.profile(comm, 8*nodes)
				best := math.Inf(1)
				var bestCap float64
				var br sim.Result
				for _, c := range seedCaps {
					r, err := torchStep(p, c)
					if err != nil {
						return err
					}
					if r.Step < best {
						best, bestCap, br = r.Step, c, r
					}
				}
				d, _ := torchStep(p, 25)
				fmt.Fprintf(w, "| %d | %d | %g | %g | %d | %.1f | %.1f | %.1f | %.1f |\n", nodes, 8*nodes, gbit, bestCap, br.Buckets, br.Step*1e3, br.Exposed*1e3, d.Step*1e3, d.Exposed*1e3)
			}
		}
	}
	return nil
}

// hierComm tabulates the hierarchical all-reduce's time at sizes up to total (and beyond,
// by the curve's last slope).
func hierComm(intra sim.Comm, nodes int, gbit float64, total int64) sim.Comm {
	bw := gbit * 1e9 / 8
	ring, tree := sim.Ring(nodes, netLatency, bw), sim.Tree(nodes, netLatency, bw)
	var pts []sim.Point
	for s := int64(4 << 10); ; s *= 2 {
		part := s / 8
		t := intra.Seconds(s) + math.Min(ring.Seconds(part), tree.Seconds(part))
		pts = append(pts, sim.Point{Bytes: s, Seconds: t})
		if s > total {
			break
		}
	}
	c, _ := sim.Fit(pts)
	return c
}

// bucketParams is a helper for the seed's models: float32 parameters of the given lengths.
func bucketParams(names []string, lens []int) []bucket.Param {
	ps := make([]bucket.Param, len(lens))
	for i := range lens {
		ps[i] = bucket.Param{Name: names[i], DType: dtype.Float32, Len: lens[i]}
	}
	return ps
}
