//! Where a rule's `cel:` rules are enforced, and the objects that make the API server
//! enforce them: pure functions of the rule, printed by `rulebook render`, dry-run by
//! `rulebook check --kubeconfig`, applied by the one writer (`src/policies.rs`).
//!
//! - A `cel:` check of a rule that defines its parent's CRD goes into the CRD's
//!   `x-kubernetes-validations` (at the schema's root: `self` is the object, `oldSelf` the
//!   stored one), unless CRD validation cannot express it: it reads `self.metadata`
//!   beyond `name` and `generateName` (all a CRD rule sees of metadata), or it narrows
//!   `operations` (a CRD rule runs on every write; a transition rule on updates only).
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

use super::Rule;
use super::crd::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};
use super::placement::{Placed, Placement, placements};
use crate::meta::split_api_version;

/// The label naming the installation (`run --lease-name`) a policy belongs to.
pub const INSTALLATION_LABEL: &str = "rulebook.dev/installation";
/// The API group and version of the policies.
pub const API_VERSION: &str = "admissionregistration.k8s.io/v1";

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
        let plural = match &rule.spec.crd {
            Some(crd) => super::crd::plural(crd, &p.kind),
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
