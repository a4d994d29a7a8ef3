#!/usr/bin/env bash
# Builds kro's controller (the benchmark's optional third contender, docs/benchmarks.md)
# through the Go module proxy into a cache outside the repository, once per version:
#   $RULEBOOK_CACHE/kro/<version>/bin/controller   the controller, run out-of-cluster
#   $RULEBOOK_CACHE/kro/<version>/crds/*.yaml      its CRDs (from the module's helm/crds)
# Exit 0 when both are present; non-zero (with the reason) when kro cannot be built.
set -euo pipefail

KRO_MODULE="github.com/kubernetes-sigs/kro"
KRO_VERSION="${KRO_VERSION:-v0.9.4}"
CACHE="${RULEBOOK_CACHE:-$HOME/.cache/rulebook}/kro/$KRO_VERSION"

if [[ -x "$CACHE/bin/controller" && -s "$CACHE/crds/kro.run_resourcegraphdefinitions.yaml" ]]; then
	echo "kro: $KRO_VERSION present in $CACHE" >&2
	exit 0
fi
if command -v go >/dev/null; then GO=go
elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
else echo "kro: go not found" >&2; exit 1; fi

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cd "$scratch" # outside the repository: no go.mod around
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
echo "kro: building $KRO_MODULE/cmd/controller@$KRO_VERSION with $("$GO" version)" >&2
mkdir -p "$scratch/bin"
GOBIN="$scratch/bin" "$GO" install "$KRO_MODULE/cmd/controller@$KRO_VERSION"
dir="$("$GO" mod download -json "$KRO_MODULE@$KRO_VERSION" |
	sed -n -E 's/^[[:space:]]*"Dir":[[:space:]]*"([^"]+)".*/\1/p')"
[[ -d "$dir/helm/crds" ]] || { echo "kro: no helm/crds in $dir" >&2; exit 1; }
mkdir -p "$CACHE/bin" "$CACHE/crds"
cp "$dir"/helm/crds/*.yaml "$CACHE/crds/"
mv -f "$scratch/bin/controller" "$CACHE/bin/controller"
echo "kro: built into $CACHE" >&2
