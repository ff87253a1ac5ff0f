#!/usr/bin/env bash
# The seed article's bucket_cap_mb sweep (section 3) for goddp's transformer at world size 2,
# with the compute-only time (two --no_ddp processes at once, sharing the cores as the two
# ranks do) and, when PyTorch is installed (../shared/bench/torch/setup.sh), PyTorch DDP's
# ddp_bench.py on the same model shape in the same run, interleaved. Writes raw.csv,
# summary.csv, table.md, sweep.svg and sweep.png under $OUT, and every run's output under
# $OUT/logs (goddp's include the per-step overlap figures and each rank's peak RSS).
#
#   make sweep                                   # caps 1 5 10 25 50 100 200, 3 repeats
#   CAPS="1 25 200" REPEATS=1 STEPS=5 make sweep # quick look
#   TORCH=0 make sweep                           # goddp only
set -euo pipefail
cd "$(dirname "$0")/.."
CAPS=${CAPS:-1 5 10 25 50 100 200}
REPEATS=${REPEATS:-3}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-5}
CONFIG=${CONFIG:-}            # e.g. "--num_layers 4 --hidden_size 512"
TORCH_DIR=${TORCH_DIR:-../shared/bench/torch}
OUT=${OUT:-out/sweep_$(date +%Y%m%d_%H%M%S)}
TAGS=${TAGS:-}
if [ -z "$TAGS" ] && ls /usr/lib/x86_64-linux-gnu/libopenblas.so >/dev/null 2>&1; then TAGS=openblas; fi
TORCH=${TORCH:-auto}
if [ "$TORCH" = auto ]; then
  if [ -f "$TORCH_DIR/ddp_bench.py" ] && /usr/bin/python3 -c 'import torch' 2>/dev/null; then TORCH=1; else TORCH=0; fi
fi
GO=${GO:-go}
mkdir -p "$OUT/logs" bin
"$GO" build -o bin/ddprun ./cmd/ddprun
"$GO" build -tags "$TAGS" -o bin/transformer ./examples/transformer
"$GO" build -o bin/sweep-report ./cmd/sweep-report
echo "# transformer built with tags '${TAGS}'; logs in $OUT/logs" >&2
raw="$OUT/raw.csv"
echo "system,kind,bucket_cap_mb,repeat,ms_step" > "$raw"
# torch's --hidden/--batch/--seq are goddp's --hidden_size/--batch_size/--seq_len
torch_config=$(echo " $CONFIG " | sed -e 's/--hidden_size/--hidden/; s/--batch_size/--batch/; s/--seq_len/--seq/')
if [ "$TORCH" = 1 ]; then
  # shellcheck disable=SC1091
  source "$TORCH_DIR/env.sh"
fi

msstep() { sed -n 's/.*bucket_cap_mb=[^ ]*  *ms\/step=\([0-9.]*\).*/\1/p' | tail -1; }
torchms() { sed -n 's/^JSON //p' "$1" | /usr/bin/python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["median"])'; }

# fail LOG WHAT: report a run that failed or printed no time, with its last lines, and stop.
fail() {
  echo "sweep: $2 failed or printed no ms/step; last lines of $1:" >&2
  tail -20 "$1" >&2
  exit 1
}

for rep in $(seq 1 "$REPEATS"); do
  # compute only: two --no_ddp processes at once; the step time is the slower one
  echo "# repeat $rep: goddp compute-only" >&2
  a="$OUT/logs/goddp_compute_r${rep}_a.log"; b="$OUT/logs/goddp_compute_r${rep}_b.log"
  OPENBLAS_NUM_THREADS=1 ./bin/transformer --no_ddp --warmup_steps "$WARMUP" --bench_steps "$STEPS" $CONFIG > "$a" 2>&1 &
  pid=$!
  OPENBLAS_NUM_THREADS=1 ./bin/transformer --no_ddp --warmup_steps "$WARMUP" --bench_steps "$STEPS" $CONFIG > "$b" 2>&1 || fail "$b" "goddp compute-only"
  wait "$pid" || fail "$a" "goddp compute-only"
  ma=$(msstep < "$a"); mb=$(msstep < "$b")
  [ -n "$ma" ] || fail "$a" "goddp compute-only"
  [ -n "$mb" ] || fail "$b" "goddp compute-only"
  echo "goddp,compute,,$rep,$(printf '%s\n%s\n' "$ma" "$mb" | sort -g | tail -1)" >> "$raw"
  if [ "$TORCH" = 1 ]; then
    echo "# repeat $rep: torch compute-only" >&2
    log="$OUT/logs/torch_compute_r${rep}.log"
    /usr/bin/python3 "$TORCH_DIR/ddp_bench.py" --no_ddp --nproc 2 --warmup "$WARMUP" --steps "$STEPS" $torch_config > "$log" 2>&1 \
      || fail "$log" "torch compute-only"
    m=$(torchms "$log") || fail "$log" "torch compute-only"
    echo "torch,compute,,$rep,$m" >> "$raw"
  fi
  for cap in $CAPS; do
    echo "# repeat $rep: goddp bucket_cap_mb=$cap" >&2
    log="$OUT/logs/goddp_cap${cap}_r${rep}.log"
    ./bin/ddprun --nproc_per_node 2 ./bin/transformer -- --bucket_cap_mb "$cap" \
      --warmup_steps "$WARMUP" --bench_steps "$STEPS" $CONFIG > "$log" 2>&1 || fail "$log" "goddp bucket_cap_mb=$cap"
    m=$(grep '^\[rank0\]' "$log" | msstep)
    [ -n "$m" ] || fail "$log" "goddp bucket_cap_mb=$cap"
    echo "goddp,ddp,$cap,$rep,$m" >> "$raw"
    if [ "$TORCH" = 1 ]; then
      echo "# repeat $rep: torch bucket_cap_mb=$cap" >&2
      log="$OUT/logs/torch_cap${cap}_r${rep}.log"
      /usr/bin/python3 "$TORCH_DIR/ddp_bench.py" --world_size 2 --bucket_cap_mb "$cap" --warmup "$WARMUP" --steps "$STEPS" $torch_config \
        > "$log" 2>&1 || fail "$log" "torch bucket_cap_mb=$cap"
      m=$(torchms "$log") || fail "$log" "torch bucket_cap_mb=$cap"
      echo "torch,ddp,$cap,$rep,$m" >> "$raw"
    fi
  done
done
./bin/sweep-report -in "$raw" -out "$OUT"
