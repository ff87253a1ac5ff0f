package procgroup_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	_ "github.com/goddp/goddp/backends/gloo"
	"github.com/goddp/goddp/procgroup"
	"github.com/goddp/goddp/procgroup/pgtest"
)

// The package's TestMain (grpcstore_test.go) checks goroutine leaks for these tests too.

var worldN atomic.Int64

// world is a set of ranks in this process, their inner groups on backend "cluster"
// (pgtest.NewCluster) or "gloo" (real sockets), sharing one MemStore.
type world struct {
	store *procgroup.MemStore
	inner []procgroup.ProcessGroup
}

func newWorld(t testing.TB, backend string, n int) *world {
	t.Helper()
	w := &world{store: procgroup.NewMemStore()}
	t.Cleanup(func() { w.store.Close() })
	switch backend {
	case "cluster":
		c := pgtest.NewCluster(n)
		t.Cleanup(c.Close)
		w.inner = c.Groups()
	case "gloo":
		w.inner = make([]procgroup.ProcessGroup, n)
		errs := make([]error, n)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		prefix := fmt.Sprintf("w%d", worldN.Add(1))
		var wg sync.WaitGroup
		for r := range n {
			wg.Go(func() {
				w.inner[r], errs[r] = procgroup.New(ctx, "gloo", procgroup.Options{
					Rank: r, Size: n, Store: w.store, Prefix: prefix, Token: "test-token",
				})
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			for _, g := range w.inner {
				if g != nil {
					g.Abort(nil)
				}
			}
			t.Fatalf("gloo groups: %v", err)
		}
	default:
		t.Fatalf("unknown backend %q", backend)
	}
	return w
}

// wdStore is the watchdogs' store of world w.
func (w *world) wdStore() procgroup.Store {
	return procgroup.PrefixStore{Prefix: "watchdog", Store: w.store}
}

func mustWatchdog(t testing.TB, pg procgroup.ProcessGroup, store procgroup.Store, opts procgroup.WatchdogOptions) procgroup.ProcessGroup {
	t.Helper()
	g, err := procgroup.WithWatchdog(pg, store, opts)
	if err != nil {
		t.Fatalf("WithWatchdog: %v", err)
	}
	return g
}

func mustDebug(t testing.TB, pg procgroup.ProcessGroup, opts procgroup.DebugOptions) procgroup.ProcessGroup {
	t.Helper()
	g, err := procgroup.WithDebug(pg, opts)
	if err != nil {
		t.Fatalf("WithDebug: %v", err)
	}
	return g
}

// runRanks runs f for every rank on its own goroutine and waits.
func runRanks(gs []procgroup.ProcessGroup, f func(rank int, pg procgroup.ProcessGroup)) {
	var wg sync.WaitGroup
	for r, g := range gs {
		wg.Go(func() { f(r, g) })
	}
	wg.Wait()
}

func closeAll(gs []procgroup.ProcessGroup) {
	runRanks(gs, func(_ int, g procgroup.ProcessGroup) { g.Close() })
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// randomInputs returns n ranks' random float64 inputs of count elements and their sum,
// computed in rank order in float64 (the reference).
func randomInputs(seed uint64, n, count int) (ins [][]float64, sum []float64) {
	r := rand.New(rand.NewPCG(seed, 1))
	ins = make([][]float64, n)
	sum = make([]float64, count)
	for k := range ins {
		ins[k] = make([]float64, count)
		for i := range ins[k] {
			ins[k][i] = r.Float64()*2 - 1
			sum[i] += ins[k][i]
		}
	}
	return ins, sum
}

// checkSum reports the first element of got that differs from want by more than rounding.
func checkSum(got, want []float64) error {
	if len(got) != len(want) {
		return fmt.Errorf("%d elements, want %d", len(got), len(want))
	}
	for i := range got {
		if math.Abs(got[i]-want[i]) > 1e-12*(1+math.Abs(want[i])) {
			return fmt.Errorf("element %d = %v, want %v", i, got[i], want[i])
		}
	}
	return nil
}

func TestWatchdogConformance(t *testing.T) {
	pgtest.Run(t, func(t testing.TB, n int) []procgroup.ProcessGroup {
		w := newWorld(t, "cluster", n)
		gs := make([]procgroup.ProcessGroup, n)
		for r := range gs {
			gs[r] = mustWatchdog(t, w.inner[r], w.wdStore(), procgroup.WatchdogOptions{
				Timeout: time.Minute, Interval: 10 * time.Millisecond, LookupEnv: noEnv,
			})
		}
		return gs
	}, pgtest.SuiteOptions{Short: true, Sizes: []int{1, 2, 3, 4}})
}

func noEnv(string) (string, bool) { return "", false }

// TestWatchdogStall makes a hang on purpose: rank 2 never issues all-reduce #2 (it waits
// until its watchdog reports the abort). The waiting ranks warn about rank 2, then time out,
// and every rank, the stuck one included, fails with an error naming the op, the sequence
// number and the missing rank with its host.
func TestWatchdogStall(t *testing.T) {
	for _, backend := range []string{"cluster", "gloo"} {
		t.Run(backend, func(t *testing.T) { testStall(t, backend) })
	}
}

func testStall(t *testing.T, backend string) {
	const n, count = 3, 1000
	const timeout, warn = 1500 * time.Millisecond, 300 * time.Millisecond
	w := newWorld(t, backend, n)
	core, logs := observer.New(zap.WarnLevel)
	onAbort := make([]chan error, n)
	gs := make([]procgroup.ProcessGroup, n)
	for r := range gs {
		ch := make(chan error, 1) // OnAbort is called once
		onAbort[r] = ch
		gs[r] = mustWatchdog(t, w.inner[r], w.wdStore(), procgroup.WatchdogOptions{
			Timeout: timeout, WarnAfter: warn, Interval: 20 * time.Millisecond,
			Host: fmt.Sprintf("host-%d", r), Logger: zap.New(core).With(zap.Int("rank", r)),
			OnAbort: func(err error) { ch <- err }, LookupEnv: noEnv,
		})
	}
	defer closeAll(gs)
	ctx := testCtx(t)
	ins, sum := randomInputs(7, n, count)

	errs := make([]error, n)
	start := time.Now()
	var mu sync.Mutex
	took := make([]time.Duration, n)
	runRanks(gs, func(r int, pg procgroup.ProcessGroup) {
		// #1 runs everywhere and is checked.
		buf := append([]float64(nil), ins[r]...)
		if err := pg.AllReduce(ctx, buf, procgroup.Sum).Wait(ctx); err != nil {
			errs[r] = fmt.Errorf("allreduce #1: %w", err)
			return
		}
		if err := checkSum(buf, sum); err != nil {
			errs[r] = fmt.Errorf("allreduce #1: %w", err)
			return
		}
		if r == 0 {
			// An invalid call takes no sequence number: the stall is still about #2.
			if err := pg.AllReduce(ctx, []int{1}, procgroup.Sum).Wait(ctx); !errors.Is(err, procgroup.ErrInvalidArgument) {
				errs[r] = fmt.Errorf("invalid call: err = %v, want ErrInvalidArgument", err)
				return
			}
		}
		if r == 2 {
			select { // stuck: only the watchdog's abort lets it go on
			case <-onAbort[r]:
			case <-ctx.Done():
				errs[r] = errors.New("the stuck rank's watchdog never reported the abort")
				return
			}
		}
		errs[r] = pg.AllReduce(ctx, make([]float64, count), procgroup.Sum).Wait(ctx)
		mu.Lock()
		took[r] = time.Since(start)
		mu.Unlock()
	})

	// The stall warning, from both waiting ranks.
	const missing = "rank 2 (host-2) has not joined allreduce #2"
	for _, r := range []int{0, 1} {
		found := false
		for _, e := range logs.FilterMessageSnippet(missing).All() {
			if e.ContextMap()["rank"] == int64(r) && strings.Contains(e.Message, "; it last completed #1 after ") {
				found = true
				t.Logf("rank %d warned: %s", r, e.Message)
			}
		}
		if !found {
			t.Errorf("rank %d logged no stall warning %q; logs: %v", r, missing, logs.All())
		}
	}
	wantText := "allreduce #2 timed out after 1.5s: " + missing + "; it last completed #1"
	for r, err := range errs {
		t.Logf("rank %d failed after %v: %v", r, took[r].Round(time.Millisecond), err)
		if err == nil {
			t.Errorf("rank %d: allreduce #2 succeeded, want a timeout", r)
			continue
		}
		if !errors.Is(err, procgroup.ErrTimeout) || !errors.Is(err, procgroup.ErrAborted) {
			t.Errorf("rank %d: err = %v, want ErrTimeout and ErrAborted", r, err)
		}
		if !strings.Contains(err.Error(), wantText) {
			t.Errorf("rank %d: err = %v, want it to contain %q", r, err, wantText)
		}
		if r == 2 {
			var rae *procgroup.RemoteAbortError
			if !errors.As(err, &rae) || rae.Rank != 2 || (rae.By != 0 && rae.By != 1) {
				t.Errorf("rank 2: err = %v, want a *RemoteAbortError from rank 0 or 1", err)
			}
			if !strings.Contains(err.Error(), "procgroup: rank 2: group aborted by rank ") {
				t.Errorf("rank 2: err = %v, want \"group aborted by rank ...\"", err)
			}
		}
	}
	for r, ch := range onAbort[:2] {
		select {
		case err := <-ch:
			if !strings.Contains(err.Error(), wantText) {
				t.Errorf("rank %d: OnAbort(%v), want %q", r, err, wantText)
			}
		case <-ctx.Done():
			t.Errorf("rank %d: OnAbort not called", r)
		}
	}
}

// TestWatchdogAllJoined: a collective every rank has issued but that does not complete is
// reported as such (here rank 1's cluster worker is paused).
func TestWatchdogAllJoined(t *testing.T) {
	const n = 2
	c := pgtest.NewCluster(n)
	defer c.Close()
	store := procgroup.NewMemStore()
	defer store.Close()
	gs := make([]procgroup.ProcessGroup, n)
	for r := range gs {
		gs[r] = mustWatchdog(t, c.Group(r), store, procgroup.WatchdogOptions{
			Timeout: 400 * time.Millisecond, WarnAfter: 100 * time.Millisecond,
			Interval: 10 * time.Millisecond, Host: "h", LookupEnv: noEnv,
		})
	}
	defer closeAll(gs)
	c.Pause(1)
	ctx := testCtx(t)
	errs := make([]error, n)
	runRanks(gs, func(r int, pg procgroup.ProcessGroup) {
		errs[r] = pg.Barrier(ctx).Wait(ctx)
	})
	want := "barrier #1 timed out after 400ms: every rank has joined barrier #1, which has not completed"
	for r, err := range errs {
		if err == nil || !strings.Contains(err.Error(), want) || !errors.Is(err, procgroup.ErrTimeout) {
			t.Errorf("rank %d: err = %v, want ErrTimeout with %q", r, err, want)
		}
	}
}

func TestWatchdogOptionsEnv(t *testing.T) {
	env := func(kv ...string) func(string) (string, bool) {
		return func(k string) (string, bool) {
			for i := 0; i < len(kv); i += 2 {
				if kv[i] == k {
					return kv[i+1], true
				}
			}
			return "", false
		}
	}
	for _, tc := range []struct {
		name          string
		opts          procgroup.WatchdogOptions
		timeout, warn time.Duration
		interval      time.Duration
		err           string
	}{
		{name: "defaults", timeout: procgroup.DefaultTimeout, warn: time.Minute, interval: time.Second},
		{name: "env seconds", opts: procgroup.WatchdogOptions{LookupEnv: env(procgroup.TimeoutEnv, "90", procgroup.StallWarnEnv, "0.2")},
			timeout: 90 * time.Second, warn: 200 * time.Millisecond, interval: 50 * time.Millisecond},
		{name: "env duration", opts: procgroup.WatchdogOptions{LookupEnv: env(procgroup.TimeoutEnv, "10s")},
			timeout: 10 * time.Second, warn: 5 * time.Second, interval: time.Second},
		{name: "option wins", opts: procgroup.WatchdogOptions{Timeout: time.Hour, LookupEnv: env(procgroup.TimeoutEnv, "10s")},
			timeout: time.Hour, warn: time.Minute, interval: time.Second},
		{name: "tiny", opts: procgroup.WatchdogOptions{Timeout: 20 * time.Millisecond},
			timeout: 20 * time.Millisecond, warn: 10 * time.Millisecond, interval: 10 * time.Millisecond},
		{name: "bad env", opts: procgroup.WatchdogOptions{LookupEnv: env(procgroup.TimeoutEnv, "soon")},
			err: `GODDP_COLLECTIVE_TIMEOUT="soon"`},
		{name: "zero env", opts: procgroup.WatchdogOptions{LookupEnv: env(procgroup.StallWarnEnv, "0")},
			err: `GODDP_STALL_WARN="0"`},
		{name: "negative", opts: procgroup.WatchdogOptions{Timeout: -time.Second}, err: "negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := tc.opts
			if o.LookupEnv == nil {
				o.LookupEnv = noEnv
			}
			err := o.Validate()
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) || !errors.Is(err, procgroup.ErrInvalidArgument) {
					t.Fatalf("err = %v, want ErrInvalidArgument with %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if o.Timeout != tc.timeout || o.WarnAfter != tc.warn || o.Interval != tc.interval {
				t.Errorf("timeout, warn, interval = %v, %v, %v; want %v, %v, %v",
					o.Timeout, o.WarnAfter, o.Interval, tc.timeout, tc.warn, tc.interval)
			}
			if o.Host == "" || o.Logger == nil {
				t.Errorf("host %q, logger %v: want defaults", o.Host, o.Logger)
			}
		})
	}
}

func TestWatchdogBadArguments(t *testing.T) {
	store := procgroup.NewMemStore()
	defer store.Close()
	c := pgtest.NewCluster(1)
	defer c.Close()
	if _, err := procgroup.WithWatchdog(nil, store, procgroup.WatchdogOptions{}); !errors.Is(err, procgroup.ErrInvalidArgument) {
		t.Errorf("nil group: err = %v", err)
	}
	if _, err := procgroup.WithWatchdog(c.Group(0), nil, procgroup.WatchdogOptions{}); !errors.Is(err, procgroup.ErrInvalidArgument) {
		t.Errorf("nil store: err = %v", err)
	}
	if _, err := procgroup.WithDebug(nil, procgroup.DebugOptions{}); !errors.Is(err, procgroup.ErrInvalidArgument) {
		t.Errorf("WithDebug(nil): err = %v", err)
	}
}

// countingStore counts the Sets of one key.
type countingStore struct {
	procgroup.Store
	key  string
	sets atomic.Int64
}

func (s *countingStore) Set(ctx context.Context, key string, v []byte) error {
	if key == s.key {
		s.sets.Add(1)
	}
	return s.Store.Set(ctx, key, v)
}

// TestWatchdogPublishRate: a rank's progress reaches the store within the publication
// bound (Interval/10) of its last change, and a fast stream of collectives costs at most
// one store write per Interval/10, not one per collective.
func TestWatchdogPublishRate(t *testing.T) {
	const n, count = 2, 64
	const interval = 200 * time.Millisecond
	const delay = interval / 10
	const collectives = 20000
	w := newWorld(t, "cluster", n)
	store := &countingStore{Store: w.wdStore(), key: "progress/0"}
	gs := make([]procgroup.ProcessGroup, n)
	for r := range gs {
		gs[r] = mustWatchdog(t, w.inner[r], store, procgroup.WatchdogOptions{
			Timeout: time.Minute, Interval: interval, Host: "h", LookupEnv: noEnv,
		})
	}
	defer closeAll(gs)
	ctx := testCtx(t)
	ins, sum := randomInputs(3, n, count)
	errs := make([]error, n)
	start := time.Now()
	runRanks(gs, func(r int, pg procgroup.ProcessGroup) {
		for i := range collectives {
			buf := append([]float64(nil), ins[r]...)
			if err := pg.AllReduce(ctx, buf, procgroup.Sum).Wait(ctx); err != nil {
				errs[r] = fmt.Errorf("allreduce #%d: %w", i+1, err)
				return
			}
			if err := checkSum(buf, sum); err != nil {
				errs[r] = fmt.Errorf("allreduce #%d: %w", i+1, err)
				return
			}
		}
	})
	last := time.Now()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	// The final progress is in the store soon after the last change.
	want := fmt.Sprintf("%d %d h", collectives, collectives)
	var got []byte
	for {
		v, _, err := store.CompareAndSet(ctx, "progress/0", []byte("\x00"), []byte("\x00"))
		if err != nil {
			t.Fatal(err)
		}
		if got = v; string(got) == want {
			break
		}
		if time.Since(last) > delay+time.Second {
			t.Fatalf("rank 0's progress in the store is %q %v after its last collective, want %q", got, time.Since(last), want)
		}
		time.Sleep(time.Millisecond)
	}
	t.Logf("published %v after the last collective", time.Since(last).Round(time.Millisecond))
	elapsed := last.Sub(start)
	sets := store.sets.Load()
	// The first publication, one per hold-off, one per Interval round, and the last one.
	bound := 3 + int64(elapsed/delay) + int64(elapsed/interval)
	t.Logf("%d collectives in %v: %d publications (bound %d)", collectives, elapsed.Round(time.Millisecond), sets, bound)
	if sets > bound || sets >= collectives {
		t.Errorf("%d publications of rank 0's progress for %d collectives in %v, want at most %d",
			sets, collectives, elapsed, bound)
	}
}
