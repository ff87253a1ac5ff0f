package sweepcsv

import (
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestRead(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "raw.csv")
	// A quoted field over two lines: the next row's line is the file's, not its index.
	data := RawLayout + "\ngoddp,ddp,1,1,10,\"1 2\n3\"\ntorch,ddp,1,1,12,\n"
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	tb, err := Read(path, "raw.csv", Raw, RawLayout)
	if err != nil {
		t.Fatal(err)
	}
	want := &Table{Header: RawLayout, Rows: [][]string{{"goddp", "ddp", "1", "1", "10", "1 2\n3"}, {"torch", "ddp", "1", "1", "12", ""}}, Lines: []int{2, 4}}
	if !reflect.DeepEqual(tb, want) {
		t.Errorf("Read: %+v, want %+v", tb, want)
	}
	for name, data := range map[string]string{
		"other header": Raw + ",x\n",
		"empty":        "",
		"short row":    Raw + "\ngoddp,ddp\n",
	} {
		if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := Read(path, "raw.csv", Raw, RawLayout)
		if err == nil || !strings.Contains(err.Error(), path) {
			t.Errorf("%s: %v, want an error naming the file", name, err)
		}
		if name != "short row" && (err == nil || !strings.Contains(err.Error(), "not a raw.csv")) {
			t.Errorf("%s: %v, want it to say what the file is not", name, err)
		}
	}
	if _, err := Read(filepath.Join(dir, "none.csv"), "raw.csv", Raw); err == nil {
		t.Error("a missing file: no error")
	}
}

// TestMedian checks Median on random data, with repeats, against the middle order
// statistics found by counting: x is the k-th smallest (from 0) where fewer than k+1 values
// are below it and more than k are at or below it.
func TestMedian(t *testing.T) {
	if m := Median(nil); !math.IsNaN(m) {
		t.Errorf("Median(nil) = %v, want NaN", m)
	}
	kth := func(xs []float64, k int) float64 {
		for _, x := range xs {
			below, atOrBelow := 0, 0
			for _, y := range xs {
				if y < x {
					below++
				}
				if y <= x {
					atOrBelow++
				}
			}
			if below <= k && k < atOrBelow {
				return x
			}
		}
		panic("no k-th value")
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for n := 1; n <= 40; n++ {
		xs := make([]float64, n)
		for i := range xs {
			xs[i] = math.Round(rng.Float64()*20) / 2
		}
		orig := append([]float64(nil), xs...)
		want := (kth(xs, (n-1)/2) + kth(xs, n/2)) / 2
		if m := Median(xs); m != want {
			t.Errorf("Median(%v) = %v, want %v", xs, m, want)
		}
		if !reflect.DeepEqual(xs, orig) {
			t.Fatalf("Median changed its input")
		}
	}
}
