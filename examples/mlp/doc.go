// Command mlp trains a small multilayer perceptron whose forward and backward passes are
// plain Go loops (no autodiff library), with its gradients averaged across ranks by package
// ddp: ddp.InitProcessGroup, ddp.New with the parameters as ddp.Params, GradReady for
// each gradient in the order backward produces it, Finalize, then an SGD step. Its training
// loop (train, in main.go) is meant to be copied.
//
// The model is x (4) → Linear(4, hidden) → tanh → Linear(hidden, 1), with the mean squared
// error against y = sin(2x₀) + x₁·x₂ − x₃/2, on inputs drawn uniformly from [−1, 1]⁴.
//
// --task teacher --inputs N --outputs K (default 32 and 1) is a teacher-student task
// instead: the targets are a fixed random network's, y = V·tanh(A·x + c) with 16 hidden
// units (the same teacher for every --seed), on inputs drawn from N(0, 1)^N; the student
// has K outputs (W2 is K × --hidden_size, b2 K) and the loss is half the squared error
// summed over them. Its W1 (--hidden_size × N) is wide enough for --comm_hook powersgd to
// compress it at ranks 1, 2 and 4 (at the default task's 4 inputs it is not, above rank
// 1), and so is W2 at K = 16. With one output, W1's gradient is close to rank 1 (every
// sample's is the same vector W2 scaled by tanh's slopes, times x), so rank 1 loses
// little; with 16 it is not. scripts/convergence.sh runs it to a target loss:
//
//	ddprun --nproc_per_node 2 ./examples/mlp -- --task teacher --inputs 32 --outputs 16 --lr 0.05 --comm_hook powersgd --powersgd_rank 2
//
// # Usage
//
//	ddprun --nproc_per_node 2 ./examples/mlp                        # 2 ranks, batch 16 each
//	ddprun --nproc_per_node 2 ./examples/mlp -- --accum_steps 4     # 3 of 4 micro-batches under NoSync
//	go run ./examples/mlp --no_ddp --batch_size 32                  # one process, the same global batch
//	ddprun --nproc_per_node 3 ./examples/mlp -- --global_batch_size 24 --micro_batch_size 4
//	                                      # 6 shards: the same params_crc32 on 1, 2, 3 or 6 ranks
//
// Without --no_ddp each process is one rank of the group its launcher describes (ddprun,
// torchrun-style variables, srun, mpirun; see ddp.InitProcessGroup), on --backend (gloo).
//
// Data depend only on (--seed, the sample's index in the run): micro-batch m of step s on
// rank r of a world of W holds the --batch_size samples from (s·accum·W + m·W + r)·batch on,
// so W ranks with --batch_size B and --accum_steps K see the data of one --no_ddp process
// with --batch_size B·K·W, and end with the same parameters up to float32 rounding (the
// tests check 2 ranks against one process to 1e-6).
//
// With --global_batch_size B --micro_batch_size m (instead of --batch_size and
// --accum_steps) the step's batch is L = B/m logical shards (ddp.Options.Shards): shard s
// of step t holds the m samples from (t·L + s)·m on, whichever rank runs it, and the ranks'
// gradients are summed in shard order, so every world size that divides L ends with the
// same bits, and so does --no_ddp, which runs the L shards and sums them the same way
// itself. A world size that does not divide L is refused at start, naming the sizes that
// work.
//
// --checkpoint_dir DIR makes rank 0 write the parameters and the data position (the run's
// next sample) every --checkpoint_every steps and after the last, with package
// ddp/checkpoint; a launcher's restart (ddprun or torchrun --max_restarts), or --resume,
// continues from the newest readable one. With --global_batch_size the checkpoint holds no
// world size, so a run checkpointed by 3 ranks resumes on 2, on 1 or with --no_ddp and
// ends with the uninterrupted run's bits; with --batch_size it resumes at its own world
// size only.
//
// --inject_nan RANK:STEP:PARAM puts a NaN into rank RANK's gradient of parameter PARAM (an
// index, or a name: w1, b1, w2, b2) at step STEP (from 0), to see ddp name it: Finalize
// returns the same *ddp.NonFiniteError on every rank, each rank prints it, and the job
// exits 1 before the optimizer steps on it:
//
//	ddprun --nproc_per_node 2 ./examples/mlp -- --inject_nan 1:5:w2
//	[rank0]: mlp: reducer: step 5: non-finite local gradient: rank 1: parameter 2 (w2)
//	[rank1]: mlp: reducer: step 5: non-finite local gradient: rank 1: parameter 2 (w2)
//
// --steps_per_rank A,B,… (instead of --steps) gives the ranks uneven data: rank r runs
// the r-th count of steps, then calls ddp's Join (ddp.Options.UnevenInputs), shadowing
// the others' steps with zero gradients until every rank is done; every rank then ends
// with the same parameters, those of a rank that ran every step. Rank 0 then prints its
// own batch's loss, since a joined rank cannot take part in the loss's all-reduce:
//
//	ddprun --nproc_per_node 3 ./examples/mlp -- --steps_per_rank 0,3,5
//
// --optimizer momentum or adamw (package ddp/optim; default sgd, the plain loop) with
// --zero 1 or 2 shards the optimizer over the ranks (ddp.Options.Zero, ddp.DDP.Step): each
// rank keeps about 1/n of AdamW's moments, and every rank prints optimizer_state_bytes.
// --zero 1 ends with the params_crc32 of --zero 0, and so does --zero 2 on 2 ranks (on
// more, within float32 rounding); a checkpoint holds the whole state, so a --zero 2 run
// resumes at --zero 0 or 1:
//
//	ddprun --nproc_per_node 4 ./examples/mlp -- --optimizer adamw --lr 0.01 --zero 2
//
// Under an elastic ddprun (--nnodes MIN:MAX; package ddp/elastic) nodes may leave and join
// while it trains: the survivors go on from the last step they all committed, with the
// state from memory, and the run ends with the bits of the uninterrupted one. It needs
// --global_batch_size and --micro_batch_size; --step_time paces the loop to watch it (run
// the same command on each node, the token shared):
//
//	GODDP_TOKEN=$(cat job.token) ddprun --nnodes 2:3 --rdzv_endpoint node0:29500 ./examples/mlp -- \
//		--global_batch_size 24 --micro_batch_size 4 --steps 400 --step_time 50ms
//
// Each change prints one line among the steps, e.g. "elastic: epoch 1: rank 1 saw: … peer
// rank 2 … lost …; left: node …; joined: none; world size 3 -> 2; resuming from step 24;
// pause 1.03s (this process: rank 0)".
//
// Output: rank 0 prints the loss of the global batch every --log_every steps; every rank
// ends with "params_crc32=<8 hex>", the CRC-32 (IEEE) of its final parameters'
// little-endian float32 bytes in registration order, the same on every rank.
// --save_params FILE (checked, and its folder created, before training) makes rank 0 write
// those bytes to FILE. Errors go to stderr (a bad flag: exit 2; anything else: exit 1).
package main
