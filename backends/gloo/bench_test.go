package gloo

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/goddp/goddp/internal/kernels"
	"github.com/goddp/goddp/procgroup"
)

// runDirect runs the collective o on both ranks of a 2-rank group without going through
// the queue: rank 1 on a helper goroutine driven by channels, so that nothing but the
// collective itself allocates.
type pairRunner struct {
	gs    [2]*group
	ops   [2]op
	start chan struct{}
	done  chan error
	stop  chan struct{}
}

func newPairRunner(t testing.TB, cfg *Config, bufs [2][]float32, rop procgroup.ReduceOp) *pairRunner {
	groups := startGroups(t, 2, cfg)
	pr := &pairRunner{start: make(chan struct{}), done: make(chan error), stop: make(chan struct{})}
	for r := range 2 {
		pr.gs[r] = groups[r].(*group)
		b, dt, _, _ := kernels.Bytes(bufs[r])
		pr.ops[r] = op{kind: procgroup.OpAllReduce, dt: dt, rop: rop, buf: b, ctx: ctx}
	}
	go func() {
		for {
			select {
			case <-pr.start:
				pr.done <- pr.step(1)
			case <-pr.stop:
				close(pr.done)
				return
			}
		}
	}()
	t.Cleanup(func() { close(pr.stop); <-pr.done })
	return pr
}

func (pr *pairRunner) step(r int) error {
	o := &pr.ops[r]
	o.seq++
	o.deadline = farFuture
	pr.gs[r].cur = o
	err := pr.gs[r].run(o)
	pr.gs[r].cur = nil
	return err
}

func (pr *pairRunner) run() error {
	pr.start <- struct{}{}
	err := pr.step(0)
	if err1 := <-pr.done; err == nil {
		err = err1
	}
	return err
}

// TestAllReduceAllocatesNothing: in steady state the collective itself (direct exchange
// and ring, both transports) allocates nothing.
// allocFreeGlobals are TestAllReduceAllocatesNothing's buffers outside the heap.
var allocFreeGlobals [2][1 << 18]float32

func TestAllReduceAllocatesNothing(t *testing.T) {
	for _, c := range []struct {
		name  string
		cfg   *Config
		count int
	}{
		{"direct-4KiB", &Config{Transport: TransportUnix}, 1 << 10},
		{"direct-shm", &Config{Transport: TransportUnix, Algorithm: AlgoDirect}, 1 << 14},
		{"direct-queued", &Config{Transport: TransportUnix, SharedMemory: ShmOff, Algorithm: AlgoDirect, SegmentSize: 16 << 10}, 1 << 16},
		{"ring-1MiB", &Config{Transport: TransportUnix, SegmentSize: 64 << 10}, 1 << 18},
		{"ring-shm-small-slots", &Config{Transport: TransportUnix, ShmSlotSize: 4 << 10, ShmSlots: 2}, 1 << 18},
		{"ring-unix-sockets", &Config{Transport: TransportUnix, SharedMemory: ShmOff, SegmentSize: 64 << 10}, 1 << 18},
		{"ring-tcp", &Config{Transport: TransportTCP, Algorithm: AlgoRing, SegmentSize: 16 << 10}, 1 << 16},
		{"ring-1MiB-global", &Config{Transport: TransportUnix, SegmentSize: 64 << 10}, 1 << 18}, // not Go's heap: never adopted (Note [Adopted buffers])
	} {
		t.Run(c.name, func(t *testing.T) {
			bufs := [2][]float32{make([]float32, c.count), make([]float32, c.count)}
			if strings.HasSuffix(c.name, "-global") {
				bufs = [2][]float32{allocFreeGlobals[0][:c.count], allocFreeGlobals[1][:c.count]}
			}
			pr := newPairRunner(t, c.cfg, bufs, procgroup.Avg)
			for i := range bufs[0] {
				bufs[0][i], bufs[1][i] = float32(i), 1
			}
			if err := pr.run(); err != nil {
				t.Fatal(err)
			}
			for i := range bufs[0] {
				want := (float32(i) + 1) / 2
				if bufs[0][i] != want || bufs[1][i] != want {
					t.Fatalf("[%d] = %v, %v; want %v", i, bufs[0][i], bufs[1][i], want)
				}
			}
			var err error
			if n := testing.AllocsPerRun(20, func() {
				if e := pr.run(); e != nil {
					err = e
				}
			}); n != 0 {
				t.Errorf("%v allocations per all-reduce, want 0", n)
			}
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

// BenchmarkAllReduce: float32 sum over a 2-rank in-process group (the ranks are goroutines
// connected through a MemStore over real sockets), through the public API. busbw = algbw
// for n = 2. Run with -benchtime=20x for a quick sanity check.
func BenchmarkAllReduce(b *testing.B) {
	for _, tr := range []string{TransportUnix, TransportTCP} {
		for _, size := range []int{4 << 10, 1 << 20, 16 << 20} {
			b.Run(fmt.Sprintf("%s/%dKiB", tr, size>>10), func(b *testing.B) {
				groups := startGroups(b, 2, &Config{Transport: tr})
				bufs := [2][]float32{make([]float32, size/4), make([]float32, size/4)}
				start, done := make(chan struct{}), make(chan error)
				go func() {
					for range start {
						done <- groups[1].AllReduce(ctx, bufs[1], procgroup.Sum).Wait(ctx)
					}
					close(done)
				}()
				defer func() { close(start); <-done }()
				b.SetBytes(int64(size))
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					start <- struct{}{}
					if err := groups[0].AllReduce(ctx, bufs[0], procgroup.Sum).Wait(ctx); err != nil {
						b.Fatal(err)
					}
					if err := <-done; err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

var farFuture = time.Now().Add(24 * time.Hour)
