// Command transformer trains the seed's ddp_bench.py model (or a token-copy task) with
// gorgonia, flags mirroring ddp_bench.py. See doc.go.
package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	stdsync "sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"gorgonia.org/tensor"

	_ "github.com/goddp/goddp/backends/gloo" // --backend gloo
	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/elastic"
	"github.com/goddp/goddp/ddp/gorgoniaddp"
	"github.com/goddp/goddp/ddp/optim"
	"github.com/goddp/goddp/examples/transformer/model"
	"github.com/goddp/goddp/internal/hookshards"
	"github.com/goddp/goddp/internal/outpath"
	"github.com/goddp/goddp/procgroup"
)

type flags struct {
	bucketCapMB   capMB
	firstCapMB    float64
	timeout       time.Duration
	logLevel      string
	numLayers     int
	hidden        int
	batch         int
	seqLen        int
	warmup        int
	bench         int
	noDDP         bool
	accum         int
	backend       string
	seed          uint64
	task          string
	lr            float64
	dropout       float64
	logEvery      int
	checkpointDir string
	zero          int  // --zero: ddp.Options.Zero
	zeroOverlap   bool // --zero_overlap: ddp.Options.ZeroOverlap
	zeroForward   bool // --zero_forward_overlap: ddp.Options.ZeroForwardOverlap
	ckptEvery     int
	resume        bool
	cpuProfile    string
	autoProfile   string // --auto_profile
	trace         string
	metricsAddr   string
	reportEvery   int
	straggleRank  int           // --straggle_ms R:MS: rank R (-1: none) …
	straggle      time.Duration // … sleeps this long per step before backward
	inject        injection     // --inject_nan
	noFiniteCheck bool
	global        int // --global_batch_size: samples per step over all ranks (with --micro_batch_size)
	micro         int // --micro_batch_size: samples per logical shard

	// stderr is where a rank says a non-finite gradient before it leaves (nonFinite).
	stderr   io.Writer
	commHook string
	psgd     ddp.PowerSGDOptions // --powersgd_rank, --powersgd_start_iter, --powersgd_min_compression_rate

	// getenv reads the launcher's environment (TORCHELASTIC_RESTART_COUNT, LOCAL_RANK,
	// GODDP_TRACE); os.Getenv unless a test sets it.
	getenv func(string) string

	// onServe, when set (by tests), receives the metrics server's address.
	onServe func(addr string)
	// onGrads, when set (by tests), sees each step's final gradients before the
	// optimizer step. It must not keep grads.
	onGrads func(step int, grads []float32)

	// stepsPerRank is --steps_per_rank: rank r runs stepsPerRank[r] steps, then ddp's Join
	// (nil: every rank runs --warmup_steps + --bench_steps).
	stepsPerRank []int
}

// shards is the number of logical shards of a step's batch, L = global/micro; 0 without
// --global_batch_size.
func (f flags) shards() int {
	if f.micro == 0 {
		return 0
	}
	return f.global / f.micro
}

// capMB is --bucket_cap_mb: a size in MB, or auto (ddp.AutoBucketCap).
type capMB float64

func (c capMB) String() string {
	if float64(c) == ddp.AutoBucketCap {
		return "auto"
	}
	return strconv.FormatFloat(float64(c), 'g', -1, 64)
}

func (c *capMB) Set(s string) error {
	if s == "auto" {
		*c = capMB(ddp.AutoBucketCap)
		return nil
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || !(v > 0) {
		return fmt.Errorf("want a positive size in MB or auto, got %q", s)
	}
	*c = capMB(v)
	return nil
}

func parseFlags(args []string, stderr io.Writer) (flags, error) {
	var f flags
	fs := flag.NewFlagSet("transformer", flag.ContinueOnError)
	// The flag package prints the usage on every error; print it only for -h (with
	// several ranks, a typo would otherwise print it once per rank).
	var usage bytes.Buffer
	fs.SetOutput(&usage)
	f.bucketCapMB = 25
	fs.Var(&f.bucketCapMB, "bucket_cap_mb", "DDP bucket size cap in MB, or auto: chosen from the first 3 steps' measurements")
	fs.StringVar(&f.autoProfile, "auto_profile", "", "with --bucket_cap_mb auto or --comm_hook auto, rank 0 writes what it measured (the step model's inputs, for cmd/ddpsim) to this JSON file")
	fs.Float64Var(&f.firstCapMB, "first_bucket_cap_mb", 1, "cap of the first bucket in MB (PyTorch: 1 MiB)")
	fs.DurationVar(&f.timeout, "timeout", 0, "bound on each collective (0: the process group's default, 30m)")
	fs.StringVar(&f.logLevel, "log_level", "warn", "level of the ddp/process-group log on stderr (debug, info, warn, error)")
	fs.IntVar(&f.numLayers, "num_layers", 2, "encoder layers")
	fs.IntVar(&f.hidden, "hidden_size", 256, "model width (d_model)")
	fs.IntVar(&f.batch, "batch_size", 8, "samples per rank per micro-batch")
	fs.IntVar(&f.seqLen, "seq_len", 64, "tokens per sample")
	fs.IntVar(&f.warmup, "warmup_steps", 3, "untimed steps")
	fs.IntVar(&f.bench, "bench_steps", 12, "timed steps")
	fs.BoolVar(&f.noDDP, "no_ddp", false, "one process, same per-rank batch, no communication (with --global_batch_size: every shard, summed in shard order)")
	fs.IntVar(&f.accum, "accum_steps", 1, "micro-batches per optimizer step (all but the last under NoSync)")
	fs.StringVar(&f.backend, "backend", "gloo", "process group backend")
	fs.Uint64Var(&f.seed, "seed", 0, "seed of the parameters, data and dropout")
	fs.StringVar(&f.task, "task", model.TaskMSE, "mse (ddp_bench.py's model) or copy (token copy, cross-entropy)")
	fs.Float64Var(&f.lr, "lr", 1e-4, "AdamW learning rate")
	fs.Float64Var(&f.dropout, "dropout", 0.1, "dropout probability")
	fs.IntVar(&f.logEvery, "log_every", 5, "print the loss every N steps (0: never)")
	fs.StringVar(&f.checkpointDir, "checkpoint_dir", "", "directory for checkpoints (empty: none)")
	fs.IntVar(&f.zero, "zero", 0, "ZeRO stage (ddp.Options.Zero): 0 plain DDP, 1 AdamW's state sharded over the ranks, 2 gradients reduce-scattered too; a checkpoint holds the whole state and resumes at any stage")
	fs.BoolVar(&f.zeroOverlap, "zero_overlap", false, "with --zero: step each bucket's shard and issue its all-gather as soon as its reduction completes, during backward, instead of after it (ddp.Options.ZeroOverlap: the same bits)")
	fs.BoolVar(&f.zeroForward, "zero_forward_overlap", false, "with --zero: let the parameters' all-gathers run into the next forward, which waits for each bucket where it first uses it (ddp.Options.ZeroForwardOverlap: the same bits; on a slow link, smaller buckets let the first layers start sooner)")
	fs.IntVar(&f.ckptEvery, "checkpoint_every", 10, "checkpoint every N steps (and at the end)")
	fs.BoolVar(&f.resume, "resume", false, "resume from the checkpoint in --checkpoint_dir if there is one")
	fs.StringVar(&f.cpuProfile, "cpuprofile", "", "write a CPU profile of the run to this file")
	fs.StringVar(&f.trace, "trace", "", "write this rank's timeline (Chrome trace JSON) to this file ({rank}, {attempt} expand; default: $GODDP_TRACE)")
	fs.StringVar(&f.metricsAddr, "metrics_addr", "", "serve Prometheus metrics at HOST:PORT/metrics (the rank of local rank L listens on PORT+L)")
	fs.IntVar(&f.reportEvery, "report_every", 50, "rank 0 prints the DDP overlap report every N steps (and at the end); the ranks exchange straggler data as often")
	fs.Var(&f.inject, "inject_nan", "RANK:STEP:PARAM: put a NaN into rank RANK's gradient of parameter PARAM (index or name) in step STEP, to see ddp name it")
	fs.BoolVar(&f.noFiniteCheck, "no_finite_check", false, "turn off ddp's check that names the ranks and parameters of non-finite gradients (ddp.Options.NoFiniteCheck)")
	fs.IntVar(&f.global, "global_batch_size", 0, "samples per step over all ranks, cut into global/micro logical shards whose sum is the same bits at every world size that divides it (with --micro_batch_size; instead of --batch_size and --accum_steps)")
	fs.IntVar(&f.micro, "micro_batch_size", 0, "samples per logical shard (with --global_batch_size)")
	perRank := fs.String("steps_per_rank", "", "comma-separated steps of each rank, the first --warmup_steps untimed (uneven data, e.g. 3,5): a rank whose steps are done joins (ddp.Options.UnevenInputs) until every rank's are; instead of --bench_steps. With --no_ddp, one process runs every rank's micro-batches of each step, as the ranks would with Join")
	straggle := fs.String("straggle_ms", "", "R:MS: rank R sleeps MS milliseconds per step before backward (a straggler on purpose, for the straggler report)")
	fs.StringVar(&f.commHook, "comm_hook", "none", "DDP communication hook: "+ddp.CommHookNames)
	fs.IntVar(&f.psgd.Rank, "powersgd_rank", 0, "with --comm_hook powersgd: the rank of each matrix's approximation (PyTorch's matrix_approximation_rank; 0: 1); with auto: the only rank it may choose (0: 2 or 4)")
	fs.IntVar(&f.psgd.StartIter, "powersgd_start_iter", 0, "with --comm_hook powersgd: steps all-reduced uncompressed first (PyTorch's start_powerSGD_iter)")
	fs.Float64Var(&f.psgd.MinCompressionRate, "powersgd_min_compression_rate", 2, "with --comm_hook powersgd: a matrix is compressed only if that saves this factor (PyTorch's min_compression_rate)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			stderr.Write(usage.Bytes())
			return f, err
		}
		return f, fmt.Errorf("%w (see --help)", err)
	}
	if _, err := zapcore.ParseLevel(f.logLevel); err != nil {
		return f, fmt.Errorf("--log_level: %w", err)
	}
	if _, err := ddp.CommHookNamed(f.commHook, f.psgd); err != nil {
		return f, fmt.Errorf("--comm_hook: %w", err)
	}
	if err := checkShardFlags(f, fs); err != nil {
		return f, err
	}
	steps, err := parseStepsPerRank(f, fs, *perRank)
	if err != nil {
		return f, err
	}
	f.stepsPerRank = steps
	switch {
	case fs.NArg() > 0:
		return f, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	case f.batch <= 0 || f.seqLen <= 0 || f.accum <= 0:
		return f, fmt.Errorf("--batch_size %d, --seq_len %d, --accum_steps %d must be positive", f.batch, f.seqLen, f.accum)
	case f.warmup < 0 || f.bench < 0:
		return f, fmt.Errorf("--warmup_steps %d, --bench_steps %d must not be negative", f.warmup, f.bench)
	case !(f.bucketCapMB > 0 || f.bucketCapMB == ddp.AutoBucketCap) || !(f.firstCapMB > 0):
		return f, fmt.Errorf("--bucket_cap_mb %v, --first_bucket_cap_mb %v must be positive", f.bucketCapMB, f.firstCapMB)
	case f.autoProfile != "" && float64(f.bucketCapMB) != ddp.AutoBucketCap && f.commHook != "auto":
		return f, errors.New("--auto_profile needs --bucket_cap_mb auto or --comm_hook auto")
	case f.timeout < 0:
		return f, fmt.Errorf("--timeout %v must not be negative", f.timeout)
	case f.resume && f.checkpointDir == "":
		return f, errors.New("--resume needs --checkpoint_dir")
	case f.ckptEvery <= 0:
		return f, fmt.Errorf("--checkpoint_every %d must be positive", f.ckptEvery)
	case f.reportEvery <= 0:
		return f, fmt.Errorf("--report_every %d must be positive", f.reportEvery)
	case f.zero < 0 || f.zero > 2:
		return f, fmt.Errorf("--zero %d: want 0, 1 or 2", f.zero)
	case f.zero > 0 && (f.noDDP || f.shards() > 0 || float64(f.bucketCapMB) == ddp.AutoBucketCap):
		return f, errors.New("--zero 1 and 2 take neither --no_ddp, --global_batch_size nor --bucket_cap_mb auto")
	case f.zeroOverlap && f.zero == 0:
		return f, errors.New("--zero_overlap needs --zero 1 or 2")
	case f.zeroForward && f.zero == 0:
		return f, errors.New("--zero_forward_overlap needs --zero 1 or 2")
	case f.zeroForward && f.zeroOverlap:
		return f, errors.New("--zero_forward_overlap and --zero_overlap: choose one (the all-gathers run during the next forward, or during backward)")
	case f.zeroOverlap && f.inject.on:
		return f, errors.New("--zero_overlap takes no --inject_nan: the overlapped step is taken before the check for non-finite gradients")
	}
	f.straggleRank = -1
	if *straggle != "" {
		r, ms, ok := strings.Cut(*straggle, ":")
		rank, err1 := strconv.Atoi(r)
		msv, err2 := strconv.ParseFloat(ms, 64)
		if !ok || err1 != nil || err2 != nil || rank < 0 || !(msv >= 0) || msv > 1e6 {
			return f, fmt.Errorf("--straggle_ms %q: want RANK:MILLISECONDS, e.g. 1:20", *straggle)
		}
		f.straggleRank, f.straggle = rank, time.Duration(msv*float64(time.Millisecond))
	}
	f.getenv = os.Getenv
	f.stderr = stderr
	return f, nil
}

// checkShardFlags checks --global_batch_size and --micro_batch_size, which go together and
// fix the batch, so --batch_size and --accum_steps cannot go beside them, nor what
// ddp.Options.Shards cannot be combined with.
func checkShardFlags(f flags, fs *flag.FlagSet) error {
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	if !set["global_batch_size"] && !set["micro_batch_size"] {
		return nil
	}
	switch {
	case f.global <= 0 || f.micro <= 0 || f.global%f.micro != 0:
		return fmt.Errorf("--global_batch_size %d, --micro_batch_size %d: want both positive, the global batch a multiple of the micro-batch", f.global, f.micro)
	case set["batch_size"] || set["accum_steps"]:
		return errors.New("--global_batch_size and --micro_batch_size fix the batch: drop --batch_size and --accum_steps")
	case float64(f.bucketCapMB) == ddp.AutoBucketCap:
		return errors.New("--global_batch_size: the shards take a fixed --bucket_cap_mb, not auto")
	}
	return nil
}

// parseStepsPerRank parses --steps_per_rank and refuses what cannot go beside it: what
// fixes the steps or the batch (--bench_steps, --global_batch_size), and what issues
// collectives of its own at some step (--checkpoint_dir, --zero, --bucket_cap_mb auto,
// --inject_nan's leaving together).
func parseStepsPerRank(f flags, fs *flag.FlagSet, s string) ([]int, error) {
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	if !set["steps_per_rank"] {
		return nil, nil
	}
	var steps []int
	for _, p := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil || n < 0 {
			return nil, fmt.Errorf("--steps_per_rank %q: want comma-separated step counts, not negative, one per rank (e.g. 3,5)", s)
		}
		steps = append(steps, n)
	}
	switch {
	case set["bench_steps"]:
		return nil, errors.New("--steps_per_rank gives each rank its steps: drop --bench_steps")
	case f.shards() > 0 || f.checkpointDir != "" || f.zero > 0 || float64(f.bucketCapMB) == ddp.AutoBucketCap || set["inject_nan"]:
		return nil, errors.New("--steps_per_rank takes neither --global_batch_size, --checkpoint_dir, --zero, --bucket_cap_mb auto nor --inject_nan")
	}
	return steps, nil
}

// usageError is a bad command line (exit status 2; other errors exit 1).
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func main() {
	err := run(context.Background(), os.Args[1:], os.Stdout, os.Stderr)
	var ue usageError
	switch {
	case err == nil:
	case errors.Is(err, flag.ErrHelp):
		os.Exit(2)
	case errors.As(err, &ue):
		fmt.Fprintln(os.Stderr, "transformer:", err)
		ddp.RecordFailure(fmt.Errorf("transformer: %w", err)) //nolint:errcheck // best effort: the usage error is printed already
		os.Exit(2)
	default:
		if !errors.As(err, new(saidError)) {
			fmt.Fprintln(os.Stderr, "transformer:", err)
		}
		// Under torchrun: the root cause for its failure summary.
		if rerr := ddp.RecordFailure(fmt.Errorf("transformer: %w", err)); rerr != nil {
			fmt.Fprintln(os.Stderr, "transformer:", rerr)
		}
		os.Exit(1)
	}
}

// gradSync is the seam between the training loop and gradient synchronisation: the
// model's grad-ready hook feeds it during backward and Finalize makes the step's
// gradients final in the flat gradient buffer before the optimizer runs. localSync
// (--no_ddp) accumulates locally; a ddp wrapper implements the same three methods
// with bucketed all-reduces (pre-dividing by the world size).
type gradSync interface {
	// BeginBackward precedes each micro-batch's backward; mode is ddp.Accumulate for all
	// but the last micro-batch of an optimizer step (NoSync).
	BeginBackward(mode ddp.SyncMode)
	// Hook receives parameter i's gradient of the current micro-batch. It runs on the
	// tape machine's goroutine during backward and must not block.
	Hook(i int, grad *tensor.Dense)
	// Finalize waits until the step's gradients are final in the flat buffer.
	Finalize(ctx context.Context) error
}

// graphBuild serialises the building of graphs in one process (the tests run ranks as
// goroutines): gorgonia v0.9.18 shares package-level nodes (its constants) between graphs
// and caches their hash codes lazily, so two graphs built at once race on them (seen with
// -race in gorgonia.Grad → ExprGraph.AddNode → Node.Hashcode).
var graphBuild stdsync.Mutex

// localSync accumulates every micro-batch's gradients into one flat buffer.
type localSync struct {
	params []model.Param
	grads  []float32
	first  bool // next micro-batch is the first of the step: overwrite, not add
}

func (s *localSync) BeginBackward(ddp.SyncMode) {}

func (s *localSync) Hook(i int, grad *tensor.Dense) {
	p := s.params[i]
	dst, src := s.grads[p.Offset:p.Offset+p.Size], grad.Data().([]float32)
	if s.first {
		copy(dst, src)
		return
	}
	for k, g := range src {
		dst[k] += g
	}
}

func (s *localSync) Finalize(context.Context) error { return nil }

// ddpSync is a DDP as a gradSync: its hook is gorgoniaddp's, which reports the gorgonia
// gradients to the DDP.
type ddpSync struct {
	*ddp.DDP
	hook gorgoniaddp.GradHook
}

func (s ddpSync) Hook(i int, grad *tensor.Dense) { s.hook(i, grad) }

// world is this process's place in the job: rank and size.
type world struct{ rank, size int }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	f, err := parseFlags(args, stderr)
	if err != nil {
		return usageError{err}
	}
	if err := checkOutputs(f); err != nil {
		return err
	}
	if w := blasWarning(); w != "" {
		fmt.Fprintln(stderr, "warning:", w)
	}
	if f.cpuProfile != "" {
		fh, err := os.Create(f.cpuProfile)
		if err != nil {
			return err
		}
		defer fh.Close()
		if err := pprof.StartCPUProfile(fh); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	_, err = train(ctx, f, stdout, stderr)
	return err
}

// checkOutputs makes the folders of the flags that write files, and checks that they can
// be written, before the run (not at its end, or in its middle).
func checkOutputs(f flags) error {
	if err := outpath.Dir("--checkpoint_dir", f.checkpointDir); err != nil {
		return err
	}
	if err := outpath.File("--cpuprofile", f.cpuProfile); err != nil {
		return err
	}
	if err := outpath.File("--auto_profile", f.autoProfile); err != nil {
		return err
	}
	// The trace's file name may hold {rank} and {attempt}; its folder is checked here,
	// and made again by observe.OpenTrace if that too holds them.
	if dir := filepath.Dir(f.trace); f.trace != "" && !strings.Contains(dir, "{") {
		return outpath.Dir("--trace", dir)
	}
	return nil
}

// modelConfig is the model the flags describe.
func modelConfig(f flags) model.Config {
	cfg := model.DefaultConfig()
	cfg.Task, cfg.NumLayers, cfg.Hidden, cfg.Dropout, cfg.Seed = f.task, f.numLayers, f.hidden, f.dropout, f.seed
	return cfg
}

// newLogger writes the ddp and process-group log lines (rare: set-up, failures, the
// watchdog) to stderr at --log_level.
func newLogger(f flags, stderr io.Writer) *zap.Logger {
	lvl, _ := zapcore.ParseLevel(f.logLevel) // checked by parseFlags
	enc := zapcore.NewConsoleEncoder(zapcore.EncoderConfig{
		TimeKey: "ts", LevelKey: "level", NameKey: "logger", MessageKey: "msg",
		EncodeTime: zapcore.ISO8601TimeEncoder, EncodeLevel: zapcore.LowercaseLevelEncoder,
		EncodeDuration: zapcore.StringDurationEncoder,
	})
	return zap.New(zapcore.NewCore(enc, zapcore.AddSync(stderr), lvl))
}

// train runs the training loop, with --no_ddp in this process alone, otherwise as one rank
// of the process group the launcher's environment describes (ddprun, torchrun-style
// variables, srun, mpirun), and returns the trained model.
func train(ctx context.Context, f flags, stdout, stderr io.Writer) (*model.Model, error) {
	// The model first: a bad configuration fails before this rank joins the group.
	m, err := model.New(modelConfig(f))
	if err != nil {
		return nil, err
	}
	log := newLogger(f, stderr)
	if f.noDDP {
		return m, trainWith(ctx, f, m, nil, log, stdout)
	}
	if elastic.Enabled(nil) {
		return m, trainElastic(ctx, f, m, log, stdout) // elastic.go
	}
	pg, err := ddp.InitProcessGroup(ctx, f.backend, ddp.InitOptions{Timeout: f.timeout, Logger: log})
	if err != nil {
		return nil, err
	}
	if t := procgroup.Transports(pg); t != nil {
		// How this rank reaches each peer, as the backend connected it (shared memory, Unix
		// socket or TCP with the peer's address): the first thing to look at on several hosts.
		parts := make([]string, len(t))
		for i, v := range t {
			parts[i] = strconv.Itoa(i) + "=" + v
		}
		fmt.Fprintf(stderr, "transports: rank %d: %s\n", pg.Rank(), strings.Join(parts, " "))
	}
	err = trainWith(ctx, f, m, pg, log, stdout)
	if err != nil && !errors.As(err, new(saidError)) { // a said error: the ranks left together
		// The other ranks must not wait for this one: fail their pending collectives.
		pg.Abort(err)
	}
	if cerr := pg.Close(); cerr != nil && err == nil {
		return nil, fmt.Errorf("rank %d: closing the process group: %w", pg.Rank(), cerr)
	}
	return m, err
}

// trainWith trains m (in place) as one rank of pg (nil: alone, without ddp). The process
// group stays the caller's.
func trainWith(ctx context.Context, f flags, m *model.Model, pg procgroup.ProcessGroup, log *zap.Logger, stdout io.Writer) (err error) {
	return trainEpoch(ctx, f, m, pg, log, stdout, nil)
}

// trainEpoch is trainWith, and with el one epoch of an elastic job: its optimizer, its
// first step and its commits come from el.
func trainEpoch(ctx context.Context, f flags, m *model.Model, pg procgroup.ProcessGroup, log *zap.Logger, stdout io.Writer, el *elasticRun) (err error) {
	t := &trainer{f: f, w: world{rank: 0, size: 1}, m: m, pg: pg, grads: make([]float32, m.NumParams()), stdout: stdout, el: el}
	if pg != nil {
		t.w = world{rank: pg.Rank(), size: pg.Size()}
	}
	if err := t.initSync(ctx, log); err != nil {
		return err
	}
	if t.d != nil {
		defer t.d.Close()
	}

	hook, err := injectHook(f, t.w.rank, m.Params(), &t.cur, t.sync.Hook)
	if err != nil {
		return err
	}
	batch, scale := f.batch, 1/float64(f.accum*t.emulated())
	if L := f.shards(); L > 0 {
		batch = f.micro // one shard per run, its own mean loss (--accum_steps is 1)
		lo, hi := 0, L
		if t.d != nil {
			if lo, hi, err = hookshards.Local(t.d, L); err != nil {
				return err
			}
			scale = hookshards.Scale(t.d, lo, hi) // 1, or n/L with a --comm_hook
		}
		t.shardLo, t.shardLoss, t.shardScale = lo, make([]float64, hi-lo), scale
	}
	if el != nil {
		if err := el.attach(ctx, t.d); err != nil {
			return err
		}
	}
	graphBuild.Lock()
	t.g, err = m.NewGraph(model.GraphOptions{
		Batch: batch, SeqLen: f.seqLen, Train: true, DataSeed: f.seed,
		LossScale: scale, Hook: hook, Wait: t.paramWait(),
	})
	graphBuild.Unlock()
	if err != nil {
		return err
	}
	defer t.g.Close()
	var start int
	if el != nil {
		if t.opt, start, err = el.begin(); err != nil {
			return err
		}
	} else {
		if f.zero == 0 { // with --zero the DDP makes and steps its shard's AdamW
			if t.opt, err = optim.NewAdamW(m.NumParams(), optim.AdamWOptions{LR: f.lr}); err != nil {
				return err
			}
		}
		if start, err = t.resume(ctx, log); err != nil {
			return err
		}
	}
	t.banner(start)

	total := t.steps()
	if t.obs, err = newObserver(f, t.w, t.d, stdout, total); err != nil {
		return err
	}
	defer func() {
		if cerr := t.obs.close(ctx); cerr != nil && err == nil {
			err = cerr
		}
	}()
	for step := start; step < total; step++ {
		if err := t.runStep(ctx, step, total); err != nil {
			return err
		}
	}
	if t.d != nil && f.stepsPerRank != nil { // this rank's data is done: shadow the others' steps
		end := t.obs.tr.Span("join")
		if err := t.d.Join(ctx); err != nil { // then every rank holds the same parameters
			return fmt.Errorf("rank %d: --steps_per_rank: %w", t.w.rank, err)
		}
		end()
	}
	return t.finish(ctx)
}

// steps is the number of steps this rank runs: --warmup_steps + --bench_steps, or its count
// of --steps_per_rank (alone, the largest count).
func (t *trainer) steps() int {
	f := t.f
	switch {
	case f.stepsPerRank == nil:
		return f.warmup + f.bench
	case t.pg != nil:
		return f.stepsPerRank[t.w.rank]
	}
	return slices.Max(f.stepsPerRank)
}

// emulated is the number of ranks whose micro-batches this process runs itself: with
// --no_ddp and --steps_per_rank every rank's, 1 otherwise.
func (t *trainer) emulated() int {
	if t.pg == nil && t.f.stepsPerRank != nil {
		return len(t.f.stepsPerRank)
	}
	return 1
}

// trainer is one rank's training run: what trainWith sets up, and the totals of the timed
// steps.
type trainer struct {
	f      flags
	w      world
	m      *model.Model
	pg     procgroup.ProcessGroup // nil: alone, without ddp
	grads  []float32              // the flat gradient buffer, which the optimizer reads
	local  *localSync             // without ddp
	d      *ddp.DDP               // with ddp
	sync   gradSync               // local or d
	g      *model.Graph
	opt    *optim.AdamW
	ck     *ckpt       // with --checkpoint_dir
	el     *elasticRun // under an elastic launcher
	obs    *observer
	stdout io.Writer
	cur    int // the running step

	// With --global_batch_size: this rank's first shard, and the last step's loss of each
	// of its shards.
	shardLo    int
	shardLoss  []float64
	shardScale float64 // of a shard's loss and gradient: 1, or n/L with a --comm_hook

	timed  time.Duration // the total time of the timed steps (after --warmup_steps)
	nTimed int
	// timedCPU: the process's CPU time (user and system) over the timed steps
	timedCPU time.Duration
	ov       overlap

	// zeroFull, with --zero and --checkpoint_dir, holds AdamW's whole state, gathered from
	// the ranks' shards before each save and handed to them after a restore: the form
	// --zero 0's AdamW has, so a checkpoint resumes at any --zero.
	zeroFull *optim.AdamW
}

// initSync sets t.sync: a localSync alone, otherwise a DDP over every parameter.
func (t *trainer) initSync(ctx context.Context, log *zap.Logger) error {
	params := t.m.Params()
	if t.pg == nil {
		t.local = &localSync{params: params, grads: t.grads}
		t.sync = t.local
		return nil
	}
	// Every parameter is a view of the model's flat buffer (which the graph reads
	// at every run) and of the flat gradient buffer (which the optimizer reads):
	// New overwrites the former with rank 0's values, Finalize leaves the averaged
	// gradients in the latter.
	dp := make([]ddp.Param, len(params))
	for i, p := range params {
		dp[i] = ddp.Param{Name: p.Name, Data: t.m.Data32()[p.Offset : p.Offset+p.Size],
			Grad: t.grads[p.Offset : p.Offset+p.Size], Shape: p.Shape}
	}
	ps := t.f.psgd
	ps.Seed = t.f.seed
	hook, err := ddp.CommHookNamed(t.f.commHook, ps)
	if err != nil {
		return err
	}
	opts := ddp.Options{BucketCapMB: float64(t.f.bucketCapMB), FirstBucketCapMB: t.f.firstCapMB, Logger: log, CommHook: hook,
		NoFiniteCheck: t.f.noFiniteCheck, Shards: hookshards.Options(t.f.commHook, t.f.shards()), UnevenInputs: t.f.stepsPerRank != nil}
	if n := len(t.f.stepsPerRank); n > 0 && n != t.w.size {
		return fmt.Errorf("--steps_per_rank %v: %d counts for a world of %d ranks", t.f.stepsPerRank, n, t.w.size)
	}
	if t.f.zero > 0 { // the same AdamW as --zero 0's, bit for bit
		lr := t.f.lr
		opts.Zero, opts.ZeroOverlap, opts.ZeroForwardOverlap = t.f.zero, t.f.zeroOverlap, t.f.zeroForward
		opts.Optimizer = func(n int) (optim.Optimizer, error) {
			return optim.NewAdamW(n, optim.AdamWOptions{LR: lr})
		}
	}
	d, err := ddp.New(ctx, t.pg, dp, opts)
	if err != nil {
		if t.f.shards() > 0 {
			return fmt.Errorf("--global_batch_size %d / --micro_batch_size %d: %w", t.f.global, t.f.micro, err)
		}
		return err
	}
	t.d = d
	t.sync = ddpSync{d, gorgoniaddp.Hook(d)}
	return nil
}

// resume restores the last checkpoint with --checkpoint_dir and returns the step to start
// from (0 without).
func (t *trainer) resume(ctx context.Context, log *zap.Logger) (int, error) {
	f, w := t.f, t.w
	if f.checkpointDir == "" {
		return 0, nil
	}
	opt := t.opt
	if f.zero > 0 {
		var err error
		if t.zeroFull, err = optim.NewAdamW(t.m.NumParams(), optim.AdamWOptions{LR: f.lr}); err != nil {
			return 0, err
		}
		opt = t.zeroFull
	}
	var err error
	if t.ck, err = newCkpt(f, w, t.pg, t.m, opt, log); err != nil {
		return 0, err
	}
	t.ck.commHook(t.d)
	start, err := t.ck.restore(ctx, f, w)
	if err != nil {
		return 0, err
	}
	if t.zeroFull != nil && start > 0 { // this rank's shard of the restored state
		if err := t.d.SetOptimizerState(t.zeroFull.State()); err != nil {
			return 0, fmt.Errorf("rank %d: --checkpoint_dir: AdamW's state: %w", w.rank, err)
		}
	}
	// The kill test (scripts/kill_test.sh) finds this rank's process by this file.
	if err := os.MkdirAll(f.checkpointDir, 0o755); err != nil {
		return 0, fmt.Errorf("rank %d: %w", w.rank, err)
	}
	pidFile := filepath.Join(f.checkpointDir, fmt.Sprintf("rank%d.pid", w.rank))
	if err := os.WriteFile(pidFile, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		return 0, fmt.Errorf("rank %d: %w", w.rank, err)
	}
	return start, nil
}

// banner prints the model and the run's settings (rank 0 only).
func (t *trainer) banner(start int) {
	if t.w.rank != 0 {
		return
	}
	f, cfg := t.f, t.m.Config()
	fmt.Fprintf(t.stdout, "Model: %.2f MB | bucket_cap_mb=%v\n", float64(t.m.NumParams())*4/1e6, f.bucketCapMB)
	batch := fmt.Sprintf("batch=%d seq=%d accum=%d", f.batch, f.seqLen, f.accum)
	if L := f.shards(); L > 0 {
		batch = fmt.Sprintf("global_batch=%d micro_batch=%d shards=%d seq=%d", f.global, f.micro, L, f.seqLen)
	}
	fmt.Fprintf(t.stdout, "params=%d task=%s layers=%d hidden=%d %s world=%d blas=%s start_step=%d\n",
		t.m.NumParams(), cfg.Task, cfg.NumLayers, cfg.Hidden, batch, t.w.size, blasName, start)
}

// runStep runs optimizer step step of total, times it (after --warmup), and reports,
// averages the loss and checkpoints as the flags ask.
func (t *trainer) runStep(ctx context.Context, step, total int) error {
	f := t.f
	t0 := time.Now()
	cpu0, cpuOK := processCPU()
	loss, err := t.step(ctx, step)
	if err != nil {
		return err
	}
	dur := time.Since(t0)
	if step >= f.warmup {
		t.timed += dur
		t.nTimed++
		if cpu1, ok := processCPU(); ok && cpuOK {
			t.timedCPU += cpu1 - cpu0
		}
		if t.d != nil {
			t.ov.add(t.d.Stats())
		}
	}
	if math.IsNaN(loss) || math.IsInf(loss, 0) {
		return fmt.Errorf("rank %d: step %d: loss is %v", t.w.rank, step, loss)
	}
	t.obs.endStep(step, dur, loss)
	if f.logEvery > 0 && (step%f.logEvery == 0 || step == total-1) {
		if err := t.showLoss(ctx, step, loss); err != nil {
			return err
		}
	}
	if t.el != nil {
		if err := t.el.commit(ctx, step+1); err != nil {
			return err
		}
	}
	if f.checkpointDir != "" && ((step+1)%f.ckptEvery == 0 || step == total-1) {
		end := t.obs.tr.Span("checkpoint")
		if t.zeroFull != nil { // every rank: the shards' state, whole, and the parameters in place
			if err := t.d.GatherOptimizerState(ctx, t.zeroFull.State()); err != nil {
				return fmt.Errorf("rank %d: step %d: gathering AdamW's state for the checkpoint: %w", t.w.rank, step, err)
			}
		}
		if err := t.ck.save(ctx, step+1); err != nil {
			return err
		}
		end()
	}
	return nil
}

// step runs the timed part of an optimizer step: forward and backward over --accum
// micro-batches, the gradients' sync, the optimizer. It returns this rank's loss.
func (t *trainer) step(ctx context.Context, step int) (float64, error) {
	t.obs.tr.BeginStep(step)
	t.cur = step
	if t.f.straggle > 0 && t.f.straggleRank == t.w.rank {
		end := t.obs.tr.Span("straggle (--straggle_ms)")
		time.Sleep(t.f.straggle)
		end()
	}
	end := t.obs.tr.Span("forward+backward")
	var loss float64
	if t.f.shards() > 0 {
		l, err := t.backwardShards(ctx, step) // with ddp, Finalize too
		if err != nil {
			return 0, t.nonFinite(ctx, step, err)
		}
		loss = l
		end()
	} else {
		l, err := t.forwardBackward(step)
		if err != nil {
			return 0, err
		}
		loss = l
		end()
		if err := t.sync.Finalize(ctx); err != nil {
			return 0, t.nonFinite(ctx, step, err)
		}
	}
	if err := t.obs.afterFinalize(ctx, t.d); err != nil {
		return 0, fmt.Errorf("step %d: %w", step, err)
	}
	if t.f.onGrads != nil {
		t.f.onGrads(step, t.grads)
	}
	end = t.obs.tr.Span("optimizer")
	if t.opt == nil { // --zero: this rank's shard, then the all-gather
		if err := t.d.Step(ctx); err != nil {
			return 0, fmt.Errorf("step %d: %w", step, err)
		}
	} else if err := t.opt.Step(t.m.Data32(), t.grads); err != nil {
		return 0, fmt.Errorf("step %d: %w", step, err)
	}
	end()
	return loss, nil
}

// forwardBackward runs the step's micro-batches, all but the last without sync, and
// returns the sum of their losses. With --no_ddp and --steps_per_rank it runs, for each
// micro-batch, every rank's that has data at step, in rank order, each loss scaled by
// 1/ranks (the graph's LossScale): what the ranks' steps with Join sum, since a rank that
// has joined adds zeros and the average divides by the world size.
func (t *trainer) forwardBackward(step int) (float64, error) {
	f := t.f
	lo, hi, size := t.w.rank, t.w.rank+1, t.w.size // the ranks whose micro-batches run here
	if n := t.emulated(); n > 1 {
		lo, hi, size = 0, n, n
	}
	var loss float64
	first := true
	for mb := 0; mb < f.accum; mb++ {
		for r := lo; r < hi; r++ {
			if t.pg == nil && f.stepsPerRank != nil && step >= f.stepsPerRank[r] {
				continue // rank r's data has run out: it has joined
			}
			// Global sample index: micro-batch mb of rank r holds samples
			// (mb·world + r)·B …, so R ranks × A micro-batches × B samples see the same
			// data as one process with batch R·A·B.
			if err := t.g.Load(step, (mb*size+r)*f.batch); err != nil {
				return 0, err
			}
			if t.local != nil {
				t.local.first = first
			}
			first = false
			mode := ddp.Accumulate // NoSync for all but the last micro-batch
			if mb == f.accum-1 {
				mode = ddp.Sync
			}
			t.sync.BeginBackward(mode)
			l, err := t.g.Run()
			if err != nil {
				return 0, fmt.Errorf("step %d micro-batch %d: %w", step, mb, err)
			}
			loss += l
		}
	}
	return loss, nil
}

// backwardShards runs the step's backward with --global_batch_size: a pass for each of this
// rank's shards, shard s holding the global samples s·micro … of the step whatever rank
// runs it, so that its data and dropout masks depend on (seed, shard, step) only (Load);
// with ddp, d.BackwardShards sums the shards' gradients in shard order and ends with
// Finalize. Alone (--no_ddp) it runs every shard and sums them the same way: the first
// shard's gradient, plus each next one in order, in float32, times 1/L. It returns the
// mean of this rank's shards' losses.
func (t *trainer) backwardShards(ctx context.Context, step int) (float64, error) {
	pass := func(s int) error {
		if err := t.g.Load(step, s*t.f.micro); err != nil {
			return err
		}
		l, err := t.g.Run()
		if err != nil {
			return fmt.Errorf("step %d shard %d: %w", step, s, err)
		}
		t.shardLoss[s-t.shardLo] = l / t.shardScale
		return nil
	}
	if t.d != nil {
		if err := hookshards.Backward(ctx, t.d, t.shardLo, t.shardLo+len(t.shardLoss), pass); err != nil {
			return 0, err
		}
	} else {
		for s := range t.shardLoss {
			t.local.first = s == 0
			if err := pass(s); err != nil {
				return 0, err
			}
		}
		inv := 1 / float32(t.f.shards())
		for k := range t.grads {
			t.grads[k] *= inv
		}
	}
	var loss float64
	for _, l := range t.shardLoss {
		loss += l
	}
	return loss / float64(len(t.shardLoss)), nil
}

// showLoss shows the loss over the global batch (the mean of the ranks' losses),
// comparable with a --no_ddp run on the global batch; collected after the step's timing.
func (t *trainer) showLoss(ctx context.Context, step int, loss float64) error {
	if t.f.shards() > 0 {
		return t.showShardsLoss(ctx, step)
	}
	if t.pg != nil && t.f.stepsPerRank == nil { // with uneven steps, rank 0's own loss
		lb := []float64{loss}
		if err := t.pg.AllReduce(ctx, lb, procgroup.Sum).Wait(ctx); err != nil {
			return fmt.Errorf("rank %d: step %d: averaging the loss: %w", t.w.rank, step, err)
		}
		loss = lb[0] / float64(t.w.size)
	}
	t.obs.showLoss(step, loss)
	return nil
}

// showShardsLoss shows the mean of every shard's loss, summed in shard order, the same
// bits at every world size: the ranks all-gather their shards' losses.
func (t *trainer) showShardsLoss(ctx context.Context, step int) error {
	all := t.shardLoss
	if t.pg != nil {
		all = make([]float64, t.f.shards())
		if err := t.pg.AllGather(ctx, all, t.shardLoss).Wait(ctx); err != nil {
			return fmt.Errorf("rank %d: step %d: gathering the shards' losses: %w", t.w.rank, step, err)
		}
	}
	loss := all[0]
	for _, l := range all[1:] {
		loss += l
	}
	t.obs.showLoss(step, loss/float64(len(all)))
	return nil
}

// paramWait is what the graph's taps wait for before they read a parameter: the DDP's
// all-gathers with --zero_forward_overlap, nothing otherwise.
func (t *trainer) paramWait() gorgoniaddp.ParamWait {
	if t.d == nil {
		return nil
	}
	return gorgoniaddp.Wait(t.d)
}

// finish ends the run: the observer's final reports, the timed steps' figures (rank 0), a
// barrier, the peak RSS and the parameters' checksum.
func (t *trainer) finish(ctx context.Context) error {
	if err := t.obs.finish(ctx); err != nil {
		return err
	}
	if t.w.rank == 0 && t.nTimed > 0 {
		fmt.Fprintf(t.stdout, "bucket_cap_mb=%v  ms/step=%.2f\n", t.f.bucketCapMB, float64(t.timed.Microseconds())/1e3/float64(t.nTimed))
		if t.timedCPU > 0 {
			fmt.Fprintf(t.stdout, "process CPU: %.2f ms per timed step (user and system, all of this rank's threads)\n", float64(t.timedCPU.Microseconds())/1e3/float64(t.nTimed))
		}
		if t.ov.n > 0 {
			fmt.Fprintln(t.stdout, t.ov.String())
		}
	}
	if t.d != nil { // --zero_forward_overlap: the last Step's all-gathers
		if err := t.d.WaitParams(ctx); err != nil {
			return fmt.Errorf("rank %d: the last step's parameters: %w", t.w.rank, err)
		}
	}
	if t.pg != nil {
		// Leave together: no rank closes its connections while a peer may still be
		// finishing the last collective.
		if err := t.pg.Barrier(ctx).Wait(ctx); err != nil {
			return fmt.Errorf("rank %d: final barrier: %w", t.w.rank, err)
		}
	}
	if t.w.rank == 0 {
		if err := t.reportAuto(); err != nil { // after the barrier: a failed write holds up no peer
			return err
		}
	}
	if t.opt != nil {
		fmt.Fprintf(t.stdout, "rank %d optimizer_state_bytes=%d\n", t.w.rank, t.opt.State().Bytes())
	} else {
		fmt.Fprintf(t.stdout, "rank %d optimizer_state_bytes=%d\n", t.w.rank, t.d.OptimizerStateBytes())
	}
	if rss, ok := peakRSS(); ok {
		fmt.Fprintf(t.stdout, "rank %d peak_rss_mb=%.1f\n", t.w.rank, float64(rss)/(1<<20))
	}
	fmt.Fprintf(t.stdout, "params_crc32=%08x\n", paramsCRC32(t.m.Data32()))
	return nil
}

// overlap sums the reducer's per-step figures over the timed steps.
type overlap struct {
	n                                 int
	buckets                           int
	compute, comm, overlapped, exposd time.Duration
}

func (o *overlap) add(s *ddp.IterStats) {
	if s == nil {
		return
	}
	o.n++
	o.buckets = len(s.BucketBytes)
	o.compute += s.Compute()
	o.comm += s.Comm()
	o.overlapped += s.Overlap()
	o.exposd += s.Exposed()
}

// String is the mean per timed step, in milliseconds: forward and backward compute (the
// reducer's Compute: from BeginBackward, which precedes the graph's run, to Finalize, less
// the hooks' time), time with a bucket's all-reduce in flight (Comm), the part of it hidden
// behind compute (Overlap) and the part the step waited for (Exposed).
func (o *overlap) String() string {
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1e3 / float64(o.n) }
	return fmt.Sprintf("overlap: buckets=%d fwd_bwd_compute_ms=%.2f comm_ms=%.2f overlapped_ms=%.2f exposed_ms=%.2f (mean of %d steps)",
		o.buckets, ms(o.compute), ms(o.comm), ms(o.overlapped), ms(o.exposd), o.n)
}

// paramsCRC32 is the CRC-32 (IEEE) of the parameters' little-endian bytes in
// registration order.
func paramsCRC32(p []float32) uint32 {
	h := crc32.NewIEEE()
	var buf [4096]byte
	for len(p) > 0 {
		n := min(len(p), len(buf)/4)
		for i, v := range p[:n] {
			binary.LittleEndian.PutUint32(buf[4*i:], math.Float32bits(v))
		}
		h.Write(buf[:4*n])
		p = p[n:]
	}
	return h.Sum32()
}

// reportAuto prints the automatic bucket sizing's choice (rank 0, --bucket_cap_mb auto) and
// writes its measurements to --auto_profile.
func (t *trainer) reportAuto() error {
	if t.d == nil {
		return nil
	}
	plan := t.d.AutoPlan()
	if plan == nil {
		if float64(t.f.bucketCapMB) == ddp.AutoBucketCap || t.f.commHook == "auto" {
			fmt.Fprintln(t.stdout, "auto bucket layout or hook: none (it needs 3 synced steps and 2 ranks; or rank 0 could not model the step: see the log)")
		}
		return nil
	}
	fmt.Fprintln(t.stdout, plan.String())
	if t.f.autoProfile == "" {
		return nil
	}
	b, err := json.MarshalIndent(plan.Profile, "", " ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(t.f.autoProfile, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("--auto_profile: %w", err)
	}
	return nil
}
