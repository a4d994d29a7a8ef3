//! A manifest copied into a template means what it meant to kubectl (issue 47, part 1):
//! the same Pod, once read by `kubectl create --dry-run=client -o json` (the local control
//! plane's kubectl, which reads YAML as `sigs.k8s.io/yaml` does: YAML 1.1 scalars) and
//! once rendered by `rulebook render` from a template with the same text, gives the same
//! values for the scalars whose reading differs between YAML 1.1 and 1.2: `0400` (octal:
//! a file mode of 0400, not decimal 400 = 0620), `yes`/`off`, `0x1F`, `1e3`, and a
//! sexagesimal-looking `190:20:30` (a string to both).

mod common;

use common::*;
use serde_json::Value as Json;

const POD: &str = "apiVersion: v1
kind: Pod
metadata:
  name: yaml11
  namespace: default
  annotations:
    clock: 190:20:30
spec:
  hostNetwork: yes
  hostPID: off
  terminationGracePeriodSeconds: 0x1F
  activeDeadlineSeconds: 1e3
  containers:
    - name: app
      image: registry.example.com/app:1
  volumes:
    - name: creds
      secret:
        secretName: creds
        defaultMode: 0400
";

/// The values compared, by JSON pointer.
const POINTERS: &[&str] = &[
    "/metadata/annotations/clock",
    "/spec/hostNetwork",
    "/spec/hostPID",
    "/spec/terminationGracePeriodSeconds",
    "/spec/activeDeadlineSeconds",
    "/spec/volumes/0/secret/defaultMode",
];

#[test]
fn a_template_reads_its_scalars_as_kubectl_reads_the_manifest() {
    let kubectl = repo().join(".cluster/bin/kubectl");
    assert!(
        kubectl.exists(),
        "{} is missing: run `make cluster` (it builds kubectl)",
        kubectl.display()
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let manifest = dir.path().join("pod.yaml");
    std::fs::write(&manifest, POD).expect("write");
    let out = std::process::Command::new(&kubectl)
        .args(["create", "--dry-run=client", "-o", "json", "-f"])
        .arg(&manifest)
        .env("KUBECONFIG", kubeconfig_path())
        .output()
        .expect("run kubectl");
    assert!(
        out.status.success(),
        "kubectl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let by_kubectl: Json = serde_json::from_slice(&out.stdout).expect("kubectl's JSON");

    // The same text as a child template of a rule on a test kind.
    let rules = dir.path().join("rules");
    let templates = dir.path().join("templates");
    std::fs::create_dir_all(&rules).expect("mkdir");
    std::fs::create_dir_all(&templates).expect("mkdir");
    std::fs::write(
        rules.join("y.yaml"),
        "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: yaml11\nspec:\n  parent:\n    apiVersion: yaml.rulebook.dev/v1\n    kind: Holder\n  children:\n    - name: pod\n      apiVersion: v1\n      kind: Pod\n      template: pod.yaml\n",
    )
    .expect("write");
    std::fs::write(templates.join("pod.yaml"), POD).expect("write");
    let parent = dir.path().join("holder.yaml");
    std::fs::write(
        &parent,
        "apiVersion: yaml.rulebook.dev/v1\nkind: Holder\nmetadata:\n  name: h\n  namespace: default\nspec: {}\n",
    )
    .expect("write");
    let text = rulebook(&[
        "render",
        "--rules",
        rules.to_str().unwrap(),
        "--templates",
        templates.to_str().unwrap(),
        "-f",
        parent.to_str().unwrap(),
    ]);
    let rendered = yaml_objects(&text);
    assert_eq!(rendered.len(), 1, "{text}");
    for p in POINTERS {
        let (k, r) = (by_kubectl.pointer(p), rendered[0].pointer(p));
        println!("{p}: kubectl {k:?}, rulebook {r:?}");
        assert!(k.is_some(), "kubectl dropped {p}: {by_kubectl}");
        // Numbers compare by value (kubectl prints 1e3 into an int64 field as 1000).
        let same = match (k.and_then(Json::as_f64), r.and_then(Json::as_f64)) {
            (Some(a), Some(b)) => a == b,
            _ => k == r,
        };
        assert!(same, "{p}: kubectl reads {k:?}, rulebook {r:?}");
    }
    assert_eq!(
        rendered[0].pointer("/spec/volumes/0/secret/defaultMode"),
        Some(&serde_json::json!(256)),
        "0400 is the file mode 0400"
    );
}
