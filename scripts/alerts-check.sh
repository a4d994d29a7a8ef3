#!/usr/bin/env bash
# `make alerts` (part of `make test`): `promtool check rules` and `promtool test rules` on
# Rulebook's alerts. The source is the PrometheusRule deploy/prometheus/prometheusrule.yaml
# (what a prometheus-operator cluster applies); promtool reads plain rule files, so its
# spec is written to rulebook.rules.yaml in a scratch directory next to a copy of the unit
# tests (deploy/prometheus/tests/alerts.test.yaml), which name that file.
#
# promtool comes from tests/tools/tools.sh (built from the Go module proxy, cached under
# ~/.cache/rulebook/tools/; `make tools` builds it). A missing promtool fails: never a skip.
set -euo pipefail
cd "$(dirname "$0")/.."

promtool="$(tests/tools/tools.sh path promtool)" || {
	echo "scripts/alerts-check.sh: promtool is missing: run \`make tools\`" >&2
	exit 1
}
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

python3 - deploy/prometheus/prometheusrule.yaml "$tmp/rulebook.rules.yaml" <<'PY'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
assert doc["kind"] == "PrometheusRule", "not a PrometheusRule"
yaml.safe_dump({"groups": doc["spec"]["groups"]}, open(sys.argv[2], "w"), sort_keys=False)
PY
cp deploy/prometheus/tests/*.test.yaml "$tmp/"

# Every alert has a unit test that expects it to fire (and one where it does not).
python3 - "$tmp/rulebook.rules.yaml" "$tmp"/*.test.yaml <<'PY'
import sys, yaml
alerts = {r["alert"] for g in yaml.safe_load(open(sys.argv[1]))["groups"] for r in g["rules"] if "alert" in r}
fired, quiet = set(), set()
for f in sys.argv[2:]:
    for t in yaml.safe_load(open(f))["tests"]:
        for a in t.get("alert_rule_test", []):
            (fired if a.get("exp_alerts") else quiet).add(a["alertname"])
missing = sorted((alerts - fired) | (alerts - quiet))
if missing:
    sys.exit(f"scripts/alerts-check.sh: alerts without a firing and a not-firing unit test: {missing}")
print(f"scripts/alerts-check.sh: {len(alerts)} alerts, each tested firing and not firing")
PY

"$promtool" check rules "$tmp/rulebook.rules.yaml"
(cd "$tmp" && "$promtool" test rules ./*.test.yaml)
