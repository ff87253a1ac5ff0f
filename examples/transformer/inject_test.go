package main

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/procgroup"
)

// TestNonFiniteNamed: with --inject_nan 1:5:PARAM (by index and by name, with and without
// NoSync micro-batches) both ranks fail step 5 with the same *ddp.NonFiniteError naming
// rank 1, step 5 and the parameter, each prints it, and the optimizer never steps on it:
// the gradients reach it (onGrads) for steps 0 to 4 only. Without the check
// (--no_finite_check) the NaN goes on into the loss, which the trainer refuses later
// without naming the rank or the parameter.
func TestNonFiniteNamed(t *testing.T) {
	const want = "reducer: step 5: non-finite local gradient: rank 1: parameter 6 (1.layers.0.linear1.weight)"
	base := tinyDDPFlags + " --batch_size 2 --warmup_steps 0 --bench_steps 8"
	for _, args := range []string{
		base + " --inject_nan 1:5:6",
		base + " --accum_steps 2 --inject_nan 1:5:1.layers.0.linear1.weight",
	} {
		stderr := make([]bytes.Buffer, 2)
		stepped := make([][]int, 2)
		_, outs, errs := runRanks(t, 2, args, func(rank int, _ procgroup.ProcessGroup, f *flags) {
			f.stderr = &stderr[rank]
			f.onGrads = func(step int, _ []float32) { stepped[rank] = append(stepped[rank], step) }
		})
		for r := range 2 {
			var nf *ddp.NonFiniteError
			if errs[r] == nil || errs[r].Error() != want || !errors.As(errs[r], &nf) || nf.Step != 5 {
				t.Errorf("%s: rank %d: %v, want %q\n%s", args, r, errs[r], want, outs[r])
			}
			if got := stderr[r].String(); got != "transformer: "+want+"\n" {
				t.Errorf("%s: rank %d printed %q", args, r, got)
			}
			if fmt.Sprint(stepped[r]) != "[0 1 2 3 4]" {
				t.Errorf("%s: rank %d: the optimizer saw the gradients of steps %v, want [0 1 2 3 4]", args, r, stepped[r])
			}
		}
	}
	_, _, errs := runRanks(t, 2, base+" --inject_nan 1:5:6 --no_finite_check", nil)
	for r, err := range errs {
		if err == nil || errors.Is(err, ddp.ErrNonFinite) || !strings.Contains(err.Error(), "loss is NaN") {
			t.Errorf("--no_finite_check: rank %d: %v, want the loss's NaN found later", r, err)
		}
	}
}

// TestInjectNaNFlag: --inject_nan takes RANK:STEP:PARAM; a parameter the model lacks is
// refused, listing the model's.
func TestInjectNaNFlag(t *testing.T) {
	f, err := parseFlags(strings.Fields("--inject_nan 1:5:1.layers.0.linear1.weight"), &bytes.Buffer{})
	if err != nil || f.inject != (injection{on: true, rank: 1, step: 5, param: "1.layers.0.linear1.weight"}) {
		t.Fatalf("%+v, %v", f.inject, err)
	}
	for _, v := range []string{"1:5", "1:5:", "x:5:2", "1:-1:2", "-1:5:2"} {
		if _, err := parseFlags([]string{"--inject_nan", v}, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), "inject_nan") || !strings.Contains(err.Error(), "want RANK:STEP:PARAM") {
			t.Errorf("--inject_nan %s: %v", v, err)
		}
	}
	for v, want := range map[string]string{
		"0:1:99":   "--inject_nan 0:1:99: parameter index 99 outside [0, 16)",
		"0:1:nope": `--inject_nan 0:1:nope: the model has no parameter "nope"; it has 0.weight, 0.bias, 1.layers.0.self_attn.in_proj_weight`,
	} {
		_, _, errs := runRanks(t, 1, tinyDDPFlags+" --batch_size 2 --warmup_steps 0 --bench_steps 1 --inject_nan "+v, nil)
		if errs[0] == nil || !strings.Contains(errs[0].Error(), want) {
			t.Errorf("--inject_nan %s: %v, want %q", v, errs[0], want)
		}
	}
}
