//! The offline lookups `render`, `test` and `check` share: a parent read from a file as the
//! API server would see it, which rule a parent belongs to (by apiVersion and kind, any of
//! a rule's CRD versions), its storage version's spec schema, and how a rule's children
//! are placed without discovery (the rule set's own CRD scopes, the built-in
//! cluster-scoped kinds). Its own file so that `render` and
//! `ruletest`, which both use it, do not import each other.

use serde_json::Value as Json;

use super::is_cluster_scoped_builtin;
use crate::render::{RuleSet, Scope};

/// A parent read from a file has no UID or namespace yet; render as the API server would
/// see it (a parent of a cluster-scoped kind of the rule's CRD has no namespace).
pub fn with_render_defaults(rule: &crate::render::CompiledRule, mut parent: Json) -> Json {
    let cluster_scoped = rule.rule.crd_cluster_scoped();
    if let Some(meta) = parent.get_mut("metadata").and_then(Json::as_object_mut) {
        if cluster_scoped {
            // The API server drops the namespace of a cluster-scoped object.
            meta.remove("namespace");
        } else {
            meta.entry("namespace").or_insert_with(|| "default".into());
        }
        meta.entry("uid")
            .or_insert_with(|| "00000000-0000-0000-0000-000000000000".into());
        meta.entry("generation").or_insert_with(|| 1.into());
    }
    parent
}

/// The rule whose parent is `api_version` `kind`: the same apiVersion, or, for a rule
/// listing versions (`spec.crd.versions`), any of them.
pub fn rule_for<'a>(
    set: &'a RuleSet,
    api_version: &str,
    kind: &str,
) -> Option<&'a crate::render::SharedRule> {
    let (group, version) = crate::meta::split_api_version(api_version);
    set.rules.values().find(|r| {
        let p = &r.rule.spec.parent;
        p.kind.value == kind
            && (p.api_version.value == api_version
                || (p.group_version().0 == group
                    && r.crd_versions().iter().any(|(v, _)| v == version)))
    })
}

/// The schema of the parent's `.spec` in the storage version: the storage version's
/// own, else `spec.crd.specSchema`.
pub fn storage_spec_schema(rule: &crate::render::CompiledRule) -> Option<&Json> {
    let crd = rule.rule.spec.crd.as_ref()?;
    crd.versions
        .iter()
        .find(|v| v.storage)
        .and_then(|v| v.spec_schema.as_ref())
        .or(crd.spec_schema.as_ref())
        .map(|s| &s.value)
}

/// How `rule`'s children are placed without discovery, as `run` places them once the
/// API server says: built-in cluster-scoped kinds, and the kinds of the rule set's own
/// CRDs with `scope: Cluster`, as such; everything else namespaced.
pub fn offline_scope<'a>(
    set: &'a RuleSet,
    rule: &'a crate::render::CompiledRule,
) -> impl Fn(usize) -> Scope + 'a {
    move |i: usize| match rule.children().get(i) {
        Some(c) if is_cluster_scoped_builtin(&c.api_version, &c.kind) => Scope::Cluster,
        Some(c)
            if rule_for(set, &c.api_version, &c.kind)
                .is_some_and(|r| r.rule.crd_cluster_scoped()) =>
        {
            Scope::Cluster
        }
        _ => Scope::Namespaced,
    }
}
