package metrics

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/internal/ddptest"
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
	m, err := New(Options{Rank: 1, GoCollectors: true, Getenv: func(k string) string {
		if k == "TORCHELASTIC_RESTART_COUNT" {
			return "3"
		}
		return ""
	}})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := Serve("127.0.0.1:0", m)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close(context.Background())

	// Stats from a real run: the reference sums are computed from them here.
	var wantBytes int64
	var wantColl, passes int
	ddptest.Run(t, 2, 3, -1, 0, ddp.Options{}, nil, func(rank, step int, d *ddp.DDP, st *ddp.IterStats) error {
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
	var nilM *Recorder
	nilM.ObserveStep(time.Second, 1)
	nilM.ObserveStats(&ddp.IterStats{})

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
	if _, err := New(Options{Getenv: func(string) string { return "x" }}); !errors.Is(err, ddp.ErrInvalidArgument) {
		t.Errorf("bad restart count: %v", err)
	}
	if _, err := Serve("127.0.0.1:0", nil); !errors.Is(err, ddp.ErrInvalidArgument) {
		t.Errorf("nil metrics: %v", err)
	}
	m, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Serve("256.0.0.1:bad", m); err == nil {
		t.Error("bad address accepted")
	}
}
