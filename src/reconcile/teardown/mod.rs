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
//! finalize step has its timeout, and the waves wait for objects held in deletion
//! (someone else's finalizer) [`WAVE_TIMEOUT`] at most in all, then go on without them.
//!
//! A teardown touches only the parent's own children: labelled with its UID and
//! controlled by it (or, an `Orphan` child, which has no ownerReference, recorded so),
//! made before its deletion (but the finalize child), and — a cluster-scoped parent's —
//! in the namespaces it recorded placing children in ([`places`]).

mod children;
mod finalize;
pub mod places;
pub mod recorded;

use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, DynamicObject};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use serde_json::{Value as Json, json};
use tracing::{info, warn};

use super::context::RuleContext;
use super::error::ReconcileError;
use super::events::{Cause, event, report_changes};
use super::plan::{FinalizeOutcome, TeardownStep, plan_teardown};
use super::prune::deletion_policy;
use super::status_write::write_deleting;
use crate::meta::{FINALIZER, labels, split_api_version};
use crate::render::status::ConditionState;
use crate::rules::DeletionPolicy;
use crate::write::writer::{Patched, WriteError};
use children::{Wave, run_wave, still_awaited, teardown_children, uncached_children, wave_states};
use finalize::{finalize_state, mark, start_finalize};

/// How often a waiting teardown looks again without being woken by a watch event.
const RECHECK: Duration = Duration::from_secs(30);
/// How soon a wave with orphaned children looks again (nothing wakes it).
const ORPHAN_RECHECK: Duration = Duration::from_secs(1);
/// How soon a step is retried after its conditional write found the object changed.
const STALE_RETRY: Duration = Duration::from_millis(500);
/// How long a teardown waits for objects already in deletion (held by someone else's
/// finalizer), in all, before it goes on without them.
pub const WAVE_TIMEOUT: Duration = Duration::from_secs(600);

pub(super) fn has_finalizer(o: &DynamicObject) -> bool {
    o.finalizers().iter().any(|f| f == FINALIZER)
}

/// In normal operation: the parent carries the finalizer exactly when its rule needs it
/// (added before any child is created, so a deletion right after creation is torn down
/// too; removed when a rule change drops its deletion steps), and the record of its
/// `Orphan` children's kinds ([`recorded`]) is up to date, written with it. No write
/// when both match. Called only for the rule that holds the finalizer on its kind
/// (`rules::decorators::KindRole::finalizer`); `taken`: its selector takes the parent. `false`: the parent changed since it was cached; reconcile it again
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
    taken: bool,
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
        !ctx.memory.orphans_cleaned(
            split_api_version(api_version).0,
            kind,
            parent.namespace().as_deref(),
        )
    });
    // Kept, not added, while orphans may be pending: children of a kind the rule dropped,
    // or children the rule no longer has that recorded `Orphan` (this reconcile's prune
    // lets go of those).
    // A parent outside the rule's selector needs it only while it has `Orphan` children
    // of the rule, which the reconcile lets go of next (`select.rs`).
    let needs = (taken && ctx.rule_needs_finalizer())
        || (has_finalizer(parent)
            && (ctx.memory.orphans_pending()
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
    teardown_children(ctx, parent, &uid)
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
    if let Some(deleted) = parent.metadata.deletion_timestamp.as_ref() {
        ctx.report_teardowns(ctx.memory.teardown_runs(uid, deleted.0.as_second()));
    }
    // Children of kinds the rule no longer has, recorded `Orphan`: no cache shows them,
    // and the garbage collector would delete them with the parent.
    if let Some(next) = let_go_of_recorded(ctx, parent, uid).await? {
        return Ok(next);
    }
    if !ctx.rule_needs_finalizer() {
        if ctx.memory.orphans_pending() {
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
    let parent_json = crate::cache::to_json(parent);
    let owned = still_awaited(ctx, parent, uid);
    let finalizing = finalize_state(ctx, parent, parent_json.as_ref(), &owned).await?;
    let states = wave_states(ctx, uid, &owned);
    let order = ctx
        .rule
        .rule
        .spec
        .deletion
        .as_ref()
        .map(|d| d.order)
        .unwrap_or_default();
    match plan_teardown(finalizing.state, &states, order) {
        TeardownStep::StartFinalize => start_finalize(ctx, parent).await,
        TeardownStep::AwaitFinalize { remaining } => {
            let message = format!(
                "waiting for {}: doneWhen is not true yet (timeout at {})",
                finalizing.what, finalizing.deadline
            );
            deleting(ctx, parent, parent_json.as_ref(), "Finalizing", &message).await?;
            Ok(Action::requeue(
                (remaining + Duration::from_secs(1)).min(RECHECK),
            ))
        }
        TeardownStep::MarkFinalized(outcome) => {
            mark_finalized(ctx, parent, &finalizing.what, outcome).await
        }
        TeardownStep::Wave { act, waiting } => {
            let wave = Wave {
                owned: &owned,
                act: &act,
                waiting: &waiting,
            };
            run_wave(ctx, parent, uid, parent_json.as_ref(), wave).await
        }
        TeardownStep::RemoveFinalizer => {
            if uncached_children(ctx, parent, uid).await? {
                return Ok(Action::requeue(STALE_RETRY));
            }
            finish(ctx, parent, uid, "every child is gone").await
        }
    }
}

/// The parent's `Deleting` condition says which step the teardown is at.
pub(super) async fn deleting(
    ctx: &RuleContext,
    parent: &DynamicObject,
    parent_json: Option<&Json>,
    reason: &str,
    message: &str,
) -> Result<(), ReconcileError> {
    match parent_json {
        Some(p) => {
            write_deleting(ctx, parent, p, &ConditionState::new(true, reason, message)).await
        }
        None => Ok(()),
    }
}

/// Records on the parent that the finalize step of `what` is over, and how.
async fn mark_finalized(
    ctx: &RuleContext,
    parent: &DynamicObject,
    what: &str,
    outcome: FinalizeOutcome,
) -> Result<Action, ReconcileError> {
    let (type_, reason, note) = match outcome {
        FinalizeOutcome::Done => (
            EventType::Normal,
            "Finalized",
            format!("{what}: doneWhen is true; deleting the children"),
        ),
        FinalizeOutcome::TimedOut => (
            EventType::Warning,
            "FinalizeTimedOut",
            format!(
                "{what}: doneWhen was not true within {}s; deleting the children anyway",
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
    if let Some(p) = crate::cache::to_json(parent) {
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
            ctx.memory.teardown_done(uid);
            ctx.report_teardowns(ctx.memory.oldest_teardown());
            info!(rule = %ctx.rule.name, parent = %parent.name_any(), why, "teardown done: finalizer removed");
            Ok(Action::await_change())
        }
        Patched::Stale => Ok(Action::requeue(STALE_RETRY)),
    }
}
