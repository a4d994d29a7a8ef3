#!/usr/bin/env bash
# Runs every test binary of `make test` against the local control plane, several test
# binaries at a time. Why not plain `cargo test`: cargo runs its test binaries one after
# another, and most of ours spend their time waiting on the API server, on Leases and on
# measurement windows (the steady-state window alone is two minutes), so a warm `make
# test` took 20–30 minutes on 2 cores while the machine sat mostly idle. Every test gets
# its own namespace, kinds and operator process (tests/common/mod.rs), which is what lets
# cargo run a binary's tests side by side already; binaries side by side are the same.
#
# Two kinds of test must not overlap anything: `api_restart` restarts the API server, and
# three of the heavy fault tests (tests/faults_heavy.rs, every one #[ignore]d) restart the
# API server or etcd and measure recovery. They run after the rest, one at a time. The
# other heavy fault tests (SIGKILLs, poison parents, a reference flood in a memory
# cgroup) restart nothing: they run in the first step as one more binary, one test at a
# time, beside the others.
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

# Run alone, after everything else, in this order.
exclusive=(api_restart)
heavy=faults_heavy
# The heavy fault tests that restart the API server or etcd (run alone, in the second
# step); the others run in the first. A new heavy test that restarts either belongs here.
heavy_alone=(heavy_apiserver_restart_mid_convergence heavy_etcd_restart_mid_convergence
	heavy_watch_expired_while_paused)
# The first step's name for the heavy tests that restart nothing. Started second, it
# also installs the CRD of heavy_watch_expired_while_paused early (its first test, by
# name), so the garbage collector knows the kind long before that test runs alone.
heavy_shared=faults_heavy_shared

# Started first, longest first (their last durations), so the tail of the first step is
# short binaries rather than one long one started last.
long_first=(sharding $heavy_shared faults versions steady_state tenants webhook_certs hostile_templates
	sharding_fence sharding_rolling orphans sharding_dropped references deletion cheaper
	sharding_cluster sharding_renewal reconcile_examples hot_reload)

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

if [[ -z "${exe[$heavy]:-}" || -z "${exe[lib]:-}" ]]; then
	echo "scripts/test.sh: cargo named no test binaries (see $logs/build.json)" >&2
	exit 1
fi
exe[$heavy_shared]=${exe[$heavy]}
# The arguments of each first-step binary: the heavy tests that restart nothing, one at
# a time (each loads the cluster as much as a whole binary does), their progress printed.
declare -A args=()
skips=()
for t in "${heavy_alone[@]}"; do skips+=(--skip "$t"); done
args[$heavy_shared]="--ignored --test-threads=1 --nocapture ${skips[*]}"

# The first step's order: the long ones, then the rest by name.
order=()
declare -A queued=()
for n in "${long_first[@]}" lib core kube bin; do
	if [[ -n "${exe[$n]:-}" ]]; then
		order+=("$n")
		queued[$n]=1
	fi
done
for n in $(printf '%s\n' "${!exe[@]}" | sort); do
	[[ -n "${queued[$n]:-}" || "$n" == "$heavy" || "$n" == "$heavy_shared" ]] && continue
	skip=""
	for x in "${exclusive[@]}"; do [[ "$n" == "$x" ]] && skip=1; done
	[[ -n "$skip" ]] && continue
	order+=("$n")
done

failed=()
declare -A pid_name=() pid_start=()
# Background jobs ignore Ctrl-C in a script: whenever the script ends, stop the test
# binaries still running with the operators they started (each binary runs in a process
# group of its own).
stop_running() {
	local p
	for p in "${!pid_name[@]}"; do kill -- "-$p" 2>/dev/null; done
}
trap stop_running EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Prints one finished binary's line and records a failure.
finish() {
	local name=$1 rc=$2 took=$3 summary
	summary=$(grep -E '^test result:' "$logs/$name.log" | tail -1)
	if ((rc == 0)); then
		printf '  ok      %-22s %4ss  %s\n' "$name" "$took" "$summary"
	else
		printf '  FAILED  %-22s %4ss  %s (exit %s; %s)\n' "$name" "$took" "$summary" "$rc" "$logs/$name.log"
		failed+=("$name")
	fi
}

echo "scripts/test.sh: ${#order[@]} test binaries, $jobs at a time"
step1=$(date +%s)
for name in "${order[@]}"; do
	while ((${#pid_name[@]} >= jobs)); do
		wait -n -p done_pid
		rc=$?
		finish "${pid_name[$done_pid]}" "$rc" $(($(date +%s) - pid_start[$done_pid]))
		unset "pid_name[$done_pid]" "pid_start[$done_pid]"
	done
	# shellcheck disable=SC2086 # the arguments are words
	setsid "${exe[$name]}" ${args[$name]:-} >"$logs/$name.log" 2>&1 &
	pid_name[$!]=$name
	pid_start[$!]=$(date +%s)
done
while ((${#pid_name[@]} > 0)); do
	wait -n -p done_pid
	rc=$?
	finish "${pid_name[$done_pid]}" "$rc" $(($(date +%s) - pid_start[$done_pid]))
	unset "pid_name[$done_pid]" "pid_start[$done_pid]"
done
step1_took=$(($(date +%s) - step1))

echo "scripts/test.sh: the tests that restart the API server, one at a time"
step2=$(date +%s)
for name in "${exclusive[@]}"; do
	if [[ -z "${exe[$name]:-}" ]]; then
		echo "  FAILED  $name: cargo built no such test binary" >&2
		failed+=("$name")
		continue
	fi
	t0=$(date +%s)
	"${exe[$name]}" >"$logs/$name.log" 2>&1
	finish "$name" $? $(($(date +%s) - t0))
done
# The heavy fault tests print their progress as they go (docs/faults.md).
echo "scripts/test.sh: the heavy fault tests that restart the API server or etcd, one at a time"
t0=$(date +%s)
"${exe[$heavy]}" --ignored --test-threads=1 --nocapture --exact "${heavy_alone[@]}" 2>&1 |
	tee "$logs/$heavy.log"
rc=${PIPESTATUS[0]}
# --exact with a misspelt name runs nothing and passes: count what ran.
ran=$(grep -cE '^test heavy_[a-z0-9_]+ \.\.\. ' "$logs/$heavy.log")
if ((rc == 0 && ran != ${#heavy_alone[@]})); then
	echo "scripts/test.sh: $heavy ran $ran of the ${#heavy_alone[@]} tests in heavy_alone" >>"$logs/$heavy.log"
	rc=1
fi
finish "$heavy" "$rc" $(($(date +%s) - t0))
step2_took=$(($(date +%s) - step2))

for name in "${failed[@]}"; do
	echo
	echo "==================== $name ($logs/$name.log) ===================="
	cat "$logs/$name.log"
done
echo
echo "scripts/test.sh: $(($(date +%s) - started))s in all: ${step1_took}s for ${#order[@]} binaries $jobs at a time, ${step2_took}s for the ones run alone"
if ((${#failed[@]} > 0)); then
	echo "scripts/test.sh: FAILED: ${failed[*]}" >&2
	exit 1
fi
