# Rulebook developer tasks. `make help` lists the targets.

SHELL := bash
.DEFAULT_GOAL := help

# Local control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kwok) built from tests/cluster/*/go.mod; state in .cluster/.
# RULEBOOK_CLUSTER_DIR named here: one exported in the caller's shell must not move the
# cluster the targets below (and KUBECONFIG_LOCAL, scripts/demo.sh) mean.
CLUSTER := RULEBOOK_CLUSTER_DIR=$(CURDIR)/.cluster tests/cluster/cluster.sh
KUBECONFIG_LOCAL := $(CURDIR)/.cluster/kubeconfig

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
cluster-down: ## Stop the local cluster and remove .cluster/ (and make test's second one, .cluster-restarts/)
	-$(CLUSTER) down
	RULEBOOK_CLUSTER_DIR=$(CURDIR)/.cluster-restarts tests/cluster/cluster.sh down

.PHONY: cluster-status
cluster-status: ## Exit 0 if the local cluster is up
	$(CLUSTER) status

# ---------------------------------------------------------------------------
# Rulebook itself.

# The heavy fault tests (tests/faults_heavy.rs, every one #[ignore]d), one at a time.
HEAVY_TEST := cargo test --locked --test faults_heavy -- --ignored --test-threads=1 --nocapture

# Every target, benches and the benchmark's reference controller included, so that
# `make bench` cannot rot uncompiled.
.PHONY: lint
lint: tools ## cargo fmt --check, cargo clippy --all-targets -D warnings (benches and examples too), doc links, helm lint/template
	cargo fmt --all -- --check
	cargo clippy --locked --all-targets -- -D warnings
	python3 scripts/check-links.py
	scripts/core-tree.sh
	python3 scripts/import-cycles.py
	scripts/helm-check.sh

# helm (v4) and promtool, built from the Go module proxy through tests/tools/*/go.mod into
# a version-keyed cache (~/.cache/rulebook/tools/), like the control plane: a warm run
# builds nothing.
.PHONY: tools
tools: ## Build helm and promtool into the cache (no-op if present)
	tests/tools/tools.sh build

.PHONY: helm-lint
helm-lint: tools ## helm lint and helm template of deploy/helm/rulebook; its RBAC against deploy/
	scripts/helm-check.sh

.PHONY: alerts
alerts: tools ## promtool check rules and promtool test rules on deploy/prometheus/
	scripts/alerts-check.sh

# The built-in kinds' OpenAPI v3 schemas `rulebook check` and `test` use by default
# (docs/reference/schemas.md), saved from the local control plane's API server into
# openapi/v<major>.<minor>/ (src/cli/schemas/builtin.rs names the files it builds in).
.PHONY: openapi
openapi: cluster ## Save the built-in kinds' OpenAPI v3 schemas of the local API server into openapi/
	KUBECONFIG=$(KUBECONFIG_LOCAL) python3 scripts/openapi-save.py --kubectl $(CURDIR)/.cluster/bin/kubectl

.PHONY: rule-tests
rule-tests: ## rulebook test on the example rules' tests (tests/rules/)
	cargo run -q --locked --bin rulebook -- test --rules rules --templates templates tests/rules

.PHONY: unit
unit: ## Only the tests that need no cluster (rule checks, rendering, injection, snapshots)
	cargo test --locked --lib --test check_corpus --test injection --test hostile_templates \
		--test render_snapshots --test status_eval

# `make test` runs every test (scripts/test.sh): every test binary but the ones that
# restart the API server, several binaries at a time (TEST_JOBS, default 4; each test has
# its own namespace, kinds and operator), and beside them, on a second local control
# plane of their own (.cluster-restarts, scripts/test-restarts.sh), `api_restart` and the
# heavy fault tests that restart the API server or etcd, one at a time. Everything runs
# even when something failed; the target fails when anything did. Logs in
# $CARGO_TARGET_DIR/test-logs/ (or target/test-logs/).
# The control plane `make test` starts (or restarts: it is told apart by this setting)
# runs its Go components with GOGC=400: on 2 cores the API server spent 13–16 % of its CPU
# collecting garbage at Go's default of 100 (a CPU profile, 2026-11-29; issue 42). The
# demo and the benchmarks keep the default.
test: export CLUSTER_GOGC := 400
.PHONY: test
test: lint rule-tests alerts cluster ## Everything: lint, the alerts' unit tests, all tests against the local control plane (started or reused) and, beside them, the restart tests on a second one
	@# a demo operator watches every namespace and would fight the tests' operators
	scripts/demo.sh down
	RULEBOOK_TEST_KUBECONFIG=$(KUBECONFIG_LOCAL) scripts/test.sh

.PHONY: demo
demo: ## Local control plane + operator + example rules and parents; leaves them running
	scripts/demo.sh up

.PHONY: demo-foreign-tenant
demo-foreign-tenant: ## make demo with another operator's Tenant CRD (tenants.capsule.clastix.io) installed: names must be fully qualified
	scripts/demo-foreign-tenant.sh

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
	cargo bench --locked --bench cache_memory
	cargo bench --locked --bench e2e

# One replica against three sharded ones (issue 19): SHARD_BENCH_N (default 10000),
# SHARD_BENCH_PER_NAMESPACE, SHARD_BENCH_REPLICAS, SHARD_BENCH_REPEATS → target/bench/sharded.md.
.PHONY: bench-sharded
bench-sharded: cluster ## Benchmark: one replica vs three --sharding namespace replicas → target/bench/sharded.md
	@mkdir -p target/bench
	cargo build --locked --release --bin rulebook
	cargo bench --locked --bench sharded

# Admission latency through the webhook (issue 43): ADMISSION_BENCH_N creates (default
# 1000) from ADMISSION_BENCH_CLIENTS (4), with the webhook and without, ADMISSION_BENCH_REPEATS
# rounds (5) → target/bench/admission.md.
.PHONY: bench-admission
bench-admission: cluster ## Benchmark: admission latency with and without Rulebook's webhook → target/bench/admission.md
	@mkdir -p target/bench
	cargo build --locked --release --bin rulebook
	cargo bench --locked --bench admission

# The cost of the progressive rollout's bookkeeping (issue 44): a template change reaching
# ROLLOUT_BENCH_N parents (default 1000) with and without spec.rollout, ROLLOUT_BENCH_REPEATS
# rounds (3), writes from the audit log, then the steady state over two resyncs
# (ROLLOUT_BENCH_RESYNC, 30 s) → target/bench/rollout.md. ROLLOUT_BENCH_BINARY: another binary.
.PHONY: bench-rollout
bench-rollout: cluster ## Benchmark: a rule change at 1,000 parents with and without spec.rollout (writes, CPU, RSS) → target/bench/rollout.md
	@mkdir -p target/bench
	@if [[ -z "$${ROLLOUT_BENCH_BINARY:-}" ]]; then cargo build --locked --release --bin rulebook; fi
	cargo bench --locked --bench rollout

# ---------------------------------------------------------------------------
# Deployment manifests (deploy/README.md). deploy/base/rbac.yaml, deploy/base/ruleset/ and
# the chart's example values (deploy/helm/rulebook/ci/examples-values.yaml: RBAC and rule
# set) are generated from rules/ and templates/; tests/deploy_manifests.rs and
# tests/helm_chart.rs fail when they are stale. DEPLOY_RBAC_FLAGS must match the
# operator's flags in deploy/base/deployment.yaml.

# No --leader-elect: deploy/base/leader-election.yaml grants the Lease permissions on the
# one Lease in rulebook-system only.
DEPLOY_RBAC_FLAGS := --service-account rulebook-system/rulebook --install-crds --webhooks
# The chart's example values: the same RBAC (and the rule set) for `helm lint`/`template`.
HELM_RBAC_FLAGS := --install-crds --webhooks --helm-values --helm-ruleset
HELM_VALUES := deploy/helm/rulebook/ci/examples-values.yaml

.PHONY: rbac
rbac: ## Regenerate deploy/base/rbac.yaml and the chart's example values (rulebook rbac) from rules/
	@{ echo "# GENERATED by \`make rbac\`: rulebook rbac $(DEPLOY_RBAC_FLAGS)"; \
	   echo "# (from rules/ and templates/). Do not edit; change the rules and regenerate."; \
	   cargo run -q --locked --bin rulebook -- rbac --rules rules --templates templates $(DEPLOY_RBAC_FLAGS); \
	} >deploy/base/rbac.yaml.tmp && mv deploy/base/rbac.yaml.tmp deploy/base/rbac.yaml || \
		{ rm -f deploy/base/rbac.yaml.tmp; exit 1; }
	@{ echo "# GENERATED by \`make rbac\`: rulebook rbac $(HELM_RBAC_FLAGS)"; \
	   echo "# (from rules/ and templates/). Do not edit; change the rules and regenerate."; \
	   cargo run -q --locked --bin rulebook -- rbac --rules rules --templates templates $(HELM_RBAC_FLAGS); \
	} >$(HELM_VALUES).tmp && mv $(HELM_VALUES).tmp $(HELM_VALUES) || \
		{ rm -f $(HELM_VALUES).tmp; exit 1; }

.PHONY: deploy-sync
deploy-sync: rbac ## Regenerate deploy/base/ from rules/ and templates/ (RBAC, rule-set ConfigMaps)
	deploy/sync-ruleset.sh rules templates

# Issue 19's sharding test at the issue's size (tests/sharding.rs; `make test` runs 1,000).
.PHONY: test-sharding-full
test-sharding-full: cluster ## Issue 19's sharding set-up at full size: 3 replicas, 3,000 parents in 300 namespaces, SIGKILL, 3 → 5 → 2 (make test runs it at 1,000)
	scripts/demo.sh down
	RULEBOOK_TEST_KUBECONFIG=$(KUBECONFIG_LOCAL) SHARD_TEST_NAMESPACES=300 \
		cargo test --locked --test sharding replicas_share_the_parents_with_the_api_servers_filter -- --nocapture

# ---------------------------------------------------------------------------
# Fault tests (docs/faults.md). The light ones (tests/faults.rs) run with the other tests
# of `make test`; the heavy ones (tests/faults_heavy.rs, all #[ignore]d: 200 parents
# SIGKILLed 10 times, 500 poison parents, API server and etcd restarts, a forced 410 Gone)
# run in `make test` too (one at a time; those that restart the API server or etcd on a
# second control plane beside the rest, scripts/test-restarts.sh), and alone here. Here
# they restart the local API server and etcd: anything else using the cluster at the
# same time sees a few seconds of refused connections.

.PHONY: test-faults
test-faults: cluster ## Only the heavy fault tests (docs/faults.md; also in `make test`); restarts the local API server and etcd
	@# a demo operator watches every namespace and would fight the tests' operators
	scripts/demo.sh down
	RULEBOOK_TEST_KUBECONFIG=$(KUBECONFIG_LOCAL) $(HEAVY_TEST)
