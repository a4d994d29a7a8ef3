//! What a teardown acts on and waits for: the parent's own children — where it places
//! them, made before its deletion — less those held in deletion past the teardown's one
//! bounded wait; a wave of them let go of; and, before the finalizer comes off, the last
//! look at the API server for a child the caches have not shown yet.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, DynamicObject, ListParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use serde_json::Value as Json;

use super::places::Places;
use super::{ORPHAN_RECHECK, RECHECK, WAVE_TIMEOUT, deleting};
use crate::cache::wire::orphan_owner;
use crate::meta::{labels, split_api_version};
use crate::reconcile::context::RuleContext;
use crate::reconcile::error::ReconcileError;
use crate::reconcile::events::{Cause, event, report_changes};
use crate::reconcile::plan::Owned;
use crate::reconcile::prune::{child_rule, leave_child, let_go_as};
use crate::rules::DeletionPolicy;

/// The children a teardown acts on: the parent's in the caches, in the namespaces it
/// places children in ([`super::places`]), and — once it is being deleted — created before its
/// deletion, but for its finalize child (the oldest object of that child created since).
/// A parent being deleted is given no new children, so an object made since that claims
/// it is someone's lookalike: one more of them cannot keep the teardown going.
pub(super) fn teardown_children(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
) -> Vec<(usize, Arc<DynamicObject>)> {
    let places = Places::for_parent(ctx, parent);
    let mut owned = ctx.owned_children(uid, parent.namespace().as_deref());
    owned.retain(|(k, o)| !ctx.kinds[*k].namespaced || places.holds(o.namespace().as_deref()));
    let Some(deleted) = parent.meta().deletion_timestamp.as_ref().map(|t| t.0) else {
        return owned;
    };
    let created = |o: &DynamicObject| o.metadata.creation_timestamp.as_ref().map(|t| t.0);
    let finalize =
        (ctx.rule.rule.spec.finalize_child()).map(|i| &ctx.rule.children()[i].name.value);
    let finalize_uid = owned
        .iter()
        .filter(|(_, o)| {
            finalize.is_some_and(|f| o.labels().get(labels::CHILD) == Some(f))
                && created(o).is_some_and(|t| t >= deleted)
        })
        .min_by_key(|(_, o)| (created(o), o.name_any()))
        .and_then(|(_, o)| o.uid());
    owned.retain(|(_, o)| {
        created(o).is_none_or(|t| t <= deleted) || (o.uid().is_some() && o.uid() == finalize_uid)
    });
    owned
}

/// [`teardown_children`], less those in deletion the teardown no longer waits for (said
/// on the parent: `DeletionStalled`). A teardown waits [`WAVE_TIMEOUT`] at most for
/// children held in deletion (someone else's finalizer), in all: counted from the first
/// time this process found one of the parent's children in deletion, not child by child,
/// so objects that claim the parent cannot renew the wait. (A restart of the operator
/// starts the count again.)
pub(super) fn still_awaited(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
) -> Vec<(usize, Arc<DynamicObject>)> {
    let mut owned = teardown_children(ctx, parent, uid);
    let in_deletion = |o: &DynamicObject| o.meta().deletion_timestamp.is_some();
    let since = ctx
        .memory
        .teardown_waiting_since(uid, owned.iter().any(|(_, o)| in_deletion(o)));
    let spent = since.is_some_and(|t| t.elapsed() > WAVE_TIMEOUT);
    let now = jiff::Timestamp::now();
    let overdue = |o: &DynamicObject| overdue(o, spent, now);
    let stalled: Vec<String> = owned
        .iter()
        .filter(|(_, o)| overdue(o))
        .map(|(k, o)| format!("{} {}", ctx.kinds[*k].ar.kind, o.name_any()))
        .collect();
    if !stalled.is_empty() {
        event(
            ctx,
            parent,
            EventType::Warning,
            "DeletionStalled",
            "Teardown",
            format!(
                "{} still in deletion after the teardown waited {}s (someone else's finalizer?): it goes on without waiting for them",
                stalled.join(", "),
                WAVE_TIMEOUT.as_secs()
            ),
        );
        owned.retain(|(_, o)| !overdue(o));
    }
    owned
}

/// Where each child stands for [`plan_teardown`]: its position in the rule, and whether
/// it is going already (in deletion, or let go of by this process).
pub(super) fn wave_states(
    ctx: &RuleContext,
    uid: &str,
    owned: &[(usize, Arc<DynamicObject>)],
) -> Vec<Owned> {
    // Only the children still owned need remembering: a child let go that is gone
    // is forgotten, so objects a tenant keeps creating under a parent being torn
    // down do not pile up here.
    let still: HashSet<String> = owned.iter().filter_map(|(_, o)| o.uid()).collect();
    let let_go = ctx.memory.let_go_among(uid, &still);
    owned
        .iter()
        .map(|(_, o)| Owned {
            position: child_rule(ctx, o).map_or(usize::MAX, |(i, _)| i),
            going: o.meta().deletion_timestamp.is_some()
                || o.uid().is_some_and(|u| let_go.contains(&u)),
        })
        .collect()
}

/// One wave of a teardown: the children to let go of now, and those it waits for.
pub(super) struct Wave<'a> {
    pub owned: &'a [(usize, Arc<DynamicObject>)],
    pub act: &'a [usize],
    pub waiting: &'a [usize],
}

/// Lets go of a wave's children (deleted, or orphaned as their policy says) and says on
/// the parent what it waits for.
pub(super) async fn run_wave(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    parent_json: Option<&Json>,
    wave: Wave<'_>,
) -> Result<Action, ReconcileError> {
    let mut changes = Vec::new();
    let mut failure = None;
    for &i in wave.act {
        let (k, o) = &wave.owned[i];
        match leave_child(ctx, parent, &ctx.kinds[*k], o).await {
            Ok(Some(change)) => {
                if let Some(child) = o.uid() {
                    ctx.memory.let_go(uid, child);
                }
                changes.push(change);
            }
            // Gone already, or (orphaning) changed since it was read: looked at
            // again on the next pass.
            Ok(None) => {}
            Err(e) => {
                failure.get_or_insert(e);
            }
        }
    }
    report_changes(ctx, parent, &changes, Cause::Inputs);
    if let Some(e) = failure {
        return Err(e);
    }
    let names: Vec<String> = (wave.act.iter().chain(wave.waiting))
        .map(|&i| {
            let (k, o) = &wave.owned[i];
            format!("{} {}", ctx.kinds[*k].ar.kind, o.name_any())
        })
        .collect();
    let message = format!("waiting for {} to be gone", names.join(", "));
    deleting(ctx, parent, parent_json, "DeletingChildren", &message).await?;
    // A deleted child's last watch event names its owner and wakes this parent;
    // an orphaned one leaves the child cache without owner or labels, and does not.
    let orphans = wave.act.iter().chain(wave.waiting).any(|&i| {
        let (k, o) = &wave.owned[i];
        let_go_as(ctx, &ctx.kinds[*k], o) == DeletionPolicy::Orphan
    });
    Ok(Action::requeue(if orphans {
        ORPHAN_RECHECK
    } else {
        RECHECK
    }))
}

/// Objects a page of [`uncached_children`] lists at most.
const UNCACHED_PAGE: u32 = 25;

/// Whether the teardown no longer waits for `o`: in deletion, and held there longer than
/// [`WAVE_TIMEOUT`] at `now`, or the teardown has `spent` that long waiting for children
/// in deletion in all.
fn overdue(o: &DynamicObject, spent: bool, now: jiff::Timestamp) -> bool {
    o.meta().deletion_timestamp.as_ref().is_some_and(|t| {
        spent || Duration::try_from(now.duration_since(t.0)).is_ok_and(|d| d > WAVE_TIMEOUT)
    })
}

/// Before the finalizer comes off: whether the API server holds a child of the parent
/// that the caches have not shown yet (created just before the deletion), not already
/// in deletion — it would be left to the garbage collector, its policy unheeded. Looked
/// for where the teardown looks ([`teardown_children`]).
pub(super) async fn uncached_children(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
) -> Result<bool, ReconcileError> {
    let selector = format!(
        "{},{}={uid}",
        labels::child_selector(&ctx.rule.name),
        labels::OWNER
    );
    let places = Places::for_parent(ctx, parent);
    for kind in &ctx.kinds {
        let apis: Vec<Api<DynamicObject>> = match (ctx.spreads(), places.namespaces()) {
            (false, _) => vec![kind.api(&ctx.client, parent.namespace().as_deref())],
            (true, Some(set)) if kind.namespaced => set
                .iter()
                .map(|ns| kind.api(&ctx.client, Some(ns)))
                .collect(),
            (true, _) => vec![kind.api(&ctx.client, None)],
        };
        for api in apis {
            if uncached_in(ctx, parent, uid, (&api, &kind.ar.kind), &selector).await? {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// [`uncached_children`] of one kind, where `api` lists.
async fn uncached_in(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    (api, kind): (&Api<DynamicObject>, &str),
    selector: &str,
) -> Result<bool, ReconcileError> {
    let parent_name = parent.name_any();
    let deleted = parent.meta().deletion_timestamp.as_ref().map(|t| t.0);
    // The parent's controller reference, of a size the caches keep: one padded past
    // what a stub keeps would never be seen by the waves, and would hold the finalizer
    // for ever. Or an `Orphan` child's owner label. Outside a namespaced parent's own
    // namespace (`targetNamespaces`), only a claim naming that namespace, as the caches
    // count it (`RuleContext::owned_children`): short enough for a stub to keep. Made
    // before the deletion: one made since is not the parent's ([`teardown_children`]).
    let home = parent.namespace().filter(|_| ctx.parent.namespaced);
    let claims = |m: &kube::api::ObjectMeta| {
        let fresh = m.deletion_timestamp.is_none()
            && (m.creation_timestamp.as_ref()).is_none_or(|c| deleted.is_none_or(|d| c.0 <= d));
        match home.as_deref() {
            Some(h) if m.namespace.as_deref() != Some(h) => {
                fresh && crate::reconcile::context::claims_from(m, uid, h)
            }
            _ => {
                fresh
                    && (m.owner_references.iter().flatten().any(|r| {
                        r.uid == uid
                            && r.controller == Some(true)
                            && r.kind == ctx.parent.ar.kind
                            && r.name == parent_name
                            && split_api_version(&r.api_version).0 == ctx.parent.ar.group
                            && crate::cache::admission::kept_size(r)
                    }) || orphan_owner(m) == Some(uid))
            }
        }
    };
    // A page at a time: the labels are public, and anyone may put them on objects of
    // any size in their namespace.
    let mut token: Option<String> = None;
    loop {
        let mut params = ListParams::default().labels(selector).limit(UNCACHED_PAGE);
        if let Some(t) = &token {
            params = params.continue_token(t);
        }
        let page = api
            .list_metadata(&params)
            .await
            .map_err(|source| ReconcileError::Read {
                what: format!("{kind} children"),
                source,
            })?;
        if page.items.iter().any(|o| claims(&o.metadata)) {
            return Ok(true);
        }
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            return Ok(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn in_deletion_since(secs: i64, now: jiff::Timestamp) -> DynamicObject {
        let at = now - jiff::SignedDuration::from_secs(secs);
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "deletionTimestamp": at.to_string()},
        }))
        .unwrap()
    }

    #[test]
    fn the_wait_for_children_in_deletion_is_the_teardowns_not_each_childs() {
        let now = jiff::Timestamp::now();
        let wait = WAVE_TIMEOUT.as_secs() as i64;
        // One child held past the timeout is no longer waited for.
        assert!(!overdue(&in_deletion_since(wait - 5, now), false, now));
        assert!(overdue(&in_deletion_since(wait + 5, now), false, now));
        // Once the teardown has waited that long in all, a child deleted a moment ago
        // (a lookalike made to renew the wait) is not waited for either.
        assert!(overdue(&in_deletion_since(1, now), true, now));
        // One not in deletion is acted on, never skipped.
        let live: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"},
        }))
        .unwrap();
        assert!(!overdue(&live, true, now));
    }
}
