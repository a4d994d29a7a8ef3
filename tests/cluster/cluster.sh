#!/usr/bin/env bash
# Functions passed to wait_until/trap look unreachable to shellcheck:
# shellcheck disable=SC2317
#
# Local Kubernetes control plane for Rulebook's tests, demos and benchmarks.
#
# Runs etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok
# (fake nodes: pods become Running/Ready without a container runtime) as plain
# processes on 127.0.0.1. No containers, no root. All state is kept in
# <repo>/.cluster/ (or RULEBOOK_CLUSTER_DIR) and the binaries in a version-keyed cache
# outside the repo.
#
# Usage: tests/cluster/cluster.sh <command>
#   build              build the binaries into the cache (no-op when present)
#   up [--fresh]       start the control plane, or reuse a healthy one
#   restart            same as `up --fresh`
#   down               stop every process and remove .cluster/ (the state directory)
#   status             print whether the cluster is up; exit 0 if so, 1 if not
#   restart-apiserver  stop and start kube-apiserver (same ports and flags)
#   restart-etcd       stop and start etcd (same ports, flags and data)
#   apiserver-without-gate
#                      start (or reuse) a second kube-apiserver on the same etcd
#                      with ShardedListAndWatch off, for the sharding fallback
#                      test; prints its kubeconfig. Stopped by `down`/`restart`.
#   stop-apiserver-without-gate
#                      stop that second kube-apiserver
#   env                print `export` lines for the cluster (eval "$(... env)")
#
# Environment:
#   RULEBOOK_CACHE        cache root (default: $HOME/.cache/rulebook)
#   RULEBOOK_CLUSTER_DIR  the state directory (default: <repo>/.cluster). Another one is
#                         another cluster on other ports beside the first: `make test`
#                         runs the tests that restart the API server or etcd on
#                         <repo>/.cluster-restarts while the others use .cluster.
#   ETCD_EXTRA_ARGS       extra etcd flags, whitespace separated (read by up)
#   APISERVER_EXTRA_ARGS  extra kube-apiserver flags (read by up)
#   CLUSTER_GOGC          GOGC of every component (read by up; unset: Go's default,
#                         100). `make test` sets 400: on its
#                         2 cores the API server spent 13–16 % of its CPU collecting
#                         garbage at 100 (a CPU profile, 2026-11-29; issue 42).
#   CLUSTER_TIMEOUT       seconds to wait for each readiness step (default 120)
set -euo pipefail

SCRIPT="$(readlink -f "${BASH_SOURCE[0]}")"
MODULES_DIR="$(dirname "$SCRIPT")"
REPO_ROOT="$(cd "$MODULES_DIR/../.." && pwd)"

# Versions come from the wrapper modules' go.mod, so bumping a go.mod also
# changes the cache key.
module_version() { # <module dir> <module path>
	sed -n -E "s#^[[:space:]]*(require[[:space:]]+)?$2[[:space:]]+(v[^[:space:]]+).*#\2#p" \
		"$MODULES_DIR/$1/go.mod" | head -n 1
}
K8S_VERSION="$(module_version kubernetes k8s.io/kubernetes)"
ETCD_VERSION="$(module_version etcd go.etcd.io/etcd/server/v3)"
KWOK_VERSION="$(module_version kwok sigs.k8s.io/kwok)"
if [[ -z "$K8S_VERSION" || -z "$ETCD_VERSION" || -z "$KWOK_VERSION" ]]; then
	echo "cluster: cannot read versions from $MODULES_DIR/*/go.mod" >&2
	exit 1
fi

CACHE_DIR="${RULEBOOK_CACHE:-$HOME/.cache/rulebook}/cluster/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION"
BIN_DIR="$CACHE_DIR/bin"
KWOK_STAGES="$CACHE_DIR/share/kwok-stages.yaml"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok kubectl)
# The second API server runs the same binary under another name (a symlink), so
# its process is told apart by argv[0] like every component.
NOGATE=kube-apiserver-nogate
# Start order (see stop_all for the stop order).
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)

# Canonical: the lock file and the processes' argv[0] (is_ours) are told apart by this path,
# so one cluster named through a symlink or `..` must still be the same cluster.
STATE_DIR="$(realpath -m -- "${RULEBOOK_CLUSTER_DIR:-$REPO_ROOT/.cluster}")"
[[ "$STATE_DIR" != / ]] || { echo "cluster: error: RULEBOOK_CLUSTER_DIR is /" >&2; exit 1; }
CERTS="$STATE_DIR/certs"
LOGS="$STATE_DIR/logs"
PIDS="$STATE_DIR/pids"
RUN="$STATE_DIR/run"
KUBECONFIG_ADMIN="$STATE_DIR/kubeconfig"
KUBECONFIG_NOGATE="$STATE_DIR/kubeconfig-nogate"

NODE_NAME="kwok-node-0"
SERVICE_CIDR="10.0.0.0/24"
SERVICE_IP="10.0.0.1"
POD_CIDR="10.244.0.0/16"
TIMEOUT="${CLUSTER_TIMEOUT:-120}"
STOP_TIMEOUT=10

log() { printf 'cluster: %s\n' "$*" >&2; }
die() { printf 'cluster: error: %s\n' "$*" >&2; exit 1; }

now_us() { local t="$EPOCHREALTIME"; echo "${t//[.,]/}"; }
since() { # <start µs> -> "12.3s"
	local ms=$((($(now_us) - $1) / 1000))
	printf '%d.%01ds' $((ms / 1000)) $((ms % 1000 / 100))
}

# Serialise commands that change one cluster (two `make test` runs at once). One lock per
# state directory, in a file beside it (it outlives `down`): a restart of one cluster
# must not wait for another cluster's start.
lock() {
	if command -v flock >/dev/null; then
		exec 9>>"$STATE_DIR.lock"
		flock -w 600 9 || die "another cluster.sh command has held the lock for 10 minutes"
	fi
}

# `down` and a fresh `up` remove the state directory: only one this script made (its
# run/ and pids/), or an empty one, never a directory RULEBOOK_CLUSTER_DIR named by mistake.
# Renamed first (atomic), then removed: a removal interrupted half-way leaves
# <dir>.removing.<pid>, which the next one removes, never a state directory that no
# longer looks like one.
remove_state() {
	local gone
	for gone in "$STATE_DIR".removing.*; do
		[[ -d "$gone" ]] && rm -rf -- "$gone"
	done
	[[ -e "$STATE_DIR" ]] || return 0
	if [[ ! (-d "$RUN" && -d "$PIDS") && -n "$(ls -A "$STATE_DIR" 2>/dev/null)" ]]; then
		die "$STATE_DIR is not a cluster state directory (no run/ and pids/); not removing it"
	fi
	gone="$STATE_DIR.removing.$$"
	mv -- "$STATE_DIR" "$gone" && rm -rf -- "$gone"
}

# ---------------------------------------------------------------- build ----

go_cmd() {
	if command -v go >/dev/null; then
		echo go
	elif [[ -x /usr/local/go/bin/go ]]; then
		echo /usr/local/go/bin/go
	else
		die "go not found (need Go >= the version in tests/cluster/*/go.mod)"
	fi
}

built() {
	local b
	for b in "${BINARIES[@]}"; do [[ -x "$BIN_DIR/$b" ]] || return 1; done
	[[ -s "$KWOK_STAGES" ]]
}

BUILD_TMP=""  # removed on exit
STARTING=0    # 1 while `up` starts components: on failure, stop them again
on_exit() {
	[[ -z "$BUILD_TMP" ]] || rm -rf "$BUILD_TMP"
	if ((STARTING)); then
		STARTING=0
		log "start failed; stopping the components (logs are in $LOGS)"
		stop_all || true
	fi
}
trap on_exit EXIT

# go_build <module dir> <ldflags> <name>=<package>...: builds the missing ones.
go_build() {
	local mod="$1" ldflags="$2" spec name pkg t0
	shift 2
	for spec in "$@"; do
		name="${spec%%=*}" pkg="${spec#*=}"
		if [[ -x "$BIN_DIR/$name" ]]; then
			log "  $name: present"
			continue
		fi
		t0="$(now_us)"
		log "  $name: go build $pkg"
		(cd "$MODULES_DIR/$mod" &&
			CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod \
				"$GO" build -trimpath -buildvcs=false -ldflags "$ldflags" \
				-o "$BUILD_TMP/$name" "$pkg")
		# rename(2) within one filesystem: never a half-written binary.
		mv -f "$BUILD_TMP/$name" "$BIN_DIR/$name"
		log "  $name: built in $(since "$t0")"
	done
}

# kwok has no built-in stages when run standalone; kwokctl writes its
# defaults into a config file. Reproduce that from the module's own YAML:
# node-initialize + node-heartbeat-with-lease + pod-ready/complete/delete.
write_kwok_stages() {
	local dir f tmp
	dir="$(cd "$MODULES_DIR/kwok" &&
		GOTOOLCHAIN=local GOFLAGS=-mod=mod "$GO" mod download sigs.k8s.io/kwok &&
		GOTOOLCHAIN=local GOFLAGS=-mod=mod "$GO" list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
	[[ -n "$dir" && -d "$dir/kustomize/stage" ]] || die "kwok module sources not found"
	mkdir -p "$(dirname "$KWOK_STAGES")"
	tmp="$(mktemp "$KWOK_STAGES.XXXXXX")"
	for f in node/fast/node-initialize.yaml \
		node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
		pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
		printf -- '---\n# sigs.k8s.io/kwok@%s kustomize/stage/%s\n' "$KWOK_VERSION" "$f"
		cat "$dir/kustomize/stage/$f"
	done >"$tmp"
	mv -f "$tmp" "$KWOK_STAGES"
	log "  kwok stages: $KWOK_STAGES"
}

cmd_build() {
	if built; then
		log "binaries up to date, nothing to build ($BIN_DIR)"
		return 0
	fi
	GO="$(go_cmd)"
	local t0 major minor v
	t0="$(now_us)"
	log "building into $BIN_DIR ($("$GO" version))"
	mkdir -p "$BIN_DIR"
	BUILD_TMP="$(mktemp -d "$CACHE_DIR/.build.XXXXXX")"

	# v1.36.3 -> major 1, minor 36 (what `kubectl version` and /version show).
	major="${K8S_VERSION#v}" major="${major%%.*}"
	minor="${K8S_VERSION#v*.}" minor="${minor%%.*}"
	local kube_ldflags="-s -w" pkgpath
	for pkgpath in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		kube_ldflags+=" -X $pkgpath.gitVersion=$K8S_VERSION"
		kube_ldflags+=" -X $pkgpath.gitMajor=$major"
		kube_ldflags+=" -X $pkgpath.gitMinor=$minor"
		kube_ldflags+=" -X $pkgpath.gitTreeState=clean"
	done

	go_build kubernetes "$kube_ldflags" \
		kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver \
		kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager \
		kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler \
		kubectl=k8s.io/kubernetes/cmd/kubectl
	go_build etcd "-s -w" etcd=go.etcd.io/etcd/server/v3
	go_build kwok "-s -w" kwok=sigs.k8s.io/kwok/cmd/kwok
	[[ -s "$KWOK_STAGES" ]] || write_kwok_stages
	for v in "${BINARIES[@]}"; do [[ -x "$BIN_DIR/$v" ]] || die "missing $BIN_DIR/$v after build"; done
	rm -rf "$BUILD_TMP"
	BUILD_TMP=""
	log "build done in $(since "$t0")"
}

# ------------------------------------------------------------ processes ----

# The pid belongs to this repo's cluster iff its argv[0] is our binary path
# (we always start components as $STATE_DIR/bin/<name>).
is_ours() { # <pid> <name>
	local argv0=""
	[[ "$1" =~ ^[0-9]+$ ]] || return 1
	[[ -r "/proc/$1/cmdline" ]] || return 1
	IFS= read -r -d '' argv0 <"/proc/$1/cmdline" 2>/dev/null || true
	[[ "$argv0" == "$STATE_DIR/bin/$2" ]]
}

pid_of() { # <name>: prints the pid if the component is running
	local pid
	[[ -r "$PIDS/$1.pid" ]] || return 1
	pid="$(<"$PIDS/$1.pid")"
	is_ours "$pid" "$1" || return 1
	echo "$pid"
}

# Our processes without (or with a stale) pid file, e.g. after .cluster was
# removed by hand: any process whose argv[0] is $STATE_DIR/bin/<component>.
orphans() { # <name>
	local p
	for p in /proc/[0-9]*; do
		is_ours "${p#/proc/}" "$1" && echo "${p#/proc/}"
	done
	return 0
}

start_component() { # <name>
	local name="$1" args=() pid
	mapfile -t args <"$RUN/$name.args"
	# setsid: own session, so the process outlives make/CI's process group
	# and terminal; nohup + </dev/null: no SIGHUP, no stdin; 9<&-: must not
	# inherit (and so hold forever) the lock.
	local go_env=()
	[[ -r "$RUN/go.env" ]] && mapfile -t go_env <"$RUN/go.env"
	setsid nohup env "${go_env[@]}" "$STATE_DIR/bin/$name" "${args[@]}" </dev/null >>"$LOGS/$name.log" 2>&1 9<&- &
	pid=$!
	echo "$pid" >"$PIDS/$name.pid"
	# $! is setsid's pid: it becomes the component only after setsid and nohup have
	# exec'd, which can take longer than one check under load. Wait for that (or for
	# the process to die) rather than judging after a fixed 50 ms.
	local tries=0
	until is_ours "$pid" "$name"; do
		tries=$((tries + 1))
		if ! kill -0 "$pid" 2>/dev/null || ((tries > 40)); then
			break
		fi
		sleep 0.05
	done
	is_ours "$pid" "$name" || {
		tail_log "$name"
		die "$name exited immediately"
	}
	log "started $name (pid $pid)"
}

stop_components() { # <name>...: TERM, wait, KILL; fails if anything survives
	local name pid pids=() deadline alive
	for name in "$@"; do
		if [[ -r "$PIDS/$name.pid" ]]; then
			pid="$(<"$PIDS/$name.pid")"
			is_ours "$pid" "$name" && pids+=("$pid:$name")
		fi
		for pid in $(orphans "$name"); do
			[[ " ${pids[*]} " == *" $pid:$name "* ]] || pids+=("$pid:$name")
		done
	done
	if [[ ${#pids[@]} -eq 0 ]]; then
		for name in "$@"; do rm -f "$PIDS/$name.pid"; done
		return 0
	fi
	for pid in "${pids[@]}"; do
		log "stopping ${pid#*:} (pid ${pid%%:*})"
		kill -TERM "${pid%%:*}" 2>/dev/null || true
	done
	deadline=$((SECONDS + STOP_TIMEOUT))
	while :; do
		alive=()
		for pid in "${pids[@]}"; do is_ours "${pid%%:*}" "${pid#*:}" && alive+=("$pid"); done
		[[ ${#alive[@]} -gt 0 ]] || break
		if ((SECONDS >= deadline)); then
			for pid in "${alive[@]}"; do
				log "${pid#*:} (pid ${pid%%:*}) ignored SIGTERM for ${STOP_TIMEOUT}s, sending SIGKILL"
				kill -KILL "${pid%%:*}" 2>/dev/null || true
			done
			sleep 1
			for pid in "${alive[@]}"; do
				is_ours "${pid%%:*}" "${pid#*:}" && die "${pid#*:} (pid ${pid%%:*}) still alive after SIGKILL"
			done
			break
		fi
		sleep 0.1
	done
	for name in "$@"; do rm -f "$PIDS/$name.pid"; done
}

# Clients first, then the apiserver while etcd is still up (without etcd its
# graceful shutdown hangs ~20s on the peer-endpoint lease), then etcd.
stop_all() {
	stop_components kwok kube-scheduler kube-controller-manager
	stop_components "$NOGATE" kube-apiserver
	stop_components etcd
}

tail_log() { # <name>
	[[ -r "$LOGS/$1.log" ]] || return 0
	printf '\n----- last 40 lines of %s -----\n' "$LOGS/$1.log" >&2
	tail -n 40 "$LOGS/$1.log" >&2
	printf -- '----- end of %s -----\n\n' "$1" >&2
}

# wait_until <description> <comma-separated components to watch> <cmd>...
# Polls cmd until it succeeds; fails fast if a watched component dies, and on
# timeout shows the tail of the watched components' logs.
wait_until() {
	local what="$1" watch="$2" deadline=$((SECONDS + TIMEOUT)) c
	shift 2
	while ! "$@" >/dev/null 2>&1; do
		for c in ${watch//,/ }; do
			if ! pid_of "$c" >/dev/null; then
				tail_log "$c"
				die "$c died while waiting for: $what"
			fi
		done
		if ((SECONDS >= deadline)); then
			for c in ${watch//,/ }; do tail_log "$c"; done
			die "timed out after ${TIMEOUT}s waiting for: $what"
		fi
		sleep 0.2
	done
}

# ---------------------------------------------------------------- checks ----

load_ports() {
	[[ -r "$RUN/ports.env" ]] || return 1
	# shellcheck source=/dev/null
	source "$RUN/ports.env"
}

kctl() { "$STATE_DIR/bin/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" --cache-dir "$STATE_DIR/kubectl-cache" "$@"; }

readyz() { # [port]
	load_ports || return 1
	[[ "$(curl -sS --noproxy '*' --max-time 5 --cacert "$CERTS/ca.crt" \
		--cert "$CERTS/admin.crt" --key "$CERTS/admin.key" \
		"https://127.0.0.1:${1:-$APISERVER_PORT}/readyz" 2>/dev/null)" == ok ]]
}
nogate_readyz() { readyz "$APISERVER_NOGATE_PORT"; }

etcd_healthy() {
	load_ports || return 1
	curl -sS --noproxy '*' --max-time 5 "http://127.0.0.1:$ETCD_CLIENT_PORT/health" 2>/dev/null |
		grep -q '"health":"true"'
}

all_running() {
	local c
	for c in "${COMPONENTS[@]}"; do pid_of "$c" >/dev/null || return 1; done
}

default_sa_exists() { kctl -n default get serviceaccount default; }
node_ready() {
	[[ "$(kctl get node "$NODE_NAME" \
		-o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" == True ]]
}
smoke_available() {
	[[ "$(kctl -n default get deployment cluster-smoke -o jsonpath='{.status.availableReplicas}')" == 2 ]]
}

# ----------------------------------------------------------------- setup ----

free_ports() { # <n>: n distinct free TCP ports on 127.0.0.1
	python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

# sign <name> <subject> <extensions>: certificate for $name.key, signed by the CA.
sign() {
	local name="$1" subj="$2" ext="$3"
	openssl req -new -key "$CERTS/$name.key" -subj "$subj" -out "$CERTS/$name.csr"
	printf '%s\n' "$ext" >"$CERTS/$name.ext"
	openssl x509 -req -in "$CERTS/$name.csr" -CA "$CERTS/ca.crt" -CAkey "$CERTS/ca.key" \
		-set_serial "0x$(openssl rand -hex 16)" -days 3650 -sha256 \
		-extfile "$CERTS/$name.ext" -out "$CERTS/$name.crt" 2>/dev/null
	rm -f "$CERTS/$name.csr" "$CERTS/$name.ext"
}

make_certs() {
	local client="basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
	# RSA 2048 everywhere (the service-account key must be RSA; RSA client
	# keys work with every client). Generated in parallel: it is most of the
	# time spent here.
	local k
	for k in ca apiserver admin kube-controller-manager kube-scheduler kwok sa; do
		openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$CERTS/$k.key" 2>/dev/null &
	done
	wait
	for k in ca apiserver admin kube-controller-manager kube-scheduler kwok sa; do
		[[ -s "$CERTS/$k.key" ]] || die "openssl genpkey failed for $k.key"
	done
	openssl req -x509 -key "$CERTS/ca.key" -sha256 -days 3650 \
		-subj "/CN=rulebook-local-ca" \
		-addext "basicConstraints=critical,CA:TRUE" \
		-addext "keyUsage=critical,digitalSignature,keyCertSign,cRLSign" \
		-out "$CERTS/ca.crt" 2>/dev/null
	sign apiserver "/CN=kube-apiserver" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:::1,IP:$SERVICE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster,DNS:kubernetes.default.svc.cluster.local"
	sign admin "/O=system:masters/CN=kubernetes-admin" "$client"
	sign kube-controller-manager "/CN=system:kube-controller-manager" "$client"
	sign kube-scheduler "/CN=system:kube-scheduler" "$client"
	sign kwok "/O=system:masters/CN=kwok-controller" "$client"
	# Service-account token signing key pair.
	openssl pkey -in "$CERTS/sa.key" -pubout -out "$CERTS/sa.pub"
	chmod 600 "$CERTS"/*.key
}

b64() { base64 -w0 <"$1"; }

write_kubeconfig() { # <file> <user> <cert name> [port]
	cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: rulebook-local
  cluster:
    server: https://127.0.0.1:${4:-$APISERVER_PORT}
    certificate-authority-data: $(b64 "$CERTS/ca.crt")
users:
- name: $2
  user:
    client-certificate-data: $(b64 "$CERTS/$3.crt")
    client-key-data: $(b64 "$CERTS/$3.key")
contexts:
- name: rulebook-local
  context:
    cluster: rulebook-local
    user: $2
current-context: rulebook-local
EOF
	chmod 600 "$1"
}

# The *_EXTRA_ARGS a cluster was started with: `up` reuses a running cluster
# only if they are unchanged.
extra_args_key() {
	local e a
	read -r -a e <<<"${ETCD_EXTRA_ARGS:-}"
	read -r -a a <<<"${APISERVER_EXTRA_ARGS:-}"
	echo "etcd: ${e[*]}"
	echo "kube-apiserver: ${a[*]}"
	echo "GOGC: ${CLUSTER_GOGC:-}"
	# Bumped when the fixed flags change, so a running cluster with the old ones restarts.
	echo "fixed flags: 3 (ShardedListAndWatch, a second API server without it)"
}

write_args() { # <name> <arg>...: one argument per line
	local name="$1"
	shift
	printf '%s\n' "$@" >"$RUN/$name.args"
}

prepare_state() {
	local ports
	remove_state
	mkdir -p "$CERTS" "$LOGS" "$PIDS" "$RUN" "$STATE_DIR/etcd" "$STATE_DIR/kubeconfigs"
	ln -s "$BIN_DIR" "$STATE_DIR/bin"
	cp "$KWOK_STAGES" "$RUN/kwok-stages.yaml"

	read -r -a ports <<<"$(free_ports 4)"
	cat >"$RUN/ports.env" <<EOF
ETCD_CLIENT_PORT=${ports[0]}
ETCD_PEER_PORT=${ports[1]}
APISERVER_PORT=${ports[2]}
APISERVER_NOGATE_PORT=${ports[3]}
EOF
	load_ports
	make_certs
	write_kubeconfig "$KUBECONFIG_ADMIN" kubernetes-admin admin
	write_kubeconfig "$KUBECONFIG_NOGATE" kubernetes-admin admin "$APISERVER_NOGATE_PORT"
	local c
	for c in kube-controller-manager kube-scheduler kwok; do
		write_kubeconfig "$STATE_DIR/kubeconfigs/$c.kubeconfig" "$c" "$c"
	done

	local etcd_extra=() api_extra=()
	read -r -a etcd_extra <<<"${ETCD_EXTRA_ARGS:-}"
	read -r -a api_extra <<<"${APISERVER_EXTRA_ARGS:-}"
	extra_args_key >"$RUN/extra-args"
	# The Go runtime's settings of every component (start_component), kept for restarts.
	if [[ -n "${CLUSTER_GOGC:-}" ]]; then
		echo "GOGC=$CLUSTER_GOGC" >"$RUN/go.env"
	else
		: >"$RUN/go.env"
	fi

	write_args etcd \
		--name=rulebook \
		--data-dir="$STATE_DIR/etcd" \
		--listen-client-urls="http://127.0.0.1:$ETCD_CLIENT_PORT" \
		--advertise-client-urls="http://127.0.0.1:$ETCD_CLIENT_PORT" \
		--listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
		--initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
		--initial-cluster="rulebook=http://127.0.0.1:$ETCD_PEER_PORT" \
		--initial-cluster-state=new \
		--unsafe-no-fsync=true \
		"${etcd_extra[@]}"

	# Audit every write request (one line each, with user and user agent): the evidence
	# for "Rulebook makes no writes at steady state" comes from the API server itself.
	# Reads are audited in one namespace only, where tests/cheaper.rs counts a new
	# parent's requests.
	cat >"$STATE_DIR/audit-policy.yaml" <<-'POLICY'
		apiVersion: audit.k8s.io/v1
		kind: Policy
		omitStages: [RequestReceived]
		rules:
		  - level: None
		    resources: [{group: coordination.k8s.io, resources: [leases]}]
		    users: [system:kube-controller-manager, system:kube-scheduler, kwok]
		  - level: Metadata
		    verbs: [create, update, patch, delete, deletecollection]
		  - level: Metadata
		    verbs: [get]
		    namespaces: [rulebook-audit-reads]
		  - level: None
	POLICY

	apiserver_args() { # <name> <port> <ShardedListAndWatch> <audit log>
		write_args "$1" \
		--etcd-servers="http://127.0.0.1:$ETCD_CLIENT_PORT" \
		--bind-address=127.0.0.1 \
		--secure-port="$2" \
		--advertise-address=127.0.0.1 \
		--endpoint-reconciler-type=none \
		--tls-cert-file="$CERTS/apiserver.crt" \
		--tls-private-key-file="$CERTS/apiserver.key" \
		--client-ca-file="$CERTS/ca.crt" \
		--authorization-mode=Node,RBAC \
		--service-account-issuer=https://kubernetes.default.svc.cluster.local \
		--service-account-key-file="$CERTS/sa.pub" \
		--service-account-signing-key-file="$CERTS/sa.key" \
		--service-cluster-ip-range="$SERVICE_CIDR" \
		--allow-privileged=true \
		--max-requests-inflight=2000 \
		--max-mutating-requests-inflight=1000 \
		--shutdown-send-retry-after=true \
		--feature-gates="ShardedListAndWatch=$3" \
		--audit-policy-file="$STATE_DIR/audit-policy.yaml" \
		--audit-log-path="$4" \
		--audit-log-format=json \
		--audit-log-maxsize=500 \
		--audit-log-maxbackup=1 \
		"${api_extra[@]}"
	}
	apiserver_args kube-apiserver "$APISERVER_PORT" true "$LOGS/audit.log"
	apiserver_args "$NOGATE" "$APISERVER_NOGATE_PORT" false "$LOGS/audit-nogate.log"

	# The garbage collector logs its discovery syncs at level 2 (when it starts watching a
	# new kind): tests whose parents' CRDs are new wait for that (gc_watches in
	# tests/common), and its log says how long it took.
	write_args kube-controller-manager \
		--kubeconfig="$STATE_DIR/kubeconfigs/kube-controller-manager.kubeconfig" \
		--controllers='*' \
		--leader-elect=false \
		--secure-port=0 \
		--use-service-account-credentials=true \
		--service-account-private-key-file="$CERTS/sa.key" \
		--root-ca-file="$CERTS/ca.crt" \
		--cluster-signing-cert-file="$CERTS/ca.crt" \
		--cluster-signing-key-file="$CERTS/ca.key" \
		--service-cluster-ip-range="$SERVICE_CIDR" \
		--flex-volume-plugin-dir="$STATE_DIR/flexvolume" \
		--kube-api-qps=200 \
		--kube-api-burst=400 \
		--vmodule=garbagecollector=2

	cat >"$RUN/kube-scheduler.yaml" <<EOF
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: $STATE_DIR/kubeconfigs/kube-scheduler.kubeconfig
  qps: 200
  burst: 400
leaderElection:
  leaderElect: false
EOF
	write_args kube-scheduler \
		--config="$RUN/kube-scheduler.yaml" \
		--secure-port=0

	write_args kwok \
		--kubeconfig="$STATE_DIR/kubeconfigs/kwok.kubeconfig" \
		--config="$RUN/kwok-stages.yaml" \
		--manage-all-nodes=false \
		--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
		--node-lease-duration-seconds=40 \
		--cidr="$POD_CIDR"
}

create_node() {
	kctl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata:
  name: $NODE_NAME
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    type: kwok
    kubernetes.io/arch: amd64
    kubernetes.io/os: linux
    kubernetes.io/hostname: $NODE_NAME
status:
  capacity:
    pods: "10000"
    cpu: "1000"
    memory: 4Ti
  allocatable:
    pods: "10000"
    cpu: "1000"
    memory: 4Ti
EOF
}

smoke_test() {
	kctl -n default apply -f - >/dev/null <<EOF
apiVersion: apps/v1
kind: Deployment
metadata:
  name: cluster-smoke
spec:
  replicas: 2
  selector:
    matchLabels: {app: cluster-smoke}
  template:
    metadata:
      labels: {app: cluster-smoke}
    spec:
      containers:
      - name: smoke
        image: rulebook.invalid/smoke:latest
EOF
	wait_until "smoke Deployment with 2 available replicas" \
		kube-apiserver,kube-controller-manager,kube-scheduler,kwok smoke_available
	# Foreground deletion returns once the ReplicaSet and Pods are gone too
	# (garbage collector + kwok's pod-delete stage).
	kctl -n default delete deployment cluster-smoke --cascade=foreground --timeout="${TIMEOUT}s" >/dev/null
}

# -------------------------------------------------------------- commands ----

cmd_up() {
	local fresh=0 t0
	case "${1:-}" in
	"") ;;
	--fresh) fresh=1 ;;
	*) die "up: unknown argument '$1' (expected --fresh)" ;;
	esac
	# Checked before anything is stopped: a typo must not cost the running cluster.
	if [[ -n "${CLUSTER_GOGC:-}" && ! "$CLUSTER_GOGC" =~ ^([1-9][0-9]*|off)$ ]]; then
		die "CLUSTER_GOGC must be a number or off, not '$CLUSTER_GOGC'"
	fi
	built || cmd_build
	lock
	# Reuse only a healthy cluster running this cache's binaries (a version
	# bump changes $BIN_DIR) with the same *_EXTRA_ARGS.
	if ((!fresh)) && all_running && readyz; then
		if [[ "$(readlink "$STATE_DIR/bin")" != "$BIN_DIR" ]]; then
			log "running cluster uses other binaries; restarting"
		elif [[ "$(extra_args_key)" != "$(cat "$RUN/extra-args" 2>/dev/null)" ]]; then
			log "ETCD_EXTRA_ARGS/APISERVER_EXTRA_ARGS/CLUSTER_GOGC changed; restarting"
		else
			log "reusing the running cluster at https://127.0.0.1:$APISERVER_PORT (use --fresh to restart)"
			return 0
		fi
	fi
	t0="$(now_us)"
	# A crashed or half-running previous cluster: stop whatever is left.
	stop_all
	STARTING=1
	prepare_state

	start_component etcd
	wait_until "etcd /health" etcd etcd_healthy
	start_component kube-apiserver
	wait_until "kube-apiserver /readyz" etcd,kube-apiserver readyz
	start_component kube-controller-manager
	start_component kube-scheduler
	start_component kwok
	create_node
	wait_until "ServiceAccount default/default" kube-apiserver,kube-controller-manager default_sa_exists
	wait_until "node $NODE_NAME Ready" kube-apiserver,kwok node_ready
	smoke_test
	STARTING=0
	log "cluster up in $(since "$t0"): https://127.0.0.1:$APISERVER_PORT"
	log "  export KUBECONFIG=$KUBECONFIG_ADMIN   (kubectl: $STATE_DIR/bin/kubectl)"
}

cmd_down() {
	lock
	stop_all
	remove_state
	log "cluster down"
}

cmd_status() {
	local c pid running=0
	for c in "${COMPONENTS[@]}"; do
		if pid="$(pid_of "$c")"; then
			printf '  %-24s running (pid %s)\n' "$c" "$pid"
			running=$((running + 1))
		else
			printf '  %-24s not running\n' "$c"
		fi
	done
	if readyz; then
		echo "  https://127.0.0.1:$APISERVER_PORT/readyz: ok"
		if ((running == ${#COMPONENTS[@]})); then
			echo "cluster is up (KUBECONFIG=$KUBECONFIG_ADMIN)"
			return 0
		fi
	fi
	if ((running == 0)); then
		echo "cluster is down"
	else
		echo "cluster is unhealthy ('up' restarts it)"
	fi
	return 1
}

restart_component() { # <name> <health check> <watched components>
	lock
	[[ -r "$RUN/$1.args" ]] || die "no cluster state in $STATE_DIR; run 'up' first"
	local t0
	t0="$(now_us)"
	stop_components "$1"
	start_component "$1"
	wait_until "$1 healthy after restart" "$3" "$2"
	wait_until "kube-apiserver /readyz" etcd,kube-apiserver readyz
	log "$1 restarted in $(since "$t0")"
}

# The second API server, started on demand (an idle one would still decode every
# write the tests and benchmarks make).
cmd_nogate() {
	lock
	readyz || die "the cluster is not up; run 'up' first"
	[[ -r "$RUN/$NOGATE.args" && -n "${APISERVER_NOGATE_PORT:-}" ]] ||
		die "this cluster was started without a second API server; run 'restart'"
	if ! pid_of "$NOGATE" >/dev/null; then
		ln -sfn kube-apiserver "$BIN_DIR/$NOGATE"
		start_component "$NOGATE"
		wait_until "$NOGATE /readyz" "etcd,$NOGATE" nogate_readyz
	fi
	echo "$KUBECONFIG_NOGATE"
}

cmd_env() {
	echo "export KUBECONFIG=$KUBECONFIG_ADMIN"
	echo "export PATH=$STATE_DIR/bin:\$PATH"
}

usage() { sed -n '/^# Usage:/,/^set -euo/{/^set /d;s/^# \{0,1\}//;p}' "$SCRIPT" >&2; }

main() {
	case "${1:-}" in
	build) cmd_build ;;
	up) cmd_up "${2:-}" ;;
	restart) cmd_up --fresh ;;
	down) cmd_down ;;
	status) cmd_status ;;
	restart-apiserver) restart_component kube-apiserver readyz etcd,kube-apiserver ;;
	restart-etcd) restart_component etcd etcd_healthy etcd ;;
	apiserver-without-gate) cmd_nogate ;;
	stop-apiserver-without-gate) lock && stop_components "$NOGATE" ;;
	env) cmd_env ;;
	-h | --help | help) usage ;;
	*)
		usage
		exit 2
		;;
	esac
}

# One line: bash has read it all before running, so editing this file while a
# command runs (e.g. a long build) cannot make bash read a half-edited file.
main "$@"; exit
