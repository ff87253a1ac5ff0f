package main

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/goddp/goddp/ddp/observe"
	"github.com/goddp/goddp/ddp/tracefile"
)

func TestMergeTraceDir(t *testing.T) {
	dir := t.TempDir()
	write := func(rank, attempt, spans int) {
		f, err := os.Create(filepath.Join(dir, fmt.Sprintf("trace.rank%d.a%d.json", rank, attempt)))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		tr, err := observe.NewTracer(f, observe.TraceOptions{Rank: rank, WorldSize: 2})
		if err != nil {
			t.Fatal(err)
		}
		for range spans {
			tr.Span("forward")()
		}
		if err := tr.Close(); err != nil {
			t.Fatal(err)
		}
	}
	out := filepath.Join(dir, "merged.json")
	if fs, err := lastAttemptTraces(dir); len(fs) != 0 || err != nil {
		t.Fatalf("empty dir: %d, %v", len(fs), err)
	}
	write(0, 0, 1)
	write(1, 0, 1)
	write(0, 1, 3) // the restart: its files win
	write(1, 1, 4)
	fs, err := lastAttemptTraces(dir)
	if len(fs) != 2 || err != nil {
		t.Fatalf("read %d, %v", len(fs), err)
	}
	if err := writeMerged(out, fs); err != nil {
		t.Fatal(err)
	}
	tf, err := tracefile.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	spans := map[int]int{}
	for _, e := range tf.TraceEvents {
		if e.Cat == observe.CatCompute {
			spans[e.PID]++
		}
	}
	if spans[0] != 3 || spans[1] != 4 || fmt.Sprint(tf.OtherData.Ranks) != "[0 1]" {
		t.Errorf("merged spans per rank %v, ranks %v", spans, tf.OtherData.Ranks)
	}
}
