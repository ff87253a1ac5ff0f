package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/goddp/goddp/procgroup"
)

// TestCommHookFlag: 2 ranks with --comm_hook powersgd (and bf16) end with the same
// parameters, other than the plain all-reduce's; auto keeps the plain all-reduce here; ranks given different --powersgd_rank
// are refused at New, each naming both sides; an unknown hook is a flag error.
func TestCommHookFlag(t *testing.T) {
	const args = tinyDDPFlags + " --warmup_steps 1 --bench_steps 4"
	crc := map[string]string{}
	for _, hook := range []string{"none", "bf16", "powersgd --powersgd_rank 2 --powersgd_min_compression_rate 1"} {
		_, out := trainRanks(t, 2, args+" --comm_hook "+hook)
		a, b := lastCRC(t, out[0]), lastCRC(t, out[1])
		if a != b {
			t.Fatalf("%s: the ranks end with %s and %s", hook, a, b)
		}
		if crc[hook] = a; hook != "none" && a == crc["none"] {
			t.Errorf("%s ends with the plain all-reduce's parameters: the hook did not run", hook)
		}
	}
	// auto, in one process: it measures three steps and keeps the plain all-reduce, whose
	// two ranks' sums have the same bits whatever the layout.
	_, out := trainRanks(t, 2, args+" --comm_hook auto")
	if a, b := lastCRC(t, out[0]), lastCRC(t, out[1]); a != crc["none"] || b != crc["none"] {
		t.Errorf("auto ends with %s and %s, want the plain all-reduce's %s", a, b, crc["none"])
	}
	if !strings.Contains(out[0], "auto hook after 3 synced steps, with the caps as set") || !strings.Contains(out[0], "; hooks none ×") {
		t.Errorf("auto: rank 0 printed no plan keeping the plain all-reduce:\n%s", out[0])
	}
	_, _, errs := runRanks(t, 2, args+" --comm_hook powersgd --powersgd_rank 2", func(rank int, _ procgroup.ProcessGroup, f *flags) {
		if rank == 1 {
			f.psgd.Rank = 1
		}
	})
	const want = "Options.CommHook is powersgd(rank 2, min_compression_rate 2, start_iter 0, seed 0) on rank 0 but powersgd(rank 1, min_compression_rate 2, start_iter 0, seed 0) on rank 1"
	for r, err := range errs {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("rank %d: %v, want an error saying %q", r, err, want)
		}
	}
	if _, err := parseFlags([]string{"--comm_hook", "powersdg"}, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), `comm hook "powersdg", want one of none, fp16, bf16, powersgd`) {
		t.Errorf("--comm_hook powersdg: %v", err)
	}
}
