#!/usr/bin/env bash
# soak.sh: the fault soak (cmd/fault-soak): a 4-rank transformer job under ddprun
# --max_restarts with checkpoints, for DURATION (default 20m), with a fault every 30-90 s:
# kill -9 of a rank, SIGSTOP then SIGCONT of a rank, a stranger's bytes on every listening
# socket of the job and, as root with ip(8), a link down and up on a two-host testbed. It
# prints the tables (faults by kind, rounds and their params_crc32 against an uninterrupted
# run's, RSS and descriptors at the start and end) and exits 1 if the job failed to recover.
#
#   scripts/soak.sh                  # 20 minutes
#   scripts/soak.sh --duration 2m    # any fault-soak flag; STEPS sets the rounds' length
#   STEPS=3000 scripts/soak.sh --duration 2m --gap 10s-20s
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
STEPS=${STEPS:-20000}
BIN=${BIN:-out/soak/bin}
mkdir -p "$BIN"
"$GO" build -o "$BIN/" ./cmd/ddprun ./cmd/fault-soak ./examples/transformer
exec "$BIN/fault-soak" --ddprun "$BIN/ddprun" "$@" -- "$BIN/transformer" \
  --num_layers 1 --hidden_size 64 --seq_len 16 --global_batch_size 16 --micro_batch_size 4 \
  --warmup_steps 0 --bench_steps "$STEPS" --log_every 50 --checkpoint_every 100
