GO ?= go
PKGS := ./...
# The example trainer's matrix products run on its Go-assembly SGEMM (fastblas/sgemm) by
# default; TAGS=openblas builds it on OpenBLAS (Debian's libopenblas-dev) instead, the
# comparison point. That build is vetted and tested too where the library is present.
OPENBLAS := $(shell ls /usr/lib/x86_64-linux-gnu/libopenblas.so /usr/lib/*/libopenblas.so 2>/dev/null | head -1)
TAGS ?=

.PHONY: build test bench proto vet sweep run

build:
	$(GO) build -tags '$(TAGS)' -o bin/ ./cmd/... ./examples/...

test: vet
	$(GO) test -race -count=1 -timeout 30m $(PKGS)
	$(if $(OPENBLAS),$(GO) test -race -count=1 -tags openblas ./examples/... ./fastblas/...,@echo "libopenblas not found: skipping the openblas build's tests")

vet:
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt: files above need formatting"; exit 1; }
	@$(GO) mod tidy -diff || { echo "go.mod/go.sum are not tidy (the diff above): run go mod tidy"; exit 1; }
	$(GO) vet $(PKGS)
	$(if $(OPENBLAS),$(GO) vet -tags openblas ./examples/... ./fastblas/...,)

bench:
	$(GO) test -run '^$$' -bench . -benchmem $(PKGS)

proto:
	./scripts/genproto.sh

sweep:
	./scripts/sweep.sh

run:
	$(GO) build -o bin/ddprun ./cmd/ddprun
	GODDP_GO_TAGS='$(TAGS)' ./bin/ddprun --nproc_per_node 2 ./examples/transformer -- $(ARGS)
