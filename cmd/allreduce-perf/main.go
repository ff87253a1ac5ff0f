// Command allreduce-perf measures all-reduce the way nccl-tests' all_reduce_perf does: for
// each message size from -b to -e (times -f each step) it runs -w warm-up and -n timed
// all-reduces, back to back on one buffer (--reset: each from the input again), and prints
// size, element count, type, time, algorithm bandwidth and bus bandwidth (busbw =
// algbw·2(n−1)/n, the per-link traffic of a ring), and checks the result of one more
// all-reduce against a reference computed independently in float64. --collective
// allgather, reducescatter or broadcast measures those instead, as nccl-tests'
// all_gather_perf, reduce_scatter_perf and broadcast_perf do (busbw = algbw·(n−1)/n,
// (n−1)/n and 1).
//
// # Usage
//
//	allreduce-perf --nproc 2 -b 4K -e 256M          # 2 local ranks, spawned by the command
//	ddprun --nproc_per_node=4 allreduce-perf -d bf16  # ranks from the environment (torchrun style)
//	allreduce-perf --nproc 2 --json | jq .busbw_gbs
//	allreduce-perf --nproc 2 -b 1M -e 256M --ceiling # busbw against the memory bandwidth (Note [Ceiling])
//	allreduce-perf --nproc 4 --collective allgather    # nccl-tests' all_gather_perf
//
// Without --nproc the process is one rank: it reads RANK, WORLD_SIZE, MASTER_ADDR, ... (or
// SLURM/Open MPI variables, see procgroup.InitFromEnv) and meets the others through
// procgroup.Rendezvous. With --nproc N it hosts a store on 127.0.0.1, starts N copies of
// itself as ranks 0..N-1, and stops them all if one fails. Rank 0 prints the table.
//
// Exit status: 0 if every check passed, 1 if a check failed or a rank failed, 2 for bad flags.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/goddp/goddp/internal/spawn"
	"github.com/goddp/goddp/procgroup"
)

// childEnv marks a rank process started by --nproc (which then runs as a rank).
const childEnv = "GODDP_ALLREDUCE_PERF_CHILD"

type config struct {
	minBytes, maxBytes int64
	factor             int64
	iters, warmup      int
	check              bool
	dtype              procgroup.DType
	op                 procgroup.ReduceOp
	backend            string
	nproc              int
	json               bool
	transport, algo    string
	timeout            time.Duration
	ceiling, shared    bool
	reset, inPlace     bool
	minTime            time.Duration
	collective         string
}

// errUsage marks flag errors (exit status 2).
type errUsage struct{ msg string }

func (e errUsage) Error() string { return e.msg }

func usagef(format string, args ...any) error { return errUsage{fmt.Sprintf(format, args...)} }

func parseFlags(args []string, stderr io.Writer) (config, error) {
	fs := flag.NewFlagSet("allreduce-perf", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		c                      config
		minS, maxS, dt, op     string
		check                  int
		factor                 int
		transport, algo, bname string
	)
	fs.StringVar(&minS, "b", "4K", "minimum message size in bytes (suffixes K, M, G: powers of 1024)")
	fs.StringVar(&maxS, "e", "64M", "maximum message size in bytes")
	fs.IntVar(&factor, "f", 2, "size multiplication factor between steps (at least 2)")
	fs.IntVar(&c.iters, "n", 20, "timed iterations per size")
	fs.IntVar(&c.warmup, "w", 5, "warm-up iterations per size")
	fs.DurationVar(&c.minTime, "min_time", 0, "time each size for at least this long, at the fastest warm-up iteration's pace (-n is then the least count; needs -w 1 or more)")
	fs.IntVar(&check, "c", 1, "check results (1) or not (0)")
	fs.StringVar(&dt, "d", "float32", "element type: float32, float64, int32, int64, bfloat16, float16")
	fs.StringVar(&c.collective, "collective", collAllReduce, "the collective: allreduce, allgather, reducescatter or broadcast (from rank 0); the size is the all-gathered output and the reduce-scattered input, as in nccl-tests")
	fs.StringVar(&op, "op", "sum", "reduction: sum, avg, min, max, prod")
	fs.StringVar(&bname, "backend", "gloo", "process group backend (\"store\": through the rendezvous store, slow, for checking)")
	fs.IntVar(&c.nproc, "nproc", 0, "spawn this many local ranks on 127.0.0.1 (0: this process is one rank, from the environment)")
	fs.BoolVar(&c.json, "json", false, "print one JSON object per size instead of the table")
	fs.StringVar(&transport, "transport", "", "gloo transport: auto, tcp or unix (sets GODDP_GLOO_TRANSPORT)")
	fs.StringVar(&algo, "algo", "", "gloo algorithm: auto, ring, direct, hierarchical or rd (sets GODDP_GLOO_ALGO)")
	fs.DurationVar(&c.timeout, "timeout", 5*time.Minute, "collective and rendezvous timeout")
	fs.BoolVar(&c.shared, "shared", false, "all-reduce buffers from the group's allocator (gloo: its shared arena, all-reduced in place) where it has one")
	fs.BoolVar(&c.inPlace, "inplace", false, "run AllGather and ReduceScatter in place, as nccl-tests' in-place column: the rank's input is its slot of the gathered output, the reduced output its chunk of the input (AllReduce and Broadcast always run in place)")
	fs.BoolVar(&c.reset, "reset", false, "copy the input into the buffer again before every timed iteration, outside the timer (by default they run back to back on the buffer, as in nccl-tests; products always restart)")
	fs.BoolVar(&c.ceiling, "ceiling", false, "also measure the memory bandwidth (every rank at once) and print each busbw as a percentage of the ceiling the algorithm's memory traffic implies")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: allreduce-perf [flags]\n\nnccl-tests style all-reduce benchmark; see the package doc.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return c, err
		}
		return c, errUsage{err.Error()} // the flag package has printed the usage
	}
	if fs.NArg() > 0 {
		return c, usagef("unexpected argument %q", fs.Arg(0))
	}
	var err error
	if c.minBytes, err = parseSize(minS); err != nil {
		return c, usagef("-b: %v", err)
	}
	if c.maxBytes, err = parseSize(maxS); err != nil {
		return c, usagef("-e: %v", err)
	}
	if c.dtype, err = procgroup.ParseDType(strings.ToLower(dt)); err != nil {
		return c, usagef("-d: %v", err)
	}
	if c.op, err = procgroup.ParseReduceOp(strings.ToLower(op)); err != nil {
		return c, usagef("--op: %v", err)
	}
	switch {
	case c.minBytes < int64(c.dtype.Size()):
		return c, usagef("-b %s is smaller than one %s element (%d bytes)", minS, c.dtype, c.dtype.Size())
	case c.maxBytes < c.minBytes:
		return c, usagef("-e %s is smaller than -b %s", maxS, minS)
	case factor < 2:
		return c, usagef("-f %d: want at least 2", factor)
	case c.iters < 1:
		return c, usagef("-n %d: want at least 1", c.iters)
	case c.warmup < 0:
		return c, usagef("-w %d: want at least 0", c.warmup)
	case c.minTime < 0:
		return c, usagef("--min_time %v: want 0 or more", c.minTime)
	case c.minTime > 0 && c.warmup == 0:
		return c, usagef("--min_time %v needs warm-up iterations to set its pace (-w 0)", c.minTime)
	case check != 0 && check != 1:
		return c, usagef("-c %d: want 0 or 1", check)
	case c.nproc < 0:
		return c, usagef("--nproc %d: want at least 0", c.nproc)
	case c.timeout <= 0:
		return c, usagef("--timeout %v: want a positive duration", c.timeout)
	case bname == "":
		return c, usagef("--backend: empty name")
	case !slices.Contains(collectives, c.collective):
		return c, usagef("--collective %q: want %s", c.collective, strings.Join(collectives, ", "))
	case c.ceiling && c.collective != collAllReduce:
		return c, usagef("--ceiling: only with --collective allreduce")
	}
	if transport != "" && transport != "auto" && transport != "tcp" && transport != "unix" {
		return c, usagef("--transport %q: want auto, tcp or unix", transport)
	}
	if algo != "" && algo != "auto" && algo != "ring" && algo != "direct" && algo != "hierarchical" && algo != "rd" {
		return c, usagef("--algo %q: want auto, ring, direct, hierarchical or rd", algo)
	}
	c.factor, c.check, c.backend, c.transport, c.algo = int64(factor), check == 1, bname, transport, algo
	return c, nil
}

// maxSize bounds -b and -e (1 TiB), far beyond any buffer this machine could hold, so that
// the size loop cannot overflow.
const maxSize = 1 << 40

// parseSize reads "4096", "4K", "1M", "256MB", "1GiB" (binary multiples).
func parseSize(s string) (int64, error) {
	t := strings.ToUpper(strings.TrimSpace(s))
	t = strings.TrimSuffix(strings.TrimSuffix(t, "B"), "I")
	mult := int64(1)
	if n := len(t); n > 0 {
		switch t[n-1] {
		case 'K':
			mult = 1 << 10
		case 'M':
			mult = 1 << 20
		case 'G':
			mult = 1 << 30
		case 'T':
			mult = 1 << 40
		}
		if mult > 1 {
			t = t[:n-1]
		}
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil || n < 1 {
		return 0, fmt.Errorf("size %q: want a positive number of bytes, optionally with K, M or G", s)
	}
	if n > maxSize/mult {
		return 0, fmt.Errorf("size %q exceeds 1 TiB", s)
	}
	return n * mult, nil
}

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

// run is main without os.Exit; it returns the exit status.
func run(args []string, stdout, stderr io.Writer) int {
	cfg, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "allreduce-perf: %v\n", err)
		return 2
	}
	// The gloo backend reads these when the group is created (children inherit them).
	if cfg.transport != "" {
		os.Setenv("GODDP_GLOO_TRANSPORT", cfg.transport)
	}
	if cfg.algo != "" {
		os.Setenv("GODDP_GLOO_ALGO", cfg.algo)
	}
	if _, err := procgroup.Lookup(cfg.backend); err != nil {
		fmt.Fprintf(stderr, "allreduce-perf: --backend: %v (have %s)\n", err, strings.Join(procgroup.Backends(), ", "))
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if cfg.nproc > 0 && os.Getenv(childEnv) == "" {
		return spawn.Local(ctx, spawn.Options{Name: "allreduce-perf", N: cfg.nproc, Args: args, ChildEnv: childEnv,
			Logger: spawn.Logger(stderr, -1), Stdout: stdout, Stderr: stderr})
	}
	return runRank(ctx, cfg, stdout, stderr)
}

// runRank runs this process as one rank of the job its environment describes.
func runRank(ctx context.Context, cfg config, stdout, stderr io.Writer) int {
	env, err := procgroup.InitFromEnv()
	if err != nil {
		fmt.Fprintf(stderr, "allreduce-perf: %v (or use --nproc N to start N local ranks)\n", err)
		return 2
	}
	logger := spawn.Logger(stderr, env.Rank)
	fail := func(err error) int {
		fmt.Fprintf(stderr, "allreduce-perf: rank %d: %v\n", env.Rank, err)
		return 1
	}
	rctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	store, closer, err := procgroup.Rendezvous(rctx, env, logger)
	if err != nil {
		cancel()
		return fail(err)
	}
	defer closer.Close()
	token, err := procgroup.JobToken(env, env.StoreAddress(), tlsOn(), nil) // Rendezvous checked it
	if err != nil {
		cancel()
		return fail(err)
	}
	pg, err := procgroup.New(rctx, cfg.backend, procgroup.Options{
		Rank: env.Rank, Size: env.WorldSize, LocalRank: env.LocalRank, LocalSize: env.LocalWorldSize,
		Store: procgroup.PrefixStore{Prefix: "allreduce-perf", Store: store}, Token: token,
		Timeout: cfg.timeout, Logger: logger, StoreAddr: env.StoreAddress(),
	})
	cancel()
	if err != nil {
		return fail(err)
	}
	var out reporter = nopReporter{}
	if env.Rank == 0 {
		out = newReporter(stdout, cfg, pg.Size())
	}
	out.header()
	failed := false
	err = bench(ctx, pg, cfg, func(r row) {
		if r.Wrong > 0 { // -1: unchecked (-c 0)
			failed = true
		}
		out.row(r)
	})
	if err != nil {
		pg.Abort(err)
		return fail(err)
	}
	if err := pg.Close(); err != nil {
		return fail(err)
	}
	out.footer()
	if failed {
		if env.Rank == 0 {
			fmt.Fprintln(stderr, "allreduce-perf: check FAILED: some results differ from the reference")
		}
		return 1
	}
	return 0
}

// row is one line of output.
type row struct {
	Collective string  `json:"collective"`
	InPlace    bool    `json:"in_place"` // AllReduce and Broadcast always; the others with --inplace
	SizeBytes  int64   `json:"size_bytes"`
	Count      int     `json:"count"`
	DType      string  `json:"dtype"`
	Op         string  `json:"op"`
	Ranks      int     `json:"nranks"`
	TimeUS     float64 `json:"time_us"` // the mean iteration, as nccl-tests reports it
	AlgBW      float64 `json:"algbw_gbs"`
	BusBW      float64 `json:"busbw_gbs"`
	// The median iteration and its busbw, as the PyTorch peer's script reports them: one
	// descheduled iteration moves the mean of a short run, not the median.
	TimeUSMedian float64 `json:"time_us_median"`
	BusBWMedian  float64 `json:"busbw_median_gbs"`
	Iters        int     `json:"iters"` // timed iterations: -n, or more for --min_time
	OK           *bool   `json:"ok"`    // null when not checked (-c 0)
	Wrong        int64   `json:"wrong"` // elements differing from the reference, over all ranks; -1 unchecked

	// --ceiling (Note [Ceiling]): the algorithm and its memory traffic per rank per message
	// byte, the memory rates (GB/s read plus written, the slowest rank's, every rank
	// copying, then reducing, then exchanging, at once), the busbw ceiling they imply for
	// the algorithm and for a single-copy one, and busbw's share of the first.
	Algo            string  `json:"algo,omitempty"`
	Traffic         float64 `json:"traffic_per_byte,omitempty"`
	CopyGBs         float64 `json:"mem_copy_gbs,omitempty"`
	ReduceGBs       float64 `json:"mem_reduce_gbs,omitempty"`
	ExchangeGBs     float64 `json:"mem_exchange_gbs,omitempty"`
	MemGBs          float64 `json:"mem_gbs,omitempty"` // the fastest of the three
	CeilBusBW       float64 `json:"ceiling_busbw_gbs,omitempty"`
	PctCeil         float64 `json:"pct_of_ceiling,omitempty"`
	PctCeilMedian   float64 `json:"pct_of_ceiling_median,omitempty"` // the median's busbw
	SingleCopyBusBW float64 `json:"single_copy_ceiling_busbw_gbs,omitempty"`
}

type reporter interface {
	header()
	row(row)
	footer()
}

type nopReporter struct{}

func (nopReporter) header()        {}
func (nopReporter) row(row)        {}
func (nopReporter) footer()        {}
func (nopReporter) String() string { return "" }

type tableReporter struct {
	w      io.Writer
	cfg    config
	ranks  int
	json   bool
	rows   int
	sumBus float64
	wrong  int64
}

func newReporter(w io.Writer, cfg config, ranks int) *tableReporter {
	return &tableReporter{w: w, cfg: cfg, ranks: ranks, json: cfg.json}
}

func (t *tableReporter) header() {
	if t.json {
		return
	}
	check := 1
	if !t.cfg.check {
		check = 0
	}
	flags := "" // the flags past -c that are set
	if t.cfg.collective != "" && t.cfg.collective != collAllReduce {
		flags += " --collective " + t.cfg.collective
	}
	if t.cfg.shared {
		flags += " --shared"
	}
	if t.cfg.inPlace {
		flags += " --inplace"
	}
	if t.cfg.reset {
		flags += " --reset"
	}
	if t.cfg.minTime > 0 {
		flags += " --min_time " + t.cfg.minTime.String()
	}
	fmt.Fprintf(t.w, "# allreduce-perf: backend %s, %d ranks, dtype %s, op %s, -b %d -e %d -f %d -n %d -w %d -c %d%s\n",
		t.cfg.backend, t.ranks, t.cfg.dtype, t.cfg.op, t.cfg.minBytes, t.cfg.maxBytes, t.cfg.factor, t.cfg.iters, t.cfg.warmup, check, flags)
	fmt.Fprintf(t.w, "#\n# %12s %12s %9s %6s %12s %10s %10s %8s", "size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong")
	if t.cfg.ceiling {
		fmt.Fprintf(t.w, " %10s %7s %9s %9s %9s %9s", "algo", "traffic", "memory", "ceiling", "%ceiling", "1-copy")
	} else {
		fmt.Fprintf(t.w, " %12s", "algo")
	}
	fmt.Fprintf(t.w, "\n# %12s %12s %9s %6s %12s %10s %10s %8s", "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "")
	if t.cfg.ceiling {
		fmt.Fprintf(t.w, " %10s %7s %9s %9s %9s %9s", "", "(B/B)", "(GB/s)", "(GB/s)", "", "(GB/s)")
	}
	fmt.Fprintln(t.w)
}

func (t *tableReporter) row(r row) {
	t.rows++
	t.sumBus += r.BusBW
	if r.Wrong > 0 {
		t.wrong += r.Wrong
	}
	if t.json {
		b, _ := json.Marshal(r)
		fmt.Fprintf(t.w, "%s\n", b)
		return
	}
	wrong := "N/A"
	if r.Wrong >= 0 {
		wrong = strconv.FormatInt(r.Wrong, 10)
	}
	fmt.Fprintf(t.w, "  %12d %12d %9s %6s %12.2f %10.3f %10.3f %8s",
		r.SizeBytes, r.Count, r.DType, r.Op, r.TimeUS, r.AlgBW, r.BusBW, wrong)
	if t.cfg.ceiling {
		traffic, ceil, pct, one := "-", "-", "-", "-"
		if r.CeilBusBW > 0 {
			traffic, ceil, pct = fmt.Sprintf("%.2f", r.Traffic), fmt.Sprintf("%.3f", r.CeilBusBW), fmt.Sprintf("%.1f%%", r.PctCeil)
			one = fmt.Sprintf("%.3f", r.SingleCopyBusBW)
		}
		fmt.Fprintf(t.w, " %10s %7s %9.2f %9s %9s %9s", r.Algo, traffic, r.MemGBs, ceil, pct, one)
	} else if r.Algo != "" {
		fmt.Fprintf(t.w, " %12s", r.Algo)
	}
	fmt.Fprintln(t.w)
}

func (t *tableReporter) footer() {
	if t.json {
		return
	}
	verdict := "OK"
	if t.wrong > 0 {
		verdict = "FAILED"
	}
	if !t.cfg.check {
		verdict = "not checked"
	}
	fmt.Fprintf(t.w, "# Out of bounds values : %d %s\n", t.wrong, verdict)
	if t.rows > 0 {
		fmt.Fprintf(t.w, "# Avg bus bandwidth    : %.3f\n", t.sumBus/float64(t.rows))
	}
}

// tlsOn reports whether GODDP_TLS_* turn TLS on (Rendezvous then accepts a job without a token).
func tlsOn() bool {
	f, err := procgroup.TLSFromEnv(nil)
	return err == nil && f.Enabled()
}
