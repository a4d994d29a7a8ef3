//! What a reconcile may read of the objects it observes, when the caches cannot simply
//! be trusted: children cached without content (over the cache budget) are read from the
//! API server; a cluster-scoped parent reads only children in the namespaces it renders
//! into; a parent too deep to read fails alone, with a condition saying why.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use serde_json::value::RawValue;
use serde_json::{Value as Json, json};

use super::context::RuleContext;
use super::error::ReconcileError;
use super::status::write_status;
use crate::cache;
use crate::cache::wire::is_stub;
use crate::meta::JsonAt;
use crate::metrics;
use crate::render::{DesiredChild, Observed, RenderError};

pub(super) type Live = Vec<(usize, Arc<DynamicObject>)>;

/// The live children with every stub replaced by the object the API server holds.
pub(super) async fn read_stubs(ctx: &RuleContext, live: Live) -> Result<Live, ReconcileError> {
    let mut out = Vec::with_capacity(live.len());
    for (k, o) in live {
        if !is_stub(&o) {
            out.push((k, o));
            continue;
        }
        let kind = &ctx.kinds[k];
        let name = o.name_any();
        let api = kind.api(&ctx.client, o.namespace().as_deref());
        match api.get_opt(&name).await {
            Ok(Some(full)) if full.uid() == o.uid() => out.push((k, Arc::new(full))),
            Ok(_) => {} // gone, or replaced: its watch event will follow
            Err(e) => {
                return Err(ReconcileError::Read {
                    what: format!("{} {name}", kind.ar.kind),
                    source: e,
                });
            }
        }
    }
    Ok(out)
}

/// The parent to reconcile: itself, or, when it is cached without content (over the
/// cache budget), as the API server holds it; `None` when it is gone or was replaced.
pub(super) async fn read_stub_parent(
    ctx: &RuleContext,
    parent: Arc<DynamicObject>,
) -> Result<Option<Arc<DynamicObject>>, ReconcileError> {
    if !is_stub(&parent) {
        return Ok(Some(parent));
    }
    // Decoded as the parent watch decodes it (a parent nested too deeply still gets its
    // `InvalidParent` condition), and kept as the cache would keep it.
    let api = ctx.parent_api_as::<crate::cache::wire::Wire<false>>(&parent);
    match api.get_opt(&parent.name_any()).await {
        Ok(Some(wire)) if wire.metadata.uid == parent.uid() => {
            let mut full = wire.into_packed();
            cache::strip_parent(&mut full);
            Ok(Some(Arc::new(full)))
        }
        Ok(_) => Ok(None),
        Err(e) => Err(ReconcileError::Read {
            what: "the parent".into(),
            source: e,
        }),
    }
}

/// The result of [`confine_to_rendered_namespaces`].
pub(super) enum Confined {
    /// Nothing to take away: the render stands.
    Same(Result<Vec<DesiredChild>, RenderError>, Live, Observed),
    /// Children outside the rendered namespaces were taken away; render again without them.
    Narrowed(Live, Observed),
}

/// A cluster-scoped parent's namespaced children may live in any namespace, so an object
/// anywhere could claim to be one (its labels and ownerReference are the claimant's to
/// write). Only children in namespaces the parent's render places children in count.
pub(super) fn confine_to_rendered_namespaces(
    ctx: &RuleContext,
    rendered: Result<Vec<DesiredChild>, RenderError>,
    live: Live,
    observed: Observed,
) -> Confined {
    let Ok(desired) = &rendered else {
        return Confined::Same(rendered, live, observed);
    };
    if ctx.parent.namespaced {
        return Confined::Same(rendered, live, observed);
    }
    let namespaces: HashSet<&str> = desired
        .iter()
        .filter_map(|d| {
            d.object
                .at(&["metadata", "namespace"])
                .and_then(Json::as_str)
        })
        .collect();
    let outside = |k: usize, o: &DynamicObject| {
        ctx.kinds[k].namespaced
            && o.namespace()
                .is_none_or(|ns| !namespaces.contains(ns.as_str()))
    };
    if !live.iter().any(|(k, o)| outside(*k, o)) {
        return Confined::Same(rendered, live, observed);
    }
    let kept: Live = live.into_iter().filter(|(k, o)| !outside(*k, o)).collect();
    let mut narrowed = Observed::from_objects(
        kept.iter()
            .filter_map(|(k, o)| cache::to_json_as(o, &ctx.kinds[*k].ar)),
    );
    narrowed.refs = observed.refs;
    Confined::Narrowed(kept, narrowed)
}

/// A parent whose content cannot be read (nested deeper than the JSON reader allows):
/// `Ready=False` with reason `InvalidParent` on it alone; nothing is rendered or pruned.
pub(super) async fn unreadable_parent(
    ctx: &RuleContext,
    parent: &DynamicObject,
) -> Result<Action, ReconcileError> {
    ctx.metrics
        .unreadable_objects
        .get_or_create(&metrics::rule(&ctx.rule.name))
        .inc();
    let message = format!(
        "{} {} cannot be read: its content is nested more deeply than Rulebook reads ({} levels); nothing is rendered for it",
        ctx.parent.ar.kind,
        parent.name_any(),
        crate::cache::MAX_DEPTH
    );
    let minimal = json!({
        "apiVersion": ctx.parent.ar.api_version,
        "kind": ctx.parent.ar.kind,
        "metadata": serde_json::to_value(&parent.metadata).unwrap_or(Json::Null),
        "status": status_of(parent),
    });
    let err = ReconcileError::InvalidParent(message);
    write_status(ctx, parent, &minimal, None, &err.condition()).await?;
    Err(err)
}

/// The `status` of a cached object read on its own (its spec may be what is too deep).
fn status_of(o: &DynamicObject) -> Json {
    let Some(text) = o.data.as_str() else {
        return Json::Null;
    };
    serde_json::from_str::<BTreeMap<String, Box<RawValue>>>(text)
        .ok()
        .and_then(|top| top.get("status").map(|s| s.get().to_string()))
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(Json::Null)
}
