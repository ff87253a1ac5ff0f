#!/bin/sh
# gen.sh: regenerates kernels.ptx from kernels.ll with LLVM's llc (NVPTX backend; Debian's
# llvm package has it). sm_70, PTX ISA 6.3: JIT-compiled by any driver of the last years for
# Volta and later (the H200 is sm_90). FMA contraction off, so that results round as on
# the host.
set -e
cd "$(dirname "$0")"
llc -O2 -march=nvptx64 -mcpu=sm_70 -mattr=+ptx63 -nvptx-fma-level=0 -o kernels.ptx kernels.ll
