GO ?= go
PKGS := ./...

.PHONY: build test bench proto vet fmt

build:
	$(GO) build -o bin/ ./cmd/...

test: vet
	$(GO) test -race -count=1 -timeout 20m $(PKGS)

vet:
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt: files above need formatting"; exit 1; }
	$(GO) vet $(PKGS)

bench:
	$(GO) test -run '^$$' -bench . -benchmem $(PKGS)

proto:
	./scripts/genproto.sh
