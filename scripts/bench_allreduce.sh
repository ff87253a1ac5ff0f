#!/usr/bin/env bash
# Side-by-side all-reduce benchmark: goddp's allreduce-perf against PyTorch's Gloo backend
# (allreduce_bench.py in $TORCH_DIR), float32 sum, interleaved and repeated because
# the machine is shared and noisy. goddp runs twice: on ordinary buffers, and (SHARED=1,
# the default) on buffers from the group's shared arena (--shared, all-reduced in place, as
# the reducer's buckets are), the latter with --ceiling. Prints, per world size and size,
# the median busbw of each over the repeats, the ceiling and the ratios. goddp's busbw is
# nccl-tests' (from the mean iteration); the p50 columns take its median iteration, as the
# PyTorch peer's script does for its own figure. Each size runs at least 20 iterations and
# at least MIN_TIME (0.3s, the peer's --min_time). Both time their iterations back to back on
# one buffer; RESET=1 (the default) adds a --shared --reset run, each iteration from the
# input copied in again, as a DDP bucket is written just before its all-reduce (its
# column: "shared reset"). VMREADV=1 adds a
# third goddp run on ordinary buffers with GODDP_GLOO_VMREADV=1 (the peers' buffers read
# with process_vm_readv, Note [Shared buffers]); TORCH=0 leaves PyTorch out.
#
#   scripts/bench_allreduce.sh                         # world sizes 2 and 4, 3 repeats
#   WORLD_SIZES=2 REPEATS=5 EXTRA="--transport tcp" SHARED=0 scripts/bench_allreduce.sh
#   REPEATS=0 OUT=out/bench_x scripts/bench_allreduce.sh  # an earlier run's tables again
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
SHARED=${SHARED:-1}
VMREADV=${VMREADV:-0}
RESET=${RESET:-1}
MIN_TIME=${MIN_TIME:-0.3s} # each size timed for at least this long, as the peer (--min_time 0.3)
TORCH=${TORCH:-1}
OUT=${OUT:-out/bench_allreduce_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT" bin
go build -o bin/allreduce-perf ./cmd/allreduce-perf
if [ "$TORCH" = 1 ]; then
  # shellcheck disable=SC1091
  source "$TORCH_DIR/env.sh"
fi
# goddp KIND FLAGS...: one allreduce-perf run of world size $n, repeat $rep, with FLAGS, into
# $OUT/KIND_n${n}_r${rep}.jsonl (GODDP_GLOO_VMREADV from the caller's environment).
goddp() {
  local kind=$1
  shift
  echo "# repeat $rep world_size $n: goddp $kind${GODDP_GLOO_VMREADV:+ GODDP_GLOO_VMREADV=$GODDP_GLOO_VMREADV} $* $EXTRA" >&2
  # shellcheck disable=SC2086
  ./bin/allreduce-perf --nproc "$n" -b "$MIN" -e "$MAX" -f 4 -n 20 -w 5 --min_time "$MIN_TIME" --json "$@" $EXTRA \
    > "$OUT/${kind}_n${n}_r${rep}.jsonl"
}
for rep in $(seq 1 "$REPEATS"); do
  for n in $WORLD_SIZES; do
    if [ "$TORCH" = 1 ]; then
      echo "# repeat $rep world_size $n: torch" >&2
      /usr/bin/python3 "$TORCH_DIR/allreduce_bench.py" --world_sizes "$n" --min_bytes "$MIN" \
        --max_bytes "$MAX" --factor 4 --trials 1 --min_time 0.3 --csv "$OUT/torch_n${n}_r${rep}.csv" >&2
    fi
    goddp goddp
    if [ "$VMREADV" = 1 ]; then GODDP_GLOO_VMREADV=1 goddp vm; fi
    if [ "$SHARED" = 1 ]; then goddp shared --shared --ceiling; fi
    if [ "$SHARED" = 1 ] && [ "$RESET" = 1 ]; then goddp reset --shared --reset; fi
  done
done
/usr/bin/python3 - "$OUT" <<'PY'
import csv, glob, json, os, statistics, sys
out = sys.argv[1]
torch, goddp, shared, vm, reset = {}, {}, {}, {}, {}
for f in glob.glob(os.path.join(out, "torch_*.csv")):
    for r in csv.DictReader(open(f)):
        torch.setdefault((int(r["world_size"]), int(r["bytes"])), []).append(float(r["busbw_GBps"]))
for kind, into in (("goddp", goddp), ("shared", shared), ("vm", vm), ("reset", reset)):
    for f in glob.glob(os.path.join(out, kind + "_*.jsonl")):
        n = int(os.path.basename(f).split("_")[1][1:])
        for line in open(f):
            if line.startswith("{"):
                r = json.loads(line)
                into.setdefault((n, int(r["size_bytes"])), []).append(r)
def fmt(b):
    for u, s in ((1 << 20, "MiB"), (1 << 10, "KiB")):
        if b >= u:
            return f"{b // u} {s}"
    return f"{b} B"
def med(rows, key):
    return statistics.median(r[key] for r in rows) if rows else float("nan")
for n in sorted({k[0] for k in goddp}):
    print(f"\nworld_size={n}  (busbw GB/s, median over repeats; ceiling and algorithm from the --shared --ceiling runs; their % of ceiling is the median of each run's own percentage, reset's is against the median ceiling)")
    print("| size | torch | goddp | goddp --shared | algorithm | ceiling | % of ceiling | shared/goddp | goddp/torch | shared/torch | goddp vm_readv | vm/goddp | goddp p50 | shared p50 | % of ceiling p50 | shared p50/torch | shared reset | reset % of ceiling | reset/torch | checked |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for (m, b) in sorted(k for k in goddp if k[0] == n):
        g, sh = goddp[(m, b)], shared.get((m, b), [])
        t = statistics.median(torch[(m, b)]) if (m, b) in torch else float("nan")
        gb, sb = med(g, "busbw_gbs"), med(sh, "busbw_gbs")
        ceil = med([r for r in sh if r.get("ceiling_busbw_gbs")], "ceiling_busbw_gbs") if sh else float("nan")
        algo = sh[0].get("algo", "-") if sh else "-"
        v = vm.get((m, b), [])
        vb = med(v, "busbw_gbs")
        gm, sm = med(g, "busbw_median_gbs"), med(sh, "busbw_median_gbs")
        rs = reset.get((m, b), [])
        rb = med(rs, "busbw_gbs")
        pct = [r for r in sh if r.get("pct_of_ceiling")]
        pc, pcm = med(pct, "pct_of_ceiling"), med(pct, "pct_of_ceiling_median")
        ok = all(r["ok"] is not False for r in g + sh + v + rs)
        print(f"| {fmt(b)} | {t:.3f} | {gb:.3f} | {sb:.3f} | {algo} | {ceil:.3f} | {pc:.0f}% | {sb / gb:.2f} | {gb / t:.2f} | {sb / t:.2f} | {vb:.3f} | {vb / gb:.2f} | {gm:.3f} | {sm:.3f} | {pcm:.0f}% | {sm / t:.2f} | {rb:.3f} | {100 * rb / ceil:.0f}% | {rb / t:.2f} | {'yes' if ok else 'NO'} |")
PY
echo "raw results in $OUT" >&2
