// Command collective-soak runs continuous mixed collectives — all-reduce, broadcast,
// all-gather, reduce-scatter and barrier, with random sizes, element types and reductions,
// 1 to 4 in flight — and checks every result element by element against a reference
// computed independently. Every rank draws the same sequence from --seed. Every --report
// interval each rank prints the collectives done, the errors, its goroutines and its heap
// in use (after a GC); at the end each prints its numbers at the first report (once warmed up) and at the end. The group runs
// under the watchdog (procgroup.WithWatchdog; --timeout), and under the desync detector
// with --debug or GODDP_DEBUG=detail.
//
// # Usage
//
//	collective-soak --nproc 4 --duration 10m          # 4 local ranks, spawned by the command
//	ddprun --nproc_per_node=4 collective-soak --duration 1h
//
// Without --nproc the process is one rank, from the environment (see
// procgroup.InitFromEnv). Exit status: 0 if every check passed, 1 on any error (the first
// failing rank's message comes first), 2 for bad flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"

	_ "github.com/goddp/goddp/backends/gloo"
	"github.com/goddp/goddp/internal/spawn"
	"github.com/goddp/goddp/procgroup"
)

// childEnv marks a rank process started by --nproc.
const childEnv = "GODDP_SOAK_CHILD"

type config struct {
	nproc    int
	duration time.Duration
	report   time.Duration
	seed     uint64
	maxCount int
	backend  string
	timeout  time.Duration
	debug    bool
}

type errUsage struct{ msg string }

func (e errUsage) Error() string { return e.msg }

func parseFlags(args []string, stderr io.Writer) (config, error) {
	fs := flag.NewFlagSet("collective-soak", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var c config
	fs.IntVar(&c.nproc, "nproc", 0, "spawn this many local ranks (0: this process is one rank, from the environment)")
	fs.DurationVar(&c.duration, "duration", time.Minute, "how long to run")
	fs.DurationVar(&c.report, "report", 5*time.Second, "interval between progress lines")
	fs.Uint64Var(&c.seed, "seed", 1, "seed of the collective sequence (the same on every rank)")
	fs.IntVar(&c.maxCount, "max-count", 1<<18, "largest element count per rank")
	fs.StringVar(&c.backend, "backend", "gloo", "process group backend")
	fs.DurationVar(&c.timeout, "timeout", 2*time.Minute, "collective timeout (the watchdog's) and rendezvous timeout")
	fs.BoolVar(&c.debug, "debug", false, "compare collective fingerprints before each collective (like GODDP_DEBUG=detail)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return c, err
		}
		return c, errUsage{err.Error()}
	}
	switch {
	case fs.NArg() > 0:
		return c, errUsage{fmt.Sprintf("unexpected argument %q", fs.Arg(0))}
	case c.nproc < 0:
		return c, errUsage{"--nproc must be at least 0"}
	case c.duration <= 0 || c.report <= 0 || c.timeout <= 0:
		return c, errUsage{"--duration, --report and --timeout must be positive"}
	case c.maxCount < 1:
		return c, errUsage{"--max-count must be at least 1"}
	}
	return c, nil
}

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

// run is main without os.Exit; it returns the exit status.
func run(args []string, stdout, stderr io.Writer) int {
	cfg, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "collective-soak: %v\n", err)
		return 2
	}
	if _, err := procgroup.Lookup(cfg.backend); err != nil {
		fmt.Fprintf(stderr, "collective-soak: --backend: %v\n", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if cfg.nproc > 0 && os.Getenv(childEnv) == "" {
		return spawn.Local(ctx, spawn.Options{Name: "collective-soak", N: cfg.nproc, Args: args, ChildEnv: childEnv,
			Logger: spawn.Logger(stderr, -1), Stdout: stdout, Stderr: stderr})
	}
	return runRank(ctx, cfg, stdout, stderr)
}

// sample is a rank's resource use at one moment.
type sample struct {
	goroutines int
	heapInuse  uint64
}

func measure() sample {
	runtime.GC() // so that heap numbers compare across samples
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return sample{goroutines: runtime.NumGoroutine(), heapInuse: ms.HeapInuse}
}

func mib(b uint64) string { return fmt.Sprintf("%.1fMiB", float64(b)/(1<<20)) }

// runRank runs this process as one rank of the job its environment describes.
func runRank(ctx context.Context, cfg config, stdout, stderr io.Writer) int {
	env, err := procgroup.InitFromEnv()
	if err != nil {
		fmt.Fprintf(stderr, "collective-soak: %v (or use --nproc N to start N local ranks)\n", err)
		return 2
	}
	logger := spawn.Logger(stderr, env.Rank)
	fail := func(err error) int {
		fmt.Fprintf(stderr, "collective-soak: rank %d: %v\n", env.Rank, err)
		return 1
	}
	debug, err := procgroup.DebugFromEnv(nil)
	if err != nil {
		return fail(err)
	}
	pg, release, err := setup(ctx, cfg, env, logger, debug || cfg.debug)
	if err != nil {
		return fail(err)
	}
	defer release()

	var st stats
	start := time.Now()
	first := measure() // replaced by the first report's numbers, taken once warmed up
	var mu sync.Mutex  // guards first and reported
	reported := false
	line := func(s sample) {
		fmt.Fprintf(stdout, "rank %d t=%v collectives=%d errors=%d goroutines=%d heap_inuse=%s\n",
			env.Rank, time.Since(start).Round(time.Second), st.collectives.Load(), st.errors.Load(),
			s.goroutines, mib(s.heapInuse))
	}
	stopReport := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(cfg.report)
		defer t.Stop()
		for {
			select {
			case <-stopReport:
				return
			case <-t.C:
				s := measure()
				mu.Lock()
				if !reported {
					first, reported = s, true
				}
				mu.Unlock()
				line(s)
			}
		}
	})
	deadline := start.Add(cfg.duration)
	err = soak(ctx, pg, cfg.seed, cfg.maxCount, func() bool { return !time.Now().Before(deadline) || ctx.Err() != nil }, &st)
	end := measure() // with the reporter still running, as in the first report
	close(stopReport)
	wg.Wait()
	if err != nil {
		return fail(err)
	}
	mu.Lock()
	defer mu.Unlock()
	fmt.Fprintf(stdout, "rank %d done: collectives=%d errors=%d in %v; goroutines %d -> %d; heap_inuse %s -> %s\n",
		env.Rank, st.collectives.Load(), st.errors.Load(), time.Since(start).Round(time.Millisecond),
		first.goroutines, end.goroutines, mib(first.heapInuse), mib(end.heapInuse))
	return 0
}

// setup meets the other ranks and returns the wrapped group and its release func.
func setup(ctx context.Context, cfg config, env procgroup.Env, logger *zap.Logger, debug bool) (procgroup.ProcessGroup, func(), error) {
	rctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	store, closer, err := procgroup.Rendezvous(rctx, env, logger)
	if err != nil {
		return nil, nil, err
	}
	token, err := procgroup.JobToken(env, env.StoreAddress(), tlsOn(), nil) // Rendezvous checked it
	if err != nil {
		return nil, nil, errors.Join(err, closer.Close())
	}
	pg, err := procgroup.New(rctx, cfg.backend, procgroup.Options{
		Rank: env.Rank, Size: env.WorldSize, LocalRank: env.LocalRank, LocalSize: env.LocalWorldSize,
		Store: store, Prefix: "soak", Token: token, Timeout: 2 * cfg.timeout, Logger: logger,
		StoreAddr: env.StoreAddress(),
	})
	if err != nil {
		closer.Close()
		return nil, nil, err
	}
	if debug {
		d, err := procgroup.WithDebug(pg, procgroup.DebugOptions{Logger: logger})
		if err != nil {
			pg.Abort(err)
			closer.Close()
			return nil, nil, err
		}
		pg = d
	}
	w, err := procgroup.WithWatchdog(pg, procgroup.PrefixStore{Prefix: "soak/watchdog", Store: store},
		procgroup.WatchdogOptions{Timeout: cfg.timeout, Logger: logger})
	if err != nil {
		pg.Abort(err)
		closer.Close()
		return nil, nil, err
	}
	pg = w
	return pg, func() {
		if err := pg.Close(); err != nil {
			logger.Warn("close", zap.Error(err))
		}
		closer.Close()
	}, nil
}

// tlsOn reports whether GODDP_TLS_* turn TLS on (Rendezvous then accepts a job without a token).
func tlsOn() bool {
	f, err := procgroup.TLSFromEnv(nil)
	return err == nil && f.Enabled()
}
