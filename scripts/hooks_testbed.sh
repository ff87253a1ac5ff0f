#!/bin/bash
# Communication hooks side by side over a two-host testbed link (cmd/testbed: network
# namespaces on this machine, one rank per host, each link shaped to the rate): goddp's
# --comm_hook none, bf16, fp16, powersgd at ranks 1, 2 and 4, and auto, and PyTorch DDP's
# none, fp16 and powersgd at the same ranks (its bf16 hook does not run on gloo), with each
# system's compute alone (--no_ddp, two processes at once) measured in the same repeat.
# Every repeat runs every point of a rate and shape once, in turn. Needs root and the
# PyTorch peer (TORCH_DIR, whose env.sh is sourced).
#
#   RATES="1gbit 10gbit" SHAPES="4x512 2x256" REPEATS=3 scripts/hooks_testbed.sh
#   RATES=host SHAPES=4x512 scripts/hooks_testbed.sh      # 2 ranks on this host, no testbed
#   GODDP_HOOKS="none auto" TORCH_HOOKS= RATES=host ...      # some hooks only
#
# Out: $OUT/raw.csv (rate,shape,system,hook,repeat,ms_step), $OUT/table.md (the medians,
# exposed = ms/step less the system's compute alone, and the bytes each hook puts on the
# wire per step and rank, from auto's profile: cmd/ddpsim -hooks for goddp, and for PyTorch
# the same shapes with its PowerSGD's P and Q both sent every step), and the logs.
set -euo pipefail
cd "$(dirname "$0")/.."
RATES=${RATES:-1gbit 10gbit}
SHAPES=${SHAPES:-4x512 2x256} # LAYERSxHIDDEN
REPEATS=${REPEATS:-3}
WARMUP=${WARMUP:-4} # auto decides after 3 synced steps: the timed steps run its choice
STEPS=${STEPS:-5}
START=${START:-2} # PowerSGD's first compressed step, both systems (PyTorch's start_powerSGD_iter)
TORCH_DIR=${TORCH_DIR:-../shared/bench/torch}
OUT=${OUT:-out/hooks_$(date +%Y%m%d_%H%M%S)}
GO=${GO:-go}
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd) # the ranks write auto's profile there from the testbed's hosts
"$GO" build -o bin/testbed ./cmd/testbed
"$GO" build -o bin/ddprun ./cmd/ddprun
"$GO" build -o bin/transformer ./examples/transformer
"$GO" build -o bin/ddpsim ./cmd/ddpsim
# shellcheck disable=SC1091
source "$TORCH_DIR/env.sh"
GODDP_TOKEN=${GODDP_TOKEN:-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}
export GODDP_TOKEN # the two hosts' ddprun authenticate with it
raw="$OUT/raw.csv"
echo "rate,shape,system,hook,repeat,ms_step" > "$raw"
echo "rate,shape,system,hook,repeat,error" > "$OUT/failed.csv"
read -r -a goddp_hooks <<< "${GODDP_HOOKS:-none bf16 fp16 powersgd_r1 powersgd_r2 powersgd_r4 auto}"
read -r -a torch_hooks <<< "${TORCH_HOOKS-none fp16 powersgd_r1 powersgd_r2 powersgd_r4}" # empty: no PyTorch DDP points

fail() {
  echo "hooks_testbed: $2 failed or printed no ms/step; last lines of $1:" >&2
  tail -20 "$1" >&2
  exit 1
}
# torch_failed LOG RATE SHAPE HOOK REP: a PyTorch point that aborted (its PowerSGD hook can
# abort Gloo, pair.cc) is a result, not a fault of this script: it goes to failed.csv with the
# error's last line, and the sweep goes on.
torch_failed() {
  echo "hooks_testbed: torch $4 failed at $2 $3 repeat $5 (recorded in failed.csv); last lines of $1:" >&2
  tail -5 "$1" >&2
  echo "$2,$3,torch,$4,$5,\"$(grep -m1 -o 'enforce fail.*\|Error.*' "$1" | head -c 160 | tr '"' "'")\"" >> "$OUT/failed.csv"
}
msstep() { sed -n 's/.*bucket_cap_mb=[^ ]*  *ms\/step=\([0-9.]*\).*/\1/p' | tail -1; }
torchms() { sed -n 's/^JSON //p' "$1" | /usr/bin/python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["median"])'; }

# goddp_flags HOOK: the trainer's flags for HOOK.
goddp_flags() {
  case $1 in
    powersgd_r*) echo "--comm_hook powersgd --powersgd_rank ${1#powersgd_r} --powersgd_start_iter $START" ;;
    *) echo "--comm_hook $1" ;;
  esac
}
torch_flags() {
  case $1 in
    powersgd_r*) echo "--comm_hook powersgd --psgd_rank ${1#powersgd_r}" ;;
    none) echo "" ;;
    *) echo "--comm_hook $1" ;;
  esac
}

# point RATE SHAPE SYSTEM HOOK REP: one launch, its median ms/step to raw.csv.
point() {
  local rate=$1 shape=$2 sys=$3 hook=$4 rep=$5 log m extra=""
  local layers=${shape%x*} hidden=${shape#*x}
  log="$OUT/logs/${rate}_${shape}_${sys}_${hook}_r${rep}.log"
  echo "# $rate $shape repeat $rep: $sys $hook" >&2
  if [ "$sys" = goddp ]; then
    local cfg="--num_layers $layers --hidden_size $hidden --warmup_steps $WARMUP --bench_steps $STEPS $(goddp_flags "$hook")"
    [ "$hook" = auto ] && extra="--auto_profile $OUT/profile_${rate}_${shape}_r${rep}.json"
    if [ "$rate" = host ]; then
      # shellcheck disable=SC2086
      ./bin/ddprun --nproc_per_node 2 ./bin/transformer -- $cfg $extra > "$log" 2>&1 || fail "$log" "$sys $hook"
      m=$(grep '^\[rank0\]' "$log" | msstep)
    else
      env -u GLOO_SOCKET_IFNAME OPENBLAS_NUM_THREADS=1 ./bin/testbed --hosts 2 --rate "$rate" -- \
        "./bin/ddprun --nnodes 2 --node_rank \$TESTBED_HOST --nproc_per_node 1 --master_addr \$TESTBED_MASTER --master_port 29500 ./bin/transformer -- $cfg $extra" \
        > "$log" 2>&1 || fail "$log" "$sys $hook"
      m=$(sed -n 's/^\[host0\] \(\[rank0\].*\)/\1/p' "$log" | msstep)
    fi
  else
    local cfg="--num_layers $layers --hidden $hidden --warmup $WARMUP --steps $STEPS $(torch_flags "$hook")"
    if [ "$rate" = host ]; then
      # shellcheck disable=SC2086
      if ! /usr/bin/python3 "$TORCH_DIR/ddp_bench.py" --world_size 2 $cfg > "$log" 2>&1; then
        torch_failed "$log" "$rate" "$shape" "$hook" "$rep"
        return 0
      fi
    else
      if ! ./bin/testbed --hosts 2 --rate "$rate" -- \
        "RANK=\$TESTBED_HOST WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=\$TESTBED_MASTER MASTER_PORT=29500 GLOO_SOCKET_IFNAME=eth0 \
         /usr/bin/python3 $TORCH_DIR/ddp_bench.py $cfg" > "$log.all" 2>&1; then
        torch_failed "$log.all" "$rate" "$shape" "$hook" "$rep"
        return 0
      fi
      sed -n 's/^\[host0\] //p' "$log.all" > "$log"
    fi
    m=$(torchms "$log") || fail "$log" "$sys $hook"
  fi
  [ -n "$m" ] || fail "$log" "$sys $hook"
  echo "$rate,$shape,$sys,$hook,$rep,$m" >> "$raw"
}

# compute RATE SHAPE REP: both systems' compute alone, two processes at once.
compute() {
  local rate=$1 shape=$2 rep=$3 a b ma mb pid log m
  local layers=${shape%x*} hidden=${shape#*x}
  echo "# $rate $shape repeat $rep: compute alone" >&2
  a="$OUT/logs/${rate}_${shape}_goddp_compute_r${rep}_a.log"
  b="$OUT/logs/${rate}_${shape}_goddp_compute_r${rep}_b.log"
  local cfg="--num_layers $layers --hidden_size $hidden --warmup_steps $WARMUP --bench_steps $STEPS"
  # shellcheck disable=SC2086
  OPENBLAS_NUM_THREADS=1 ./bin/transformer --no_ddp $cfg > "$a" 2>&1 &
  pid=$!
  # shellcheck disable=SC2086
  OPENBLAS_NUM_THREADS=1 ./bin/transformer --no_ddp $cfg > "$b" 2>&1 || fail "$b" "goddp compute"
  wait "$pid" || fail "$a" "goddp compute"
  ma=$(msstep < "$a")
  mb=$(msstep < "$b")
  [ -n "$ma" ] && [ -n "$mb" ] || fail "$a" "goddp compute"
  echo "$rate,$shape,goddp,compute,$rep,$(printf '%s\n%s\n' "$ma" "$mb" | sort -g | tail -1)" >> "$raw"
  log="$OUT/logs/${rate}_${shape}_torch_compute_r${rep}.log"
  /usr/bin/python3 "$TORCH_DIR/ddp_bench.py" --no_ddp --nproc 2 --num_layers "$layers" --hidden "$hidden" --warmup "$WARMUP" --steps "$STEPS" \
    > "$log" 2>&1 || fail "$log" "torch compute"
  m=$(torchms "$log") || fail "$log" "torch compute"
  echo "$rate,$shape,torch,compute,$rep,$m" >> "$raw"
}

date -u
uptime
for rate in $RATES; do
  for shape in $SHAPES; do
    for rep in $(seq 1 "$REPEATS"); do
      compute "$rate" "$shape" "$rep"
      for k in $(seq 0 $((${#goddp_hooks[@]} - 1))); do
        point "$rate" "$shape" goddp "${goddp_hooks[$k]}" "$rep"
        if [ "$k" -lt "${#torch_hooks[@]}" ]; then
          point "$rate" "$shape" torch "${torch_hooks[$k]}" "$rep"
        fi
      done
    done
  done
done
date -u
uptime

# The table: medians over the repeats; the bytes from the first repeat's auto profile.
for p in "$OUT"/profile_*_r1.json; do
  [ -e "$p" ] || continue
  ./bin/ddpsim -profile "$p" -caps 25 -hooks > "${p%.json}.ddpsim.txt"
done
/usr/bin/python3 scripts/hooks_table.py "$OUT"
