package tracefile

import (
	"errors"
	"math/rand/v2"
	"testing"
	"time"
)

func comm(rank int, ts, dur float64, step, iter, bucket, bytes int64) Event {
	return Event{Name: "all-reduce", Cat: "comm", Ph: "X", TS: ts, Dur: dur, PID: rank,
		Args: map[string]any{"step": float64(step), "iter": float64(iter), "bucket": float64(bucket), "bytes": float64(bytes)}}
}

func TestLinkUse(t *testing.T) {
	tf := &File{OtherData: Meta{Ranks: []int{0, 1}}, TraceEvents: []Event{
		// step 0 (warm-up, skipped with fromStep 1)
		comm(0, 0, 50, 0, 1, 0, 1000), comm(1, 0, 50, 0, 1, 0, 1000),
		// step 1, bucket 0: rank 1 starts 30 µs late; on the wire [130, 200]
		comm(0, 100, 100, 1, 2, 0, 400), comm(1, 130, 60, 1, 2, 0, 400),
		// step 1, bucket 1: [190, 260] overlaps bucket 0: the union is [130, 260]
		comm(0, 180, 80, 1, 2, 1, 600), comm(1, 190, 60, 1, 2, 1, 600),
		// step 2, bucket 0: [1000, 1100]
		comm(0, 1000, 100, 2, 3, 0, 400), comm(1, 990, 90, 2, 3, 0, 400),
		// step 2, bucket 1: only rank 0 traced it (rank 1's trace ended): not counted
		comm(0, 1200, 100, 2, 3, 1, 600),
		// not comm events
		{Name: "launch 0", Cat: "launch", Ph: "i", TS: 5000, PID: 0, Args: map[string]any{"step": 2.0, "iter": 3.0, "bucket": 0.0}},
	}}
	got, err := LinkUse(tf, 1)
	if err != nil {
		t.Fatal(err)
	}
	want := InFlight{Ranks: 2, Collectives: 3, Bytes: 1400, Busy: (130 + 100) * time.Microsecond}
	if got != want {
		t.Errorf("LinkUse = %+v, want %+v", got, want)
	}
	all, err := LinkUse(tf, 0)
	if err != nil {
		t.Fatal(err)
	}
	if all.Collectives != 4 || all.Bytes != 2400 || all.Busy != (50+130+100)*time.Microsecond {
		t.Errorf("LinkUse from step 0 = %+v", all)
	}
	if _, err := LinkUse(tf, 3); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("no collective after the last step: %v", err)
	}
	if _, err := LinkUse(&File{}, 0); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("no ranks: %v", err)
	}
}

// TestLinkUseRandom compares the union with a count of busy microseconds on random traces
// of three ranks, integer times.
func TestLinkUseRandom(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		tf := &File{OtherData: Meta{Ranks: []int{0, 1, 2}}}
		busy := make([]bool, 2000)
		var bytes int64
		n := 1 + r.IntN(12)
		for b := range n {
			var start, end int
			for rank := range 3 {
				s := r.IntN(1500)
				d := 1 + r.IntN(400)
				tf.TraceEvents = append(tf.TraceEvents, comm(rank, float64(s), float64(d), 1, 1, int64(b), int64(b+1)))
				start, end = max(start, s), max(end, s+d)
			}
			for us := start; us < end; us++ {
				busy[us] = true
			}
			bytes += int64(b + 1)
		}
		want := 0
		for _, v := range busy {
			if v {
				want++
			}
		}
		got, err := LinkUse(tf, 0)
		if err != nil {
			t.Fatal(err)
		}
		if got.Busy != time.Duration(want)*time.Microsecond || got.Bytes != bytes || got.Collectives != n {
			t.Fatalf("LinkUse = %+v, want busy %dµs, %d bytes, %d collectives", got, want, bytes, n)
		}
	}
}
