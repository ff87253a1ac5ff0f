#!/usr/bin/env bash
# Compute against the PyTorch peer: ms/step of the transformer at one shape, one process
# (--no_ddp) and 2 ranks under ddprun, for goddp's default build (its Go-assembly SGEMM),
# its OpenBLAS build (where libopenblas-dev is installed) and, where PyTorch and the peer's
# scripts are present ($TORCH_DIR), PyTorch 1.13's ddp_bench.py. The systems run
# interleaved, ROUNDS times; the table gives each one's median and its ratio to PyTorch.
# OPENBLAS_CORETYPE is set the same for every system (SkylakeX on an AVX-512 CPU, as the
# peer's env.sh does), since Debian's OpenBLAS picks slow kernels on CPUs it does not know.
#
#   scripts/bench_compute.sh                                   # seed shape, 3 rounds
#   ROUNDS=5 CONFIG="--num_layers 4 --hidden_size 512" scripts/bench_compute.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-30}
CONFIG=${CONFIG:-}
TORCH_DIR=${TORCH_DIR:-../shared/bench/torch}
OUT=${OUT:-out/compute_$(date +%Y%m%d_%H%M%S)}
GO=${GO:-go}
mkdir -p "$OUT/logs" bin
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx512f /proc/cpuinfo; then export OPENBLAS_CORETYPE=SkylakeX; fi
"$GO" build -o bin/ddprun ./cmd/ddprun
"$GO" build -o bin/transformer ./examples/transformer
systems=(goddp)
if ls /usr/lib/x86_64-linux-gnu/libopenblas.so /usr/lib/*/libopenblas.so >/dev/null 2>&1; then
  "$GO" build -tags openblas -o bin/transformer-openblas ./examples/transformer
  systems+=(goddp_openblas)
fi
torch_config=$(echo " $CONFIG " | sed -e 's/--hidden_size/--hidden/; s/--batch_size/--batch/; s/--seq_len/--seq/')
if [ -f "$TORCH_DIR/ddp_bench.py" ] && /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  systems+=(torch)
fi
echo "# OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}; systems: ${systems[*]}; logs in $OUT/logs" >&2
raw="$OUT/raw.csv"
echo "system,mode,round,ms_step" > "$raw"

goddp_ms() { sed -n 's/.*ms\/step=\([0-9.]*\).*/\1/p' "$1" | tail -1; }
torch_ms() { sed -n 's/^JSON //p' "$1" | /usr/bin/python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["median"])'; }

# run SYSTEM MODE ROUND: one launch; appends its ms/step to raw.csv.
run() {
  local sys=$1 mode=$2 round=$3 log="$OUT/logs/$1_$2_$3.log" bin=bin/transformer ms
  [ "$sys" = goddp_openblas ] && bin=bin/transformer-openblas
  case "$sys/$mode" in
    torch/one) (source "$TORCH_DIR/env.sh"; /usr/bin/python3 "$TORCH_DIR/ddp_bench.py" --no_ddp --steps "$STEPS" $torch_config) >"$log" 2>&1 ;;
    torch/ddp) (source "$TORCH_DIR/env.sh"; /usr/bin/python3 "$TORCH_DIR/ddp_bench.py" --world_size 2 --steps "$STEPS" $torch_config) >"$log" 2>&1 ;;
    */one) "$bin" --no_ddp --bench_steps "$STEPS" $CONFIG >"$log" 2>&1 ;;
    */ddp) bin/ddprun --nproc_per_node 2 "$bin" -- --bench_steps "$STEPS" $CONFIG >"$log" 2>&1 ;;
  esac
  if [ "$sys" = torch ]; then ms=$(torch_ms "$log"); else ms=$(goddp_ms "$log"); fi
  [ -n "$ms" ] || { echo "bench_compute: $sys $mode printed no ms/step; see $log" >&2; exit 1; }
  echo "$sys,$mode,$round,$ms" >> "$raw"
  echo "round $round  $mode  $sys  $ms ms/step" >&2
}

for round in $(seq 1 "$ROUNDS"); do
  for mode in one ddp; do
    for sys in "${systems[@]}"; do run "$sys" "$mode" "$round"; done
  done
done

/usr/bin/env python3 - "$raw" <<'PY' | tee "$OUT/table.md"
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
med = {}
for (s, m) in {(r["system"], r["mode"]) for r in rows}:
    v = [float(r["ms_step"]) for r in rows if r["system"] == s and r["mode"] == m]
    med[s, m] = (statistics.median(v), min(v), max(v), len(v))
systems = [s for s in ("goddp", "goddp_openblas", "torch") if (s, "one") in med]
print("| system | 1 process ms/step (min..max) | vs torch | 2 ranks ms/step (min..max) | vs torch |")
print("|---|---:|---:|---:|---:|")
for s in systems:
    cells = []
    for m in ("one", "ddp"):
        md, lo, hi, n = med[s, m]
        ratio = f"{md / med['torch', m][0]:.2f}" if ("torch", m) in med else "-"
        cells += [f"{md:.1f} ({lo:.1f}..{hi:.1f})", ratio]
    print(f"| {s} | " + " | ".join(cells) + " |")
PY
