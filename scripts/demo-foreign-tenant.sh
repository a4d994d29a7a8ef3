#!/usr/bin/env bash
# `make demo-foreign-tenant` (issue 45): `make demo` with another operator's `Tenant` kind
# installed beside ours. Capsule's `tenants.capsule.clastix.io` is common in clusters;
# with it, a kind's short name resolves to whichever group kubectl's discovery prefers,
# and a demo or doc written with short names fails ("... not found") or shows the wrong
# object. The demo names every resource fully
# (`tenants.xyz.com/acme`): this runs it with the foreign CRD present, fails if the demo
# does, and leaves the cluster as it found it (the foreign CRD removed, the demo operator
# stopped; the demo's own objects stay, as after `make demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
K=("$ROOT/.cluster/bin/kubectl" --kubeconfig "$ROOT/.cluster/kubeconfig")
CRD=tenants.capsule.clastix.io

tests/cluster/cluster.sh up
cleanup() {
  scripts/demo.sh down || true
  "${K[@]}" delete customresourcedefinitions.apiextensions.k8s.io "$CRD" --ignore-not-found --wait=false >/dev/null || true
}
trap cleanup EXIT

# A stand-in for Capsule's CRD: same group, kind, plural and short name.
"${K[@]}" apply -f - <<EOF
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: $CRD
spec:
  group: capsule.clastix.io
  scope: Cluster
  names: {kind: Tenant, plural: tenants, singular: tenant, shortNames: [tnt]}
  versions:
    - name: v1beta2
      served: true
      storage: true
      schema:
        openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
EOF
"${K[@]}" wait --for=condition=Established --timeout=60s "customresourcedefinitions.apiextensions.k8s.io/$CRD"
# A foreign Tenant named like the demo's, so that a short name finding it would "work".
"${K[@]}" apply -f - <<EOF
apiVersion: capsule.clastix.io/v1beta2
kind: Tenant
metadata:
  name: acme
spec: {owners: [{kind: User, name: alice}]}
EOF

scripts/demo.sh up
# The demo's Tenant, by its full name, is Ready; the foreign one is untouched.
"${K[@]}" wait --for=condition=Ready --timeout=120s tenants.xyz.com/acme
if "${K[@]}" get tenants.capsule.clastix.io/acme -o jsonpath='{.metadata.finalizers}{.status}' | grep -q .; then
  echo "demo-foreign-tenant: the foreign Tenant was written to" >&2
  exit 1
fi
echo "demo-foreign-tenant: make demo succeeded with $CRD installed"
