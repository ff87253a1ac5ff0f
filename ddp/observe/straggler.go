package observe

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/tracefile"
	"github.com/goddp/goddp/procgroup"
)

// Arrival is one collective (a bucket's all-reduce in one backward pass) and the instant
// each rank issued it, on a clock common to the ranks (any origin).
type Arrival struct {
	Iter, Bucket int
	// At[r] is rank r's arrival; a negative value means unknown.
	At []time.Duration
}

// StragglerReport says which rank arrives last at the collectives, and by how much: the
// skew of a collective is its latest arrival less its earliest, time every other rank spent
// waiting for the last one.
type StragglerReport struct {
	// Collectives is the number of collectives seen (with every rank's arrival known).
	Collectives int
	// LastCount[r] counts the collectives rank r arrived at last (ties count for none).
	LastCount []int
	// MeanLag[r] is rank r's mean arrival after the earliest rank.
	MeanLag []time.Duration
	// Straggler is the rank that arrived last most often, -1 if none did.
	Straggler int
	// The skew distribution.
	SkewP50, SkewP90, SkewMax time.Duration
	// Hosts, when known, names each rank's host (a merged multi-node trace records them),
	// and String names the straggler's.
	Hosts map[int]string
}

// String is the report as one log line, naming the straggler.
func (r StragglerReport) String() string {
	if r.Collectives == 0 {
		return "ddp stragglers: no collectives seen"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "ddp stragglers: %d collectives, skew p50 %s p90 %s max %s; ", r.Collectives, ms(r.SkewP50), ms(r.SkewP90), ms(r.SkewMax))
	if r.Straggler < 0 {
		b.WriteString("no rank arrived last")
	} else {
		b.WriteString("rank " + strconv.Itoa(r.Straggler))
		if h, ok := r.Hosts[r.Straggler]; ok {
			fmt.Fprintf(&b, " (host %s)", h)
		}
		fmt.Fprintf(&b, " arrived last most often (%d of %d, %.0f%%, mean lag %s)", r.LastCount[r.Straggler],
			r.Collectives, 100*float64(r.LastCount[r.Straggler])/float64(r.Collectives), ms(r.MeanLag[r.Straggler]))
	}
	b.WriteString("; last per rank [")
	for i, n := range r.LastCount {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%d", n)
	}
	b.WriteString("]")
	return b.String()
}

// maxSkewSamples bounds the skews a stragglerStats keeps: up to it the percentiles are
// exact; past it they come from a uniform sample of that many (reservoir sampling), so a
// long run's memory stays fixed (512 KiB).
const maxSkewSamples = 1 << 16

// stragglerStats accumulates arrivals.
type stragglerStats struct {
	last    []int
	lag     []time.Duration
	n       int             // collectives seen
	skewMax time.Duration   // exact, whatever the sample holds
	skews   []time.Duration // all skews, or a uniform sample of maxSkewSamples of them
	rng     *rand.Rand      // fixed seed: every rank keeps the same sample of the same data
}

func (s *stragglerStats) add(at []time.Duration) {
	if len(at) == 0 {
		return
	}
	for _, t := range at {
		if t < 0 {
			return
		}
	}
	if len(s.last) < len(at) {
		s.last = append(s.last, make([]int, len(at)-len(s.last))...)
		s.lag = append(s.lag, make([]time.Duration, len(at)-len(s.lag))...)
	}
	lo, hi := slices.Min(at), slices.Max(at)
	s.n++
	s.skewMax = max(s.skewMax, hi-lo)
	if len(s.skews) < maxSkewSamples {
		s.skews = append(s.skews, hi-lo)
	} else {
		if s.rng == nil {
			s.rng = rand.New(rand.NewPCG(1, 2))
		}
		if k := s.rng.IntN(s.n); k < maxSkewSamples {
			s.skews[k] = hi - lo
		}
	}
	if hi > lo {
		if r := slices.Index(at, hi); slices.Index(at[r+1:], hi) < 0 { // a unique latest arrival
			s.last[r]++
		}
	}
	for r, t := range at {
		s.lag[r] += t - lo
	}
}

func (s *stragglerStats) report() StragglerReport {
	n := s.n
	r := StragglerReport{Collectives: n, LastCount: slices.Clone(s.last), MeanLag: make([]time.Duration, len(s.lag)), Straggler: -1}
	if n == 0 {
		return r
	}
	for i, l := range s.lag {
		r.MeanLag[i] = l / time.Duration(n)
	}
	best := 0
	for i, c := range r.LastCount {
		if c > best {
			best, r.Straggler = c, i
		}
	}
	sk := slices.Clone(s.skews)
	slices.Sort(sk)
	pct := func(p float64) time.Duration { return sk[max(int(math.Ceil(p*float64(len(sk))))-1, 0)] }
	r.SkewP50, r.SkewP90, r.SkewMax = pct(0.5), pct(0.9), s.skewMax
	return r
}

// AnalyzeArrivals reports on arrivals (collectives lacking a rank's arrival are skipped).
func AnalyzeArrivals(arrivals []Arrival) StragglerReport {
	var s stragglerStats
	for _, a := range arrivals {
		s.add(a.At)
	}
	return s.report()
}

// ArrivalsFromTrace extracts every collective's arrivals from a merged trace: the launch
// events, keyed by (iter, bucket), placed by rank (pid). Collectives not seen on every rank
// of the file are left out.
func ArrivalsFromTrace(tf *tracefile.File) []Arrival {
	type key struct{ iter, bucket int64 }
	ranks := slices.Clone(tf.OtherData.Ranks)
	byKey := map[key][]time.Duration{}
	var order []key
	for i := range tf.TraceEvents {
		e := &tf.TraceEvents[i]
		if e.Cat != CatLaunch {
			continue
		}
		it, ok1 := e.Arg("iter")
		b, ok2 := e.Arg("bucket")
		if !ok1 || !ok2 {
			continue
		}
		if !slices.Contains(ranks, e.PID) {
			ranks = append(ranks, e.PID)
		}
		k := key{it, b}
		at, ok := byKey[k]
		if !ok {
			order = append(order, k)
		}
		for len(at) <= e.PID {
			at = append(at, -1)
		}
		at[e.PID] = time.Duration(e.TS * float64(time.Microsecond))
		byKey[k] = at
	}
	slices.Sort(ranks)
	out := make([]Arrival, 0, len(order))
	for _, k := range order {
		at := byKey[k]
		row := make([]time.Duration, len(ranks))
		complete := true
		for j, r := range ranks {
			if r >= len(at) || at[r] < 0 {
				complete = false
				break
			}
			row[j] = at[r]
		}
		if complete {
			out = append(out, Arrival{Iter: int(k.iter), Bucket: int(k.bucket), At: row})
		}
	}
	return out
}

// StragglerMonitor gathers every rank's arrival at every bucket's collective while training,
// cheaply: it keeps this rank's launch instants (wall clock) and every Every synced passes
// exchanges them with one AllGather. Every rank must call Record after each Finalize and
// Flush at the end, at the same points (they issue collectives on the DDP's process group).
// Report is the same on every rank. It is not safe for concurrent use.
type StragglerMonitor struct {
	pg       procgroup.ProcessGroup
	every    int
	lastIter int
	passes   int
	pending  []int64 // per pass: iter, number of buckets, the buckets' launch instants (Unix ns)
	gather   []int64
	stats    stragglerStats
	flushes  int
}

// NewStragglerMonitor returns a monitor for d's collectives that exchanges arrivals every
// every synced passes (default 50 when every ≤ 0).
func NewStragglerMonitor(d *ddp.DDP, every int) (*StragglerMonitor, error) {
	if d == nil {
		return nil, fmt.Errorf("%w: NewStragglerMonitor: nil DDP", ddp.ErrInvalidArgument)
	}
	if every <= 0 {
		every = 50
	}
	return &StragglerMonitor{pg: d.ProcessGroup(), every: every}, nil
}

// Record notes this rank's launch instants of one synced pass (nil, NoSync passes and
// repeats are ignored) and, every Every passes, exchanges them with the other ranks.
func (m *StragglerMonitor) Record(ctx context.Context, st *ddp.IterStats) error {
	if st == nil || st.Mode != ddp.Sync || st.Iter == m.lastIter {
		return nil
	}
	m.lastIter = st.Iter
	start := st.Start.UnixNano() // wall clock: common to ranks on one host
	m.pending = append(m.pending, int64(st.Iter), int64(len(st.BucketLaunched)))
	for _, l := range st.BucketLaunched {
		if l < 0 {
			m.pending = append(m.pending, -1)
		} else {
			m.pending = append(m.pending, start+int64(l))
		}
	}
	m.passes++
	if m.passes >= m.every {
		return m.Flush(ctx)
	}
	return nil
}

// Flush exchanges the arrivals recorded since the last exchange (every rank must call it at
// the same point, for instance after the last step).
func (m *StragglerMonitor) Flush(ctx context.Context) error {
	if m.pg.Size() == 1 || m.passes == 0 {
		m.pending, m.passes = m.pending[:0], 0
		return nil
	}
	n, size := len(m.pending), m.pg.Size()
	if cap(m.gather) < n*size {
		m.gather = make([]int64, n*size)
	}
	out := m.gather[:n*size]
	if err := m.pg.AllGather(ctx, out, m.pending).Wait(ctx); err != nil {
		return fmt.Errorf("ddp: rank %d: straggler monitor: exchange %d (backward pass %d): %w", m.pg.Rank(), m.flushes, m.lastIter, err)
	}
	m.flushes++
	at := make([]time.Duration, size)
	for off := 0; off < n; {
		iter, nb := out[off], int(out[off+1])
		for r := 0; r < size; r++ {
			if out[r*n+off] != iter || int(out[r*n+off+1]) != nb {
				return fmt.Errorf("ddp: rank %d: straggler monitor: rank %d recorded pass %d with %d buckets where this rank has pass %d with %d",
					m.pg.Rank(), r, out[r*n+off], out[r*n+off+1], iter, nb)
			}
		}
		for b := 0; b < nb; b++ {
			for r := 0; r < size; r++ {
				at[r] = -1
				if v := out[r*n+off+2+b]; v >= 0 {
					at[r] = time.Duration(v) // Unix ns as a Duration: a common origin
				}
			}
			m.stats.add(at)
		}
		off += 2 + nb
	}
	m.pending, m.passes = m.pending[:0], 0
	return nil
}

// Report returns what the exchanges so far showed.
func (m *StragglerMonitor) Report() StragglerReport { return m.stats.report() }
