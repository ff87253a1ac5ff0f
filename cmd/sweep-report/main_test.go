package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestReport(t *testing.T) {
	dir := t.TempDir()
	raw := filepath.Join(dir, "raw.csv")
	data := "system,kind,bucket_cap_mb,repeat,ms_step\n" +
		"goddp,ddp,1,1,120\ngoddp,ddp,1,2,140\ngoddp,ddp,1,3,130\n" +
		"goddp,ddp,25,1,100\ngoddp,ddp,25,2,110\n" +
		"goddp,compute,,1,80\ngoddp,compute,,2,90\n" +
		"torch,ddp,1,1,150\ntorch,ddp,25,1,150\ntorch,compute,,1,100\n"
	if err := os.WriteFile(raw, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	if err := run(raw, dir, &out); err != nil {
		t.Fatal(err)
	}
	table := out.String()
	for _, want := range []string{
		"| 1 | 130.0 | 120.0..140.0 | 1.24x | 45.0 | 34.6% |", // median 130, best 105, compute 85
		"| 25 | 105.0 | 100.0..110.0 | 1.00x | 20.0 | 19.0% |",
		"| 1 | 150.0 | 150.0..150.0 | 1.00x | 50.0 | 33.3% |",
		"| 25 | 0.70 |", // 105/150
		"| compute only | 0.85 |",
	} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
	sum, err := os.ReadFile(filepath.Join(dir, "summary.csv"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(sum), "goddp,25,105.000,100.000,110.000,2,1.0000,85.000,20.000,0.1905\n") {
		t.Errorf("summary.csv:\n%s", sum)
	}
	for _, f := range []string{"sweep.svg", "sweep.png", "table.md"} {
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Size() == 0 {
			t.Errorf("%s missing or empty: %v", f, err)
		}
	}
}

func TestReportBadInput(t *testing.T) {
	dir := t.TempDir()
	for name, data := range map[string]string{
		"header": "a,b\n",
		"ms":     "system,kind,bucket_cap_mb,repeat,ms_step\ngoddp,ddp,1,1,x\n",
		"kind":   "system,kind,bucket_cap_mb,repeat,ms_step\ngoddp,other,1,1,3\n",
		"empty":  "system,kind,bucket_cap_mb,repeat,ms_step\n",
	} {
		raw := filepath.Join(dir, name+".csv")
		if err := os.WriteFile(raw, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := run(raw, dir, &strings.Builder{}); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}
