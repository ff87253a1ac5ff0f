package main

import (
	"fmt"
	"math"
	"math/rand/v2"
)

// The tasks of --task: what the samples are.
const (
	taskSine    = "sine"    // y = sin(2x₀) + x₁·x₂ − x₃/2 on [−1, 1]⁴ (the default)
	taskTeacher = "teacher" // y = a fixed random teacher network's output on N(0, 1)^inputs
)

// teacherHidden is the teacher's width, and teacherSeed the seed of its weights: the same
// teacher for every --seed, so that seeds vary the student and the data only.
const (
	teacherHidden = 16
	teacherSeed   = 0x7eac4e2
)

// task is --task with its input and output widths (--inputs, --outputs) and, for the
// teacher task, the teacher.
type task struct {
	name    string
	in, out int
	// The teacher, y = V·tanh(A·x + c): A is teacherHidden×in, V out×teacherHidden,
	// row-major.
	a, c, v []float64
}

// newTask is the task named name with in inputs (0: the task's default, 4 for sine, 32
// for teacher) and out outputs (1 for sine).
func newTask(name string, in, out int) (task, error) {
	switch name {
	case taskSine:
		if in != 0 && in != sineInputs || out != 1 {
			return task{}, fmt.Errorf("--task sine has %d inputs and 1 output, not --inputs %d --outputs %d", sineInputs, in, out)
		}
		return task{name: name, in: sineInputs, out: 1}, nil
	case taskTeacher:
		if in == 0 {
			in = 32
		}
		if in < 1 || in > 1<<16 || out < 1 || out > 1<<16 {
			return task{}, fmt.Errorf("--inputs %d, --outputs %d: want 1 to 65536 each", in, out)
		}
		return newTeacher(in, out), nil
	}
	return task{}, fmt.Errorf("--task %q: want %s or %s", name, taskSine, taskTeacher)
}

// newTeacher draws the teacher of in inputs and out outputs: A and V from N(0, 1/fan-in),
// c from N(0, 0.1²), so that A·x has unit variance and tanh is neither linear nor
// saturated.
func newTeacher(in, out int) task {
	t := task{name: taskTeacher, in: in, out: out, a: make([]float64, teacherHidden*in), c: make([]float64, teacherHidden), v: make([]float64, out*teacherHidden)}
	rng := rand.New(rand.NewPCG(teacherSeed, uint64(in)))
	for k := range t.a {
		t.a[k] = rng.NormFloat64() / math.Sqrt(float64(in))
	}
	for j := range t.c {
		t.c[j] = 0.1 * rng.NormFloat64()
	}
	for k := range t.v {
		t.v[k] = rng.NormFloat64() / math.Sqrt(teacherHidden)
	}
	return t
}

// samples fills xs (n×in) and ys (n×out) with the n samples of the run from index first on:
// each depends on (seed, its index) only.
func (t task) samples(seed uint64, first, n int, xs, ys []float32) {
	if t.name == taskSine {
		sineSamples(seed, first, n, xs, ys)
		return
	}
	for s := range n {
		rng := rand.New(rand.NewPCG(seed, uint64(first+s)))
		x := xs[s*t.in : (s+1)*t.in]
		for k := range x {
			x[k] = float32(rng.NormFloat64())
		}
		t.teach(x, ys[s*t.out:(s+1)*t.out])
	}
}

// teach puts the teacher's outputs at x into y.
func (t task) teach(x, y []float32) {
	var h [teacherHidden]float64
	for j := range h {
		z := t.c[j]
		for k, v := range x {
			z += t.a[j*t.in+k] * float64(v)
		}
		h[j] = math.Tanh(z)
	}
	for o := range y {
		var v float64
		for j, hj := range h {
			v += t.v[o*teacherHidden+j] * hj
		}
		y[o] = float32(v)
	}
}
