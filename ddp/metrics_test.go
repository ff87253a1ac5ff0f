package ddp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/reducer"
)

func scrape(t *testing.T, addr string) (string, error) {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("status %s", resp.Status)
	}
	return string(b), err
}

func TestMetricsEndpoint(t *testing.T) {
	m, err := NewMetrics(MetricsOptions{Rank: 1, GoCollectors: true, Getenv: func(k string) string {
		if k == "TORCHELASTIC_RESTART_COUNT" {
			return "3"
		}
		return ""
	}})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ServeMetrics("127.0.0.1:0", m)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close(context.Background())

	// Stats from a real run: the reference sums are computed from them here.
	var wantBytes int64
	var wantColl, passes int
	obsRun(t, 2, 3, -1, 0, Options{}, nil, func(rank, step int, d *DDP, st *reducer.IterStats) error {
		if rank != 1 {
			return nil
		}
		m.ObserveStats(st)
		m.ObserveStats(st) // a repeat is ignored
		passes++
		for b, n := range st.BucketBytes {
			if st.BucketFinished[b] >= st.BucketLaunched[b] {
				wantBytes += n
				wantColl++
			}
		}
		m.ObserveStep(time.Duration(step+1)*time.Millisecond, 2.5-float64(step))
		return nil
	})
	var nilM *Metrics
	nilM.ObserveStep(time.Second, 1)
	nilM.ObserveStats(&reducer.IterStats{})

	body, err := scrape(t, srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range []string{
		`goddp_restarts{rank="1"} 3`,
		`goddp_steps_total{rank="1"} 3`,
		`goddp_loss{rank="1"} 0.5`,
		`goddp_step_seconds_sum{rank="1"} 0.006`,
		`goddp_step_seconds_count{rank="1"} 3`,
		fmt.Sprintf(`goddp_bytes_reduced_total{rank="1"} %d`, wantBytes),
		fmt.Sprintf(`goddp_collective_seconds_count{rank="1"} %d`, wantColl),
		fmt.Sprintf(`goddp_exposed_comm_seconds_count{rank="1"} %d`, passes),
		`go_goroutines`,
	} {
		if !strings.Contains(body, line) {
			t.Errorf("scrape lacks %q", line)
		}
	}
	if t.Failed() {
		t.Log(body)
	}
	if err := srv.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := srv.Close(context.Background()); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := scrape(t, srv.Addr()); err == nil {
		t.Error("scrape after Close succeeded")
	}
	http.DefaultClient.CloseIdleConnections()
}

func TestMetricsBadInput(t *testing.T) {
	if _, err := NewMetrics(MetricsOptions{Getenv: func(string) string { return "x" }}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("bad restart count: %v", err)
	}
	if _, err := ServeMetrics("127.0.0.1:0", nil); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("nil metrics: %v", err)
	}
	m, err := NewMetrics(MetricsOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ServeMetrics("256.0.0.1:bad", m); err == nil {
		t.Error("bad address accepted")
	}
}

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
