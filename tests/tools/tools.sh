#!/usr/bin/env bash
#
# The Go tools Rulebook's checks use besides the control plane: helm (v4: `helm lint`,
# `helm template` in `make lint`, `helm install` in tests/helm_chart.rs) and promtool
# (`promtool check rules` / `promtool test rules` on deploy/prometheus/ in `make test`).
# Built from the Go module proxy through the wrapper modules next to this script, the
# same way tests/cluster/cluster.sh builds kube-apiserver and kwok: versions come from
# the go.mod files, the binaries live in a version-keyed cache outside the repository,
# and a warm run finds them there and builds nothing.
#
# Usage: tests/tools/tools.sh <command>
#   build         build the missing binaries into the cache (no-op when present)
#   path <tool>   print the cached binary's path (helm or promtool); fails loudly when
#                 it is not built (run `build` first: it is never built implicitly)
#   bin-dir       print the cache's bin directory
#
# Environment:
#   RULEBOOK_CACHE  cache root (default: $HOME/.cache/rulebook)
#   TOOLS_NICE      niceness of the Go builds (default 15: they share the machine)
set -euo pipefail

SCRIPT="$(readlink -f "${BASH_SOURCE[0]}")"
MODULES_DIR="$(dirname "$SCRIPT")"

# Versions come from the wrapper modules' go.mod, so bumping a go.mod also changes
# the cache key.
module_version() { # <module dir> <module path>
	sed -n -E "s#^[[:space:]]*(require[[:space:]]+)?$2[[:space:]]+(v[^[:space:]]+).*#\2#p" \
		"$MODULES_DIR/$1/go.mod" | head -n 1
}
HELM_VERSION="$(module_version helm helm.sh/helm/v4)"
PROM_VERSION="$(module_version prometheus github.com/prometheus/prometheus)"
if [[ -z "$HELM_VERSION" || -z "$PROM_VERSION" ]]; then
	echo "tools: cannot read versions from $MODULES_DIR/*/go.mod" >&2
	exit 1
fi

CACHE_DIR="${RULEBOOK_CACHE:-$HOME/.cache/rulebook}/tools/helm-$HELM_VERSION-prometheus-$PROM_VERSION"
BIN_DIR="$CACHE_DIR/bin"
BINARIES=(helm promtool)

log() { printf 'tools: %s\n' "$*" >&2; }
die() { printf 'tools: error: %s\n' "$*" >&2; exit 1; }

now_us() { local t="$EPOCHREALTIME"; echo "${t//[.,]/}"; }
since() { # <start µs> -> "12.3s"
	local ms=$((($(now_us) - $1) / 1000))
	printf '%d.%01ds' $((ms / 1000)) $((ms % 1000 / 100))
}

go_cmd() {
	if command -v go >/dev/null; then
		echo go
	elif [[ -x /usr/local/go/bin/go ]]; then
		echo /usr/local/go/bin/go
	else
		die "go not found (need Go >= the version in tests/tools/*/go.mod)"
	fi
}

BUILD_TMP="" # removed on exit
trap '[[ -z "$BUILD_TMP" ]] || rm -rf "$BUILD_TMP"' EXIT

# go_build <module dir> <ldflags> <name>=<package>: builds it unless present.
go_build() {
	local mod="$1" ldflags="$2" spec="$3" name pkg t0
	name="${spec%%=*}" pkg="${spec#*=}"
	if [[ -x "$BIN_DIR/$name" ]]; then
		log "  $name: present"
		return 0
	fi
	t0="$(now_us)"
	log "  $name: go build $pkg"
	(cd "$MODULES_DIR/$mod" &&
		CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod \
			nice -n "${TOOLS_NICE:-15}" "$GO" build -trimpath -buildvcs=false -ldflags "$ldflags" \
			-o "$BUILD_TMP/$name" "$pkg")
	# rename(2) within one filesystem: never a half-written binary.
	mv -f "$BUILD_TMP/$name" "$BIN_DIR/$name"
	log "  $name: built in $(since "$t0")"
}

cmd_build() {
	local b missing=0
	for b in "${BINARIES[@]}"; do [[ -x "$BIN_DIR/$b" ]] || missing=1; done
	if ((!missing)); then
		log "binaries up to date, nothing to build ($BIN_DIR)"
		return 0
	fi
	GO="$(go_cmd)"
	log "building into $BIN_DIR ($("$GO" version))"
	mkdir -p "$BIN_DIR"
	BUILD_TMP="$(mktemp -d "$CACHE_DIR/.build.XXXXXX")"
	# The versions the binaries report (`helm version`, `promtool --version`).
	go_build helm "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION -X helm.sh/helm/v4/internal/version.gitTreeState=clean" \
		helm=helm.sh/helm/v4/cmd/helm
	go_build prometheus "-s -w -X github.com/prometheus/common/version.Version=${PROM_VERSION} -X github.com/prometheus/common/version.Branch=module-proxy" \
		promtool=github.com/prometheus/prometheus/cmd/promtool
	for b in "${BINARIES[@]}"; do [[ -x "$BIN_DIR/$b" ]] || die "missing $BIN_DIR/$b after build"; done
}

cmd_path() {
	local tool="${1:-}"
	case "$tool" in
	helm | promtool) ;;
	*) die "usage: tools.sh path helm|promtool" ;;
	esac
	[[ -x "$BIN_DIR/$tool" ]] ||
		die "$tool is not built ($BIN_DIR/$tool missing): run tests/tools/tools.sh build (make tools)"
	echo "$BIN_DIR/$tool"
}

case "${1:-}" in
build) cmd_build ;;
path) cmd_path "${2:-}" ;;
bin-dir) echo "$BIN_DIR" ;;
*) die "usage: tools.sh build | path helm|promtool | bin-dir" ;;
esac
