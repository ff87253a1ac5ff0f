#!/usr/bin/env bash
# gpu_check.sh: the one-call GPU check of backends/nccl (issue 5).
#
#   scripts/gpu_check.sh build [OUT]   on a machine with Go: builds into OUT (default
#                                      .cache/gpu_check) the backend's test binary, allreduce-perf
#                                      and a copy of this script.
#   OUT/gpu_check.sh run [OUT]         on the GPU machine (CUDA driver, PyTorch with the
#                                      nvidia-nccl-cu13 wheel, no Go): finds libnccl.so.2, runs the
#                                      GPU tests at world size 1 (results, stream/event ordering,
#                                      the device allreduce-perf table), then allreduce-perf.
#   scripts/gpu_check.sh selftest      build, compile the fake libcuda/libnccl of the tests, and
#                                      run part 2 against them (no GPU needed).
#
# One GPU can hold only one NCCL rank (NCCL refuses two ranks on one device), so the GPU run is
# at world size 1; multi-rank correctness is the fake-library conformance suite of `go test`.
# Environment: GODDP_NCCL_LIB / GODDP_CUDA_LIB override the libraries found; PYTHON (python3).
set -euo pipefail
mode=${1:-}
root=$(cd "$(dirname "$0")/.." 2>/dev/null && pwd)

build() {
	local out=$1
	mkdir -p "$out"
	cd "$root"
	go test -c -o "$out/nccl.test" ./backends/nccl/
	go build -o "$out/allreduce-perf" ./cmd/allreduce-perf
	cp "$root/scripts/gpu_check.sh" "$out/gpu_check.sh"
	echo "built into $out: nccl.test allreduce-perf gpu_check.sh"
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
	echo "== backend tests at world size 1 (results, stream/event ordering, device allreduce-perf table)"
	(cd "$dir" && timeout 300 ./nccl.test -test.v -test.count=1 \
		-test.run 'TestRegistered|TestLibraryMissing|TestDeviceAllReduce|TestStreamOrder|TestGPUPerfTable')
	echo "== allreduce-perf --backend nccl --nproc 1 (host buffers staged through pinned memory)"
	timeout 180 "$dir/allreduce-perf" --backend nccl --nproc 1 -b 4K -e 64M -f 4 -n 10 -w 3
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
	gcc -shared -fPIC -O1 -o "$fake/libcuda.so.1" -Wl,-soname,libcuda.so.1 "$root/backends/nccl/testdata/fake/fakecuda.c" -lpthread
	gcc -shared -fPIC -O1 -o "$fake/libnccl.so.2" -Wl,-soname,libnccl.so.2 "$root/backends/nccl/testdata/fake/fakenccl.c" \
		-L"$fake" -l:libcuda.so.1 -Wl,-rpath,"$fake" -lpthread -lm
	GODDP_CUDA_LIB="$fake/libcuda.so.1" GODDP_NCCL_LIB="$fake/libnccl.so.2" GODDP_GPU_PERF_MAX=$((16 << 20)) run "$out"
	;;
*)
	sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
	exit 2
	;;
esac
