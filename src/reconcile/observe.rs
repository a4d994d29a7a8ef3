//! The observe stage of a reconcile: the parent and its live children as the caches have
//! them, with no write. Nothing changed since a reconcile that had nothing to do: the
//! reconcile stops here ([`skip_if_steady`]). And what a reconcile may read of the objects
//! it observes, when the caches cannot simply be trusted: children cached without content
//! (over the cache budget) are read from the API server; a cluster-scoped parent reads
//! only children in the namespaces it renders into; a parent too deep to read fails alone,
//! with a condition saying why.

use std::collections::{BTreeMap, HashSet};
use std::ops::ControlFlow;
use std::sync::Arc;

use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use serde_json::value::RawValue;
use serde_json::{Value as Json, json};

use super::context::RuleContext;
use super::error::ReconcileError;
use super::events::Cause;
use super::outcome::{Outcome, invalid_parent, settled};
use crate::cache;
use crate::cache::wire::is_stub;
use crate::meta::JsonAt;
use crate::metrics;
use crate::render::{DesiredChild, Observed};

pub(super) type Live = Vec<(usize, Arc<DynamicObject>)>;

/// What the observe stage hands on.
pub(super) struct Observation {
    /// The parent's live children, stubs read whole.
    pub live: Live,
    /// The parent as JSON (with the status this process last wrote, when the rule reads
    /// it and the cache predates the write).
    pub parent_json: Json,
    /// The live children as JSON; references come with the dereference stage.
    pub observed: Observed,
    /// Whether the rule itself is the one new input (for the events).
    pub cause: Cause,
    /// What earlier reconciles awaited ([`ParentMemory::begin`](super::ParentMemory::begin)): given back when the
    /// reconcile stops at the fingerprint, dropped once it goes on.
    pub awaited: super::memory::Awaited,
}

/// The observe stage: the parent and its live children, as the caches (or, for children cached
/// without content, the API server) have them. Nothing changed since a reconcile that had
/// nothing to do (and no references to look at): nothing to do, and nothing is even read
/// as JSON. What earlier reconciles awaited is not awaited while this one decides from the
/// caches (`Steady::begin`), unless it stops at the fingerprint.
pub(super) async fn observe(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
) -> Result<ControlFlow<Outcome, Observation>, ReconcileError> {
    let namespace = parent.namespace();
    let awaited = ctx.memory.begin(uid);
    let live = read_stubs(ctx, ctx.owned_children(uid, namespace.as_deref())).await?;
    if ctx.rule.rule.spec.references.is_empty()
        && let Some(done) = skip_if_steady(ctx, parent, uid, &live, &BTreeMap::new())
    {
        ctx.memory.resume(uid, awaited);
        return Ok(ControlFlow::Break(Outcome::Ends(Ok(done))));
    }
    let Some(mut parent_json) = cache::to_json(parent) else {
        return Ok(ControlFlow::Break(unreadable_parent(ctx, parent)));
    };
    // The status this process last wrote, when the cache predates it.
    let written = ctx.memory.status_written_since(uid, parent);
    let rollout =
        super::status_write::rule_rollout_only(ctx, parent, written.as_ref(), &parent_json);
    let cause = if rollout {
        Cause::RuleRollout
    } else {
        Cause::Inputs
    };
    if ctx.rule.reads_parent_status()
        && let Some(status) = written
        && let Some(p) = parent_json.as_object_mut()
    {
        // The rule reads the status: the parent as this process knows it (the status
        // watch event does not bring a reconcile of its own, and the steady check
        // already counts that write).
        p.insert("status".into(), status);
    }
    let observed = Observed::from_objects(
        live.iter()
            .filter_map(|(k, o)| cache::to_json_as(o, &ctx.kinds[*k].ar)),
    );
    Ok(ControlFlow::Continue(Observation {
        live,
        parent_json,
        observed,
        cause,
        awaited,
    }))
}

/// `Some(action)` when the parent's inputs are those of a reconcile that had nothing to
/// do ([`ParentMemory::is_steady`](super::ParentMemory::is_steady)): the reconcile stops there.
pub(super) fn skip_if_steady(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    live_children: &[(usize, Arc<DynamicObject>)],
    refs: &BTreeMap<String, Json>,
) -> Option<Action> {
    if !ctx.memory.is_steady(uid, parent, live_children, refs) {
        return None;
    }
    ctx.metrics
        .reconciles_skipped
        .get_or_create(&metrics::rule(&ctx.rule.name))
        .inc();
    Some(settled())
}

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

/// A cluster-scoped parent's namespaced children may live in any namespace (a namespaced
/// parent's, in its own and those of the rule's `targetNamespaces`), so an object
/// anywhere could claim to be one (its labels and ownerReference are the claimant's to
/// write). Only children in namespaces the parent's render (`desired`) places children in
/// (and a namespaced parent's own, `home`) count: the others are taken out of `live` and `observed`, and `true` says the parent is
/// to be rendered again without them.
pub(super) fn confine_to_rendered_namespaces(
    ctx: &RuleContext,
    home: Option<&str>,
    desired: &[DesiredChild],
    live: &mut Live,
    observed: &mut Observed,
) -> bool {
    if !ctx.spreads() {
        return false;
    }
    // A namespaced parent's own namespace holds its children whatever it renders (they
    // carry its controller reference there).
    let home = ctx.parent.namespaced.then_some(home).flatten();
    let namespaces: HashSet<&str> = home
        .into_iter()
        .chain(desired.iter().filter_map(|d| {
            d.object
                .at(&["metadata", "namespace"])
                .and_then(Json::as_str)
        }))
        .collect();
    let outside = |k: usize, o: &DynamicObject| {
        ctx.kinds[k].namespaced
            && o.namespace()
                .is_none_or(|ns| !namespaces.contains(ns.as_str()))
    };
    if !live.iter().any(|(k, o)| outside(*k, o)) {
        return false;
    }
    let kept: Live = std::mem::take(live)
        .into_iter()
        .filter(|(k, o)| !outside(*k, o))
        .collect();
    let mut narrowed = Observed::from_objects(
        kept.iter()
            .filter_map(|(k, o)| cache::to_json_as(o, &ctx.kinds[*k].ar)),
    );
    narrowed.refs = std::mem::take(&mut observed.refs);
    *observed = narrowed;
    *live = kept;
    true
}

/// A parent whose content cannot be read (nested deeper than the JSON reader allows):
/// `Ready=False` with reason `InvalidParent` on it alone; nothing is rendered or pruned.
fn unreadable_parent(ctx: &RuleContext, parent: &DynamicObject) -> Outcome {
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
    invalid_parent(minimal, message)
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
