//! Rules on disk for the fault scenarios: a temp rule directory, a rule for one parent kind
//! of group faults.rulebook.dev, its child entries, templates and CRD.

use super::*;

pub const GROUP: &str = "faults.rulebook.dev";
pub const API_VERSION: &str = "faults.rulebook.dev/v1";

// ---------------------------------------------------------------------------------------
// Rules on disk.

/// A temp dir with `rules/` and `templates/`.
pub struct RuleDir {
    _dir: tempfile::TempDir,
    pub rules: PathBuf,
    pub templates: PathBuf,
}

impl RuleDir {
    pub fn new() -> RuleDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let rules = dir.path().join("rules");
        let templates = dir.path().join("templates");
        std::fs::create_dir_all(&rules).unwrap();
        std::fs::create_dir_all(&templates).unwrap();
        RuleDir {
            _dir: dir,
            rules,
            templates,
        }
    }

    pub fn rule(&self, file: &str, text: &str) {
        std::fs::write(self.rules.join(file), text).unwrap();
    }

    /// An operator on these rules (see [`Operator::on`]).
    pub fn operator(&self) -> OperatorBuilder {
        Operator::on(&self.rules, &self.templates)
    }

    /// The most common operator of a test: these rules, watching namespace `ns`, the
    /// rules' CRDs installed (`--install-crds`).
    pub async fn start_in(&self, ns: &str) -> Operator {
        self.operator()
            .namespace(ns)
            .flags(&["--install-crds"])
            .start()
            .await
    }

    pub fn template(&self, rel: &str, text: &str) {
        let path = self.templates.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
}

pub fn plural(kind: &str) -> String {
    format!("{}s", kind.to_lowercase())
}

/// One child entry of a rule; `extra` are further keys, as YAML lines (`forEach: "..."`).
pub fn child(name: &str, api_version: &str, kind: &str, template: &str, extra: &[&str]) -> String {
    let mut s = format!(
        "    - name: {name}\n      apiVersion: {api_version}\n      kind: {kind}\n      template: {template}\n"
    );
    for e in extra {
        s.push_str(&format!("      {e}\n"));
    }
    s
}

/// A rule for `kind` with one ConfigMap child (`cm.yaml`) whose `deletionPolicy` is
/// `Orphan`.
pub fn orphan_rule(rule: &str, kind: &str) -> String {
    rule_text(
        rule,
        kind,
        &[child(
            "config",
            "v1",
            "ConfigMap",
            "cm.yaml",
            &["deletionPolicy: Orphan"],
        )],
    )
}

/// A rule named `name` for parent `kind` (group faults.rulebook.dev), with its CRD.
pub fn rule_text(name: &str, kind: &str, children: &[String]) -> String {
    format!(
        r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: {name}
spec:
  parent:
    apiVersion: {API_VERSION}
    kind: {kind}
  children:
{children}  crd:
    plural: {plural}
    specSchema:
      type: object
      x-kubernetes-preserve-unknown-fields: true
"#,
        children = children.concat(),
        plural = plural(kind),
    )
}

/// A ConfigMap template named `<parent>-<suffix>` whose data are `data` (YAML lines,
/// indented two spaces).
pub fn configmap_template(suffix: &str, data: &str) -> String {
    format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{{{ parent.metadata.name ~ \"-{suffix}\" }}}}\ndata:\n{data}"
    )
}

/// The CRD `rulebook crds` would install for `kind` (used where the operator must not
/// install it itself).
pub fn crd(kind: &str) -> Json {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{}.{GROUP}", plural(kind))},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": plural(kind), "singular": kind.to_lowercase(),
                      "kind": kind, "listKind": format!("{kind}List")},
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                    "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                }}},
            }],
        },
    })
}

pub fn crds_api(client: &kube::Client) -> Api<DynamicObject> {
    api(
        client,
        None,
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    )
}
