//! Rulebook's finalizer and a parent's teardown.
//!
//! Parents of a rule with a say in their deletion (`spec.deletion`, or a child with
//! `deletionPolicy: Orphan`) carry the finalizer `rulebook.dev/finalizer`; other parents
//! never do, and their children are left to the garbage collector at no extra write.
//! Once a parent with the finalizer is being deleted, each reconcile takes the next step
//! that [`plan_teardown`] picks: create the finalize child (rendered from the parent
//! alone — no other template is rendered in a teardown), wait for its `doneWhen` or its
//! timeout, record that the step is over, let go of the children in waves, remove the
//! finalizer.
//!
//! Everything a step needs is read back from the cluster (the finalize child, the marker
//! annotation on the parent, the children left), so an operator killed at any point
//! resumes where it was. Patches to the parent and to orphaned children are conditional
//! on the resourceVersion read, deletes on the child's UID; the finalize child is created
//! only after its name was looked up on the API server. No step waits forever: the
//! finalize step has its timeout, and a wave whose objects stay in deletion longer than
//! [`WAVE_TIMEOUT`] (someone else's finalizer) is left to the garbage collector.

mod finalize;
pub mod recorded;

use std::collections::HashSet;
use std::time::Duration;

use kube::api::{Api, DynamicObject, ListParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use serde_json::{Value as Json, json};
use tracing::{info, warn};

use super::context::{RuleContext, lock};
use super::error::ReconcileError;
use super::events::{Cause, event, report_changes};
use super::plan::{FinalizeOutcome, Owned, TeardownStep, plan_teardown};
use super::prune::{child_rule, deletion_policy, leave_child};
use super::status::write_deleting;
use super::writer::{Patched, WriteError};
use crate::meta::{FINALIZER, labels, split_api_version};
use crate::render::status::ConditionState;
use crate::rules::DeletionPolicy;
use finalize::{finalize_state, mark, start_finalize};

/// How often a waiting teardown looks again without being woken by a watch event.
const RECHECK: Duration = Duration::from_secs(30);
/// How soon a wave with orphaned children looks again (nothing wakes it).
const ORPHAN_RECHECK: Duration = Duration::from_secs(1);
/// How soon a step is retried after its conditional write found the object changed.
const STALE_RETRY: Duration = Duration::from_millis(500);
/// How long a wave waits for an object already in deletion (held by someone else's
/// finalizer) before the teardown goes on without it.
pub const WAVE_TIMEOUT: Duration = Duration::from_secs(600);

pub(super) fn has_finalizer(o: &DynamicObject) -> bool {
    o.finalizers().iter().any(|f| f == FINALIZER)
}

/// In normal operation: the parent carries the finalizer exactly when its rule needs it
/// (added before any child is created, so a deletion right after creation is torn down
/// too; removed when a rule change drops its deletion steps), and the record of its
/// `Orphan` children's kinds ([`recorded`]) is up to date, written with it. No write
/// when both match. `false`: the parent changed since it was cached; reconcile it again
/// before going on.
///
/// A recorded kind the rule no longer has stays recorded, and keeps the finalizer, until
/// the teardown has looked for it: nothing is listed here, so neither a record a tenant
/// filled nor a rule edit costs a reconcile more than reading the annotation, and a kind
/// that a quick revert puts back keeps its objects (the clean-up of a dropped kind, in
/// `engine::dropped`, lets go of them meanwhile, and can be stopped).
pub(super) async fn keep_finalizer(
    ctx: &RuleContext,
    parent: &DynamicObject,
) -> Result<bool, ReconcileError> {
    // Only with the finalizer: without it, nothing holds the parent for a teardown. A
    // kind this process's clean-up of dropped kinds finished here has nothing left to
    // look for.
    let mut pending = if has_finalizer(parent) {
        recorded::pending(ctx, parent)
    } else {
        Vec::new()
    };
    pending.retain(|(api_version, kind)| {
        !ctx.orphans_pending.was_cleaned(
            split_api_version(api_version).0,
            kind,
            parent.namespace().as_deref(),
        )
    });
    // Kept, not added, while orphans may be pending: children of a kind the rule dropped,
    // or children the rule no longer has that recorded `Orphan` (this reconcile's prune
    // lets go of those).
    let needs = ctx.rule.rule.spec.needs_finalizer()
        || (has_finalizer(parent)
            && (ctx.orphans_pending.get()
                || !pending.is_empty()
                || owns_recorded_orphans(ctx, parent)));
    let record = recorded::record(ctx, &pending);
    // A parent without the finalizer that needs none: its record holds nothing (and its
    // rule may not patch it), whatever anyone wrote there.
    if needs == has_finalizer(parent)
        && (!needs || parent.annotations().get(labels::ORPHAN_KINDS) == record.as_ref())
    {
        return Ok(true);
    }
    if !needs && let Some(uid) = parent.uid() {
        // The finalizer comes off: another rule's `Orphan` children (a rename) would go
        // with the parent. Until they are let go of, it stays, and the reconcile goes on.
        let (changes, result) = recorded::let_go_of_foreign(ctx, parent, &uid).await;
        report_changes(ctx, parent, &changes, Cause::Inputs);
        if let Err(e) = result {
            if matches!(e, ReconcileError::NotLeader) {
                return Err(e);
            }
            warn!(rule = %ctx.rule.name, parent = %parent.name_any(), error = %e, "another rule's Orphan children are not let go of yet: the finalizer stays");
            return Ok(true);
        }
    }
    let mut body = finalizer_patch(parent, needs);
    body["metadata"]["annotations"] = json!({ labels::ORPHAN_KINDS: record });
    let api = ctx.parent_api(parent);
    let patched = patch_parent(ctx, &api, parent, &body, FINALIZER).await?;
    Ok(patched == Patched::Patched)
}

/// Whether `parent` owns a child whose policy is `Orphan` only by what the object
/// recorded (its child, or its kind, left the rule): without the finalizer the garbage
/// collector would delete it with the parent.
fn owns_recorded_orphans(ctx: &RuleContext, parent: &DynamicObject) -> bool {
    let Some(uid) = parent.uid() else {
        return false;
    };
    ctx.owned_children(&uid, parent.namespace().as_deref())
        .iter()
        .any(|(k, o)| deletion_policy(ctx, &ctx.kinds[*k], o) == DeletionPolicy::Orphan)
}

/// The merge patch that adds (`on`) or removes Rulebook's finalizer on `parent` as seen
/// (its resourceVersion is the precondition), keeping everyone else's.
pub fn finalizer_patch(parent: &DynamicObject, on: bool) -> Json {
    let mut list: Vec<&str> = parent
        .finalizers()
        .iter()
        .map(String::as_str)
        .filter(|f| *f != FINALIZER)
        .collect();
    if on {
        list.push(FINALIZER);
    }
    json!({"metadata": {
        "resourceVersion": parent.resource_version(),
        "finalizers": if list.is_empty() { Json::Null } else { json!(list) },
    }})
}

/// A conditional merge patch of the parent through the writer; `what` names the field
/// for an error message.
async fn patch_parent(
    ctx: &RuleContext,
    api: &Api<DynamicObject>,
    parent: &DynamicObject,
    body: &Json,
    what: &str,
) -> Result<Patched, ReconcileError> {
    match ctx.writer.merge_patch(api, &parent.name_any(), body).await {
        Ok(p) => Ok(p),
        Err(WriteError::NotLeader) => Err(ReconcileError::NotLeader),
        Err(WriteError::Api(e)) => Err(ReconcileError::Apply {
            what: format!("{what} on the parent"),
            source: e,
        }),
    }
}

/// One reconcile of a parent being deleted.
pub(super) async fn teardown(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
) -> Result<Action, ReconcileError> {
    if !has_finalizer(parent) {
        return Ok(Action::await_change()); // the garbage collector removes the children
    }
    // Children of kinds the rule no longer has, recorded `Orphan`: no cache shows them,
    // and the garbage collector would delete them with the parent.
    if let Some(next) = let_go_of_recorded(ctx, parent, uid).await? {
        return Ok(next);
    }
    if !ctx.rule.rule.spec.needs_finalizer() {
        if ctx.orphans_pending.get() {
            // Children of a kind the rule dropped wait to be orphaned (`engine::dropped`):
            // the garbage collector would delete them with the parent.
            return Ok(Action::requeue(ORPHAN_RECHECK));
        }
        if !owns_recorded_orphans(ctx, parent) {
            // A rule change dropped the deletion steps: the garbage collector takes over.
            return finish(ctx, parent, uid, "the rule has no deletion steps any more").await;
        }
        // Children the rule no longer has, recorded `Orphan`: the waves let go of them
        // (and of the rest) before the finalizer comes off.
    }
    let parent_json = super::cache::to_json(parent);
    let mut owned = ctx.owned_children(uid, parent.namespace().as_deref());
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
                "{} still in deletion after {}s (someone else's finalizer?): the teardown goes on without waiting for them",
                stalled.join(", "),
                WAVE_TIMEOUT.as_secs()
            ),
        );
        owned.retain(|(_, o)| !overdue(o));
    }
    let finalizing = finalize_state(ctx, parent, parent_json.as_ref(), &owned).await?;
    let states: Vec<Owned> = {
        let mut let_go = lock(&ctx.let_go);
        // Only the children still owned need remembering: a child let go that is gone
        // is forgotten, so objects a tenant keeps creating under a parent being torn
        // down do not pile up here.
        if let Some(mine) = let_go.get_mut(uid) {
            let still: HashSet<String> = owned.iter().filter_map(|(_, o)| o.uid()).collect();
            mine.retain(|child| still.contains(child));
        }
        let mine = let_go.get(uid);
        owned
            .iter()
            .map(|(_, o)| Owned {
                position: child_rule(ctx, o).map_or(usize::MAX, |(i, _)| i),
                going: o.meta().deletion_timestamp.is_some()
                    || mine.is_some_and(|m| o.uid().is_some_and(|u| m.contains(&u))),
            })
            .collect()
    };
    let order = ctx
        .rule
        .rule
        .spec
        .deletion
        .as_ref()
        .map(|d| d.order)
        .unwrap_or_default();
    let status = |reason: &str, message: String| {
        let parent_json = parent_json.clone();
        let step = ConditionState::new(true, reason, &message);
        async move {
            match parent_json {
                Some(p) => write_deleting(ctx, parent, &p, &step).await,
                None => Ok(()),
            }
        }
    };
    match plan_teardown(finalizing.state, &states, order) {
        TeardownStep::StartFinalize => start_finalize(ctx, parent).await,
        TeardownStep::AwaitFinalize { remaining } => {
            status(
                "Finalizing",
                format!(
                    "waiting for {}: doneWhen is not true yet (timeout at {})",
                    finalizing.what, finalizing.deadline
                ),
            )
            .await?;
            Ok(Action::requeue(
                (remaining + Duration::from_secs(1)).min(RECHECK),
            ))
        }
        TeardownStep::MarkFinalized(outcome) => {
            let (type_, reason, note) = match outcome {
                FinalizeOutcome::Done => (
                    EventType::Normal,
                    "Finalized",
                    format!(
                        "{}: doneWhen is true; deleting the children",
                        finalizing.what
                    ),
                ),
                FinalizeOutcome::TimedOut => (
                    EventType::Warning,
                    "FinalizeTimedOut",
                    format!(
                        "{}: doneWhen was not true within {}s; deleting the children anyway",
                        finalizing.what,
                        ctx.rule.finalize_timeout().as_secs()
                    ),
                ),
                FinalizeOutcome::Failed => (
                    EventType::Warning,
                    "FinalizeFailed",
                    "the finalize step could not run; deleting the children anyway".into(),
                ),
            };
            match mark(ctx, parent, outcome).await? {
                Patched::Patched => {
                    event(ctx, parent, type_, reason, "Finalize", note);
                    Ok(Action::await_change())
                }
                Patched::Stale => Ok(Action::requeue(STALE_RETRY)),
            }
        }
        TeardownStep::Wave { act, waiting } => {
            let mut changes = Vec::new();
            let mut failure = None;
            for &i in &act {
                let (k, o) = &owned[i];
                match leave_child(ctx, parent, &ctx.kinds[*k], o).await {
                    Ok(Some(change)) => {
                        if let Some(child) = o.uid() {
                            lock(&ctx.let_go)
                                .entry(uid.to_string())
                                .or_default()
                                .insert(child);
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
            let names: Vec<String> = act
                .iter()
                .chain(&waiting)
                .map(|&i| {
                    let (k, o) = &owned[i];
                    format!("{} {}", ctx.kinds[*k].ar.kind, o.name_any())
                })
                .collect();
            status(
                "DeletingChildren",
                format!("waiting for {} to be gone", names.join(", ")),
            )
            .await?;
            // A deleted child's last watch event names its owner and wakes this parent;
            // an orphaned one leaves the child cache without owner or labels, and does not.
            let orphans = act.iter().chain(&waiting).any(|&i| {
                let (k, o) = &owned[i];
                deletion_policy(ctx, &ctx.kinds[*k], o) == DeletionPolicy::Orphan
            });
            Ok(Action::requeue(if orphans {
                ORPHAN_RECHECK
            } else {
                RECHECK
            }))
        }
        TeardownStep::RemoveFinalizer => {
            if uncached_children(ctx, parent, uid).await? {
                return Ok(Action::requeue(STALE_RETRY));
            }
            finish(ctx, parent, uid, "every child is gone").await
        }
    }
}

/// The first step of a teardown, while the parent's record names kinds the rule no
/// longer has: lets go of its `Orphan` children of those kinds, then takes them off the
/// record (one conditional patch), so that later steps do not look again. `Some`: what
/// to do instead of going on — look again after a failure, reported on the parent
/// (`Deleting` condition, Warning event), or after the record changed.
async fn let_go_of_recorded(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
) -> Result<Option<Action>, ReconcileError> {
    let pending = recorded::pending(ctx, parent);
    if pending.is_empty() {
        return Ok(None);
    }
    let (left, changes) = recorded::let_go_of_kinds(ctx, parent, uid, &pending).await?;
    report_changes(ctx, parent, &changes, Cause::Inputs);
    if let Some((kind, why)) = left.first() {
        let message = format!(
            "{} children with deletionPolicy Orphan, of a kind the rule no longer has, are not let go of yet: {why}",
            kind.1
        );
        let changed = left
            .iter()
            .all(|(_, e)| matches!(e, ReconcileError::Conflict(_)));
        return orphans_pending(ctx, parent, message, changed)
            .await
            .map(Some);
    }
    let mut body = json!({"metadata": {"resourceVersion": parent.resource_version()}});
    body["metadata"]["annotations"] = json!({ labels::ORPHAN_KINDS: recorded::record(ctx, &[]) });
    let api = ctx.parent_api(parent);
    Ok(
        match patch_parent(ctx, &api, parent, &body, labels::ORPHAN_KINDS).await? {
            // Its watch event brings the next step.
            Patched::Patched => Some(Action::await_change()),
            Patched::Stale => Some(Action::requeue(STALE_RETRY)),
        },
    )
}

/// Before the finalizer comes off: the parent's `Orphan` children that another rule made
/// ([`recorded::let_go_of_foreign`]) are let go of. `Some`: what to do instead of going
/// on, after a failure reported on the parent.
async fn let_go_of_foreign(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
) -> Result<Option<Action>, ReconcileError> {
    let (changes, result) = recorded::let_go_of_foreign(ctx, parent, uid).await;
    report_changes(ctx, parent, &changes, Cause::Inputs);
    match result {
        Ok(()) => Ok(None),
        Err(ReconcileError::NotLeader) => Err(ReconcileError::NotLeader),
        Err(why) => {
            let changed = matches!(why, ReconcileError::Conflict(_));
            let message = format!(
                "children with deletionPolicy Orphan that another rule made are not let go of yet: {why}"
            );
            orphans_pending(ctx, parent, message, changed)
                .await
                .map(Some)
        }
    }
}

/// `Orphan` children the teardown could not let go of: said on the parent (`Deleting`
/// condition, reason `OrphansPending`; a Warning event), and looked at again soon when
/// they only `changed` under the patch, later otherwise.
async fn orphans_pending(
    ctx: &RuleContext,
    parent: &DynamicObject,
    message: String,
    changed: bool,
) -> Result<Action, ReconcileError> {
    event(
        ctx,
        parent,
        EventType::Warning,
        "OrphansPending",
        "Teardown",
        message.clone(),
    );
    if let Some(p) = super::cache::to_json(parent) {
        write_deleting(
            ctx,
            parent,
            &p,
            &ConditionState::new(true, "OrphansPending", &message),
        )
        .await?;
    }
    Ok(Action::requeue(if changed {
        ORPHAN_RECHECK
    } else {
        RECHECK
    }))
}

/// The last step: Rulebook's finalizer comes off, and the API server removes the parent
/// — once another rule's `Orphan` children (a rename) are let go of.
async fn finish(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    why: &str,
) -> Result<Action, ReconcileError> {
    if let Some(next) = let_go_of_foreign(ctx, parent, uid).await? {
        return Ok(next);
    }
    let api = ctx.parent_api(parent);
    match patch_parent(
        ctx,
        &api,
        parent,
        &finalizer_patch(parent, false),
        FINALIZER,
    )
    .await?
    {
        Patched::Patched => {
            lock(&ctx.let_go).remove(uid);
            info!(rule = %ctx.rule.name, parent = %parent.name_any(), why, "teardown done: finalizer removed");
            Ok(Action::await_change())
        }
        Patched::Stale => Ok(Action::requeue(STALE_RETRY)),
    }
}

/// Objects a page of [`uncached_children`] lists at most.
const UNCACHED_PAGE: u32 = 25;

/// Whether `o` has been in deletion longer than [`WAVE_TIMEOUT`].
fn overdue(o: &DynamicObject) -> bool {
    o.meta().deletion_timestamp.as_ref().is_some_and(|t| {
        Duration::try_from(jiff::Timestamp::now().duration_since(t.0))
            .is_ok_and(|d| d > WAVE_TIMEOUT)
    })
}

/// Before the finalizer comes off: whether the API server holds a child of the parent
/// that the caches have not shown yet (created just before the deletion), not already
/// in deletion — it would be left to the garbage collector, its policy unheeded.
async fn uncached_children(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
) -> Result<bool, ReconcileError> {
    let selector = format!(
        "{},{}={uid}",
        labels::child_selector(&ctx.rule.name),
        labels::OWNER
    );
    let ns = parent.namespace();
    let parent_name = parent.name_any();
    for kind in &ctx.kinds {
        let within = if ctx.parent.namespaced {
            ns.as_deref()
        } else {
            None
        };
        // A page at a time: the labels are public, and anyone may put them on objects
        // of any size in their namespace.
        let api = kind.api(&ctx.client, within);
        let mut token: Option<String> = None;
        loop {
            let mut params = ListParams::default().labels(&selector).limit(UNCACHED_PAGE);
            if let Some(t) = &token {
                params = params.continue_token(t);
            }
            let page = api
                .list_metadata(&params)
                .await
                .map_err(|source| ReconcileError::Read {
                    what: format!("{} children", kind.ar.kind),
                    source,
                })?;
            // The parent's controller reference, of a size the caches keep: one padded
            // past what a stub keeps would never be seen by the waves, and would hold
            // the finalizer for ever.
            let left = page.items.iter().any(|o| {
                o.metadata.deletion_timestamp.is_none()
                    && o.metadata.owner_references.iter().flatten().any(|r| {
                        r.uid == uid
                            && r.controller == Some(true)
                            && r.kind == ctx.parent.ar.kind
                            && r.name == parent_name
                            && split_api_version(&r.api_version).0 == ctx.parent.ar.group
                            && super::admission::kept_size(r)
                    })
            });
            if left {
                return Ok(true);
            }
            token = page.metadata.continue_.filter(|t| !t.is_empty());
            if token.is_none() {
                break;
            }
        }
    }
    Ok(false)
}
