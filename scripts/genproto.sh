#!/usr/bin/env bash
# Regenerates the Go code of procgroup/storepb from store.proto.
#
# Needs protoc (Debian: apt-get install protobuf-compiler). The Go plugins are installed at
# pinned versions into .cache/protoc-bin inside the repository (git-ignored), so the output
# does not depend on what happens to be on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

PROTOC_GEN_GO_VERSION=v1.36.12      # matches google.golang.org/protobuf in go.mod
PROTOC_GEN_GO_GRPC_VERSION=v1.6.1

command -v protoc >/dev/null || { echo "genproto: protoc not found (apt-get install protobuf-compiler)" >&2; exit 1; }

bin="$PWD/.cache/protoc-bin"
mkdir -p "$bin"
GOBIN="$bin" go install "google.golang.org/protobuf/cmd/protoc-gen-go@${PROTOC_GEN_GO_VERSION}"
GOBIN="$bin" go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@${PROTOC_GEN_GO_GRPC_VERSION}"

PATH="$bin:$PATH" protoc \
	--proto_path=procgroup/storepb \
	--go_out=procgroup/storepb --go_opt=paths=source_relative \
	--go-grpc_out=procgroup/storepb --go-grpc_opt=paths=source_relative \
	procgroup/storepb/store.proto
echo "genproto: regenerated procgroup/storepb"
