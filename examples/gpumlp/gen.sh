#!/bin/sh
# gen.sh: regenerates kernels.ptx from kernels.ll (as backends/nccl/kernels/gen.sh).
set -e
cd "$(dirname "$0")"
llc -O2 -march=nvptx64 -mcpu=sm_70 -mattr=+ptx63 -nvptx-fma-level=0 -o kernels.ptx kernels.ll
