#!/usr/bin/env bash
# The gradient-compression convergence study: each task, seed and comm hook trained once
# under the real `ddprun --nproc_per_node 2` on gloo, rank 0's loss logged every step, then
# cmd/convergence-report's steps to a fixed target loss per run, the median over seeds and
# its ratio to hook none, as CSV and a markdown table, with the loss curves plotted per
# task. With TORCH=1 (the default where /usr/bin/python3 imports torch) the same runs of
# scripts/torch_convergence.py (PyTorch DDP, gloo, 2 processes) go into the same folder,
# one run at a time after goddp's, and into the same tables and plots.
#
#   scripts/convergence.sh                               # both tasks, 3 seeds, every hook
#   SEEDS=1 TASKS=teacher TORCH=0 scripts/convergence.sh # a quick look
#   HOOKS="none powersgd-r4-start50" scripts/convergence.sh
#
# The tasks (the same shapes, optimizer and lr in both systems):
#   copy     examples/transformer --task copy: 2 layers, h 128, seq 32, batch 8 per rank,
#            no dropout, AdamW lr 1e-3; COPY_STEPS steps; target COPY_TARGET
#   teacher  examples/mlp --task teacher --inputs 32 --outputs 16: hidden 64, batch 32 per
#            rank, SGD lr 0.05; TEACHER_STEPS steps; target TEACHER_TARGET
# The hooks: none, bf16, fp16, powersgd-rR (--powersgd_rank R, --powersgd_start_iter 2,
# the least PyTorch's start_powerSGD_iter allows with error feedback), powersgd-rR-startK
# (--powersgd_start_iter K). PyTorch has no bf16 hook that runs on gloo: it skips bf16.
# Both systems run with buckets of 25 MB, the first one too (FIRST_MB): each model is one
# bucket. With PyTorch's first bucket of 1 MiB, its powerSGD_hook aborts the copy task on
# gloo when compression starts (see scripts/torch_convergence.py).
#
# Writes $OUT/SYSTEM.TASK.HOOK.sSEED.log (rank 0's output), $OUT/commands.txt, and
# convergence-report's runs.csv, summary.csv, summary.md and loss_TASK.{svg,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/convergence}
SEEDS=${SEEDS:-1 2 3}
TASKS=${TASKS:-copy teacher}
HOOKS=${HOOKS:-none bf16 fp16 powersgd-r1 powersgd-r2 powersgd-r4}
COPY_STEPS=${COPY_STEPS:-600}
TEACHER_STEPS=${TEACHER_STEPS:-400}
COPY_TARGET=${COPY_TARGET:-0.01}
TEACHER_TARGET=${TEACHER_TARGET:-0.4}
SMOOTH=${SMOOTH:-10}
FIRST_MB=${FIRST_MB:-25}
GODDP=${GODDP:-1}       # 0: PyTorch's runs only
LIMIT=${LIMIT:-600}     # seconds a PyTorch run may take
if [ -z "${TORCH:-}" ]; then
  TORCH=0
  /usr/bin/python3 -c 'import torch' 2>/dev/null && TORCH=1
fi
mkdir -p "$OUT/bin"
go build -o "$OUT/bin/" ./cmd/ddprun ./cmd/convergence-report ./examples/mlp ./examples/transformer

# hook_flags HOOK: the trainer flags of a hook token.
hook_flags() {
  case $1 in
    none | bf16 | fp16) echo "--comm_hook $1" ;;
    powersgd-r*-start*)
      local r=${1#powersgd-r}
      echo "--comm_hook powersgd --powersgd_rank ${r%%-*} --powersgd_start_iter ${r#*-start}" ;;
    powersgd-r*) echo "--comm_hook powersgd --powersgd_rank ${1#powersgd-r} --powersgd_start_iter 2" ;;
    *) echo "convergence.sh: hook $1: want none, bf16, fp16, powersgd-rR or powersgd-rR-startK" >&2; return 1 ;;
  esac
}

# task_cmd TASK SEED: the trainer and its flags.
task_cmd() {
  case $1 in
    copy) echo "$OUT/bin/transformer --task copy --num_layers 2 --hidden_size 128 --seq_len 32 --batch_size 8 --dropout 0 --lr 1e-3 --warmup_steps 0 --bench_steps $COPY_STEPS --log_every 1 --report_every 1000000 --bucket_cap_mb 25 --first_bucket_cap_mb $FIRST_MB --seed $2" ;;
    teacher) echo "$OUT/bin/mlp --task teacher --inputs 32 --outputs 16 --hidden_size 64 --batch_size 32 --lr 0.05 --steps $TEACHER_STEPS --log_every 1 --bucket_cap_mb 25 --first_bucket_cap_mb $FIRST_MB --seed $2" ;;
    *) echo "convergence.sh: task $1: want copy or teacher" >&2; return 1 ;;
  esac
}

: >"$OUT/commands.txt"
for task in $TASKS; do
  [ "$GODDP" = 1 ] || break
  for hook in $HOOKS; do
    flags=$(hook_flags "$hook")
    for seed in $SEEDS; do
      cmd="$OUT/bin/ddprun --standalone --nproc_per_node 2 $(task_cmd "$task" "$seed" | sed 's/ / -- /') $flags"
      echo "$cmd" >>"$OUT/commands.txt"
      echo "goddp $task $hook seed $seed" >&2
      $cmd 2>"$OUT/goddp.$task.$hook.s$seed.err" | grep '^\[rank0\]: ' >"$OUT/goddp.$task.$hook.s$seed.log"
    done
  done
done

if [ "$TORCH" = 1 ]; then
  for task in $TASKS; do
    for hook in $HOOKS; do
      [ "$hook" = bf16 ] && continue # gloo has no bfloat16 all-reduce
      for seed in $SEEDS; do
        steps=$COPY_STEPS
        [ "$task" = teacher ] && steps=$TEACHER_STEPS
        cmd="/usr/bin/python3 scripts/torch_convergence.py --task $task --hook $hook --seed $seed --steps $steps --first_bucket_cap_mb $FIRST_MB"
        echo "$cmd" >>"$OUT/commands.txt"
        echo "torch $task $hook seed $seed" >&2
        # A failed run (gloo's abort of PowerSGD, a hang) is said and its log kept: the
        # report counts the steps it logged, and it misses the target if it stopped short.
        timeout "$LIMIT" $cmd >"$OUT/torch.$task.$hook.s$seed.log" 2>"$OUT/torch.$task.$hook.s$seed.err" ||
          echo "torch $task $hook seed $seed: exit $? (see torch.$task.$hook.s$seed.err)" >&2
      done
    done
  done
fi

"$OUT/bin/convergence-report" -in "$OUT" -target "copy=$COPY_TARGET,teacher=$TEACHER_TARGET" -smooth "$SMOOTH"
