package main

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	_ "github.com/goddp/goddp/backends/gloo" // the "gloo" backend (--backend gloo)
	"github.com/goddp/goddp/ddp"
	"github.com/goddp/goddp/ddp/elastic"
	"github.com/goddp/goddp/internal/hookshards"
	"github.com/goddp/goddp/internal/outpath"
	"github.com/goddp/goddp/procgroup"
)

type flags struct {
	hidden     int
	batch      int // samples per rank per micro-batch
	accum      int
	steps      int
	lr         float64
	seed       uint64
	logEvery   int
	bucketMB   float64
	firstMB    float64
	backend    string
	noDDP      bool
	saveParams string
	global     int // --global_batch_size: samples per step over all ranks (with --micro_batch_size)
	micro      int // --micro_batch_size: samples per logical shard

	checkpointDir string // --checkpoint_dir (empty: none)
	ckptEvery     int
	resume        bool
	inject        injection
	stderr        io.Writer // where a rank says a non-finite gradient before it leaves (see train)
	commHook      string
	psgd          ddp.PowerSGDOptions // --powersgd_rank, --powersgd_start_iter, --powersgd_min_compression_rate
	stepsPerRank  []int               // --steps_per_rank: rank r runs stepsPerRank[r] steps, then ddp's Join (nil: --steps each)
	stepTime      time.Duration       // --step_time: the least time a step takes (0: none)
	optimizer     string              // --optimizer: sgd, momentum or adamw
	momentum      float64
	zero          int  // --zero: ddp.Options.Zero
	task          task // --task and --inputs (task.go)
}

// injection is --inject_nan RANK:STEP:PARAM: rank RANK's gradient of parameter PARAM (an
// index or a name) holds a NaN in step STEP. on is false without the flag.
type injection struct {
	on                bool
	rank, step, param int
}

func (in *injection) String() string {
	if !in.on {
		return ""
	}
	return fmt.Sprintf("%d:%d:%d", in.rank, in.step, in.param)
}

func (in *injection) Set(s string) error {
	bad := fmt.Errorf("want RANK:STEP:PARAM, PARAM an index in [0, %d) or a name (%s), e.g. 1:5:2 or 1:5:w2", nParams, strings.Join(paramNames[:], ", "))
	parts := strings.Split(s, ":")
	if len(parts) != 3 {
		return bad
	}
	rank, err1 := strconv.Atoi(parts[0])
	step, err2 := strconv.Atoi(parts[1])
	if err1 != nil || err2 != nil || rank < 0 || step < 0 {
		return bad
	}
	param, err := strconv.Atoi(parts[2])
	if err != nil {
		param = slices.Index(paramNames[:], parts[2])
	}
	if param < 0 || param >= nParams {
		return bad
	}
	*in = injection{on: true, rank: rank, step: step, param: param}
	return nil
}

// poison puts a NaN into the middle of g, the gradient of parameter i that this rank
// reports in step, if --inject_nan asks for it.
func (in injection) poison(rank, step, i int, g []float32) {
	if in.on && in.rank == rank && in.step == step && in.param == i {
		g[len(g)/2] = float32(math.NaN())
	}
}

// shards is the number of logical shards of a step's batch, L = global/micro; 0 without
// --global_batch_size.
func (f flags) shards() int {
	if f.micro == 0 {
		return 0
	}
	return f.global / f.micro
}

func parseFlags(args []string, stderr io.Writer) (flags, error) {
	var f flags
	fs := flag.NewFlagSet("mlp", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&f.hidden, "hidden_size", 64, "hidden units")
	fs.IntVar(&f.batch, "batch_size", 16, "samples per rank per micro-batch")
	fs.IntVar(&f.accum, "accum_steps", 1, "micro-batches per optimizer step (all but the last under NoSync)")
	fs.IntVar(&f.steps, "steps", 500, "optimizer steps")
	fs.Float64Var(&f.lr, "lr", 0.3, "learning rate")
	fs.StringVar(&f.optimizer, "optimizer", "sgd", "sgd, momentum (SGD with --momentum) or adamw (package ddp/optim)")
	fs.Float64Var(&f.momentum, "momentum", 0.9, "with --optimizer momentum: the momentum")
	fs.IntVar(&f.zero, "zero", 0, "ZeRO stage (ddp.Options.Zero): 0 plain DDP, 1 optimizer state sharded, 2 gradients reduce-scattered too")
	fs.Uint64Var(&f.seed, "seed", 1, "seed of the parameters and the data")
	fs.IntVar(&f.logEvery, "log_every", 100, "rank 0 prints the loss every N steps (0: never)")
	fs.Float64Var(&f.bucketMB, "bucket_cap_mb", 25, "DDP bucket size cap in MiB")
	fs.Float64Var(&f.firstMB, "first_bucket_cap_mb", 1, "cap of the first bucket in MiB")
	fs.StringVar(&f.backend, "backend", "gloo", "process group backend")
	fs.BoolVar(&f.noDDP, "no_ddp", false, "one process, no process group, the same --batch_size")
	fs.StringVar(&f.saveParams, "save_params", "", "rank 0 writes the final parameters (little-endian float32) to this file")
	fs.IntVar(&f.global, "global_batch_size", 0, "samples per step over all ranks, cut into global/micro logical shards whose sum is the same bits at every world size (with --micro_batch_size; instead of --batch_size and --accum_steps)")
	fs.IntVar(&f.micro, "micro_batch_size", 0, "samples per logical shard (with --global_batch_size)")
	fs.StringVar(&f.checkpointDir, "checkpoint_dir", "", "rank 0 checkpoints here; every rank resumes from here on a launcher's restart or with --resume (empty: none)")
	fs.IntVar(&f.ckptEvery, "checkpoint_every", 10, "checkpoint every N steps (and after the last)")
	fs.BoolVar(&f.resume, "resume", false, "resume from the newest checkpoint in --checkpoint_dir, if there is one")
	fs.Var(&f.inject, "inject_nan", "RANK:STEP:PARAM: put a NaN into rank RANK's gradient of parameter PARAM (index or name: w1, b1, w2, b2) in step STEP (from 0), to see ddp name it")
	f.stderr = stderr
	fs.StringVar(&f.commHook, "comm_hook", "none", "DDP communication hook: "+ddp.CommHookNames)
	fs.IntVar(&f.psgd.Rank, "powersgd_rank", 0, "with --comm_hook powersgd: the rank of each matrix's approximation (PyTorch's matrix_approximation_rank; 0: 1); with auto: the only rank it may choose (0: 2 or 4)")
	fs.IntVar(&f.psgd.StartIter, "powersgd_start_iter", 0, "with --comm_hook powersgd: steps all-reduced uncompressed first (PyTorch's start_powerSGD_iter)")
	fs.Float64Var(&f.psgd.MinCompressionRate, "powersgd_min_compression_rate", 2, "with --comm_hook powersgd: a matrix is compressed only if that saves this factor (PyTorch's min_compression_rate)")
	fs.DurationVar(&f.stepTime, "step_time", 0, "each step takes at least this long (a paced loop, to watch or test a job whose nodes leave and join; 0: as fast as it goes)")
	taskName := fs.String("task", taskSine, "sine (y = sin(2x₀) + x₁·x₂ − x₃/2, 4 inputs) or teacher (a fixed random tanh network of --inputs inputs and 16 hidden units)")
	inputs := fs.Int("inputs", 0, "with --task teacher: the input width, W1 is --hidden_size × --inputs (0: 32)")
	outputs := fs.Int("outputs", 1, "with --task teacher: the output width, W2 is --outputs × --hidden_size (a matrix above 1)")
	perRank := fs.String("steps_per_rank", "", "comma-separated steps of each rank (uneven data, e.g. 0,3,5): a rank whose steps are done joins (ddp.Options.UnevenInputs) until every rank's are; instead of --steps")
	if err := fs.Parse(args); err != nil {
		return f, err
	}
	if _, err := ddp.CommHookNamed(f.commHook, f.psgd); err != nil {
		return f, fmt.Errorf("--comm_hook: %w", err)
	}
	var err error
	if f.task, err = newTask(*taskName, *inputs, *outputs); err != nil {
		return f, err
	}
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	if set["global_batch_size"] || set["micro_batch_size"] {
		switch {
		case f.global <= 0 || f.micro <= 0 || f.global%f.micro != 0:
			return f, fmt.Errorf("--global_batch_size %d, --micro_batch_size %d: want both positive, the global batch a multiple of the micro-batch", f.global, f.micro)
		case set["batch_size"] || set["accum_steps"]:
			return f, fmt.Errorf("--global_batch_size and --micro_batch_size fix the batch: drop --batch_size and --accum_steps")
		}
	}
	fac, err := optimizerFactory(f)
	if err != nil {
		return f, err
	}
	if f.optimizer != "sgd" || f.zero != 0 { // the plain loop's --lr is as it always was
		if _, err := fac(0); err != nil {
			return f, fmt.Errorf("--optimizer %s: %w", f.optimizer, err)
		}
	}
	if f.zero != 0 && (f.zero < 0 || f.zero > 2 || f.noDDP || f.shards() > 0 || set["steps_per_rank"]) {
		return f, fmt.Errorf("--zero %d: want 0, 1 or 2, without --no_ddp, --global_batch_size or --steps_per_rank", f.zero)
	}
	if set["steps_per_rank"] {
		for _, p := range strings.Split(*perRank, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(p))
			if err != nil || n < 0 {
				return f, fmt.Errorf("--steps_per_rank %q: want comma-separated step counts, not negative, one per rank (e.g. 0,3,5)", *perRank)
			}
			f.stepsPerRank = append(f.stepsPerRank, n)
		}
		switch {
		case set["steps"]:
			return f, fmt.Errorf("--steps_per_rank gives each rank its steps: drop --steps")
		case f.noDDP || f.shards() > 0 || f.checkpointDir != "":
			return f, fmt.Errorf("--steps_per_rank takes neither --no_ddp, --global_batch_size nor --checkpoint_dir")
		}
	}
	switch {
	case fs.NArg() > 0:
		return f, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	case f.hidden <= 0 || f.batch <= 0 || f.accum <= 0 || f.steps < 0 || f.logEvery < 0:
		return f, fmt.Errorf("--hidden_size %d, --batch_size %d, --accum_steps %d must be positive; --steps %d, --log_every %d not negative",
			f.hidden, f.batch, f.accum, f.steps, f.logEvery)
	case !(f.bucketMB > 0) || !(f.firstMB > 0):
		return f, fmt.Errorf("--bucket_cap_mb %v, --first_bucket_cap_mb %v must be positive", f.bucketMB, f.firstMB)
	case f.ckptEvery <= 0 || (f.resume && f.checkpointDir == ""):
		return f, fmt.Errorf("--checkpoint_every %d must be positive; --resume needs --checkpoint_dir", f.ckptEvery)
	}
	return f, nil
}

func main() {
	f, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "mlp:", err)
		os.Exit(2)
	}
	if err := run(context.Background(), f, os.Stdout); err != nil {
		if !errors.As(err, new(saidError)) {
			fmt.Fprintln(os.Stderr, "mlp:", err)
		}
		os.Exit(1)
	}
}

// run checks the output file, joins the launcher's group (without --no_ddp) and trains.
func run(ctx context.Context, f flags, stdout io.Writer) error {
	if err := outpath.File("--save_params", f.saveParams); err != nil { // before training, not after it
		return err
	}
	if err := outpath.Dir("--checkpoint_dir", f.checkpointDir); err != nil {
		return err
	}
	if elastic.Enabled(nil) {
		return runElastic(ctx, f, stdout) // elastic.go
	}
	var pg procgroup.ProcessGroup
	if !f.noDDP {
		g, err := ddp.InitProcessGroup(ctx, f.backend, ddp.InitOptions{})
		if err != nil {
			return err
		}
		defer g.Close()
		pg = g
	}
	m, err := train(ctx, f, pg, stdout)
	if err != nil {
		return err
	}
	return report(f, m, pg == nil || pg.Rank() == 0, stdout)
}

// report writes the final parameters (--save_params, by rank 0) and prints their CRC.
func report(f flags, m *mlp, rank0 bool, stdout io.Writer) error {
	if f.saveParams != "" && rank0 {
		if err := os.WriteFile(f.saveParams, paramBytes(m.flat()), 0o644); err != nil {
			return fmt.Errorf("--save_params: %w", err)
		}
	}
	fmt.Fprintf(stdout, "params_crc32=%08x\n", crc32.ChecksumIEEE(paramBytes(m.flat())))
	return nil
}

// sleepCtx sleeps for d (nothing if d <= 0), or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// train is the training loop: with pg, one rank of data-parallel training; with a nil pg,
// one process on its own.
func train(ctx context.Context, f flags, pg procgroup.ProcessGroup, stdout io.Writer) (*mlp, error) {
	m := newMLP(f.hidden, f.task.in, f.task.out, f.seed)
	rank, world := 0, 1
	var d *ddp.DDP
	var opts ddp.Options
	opt, err := newStepper(f, m, &opts)
	if err != nil {
		return nil, err
	}
	if pg != nil {
		rank, world = pg.Rank(), pg.Size()
		params := make([]ddp.Param, nParams)
		for i := range params {
			params[i] = ddp.Param{Name: m.names[i], Data: m.params[i], Grad: m.grads[i]}
		}
		params[w1].Shape = []int{f.hidden, m.in} // a matrix, for --comm_hook powersgd
		if m.out > 1 {
			params[w2].Shape = m.shapes()[w2] // with --outputs, one too
		}
		f.psgd.Seed = f.seed
		hook, err := ddp.CommHookNamed(f.commHook, f.psgd)
		if err != nil {
			return nil, err
		}
		// New checks the ranks' models and hooks agree and copies rank 0's parameters.
		opts.BucketCapMB, opts.FirstBucketCapMB, opts.Shards, opts.CommHook = f.bucketMB, f.firstMB, hookshards.Options(f.commHook, f.shards()), hook
		opts.UnevenInputs = f.stepsPerRank != nil
		if f.stepsPerRank != nil {
			if len(f.stepsPerRank) != world {
				return nil, fmt.Errorf("--steps_per_rank %v: %d counts for a world of %d ranks", f.stepsPerRank, len(f.stepsPerRank), world)
			}
			f.steps = f.stepsPerRank[rank]
		}
		if d, err = ddp.New(ctx, pg, params, opts); err != nil {
			if f.shards() > 0 {
				return nil, fmt.Errorf("--global_batch_size %d / --micro_batch_size %d: %w", f.global, f.micro, err)
			}
			return nil, err
		}
		defer d.Close()
		opt.d = d
	}
	var next int64 // the data position: the run's next sample, over the global batch
	k, start, err := restoreCkpt(ctx, f, pg, m, opt, &next, stdout)
	if err != nil {
		return nil, err
	}
	if f.shards() > 0 {
		return m, trainShards(ctx, f, pg, d, m, start, &next, stdout, func(step int) error { return k.after(ctx, rank, step) })
	}
	step := start
	ready := func(i int) { // backward reports parameter i's micro-batch gradient
		f.inject.poison(rank, step, i, m.micro[i])
		if d != nil {
			d.GradReady(i, m.micro[i]) // copied at once; an error comes back from Finalize
			return
		}
		for k, g := range m.micro[i] { // alone, the trainer sums the micro-batches itself
			m.grads[i][k] += g
		}
	}
	xs, ys := make([]float32, f.batch*m.in), make([]float32, f.batch*m.out)
	for ; step < f.steps; step++ {
		paced := time.Now()
		if d == nil {
			for _, g := range m.grads {
				clear(g)
			}
		}
		var loss float32
		for micro := range f.accum {
			if d != nil {
				mode := ddp.Accumulate // NoSync for all but the last
				if micro == f.accum-1 {
					mode = ddp.Sync
				}
				d.BeginBackward(mode)
			}
			first := int(next) + (micro*world+rank)*f.batch
			f.task.samples(f.seed, first, f.batch, xs, ys)
			// The DDP sums the micro-batches' gradients: scaling by 1/accum is ours.
			loss += m.forwardBackward(xs, ys, 1/float32(f.accum), ready)
		}
		if d != nil {
			if err := d.Finalize(ctx); err != nil { // m.grads: averaged over the ranks
				return nil, leave(ctx, f, pg, err)
			}
		}
		if err := opt.step(ctx, m, float32(f.lr)); err != nil {
			return nil, err
		}
		next += int64(f.accum * world * f.batch)

		if f.logEvery > 0 && (step%f.logEvery == 0 || step == f.steps-1) {
			l := []float32{loss}
			if pg != nil && f.stepsPerRank == nil { // every rank takes part: the global batch's loss
				if err := pg.AllReduce(ctx, l, procgroup.Avg).Wait(ctx); err != nil {
					return nil, err
				}
			}
			if rank == 0 {
				fmt.Fprintf(stdout, "step %d loss %.6f\n", step, l[0])
			}
		}
		if err := k.after(ctx, rank, step); err != nil {
			return nil, err
		}
		if err := sleepCtx(ctx, f.stepTime-time.Since(paced)); err != nil {
			return nil, err
		}
	}
	if d != nil && rank == 0 {
		if plan := d.AutoPlan(); plan != nil { // --comm_hook auto: what it chose
			fmt.Fprintln(stdout, plan.String())
		}
	}
	if f.zero > 0 || f.optimizer != "sgd" { // every rank: its share of the state
		fmt.Fprintf(stdout, "optimizer_state_bytes=%d\n", opt.stateBytes())
	}
	if f.stepsPerRank != nil { // this rank's data is done: shadow the others' steps
		if err := d.Join(ctx); err != nil { // then every rank holds the same parameters
			return nil, err
		}
	}
	if pg != nil { // leave together: no rank closes while a peer may still be finishing
		if err := pg.Barrier(ctx).Wait(ctx); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// trainShards is train's loop with --global_batch_size from step start: the step's batch
// is L logical shards of --micro_batch_size samples, shard s of step t holding the samples
// from *next + s·micro (the data position, t·L·micro) on whatever rank runs it, and ddp
// sums the shards' gradients in shard order (ddp.Options.Shards). With a nil d, one
// process runs every shard and sums them the same way itself: the first shard's gradient,
// plus each next one in order, times 1/L.
//
// after runs after each step (a checkpoint, an elastic commit).
func trainShards(ctx context.Context, f flags, pg procgroup.ProcessGroup, d *ddp.DDP, m *mlp, start int, next *int64, stdout io.Writer, after func(step int) error) error {
	L := f.shards()
	lo, hi := 0, L
	scale := float32(1) // of a shard's gradient: n/L with a comm hook (hookshards)
	if d != nil {
		var err error
		if lo, hi, err = hookshards.Local(d, L); err != nil {
			return err
		}
		scale = float32(hookshards.Scale(d, lo, hi))
	}
	losses, all := make([]float32, hi-lo), make([]float32, L) // per shard: its mean loss
	xs, ys := make([]float32, f.micro*m.in), make([]float32, f.micro*m.out)
	first := false // alone: the step's first shard is copied, the next ones added
	rank, step := 0, start
	if pg != nil {
		rank = pg.Rank()
	}
	ready := func(i int) {
		f.inject.poison(rank, step, i, m.micro[i])
		switch {
		case d != nil:
			d.GradReady(i, m.micro[i]) // an error comes back from Finalize
		case first:
			copy(m.grads[i], m.micro[i])
		default:
			for k, g := range m.micro[i] {
				m.grads[i][k] += g
			}
		}
	}
	shard := func(s int) error {
		f.task.samples(f.seed, int(*next)+s*f.micro, f.micro, xs, ys)
		losses[s-lo] = m.forwardBackward(xs, ys, scale, ready) / scale // the shard's own mean
		return nil
	}
	inv := 1 / float32(L)
	for ; step < f.steps; step++ {
		paced := time.Now()
		if d != nil {
			if err := hookshards.Backward(ctx, d, lo, hi, shard); err != nil { // m.grads: the mean over the shards
				return leave(ctx, f, pg, err)
			}
		} else {
			for s := range L {
				first = s == 0
				_ = shard(s)
			}
			for _, g := range m.grads {
				for k := range g {
					g[k] *= inv
				}
			}
		}
		m.sgd(float32(f.lr))
		*next += int64(L * f.micro)

		if f.logEvery > 0 && (step%f.logEvery == 0 || step == f.steps-1) {
			copy(all, losses)
			if pg != nil { // every rank takes part: the shards' losses, summed in shard order
				if err := pg.AllGather(ctx, all, losses).Wait(ctx); err != nil {
					return err
				}
			}
			l := all[0]
			for _, v := range all[1:] {
				l += v
			}
			if rank == 0 {
				fmt.Fprintf(stdout, "step %d loss %.6f\n", step, l*inv)
			}
		}
		if err := after(step); err != nil {
			return err
		}
		if err := sleepCtx(ctx, f.stepTime-time.Since(paced)); err != nil {
			return err
		}
	}
	if pg != nil { // leave together, as train does
		return pg.Barrier(ctx).Wait(ctx)
	}
	return nil
}

// saidError is an error the rank has printed already (see leave).
type saidError struct{ error }

func (e saidError) Unwrap() error { return e.error }

// leave is train's error for err, Finalize's. A non-finite gradient (a *ddp.NonFiniteError)
// is the same error on every rank, with the group intact, and the optimizer has not
// stepped on it: each rank prints it, then the ranks leave together (a barrier), so that
// none exits, and makes the launcher stop the others, before every rank has said it.
func leave(ctx context.Context, f flags, pg procgroup.ProcessGroup, err error) error {
	if !errors.Is(err, ddp.ErrNonFinite) {
		return err
	}
	fmt.Fprintln(f.stderr, "mlp:", err)
	if berr := pg.Barrier(ctx).Wait(ctx); berr != nil {
		return fmt.Errorf("the barrier to leave together after it: %w", berr)
	}
	return saidError{err}
}

// paramBytes is p's little-endian float32 bytes.
func paramBytes(p []float32) []byte {
	b := make([]byte, 4*len(p))
	for i, v := range p {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
	}
	return b
}
