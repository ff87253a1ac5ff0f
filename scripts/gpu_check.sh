#!/usr/bin/env bash
# gpu_check.sh: the one-call GPU check of backends/nccl.
#
#   scripts/gpu_check.sh build [OUT]   on a machine with Go: builds into OUT (default
#                                      .cache/gpu_check) the backend's and the reducer's test
#                                      binaries, allreduce-perf, the GPU trainer examples/gpumlp,
#                                      scripts/gpu_torch.py and a copy of this script.
#   OUT/gpu_check.sh run [OUT]         on the GPU machine (CUDA driver, PyTorch with the
#                                      nvidia-nccl-cu13 wheel, no Go): finds libnccl.so.2 and
#                                      libcublas, runs the GPU tests at world size 1 (results,
#                                      stream/event ordering and its event timeline, cuBLAS GEMM
#                                      and the orthonormalisation kernel, the device
#                                      allreduce-perf table), PowerSGD on device buckets against
#                                      the host path, beside torch.distributed.all_reduce,
#                                      allreduce-perf, then gpumlp's ms/step beside PyTorch DDP
#                                      on NCCL with the same model.
#   scripts/gpu_check.sh selftest      build, compile the fake libcuda/libnccl/libcublas of the
#                                      tests, and run part 2 against them (no GPU needed; the
#                                      PyTorch lines are skipped without torch.cuda).
#
# One GPU can hold only one NCCL rank (NCCL refuses two ranks on one device), so the GPU run is
# at world size 1; multi-rank correctness is the fake-library conformance suite of `go test`.
# Environment: GODDP_NCCL_LIB / GODDP_CUDA_LIB / GODDP_CUBLAS_LIB override the libraries found;
# PYTHON (python3).
set -euo pipefail
mode=${1:-}
root=$(cd "$(dirname "$0")/.." 2>/dev/null && pwd)

build() {
	local out=$1
	mkdir -p "$out"
	cd "$root"
	go test -c -o "$out/nccl.test" ./backends/nccl/
	go test -c -o "$out/reducer.test" ./reducer/
	go build -o "$out/allreduce-perf" ./cmd/allreduce-perf
	go build -o "$out/gpumlp" ./examples/gpumlp
	cp "$root/scripts/gpu_check.sh" "$out/gpu_check.sh"
	cp "$root/scripts/gpu_torch.py" "$out/gpu_torch.py"
	echo "built into $out: nccl.test reducer.test allreduce-perf gpumlp gpu_torch.py gpu_check.sh"
	echo "copy $out to the GPU machine and run: ./gpu_check.sh run ."
}

find_nccl() {
	if [[ -n ${GODDP_NCCL_LIB:-} ]]; then
		echo "$GODDP_NCCL_LIB"
		return
	fi
	local py=${PYTHON:-python3} lib=""
	lib=$("$py" - <<'PY' 2>/dev/null || true
import os
try:
    import nvidia.nccl as m
except ImportError:
    raise SystemExit(0)
for d in list(getattr(m, "__path__", [])):
    p = os.path.join(d, "lib", "libnccl.so.2")
    if os.path.exists(p):
        print(p)
        break
PY
)
	if [[ -z $lib ]]; then
		local sp
		for sp in $("$py" -c 'import site,sys; print(" ".join(site.getsitepackages()+[site.getusersitepackages()]))' 2>/dev/null); do
			[[ -d $sp ]] || continue
			lib=$(find "$sp" -name 'libnccl.so.2' -path '*nvidia*' 2>/dev/null | head -1)
			[[ -n $lib ]] && break
		done
	fi
	if [[ -z $lib ]]; then
		lib=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')
	fi
	echo "$lib"
}

# find_cublas prints a colon-separated list of cuBLAS candidates: the pip wheel's (the one
# PyTorch uses), then the dynamic loader's.
find_cublas() {
	if [[ -n ${GODDP_CUBLAS_LIB:-} ]]; then
		echo "$GODDP_CUBLAS_LIB"
		return
	fi
	local py=${PYTHON:-python3} libs="" sp f
	for sp in $("$py" -c 'import site,sys; print(" ".join(site.getsitepackages()+[site.getusersitepackages()]))' 2>/dev/null); do
		[[ -d $sp ]] || continue
		for f in $(find "$sp" -name 'libcublas.so.*' -path '*nvidia*' 2>/dev/null | grep -v Lt | sort -r); do
			libs="$libs${libs:+:}$f"
		done
	done
	echo "${libs}${libs:+:}libcublas.so.13:libcublas.so.12:libcublas.so"
}

# torch_cuda reports whether PyTorch with CUDA is importable.
torch_cuda() {
	"${PYTHON:-python3}" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

run() {
	local dir=${1:-.}
	dir=$(cd "$dir" && pwd)
	local nccl
	nccl=$(find_nccl)
	if [[ -z $nccl || ! -e $nccl ]]; then
		echo "gpu_check: libnccl.so.2 not found (pip install nvidia-nccl-cu13, or set GODDP_NCCL_LIB)" >&2
		exit 1
	fi
	export GODDP_NCCL_LIB=$nccl GODDP_GPU=1
	echo "== libnccl.so.2: $nccl"
	if command -v ldd >/dev/null; then
		# The wheel's NCCL links the CUDA runtime statically and loads the driver itself; if
		# it needs a libcudart.so, ldd shows whether one is found.
		if ldd "$nccl" | grep -q cudart; then
			echo "== libnccl.so.2 needs libcudart: $(ldd "$nccl" | grep cudart)"
		else
			echo "== libnccl.so.2 does not need libcudart.so (CUDA runtime linked statically)"
		fi
	fi
	echo "== libcuda.so.1: ${GODDP_CUDA_LIB:-$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')}"
	command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
	local cublas
	cublas=$(find_cublas)
	echo "== backend tests at world size 1 (results, stream/event ordering, cuBLAS GEMM and orthonormalisation, device allreduce-perf table)"
	(cd "$dir" && GODDP_CUBLAS_LIB=$cublas timeout 300 ./nccl.test -test.v -test.count=1 \
		-test.run 'TestRegistered|TestLibraryMissing|TestDeviceAllReduce|TestStreamOrder|TestGPUStreamWaitTimeline|TestGPUGemm|TestGPUOrthonormalize|TestGPUPerfTable') |
		tee "$dir/nccl_test.log"
	echo "== PowerSGD on device buckets at world size 1, against the host path and a float64 reference"
	(cd "$dir" && GODDP_CUBLAS_LIB=$cublas timeout 300 ./reducer.test -test.v -test.count=1 -test.run 'TestPowerSGDDevice$') |
		tee "$dir/reducer_test.log" | grep -E '^(---|ok|FAIL|PASS)|largest difference'
	grep -q '^--- PASS: TestPowerSGDDevice ' "$dir/reducer_test.log"
	echo "== the comm stream waiting on the compute stream, from event timestamps (TestGPUStreamWaitTimeline)"
	grep 'timeline (ms' "$dir/nccl_test.log" | sed 's/^ *//'
	if torch_cuda; then
		echo "== torch.distributed.all_reduce on NCCL, device tensors (beside the table above)"
		timeout 180 "${PYTHON:-python3}" "$dir/gpu_torch.py" allreduce --max_bytes "${GODDP_GPU_PERF_MAX:-268435456}"
	else
		echo "== torch.distributed.all_reduce: skipped (no PyTorch with CUDA here)"
	fi
	echo "== allreduce-perf --backend nccl --nproc 1 (host buffers staged through pinned memory)"
	timeout 180 "$dir/allreduce-perf" --backend nccl --nproc 1 -b 4K -e 64M -f 4 -n 10 -w 3
	local mlp="--in 64 --hidden 256 --out 16 --batch 64 --steps 20 --bench_steps 50"
	echo "== GPU trainer examples/gpumlp at world size 1 (cuBLAS: first found of $cublas)"
	(cd "$dir" && RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=${GPU_CHECK_PORT:-29531} \
		GODDP_CUBLAS_LIB=$cublas timeout 180 ./gpumlp $mlp 2>/dev/null) | grep -E 'ms/step|final loss'
	if torch_cuda; then
		echo "== PyTorch DDP on NCCL, the same model at world size 1"
		timeout 180 "${PYTHON:-python3}" "$dir/gpu_torch.py" mlp $mlp
	else
		echo "== PyTorch DDP: skipped (no PyTorch with CUDA here)"
	fi
	echo "== gpu_check: all passed"
}

case $mode in
build) build "${2:-$root/.cache/gpu_check}" ;;
run) run "${2:-$(dirname "$0")}" ;;
selftest)
	out=${2:-$root/.cache/gpu_check}
	build "$out"
	fake="$out/fake"
	mkdir -p "$fake"
	(cd "$root" && go run ./internal/gpufake/cmd/buildfakes "$fake")
	GODDP_CUDA_LIB="$fake/libcuda.so.1" GODDP_NCCL_LIB="$fake/libnccl.so.2" GODDP_CUBLAS_LIB="$fake/libcublas.so" \
		GODDP_GPU_PERF_MAX=$((16 << 20)) run "$out"
	;;
*)
	sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
	exit 2
	;;
esac
