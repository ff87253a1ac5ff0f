#!/bin/bash
# ZeRO with and without --zero_overlap or --zero_forward_overlap against plain DDP, the
# transformer at L=4 h=512 on 2 ranks: ROUNDS rounds, each running every configuration of
# CFGS ("|" between them; default --zero 0, then stages 1 and 2 alone, with --zero_overlap and
# with --zero_forward_overlap) once, in turn. RATE=host runs NPROC ranks (default 2) on this host; a tc rate (1gbit) runs
# NPROC ranks (default 1) on each of two testbed hosts (cmd/testbed: network namespaces on
# this machine; needs root). Run it under flock /tmp/bench.lock on a shared machine.
#
#   make build   # or: go build -o bin/ ./cmd/ddprun ./examples/transformer ./cmd/testbed
#   RATE=host ROUNDS=3 scripts/zero_overlap.sh
#   RATE=1gbit ROUNDS=3 scripts/zero_overlap.sh
#   RATE=host NPROC=4 ROUNDS=2 scripts/zero_overlap.sh    # n = 4 on one host
#   RATE=1gbit NPROC=2 ROUNDS=2 scripts/zero_overlap.sh   # n = 4 on two hosts
#   CFGS="0|2 --zero_forward_overlap" EXTRA="--bucket_cap_mb 6" RATE=1gbit scripts/zero_overlap.sh
#
# CFGS may name the PyTorch peer, scripts/torch_zero.py ("torch adamw": DDP with AdamW;
# "torch zero": ZeroRedundancyOptimizer(AdamW)), under torchrun on the testbed. Give it
# the same BLAS set-up as for every comparison (the PyTorch peer's env.sh) before the run.
# (--redirects 1 --tee 1: Debian's torch 1.13 under Python 3.11 cannot parse their defaults.)
#   CFGS="0|2 --zero_forward_overlap|torch adamw|torch zero" RATE=1gbit scripts/zero_overlap.sh
#
# Out: one "=== round R --zero CFG load L" line per launch, then its ms/step and
# params_crc32 lines.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-host}
ROUNDS=${ROUNDS:-3}
EXTRA=${EXTRA:-}
CFGS=${CFGS:-0|1|1 --zero_overlap|1 --zero_forward_overlap|2|2 --zero_overlap|2 --zero_forward_overlap}
IFS='|' read -r -a cfgs <<< "$CFGS"
if [ "$RATE" = host ]; then NPROC=${NPROC:-2}; else NPROC=${NPROC:-1}; fi
export GODDP_TOKEN=${GODDP_TOKEN:-$(openssl rand -hex 32)}
for round in $(seq "$ROUNDS"); do
  for cfg in "${cfgs[@]}"; do
    if [[ $cfg == torch* ]]; then # the PyTorch peer: "torch adamw" or "torch zero"
      echo "=== round $round $cfg load $(cut -d' ' -f1 /proc/loadavg)"
      if [ "$RATE" = host ]; then
        OPENBLAS_NUM_THREADS=1 /usr/bin/python3 scripts/torch_zero.py --world_size "$NPROC" \
          --num_layers 4 --hidden 512 --warmup 3 --steps 5 --optim "${cfg#torch }"
      else
        ./bin/testbed --hosts 2 --rate "$RATE" -- "GLOO_SOCKET_IFNAME=eth0 OPENBLAS_NUM_THREADS=1 \
          torchrun --redirects 1 --tee 1 --nnodes 2 --node_rank \$TESTBED_HOST --nproc_per_node $NPROC \
          --master_addr \$TESTBED_MASTER --master_port 29500 scripts/torch_zero.py \
          --num_layers 4 --hidden 512 --warmup 2 --steps 8 --optim ${cfg#torch }"
      fi 2>&1 | grep -E "ms/step"
      continue
    fi
    echo "=== round $round --zero $cfg load $(cut -d' ' -f1 /proc/loadavg)"
    if [ "$RATE" = host ]; then
      ./bin/ddprun --nproc_per_node "$NPROC" ./bin/transformer -- --num_layers 4 --hidden_size 512 \
        --warmup_steps 3 --bench_steps 5 $EXTRA --zero $cfg
    else
      # GLOO_SOCKET_IFNAME=lo (the peer's env.sh) would keep goddp off the testbed's links.
      env -u GLOO_SOCKET_IFNAME ./bin/testbed --hosts 2 --rate "$RATE" -- "bin/ddprun --nnodes 2 --node_rank \$TESTBED_HOST \
        --nproc_per_node $NPROC --master_addr \$TESTBED_MASTER --master_port 29500 bin/transformer -- \
        --num_layers 4 --hidden_size 512 --warmup_steps 2 --bench_steps 8 --log_every 0 $EXTRA --zero $cfg"
    fi 2>&1 | grep -E "ms/step=|params_crc32|optimizer_state_bytes|peak_rss_mb"
  done
done
