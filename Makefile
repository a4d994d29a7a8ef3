# Rulebook developer tasks. `make help` lists the targets.

SHELL := bash
.DEFAULT_GOAL := help

# Local control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kwok) built from tests/cluster/*/go.mod; state in .cluster/.
CLUSTER := tests/cluster/cluster.sh

.PHONY: help
help: ## List the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | \
		awk -F ':.*## ' '{ printf "  %-16s %s\n", $$1, $$2 }'

.PHONY: cluster-build
cluster-build: ## Build the control plane binaries into the cache (no-op if present)
	$(CLUSTER) build

.PHONY: cluster
cluster: cluster-build ## Start the local cluster, or reuse a healthy running one
	$(CLUSTER) up

.PHONY: cluster-restart
cluster-restart: cluster-build ## Restart the local cluster from scratch
	$(CLUSTER) restart

.PHONY: cluster-down
cluster-down: ## Stop the local cluster and remove .cluster/
	$(CLUSTER) down

.PHONY: cluster-status
cluster-status: ## Exit 0 if the local cluster is up
	$(CLUSTER) status

# ---------------------------------------------------------------------------
# Rulebook itself.

CARGO_TEST := cargo test --locked --lib --bins --tests

.PHONY: lint
lint: ## cargo fmt --check and cargo clippy -D warnings
	cargo fmt --all -- --check
	cargo clippy --locked --all-targets -- -D warnings

.PHONY: unit
unit: ## Only the tests that need no cluster (rule checks, rendering, injection, snapshots)
	cargo test --locked --lib --test check_corpus --test injection --test hostile_templates \
		--test render_snapshots --test status_eval

.PHONY: test
test: lint cluster ## Everything: lint, then all tests against the local control plane (started or reused)
	@# a demo operator watches every namespace and would fight the tests' operators
	scripts/demo.sh down
	RULEBOOK_TEST_KUBECONFIG=$(KUBECONFIG_LOCAL) $(CARGO_TEST) --no-fail-fast

.PHONY: demo
demo: ## Local control plane + operator + example rules and parents; leaves them running
	scripts/demo.sh up

.PHONY: demo-down
demo-down: ## Stop the demo operator and the local control plane
	scripts/demo.sh down
	$(CLUSTER) down

# ---------------------------------------------------------------------------
# Benchmarks (docs/benchmarks.md): the render cost (criterion), then Rulebook, the
# hand-written reference controller and kro (when it builds) on the local control plane,
# and the API server's own limit. Results in target/bench/ (results.md, results.json,
# converge.svg). Sizes: BENCH_N, BENCH_SCALE_N, BENCH_STEADY_SECONDS, BENCH_CONCURRENCY,
# BENCH_API_CONCURRENCY, BENCH_CONTENDERS, BENCH_WORKLOADS (see docs/benchmarks.md).

.PHONY: bench
bench: cluster ## Benchmarks: render cost, then Rulebook vs a hand-written controller (and kro) → target/bench/
	@mkdir -p target/bench
	@if [[ ",$${BENCH_CONTENDERS:-kro}," == *,kro,* ]]; then \
		benches/kro/build.sh >target/bench/kro-build.log 2>&1 || \
			echo "bench: kro could not be built (see target/bench/kro-build.log); it is left out"; \
	fi
	cargo build --locked --release --bin rulebook --example bench-reference
	cargo bench --locked --bench render
	cargo bench --locked --bench e2e
