//! The grants for the admission policies of `cel:` keys (rules/policy.rs generates them,
//! src/policies.rs applies them): every verb the writer uses by `resourceNames`, and the
//! `list` that finds an installation's policies by label (a list cannot be limited to
//! names). Here, beside the other grants, so that `rulebook rbac` needs nothing above
//! its layer.

use std::collections::BTreeSet;

use serde_json::Value as Json;

use crate::render::RuleSet;
use crate::rules::policy::{self, KINDS, Resource, Scope};

/// What `run` does to the policies: read, apply (create) and delete them by name, and
/// list this installation's (by label; a list cannot be limited to names).
pub const POLICY_VERBS: &[&str] = &["create", "delete", "get", "patch"];

/// The RBAC rules `rulebook rbac` adds for the policies of `set` (none without `cel:`
/// keys): every verb but `list` by `resourceNames`.
pub fn rbac_rules(set: &RuleSet) -> Vec<Json> {
    let mut names: BTreeSet<String> = BTreeSet::new();
    for rule in set.rules.values() {
        let r = &rule.rule;
        for obj in policy::policies(r, &Resource::of(r), &Scope::default()) {
            if let Some(n) = obj["metadata"]["name"].as_str() {
                names.insert(n.to_string());
            }
        }
    }
    if names.is_empty() {
        return Vec::new();
    }
    let resources: Vec<&str> = KINDS.iter().map(|(_, p)| *p).collect();
    vec![
        serde_json::json!({
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": resources,
            "resourceNames": names,
            "verbs": POLICY_VERBS,
        }),
        serde_json::json!({
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": resources,
            "verbs": ["list"],
        }),
    ]
}
