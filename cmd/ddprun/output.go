package main

import (
	"bufio"
	"errors"
	"io"
	"os"
	"sync"
)

// maxLine bounds the bytes of one output line ddprun holds: a longer line is emitted in
// pieces of this size, each with its own prefix.
const maxLine = 1 << 20

// tailLines is how many of a failed rank's last lines the failure report shows.
const tailLines = 10

// stream names one of a rank's two output streams.
type stream int

const (
	streamStdout stream = iota
	streamStderr
)

// console is where ranks' lines meet ddprun's own output. Each line goes out in one Write
// under mu, so lines from different ranks never interleave mid-line, and rank output never
// interleaves with ddprun's messages.
type console struct {
	mu  sync.Mutex // guards writes to out and err
	out io.Writer
	err io.Writer
}

// line writes prefix+text+"\n" to the stream's writer.
func (c *console) line(s stream, prefix string, text []byte) {
	buf := make([]byte, 0, len(prefix)+len(text)+1)
	buf = append(append(append(buf, prefix...), text...), '\n')
	c.mu.Lock()
	defer c.mu.Unlock()
	w := c.out
	if s == streamStderr {
		w = c.err
	}
	w.Write(buf) //nolint:errcheck // a console that fails to write has nobody to tell
}

// msg writes one of ddprun's own messages to the error stream.
func (c *console) msg(text string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	io.WriteString(c.err, text) //nolint:errcheck // see line
}

// tail keeps a stream's last lines for the failure report. (One per stream: the order in
// which lines of two pipes arrive is not the order they were written in, so a shared ring
// could lose the last stderr lines to stdout lines written before them.)
type tail struct {
	mu    sync.Mutex // guards the fields below
	lines [tailLines]string
	next  int // index of the next slot to write
	n     int // lines held, at most tailLines
}

func (t *tail) add(text []byte) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.lines[t.next] = string(text)
	t.next = (t.next + 1) % tailLines
	if t.n < tailLines {
		t.n++
	}
}

// get returns the held lines, oldest first.
func (t *tail) get() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]string, 0, t.n)
	for i := 0; i < t.n; i++ {
		out = append(out, t.lines[(t.next-t.n+i+tailLines)%tailLines])
	}
	return out
}

// sink receives the lines of one stream of one rank.
type sink struct {
	s       stream
	prefix  string
	console *console // nil: not shown on the console
	file    *os.File // nil: no log file
	tail    *tail
	buf     []byte // reused for log-file writes
}

// emit delivers one line (without its newline). Log-file write errors are returned so the
// caller can report them once.
func (k *sink) emit(text []byte) error {
	k.tail.add(text)
	if k.console != nil {
		k.console.line(k.s, k.prefix, text)
	}
	if k.file != nil {
		k.buf = append(append(k.buf[:0], text...), '\n')
		if _, err := k.file.Write(k.buf); err != nil {
			return err
		}
	}
	return nil
}

// pump reads r line by line until EOF and hands each line to k. A final line without a
// newline is delivered as a line; a line longer than maxLine is delivered in pieces. It
// returns the first log-file write error, after draining r (a rank must never block on a
// full pipe because its log disk is full).
func pump(r io.Reader, k *sink) error {
	br := bufio.NewReaderSize(r, 64<<10)
	var long []byte // a line longer than the reader's buffer, being assembled
	var ferr error
	deliver := func(b []byte) {
		if err := k.emit(b); err != nil && ferr == nil {
			ferr = err
			k.file = nil
		}
	}
	for {
		chunk, err := br.ReadSlice('\n')
		switch {
		case err == nil:
			chunk = chunk[:len(chunk)-1]
			if long != nil {
				deliver(append(long, chunk...))
				long = nil
			} else {
				deliver(chunk)
			}
		case errors.Is(err, bufio.ErrBufferFull):
			long = append(long, chunk...)
			for len(long) >= maxLine {
				deliver(long[:maxLine])
				long = append([]byte(nil), long[maxLine:]...)
			}
		default: // io.EOF, or the pipe failed: deliver what is left and stop
			if len(long)+len(chunk) > 0 {
				deliver(append(long, chunk...))
			}
			return ferr
		}
	}
}
