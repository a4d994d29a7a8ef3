#!/usr/bin/env bash
# The tests that restart the API server or etcd, on a local control plane of their own,
# beside the rest of `make test` (scripts/test.sh starts this script next to its first
# step). Why a second control plane: a restart refuses every connection of everything
# else on the cluster for seconds, so these tests ran alone after all the others and
# added 90–150 s to a warm `make test` (issue 42's ≤ 10 min). On their own cluster they
# restart nothing the others use; an idle control plane costs 4 % of one core, and a
# fresh one restarts in seconds rather than after a whole suite's objects.
#
# The cluster is tests/cluster/cluster.sh with RULEBOOK_CLUSTER_DIR=<repo>/.cluster-restarts
# (other ports, its own etcd); started fresh here and stopped at the end, whatever
# happened (`make cluster-down` stops it too). The tests find it through
# RULEBOOK_TEST_KUBECONFIG, and restart it through their cluster.sh calls, which follow
# the kubeconfig's directory (tests/common `cluster_sh_command`). One test at a time, in
# this order:
#   1. `heavy_kinds_of_the_tests_run_alone_installed_early`: the paused test's CRD, so the
#      garbage collector discovers the kind (every 30 s) while the tests below run;
#   2. `api_restart`;
#   3. the heavy fault tests that restart the API server or etcd (`heavy_alone` below).
#
# Usage: scripts/test-restarts.sh <logs dir> <api_restart executable> <faults_heavy executable>
#        scripts/test-restarts.sh --list   (the faults_heavy tests run here, one a line)
# Writes "<name> <exit code> <seconds>" per test to <logs dir>/restarts.results, each
# test's output to <logs dir>/<name>.log; exits 0 (scripts/test.sh judges the results).
set -uo pipefail
cd "$(dirname "$0")/.."

# The heavy fault tests that restart the API server or etcd. A new heavy test that
# restarts either belongs here (scripts/test.sh skips every one of --list in its first
# step).
heavy_alone=(heavy_apiserver_restart_mid_convergence heavy_etcd_restart_mid_convergence
	heavy_watch_expired_while_paused)
early=heavy_kinds_of_the_tests_run_alone_installed_early

if [[ "${1:-}" == --list ]]; then
	printf '%s\n' "$early" "${heavy_alone[@]}"
	exit 0
fi
if (($# != 3)); then
	echo "usage: $0 <logs dir> <api_restart executable> <faults_heavy executable>" >&2
	exit 2
fi
logs=$1 api_restart=$2 heavy=$3
results="$logs/restarts.results"
: >"$results"

export RULEBOOK_CLUSTER_DIR="$PWD/.cluster-restarts"
export RULEBOOK_TEST_KUBECONFIG="$RULEBOOK_CLUSTER_DIR/kubeconfig"
cluster_log="$logs/cluster-restarts.log"
down() { tests/cluster/cluster.sh down >>"$cluster_log" 2>&1; }
trap down EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

record() { # <name> <exit code> <start seconds>
	echo "$1 $2 $(($(date +%s) - $3))" >>"$results"
}

# faults_heavy --exact with a misspelt name runs nothing and passes: the exit code, or 1
# when fewer than <n> tests ran.
ran_all() { # <exit code> <log> <n>
	local ran
	ran=$(grep -cE '^test heavy_[a-z0-9_]+ \.\.\. ' "$2")
	if (($1 == 0 && ran != $3)); then
		echo "scripts/test-restarts.sh: faults_heavy ran $ran of the $3 tests named" >>"$2"
		echo 1
	else
		echo "$1"
	fi
}

# Once more if the first start fails: its ports are picked free, then bound by the
# components a few seconds later, while the first step opens connections by the hundred.
t0=$(date +%s)
tests/cluster/cluster.sh up --fresh >"$cluster_log" 2>&1 ||
	tests/cluster/cluster.sh up --fresh >>"$cluster_log" 2>&1
rc=$?
record cluster-restarts "$rc" "$t0"
((rc == 0)) || exit 0

t0=$(date +%s)
"$heavy" --ignored --exact --nocapture "$early" >"$logs/faults_heavy_early.log" 2>&1
record faults_heavy_early "$(ran_all $? "$logs/faults_heavy_early.log" 1)" "$t0"

t0=$(date +%s)
"$api_restart" >"$logs/api_restart.log" 2>&1
record api_restart $? "$t0"

t0=$(date +%s)
"$heavy" --ignored --test-threads=1 --nocapture --exact "${heavy_alone[@]}" >"$logs/faults_heavy.log" 2>&1
record faults_heavy "$(ran_all $? "$logs/faults_heavy.log" ${#heavy_alone[@]})" "$t0"
exit 0
