#!/usr/bin/env bash
# Issue 7's "must show", in one run: (a) the merged timeline of the 2-rank transformer at
# bucket_cap_mb 1 and 200 and a PNG of one step after warm-up (trace-plot); (b) a straggler
# made on purpose (--straggle_ms 1:MS) and the report naming it; (c) the cost of tracing:
# ms/step without and with --trace, interleaved; (d) the Prometheus endpoint scraped with
# curl during a run. Everything lands under $OUT.
#
#   scripts/trace_demo.sh
#   CONFIG="--num_layers 1 --hidden_size 64" REPEATS=2 scripts/trace_demo.sh   # quick look
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
OUT=${OUT:-out/trace_demo}
CONFIG=${CONFIG:-}          # default: the seed's model (2 layers, hidden 256, batch 8, seq 64)
CAPS=${CAPS:-1 200}
ITER=${ITER:-5}             # the step drawn (after the warm-up and the bucket rebuild)
STEPS=${STEPS:-10}
REPEATS=${REPEATS:-5}
STRAGGLE=${STRAGGLE:-1:20}
PORT=${PORT:-9464}
TAGS=${TAGS:-}

mkdir -p "$OUT/bin" "$OUT/logs"
"$GO" build -o "$OUT/bin/ddprun" ./cmd/ddprun
"$GO" build -o "$OUT/bin/trace-plot" ./cmd/trace-plot
"$GO" build -tags "$TAGS" -o "$OUT/bin/transformer" ./examples/transformer
run2() { "$OUT/bin/ddprun" --nproc_per_node 2 "$@"; }
msstep() { sed -n 's/.*bucket_cap_mb=[^ ]*  *ms\/step=\([0-9.]*\).*/\1/p' "$1" | tail -1; }

echo "== (a) timelines: bucket_cap_mb $CAPS, step $ITER drawn"
for cap in $CAPS; do
  log="$OUT/logs/trace_cap$cap.log"
  run2 --trace_merge "$OUT/trace_cap$cap.json" "$OUT/bin/transformer" -- $CONFIG --bucket_cap_mb "$cap" \
    --warmup_steps 3 --bench_steps "$STEPS" > "$log" 2>&1
  "$OUT/bin/trace-plot" -in "$OUT/trace_cap$cap.json" -iter "$ITER" -out "$OUT/trace_cap$cap.png"
  echo "cap $cap: $(grep -h '^\[rank0\]: overlap:' "$log" | sed 's/^\[rank0\]: //')"
  echo "cap $cap: $OUT/trace_cap$cap.json -> $OUT/trace_cap$cap.png"
done

echo "== (b) straggler: --straggle_ms $STRAGGLE, then the other rank, then none"
other="$(( 1 - ${STRAGGLE%%:*} )):${STRAGGLE##*:}"
for s in "$STRAGGLE" "$other" none; do
  log="$OUT/logs/straggle_${s/:/_}.log"
  opt=(--straggle_ms "$s"); [ "$s" = none ] && opt=()
  run2 "$OUT/bin/transformer" -- $CONFIG "${opt[@]}" --warmup_steps 2 --bench_steps "$STEPS" > "$log" 2>&1
  echo "--straggle_ms $s: $(grep -h '^\[rank0\]: ddp stragglers' "$log" | sed 's/^\[rank0\]: //')"
done

echo "== (c) tracing overhead, interleaved, $REPEATS repeats of $STEPS timed steps"
printf '%-7s  %-12s  %-12s\n' repeat "no trace" "--trace"
sum_off=0; sum_on=0
for rep in $(seq 1 "$REPEATS"); do
  off="$OUT/logs/overhead_off_$rep.log"; on="$OUT/logs/overhead_on_$rep.log"
  run2 "$OUT/bin/transformer" -- $CONFIG --warmup_steps 3 --bench_steps "$STEPS" > "$off" 2>&1
  run2 "$OUT/bin/transformer" -- $CONFIG --warmup_steps 3 --bench_steps "$STEPS" --trace "$OUT/overhead_$rep.json" > "$on" 2>&1
  a=$(msstep "$off"); b=$(msstep "$on")
  printf '%-7s  %-12s  %-12s\n' "$rep" "$a" "$b"
  sum_off=$(echo "$sum_off + $a" | bc -l); sum_on=$(echo "$sum_on + $b" | bc -l)
done
printf '%-7s  %-12.2f  %-12.2f  (ms/step)\n' mean "$(echo "$sum_off / $REPEATS" | bc -l)" "$(echo "$sum_on / $REPEATS" | bc -l)"

echo "== (d) metrics: --metrics_addr 127.0.0.1:$PORT (rank 1 on $((PORT + 1))), scraped during the run"
log="$OUT/logs/metrics.log"
run2 "$OUT/bin/transformer" -- $CONFIG --warmup_steps 2 --bench_steps $((STEPS * 4)) --metrics_addr "127.0.0.1:$PORT" > "$log" 2>&1 &
job=$!
for _ in $(seq 1 3000); do
  grep -q '^\[rank0\]: step [1-9][0-9]* loss' "$log" && break
  kill -0 "$job" 2>/dev/null || break
  sleep 0.05
done
for p in "$PORT" $((PORT + 1)); do
  echo "\$ curl -s http://127.0.0.1:$p/metrics | grep '^goddp_' | grep -v _bucket"
  curl -s "http://127.0.0.1:$p/metrics" > "$OUT/metrics_$p.txt" || true
  grep '^goddp_' "$OUT/metrics_$p.txt" | grep -v '_bucket' || echo "(no metrics: the run ended first?)"
done
wait "$job"
