#!/usr/bin/env bash
# The kill test (restart without losing work): the 2-rank transformer run without
# interruption gives the reference params_crc32; then, for each RANK:STEP pair, the same run
# under `ddprun --max_restarts 1` has that rank's process killed with a real `kill -9` (its
# pid read from the rank<R>.pid file the trainer writes in its --checkpoint_dir) as soon as
# rank 0 reports the step; ddprun restarts the group, the trainer resumes from its
# newest readable checkpoint, and the run's final params_crc32 must equal the reference.
# Prints the table (rank, step, the last step rank 0 finished before the kill, the step
# resumed from, crc, equal?) and exits 1 if any row differs.
#
#   scripts/kill_test.sh
#   PAIRS="1:7 0:12" STEPS=20 scripts/kill_test.sh
#   CONFIG="--num_layers 2 --hidden_size 256" scripts/kill_test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
OUT=${OUT:-out/kill_test}
PAIRS=${PAIRS:-0:2 1:4 0:5 1:9 0:13 1:17 0:22 1:26 0:28}
STEPS=${STEPS:-30}
EVERY=${EVERY:-5}
CONFIG=${CONFIG:---num_layers 1 --hidden_size 64}
TAGS=${TAGS:-}

rm -rf "$OUT"
mkdir -p "$OUT/bin"
"$GO" build -o "$OUT/bin/ddprun" ./cmd/ddprun
"$GO" build -tags "$TAGS" -o "$OUT/bin/transformer" ./examples/transformer
ARGS="$CONFIG --warmup_steps 0 --bench_steps $STEPS --checkpoint_every $EVERY --log_every 1"

lastcrc() { sed -n 's/^\[rank0\]: params_crc32=\([0-9a-f]*\)$/\1/p' "$1" | tail -1; }

# The reference: the same job, never interrupted.
"$OUT/bin/ddprun" --nproc_per_node 2 "$OUT/bin/transformer" -- $ARGS --checkpoint_dir "$OUT/ref/ckpt" > "$OUT/ref.log" 2>&1 ||
  { echo "kill_test: the reference run failed:" >&2; tail -20 "$OUT/ref.log" >&2; exit 1; }
ref=$(lastcrc "$OUT/ref.log")
[ -n "$ref" ] || { echo "kill_test: no params_crc32 in $OUT/ref.log" >&2; exit 1; }

fails=0
rows=()
for pair in $PAIRS; do
  rank=${pair%%:*}; step=${pair##*:}
  dir="$OUT/r${rank}_s${step}"; log="$dir.log"
  mkdir -p "$dir"; : > "$log"
  "$OUT/bin/ddprun" --nproc_per_node 2 --max_restarts 1 "$OUT/bin/transformer" -- $ARGS --checkpoint_dir "$dir/ckpt" > "$log" 2>&1 &
  job=$!
  # Wait until rank 0 has finished the step (then every rank is in it or the next one).
  killed_at=-
  for _ in $(seq 1 6000); do
    if grep -q "^\[rank0\]: step $step loss" "$log"; then
      pid=$(cat "$dir/ckpt/rank$rank.pid")
      kill -9 "$pid"
      killed_at=$(sed -n 's/^\[rank0\]: step \([0-9]*\) loss.*/\1/p' "$log" | tail -1)
      break
    fi
    if ! kill -0 "$job" 2>/dev/null; then break; fi
    sleep 0.01
  done
  rc=0
  wait "$job" || rc=$?
  crc=$(lastcrc "$log")
  resumed=$(sed -n 's/^\[rank0\]: params=.* start_step=\([0-9]*\)$/\1/p' "$log" | tail -n +2 | tail -1)
  restarted=no
  grep -q "failed on attempt 0" "$log" && restarted=yes
  equal=no
  if [ "$rc" = 0 ] && [ "$crc" = "$ref" ] && [ "$killed_at" != - ] && [ "$restarted" = yes ]; then equal=yes; else fails=$((fails + 1)); fi
  rows+=("$(printf '%4s  %4s  %9s  %7s  %9s  %8s  %s' "$rank" "$step" "$killed_at" "${resumed:--}" "$restarted" "${crc:--}" "$equal")")
done

echo "reference (uninterrupted) params_crc32=$ref   [$CONFIG, $STEPS steps, checkpoint every $EVERY, 2 ranks]"
echo "rank  step  rank0_at  resumed  restarted       crc  equal?"
printf '%s\n' "${rows[@]}"
echo "logs: $OUT/*.log"
[ "$fails" = 0 ] || { echo "kill_test: $fails of the runs differ or failed" >&2; exit 1; }
