#!/usr/bin/env bash
# Side-by-side all-reduce benchmark: goddp's allreduce-perf against PyTorch's Gloo backend
# (allreduce_bench.py in $TORCH_DIR), float32 sum, interleaved and repeated because
# the machine is shared and noisy. Prints, per world size and size, the median busbw of each
# system over the repeats and the ratio goddp/torch.
#
#   scripts/bench_allreduce.sh                         # world sizes 2 and 4, 3 repeats
#   WORLD_SIZES=2 REPEATS=5 EXTRA="--transport tcp" scripts/bench_allreduce.sh
#
# Needs the PyTorch peer installed ($TORCH_DIR/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_DIR=${TORCH_DIR:-../shared/bench/torch}
WORLD_SIZES=${WORLD_SIZES:-2 4}
REPEATS=${REPEATS:-3}
MIN=${MIN:-4096}
MAX=${MAX:-268435456}
EXTRA=${EXTRA:-}
OUT=${OUT:-out/bench_allreduce_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT" bin
go build -o bin/allreduce-perf ./cmd/allreduce-perf
# shellcheck disable=SC1091
source "$TORCH_DIR/env.sh"
for rep in $(seq 1 "$REPEATS"); do
  for n in $WORLD_SIZES; do
    echo "# repeat $rep world_size $n: torch" >&2
    /usr/bin/python3 "$TORCH_DIR/allreduce_bench.py" --world_sizes "$n" --min_bytes "$MIN" \
      --max_bytes "$MAX" --factor 4 --trials 1 --min_time 0.3 --csv "$OUT/torch_n${n}_r${rep}.csv" >&2
    echo "# repeat $rep world_size $n: goddp $EXTRA" >&2
    # shellcheck disable=SC2086
    ./bin/allreduce-perf --nproc "$n" -b "$MIN" -e "$MAX" -f 4 -n 20 -w 5 --json $EXTRA \
      > "$OUT/goddp_n${n}_r${rep}.jsonl"
  done
done
/usr/bin/python3 - "$OUT" <<'PY'
import csv, glob, json, os, statistics, sys
out = sys.argv[1]
torch, goddp = {}, {}
for f in glob.glob(os.path.join(out, "torch_*.csv")):
    for r in csv.DictReader(open(f)):
        torch.setdefault((int(r["world_size"]), int(r["bytes"])), []).append(
            (float(r["busbw_GBps"]), float(r["time_us_median"])))
for f in glob.glob(os.path.join(out, "goddp_*.jsonl")):
    n = int(os.path.basename(f).split("_")[1][1:])
    for line in open(f):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        goddp.setdefault((n, int(r["size_bytes"])), []).append((r["busbw_gbs"], r["time_us"], r["ok"]))
def fmt(b):
    for u, s in ((1 << 20, "MiB"), (1 << 10, "KiB")):
        if b >= u:
            return f"{b // u} {s}"
    return f"{b} B"
for n in sorted({k[0] for k in goddp}):
    print(f"\nworld_size={n}  (median over repeats; busbw GB/s, time us)")
    print(f"{'size':>9} | {'torch busbw':>11} {'torch us':>10} | {'goddp busbw':>11} {'goddp us':>10} {'ok':>3} | {'ratio':>6}")
    for (m, b) in sorted(k for k in goddp if k[0] == n):
        g = goddp[(m, b)]
        gb = statistics.median(x[0] for x in g); gt = statistics.median(x[1] for x in g)
        ok = all(x[2] is not False for x in g)
        t = torch.get((m, b))
        if t:
            tb = statistics.median(x[0] for x in t); tt = statistics.median(x[1] for x in t)
            print(f"{fmt(b):>9} | {tb:>11.3f} {tt:>10.1f} | {gb:>11.3f} {gt:>10.1f} {'yes' if ok else 'NO':>3} | {gb / tb if tb else float('nan'):>6.2f}")
        else:
            print(f"{fmt(b):>9} | {'-':>11} {'-':>10} | {gb:>11.3f} {gt:>10.1f} {'yes' if ok else 'NO':>3} |")
PY
echo "raw results in $OUT" >&2
