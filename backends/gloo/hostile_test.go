package gloo

import (
	"context"
	"crypto/rand"
	"errors"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/goddp/goddp/procgroup"
)

// checkAllReduce runs one float32 sum all-reduce on every rank and checks the result.
func checkAllReduce(t *testing.T, groups []procgroup.ProcessGroup, count int) {
	t.Helper()
	x := inputs(uint64(count), len(groups), count, procgroup.Sum)
	want := reduceRef(x, procgroup.Sum)
	bufs := make([]any, len(groups))
	each(t, groups, func(r int, g procgroup.ProcessGroup) error {
		bufs[r] = toBuf(procgroup.Float32, x[r])
		return wait(g.AllReduce(ctx, bufs[r], procgroup.Sum))
	})
	for r := range groups {
		checkClose(t, "allreduce", procgroup.Float32, procgroup.Sum, fromBuf(bufs[r]), want)
	}
}

// TestHostileConnections connects strangers to rank 0's data ports (TCP and Unix) that send
// garbage, a wrong token, a truncated hello or a frame with a 2^62 length: each is refused
// and logged, the group's collectives keep working, and the heap does not grow.
func TestHostileConnections(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	groups := startGroupsLogged(t, 3, &Config{HandshakeTimeout: 2 * time.Second}, zap.New(core))
	g0 := groups[0].(*group)
	var addrs [][2]string
	for _, ln := range g0.listeners {
		addrs = append(addrs, [2]string{ln.Addr().Network(), ln.Addr().String()})
	}
	if len(addrs) != 2 {
		t.Fatalf("rank 0 listens on %v, want tcp and unix", addrs)
	}
	wrongKey := &handshaker{key: groupKey("wrong", "x"), rank: 2, size: 3, rand: rand.Reader}
	rightKey := &handshaker{key: groupKey("secret", g0.opts.Prefix), rank: 1, size: 3, rand: rand.Reader}
	attacks := map[string]func(c net.Conn){
		"garbage":   func(c net.Conn) { c.Write([]byte(strings.Repeat("garbage!", 512))) },
		"2^62":      func(c net.Conn) { c.Write(header(kindData, 1, 1<<62)) },
		"truncated": func(c net.Conn) { c.Write([]byte(handMagic + "abc")) },
		"wrong token": func(c net.Conn) {
			if err := wrongKey.dial(c, 0); err == nil {
				t.Error("wrong token accepted")
			}
		},
		"duplicate rank": func(c net.Conn) {
			if err := rightKey.dial(c, 0); err == nil {
				t.Error("second connection for rank 1 accepted")
			}
		},
		"silent": func(c net.Conn) {},
	}
	attack := func() {
		for _, a := range addrs {
			for name, f := range attacks {
				c, err := net.Dial(a[0], a[1])
				if err != nil {
					t.Fatalf("%s %s: %v", a[0], name, err)
				}
				f(c)
				c.Close()
			}
		}
	}
	attack()
	checkAllReduce(t, groups, 1000)
	checkAllReduce(t, groups, 3<<18) // ring, several segments
	// Memory: many more hostile connections must not grow the heap.
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range 20 {
		attack()
	}
	checkAllReduce(t, groups, 1000)
	deadline := time.Now().Add(10 * time.Second)
	for logs.FilterMessageSnippet("refused").Len() < 21*len(addrs)*(len(attacks)) && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if grow := int64(after.HeapAlloc) - int64(before.HeapAlloc); grow > 8<<20 {
		t.Errorf("heap grew by %d bytes over %d hostile connections", grow, 20*len(addrs)*len(attacks))
	}
	if n := logs.FilterMessageSnippet("refused").Len(); n < 21*len(addrs)*len(attacks) {
		t.Errorf("%d refusals logged, want %d", n, 21*len(addrs)*len(attacks))
	}
	checkAllReduce(t, groups, 77)
}

// TestPeerLost kills a rank mid-collective by closing its sockets abruptly (what the kernel
// does for a process killed with SIGKILL): every other rank's pending work fails within
// seconds with a PeerLostError naming it.
func TestPeerLost(t *testing.T) {
	for _, size := range []int{2, 3, 4} {
		for _, cfg := range []*Config{{Transport: TransportUnix}, {Transport: TransportTCP}} {
			dead := size - 2 // a rank that is neither 0 nor adjacent to every other
			groups := startGroupsNoCleanup(t, size, cfg)
			works := make([]procgroup.Work, size)
			for r, g := range groups {
				if r != dead {
					works[r] = g.AllReduce(ctx, make([]float32, 1<<20), procgroup.Sum)
				}
			}
			time.Sleep(50 * time.Millisecond)
			start := time.Now()
			for _, p := range groups[dead].(*group).peers {
				if p != nil {
					p.conn.Close()
				}
			}
			for r, w := range works {
				if w == nil {
					continue
				}
				c, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				err := w.Wait(c)
				cancel()
				var ple *PeerLostError
				switch {
				case errors.Is(err, context.DeadlineExceeded):
					t.Fatalf("n=%d %s: rank %d: no error after %v", size, cfg.Transport, r, time.Since(start))
				case !errors.Is(err, procgroup.ErrPeerLost) || !errors.As(err, &ple) || ple.Rank != dead:
					t.Errorf("n=%d %s: rank %d: %v; want a PeerLostError naming rank %d", size, cfg.Transport, r, err, dead)
				}
			}
			for _, g := range groups {
				g.Abort(nil)
			}
			for r, g := range groups {
				if err := wait(g.Barrier(ctx)); !errors.Is(err, procgroup.ErrAborted) {
					t.Errorf("rank %d: barrier after abort: %v", r, err)
				}
			}
		}
	}
}

// TestTimeout: a rank that never issues the collective makes the others time out with
// ErrTimeout naming the op and sequence number.
func TestTimeout(t *testing.T) {
	groups := startGroupsTimeout(t, 2, &Config{PollInterval: 20 * time.Millisecond}, 200*time.Millisecond)
	err := wait(groups[0].AllReduce(ctx, make([]float64, 10), procgroup.Sum))
	if !errors.Is(err, procgroup.ErrTimeout) || !strings.Contains(err.Error(), "allreduce #1") {
		t.Fatalf("got %v, want ErrTimeout naming allreduce #1", err)
	}
	if err := wait(groups[0].Barrier(ctx)); !errors.Is(err, procgroup.ErrAborted) {
		t.Fatalf("after timeout: %v, want ErrAborted", err)
	}
	// Rank 1 hears of the abort (or loses rank 0) on its next collective.
	if err := wait(groups[1].Barrier(ctx)); err == nil {
		t.Fatal("rank 1's barrier succeeded alone")
	}
}

// TestCtxCancel: a collective whose ctx ends fails with the ctx's error and aborts the group.
func TestCtxCancel(t *testing.T) {
	groups := startGroups(t, 2, &Config{PollInterval: 20 * time.Millisecond})
	c, cancel := context.WithCancel(context.Background())
	w := groups[0].AllReduce(c, make([]float32, 5), procgroup.Sum)
	time.Sleep(30 * time.Millisecond)
	cancel()
	if err := wait(w); !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want context.Canceled", err)
	}
}

func TestInvalidArguments(t *testing.T) {
	groups := startGroups(t, 2, nil)
	g := groups[0]
	for name, w := range map[string]procgroup.Work{
		"type":          g.AllReduce(ctx, []uint8{1}, procgroup.Sum),
		"nil":           g.AllReduce(ctx, nil, procgroup.Sum),
		"op":            g.AllReduce(ctx, []float32{1}, procgroup.ReduceOp(99)),
		"root":          g.Broadcast(ctx, []float32{1}, 2),
		"gather len":    g.AllGather(ctx, make([]float32, 3), make([]float32, 2)),
		"gather type":   g.AllGather(ctx, make([]float32, 4), make([]float64, 2)),
		"scatter len":   g.ReduceScatter(ctx, make([]float32, 2), make([]float32, 3), procgroup.Sum),
		"scatter op":    g.ReduceScatter(ctx, make([]float32, 1), make([]float32, 2), 0),
		"scatter types": g.ReduceScatter(ctx, make([]int32, 1), make([]int64, 2), procgroup.Sum),
	} {
		if err := wait(w); !errors.Is(err, procgroup.ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", name, err)
		}
	}
	checkAllReduce(t, groups, 5) // bad calls did not disturb the sequence
	if _, err := procgroup.New(ctx, "gloo", procgroup.Options{Rank: 0, Size: 1, Store: procgroup.NewMemStore(), Backend: &Config{Transport: "carrier-pigeon"}}); !errors.Is(err, procgroup.ErrInvalidArgument) {
		t.Errorf("bad transport: %v", err)
	}
}
