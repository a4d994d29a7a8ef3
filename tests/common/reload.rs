//! Rules for the hot-reload and orphan tests: a rule per parent kind (group
//! `reload.rulebook.dev`, its CRD installed by the operator) with one ConfigMap child,
//! and extra children to add to it.

use std::path::Path;
use std::time::Duration;

use kube::api::{Api, DynamicObject};
use serde_json::{Value as Json, json};

use super::{api, wait_for};

const T: Duration = Duration::from_secs(120);

/// Writes a rule for `kind` (group `reload.rulebook.dev`) whose ConfigMap child carries `marker`.
pub fn write_rule(rules: &Path, templates: &Path, kind: &str, marker: &str) {
    let lower = kind.to_lowercase();
    std::fs::create_dir_all(rules).unwrap();
    std::fs::create_dir_all(templates.join(&lower)).unwrap();
    std::fs::write(
        rules.join(format!("{lower}.yaml")),
        format!(
            r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: {lower}
spec:
  parent:
    apiVersion: reload.rulebook.dev/v1
    kind: {kind}
  children:
    - name: config
      apiVersion: v1
      kind: ConfigMap
      template: {lower}/config.yaml
  status:
    marker: "$.children.config.data.marker"
  crd:
    plural: {lower}s
    specSchema:
      type: object
      x-kubernetes-preserve-unknown-fields: true
"#
        ),
    )
    .unwrap();
    write_template(templates, kind, marker);
}

pub fn write_template(templates: &Path, kind: &str, marker: &str) {
    let lower = kind.to_lowercase();
    std::fs::write(
        templates.join(&lower).join("config.yaml"),
        format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{{{ parent.metadata.name }}}}\ndata:\n  marker: \"{marker}\"\n"
        ),
    )
    .unwrap();
}

pub fn parent(kind: &str, ns: &str, name: &str) -> Json {
    json!({"apiVersion": "reload.rulebook.dev/v1", "kind": kind,
           "metadata": {"name": name, "namespace": ns}, "spec": {}})
}

pub async fn parents_api(client: &kube::Client, ns: &str, kind: &str) -> Api<DynamicObject> {
    let a = api(
        client,
        Some(ns),
        "reload.rulebook.dev/v1",
        kind,
        &format!("{}s", kind.to_lowercase()),
    );
    wait_for(T, &format!("the {kind} CRD to be served"), || async {
        a.list(&Default::default()).await.ok().map(|_| ())
    })
    .await;
    a
}

/// An extra child for [`with_children`]: its name in the rule, kind, a line of its entry
/// (`deletionPolicy: Orphan`, or none), and its object's content below `metadata`; the
/// object is named `<parent>-<name>`.
pub struct Extra<'a> {
    pub name: &'a str,
    pub kind: &'a str,
    pub line: &'a str,
    pub body: &'a str,
}

/// [`write_rule`]'s rule for `kind` with `extra` v1 children (before its `config` child
/// when `first`, after it otherwise), and their templates; returns the rule without them.
pub fn with_children(
    rules: &Path,
    templates: &Path,
    kind: &str,
    extra: &[Extra],
    first: bool,
) -> String {
    let lower = kind.to_lowercase();
    write_rule(rules, templates, kind, "x");
    let rule_file = rules.join(format!("{lower}.yaml"));
    let plain = std::fs::read_to_string(&rule_file).unwrap();
    let mut entries = String::new();
    for e in extra {
        entries += &format!(
            "    - name: {}\n      apiVersion: v1\n      kind: {}\n      template: {lower}/{}.yaml\n",
            e.name, e.kind, e.name
        );
        if !e.line.is_empty() {
            entries += &format!("      {}\n", e.line);
        }
        std::fs::write(
            templates.join(&lower).join(format!("{}.yaml", e.name)),
            format!(
                "apiVersion: v1\nkind: {}\nmetadata:\n  name: {{{{ parent.metadata.name ~ \"-{}\" }}}}\n{}",
                e.kind, e.name, e.body
            ),
        )
        .unwrap();
    }
    let with = if first {
        plain.replace("  children:\n", &format!("  children:\n{entries}"))
    } else {
        plain.replace("  status:", &format!("{entries}  status:"))
    };
    std::fs::write(&rule_file, with).unwrap();
    plain
}
