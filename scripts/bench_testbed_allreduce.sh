#!/usr/bin/env bash
# All-reduce across two hosts of the testbed (cmd/testbed: network namespaces, each link
# shaped to RATE), 2×LOCAL ranks: goddp's allreduce-perf with the flat ring
# (GODDP_GLOO_ALGO=ring) and with Note [Hierarchical]'s rings (auto), and PyTorch's Gloo
# (allreduce_bench.py, env:// with GLOO_SOCKET_IFNAME=eth0) when installed, interleaved,
# REPEATS times. goddp's auto runs once more on buffers from the group's arena (--shared, as
# the reducer's buckets are: Note [Host phases in place]) unless SHARED=0. Prints the median
# busbw per size. Root only.
#
# PLACEMENT=contiguous (the default) puts ranks 0..LOCAL-1 on host 0, as ddprun --nnodes does
# (goddp runs under it); PLACEMENT=roundrobin puts rank r on host r mod 2, every rank started
# by hand with torchrun's variables (goddp's rank 0 then hosts the store).
#
#   RATE=1gbit scripts/bench_testbed_allreduce.sh
#   RATE=10gbit REPEATS=5 MIN=1048576 MAX=67108864 PLACEMENT=roundrobin scripts/bench_testbed_allreduce.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-1gbit}
REPEATS=${REPEATS:-3}
MIN=${MIN:-1048576}
MAX=${MAX:-67108864}
LOCAL=${LOCAL:-2}
PLACEMENT=${PLACEMENT:-contiguous}
SHARED=${SHARED:-1}
TORCH_DIR=${TORCH_DIR:-../shared/bench/torch}
OUT=${OUT:-out/testbed_allreduce_${RATE}_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT" bin
go build -o bin/ ./cmd/testbed ./cmd/ddprun ./cmd/allreduce-perf
GODDP_TOKEN=${GODDP_TOKEN:-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}
export GODDP_TOKEN
TORCH=0
if [ -f "$TORCH_DIR/allreduce_bench.py" ] && /usr/bin/python3 -c 'import torch' 2>/dev/null; then TORCH=1; fi
WORLD=$((2 * LOCAL))
case "$PLACEMENT" in
  contiguous) rankof="\$((\$TESTBED_HOST * $LOCAL + L))" ;;
  roundrobin) rankof="\$((L * 2 + \$TESTBED_HOST))" ;;
  *) echo "PLACEMENT=$PLACEMENT: want contiguous or roundrobin" >&2; exit 2 ;;
esac
# ranks CMD TAG: the shell text that starts this host's LOCAL ranks of CMD by hand (rank from
# $rankof with L the local index), torchrun's variables set, and waits for them.
ranks() {
  local out="" l
  for l in $(seq 0 $((LOCAL - 1))); do
    out="$out (RANK=${rankof//L/$l} LOCAL_RANK=$l LOCAL_WORLD_SIZE=$LOCAL WORLD_SIZE=$WORLD MASTER_ADDR=\$TESTBED_MASTER ${1//@L@/$l}) &"
  done
  echo "$out wait"
}
for rep in $(seq 1 "$REPEATS"); do
  runs="ring auto"
  if [ "$SHARED" = 1 ]; then runs="$runs shared"; fi
  for run in $runs; do
    echo "# repeat $rep: goddp $run ($PLACEMENT)" >&2
    algo=$run flags=""
    if [ "$run" = shared ]; then algo=auto flags=--shared; fi
    perf="bin/allreduce-perf -b $MIN -e $MAX -f 4 -n 5 -w 2 --json $flags"
    if [ "$PLACEMENT" = contiguous ]; then
      cmd="bin/ddprun --nnodes 2 --node_rank \$TESTBED_HOST --nproc_per_node $LOCAL --master_addr \$TESTBED_MASTER --master_port 29500 $perf"
    else
      cmd="$(ranks "MASTER_PORT=29500 $perf")"
    fi
    bin/testbed --hosts 2 --rate "$RATE" -- "export GODDP_GLOO_ALGO=$algo; $cmd" > "$OUT/goddp_${run}_r${rep}.log" 2>&1
  done
  if [ "$TORCH" = 1 ]; then
    echo "# repeat $rep: torch ($PLACEMENT)" >&2
    torch_ranks="$(ranks "MASTER_PORT=29600 /usr/bin/python3 $TORCH_DIR/allreduce_bench.py --min_bytes $MIN --max_bytes $MAX --factor 4 --trials 1 --min_time 0.3 --csv $PWD/$OUT/torch_r${rep}_\${TESTBED_HOST}_@L@.csv")"
    bin/testbed --hosts 2 --rate "$RATE" -- \
      "source $TORCH_DIR/env.sh; export GLOO_SOCKET_IFNAME=eth0; $torch_ranks" > "$OUT/torch_r${rep}.log" 2>&1
  fi
done
/usr/bin/python3 - "$OUT" "$WORLD" "$PLACEMENT" <<'PY'
import csv, glob, json, os, re, statistics, sys
out, world = sys.argv[1], int(sys.argv[2])
rows = {}
for f in glob.glob(os.path.join(out, "goddp_*_r*.log")):
    algo = os.path.basename(f).split("_")[1]
    for line in open(f):
        m = re.search(r"(\{.*\})", line)
        if m and '"busbw_gbs"' in m.group(1):
            r = json.loads(m.group(1))
            if not r.get("ok", True):
                sys.exit(f"{f}: a result failed its check")
            rows.setdefault((algo, r["size_bytes"]), []).append(r["busbw_gbs"])
for f in glob.glob(os.path.join(out, "torch_r*_0_0.csv")):  # rank 0's
    for r in csv.DictReader(open(f)):
        if int(r["world_size"]) == world:
            rows.setdefault(("torch", int(r["bytes"])), []).append(float(r["busbw_GBps"]))
sizes = sorted({k[1] for k in rows})
print(f"busbw GB/s, {world} ranks on 2 hosts ({sys.argv[3]}), median over repeats")
print("| size | torch | goddp ring | goddp hierarchical | goddp --shared (in place) | hierarchical/ring | hierarchical/torch | shared/torch |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
med = lambda k: statistics.median(rows[k]) if k in rows else float("nan")
for s in sizes:
    t, g, h, sh = med(("torch", s)), med(("ring", s)), med(("auto", s)), med(("shared", s))
    print(f"| {s >> 20} MiB | {t:.3f} | {g:.3f} | {h:.3f} | {sh:.3f} | {h / g:.2f} | {h / t:.2f} | {sh / t:.2f} |")
PY
