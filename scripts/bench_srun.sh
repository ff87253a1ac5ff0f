#!/usr/bin/env bash
# bench_srun.sh: ms/step of the 2-rank transformer at the seed shape (its defaults) under
# srun -N1 -n2 and under ddprun --nproc_per_node 2, interleaved (the order alternating),
# REPEAT times each. Needs the
# local SLURM cluster (scripts/slurm.sh up, as root); run it under flock /tmp/bench.lock on a
# shared machine.
#
#   scripts/bench_srun.sh                    # 4 pairs, --bench_steps 30
#   REPEAT=5 ARGS="--bench_steps 50" scripts/bench_srun.sh
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
REPEAT=${REPEAT:-4}
ARGS=${ARGS:---bench_steps 30}
BIN=${BIN:-out/bench_srun}
mkdir -p "$BIN"
"$GO" build -o "$BIN/" ./cmd/ddprun ./examples/transformer
# A cluster that is up already is used and left up; one started here is taken down.
if ! scripts/slurm.sh status >/dev/null 2>&1; then
  trap 'scripts/slurm.sh down >/dev/null' EXIT
fi
eval "$(scripts/slurm.sh up | grep '^export SLURM_CONF=')"
GODDP_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
export GODDP_TOKEN
bin=$(cd "$BIN" && pwd)
msstep() { sed -n 's/.*ms\/step=\([0-9.]*\).*/\1/p' | head -1; }
echo "launcher run ms/step"
ddprun_run() {
  # shellcheck disable=SC2086
  echo "ddprun $1 $("$bin/ddprun" --standalone --nproc_per_node 2 "$bin/transformer" -- $ARGS 2>&1 | msstep)"
}
srun_run() {
  # shellcheck disable=SC2086
  echo "srun $1 $(srun -N1 -n2 -l "$bin/transformer" $ARGS 2>&1 | msstep)"
}
# The order alternates: ddprun first in odd pairs, srun first in even ones.
for i in $(seq 1 "$REPEAT"); do
  if ((i % 2)); then ddprun_run "$i"; srun_run "$i"; else srun_run "$i"; ddprun_run "$i"; fi
done
