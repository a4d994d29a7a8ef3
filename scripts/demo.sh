#!/usr/bin/env bash
# `make demo`: the local control plane, Rulebook running on rules/ and templates/,
# the example parents, and what happened. Leaves everything running; `make demo-down`
# stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
KUBECONFIG=$ROOT/.cluster/kubeconfig
K=("$ROOT/.cluster/bin/kubectl" --kubeconfig "$KUBECONFIG")
PIDFILE=$ROOT/.cluster/pids/rulebook-demo.pid
LOG=$ROOT/.cluster/logs/rulebook-demo.log
ADDR=${RULEBOOK_DEMO_ADDR:-127.0.0.1:8080}
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

case "${1:-up}" in
down)
  if [[ -f $PIDFILE ]]; then
    pid=$(cat "$PIDFILE")
    if [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "rulebook run"; then
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 50); do [[ -d /proc/$pid ]] || break; sleep 0.2; done
      kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$PIDFILE"
  fi
  exit 0 ;;
up) ;;
*) echo "usage: $0 [up|down]" >&2; exit 2 ;;
esac

say "Building rulebook"
cargo build --quiet --bin rulebook
BIN=$ROOT/target/debug/rulebook

say "Checking the rules (no cluster needed)"
"$BIN" check --rules rules --templates templates

say "Starting the local control plane"
tests/cluster/cluster.sh up

say "Starting the operator (log: ${LOG#"$ROOT"/})"
"$0" down
mkdir -p "$(dirname "$PIDFILE")" "$(dirname "$LOG")"
RUST_LOG=${RUST_LOG:-info,kube=warn} setsid nohup "$BIN" run \
  --rules rules --templates templates --kubeconfig "$KUBECONFIG" \
  --install-crds --metrics-addr "$ADDR" </dev/null >"$LOG" 2>&1 &
echo $! >"$PIDFILE"
for i in $(seq 150); do
  if curl -fsS "http://$ADDR/readyz" >/dev/null 2>&1; then break; fi
  if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then tail -30 "$LOG"; echo "the operator exited" >&2; exit 1; fi
  [[ $i == 150 ]] && { tail -30 "$LOG"; echo "the operator did not become ready" >&2; exit 1; }
  sleep 0.2
done
CRD=customresourcedefinitions.apiextensions.k8s.io
"${K[@]}" wait --for=condition=Established --timeout=60s \
  $CRD/mywebs.operator.k8s-summit.org $CRD/myapps.app.example.com $CRD/projects.xyz.com \
  $CRD/teamapps.xyz.com $CRD/tenants.xyz.com

say "Creating the example parents (examples/*.yaml)"
"${K[@]}" apply -f examples/

say "Waiting until every parent is Ready"
"${K[@]}" wait --for=condition=Ready --timeout=120s mywebs.operator.k8s-summit.org/hello \
  myapps.app.example.com/shop projects.xyz.com/apollo teamapps.xyz.com/orders tenants.xyz.com/acme

PARENTS=mywebs.operator.k8s-summit.org,myapps.app.example.com,projects.xyz.com,teamapps.xyz.com,tenants.xyz.com
say "kubectl get $PARENTS"
"${K[@]}" get "$PARENTS"
say "Tenant acme: its namespace and what Rulebook put in it"
"${K[@]}" get resourcequotas,limitranges,rolebindings.rbac.authorization.k8s.io,networkpolicies.networking.k8s.io -n tenant-acme
say "The children Rulebook created (label app.kubernetes.io/managed-by=rulebook)"
"${K[@]}" get configmaps,secrets,services,deployments.apps -l app.kubernetes.io/managed-by=rulebook
say "MyWeb hello: status"
"${K[@]}" get mywebs.operator.k8s-summit.org/hello -o jsonpath='{.status}' | (command -v jq >/dev/null && jq . || cat); echo
say "Events on MyWeb hello"
"${K[@]}" get events --field-selector involvedObject.name=hello,involvedObject.kind=MyWeb \
  -o custom-columns=REASON:.reason,MESSAGE:.message --sort-by=.metadata.creationTimestamp 2>/dev/null || true
say "Operator metrics (http://$ADDR/metrics)"
curl -fsS "http://$ADDR/metrics" | grep -E '^rulebook_(reconciles_total|children_applied_total|api_writes_total|ruleset_valid)' || true

cat <<MSG

Rulebook is running (pid $(cat "$PIDFILE"), log ${LOG#"$ROOT"/}) against the local cluster.
Try:
  export KUBECONFIG=$KUBECONFIG; alias k=$ROOT/.cluster/bin/kubectl
  k scale deployments.apps/hello-web --replicas=5   # reverted to the spec's 2
  k delete configmaps/hello-html                 # recreated
  k patch mywebs.operator.k8s-summit.org/hello --type=merge -p '{"spec":{"replicas":3}}'
  k patch mywebs.operator.k8s-summit.org/hello --type=json -p '[{"op":"remove","path":"/spec/nodePortNumber"}]'  # the Service is pruned
  edit templates/myweb/configmap.yaml            # hot reload: every MyWeb's ConfigMap follows
  k create configmap payments-extra --from-literal=TIMEOUT=30s && k label configmaps/payments-extra team=payments
                                                 # referenced by TeamApp orders: its settings follow
  k delete secrets/orders-db                     # orders: Ready=False, ReferenceMissing; nothing pruned
  k annotate teamapps.xyz.com/orders rulebook.dev/paused=true   # hands off until the annotation goes
  curl http://$ADDR/status
Stop everything with: make demo-down
MSG
