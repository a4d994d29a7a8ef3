#!/usr/bin/env bash
# Runs every test binary of `make test` against the local control plane, several test
# binaries at a time. Why not plain `cargo test`: cargo runs its test binaries one after
# another, and most of ours spend their time waiting on the API server, on Leases and on
# measurement windows (the steady-state window alone is two minutes), so a warm `make
# test` took 20–30 minutes on 2 cores while the machine sat mostly idle. Every test gets
# its own namespace, kinds and operator process (tests/common/mod.rs), which is what lets
# cargo run a binary's tests side by side already; binaries side by side are the same.
#
# Two kinds of test must not share the cluster with anything: `api_restart` restarts the
# API server, and three of the heavy fault tests (tests/faults_heavy.rs, every one
# #[ignore]d) restart the API server or etcd and measure recovery. They run on a second
# local control plane of their own (.cluster-restarts), one at a time, in a lane beside
# the first step (scripts/test-restarts.sh, which names them); until 2026-11-29 they ran
# alone after everything else, 90–150 s of a warm run. The other heavy fault tests
# (SIGKILLs, poison parents, a reference flood in a memory cgroup) restart nothing: they
# run in the first step as one more binary, one test at a time, beside the others.
#
# Each binary's output goes to $CARGO_TARGET_DIR/test-logs/<name>.log; a failed binary's
# log is printed in full at the end. Like `cargo test --no-fail-fast`, everything runs
# even when something failed; the exit code is 1 when anything did.
#
#   TEST_JOBS      binaries at a time in the first step (default 4)
#   RULEBOOK_TEST_KUBECONFIG  the cluster, as for cargo test (the Makefile sets it)
set -uo pipefail
cd "$(dirname "$0")/.."

jobs="${TEST_JOBS:-4}"
if ! [[ "$jobs" =~ ^[1-9][0-9]*$ ]]; then
	echo "scripts/test.sh: TEST_JOBS must be a positive number, not '$jobs'" >&2
	exit 2
fi
target="${CARGO_TARGET_DIR:-target}"
logs="$target/test-logs"
rm -rf "$logs"
mkdir -p "$logs"

# On the second control plane (scripts/test-restarts.sh): api_restart, and the heavy
# fault tests it lists.
restarts=api_restart
heavy=faults_heavy
mapfile -t heavy_restarts < <(scripts/test-restarts.sh --list)
# Without the list, the first step would run the restart tests on the shared cluster.
if ((${#heavy_restarts[@]} == 0)); then
	echo "scripts/test.sh: scripts/test-restarts.sh --list named no tests" >&2
	exit 1
fi
# The first step's name for the heavy tests that restart nothing.
heavy_shared=faults_heavy_shared

# The first step starts the longest binaries first, so that its tail is short binaries
# rather than one long one started last (in the first warm run of 2026-11-29 `rollout`
# and `webhook_sharded`, started last by name, kept it 45 s longer). The durations are
# each binary's in the last run ($target/test-durations, written after the first step);
# a binary the last run did not have starts first, as it may be long. Without that file
# (a new target directory): long_first, by the durations of 2026-11-29, then by name.
durations="$target/test-durations"
long_first=($heavy_shared sharding versions faults tenants steady_state sharding_fence rollout
	webhook_certs sharding_rolling webhook_sharded orphans deletion references
	sharding_dropped hot_reload admission_cel diff sharding_cluster git_source
	deploy_manifests decorators cheaper operations)

started=$(date +%s)
echo "scripts/test.sh: building the test binaries"
if ! cargo test --locked --lib --bins --tests --no-run --message-format=json-render-diagnostics \
	>"$logs/build.json"; then
	echo "scripts/test.sh: building the tests failed" >&2
	exit 1
fi

# name<TAB>executable for every test binary: the library's unit tests are "lib", the
# binary's "bin", the integration tests by file name.
declare -A exe=()
while IFS=$'\t' read -r name path; do
	exe[$name]=$path
done < <(python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    # The test harnesses only, not the rulebook binary the tests run.
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    if not m.get("profile", {}).get("test"):
        continue
    t = m["target"]
    kind = t["kind"][0]
    if kind in ("lib", "bin", "test"):
        name = t["name"] if kind == "test" else kind
        # The pure core (crates/rulebook-core) and the kube layer (crates/rulebook-kube)
        # have unit tests of their own.
        if kind == "lib" and "rulebook-core" in m.get("package_id", ""):
            name = "core"
        if kind == "lib" and "rulebook-kube" in m.get("package_id", ""):
            name = "kube"

        print(name + "\t" + m["executable"])
' <"$logs/build.json")

if [[ -z "${exe[$heavy]:-}" || -z "${exe[lib]:-}" || -z "${exe[$restarts]:-}" ]]; then
	echo "scripts/test.sh: cargo named no test binaries (see $logs/build.json)" >&2
	exit 1
fi
exe[$heavy_shared]=${exe[$heavy]}
# The arguments of each first-step binary: the heavy tests that restart nothing, one at
# a time (each loads the cluster as much as a whole binary does), their progress printed.
declare -A args=()
skips=()
for t in "${heavy_restarts[@]}"; do skips+=(--skip "$t"); done
args[$heavy_shared]="--ignored --test-threads=1 --nocapture ${skips[*]}"

# The first step's order (see long_first above).
order=()
declare -A queued=()
queue() {
	[[ -n "${exe[$1]:-}" && -z "${queued[$1]:-}" && "$1" != "$heavy" && "$1" != "$restarts" ]] || return 0
	order+=("$1")
	queued[$1]=1
}
mapfile -t all < <(printf '%s\n' "${!exe[@]}" | sort)
if [[ -s "$durations" ]]; then
	declare -A last=()
	while read -r n took; do last[$n]=$took; done <"$durations"
	for n in "${all[@]}"; do [[ -n "${last[$n]:-}" ]] || queue "$n"; done
	while read -r n _; do queue "$n"; done < <(sort -k2,2nr "$durations")
else
	for n in "${long_first[@]}" "${all[@]}"; do queue "$n"; done
fi

failed=()
declare -A pid_name=() pid_start=()
# Background jobs ignore Ctrl-C in a script: whenever the script ends, stop the test
# binaries still running with the operators they started (each binary runs in a process
# group of its own).
stop_running() {
	local p
	for p in "${!pid_name[@]}" ${restarts_pid:-}; do kill -- "-$p" 2>/dev/null; done
}
trap stop_running EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Prints one finished binary's line and records a failure.
finish() {
	local name=$1 rc=$2 took=$3 summary
	summary=$(grep -E '^test result:' "$logs/$name.log" 2>/dev/null | tail -1)
	if [[ "$rc" == 0 ]]; then
		printf '  ok      %-22s %4ss  %s\n' "$name" "$took" "$summary"
	else
		printf '  FAILED  %-22s %4ss  %s (exit %s; %s)\n' "$name" "$took" "$summary" "$rc" "$logs/$name.log"
		failed+=("$name")
	fi
}

# Waits for one of the first step's binaries (or the restarts lane) to end and prints it.
reap() {
	local done_pid rc
	wait -n -p done_pid
	rc=$?
	if [[ "$done_pid" == "${restarts_pid:-}" ]]; then
		# Forgotten at once: a later binary may be given the same pid.
		restarts_done=1
		unset restarts_pid
		return
	fi
	local took=$(($(date +%s) - pid_start[$done_pid]))
	finish "${pid_name[$done_pid]}" "$rc" "$took"
	echo "${pid_name[$done_pid]} $took" >>"$logs/durations"
	unset "pid_name[$done_pid]" "pid_start[$done_pid]"
}

echo "scripts/test.sh: the tests that restart the API server or etcd, on a second control plane beside the rest (scripts/test-restarts.sh)"
restarts_done=""
setsid scripts/test-restarts.sh "$logs" "${exe[$restarts]}" "${exe[$heavy]}" >"$logs/test-restarts.out" 2>&1 &
restarts_pid=$!

echo "scripts/test.sh: ${#order[@]} test binaries, $jobs at a time, from ${order[*]:0:6} ..."
step1=$(date +%s)
for name in "${order[@]}"; do
	while ((${#pid_name[@]} >= jobs)); do
		reap
	done
	# shellcheck disable=SC2086 # the arguments are words
	setsid "${exe[$name]}" ${args[$name]:-} >"$logs/$name.log" 2>&1 &
	pid_name[$!]=$name
	pid_start[$!]=$(date +%s)
done
while ((${#pid_name[@]} > 0)); do
	reap
done
step1_took=$(($(date +%s) - step1))
cp "$logs/durations" "$durations"

echo "scripts/test.sh: the tests on the second control plane (.cluster-restarts), one at a time"
[[ -n "$restarts_done" ]] || wait "$restarts_pid"
unset restarts_pid
touch "$logs/restarts.results"
# name, exit code, seconds: the cluster's start, then each test binary run.
ran=()
restarts_took=0
while read -r name rc took; do
	ran+=("$name")
	finish "$name" "$rc" "$took"
	restarts_took=$((restarts_took + took))
done <"$logs/restarts.results"
for name in cluster-restarts faults_heavy_early "$restarts" "$heavy"; do
	if [[ " ${ran[*]} " != *" $name "* ]]; then
		echo "  FAILED  $name: did not run (see $logs/test-restarts.out and $logs/cluster-restarts.log)"
		failed+=("$name")
	fi
done
# The heavy fault tests' figures (docs/faults.md; a failed binary's log is printed below).
if [[ " ${failed[*]} " != *" $heavy "* ]]; then cat "$logs/$heavy.log"; fi

for name in "${failed[@]}"; do
	echo
	echo "==================== $name ($logs/$name.log) ===================="
	cat "$logs/$name.log"
done
echo
echo "scripts/test.sh: $(($(date +%s) - started))s in all: ${step1_took}s for ${#order[@]} binaries $jobs at a time, ${restarts_took}s for the second control plane's lane beside them"
if ((${#failed[@]} > 0)); then
	echo "scripts/test.sh: FAILED: ${failed[*]}" >&2
	exit 1
fi
