#!/usr/bin/env bash
# The pure core's dependency tree holds no Kubernetes client, HTTP stack or async runtime
# (issue 42; docs/architecture.md): what `cargo tree` resolves for crates/rulebook-core's
# normal dependencies must name none of kube*, k8s-openapi, hyper* or tokio*.
# tests/layering.rs checks the same from Cargo.lock; this asks cargo itself, for `make lint`.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(cargo tree --locked -p rulebook-core -e normal --prefix none --format '{p}' | sed 's/ (\*)$//' | sort -u)
if [ "$(printf '%s\n' "$tree" | grep -c '^rulebook-core ')" -ne 1 ]; then
    echo "core-tree: cargo tree did not list rulebook-core" >&2
    exit 1
fi
forbidden=$(printf '%s\n' "$tree" | grep -E '^(kube|kube-[a-z-]+|k8s-openapi|hyper|hyper-[a-z-]+|tokio|tokio-[a-z-]+) ' | sort -u || true)
if [ -n "$forbidden" ]; then
    echo "rulebook-core depends on:" >&2
    printf '  %s\n' "$forbidden" >&2
    exit 1
fi
echo "core-tree: rulebook-core has no kube, k8s-openapi, hyper or tokio ($(printf '%s\n' "$tree" | sort -u | wc -l) packages)"
