#!/usr/bin/env python3
"""`make openapi`: save the built-in kinds' OpenAPI v3 schemas from a running API server.

`rulebook check` and `rulebook test` check rendered children against their kinds' schemas
(docs/reference/schemas.md); without `--kubeconfig` or `--openapi` they use the set saved
here, built into the binary (src/cli/schemas/builtin.rs). One file per built-in
group-version (`api__v1.json`, `apis__apps__v1.json`), under `openapi/v<major>.<minor>/`:
only `components.schemas` (the paths are not needed), without descriptions, one schema per
line in name order, so a new Kubernetes version's diff reads schema by schema. About
0.5 MB for v1.36 (60 kB gzipped): small enough to keep every built-in group.

Usage: scripts/openapi-save.py [--kubectl PATH] [--out DIR]   (KUBECONFIG from the environment)
"""

import argparse
import json
import os
import subprocess
import sys


def kubectl(cmd, *args):
    return subprocess.run([cmd, *args], check=True, capture_output=True, text=True).stdout


def built_in(path):
    """A group-version of Kubernetes itself: the core group, or a group named without a
    dot or ending in .k8s.io; not a CRD's group, not a group's own index."""
    if path == "api/v1":
        return True
    parts = path.split("/")
    if len(parts) != 3 or parts[0] != "apis":
        return False
    group = parts[1]
    return "." not in group or group.endswith(".k8s.io")


def strip(x):
    """A schema without its descriptions (a property named `description` stays)."""
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if k == "description":
                continue
            if k == "properties" and isinstance(v, dict):
                out[k] = {name: strip(s) for name, s in v.items()}
            else:
                out[k] = strip(v)
        return out
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x


def write(doc, path):
    schemas = {k: strip(v) for k, v in doc.get("components", {}).get("schemas", {}).items()}
    lines = [
        json.dumps(name) + ":" + json.dumps(schemas[name], sort_keys=True, separators=(",", ":"))
        for name in sorted(schemas)
    ]
    with open(path, "w") as f:
        f.write('{"components":{"schemas":{\n' + ",\n".join(lines) + "\n}}}\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubectl", default=os.environ.get("KUBECTL", "kubectl"))
    ap.add_argument("--out", help="default: openapi/v<major>.<minor> of the server")
    args = ap.parse_args()
    version = json.loads(kubectl(args.kubectl, "version", "-o", "json"))["serverVersion"]
    out = args.out or os.path.join("openapi", f"v{version['major']}.{version['minor'].rstrip('+')}")
    index = json.loads(kubectl(args.kubectl, "get", "--raw", "/openapi/v3"))["paths"]
    os.makedirs(out, exist_ok=True)
    for old in os.listdir(out):
        if old.endswith(".json"):
            os.remove(os.path.join(out, old))
    saved = 0
    for path in sorted(p for p in index if built_in(p)):
        doc = json.loads(kubectl(args.kubectl, "get", "--raw", "/openapi/v3/" + path))
        write(doc, os.path.join(out, path.replace("/", "__") + ".json"))
        saved += 1
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"openapi: {saved} group-versions of Kubernetes {version['gitVersion']} in {out} ({size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
