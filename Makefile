# atomicphase developer tasks. `make help` lists them.

GO          ?= go
BIN         := $(CURDIR)/bin
SQLC        := $(BIN)/sqlc
STATICCHECK := $(BIN)/staticcheck
SQLC_VERSION        := v1.31.1
STATICCHECK_VERSION := v0.8.2
FUZZTIME    ?= 10s

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets
	@awk 'BEGIN {FS = ":.*##"} /^[a-zA-Z_-]+:.*##/ {printf "  %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(SQLC):
	GOBIN=$(BIN) $(GO) install github.com/sqlc-dev/sqlc/cmd/sqlc@$(SQLC_VERSION)

$(STATICCHECK):
	GOBIN=$(BIN) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

.PHONY: tools
tools: $(SQLC) $(STATICCHECK) ## Install pinned sqlc and staticcheck into ./bin

.PHONY: generate
generate: $(SQLC) ## Regenerate internal/db from migrations/ and queries/
	$(SQLC) generate

.PHONY: verify
verify: $(SQLC) ## Fail if generated code is stale or go.mod is untidy
	$(SQLC) diff
	$(GO) mod tidy -diff

.PHONY: lint
lint: $(STATICCHECK) ## gofmt, go vet and staticcheck
	@out=$$(gofmt -l .); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(STATICCHECK) ./...

.PHONY: test
test: ## Run every test with the race detector (see README: Testing)
	$(GO) test -race -count=1 ./...

.PHONY: torture
torture: ## The long reliability run: crash matrix, faults, restarts, failovers and storms x20, fuzzing 2m each
	TORTURE_ITERATIONS=20 $(GO) test -race -count=1 -timeout 90m ./internal/torture
	$(GO) test -race -count=5 -timeout 30m -run 'Fifty|Unrelated|Ambiguous|Connections|Terminated' ./txn
	$(MAKE) fuzz FUZZTIME=2m

.PHONY: fuzz
fuzz: ## Run each fuzz target for FUZZTIME (default 10s)
	$(GO) test -run '^$$' -fuzz '^FuzzValidateKey$$' -fuzztime $(FUZZTIME) ./txn
	$(GO) test -run '^$$' -fuzz '^FuzzCanonicalJSON$$' -fuzztime $(FUZZTIME) ./txn
	$(GO) test -run '^$$' -fuzz '^FuzzCanonicalJSONMatchesReference$$' -fuzztime $(FUZZTIME) ./txn
	$(GO) test -run '^$$' -fuzz '^FuzzWriteStringMatchesReference$$' -fuzztime $(FUZZTIME) ./txn
	$(GO) test -run '^$$' -fuzz '^FuzzParseKey$$' -fuzztime $(FUZZTIME) ./httpidem
	$(GO) test -run '^$$' -fuzz '^FuzzValidate$$' -fuzztime $(FUZZTIME) ./outbox

.PHONY: bench
bench: ## Benchmarks side by side with a bare transaction, DBOS, River and Watermill (short, ~5 min)
	cd bench && $(GO) run ./cmd/benchtable
	cd bench && $(GO) test -run '^$$' -bench . -benchmem -count 3 .

.PHONY: bench-long
bench-long: ## The same, 30 s per cell and 1,000,000 keys for cleanup
	cd bench && $(GO) run ./cmd/benchtable -long

.PHONY: demo
demo: ## The main job: rocketrides under load, faults and SIGKILLs, with invariant checks
	$(GO) run ./examples/rocketrides/demo

.PHONY: quickstart
quickstart: ## The 30-second tour: one key, 23 requests, one execution; a resumed workflow
	$(GO) run ./examples/quickstart
