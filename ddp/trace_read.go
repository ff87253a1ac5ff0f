package ddp

import (
	"io"

	"github.com/goddp/goddp/ddp/tracefile"
)

// The trace file types and functions live in package tracefile (which needs neither ddp nor
// gorgonia, so ddprun and trace-plot stay small); these names keep them at hand for trainers.

// TraceEvent is one event of a Chrome trace event file (tracefile.Event).
type TraceEvent = tracefile.Event

// TraceMeta is the otherData of a goddp trace (tracefile.Meta).
type TraceMeta = tracefile.Meta

// TraceFile is a whole trace: a Tracer's output, or MergeTraces's (tracefile.File).
type TraceFile = tracefile.File

// ReadTrace decodes a trace, repairing the file of a rank that died while writing it
// (tracefile.Read).
func ReadTrace(r io.Reader) (*TraceFile, error) { return tracefile.Read(r) }

// ReadTraceFile reads the trace in file path (tracefile.ReadFile).
func ReadTraceFile(path string) (*TraceFile, error) { return tracefile.ReadFile(path) }

// MergeTraces merges the traces of several ranks into one on the earliest file's epoch
// (tracefile.Merge); an empty list or a rank in two files is an error wrapping
// tracefile.ErrInvalidArgument.
func MergeTraces(files ...*TraceFile) (*TraceFile, error) { return tracefile.Merge(files...) }

// WriteTrace encodes tf to w (tracefile.Write).
func WriteTrace(w io.Writer, tf *TraceFile) error { return tracefile.Write(w, tf) }

// MergeTraceFiles reads the traces in paths, merges them and writes the result to out
// (tracefile.MergeFiles).
func MergeTraceFiles(out string, paths ...string) error { return tracefile.MergeFiles(out, paths...) }
