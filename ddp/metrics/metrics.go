package metrics

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/goddp/goddp/ddp"
)

// Options configure a Recorder.
type Options struct {
	// Rank labels every metric (label "rank").
	Rank int
	// Getenv reads TORCHELASTIC_RESTART_COUNT for the restarts gauge (default os.Getenv).
	Getenv func(string) string
	// GoCollectors adds the Go runtime and process collectors to the registry.
	GoCollectors bool
}

// Recorder holds a rank's Prometheus metrics, in a registry of their own (never the global
// one): step time, steps, loss, bytes reduced, the latency of each bucket's collective, the
// exposed communication, and the group's restarts. A nil *Recorder is valid and records
// nothing. Its methods are safe for concurrent use.
type Recorder struct {
	reg        *prometheus.Registry
	stepTime   prometheus.Histogram
	steps      prometheus.Counter
	loss       prometheus.Gauge
	bytes      prometheus.Counter
	collective prometheus.Histogram
	exposed    prometheus.Histogram
	overlap    prometheus.Gauge
	restarts   prometheus.Gauge

	mu       sync.Mutex // guards lastIter
	lastIter int
}

// New returns a rank's metrics, registered in a new registry.
func New(opts Options) (*Recorder, error) {
	if opts.Getenv == nil {
		opts.Getenv = os.Getenv
	}
	labels := prometheus.Labels{"rank": strconv.Itoa(opts.Rank)}
	lat := prometheus.ExponentialBuckets(50e-6, 2, 18) // 50µs … 6.5s
	m := &Recorder{
		reg: prometheus.NewRegistry(),
		stepTime: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "goddp_step_seconds",
			Help: "Wall time of a training step.", ConstLabels: labels, Buckets: prometheus.ExponentialBuckets(1e-3, 1.5, 24)}),
		steps: prometheus.NewCounter(prometheus.CounterOpts{Name: "goddp_steps_total",
			Help: "Training steps completed.", ConstLabels: labels}),
		loss: prometheus.NewGauge(prometheus.GaugeOpts{Name: "goddp_loss",
			Help: "Loss of the last step.", ConstLabels: labels}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{Name: "goddp_bytes_reduced_total",
			Help: "Bytes of gradient buckets all-reduced.", ConstLabels: labels}),
		collective: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "goddp_collective_seconds",
			Help: "Latency of a bucket's collective, from its launch to its observed completion.", ConstLabels: labels, Buckets: lat}),
		exposed: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "goddp_exposed_comm_seconds",
			Help: "Communication not hidden behind backward, per synced pass.", ConstLabels: labels, Buckets: lat}),
		overlap: prometheus.NewGauge(prometheus.GaugeOpts{Name: "goddp_overlap_ratio",
			Help: "Fraction of the last synced pass's communication hidden behind backward.", ConstLabels: labels}),
		restarts: prometheus.NewGauge(prometheus.GaugeOpts{Name: "goddp_restarts",
			Help: "Restarts of the group so far (TORCHELASTIC_RESTART_COUNT).", ConstLabels: labels}),
	}
	cs := []prometheus.Collector{m.stepTime, m.steps, m.loss, m.bytes, m.collective, m.exposed, m.overlap, m.restarts}
	if opts.GoCollectors {
		cs = append(cs, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	for _, c := range cs {
		if err := m.reg.Register(c); err != nil {
			return nil, fmt.Errorf("ddp: metrics: %w", err)
		}
	}
	if s := opts.Getenv("TORCHELASTIC_RESTART_COUNT"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			return nil, fmt.Errorf("%w: TORCHELASTIC_RESTART_COUNT=%q: want a count", ddp.ErrInvalidArgument, s)
		}
		m.restarts.Set(float64(n))
	}
	return m, nil
}

// Registry is the metrics' registry, to add the trainer's own collectors to.
func (m *Recorder) Registry() *prometheus.Registry { return m.reg }

// Handler serves the metrics in the Prometheus exposition format.
func (m *Recorder) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// ObserveStep records one training step: its wall time and its loss.
func (m *Recorder) ObserveStep(d time.Duration, loss float64) {
	if m == nil {
		return
	}
	m.steps.Inc()
	m.stepTime.Observe(d.Seconds())
	m.loss.Set(loss)
}

// ObserveStats records one backward pass's communication (call it with d.Stats() after each
// Finalize; NoSync passes and repeats are ignored).
func (m *Recorder) ObserveStats(st *ddp.IterStats) {
	if m == nil || st == nil || st.Mode != ddp.Sync {
		return
	}
	m.mu.Lock()
	if st.Iter == m.lastIter {
		m.mu.Unlock()
		return
	}
	m.lastIter = st.Iter
	m.mu.Unlock()
	for b, l := range st.BucketLaunched {
		if f := st.BucketFinished[b]; l >= 0 && f >= l {
			m.collective.Observe((f - l).Seconds())
			m.bytes.Add(float64(st.BucketBytes[b]))
		}
	}
	m.exposed.Observe(st.Exposed().Seconds())
	if c := st.Comm(); c > 0 {
		m.overlap.Set(float64(st.Overlap()) / float64(c))
	}
}

// Server serves a Recorder's registry over HTTP at /metrics.
type Server struct {
	srv  *http.Server
	ln   net.Listener
	done chan struct{} // closed when the serving goroutine has returned
	err  error         // Serve's error, set before done is closed
}

// Serve listens on addr (host:port; port 0 picks a free one) and serves m at /metrics
// until Close. It returns once it is listening.
func Serve(addr string, m *Recorder) (*Server, error) {
	if m == nil {
		return nil, fmt.Errorf("%w: metrics.Serve: nil Recorder", ddp.ErrInvalidArgument)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("ddp: metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", m.Handler())
	s := &Server{srv: &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}, ln: ln, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.err = err
		}
	}()
	return s, nil
}

// Addr is the address the server listens on.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the server: it stops listening, lets in-flight scrapes finish until ctx ends
// (then drops them), and waits for the serving goroutine. It is idempotent.
func (s *Server) Close(ctx context.Context) error {
	err := s.srv.Shutdown(ctx)
	if err != nil {
		err = errors.Join(err, s.srv.Close())
	}
	<-s.done
	if err == nil && s.err != nil {
		err = s.err
	}
	if err != nil {
		return fmt.Errorf("ddp: metrics server: %w", err)
	}
	return nil
}
