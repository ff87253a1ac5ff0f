#!/usr/bin/env bash
# The bucket_cap_mb sweep for goddp's transformer at world size 2, with the compute-only
# time (two --no_ddp processes at once, sharing the cores as the two ranks do) and, when PyTorch is installed ($TORCH_DIR/setup.sh), PyTorch DDP's
# ddp_bench.py on the same model shape in the same run, interleaved. Writes raw.csv,
# summary.csv, table.md, sweep.svg and sweep.png under $OUT, and every run's output under
# $OUT/logs (goddp's include the per-step overlap figures and each rank's peak RSS). With
# auto (AUTO=1), sim.md holds cmd/ddpsim's prediction of every cap against the measured
# medians, from auto's profiles and from one traced one-bucket launch per repeat
# (ONEBUCKET=1), with the all-reduce curve of allreduce-perf run once before the repeats, as
# the ranks run (on the testbed or this host, on buffers from the group's arena as the
# buckets are), and the slowdowns under overlap from one more traced launch per repeat whose
# buckets all have the sweep's smallest cap (OVERLAP_MB), and last with each collective's own
# CPU time, from rank 0's CPU per step against the buckets of the sweep's launches (cpu.csv,
# Note [A collective's CPU] in package bucket/sim). The points of a repeat run in a
# shuffled order (ORDER, SEED; logs/order.txt), each once the machine is quiet (QUIET;
# logs/probe.csv, Note [Quiet machine]).
#
#   make sweep                                   # caps 1 5 10 25 50 100 200, 3 repeats
#   CAPS="1 25 200" REPEATS=1 STEPS=5 make sweep # quick look
#   TORCH=0 make sweep                           # goddp only
#   COMM_HOOK=powersgd PSGD_RANK=2 make sweep    # both systems with a comm hook
#   AUTO=0 make sweep                            # without goddp's --bucket_cap_mb auto
#   LINK=0 TESTBED_RATE=1gbit make sweep         # without the traced launches for link.txt
#   TESTBED_RATE=1gbit make sweep                # over a real link: 2 hosts x 1 rank (root)
#
# With TESTBED_RATE (tc syntax: 1gbit, 10gbit) every DDP point runs on a fresh two-host
# testbed (cmd/testbed: network namespaces joined by a bridge, each link shaped to the rate),
# one rank per host, launched as on two machines: goddp with ddprun --nnodes 2, PyTorch with
# its env:// variables and GLOO_SOCKET_IFNAME=eth0. Each rank uses one BLAS thread, as the two
# hosts share this machine's cores. goddp's runs also give link.txt: the link's use while
# buckets are in flight, from one more, traced, launch per cap, counting each bucket from the
# later rank's start (sweep-report -trace).
set -euo pipefail
cd "$(dirname "$0")/.."
CAPS=${CAPS:-1 5 10 25 50 100 200}
REPEATS=${REPEATS:-3}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-5}
CONFIG=${CONFIG:-}            # e.g. "--num_layers 4 --hidden_size 512"
COMM_HOOK=${COMM_HOOK:-}      # e.g. bf16, powersgd or auto: --comm_hook of both systems (none: the default; PyTorch has no auto and runs none)
PSGD_RANK=${PSGD_RANK:-}      # with COMM_HOOK=powersgd: --powersgd_rank (ddp_bench.py's --psgd_rank; empty: 1); with auto: its only rank
TORCH_DIR=${TORCH_DIR:-../shared/bench/torch}
OUT=${OUT:-out/sweep_$(date +%Y%m%d_%H%M%S)}
TAGS=${TAGS:-}
TORCH=${TORCH:-auto}
LINK=${LINK:-1}               # on the testbed: one more traced goddp launch per cap (link.txt)
AUTO=${AUTO:-1}               # also run goddp with --bucket_cap_mb auto (kind auto in raw.csv)
ONEBUCKET=${ONEBUCKET:-1}     # also one traced goddp launch with one bucket per repeat (sim.md)
OVERLAP_MB=${OVERLAP_MB:-$(printf '%s\n' $CAPS | sort -g | head -1)} # with ONEBUCKET=1: one traced launch per repeat with every bucket this cap (sim.md)
PERF_MAX=${PERF_MAX:-64M}     # with ONEBUCKET=1: allreduce-perf from 64K to this size, once (logs/allreduce.jsonl, sim.md)
ORDER=${ORDER:-random}        # or fixed: the order of the points within a repeat
QUIET=${QUIET:-1}             # wait for a quiet machine before each launch (0: do not probe)
QUIET_TOL=0.15                # quiet: a probe at most this fraction over the median of the probes so far
QUIET_WAIT=60                 # the longest wait for quiet before a launch, in seconds
SEED=${SEED:-$((RANDOM % 10000))}
if [ "$TORCH" = auto ]; then
  if [ -f "$TORCH_DIR/ddp_bench.py" ] && /usr/bin/python3 -c 'import torch' 2>/dev/null; then TORCH=1; else TORCH=0; fi
fi
GO=${GO:-go}
TESTBED_RATE=${TESTBED_RATE:-}
mkdir -p "$OUT/logs" bin
if [ -n "$TESTBED_RATE" ]; then
  "$GO" build -o bin/testbed ./cmd/testbed
  GODDP_TOKEN=${GODDP_TOKEN:-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}
  export GODDP_TOKEN
fi
"$GO" build -o bin/ddprun ./cmd/ddprun
"$GO" build -tags "$TAGS" -o bin/transformer ./examples/transformer
"$GO" build -o bin/sweep-report ./cmd/sweep-report
"$GO" build -o bin/ddpsim ./cmd/ddpsim
"$GO" build -o bin/allreduce-perf ./cmd/allreduce-perf
echo "# transformer built with tags '${TAGS}'; logs in $OUT/logs; order seed $SEED" >&2
raw="$OUT/raw.csv"
echo "system,kind,bucket_cap_mb,repeat,ms_step,layout" > "$raw"
echo "system,kind,bucket_cap_mb,repeat,buckets,cpu_ms_step" > "$OUT/cpu.csv"
# torch's --hidden/--batch/--seq are goddp's --hidden_size/--batch_size/--seq_len
torch_config=$(echo " $CONFIG " | sed -e 's/--hidden_size/--hidden/; s/--batch_size/--batch/; s/--seq_len/--seq/')
if [ -n "$COMM_HOOK" ]; then # both systems' DDP runs with that hook; PyTorch's PowerSGD starts at step 2
  CONFIG="$CONFIG --comm_hook $COMM_HOOK --powersgd_rank ${PSGD_RANK:-0} --powersgd_start_iter 2"
  if [ "$COMM_HOOK" != auto ]; then
    torch_config="$torch_config --comm_hook $COMM_HOOK --psgd_rank ${PSGD_RANK:-1}"
  fi
fi
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

# ddprun_testbed LOG WHAT ARGS...: ddprun ARGS on a fresh two-host testbed, one rank per
# host, as on two machines, into LOG; fails the sweep (naming WHAT) if it fails.
ddprun_testbed() {
  local log=$1 what=$2
  shift 2
  # env.sh points GLOO_SOCKET_IFNAME at lo for torch on one host; goddp honours it too
  env -u GLOO_SOCKET_IFNAME OPENBLAS_NUM_THREADS=1 ./bin/testbed --hosts 2 --rate "$TESTBED_RATE" -- \
    "./bin/ddprun --nnodes 2 --node_rank \$TESTBED_HOST --nproc_per_node 1 --master_addr \$TESTBED_MASTER --master_port 29500 $*" \
    > "$log" 2>&1 || fail "$log" "$what on the testbed"
}

# goddp_testbed CAP LOG [DDPRUN_FLAGS...]: one goddp launch on the testbed (ddprun_testbed).
goddp_testbed() {
  local cap=$1 log=$2
  shift 2
  ddprun_testbed "$log" "goddp bucket_cap_mb=$cap${*:+ ($*)}" \
    "$* ./bin/transformer -- --bucket_cap_mb $cap --warmup_steps $WARMUP --bench_steps $STEPS $CONFIG"
}

# goddp_point CAP LOG [DDPRUN_FLAGS...]: one goddp launch with --bucket_cap_mb CAP (CAP may
# carry more of the trainer's flags, as "auto --auto_profile F"): on a fresh two-host testbed
# with TESTBED_RATE, else 2 ranks on this host. Sets m to rank 0's ms/step, or fails the sweep,
# and lay to the bucket layout it ran (empty if its log has none).
goddp_point() {
  local cap=$1 log=$2
  shift 2
  if [ -n "$TESTBED_RATE" ]; then
    goddp_testbed "$cap" "$log" "$@"
    m=$(sed -n 's/^\[host0\] \(\[rank0\].*\)/\1/p' "$log" | msstep)
  else
    # shellcheck disable=SC2086 # $cap may hold several flags
    ./bin/ddprun --nproc_per_node 2 "$@" ./bin/transformer -- --bucket_cap_mb $cap \
      --warmup_steps "$WARMUP" --bench_steps "$STEPS" $CONFIG > "$log" 2>&1 || fail "$log" "goddp bucket_cap_mb=$cap"
    m=$(grep '^\[rank0\]' "$log" | msstep)
  fi
  [ -n "$m" ] || fail "$log" "goddp bucket_cap_mb=$cap"
  # the bucket sizes in MB rank 0 ran after its last rebuild (sweep-report's Note [Same layout])
  lay=$(sed -n 's/.*\[rank0\]: ddp: .* rebuilt \[\([0-9. ]*\)\]MB.*/\1/p' "$log" | tail -1)
  # rank 0's own CPU time per timed step (cpu.csv, cmd/ddpsim -collective_cpu_csv)
  cpu=$(sed -n 's/.*\[rank0\]: process CPU: \([0-9.]*\) ms per timed step.*/\1/p' "$log" | tail -1)
}

# cpu_row KIND CAP REP: the last goddp_point's CPU per step and bucket count, to cpu.csv.
cpu_row() {
  [ -n "$cpu" ] && [ -n "$lay" ] && echo "goddp,$1,$2,$3,$(wc -w <<< "$lay"),$cpu" >> "$OUT/cpu.csv"
  return 0
}

# compute_point REP: compute only, two --no_ddp processes at once (the step time is the slower
# one), and PyTorch's.
compute_point() {
  local rep=$1 a b ma mb log m
  echo "# repeat $rep: goddp compute-only" >&2
  a="$OUT/logs/goddp_compute_r${rep}_a.log"; b="$OUT/logs/goddp_compute_r${rep}_b.log"
  OPENBLAS_NUM_THREADS=1 ./bin/transformer --no_ddp --warmup_steps "$WARMUP" --bench_steps "$STEPS" $CONFIG > "$a" 2>&1 &
  pid=$!
  OPENBLAS_NUM_THREADS=1 ./bin/transformer --no_ddp --warmup_steps "$WARMUP" --bench_steps "$STEPS" $CONFIG > "$b" 2>&1 || fail "$b" "goddp compute-only"
  wait "$pid" || fail "$a" "goddp compute-only"
  ma=$(msstep < "$a"); mb=$(msstep < "$b")
  [ -n "$ma" ] || fail "$a" "goddp compute-only"
  [ -n "$mb" ] || fail "$b" "goddp compute-only"
  echo "goddp,compute,,$rep,$(printf '%s\n%s\n' "$ma" "$mb" | sort -g | tail -1)," >> "$raw"
  if [ "$TORCH" = 1 ]; then
    echo "# repeat $rep: torch compute-only" >&2
    log="$OUT/logs/torch_compute_r${rep}.log"
    /usr/bin/python3 "$TORCH_DIR/ddp_bench.py" --no_ddp --nproc 2 --warmup "$WARMUP" --steps "$STEPS" $torch_config > "$log" 2>&1 \
      || fail "$log" "torch compute-only"
    m=$(torchms "$log") || fail "$log" "torch compute-only"
    echo "torch,compute,,$rep,$m," >> "$raw"
  fi
}

# cap_point CAP REP: goddp with --bucket_cap_mb CAP, then PyTorch DDP with the same cap.
cap_point() {
  local cap=$1 rep=$2 log
  echo "# repeat $rep: goddp bucket_cap_mb=$cap" >&2
  log="$OUT/logs/goddp_cap${cap}_r${rep}.log"
  goddp_point "$cap" "$log"
  echo "goddp,ddp,$cap,$rep,$m,$lay" >> "$raw"
  cpu_row ddp "$cap" "$rep"
  if [ "$TORCH" = 1 ]; then
    echo "# repeat $rep: torch bucket_cap_mb=$cap" >&2
    log="$OUT/logs/torch_cap${cap}_r${rep}.log"
    if [ -n "$TESTBED_RATE" ]; then
      ./bin/testbed --hosts 2 --rate "$TESTBED_RATE" -- \
        "RANK=\$TESTBED_HOST WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=\$TESTBED_MASTER MASTER_PORT=29500 GLOO_SOCKET_IFNAME=eth0 \
         /usr/bin/python3 $TORCH_DIR/ddp_bench.py --bucket_cap_mb $cap --warmup $WARMUP --steps $STEPS $torch_config" \
        > "$log.all" 2>&1 || fail "$log.all" "torch bucket_cap_mb=$cap on the testbed"
      sed -n 's/^\[host0\] //p' "$log.all" > "$log"
    else
      /usr/bin/python3 "$TORCH_DIR/ddp_bench.py" --world_size 2 --bucket_cap_mb "$cap" --warmup "$WARMUP" --steps "$STEPS" $torch_config \
        > "$log" 2>&1 || fail "$log" "torch bucket_cap_mb=$cap"
    fi
    m=$(torchms "$log") || fail "$log" "torch bucket_cap_mb=$cap"
    echo "torch,ddp,$cap,$rep,$m," >> "$raw"
  fi
}

# auto_point REP: goddp choosing its own layout; its measurements go to auto_profile_rN.json
# (cmd/ddpsim -profile).
auto_point() {
  echo "# repeat $1: goddp bucket_cap_mb=auto" >&2
  goddp_point "auto --auto_profile $OUT/logs/auto_profile_r$1.json" "$OUT/logs/goddp_auto_r$1.log"
  echo "goddp,auto,,$1,$m,$lay" >> "$raw"
  cpu_row auto "" "$1"
}

# onebucket_point REP: goddp with one bucket, traced and not timed: no collective runs during
# its backward passes, so its trace gives the steady compute timeline (cmd/ddpsim -trace),
# where auto's profile has its second step's.
onebucket_point() {
  echo "# repeat $1: goddp with one bucket, traced" >&2
  # 100000 MB: above any model's size
  goddp_point "100000 --first_bucket_cap_mb 100000" "$OUT/logs/goddp_onebucket_r$1.log" \
    --trace_merge "$OUT/logs/onebucket_r$1_trace.json"
}

# overlap_point REP: goddp with every bucket OVERLAP_MB, traced and not timed: its
# collectives run during backward, and its trace against the one-bucket launches' gives the
# slowdowns under overlap (cmd/ddpsim -overlap_trace, Note [Overlap from traces]).
overlap_point() {
  echo "# repeat $1: goddp with every bucket $OVERLAP_MB MB, traced" >&2
  goddp_point "$OVERLAP_MB --first_bucket_cap_mb $OVERLAP_MB" "$OUT/logs/goddp_overlap_r$1.log" \
    --trace_merge "$OUT/logs/overlap_r$1_trace.json"
}

# perf_point: allreduce-perf from 64K to PERF_MAX, placed as the ranks are; its JSON rows go
# to logs/allreduce.jsonl (cmd/ddpsim -allreduce).
perf_point() {
  local log="$OUT/logs/allreduce.log"
  local perf="./bin/allreduce-perf -b 64K -e $PERF_MAX -f 2 -n 20 -w 5 -c 0 --shared --json"
  echo "# allreduce-perf, 64K to $PERF_MAX" >&2
  if [ -n "$TESTBED_RATE" ]; then
    ddprun_testbed "$log" allreduce-perf "$perf"
  else
    # shellcheck disable=SC2086 # $perf is a command line
    ./bin/ddprun --nproc_per_node 2 $perf > "$log" 2>&1 || fail "$log" "allreduce-perf"
  fi
  sed -n 's/^\(\[host0\] \)\{0,1\}\[rank0\]: \({.*}\)$/\2/p' "$log" > "$OUT/logs/allreduce.jsonl"
  [ -s "$OUT/logs/allreduce.jsonl" ] || fail "$log" "allreduce-perf"
}

# Note [Quiet machine]: the machine is shared, and another tenant's load comes in spells of
# tens of seconds that slow every launch in them alike. With QUIET=1, before each launch the
# sweep times a probe (both cores clearing 512 MiB each, as dd does from /dev/zero) and,
# while it is more than QUIET_TOL slower than the median of the sweep's probes so far,
# waits and probes again, for at most QUIET_WAIT seconds; then it launches anyway. No
# launch is dropped or repeated. Every probe, and one after each launch, goes to
# logs/probe.csv (the launch before it, or after it), so that a spell that began during a
# launch can be seen there. Each probe first runs half of it untimed: an unwarmed probe
# after idle measures the gate's own sleep. The gate takes the median, not the fastest
# probe, which on a VM can be an outlier that keeps the gate waiting for nothing
# (docs/results/2026-12-04-step-model-sweeps.md); a spell still shows against the median as
# long as most of the sweep is quiet.
probe_ms() {
  local s
  dd if=/dev/zero of=/dev/null bs=64M count=4 2>/dev/null &
  dd if=/dev/zero of=/dev/null bs=64M count=4 2>/dev/null
  wait
  s=$(date +%s%N)
  dd if=/dev/zero of=/dev/null bs=64M count=8 2>/dev/null &
  dd if=/dev/zero of=/dev/null bs=64M count=8 2>/dev/null
  wait
  echo $((($(date +%s%N) - s) / 1000000))
}
# probe_median: the median of the sweep's probes so far, all of them in logs/probe.csv (Note
# [Quiet machine]).
probe_median() {
  tail -n +2 "$OUT/logs/probe.csv" | cut -d, -f5 | sort -n | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
# quiet_gate REP ITEM: Note [Quiet machine], before ITEM of repeat REP.
quiet_gate() {
  [ "$QUIET" = 1 ] || return 0
  local t base waited=0
  while :; do
    t=$(probe_ms)
    echo "$(date +%s),$1,$2,before,$t,$waited" >> "$OUT/logs/probe.csv"
    base=$(probe_median)
    if awk -v t="$t" -v b="$base" -v tol="$QUIET_TOL" 'BEGIN { exit !(t <= b * (1 + tol)) }' || [ "$waited" -ge "$QUIET_WAIT" ]; then
      return 0
    fi
    sleep 3
    waited=$((waited + 3))
  done
}
# probe_after REP ITEM: one probe after ITEM's launch, logged (Note [Quiet machine]).
probe_after() {
  [ "$QUIET" = 1 ] || return 0
  echo "$(date +%s),$1,$2,after,$(probe_ms),0" >> "$OUT/logs/probe.csv"
}
if [ "$QUIET" = 1 ]; then echo "unix_s,repeat,item,when,probe_ms,waited_s" > "$OUT/logs/probe.csv"; fi

# Each repeat runs every point once, in an order shuffled from SEED and the repeat (ORDER=fixed:
# compute, the caps, auto, one bucket), so that no point always follows the same one or
# runs at the same place in the repeat while the machine's speed drifts.
items="compute"
for cap in $CAPS; do items="$items cap:$cap"; done
[ "$AUTO" = 1 ] && items="$items auto"
[ "$ONEBUCKET" = 1 ] && items="$items onebucket overlap"
: > "$OUT/logs/order.txt"
if [ "$ONEBUCKET" = 1 ] && [ "$AUTO" = 1 ]; then
  quiet_gate 0 allreduce-perf
  perf_point
  probe_after 0 allreduce-perf
fi
for rep in $(seq 1 "$REPEATS"); do
  order=$items
  if [ "$ORDER" != fixed ]; then
    order=$(printf '%s\n' $items | awk -v seed=$((SEED * 1000 + rep)) 'BEGIN { srand(seed) } { print rand() "\t" $0 }' | sort -g | cut -f2 | tr '\n' ' ')
  fi
  echo "repeat $rep: $order" >> "$OUT/logs/order.txt"
  for item in $order; do
    quiet_gate "$rep" "$item"
    case $item in
      compute) compute_point "$rep" ;;
      cap:*) cap_point "${item#cap:}" "$rep" ;;
      auto) auto_point "$rep" ;;
      onebucket) onebucket_point "$rep" ;;
      overlap) overlap_point "$rep" ;;
    esac
    probe_after "$rep" "$item"
  done
done
./bin/sweep-report -in "$raw" -out "$OUT"
if [ "$AUTO" = 1 ]; then
  # The step model (cmd/ddpsim) against the sweep: from auto's profiles, as the auto sizing
  # saw its first steps, and with the compute timeline of the one-bucket launches' steady
  # passes (after the warm-up) in their place.
  profiles=$(ls "$OUT"/logs/auto_profile_r*.json | paste -sd,)
  # sweep-report writes layouts.csv only where two caps ran one layout.
  measured=(-measured "$OUT/summary.csv")
  [ -f "$OUT/layouts.csv" ] && measured+=(-layouts "$OUT/layouts.csv")
  # model TITLE [DDPSIM_FLAGS...]: one table of sim.md, the model against the sweep.
  model() {
    echo "## $1"
    echo
    shift
    ./bin/ddpsim -profile "$profiles" "${measured[@]}" "$@"
  }
  {
    model "The step model from auto's profiles ($REPEATS, combined by the median)"
    if [ "$ONEBUCKET" = 1 ]; then
      traced=(-trace_from $((WARMUP + 1)) -trace "$(ls "$OUT"/logs/onebucket_r*_trace.json | paste -sd,)")
      echo
      model "The same, with the compute timeline of the one-bucket launches (their passes after the warm-up, each from the rank that paced it)" "${traced[@]}"
      traced+=(-allreduce "$OUT/logs/allreduce.jsonl")
      echo
      model "The same, with allreduce-perf's all-reduce curve (logs/allreduce.jsonl)" "${traced[@]}"
      traced+=(-overlap_trace "$(ls "$OUT"/logs/overlap_r*_trace.json | paste -sd,)")
      echo
      model "The same, with the slowdowns under overlap of the traced launches with every bucket $OVERLAP_MB MB against the one-bucket launches (Note [Overlap from traces] in cmd/ddpsim)" "${traced[@]}"
      echo
      # a sweep of one layout, or a system that reports no CPU time, gives nothing to fit
      model "The same, with each collective's own CPU time from the sweep's launches (cpu.csv; Note [A collective's CPU] in package bucket/sim)" "${traced[@]}" -collective_cpu_csv "$OUT/cpu.csv" ||
        echo "(no CPU per collective to fit from cpu.csv: ddpsim's error is in the sweep's output)"
    fi
  } > "$OUT/sim.md" || { echo "sweep: ddpsim failed" >&2; exit 1; }
  cat "$OUT/sim.md"
fi
if [ -n "$TESTBED_RATE" ] && [ "$LINK" = 1 ]; then
  # One more goddp launch per cap, traced and not timed: the merged trace of both hosts gives
  # each bucket's time on the wire from the later rank's start (sweep-report -trace), which
  # rank 0's own in-flight time would overstate by the ranks' skew.
  echo "link use while goddp's buckets are on the wire ($TESTBED_RATE), from merged traces:" | tee "$OUT/link.txt"
  for cap in $CAPS; do
    log="$OUT/logs/goddp_cap${cap}_traced.log"
    trace="$OUT/logs/goddp_cap${cap}_trace.json"
    goddp_testbed "$cap" "$log" --trace_merge "$trace"
    echo "  bucket_cap_mb=$cap  $(./bin/sweep-report -trace "$trace" -rate "$TESTBED_RATE" -from_step "$WARMUP")" | tee -a "$OUT/link.txt"
  done
fi
