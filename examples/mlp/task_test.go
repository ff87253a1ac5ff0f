package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestTeacherTargetsAreTheTeacher checks the targets of --task teacher (48 inputs, 3
// outputs) another way: a student whose weights are set to the teacher's (the mlp's own
// float32 forward pass, 16 hidden units) has a loss of float32 rounding on them, while the random student's is far
// from it; and a sample depends on (seed, index) only, not on the batch it is drawn in.
func TestTeacherTargetsAreTheTeacher(t *testing.T) {
	const in, out, n = 48, 3, 64
	tk, err := newTask(taskTeacher, in, out)
	if err != nil {
		t.Fatal(err)
	}
	xs, ys := make([]float32, n*in), make([]float32, n*out)
	tk.samples(7, 100, n, xs, ys)
	copyOf := newMLP(teacherHidden, in, out, 3)
	for k, a := range tk.a {
		copyOf.params[w1][k] = float32(a)
	}
	for j := range teacherHidden {
		copyOf.params[b1][j] = float32(tk.c[j])
	}
	for k, v := range tk.v {
		copyOf.params[w2][k] = float32(v)
	}
	clear(copyOf.params[b2])
	none := func(int) {}
	if l := copyOf.forwardBackward(xs, ys, 1, none); !(l < 1e-10) {
		t.Errorf("the teacher's own weights: loss %g, want float32 rounding (< 1e-10)", l)
	}
	if l := newMLP(64, in, out, 3).forwardBackward(xs, ys, 1, none); !(l > 1e-2) {
		t.Errorf("a random student: loss %g, want > 1e-2 (the comparison could not tell)", l)
	}
	var vy float64 // the targets are not degenerate: their variance
	for _, y := range ys {
		vy += float64(y) * float64(y) / float64(len(ys))
	}
	if !(vy > 0.05) {
		t.Errorf("mean y² %g over %d samples, want > 0.05", vy, n)
	}
	same := true
	for s := range n {
		same = same && ys[s*out] == ys[s*out+1]
	}
	if same {
		t.Errorf("outputs 0 and 1 are the same function")
	}
	// Samples 110…119 of the same seed, drawn alone, are rows 10…19 of the batch above.
	xs2, ys2 := make([]float32, 10*in), make([]float32, 10*out)
	tk.samples(7, 110, 10, xs2, ys2)
	if !slicesEqual(xs2, xs[10*in:20*in]) || !slicesEqual(ys2, ys[10*out:20*out]) {
		t.Errorf("samples 110… drawn alone differ from the same samples drawn in a batch")
	}
	tk.samples(8, 110, 10, xs2, ys2)
	if slicesEqual(xs2, xs[10*in:20*in]) {
		t.Errorf("seeds 7 and 8 draw the same inputs")
	}
}

func slicesEqual(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if a[k] != b[k] {
			return false
		}
	}
	return true
}

// TestTaskFlags: the flags reach the task, the default is today's, bad values are refused
// naming the flag.
func TestTaskFlags(t *testing.T) {
	for args, want := range map[string]task{"": {name: taskSine, in: 4, out: 1}, "--task teacher": {name: taskTeacher, in: 32, out: 1}, "--task teacher --inputs 48 --outputs 5": {name: taskTeacher, in: 48, out: 5}, "--task sine --inputs 4": {name: taskSine, in: 4, out: 1}} {
		f := mustParse(t, args)
		if f.task.name != want.name || f.task.in != want.in || f.task.out != want.out {
			t.Errorf("%q: task %s with %d inputs and %d outputs, want %s with %d and %d", args, f.task.name, f.task.in, f.task.out, want.name, want.in, want.out)
		}
	}
	for args, want := range map[string]string{
		"--task sine --inputs 8":      "--task sine has 4 inputs and 1 output, not --inputs 8 --outputs 1",
		"--task sine --outputs 2":     "--task sine has 4 inputs and 1 output, not --inputs 0 --outputs 2",
		"--task teacher --inputs -1":  "--inputs -1, --outputs 1: want 1 to 65536 each",
		"--task teacher --outputs 0":  "--inputs 32, --outputs 0: want 1 to 65536 each",
		"--task students":             `--task "students": want sine or teacher`,
		"--task teacher --inputs 1e9": `invalid value "1e9" for flag -inputs`,
	} {
		_, err := parseFlags(strings.Fields(args), &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want an error containing %q", args, err, want)
		}
	}
}

// TestTeacherTaskUnderDDPRun launches 2 ranks of this trainer under the real ddprun on
// --task teacher --inputs 32 --outputs 16 --hidden_size 64:
//   - rank 0's --save_params file holds 64·32 + 64 + 16·64 + 16 parameters (the flags
//     reach W1 and W2);
//   - with every hook the loss falls: the mean of the last 20 steps' losses is under a
//     quarter of step 0's, and the ranks end with the same params_crc32;
//   - W1 (64×32) and W2 (16×64) are matrices PowerSGD compresses at ranks 1, 2 and 4
//     (each run ends away from the plain all-reduce's crc), and at rank 16, where
//     (64+32)·16·2 ≥ 64·32 and (16+64)·16·2 ≥ 16·64, they go uncompressed and the run
//     ends with the plain crc; the default task's W1 (64×4) is not compressed at rank 2,
//     so it is no test of PowerSGD there.
func TestTeacherTaskUnderDDPRun(t *testing.T) {
	if testing.Short() {
		t.Skip("builds ddprun")
	}
	ddprun := buildDDPRun(t)
	dir := t.TempDir()
	const base = "--task teacher --inputs 32 --outputs 16 --hidden_size 64 --steps 150 --log_every 1 --lr 0.05 --batch_size 32"
	run := func(args string) (crc string, losses []float64) {
		t.Helper()
		last, stdout, stderr, err := ddprunTrainer(t, ddprun, 2, args)
		if err != nil {
			t.Fatalf("%s: ddprun: %v\nstdout:\n%s\nstderr:\n%s", args, err, stdout, stderr)
		}
		if last["rank0"] != last["rank1"] || !strings.HasPrefix(last["rank0"], "params_crc32=") {
			t.Fatalf("%s: the ranks end with %q and %q\nstdout:\n%s", args, last["rank0"], last["rank1"], stdout)
		}
		for _, line := range strings.Split(stdout, "\n") {
			var rank, step int
			var l float64
			if _, err := fmt.Sscanf(line, "[rank%d]: step %d loss %g", &rank, &step, &l); err == nil {
				if step != len(losses) {
					t.Fatalf("%s: step %d logged after %d steps\n%s", args, step, len(losses), stdout)
				}
				losses = append(losses, l)
			}
		}
		return last["rank0"], losses
	}
	saved := filepath.Join(dir, "params.bin")
	plain, losses := run(base + " --save_params " + saved)
	if b, err := os.ReadFile(saved); err != nil || len(b) != 4*(64*32+64+16*64+16) {
		t.Errorf("--save_params: %d bytes (%v), want %d", len(b), err, 4*(64*32+64+16*64+16))
	}
	for _, hook := range []string{"none", "bf16", "fp16", "powersgd --powersgd_rank 1", "powersgd --powersgd_rank 2", "powersgd --powersgd_rank 4", "powersgd --powersgd_rank 16"} {
		crc := plain
		if hook != "none" {
			crc, losses = run(base + " --comm_hook " + hook)
		}
		if len(losses) != 150 {
			t.Fatalf("%s: %d losses, want 150", hook, len(losses))
		}
		var tail float64
		for _, l := range losses[130:] {
			tail += l / 20
		}
		t.Logf("%s: loss %v → %v (mean of the last 20), %s", hook, losses[0], tail, crc)
		if !(tail < losses[0]/4) {
			t.Errorf("%s: loss %v → %v (mean of the last 20), want under a quarter", hook, losses[0], tail)
		}
		compressed := hook != "none" && hook != "powersgd --powersgd_rank 16"
		if compressed == (crc == plain) {
			t.Errorf("%s ends with %s, the plain all-reduce with %s: want them %s", hook, crc, plain, map[bool]string{true: "different", false: "equal"}[compressed])
		}
	}
	sine, _ := run("--hidden_size 64 --steps 20 --log_every 1")
	if psgd, _ := run("--hidden_size 64 --steps 20 --log_every 1 --comm_hook powersgd --powersgd_rank 2"); psgd != sine {
		t.Errorf("the default task at rank 2 ends with %s, not the plain %s: its 64×4 W1 was compressed", psgd, sine)
	}
}
