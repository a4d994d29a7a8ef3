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
