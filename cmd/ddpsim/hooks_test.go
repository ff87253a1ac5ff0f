package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/goddp/goddp/bucket/sim"
)

// TestHookTable: a profile with compression costs gets each hook's row and auto's choice;
// over 1 Gbit/s auto compresses the bucket whose collective backward does not hide, on a link a thousand times faster it
// keeps the plain all-reduce, and a profile without costs is refused with the flags to write
// one.
func TestHookTable(t *testing.T) {
	dir := t.TempDir()
	path := profileFile(t, dir, "p.json", 0.08)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var p sim.Profile
	if err := json.Unmarshal(b, &p); err != nil {
		t.Fatal(err)
	}
	p.Compression = &sim.Compression{MinCompressionRate: 2, Cast16Pre: 1e-9, Cast16Post: 1e-9,
		PowerSGD: []sim.RankCost{{Rank: 1, Pre: 2e-9, Post: 1e-9}, {Rank: 4, Pre: 3e-9, Post: 2e-9}}}
	for range p.Params {
		p.Compression.Shapes = append(p.Compression.Shapes, []int{512, 512})
	}
	p.World = 1
	alone := writeJSON(t, dir, "alone.json", p)
	if err := run([]string{"-profile", alone, "-caps", "25", "-gbit", "1"}, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), "give -world") {
		t.Errorf("-gbit on a one-rank profile without -world: %v", err)
	}
	p.World = 2
	withCosts := writeJSON(t, dir, "c.json", p)
	var out bytes.Buffer
	if err := run([]string{"-profile", withCosts, "-caps", "25", "-hooks", "-gbit", "1"}, &out, io.Discard); err != nil {
		t.Fatal(err) // -world defaults to the profile's
	}
	for _, want := range []string{"| none |", "| bf16 |", "| fp16 |", "| powersgd(r=4) |", "| powersgd(r=1) |", "| auto: "} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("1 Gbit/s: no %q in\n%s", want, out.String())
		}
	}
	if _, auto, _ := strings.Cut(out.String(), "| auto: "); !strings.Contains(strings.SplitN(auto, "\n", 2)[0], "powersgd(r=") {
		t.Errorf("1 Gbit/s: auto does not compress:\n%s", out.String())
	}
	out.Reset()
	if err := run([]string{"-profile", withCosts, "-caps", "25", "-hooks", "-world", "2", "-gbit", "1000"}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "| auto: none ×") || !strings.Contains(out.String(), "auto keeps the plain all-reduce") {
		t.Errorf("1000 Gbit/s: auto does not keep the plain all-reduce in\n%s", out.String())
	}
	p.Compression.Shapes = p.Compression.Shapes[:1] // a stranger's or a damaged profile
	short := writeJSON(t, dir, "short.json", p)
	if err := run([]string{"-profile", short, "-caps", "25", "-hooks"}, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), "1 shapes for 8 parameters") {
		t.Errorf("a profile with too few shapes: %v", err)
	}
	err = run([]string{"-profile", path, "-caps", "25", "-hooks"}, io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "--comm_hook auto --auto_profile") {
		t.Errorf("no costs: %v", err)
	}
}
