//! What `rulebook diff` reads for a parent's references: the objects its targets point
//! at, read from the API server as the operator's caches would hold them.

use std::collections::BTreeMap;

use kube::Client;
use kube::api::{ApiResource, DynamicObject, ListParams};
use serde_json::Value as Json;

use super::{Kinds, typed};
use crate::engine::kind_api;
use crate::render::{CompiledRule, Observed, RefSelect, Scope};

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
