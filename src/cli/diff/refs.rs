//! What `rulebook diff` reads for a parent's references: the objects its targets point
//! at, read from the API server as the operator's caches would hold them — after, with
//! `--base-rules`, checking that the base branch's rule reads them too ([`super::base`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::Client;
use kube::api::{ApiResource, DynamicObject, ListParams};
use serde_json::Value as Json;

use super::base::{Reach, refused};
use super::{Kinds, typed};
use crate::engine::kind_api;
use crate::render::{CompiledRule, Observed, RefSelect, RefTarget, Scope};

/// The base branch's rule of the same name, with its references' kinds (`None`: not
/// served by the cluster), against which a pull request's references are checked.
pub(super) struct Base {
    /// `None`: the rule is new in the pull request, and so is every reference of it.
    pub rule: Option<Arc<CompiledRule>>,
    pub kinds: Vec<Option<(ApiResource, bool)>>,
}

impl Base {
    pub async fn resolve(client: &Client, rule: Option<Arc<CompiledRule>>) -> Base {
        let mut kinds = Vec::new();
        for r in rule.iter().flat_map(|r| &r.rule.spec.references) {
            let found = crate::engine::resolve_kind(client, "reference", &r.api_version, &r.kind);
            kinds.push(found.await.ok());
        }
        Base { rule, kinds }
    }

    /// What the base rule reads for `parent`; nothing when it cannot be evaluated for it.
    fn reaches(&self, parent: &Json) -> Vec<Reach> {
        let Some(rule) = &self.rule else {
            return Vec::new();
        };
        let kinds = self.kinds.iter().map(|k| k.as_ref()).collect::<Vec<_>>();
        let scope = |i: usize| match kinds.get(i) {
            Some(Some((_, false))) => Scope::Cluster,
            _ => Scope::Namespaced,
        };
        rule.reference_targets(parent, &Observed::default(), &scope, &mut rule.budget())
            .map(|targets| reaches(rule, &kinds, &targets))
            .unwrap_or_default()
    }
}

/// What each of `targets` reads, for those whose kind is known.
fn reaches(
    rule: &CompiledRule,
    kinds: &[Option<&(ApiResource, bool)>],
    targets: &[RefTarget],
) -> Vec<Reach> {
    let spec = &rule.rule.spec.references;
    targets
        .iter()
        .filter_map(|t| {
            let (ar, _) = kinds.get(t.reference).copied().flatten()?;
            let r = spec.get(t.reference)?;
            Some(Reach::new(
                &ar.group,
                &ar.kind,
                t.namespace.clone(),
                t.select.clone(),
                &crate::render::cache_filter(r),
            ))
        })
        .collect()
}

/// The refusal of each of `targets` that the base rule does not read for `parent`.
fn refusals(
    rule: &CompiledRule,
    kinds: &Kinds,
    base: &Base,
    parent: &Json,
    targets: &[RefTarget],
) -> Vec<String> {
    let allowed = base.reaches(parent);
    let mine: Vec<Option<&(ApiResource, bool)>> = kinds.refs.iter().map(Some).collect();
    let spec = &rule.rule.spec.references;
    targets
        .iter()
        .filter_map(|t| {
            let reach = reaches(rule, &mine, std::slice::from_ref(t)).pop()?;
            let name = &spec.get(t.reference)?.name.value;
            (!allowed.iter().any(|b| reach.within(b))).then(|| refused(name, &reach))
        })
        .collect()
}

/// `refs` for `parent`, or the message the operator would set (`ReferenceMissing`, or the
/// evaluation error).
pub(super) async fn dereference(
    client: &Client,
    rule: &CompiledRule,
    kinds: &Kinds,
    parent: &Json,
) -> Result<BTreeMap<String, Json>, String> {
    let spec = &rule.rule.spec.references;
    if spec.is_empty() {
        return Ok(BTreeMap::new());
    }
    let scope = |i: usize| match kinds.refs.get(i) {
        Some((_, false)) => Scope::Cluster,
        _ => Scope::Namespaced,
    };
    let targets = rule
        .reference_targets(parent, &Observed::default(), &scope, &mut rule.budget())
        .map_err(|e| e.to_string())?;
    if let Some(base) = &kinds.base {
        let refused = refusals(rule, kinds, base, parent, &targets);
        if !refused.is_empty() {
            return Err(refused.join("; "));
        }
    }
    let mut found = BTreeMap::new();
    for t in targets {
        let (Some((ar, namespaced)), Some(r)) =
            (kinds.refs.get(t.reference), spec.get(t.reference))
        else {
            continue;
        };
        let api = kind_api(client, ar, *namespaced, t.namespace.as_deref());
        let filter = crate::render::cache_filter(r);
        match &t.select {
            RefSelect::Name(name) => {
                let o = api.get_opt(name).await.map_err(|e| e.to_string())?;
                // The operator's cache holds only what `watchSelector` selects.
                let o = o.filter(|o| matches_watch(o, filter.labels.as_deref()));
                match o.and_then(|o| typed(&o, ar)) {
                    Some(o) => {
                        found.insert(r.name.value.clone(), o);
                    }
                    None if r.optional => {}
                    None => {
                        return Err(format!(
                            "ReferenceMissing: refs.{}: {} not found",
                            r.name.value,
                            t.describe(&r.kind.value)
                        ));
                    }
                }
            }
            RefSelect::Labels(labels) => {
                let mut selector: Vec<String> =
                    labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                selector.extend(filter.labels.clone());
                let list = api
                    .list(&ListParams::default().labels(&selector.join(",")))
                    .await
                    .map_err(|e| e.to_string())?;
                let mut items: Vec<Json> = list.items.iter().filter_map(|o| typed(o, ar)).collect();
                items.sort_by(|a, b| {
                    a.pointer("/metadata/name")
                        .and_then(Json::as_str)
                        .cmp(&b.pointer("/metadata/name").and_then(Json::as_str))
                });
                found.insert(r.name.value.clone(), Json::Array(items));
            }
        }
    }
    Ok(found)
}

/// Whether `o` carries the labels of a `watchSelector` (equality and existence terms).
fn matches_watch(o: &DynamicObject, selector: Option<&str>) -> bool {
    let Some(sel) = selector else { return true };
    let Ok(terms) = crate::rules::parse_label_selector(sel) else {
        return false;
    };
    let labels = o.metadata.labels.clone().unwrap_or_default();
    terms.iter().all(|(k, v, negated)| {
        let have = labels.get(k);
        let hit = match v {
            Some(v) => have == Some(v),
            None => have.is_some(),
        };
        hit != *negated
    })
}

/// The kinds of a rule's references, as discovery has them.
pub(super) async fn resolve(
    client: &Client,
    rule: &CompiledRule,
) -> anyhow::Result<Vec<(ApiResource, bool)>> {
    let mut out = Vec::new();
    for r in &rule.rule.spec.references {
        out.push(crate::engine::resolve_kind(client, "reference", &r.api_version, &r.kind).await?);
    }
    Ok(out)
}
