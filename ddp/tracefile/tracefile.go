// Package tracefile reads, merges and writes the Chrome trace event files that ddp's Tracer
// writes (one per rank), without importing ddp or gorgonia: what ddprun --trace_merge and
// cmd/trace-plot need.
//
// # Usage
//
//	err := tracefile.MergeFiles("trace.json", "trace.rank0.json", "trace.rank1.json")
//	tf, err := tracefile.ReadFile("trace.json")
//	for _, e := range tf.TraceEvents { ... }
package tracefile

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
)

// EnvVar names the environment variable observe.OpenTrace falls back to for its path;
// ddprun --trace_merge sets it for every rank.
const EnvVar = "GODDP_TRACE"

// ErrInvalidArgument: Merge was given no traces, or two traces of one rank. It is its own,
// not ddp's, as this package imports neither ddp nor its dependencies.
var ErrInvalidArgument = errors.New("tracefile: invalid argument")

// Event is one event of a Chrome trace event file, as Read decodes it.
type Event struct {
	Name string         `json:"name"`
	Cat  string         `json:"cat,omitempty"`
	Ph   string         `json:"ph"`
	TS   float64        `json:"ts"`            // µs since the file's epoch
	Dur  float64        `json:"dur,omitempty"` // µs, for "X" events
	PID  int            `json:"pid"`
	TID  int            `json:"tid"`
	S    string         `json:"s,omitempty"`
	Args map[string]any `json:"args,omitempty"`
}

// Arg returns the integer argument key of e, and whether e has it.
func (e *Event) Arg(key string) (int64, bool) {
	switch v := e.Args[key].(type) {
	case float64:
		return int64(v), true
	case json.Number:
		n, err := v.Int64()
		return n, err == nil
	}
	return 0, false
}

// End is the end of a complete event (TS for others).
func (e *Event) End() float64 { return e.TS + e.Dur }

// Meta is the otherData of a goddp trace.
type Meta struct {
	// EpochUnixMicro is the wall-clock instant of ts 0, in µs since the Unix epoch.
	EpochUnixMicro int64 `json:"goddp_epoch_unix_us"`
	// Clock says how the ranks' clocks were aligned ("wall").
	Clock string `json:"goddp_clock,omitempty"`
	// Ranks lists the ranks whose events the file holds.
	Ranks     []int `json:"goddp_ranks"`
	WorldSize int   `json:"goddp_world_size,omitempty"`
	// Offsets (merged files) is the shift applied to each input file's timestamps, in µs,
	// one per input file in the order given to Merge.
	Offsets []float64 `json:"goddp_offsets_us,omitempty"`
	// Hosts names each rank's host, where the launcher recorded it (ddprun --trace_merge
	// on several nodes: "HOSTNAME node N").
	Hosts map[int]string `json:"goddp_hosts,omitempty"`
}

// File is a whole trace: a Tracer's output, or Merge's.
type File struct {
	DisplayTimeUnit string  `json:"displayTimeUnit,omitempty"`
	OtherData       Meta    `json:"otherData"`
	TraceEvents     []Event `json:"traceEvents"`
}

// Read decodes a trace. The file of a rank that died while writing lacks its end: it
// is repaired by dropping the last, partial event.
func Read(r io.Reader) (*File, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("ddp: read trace: %w", err)
	}
	var tf File
	err = json.Unmarshal(data, &tf)
	if err == nil {
		return &tf, nil
	}
	var syn *json.SyntaxError
	if !errors.As(err, &syn) && !errors.Is(err, io.ErrUnexpectedEOF) {
		return nil, fmt.Errorf("ddp: read trace: %w", err)
	}
	// A truncated file: events are written one per line, so the complete ones end before
	// the last newline.
	trimmed := bytes.TrimRight(data, " \n\r\t")
	for _, cut := range [][]byte{trimmed, trimmed[:max(bytes.LastIndexByte(trimmed, '\n'), 0)]} {
		fixed := append(bytes.TrimSuffix(bytes.TrimRight(cut, " \n"), []byte(",")), "\n]}"...)
		var tf2 File
		if json.Unmarshal(fixed, &tf2) == nil {
			return &tf2, nil
		}
	}
	return nil, fmt.Errorf("ddp: read trace: %w", err)
}

// ReadFile reads the trace in file path.
func ReadFile(path string) (*File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("ddp: %w", err)
	}
	defer f.Close()
	tf, err := Read(f)
	if err != nil {
		return nil, fmt.Errorf("%w (%s)", err, path)
	}
	return tf, nil
}

// Merge merges the traces of several ranks into one, on the earliest file's epoch:
// each file's timestamps are shifted by the difference of its epoch from that one (Note
// [Trace format]). The ranks must differ between files.
func Merge(files ...*File) (*File, error) {
	if len(files) == 0 {
		return nil, fmt.Errorf("%w: Merge: no traces", ErrInvalidArgument)
	}
	epoch := files[0].OtherData.EpochUnixMicro
	for _, f := range files {
		epoch = min(epoch, f.OtherData.EpochUnixMicro)
	}
	out := &File{DisplayTimeUnit: "ms", OtherData: Meta{EpochUnixMicro: epoch, Clock: "wall"}}
	seen := map[int]int{}
	n := 0
	for _, f := range files {
		n += len(f.TraceEvents)
	}
	out.TraceEvents = make([]Event, 0, n)
	for k, f := range files {
		for _, r := range f.OtherData.Ranks {
			if j, dup := seen[r]; dup {
				return nil, fmt.Errorf("%w: Merge: rank %d is in traces %d and %d", ErrInvalidArgument, r, j, k)
			}
			seen[r] = k
			out.OtherData.Ranks = append(out.OtherData.Ranks, r)
		}
		out.OtherData.WorldSize = max(out.OtherData.WorldSize, f.OtherData.WorldSize)
		for r, h := range f.OtherData.Hosts {
			if out.OtherData.Hosts == nil {
				out.OtherData.Hosts = map[int]string{}
			}
			out.OtherData.Hosts[r] = h
		}
		d := f.OtherData.EpochUnixMicro - epoch
		if d < 0 { // it overflowed: no two real clocks are 292,000 years apart
			return nil, fmt.Errorf("%w: Merge: trace %d's epoch %d µs is too far from trace epoch %d µs", ErrInvalidArgument, k, f.OtherData.EpochUnixMicro, epoch)
		}
		shift := float64(d)
		out.OtherData.Offsets = append(out.OtherData.Offsets, shift)
		for _, e := range f.TraceEvents {
			if e.Ph != "M" {
				e.TS += shift
			}
			out.TraceEvents = append(out.TraceEvents, e)
		}
	}
	slices.Sort(out.OtherData.Ranks)
	return out, nil
}

// Write encodes tf (for instance a merged trace) to w.
func Write(w io.Writer, tf *File) error {
	enc := json.NewEncoder(w)
	if err := enc.Encode(tf); err != nil {
		return fmt.Errorf("ddp: write trace: %w", err)
	}
	return nil
}

// MergeFiles reads the traces in paths, merges them and writes the result to out.
func MergeFiles(out string, paths ...string) error {
	files := make([]*File, 0, len(paths))
	for _, p := range paths {
		tf, err := ReadFile(p)
		if err != nil {
			return err
		}
		files = append(files, tf)
	}
	m, err := Merge(files...)
	if err != nil {
		return err
	}
	f, err := os.Create(out)
	if err != nil {
		return fmt.Errorf("ddp: %w", err)
	}
	if err := Write(f, m); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("ddp: %w", err)
	}
	return nil
}
