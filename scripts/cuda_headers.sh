#!/usr/bin/env bash
# cuda_headers.sh: fetch cuda.h and the libcuda.so link stub from Debian's non-free
# nvidia-cuda-dev .deb into .cache/cuda (without installing its 2.7 GB), so that the
# `cuda` build tag of backends/nccl (gorgonia.org/cu interop) builds and vets:
#
#   scripts/cuda_headers.sh
#   CGO_CFLAGS=-I$PWD/.cache/cuda/include CGO_LDFLAGS=-L$PWD/.cache/cuda/lib \
#     go vet -tags cuda ./backends/nccl/
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/.cache/cuda}
if [[ -e $out/include/cuda.h && -e $out/lib/libcuda.so ]]; then
	echo "$out: already there"
	exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A private apt configuration with contrib and non-free added (the system's is untouched).
. /etc/os-release
mkdir -p "$work/apt/lists/partial" "$work/apt/archives/partial"
echo "deb http://deb.debian.org/debian ${VERSION_CODENAME:-bookworm} main contrib non-free non-free-firmware" >"$work/sources.list"
aptopts=(-o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
	-o Dir::State::Lists="$work/apt/lists" -o Dir::Cache::Archives="$work/apt/archives" -o Debug::NoLocking=1)
apt-get "${aptopts[@]}" update -qq
(cd "$work" && apt-get "${aptopts[@]}" download nvidia-cuda-dev libcuda1 2>&1 | tail -2) || true
deb=$(ls "$work"/nvidia-cuda-dev_*.deb 2>/dev/null | head -1)
[[ -n $deb ]] || { echo "cuda_headers: could not download nvidia-cuda-dev" >&2; exit 1; }
mkdir -p "$work/x" "$out/include" "$out/lib"
dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$work/x" --wildcards '*/cuda.h' '*/cudaTypedefs.h' '*/cuda_stdint.h' '*stubs/libcuda.so' 2>/dev/null || true
find "$work/x" -name cuda.h -path '*include*' -exec cp {} "$out/include/" \;
find "$work/x" -name cuda_stdint.h -exec cp {} "$out/include/" \; 2>/dev/null || true
stub=$(find "$work/x" -name libcuda.so | head -1)
if [[ -z $stub ]]; then
	# No stub in this package version: make one from the headers' symbol list is not
	# possible; use libcuda1's real library if it was downloaded.
	d1=$(ls "$work"/libcuda1_*.deb 2>/dev/null | head -1)
	[[ -n $d1 ]] && dpkg-deb --fsys-tarfile "$d1" | tar -x -C "$work/x" --wildcards '*libcuda.so.*' 2>/dev/null || true
	stub=$(find "$work/x" -name 'libcuda.so.*' -type f | head -1)
fi
[[ -e $out/include/cuda.h && -n $stub ]] || { echo "cuda_headers: cuda.h or libcuda.so not found in the package" >&2; exit 1; }
cp "$stub" "$out/lib/libcuda.so"
echo "extracted into $out: include/cuda.h lib/libcuda.so"
