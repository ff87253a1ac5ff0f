package observe

import (
	"bytes"
	"testing"
	"time"
)

// fakeClock advances by the durations given to tick.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time       { return c.t }
func (c *fakeClock) tick(d time.Duration) { c.t = c.t.Add(d) }
func newFakeClock() *fakeClock            { return &fakeClock{t: time.Unix(1000, 0)} }
func progressRun(p *Progress, c *fakeClock) {
	for s := range 10 {
		c.tick(100 * time.Millisecond)
		p.Update(s, 10-float64(s))
	}
}

func TestProgressPlain(t *testing.T) {
	var buf bytes.Buffer
	c := newFakeClock()
	p := NewProgress(&buf, ProgressOptions{Total: 10, Every: 350 * time.Millisecond, Now: c.now})
	progressRun(p, c)
	p.Done()
	want := "step 1/10  loss 10.0000\n" +
		"step 5/10  loss 6.0000  100.0 ms/step  ETA 1s\n" +
		"step 9/10  loss 2.0000  100.0 ms/step  ETA 0s\n" +
		"step 10/10  loss 1.0000  100.0 ms/step  ETA 0s\n"
	if got := buf.String(); got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
}

func TestProgressTerminal(t *testing.T) {
	var buf bytes.Buffer
	c := newFakeClock()
	p := NewProgress(&buf, ProgressOptions{Total: 1000, Mode: ProgressTerminal, Now: c.now}) // every 200ms
	for s := range 5 {
		c.tick(100 * time.Millisecond)
		p.Update(s, 1/float64(s+1))
	}
	p.Done()
	p.Done()
	want := "\rstep 1/1000  loss 1.0000" +
		"\rstep 3/1000  loss 0.3333  100.0 ms/step  ETA 1m40s" +
		"\rstep 5/1000  loss 0.2000  100.0 ms/step  ETA 1m40s\n"
	if got := buf.String(); got != want {
		t.Errorf("got %q\nwant %q", got, want)
	}
	var nilP *Progress
	nilP.Update(1, 1)
	nilP.Done()
	// A bytes.Buffer is not a terminal: auto mode writes plain lines.
	if NewProgress(&buf, ProgressOptions{}).tty {
		t.Error("a buffer taken for a terminal")
	}
}
