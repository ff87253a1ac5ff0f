#!/bin/bash
# ZeRO with and without --zero_overlap against plain DDP, the transformer at L=4 h=512 on 2
# ranks: ROUNDS rounds, each running --zero 0, 1, 1 --zero_overlap, 2 and 2 --zero_overlap
# once, in turn. RATE=host runs NPROC ranks (default 2) on this host; a tc rate (1gbit) runs
# NPROC ranks (default 1) on each of two testbed hosts (cmd/testbed: network namespaces on
# this machine; needs root). Run it under flock /tmp/bench.lock on a shared machine.
#
#   make build   # or: go build -o bin/ ./cmd/ddprun ./examples/transformer ./cmd/testbed
#   RATE=host ROUNDS=3 scripts/zero_overlap.sh
#   RATE=1gbit ROUNDS=3 scripts/zero_overlap.sh
#   RATE=host NPROC=4 ROUNDS=2 scripts/zero_overlap.sh    # n = 4 on one host
#   RATE=1gbit NPROC=2 ROUNDS=2 scripts/zero_overlap.sh   # n = 4 on two hosts
#
# Out: one "=== round R --zero CFG load L" line per launch, then its ms/step and
# params_crc32 lines.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-host}
ROUNDS=${ROUNDS:-3}
EXTRA=${EXTRA:-}
if [ "$RATE" = host ]; then NPROC=${NPROC:-2}; else NPROC=${NPROC:-1}; fi
export GODDP_TOKEN=${GODDP_TOKEN:-$(openssl rand -hex 32)}
for round in $(seq "$ROUNDS"); do
  for cfg in "0" "1" "1 --zero_overlap" "2" "2 --zero_overlap"; do
    echo "=== round $round --zero $cfg load $(cut -d' ' -f1 /proc/loadavg)"
    if [ "$RATE" = host ]; then
      ./bin/ddprun --nproc_per_node "$NPROC" ./bin/transformer -- --num_layers 4 --hidden_size 512 \
        --warmup_steps 3 --bench_steps 5 $EXTRA --zero $cfg
    else
      ./bin/testbed --hosts 2 --rate "$RATE" -- "bin/ddprun --nnodes 2 --node_rank \$TESTBED_HOST \
        --nproc_per_node $NPROC --master_addr \$TESTBED_MASTER --master_port 29500 bin/transformer -- \
        --num_layers 4 --hidden_size 512 --warmup_steps 2 --bench_steps 8 --log_every 0 $EXTRA --zero $cfg"
    fi 2>&1 | grep -E "ms/step=|params_crc32|optimizer_state_bytes"
  done
done
