package tracefile

import (
	"bytes"
	"errors"
	"testing"
)

// FuzzRead: Read decodes or repairs any bytes without panicking; what it accepts merges
// (alone, and with a second trace of another rank), shifts no file back in time, writes,
// and reads back with the same events.
func FuzzRead(f *testing.F) {
	f.Add([]byte(`{"otherData":{"goddp_epoch_unix_us":5,"goddp_ranks":[0]},"traceEvents":[
{"name":"step","ph":"X","ts":1,"dur":2,"pid":0,"tid":0,"args":{"step":3}},
{"name":"all-reduce 0","cat":"comm","ph":"X","ts":1,"dur":2,"pid":0,"tid":1,"args":{"step":0,"iter":0,"bucket":0,"bytes":64}}
]}`))
	f.Add([]byte(`{"otherData":{"goddp_epoch_unix_us":5,"goddp_ranks":[1]},"traceEvents":[
{"name":"step","ph":"X","ts":1,"dur":2,"pid":1,"tid":0},
{"name":"cut","ph":"X","ts":1,"du`)) // a rank that died mid-write
	f.Add([]byte(`{"otherData":{"goddp_epoch_unix_us":-9223372036854775808,"goddp_ranks":[2]},"traceEvents":[]}`))
	f.Add([]byte("\n"))
	f.Add([]byte(`{"traceEvents":[{"ts":1e308,"dur":1e308}]}`))
	other := &File{OtherData: Meta{EpochUnixMicro: 9223372036854775807, Ranks: []int{1 << 30}},
		TraceEvents: []Event{{Name: "x", Ph: "X", TS: 1, Dur: 1, PID: 1 << 30}}}
	f.Fuzz(func(t *testing.T, data []byte) {
		tf, err := Read(bytes.NewReader(data))
		if err != nil {
			return
		}
		for _, in := range [][]*File{{tf}, {tf, other}} {
			m, err := Merge(in...)
			if err != nil {
				if !errors.Is(err, ErrInvalidArgument) {
					t.Fatalf("Merge: %v; want ErrInvalidArgument", err)
				}
				continue
			}
			for i, off := range m.OtherData.Offsets {
				if off < 0 {
					t.Fatalf("file %d shifted by %g µs: before the earliest epoch %d", i, off, m.OtherData.EpochUnixMicro)
				}
			}
			LinkUse(m, 0)
			var buf bytes.Buffer
			if err := Write(&buf, m); err != nil {
				continue // a value JSON cannot hold (an infinite ts): refused with an error
			}
			back, err := Read(&buf)
			if err != nil {
				t.Fatalf("Read of Write's output: %v\n%s", err, buf.Bytes())
			}
			if len(back.TraceEvents) != len(m.TraceEvents) {
				t.Fatalf("%d events written, %d read back", len(m.TraceEvents), len(back.TraceEvents))
			}
		}
	})
}
