// Command transformer trains a gorgonia Transformer encoder, the model of the seed's
// ddp_bench.py layer for layer: Linear(h,h) → num_layers post-norm encoder layers
// (8 heads, feed-forward 4h, ReLU, dropout 0.1) → Linear(h,h), MSE against a random
// target, AdamW (lr 1e-4); 1,711,104 parameters at the defaults, as in PyTorch.
// --task copy embeds random tokens and predicts them back with cross-entropy.
//
// # Usage
//
//	make run                                                      # 2 ranks under ddprun
//	ddprun --nproc_per_node 2 ./examples/transformer -- --bucket_cap_mb 25
//	GODDP_GO_TAGS=openblas ddprun --nproc_per_node 2 ./examples/transformer -- --accum_steps 4
//	go run ./examples/transformer --no_ddp                        # one process, Go-assembly SGEMM
//	go run -tags openblas ./examples/transformer --no_ddp         # OpenBLAS (libopenblas-dev)
//	go run ./examples/transformer --no_ddp --task copy --lr 1e-3 --bench_steps 100
//
// Without --no_ddp each process is one rank of the group its launcher describes (ddprun,
// torchrun-style RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, srun, mpirun; see
// ddp.InitProcessGroup), on --backend (gloo). ddp.New copies rank 0's parameters to every
// rank; during backward each parameter's gradient goes into its bucket as soon as it is
// computed and full buckets are all-reduced while backward goes on (--bucket_cap_mb,
// --first_bucket_cap_mb); the optimizer steps on the averaged gradients. With
// --accum_steps K the first K−1 micro-batches run under NoSync.
//
// Output: rank 0 prints "Model: <N> MB | bucket_cap_mb=<X>" first, the loss every
// --log_every steps (with ddp: the mean over the ranks, i.e. the global batch's loss), the
// overlap and straggler reports (below), "bucket_cap_mb=<X>  ms/step=<Y>" (timed steps
// only, after --warmup_steps), its own CPU time over those steps ("process CPU: <C> ms
// per timed step", where the system reports it) and, with ddp, the reducer's mean
// per-step figures ("overlap: buckets=… fwd_bwd_compute_ms=… comm_ms=… overlapped_ms=…
// exposed_ms=…"). Every rank then prints its peak RSS ("rank <r>
// peak_rss_mb=<M>", getrusage's maxrss) and last "params_crc32=<8 hex>": CRC-32 (IEEE) of
// the final parameters' little-endian float32 bytes in registration order, the same on
// every rank. Errors (a bad flag: exit 2; anything else, such as a lost peer: exit 1) go
// to stderr, as do the ddp and process-group log lines (--log_level).
//
// Data and dropout masks depend only on (--seed, global sample index, step): micro-batch
// m of rank r holds samples (m·world + r)·batch …, so 2 ranks with --batch_size B, or
// --accum_steps 2, see exactly the data of one process with batch 2B.
//
// # The same bits at every world size
//
// --global_batch_size B --micro_batch_size m (instead of --batch_size and --accum_steps)
// fix the global batch: each step is L = B/m logical shards (ddp.Options.Shards), shard s
// holding the step's global samples s·m … (s+1)·m−1 and their dropout masks whatever rank
// runs it, and ddp sums the shards' gradients in shard order, so any world size that
// divides L ends with the same params_crc32 and prints the same losses (another is refused
// at start, with the sizes that work). --no_ddp runs all L shards in one process and sums
// them the same way. The parameters come from --seed alone. A checkpoint then resumes at
// any of those world sizes:
//
//	ddprun --nproc_per_node 3 ./examples/transformer -- --global_batch_size 48 --micro_batch_size 8
//	go run ./examples/transformer --no_ddp --global_batch_size 48 --micro_batch_size 8
//
// With those flags it is also elastic under ddprun --nnodes MIN:MAX (package ddp/elastic):
// a node may leave or join mid-run, the survivors go on with the parameters and AdamW's
// state from memory, and the run ends with the bits of the uninterrupted one.
//
// # Uneven data per rank
//
// --steps_per_rank 3,5 (instead of --bench_steps) gives rank r its own count of steps, as
// when the ranks' data run out at different points: a rank whose steps are done calls
// ddp's Join (ddp.Options.UnevenInputs), which shadows the others' all-reduces with zero
// gradients until every rank is done, and every rank then ends with the parameters of the
// rank that ran the most steps. The average divides by the world size (Note [Join] in
// package ddp). --no_ddp --steps_per_rank 3,5 runs the same batches in one process, each
// step the micro-batches of the ranks that still have data; at 2 ranks, or with two ranks
// that have data, the params_crc32 is the same. Without Join the ranks that stop early
// leave their peers in a collective until --timeout. It takes neither --checkpoint_dir,
// --zero, --global_batch_size, --bucket_cap_mb auto nor --inject_nan; the straggler report
// (a collective every --report_every steps) is off, and rank 0 prints its own loss.
//
//	ddprun --nproc_per_node 2 ./examples/transformer -- --steps_per_rank 3,5 --warmup_steps 0
//
// # Non-finite gradients
//
// A NaN or an infinity in any rank's gradient makes every rank's Finalize return the same
// *ddp.NonFiniteError, naming the step, the ranks and the parameters whose own gradient
// was not finite: every rank prints it and the job exits 1 before the optimizer steps on
// it (--no_finite_check turns the check off). --inject_nan RANK:STEP:PARAM puts a NaN into
// rank RANK's gradient of parameter PARAM (an index or a name) in step STEP, to see it:
//
//	ddprun --nproc_per_node 2 ./examples/transformer -- --inject_nan 1:5:6
//	[rank0]: transformer: reducer: step 5: non-finite local gradient: rank 1: parameter 6 (1.layers.0.linear1.weight)
//	[rank1]: transformer: reducer: step 5: non-finite local gradient: rank 1: parameter 6 (1.layers.0.linear1.weight)
//
// # Checkpoints and restarts
//
// --zero 1 or 2 hands AdamW to ddp (ddp.Options.Zero, package ddp/optim's AdamW, the same
// arithmetic): each rank keeps the moments of about half (1/n) of the parameters, and at
// 2 the buckets are reduce-scattered; every rank prints its optimizer_state_bytes. It ends
// with --zero 0's params_crc32 at 1, and at 2 on two ranks. With --checkpoint_dir the
// ranks all-gather the shards' state before each save (ddp.DDP.GatherOptimizerState), so
// the file holds AdamW's whole state as --zero 0 writes it, and a restore hands each rank
// its shard (SetOptimizerState): a checkpoint resumes at any --zero. Each rank then also
// holds that whole state, twice the model's size, beside its shard (not counted in
// optimizer_state_bytes).
// --zero_overlap (ddp.Options.ZeroOverlap) steps each bucket's shard and issues its
// all-gather as soon as the bucket's reduction completes, during backward, with the same
// params_crc32; it takes no --inject_nan, since the step comes before the check.
//
// With --checkpoint_dir rank 0 saves the parameters, AdamW's state and the step (with the
// seed, the data and dropout position) every --checkpoint_every steps and after the last
// one, to step<S>.ckpt, with package ddp/checkpoint: atomically (temporary file, fsync,
// rename, directory fsync), keeping the two newest files; every rank also writes
// rank<R>.pid there. With --resume, or by itself when ddprun or torchrun --max_restarts
// restarts the group (TORCHELASTIC_RESTART_COUNT > 0), every rank continues from the
// newest checkpoint any rank can read (a corrupt newest file falls back to the one before;
// none at all, or an empty or missing directory, is a fresh start; a rank whose directory
// lacks it gets the state from one that has it). Data and reductions are deterministic, so
// a run whose ranks are killed and restarted ends with the same params_crc32 as an
// uninterrupted one (scripts/kill_test.sh). Without --global_batch_size this trainer's
// data depend on the world size times --accum_steps, so a checkpoint resumes where that
// product is its own (2 ranks resume 1 rank's file with --accum_steps 2); with it, at any
// world size that divides the shards: see Note [Checkpoints] in checkpoint.go.
//
// # gorgonia and the matrix products
//
// The model is built in gorgonia (v0.9.18). Its matrix products run on goddp's own SGEMM
// (package fastblas/sgemm, through package fastblas): avo-generated AVX-512 and AVX2
// kernels that read A in place and pack B Goto/BLIS-style, the packing in assembly too,
// since in Go it costs more than attention's small per-head products. It needs no cgo and
// is far faster than gorgonia's pure-Go BLAS: see
// docs/results/2026-12-02-compute-against-pytorch.md.
// With -tags openblas the products run on OpenBLAS, whose Debian build picks slow kernels
// on CPUs it does not know, so ddprun sets OPENBLAS_CORETYPE.
//
// gorgonia has no per-gradient callback: package ddp/gorgoniaddp's taps report the
// gradients (Note [Tap placement] and Note [Tap outputs] there). gorgonia's faults that a
// trainer must know: its initialisers seed from the clock (rank 0's broadcast is needed),
// its VM must be reset before every run, InverseSqrt's gradient is wrong, Dropout reuses a
// stale mask, and it starts under Go 1.26 only with go4.org/unsafe/assume-no-moving-gc at
// a 2023 version.
//
// # Seeing where the time goes
//
//	--trace FILE          each rank's timeline, Chrome trace JSON ("{rank}" expands, else
//	                      FILE gets .rank<R>); ddprun --trace_merge OUT sets it and merges;
//	                      go run ./cmd/trace-plot -in OUT -iter 5 -out step5.png draws a step
//	--metrics_addr H:P    Prometheus metrics at http://H:P+LOCAL_RANK/metrics
//	--report_every N      rank 0 prints the DDP overlap report ("ddp: N passes: …") every N
//	                      steps and at the end, then the straggler report ("ddp stragglers:
//	                      …", every rank's arrival at every bucket's all-reduce, exchanged
//	                      every N steps)
//	--straggle_ms R:MS    rank R sleeps MS ms per step before backward (a straggler on purpose)
//
// On a terminal rank 0's loss lines become one progress line redrawn in place (step, loss,
// ms/step, ETA); otherwise (a pipe, ddprun) they stay "step N loss L", followed from the
// second on by the ms/step since the previous line and the ETA. With the flags off the
// tracer and the metrics are nil and cost nothing; the overlap and straggler reports cost a
// few additions per step and one all-gather every --report_every steps.
// scripts/trace_demo.sh shows all of it.
package main
