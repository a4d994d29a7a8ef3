//! Where a rule's `cel:` rules are enforced, and the objects that make the API server
//! enforce them: pure functions of the rule, printed by `rulebook render`, dry-run by
//! `rulebook check --kubeconfig`, applied by the one writer (`src/policies.rs`).
//!
//! - A `cel:` check of a rule that defines its parent's CRD goes into the CRD's
//!   `x-kubernetes-validations` (at the schema's root: `self` is the object, `oldSelf` the
//!   stored one), unless CRD validation cannot express it: it reads `self.metadata`
//!   beyond `name` and `generateName` (all a CRD rule sees of metadata), or it narrows
//!   `operations` (a CRD rule runs on every write; a transition rule on updates only).
//!   It also goes to a policy when the CRD has several versions (`spec.crd.versions`): a
//!   CRD rule runs in the request's version, a policy in the rule's (`matchPolicy:
//!   Equivalent`).
//! - Every other `cel:` check (built-in or foreign parent kinds, and the cases above)
//!   goes into a generated `ValidatingAdmissionPolicy` with its binding
//!   (`validationActions: [Deny]`), scoped to the parent's resource and to the operations
//!   the check runs on: `self` becomes `object` and `oldSelf` `oldObject`. Checks that run
//!   on different operations go into different policies (`-create`, `-update`), so that a
//!   transition rule never runs on a create.
//! - `cel:` defaults go into a `MutatingAdmissionPolicy` with its binding: a field is set
//!   only while absent.
//!
//! Names: `rulebook-<rule>[-create|-update]`, a policy and its binding alike. Labels:
//! Rulebook's (`app.kubernetes.io/managed-by`), the rule, and the installation (`run
//! --lease-name`), by which the writer finds the policies of rules that are gone.

use serde_json::{Value as Json, json};

use super::{Rule, ValidateRule};
use crate::meta::labels::{MANAGED_BY as MANAGED_BY_LABEL, MANAGED_BY_VALUE};
use crate::meta::split_api_version;

/// The four kinds, with their plurals.
pub const KINDS: [(&str, &str); 4] = [
    ("ValidatingAdmissionPolicy", "validatingadmissionpolicies"),
    (
        "ValidatingAdmissionPolicyBinding",
        "validatingadmissionpolicybindings",
    ),
    ("MutatingAdmissionPolicy", "mutatingadmissionpolicies"),
    (
        "MutatingAdmissionPolicyBinding",
        "mutatingadmissionpolicybindings",
    ),
];

/// The label naming the installation (`run --lease-name`) a policy belongs to.
pub const INSTALLATION_LABEL: &str = "rulebook.dev/installation";
/// The API group and version of the policies.
pub const API_VERSION: &str = "admissionregistration.k8s.io/v1";

/// Where one `cel:` check is enforced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// The CRD's `x-kubernetes-validations`.
    Crd,
    /// A `ValidatingAdmissionPolicy`, and why not the CRD.
    Policy(String),
}

/// One `cel:` check, placed.
#[derive(Clone, Debug)]
pub struct Placed<'a> {
    /// Its index in `spec.admission.validate`.
    pub index: usize,
    pub check: &'a ValidateRule,
    pub cel: &'a str,
    /// It reads `oldSelf`: it runs on updates only.
    pub transition: bool,
    /// `CREATE`, `UPDATE` or both, as it runs.
    pub operations: Vec<&'static str>,
    pub placement: Placement,
}

/// What the policies reach besides the parent's kind: `run --namespace` and `run
/// --selector`, and the installation they belong to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    pub installation: String,
    pub namespace: Option<String>,
    /// Label selector requirements (`key=value`, `key!=value`, `key`, `!key`), as a
    /// `LabelSelector` object.
    pub selector: Option<Json>,
}

impl Default for Scope {
    fn default() -> Self {
        Scope {
            installation: "rulebook".into(),
            namespace: None,
            selector: None,
        }
    }
}

/// What a CRD validation rule may read of `self.metadata`.
const CRD_METADATA: &[&str] = &["name", "generateName"];

/// The `cel:` checks of `rule`, each with where it is enforced. A check whose CEL does
/// not compile is left out (`rulebook check` reports it).
pub fn placements(rule: &Rule) -> Vec<Placed<'_>> {
    let Some(admission) = &rule.spec.admission else {
        return Vec::new();
    };
    let defines_crd = rule.spec.crd.is_some();
    // A CRD validation rule runs on a request in its own version's schema: with several
    // versions, the rule's expressions (written for `spec.parent`'s version) go into a
    // policy instead.
    let several_versions = rule.spec.crd.as_ref().is_some_and(|c| c.versions.len() > 1);
    let mut out = Vec::new();
    for (index, check) in admission.validate.iter().enumerate() {
        let Some(cel) = &check.cel else { continue };
        let Ok(expr) = crate::cel::compile(cel) else {
            continue;
        };
        let transition = expr.reads("oldSelf");
        let operations = operations(check, transition);
        let narrowed = if transition {
            operations != ["UPDATE"]
        } else {
            operations.len() != 2
        };
        let metadata: Vec<String> = expr
            .paths_from("self")
            .into_iter()
            .filter(|p| p.first().is_some_and(|f| f == "metadata"))
            .filter_map(|p| match p.get(1) {
                Some(f) if CRD_METADATA.contains(&f.as_str()) => None,
                Some(f) => Some(format!("self.metadata.{f}")),
                None => Some("self.metadata".to_string()),
            })
            .collect();
        let placement = if !defines_crd {
            Placement::Policy("the rule does not define the parent's CRD".into())
        } else if several_versions {
            Placement::Policy(
                "the CRD has several versions: a policy judges a request in any of them in the rule's version (matchPolicy: Equivalent)".into(),
            )
        } else if let Some(m) = metadata.first() {
            Placement::Policy(format!(
                "it reads {m}, and a CRD validation rule sees only metadata.name and metadata.generateName"
            ))
        } else if narrowed {
            Placement::Policy(format!(
                "its operations ({}) differ from those a CRD validation rule runs on",
                operations.join(", ")
            ))
        } else {
            Placement::Crd
        };
        out.push(Placed {
            index,
            check,
            cel,
            transition,
            operations,
            placement,
        });
    }
    out
}

/// The operations a check runs on: its `operations`, else updates for a transition
/// rule and both otherwise.
fn operations(check: &ValidateRule, transition: bool) -> Vec<&'static str> {
    let mut ops: Vec<&'static str> = ["CREATE", "UPDATE"]
        .into_iter()
        .filter(|op| check.operations.iter().any(|o| o.as_str() == *op))
        .collect();
    if ops.is_empty() {
        ops = if transition {
            vec!["UPDATE"]
        } else {
            vec!["CREATE", "UPDATE"]
        };
    }
    if transition {
        ops.retain(|o| *o == "UPDATE");
    }
    ops
}

/// The `x-kubernetes-validations` of the CRD's root schema (empty: none).
pub fn crd_validations(rule: &Rule) -> Vec<Json> {
    placements(rule)
        .into_iter()
        .filter(|p| p.placement == Placement::Crd)
        .map(|p| {
            let mut v = json!({"rule": p.cel, "message": p.check.message.value});
            if let Some(f) = &p.check.field_path {
                v["fieldPath"] = json!(crd_field_path(f));
            }
            v
        })
        .collect()
}

/// `spec.replicas` → `.spec.replicas` (a CRD rule's `fieldPath` is a JSON path from the
/// schema node, here the root).
fn crd_field_path(f: &str) -> String {
    if f.starts_with('.') {
        f.to_string()
    } else {
        format!(".{f}")
    }
}

/// Puts the rule's CRD validation rules into every version of `crd` (a generated CRD).
pub fn add_crd_validations(rule: &Rule, crd: &mut Json) {
    let validations = crd_validations(rule);
    if validations.is_empty() {
        return;
    }
    if let Some(versions) = crd
        .pointer_mut("/spec/versions")
        .and_then(Json::as_array_mut)
    {
        for v in versions {
            if let Some(root) = v.pointer_mut("/schema/openAPIV3Schema") {
                root["x-kubernetes-validations"] = json!(validations);
            }
        }
    }
}

/// The resource the policies match: group, version, plural.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resource {
    pub group: String,
    pub version: String,
    pub plural: String,
}

impl Resource {
    /// The parent's resource, its plural from the rule's CRD or guessed from the kind
    /// (the writer passes the one discovery gives).
    pub fn of(rule: &Rule) -> Resource {
        let p = &rule.spec.parent;
        let (group, version) = split_api_version(&p.api_version);
        // As `crd::plural` (which imports this file: no import back).
        let plural = match rule.spec.crd.as_ref().and_then(|c| c.plural.as_ref()) {
            Some(given) => given.value.clone(),
            None => crate::meta::guess_plural(&p.kind),
        };
        Resource {
            group: group.to_string(),
            version: version.to_string(),
            plural,
        }
    }
}

/// The metadata of every generated policy and binding.
fn metadata(name: &str, rule: &Rule, scope: &Scope) -> Json {
    json!({
        "name": name,
        "labels": {
            (MANAGED_BY_LABEL): MANAGED_BY_VALUE,
            "rulebook.dev/rule": rule.metadata.name.value,
            (INSTALLATION_LABEL): scope.installation,
        },
    })
}

/// The name of the policy (and binding) of `rule` for checks running on `operations`.
pub fn policy_name(rule: &str, operations: &[&str]) -> String {
    match operations {
        ["CREATE"] => format!("rulebook-{rule}-create"),
        ["UPDATE"] => format!("rulebook-{rule}-update"),
        _ => format!("rulebook-{rule}"),
    }
}

/// `matchResources` of a binding: the scope's namespace and selector.
fn match_resources(scope: &Scope) -> Json {
    let mut m = json!({});
    if let Some(ns) = &scope.namespace {
        m["namespaceSelector"] = json!({"matchLabels": {"kubernetes.io/metadata.name": ns}});
    }
    if let Some(sel) = &scope.selector {
        m["objectSelector"] = sel.clone();
    }
    m
}

/// Renames the variables `from` → `to` in CEL source, leaving string literals and
/// field selections (`x.self`) alone.
pub fn rename(source: &str, renames: &[(&str, &str)]) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    let mut prev_significant: Option<char> = None;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' {
            let raw =
                i > 0 && matches!(chars[i - 1], 'r' | 'R') && !ident_char_before(&chars, i - 1);
            let end = literal_end(&chars, i, raw);
            out.extend(&chars[i..end]);
            i = end;
            prev_significant = Some(c);
            continue;
        }
        if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let selected = prev_significant == Some('.');
            match renames.iter().find(|(f, _)| *f == word) {
                Some((_, to)) if !selected => out.push_str(to),
                _ => out.push_str(&word),
            }
            prev_significant = Some('a');
            continue;
        }
        out.push(c);
        if !c.is_whitespace() {
            prev_significant = Some(c);
        }
        i += 1;
    }
    out
}

fn ident_char_before(chars: &[char], i: usize) -> bool {
    i > 0 && (chars[i - 1].is_ascii_alphanumeric() || chars[i - 1] == '_')
}

/// The index after the string literal opening at `start` (single, double or triple
/// quotes; backslash escapes unless raw).
fn literal_end(chars: &[char], start: usize, raw: bool) -> usize {
    let q = chars[start];
    let triple = chars.get(start + 1) == Some(&q) && chars.get(start + 2) == Some(&q);
    let mut i = start + if triple { 3 } else { 1 };
    while i < chars.len() {
        if chars[i] == '\\' && !raw {
            i += 2;
            continue;
        }
        if chars[i] == q
            && (!triple || (chars.get(i + 1) == Some(&q) && chars.get(i + 2) == Some(&q)))
        {
            return i + if triple { 3 } else { 1 };
        }
        i += 1;
    }
    chars.len()
}

/// The `ValidatingAdmissionPolicy` objects and bindings of `rule` (in pairs), one pair
/// per set of operations.
pub fn validating_policies(rule: &Rule, resource: &Resource, scope: &Scope) -> Vec<Json> {
    let placed: Vec<Placed> = placements(rule)
        .into_iter()
        .filter(|p| matches!(p.placement, Placement::Policy(_)))
        .collect();
    let mut out = Vec::new();
    for ops in [vec!["CREATE", "UPDATE"], vec!["CREATE"], vec!["UPDATE"]] {
        let validations: Vec<Json> = placed
            .iter()
            .filter(|p| p.operations == ops)
            .map(|p| {
                json!({
                    "expression": rename(p.cel, &[("self", "object"), ("oldSelf", "oldObject")]),
                    "message": p.check.message.value,
                })
            })
            .collect();
        if validations.is_empty() {
            continue;
        }
        let name = policy_name(&rule.metadata.name, &ops);
        out.push(json!({
            "apiVersion": API_VERSION,
            "kind": "ValidatingAdmissionPolicy",
            "metadata": metadata(&name, rule, scope),
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "matchPolicy": "Equivalent",
                    "resourceRules": [{
                        "apiGroups": [resource.group],
                        "apiVersions": [resource.version],
                        "resources": [resource.plural],
                        "operations": ops,
                    }],
                },
                "validations": validations,
            },
        }));
        out.push(json!({
            "apiVersion": API_VERSION,
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": metadata(&name, rule, scope),
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": match_resources(scope),
            },
        }));
    }
    out
}

/// The `MutatingAdmissionPolicy` and binding of `rule`'s `cel:` defaults (empty: none).
/// Each default is an apply configuration that sets the field only while it is absent.
pub fn mutating_policies(rule: &Rule, resource: &Resource, scope: &Scope) -> Vec<Json> {
    let Some(admission) = &rule.spec.admission else {
        return Vec::new();
    };
    let mutations: Vec<Json> = admission
        .default
        .iter()
        .filter_map(|d| {
            let cel = d.cel.as_ref()?;
            let path: Vec<&str> = d.path.split('.').collect();
            Some(json!({
                "patchType": "ApplyConfiguration",
                "applyConfiguration": {"expression": default_expression(&path, cel)},
            }))
        })
        .collect();
    if mutations.is_empty() {
        return Vec::new();
    }
    let name = policy_name(&rule.metadata.name, &["CREATE", "UPDATE"]);
    vec![
        json!({
            "apiVersion": API_VERSION,
            "kind": "MutatingAdmissionPolicy",
            "metadata": metadata(&name, rule, scope),
            "spec": {
                "failurePolicy": "Fail",
                "reinvocationPolicy": "Never",
                "matchConstraints": {
                    "matchPolicy": "Equivalent",
                    "resourceRules": [{
                        "apiGroups": [resource.group],
                        "apiVersions": [resource.version],
                        "resources": [resource.plural],
                        "operations": ["CREATE", "UPDATE"],
                    }],
                },
                "mutations": mutations,
            },
        }),
        json!({
            "apiVersion": API_VERSION,
            "kind": "MutatingAdmissionPolicyBinding",
            "metadata": metadata(&name, rule, scope),
            "spec": {"policyName": name, "matchResources": match_resources(scope)},
        }),
    ]
}

/// `has(object.a) && has(object.a.b) ? Object{} : Object{a: Object.a{b: (VALUE)}}`:
/// the apply configuration that sets `a.b` to `value` while it is absent.
pub fn default_expression(path: &[&str], value: &str) -> String {
    let present: Vec<String> = (1..=path.len())
        .map(|n| format!("has(object.{})", path[..n].join(".")))
        .collect();
    let mut set = format!("({value})");
    for n in (1..=path.len()).rev() {
        let type_name = if n == 1 {
            "Object".to_string()
        } else {
            format!("Object.{}", path[..n - 1].join("."))
        };
        set = format!("{type_name}{{{}: {set}}}", path[n - 1]);
    }
    format!("{} ? Object{{}} : {set}", present.join(" && "))
}

/// Every policy and binding `rule` generates, validating then mutating.
pub fn policies(rule: &Rule, resource: &Resource, scope: &Scope) -> Vec<Json> {
    let mut out = validating_policies(rule, resource, scope);
    out.extend(mutating_policies(rule, resource, scope));
    out
}

#[cfg(test)]
mod tests;
