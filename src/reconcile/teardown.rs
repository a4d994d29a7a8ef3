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
//! Every step is read back from the cluster (the finalize child, the marker annotation
//! on the parent, the children left), so an operator killed at any point resumes where
//! it was; every write is conditional on the object as seen (resourceVersion or UID), so
//! nothing is deleted twice or written over a newer state.

use std::time::Duration;

use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use serde_json::{Value as Json, json};
use tracing::info;

use super::apply::target;
use super::cache;
use super::context::{RuleContext, lock};
use super::error::{ReconcileError, is_not_found};
use super::events::{event, event_about, report_changes};
use super::observe::read_stubs;
use super::offload::{finalize_done_off_runtime, render_finalize_off_runtime};
use super::plan::{
    FinalizeOutcome, FinalizeState, Owned, TeardownStep, controlled_by, plan_teardown,
};
use super::prune::{leave_child, policy_of};
use super::status::write_deleting;
use super::writer::{Patched, WriteError};
use crate::meta::{FINALIZER, labels};
use crate::render::status::ConditionState;
use crate::rules::DeletionPolicy;

/// How often a waiting teardown looks again without being woken by a watch event.
const RECHECK: Duration = Duration::from_secs(30);
/// How soon a wave with orphaned children looks again (nothing wakes it).
const ORPHAN_RECHECK: Duration = Duration::from_secs(1);
/// How soon a step is retried after its conditional write found the object changed.
const STALE_RETRY: Duration = Duration::from_millis(500);

pub(super) fn has_finalizer(o: &DynamicObject) -> bool {
    o.finalizers().iter().any(|f| f == FINALIZER)
}

/// In normal operation: the parent carries the finalizer exactly when its rule needs it
/// (added before any child is created, so a deletion right after creation is torn down
/// too; removed when a rule change drops its deletion steps). No write when it matches.
pub(super) async fn keep_finalizer(
    ctx: &RuleContext,
    parent: &DynamicObject,
) -> Result<(), ReconcileError> {
    match (ctx.rule.rule.spec.needs_finalizer(), has_finalizer(parent)) {
        (true, false) => {
            let mut metadata = json!({
                "name": parent.name_any(),
                "uid": parent.uid(),
                "finalizers": [FINALIZER],
            });
            if let Some(ns) = parent.namespace() {
                metadata["namespace"] = Json::from(ns);
            }
            let body = json!({
                "apiVersion": ctx.parent.ar.api_version,
                "kind": ctx.parent.ar.kind,
                "metadata": metadata,
            });
            let api = ctx.parent_api(parent);
            match ctx.writer.apply(&api, &parent.name_any(), &body).await {
                Ok(_) => Ok(()),
                Err(WriteError::NotLeader) => Err(ReconcileError::NotLeader),
                Err(WriteError::Api(e)) if is_not_found(&e) => Ok(()),
                Err(WriteError::Api(e)) => Err(ReconcileError::Apply {
                    what: format!("the finalizer {FINALIZER} on the parent"),
                    source: e,
                }),
            }
        }
        (false, true) => remove_finalizer(ctx, parent).await.map(|_| ()),
        _ => Ok(()),
    }
}

/// The merge patch that removes Rulebook's finalizer from `parent` as seen (its
/// resourceVersion is the precondition), keeping everyone else's.
pub fn release_patch(parent: &DynamicObject) -> Json {
    let rest: Vec<&String> = parent
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .collect();
    json!({"metadata": {
        "resourceVersion": parent.resource_version(),
        "finalizers": if rest.is_empty() { Json::Null } else { json!(rest) },
    }})
}

async fn remove_finalizer(
    ctx: &RuleContext,
    parent: &DynamicObject,
) -> Result<Patched, ReconcileError> {
    let api = ctx.parent_api(parent);
    match ctx
        .writer
        .merge_patch(&api, &parent.name_any(), &release_patch(parent))
        .await
    {
        Ok(p) => Ok(p),
        Err(WriteError::NotLeader) => Err(ReconcileError::NotLeader),
        Err(WriteError::Api(e)) => Err(ReconcileError::Apply {
            what: format!("removing the finalizer {FINALIZER} from the parent"),
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
    if !ctx.rule.rule.spec.needs_finalizer() {
        // A rule change dropped the deletion steps: the garbage collector takes over.
        return finish(ctx, parent, uid, "the rule has no deletion steps any more").await;
    }
    let parent_json = cache::to_json(parent);
    let owned = ctx.owned_children(uid, parent.namespace().as_deref());
    let finalizing = finalize_state(ctx, parent, parent_json.as_ref(), &owned).await?;
    let states: Vec<Owned> = {
        let let_go = lock(&ctx.let_go);
        let mine = let_go.get(uid);
        owned
            .iter()
            .map(|(_, o)| Owned {
                position: position_of(ctx, o),
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
        TeardownStep::StartFinalize => start_finalize(ctx, parent, parent_json).await,
        TeardownStep::AwaitFinalize { remaining } => {
            status(
                "Finalizing",
                format!(
                    "waiting for {}: doneWhen is not true yet ({}s until the timeout)",
                    finalizing.what,
                    remaining.as_secs()
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
                    Ok(change) => {
                        if let Some(child) = o.uid() {
                            lock(&ctx.let_go)
                                .entry(uid.to_string())
                                .or_default()
                                .insert(child);
                        }
                        changes.extend(change);
                    }
                    Err(e) => {
                        failure.get_or_insert(e);
                    }
                }
            }
            report_changes(ctx, parent, &changes);
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
            let orphans = act
                .iter()
                .chain(&waiting)
                .any(|&i| policy_of(ctx, &owned[i].1) == DeletionPolicy::Orphan);
            Ok(Action::requeue(if orphans {
                ORPHAN_RECHECK
            } else {
                RECHECK
            }))
        }
        TeardownStep::RemoveFinalizer => finish(ctx, parent, uid, "every child is gone").await,
    }
}

/// The last step: Rulebook's finalizer comes off, and the API server removes the parent.
async fn finish(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    why: &str,
) -> Result<Action, ReconcileError> {
    match remove_finalizer(ctx, parent).await? {
        Patched::Patched => {
            lock(&ctx.let_go).remove(uid);
            info!(rule = %ctx.rule.name, parent = %parent.name_any(), why, "teardown done: finalizer removed");
            Ok(Action::await_change())
        }
        Patched::Stale => Ok(Action::requeue(STALE_RETRY)),
    }
}

/// A child's position in the rule, by its `rulebook.dev/child` label; `usize::MAX` for a
/// child the rule no longer has (it goes first).
fn position_of(ctx: &RuleContext, o: &DynamicObject) -> usize {
    let name = o.labels().get(labels::CHILD);
    ctx.rule
        .children()
        .iter()
        .position(|c| Some(&c.name.value) == name)
        .unwrap_or(usize::MAX)
}

/// The finalize step as the cluster shows it, and how messages name its child.
struct Finalizing {
    state: FinalizeState,
    what: String,
}

async fn finalize_state(
    ctx: &RuleContext,
    parent: &DynamicObject,
    parent_json: Option<&Json>,
    owned: &[(usize, std::sync::Arc<DynamicObject>)],
) -> Result<Finalizing, ReconcileError> {
    let over = |what: String| Finalizing {
        state: FinalizeState::Over,
        what,
    };
    let Some(idx) = ctx.rule.rule.spec.finalize_child() else {
        return Ok(over(String::new()));
    };
    let child = &ctx.rule.children()[idx];
    let mut what = format!("the finalize child '{}'", child.name.value);
    if parent.annotations().contains_key(labels::FINALIZED) {
        return Ok(over(what));
    }
    let Some(parent_json) = parent_json else {
        event(
            ctx,
            parent,
            EventType::Warning,
            "FinalizeFailed",
            "Finalize",
            "the parent cannot be read (nested too deeply): no finalize child is rendered".into(),
        );
        return Ok(Finalizing {
            state: FinalizeState::Failed,
            what,
        });
    };
    let live: Vec<_> = owned
        .iter()
        .filter(|(_, o)| o.labels().get(labels::CHILD) == Some(&child.name.value))
        .cloned()
        .collect();
    let Some((k, live)) = read_stubs(ctx, live).await?.into_iter().next() else {
        return Ok(Finalizing {
            state: FinalizeState::NotStarted,
            what,
        });
    };
    what = format!("{} {}", ctx.kinds[k].ar.kind, live.name_any());
    let Some(child_json) = cache::to_json(&live) else {
        return Ok(Finalizing {
            state: FinalizeState::Failed,
            what,
        });
    };
    let state = match finalize_done_off_runtime(ctx, parent_json.clone(), child_json).await? {
        Ok(true) => FinalizeState::Done,
        Ok(false) => {
            let created = live
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0)
                .unwrap_or_else(jiff::Timestamp::now);
            let waited = jiff::Timestamp::now().duration_since(created);
            let waited = Duration::try_from(waited).unwrap_or(Duration::ZERO);
            match ctx.rule.finalize_timeout().checked_sub(waited) {
                Some(remaining) if !remaining.is_zero() => FinalizeState::Running { remaining },
                _ => FinalizeState::TimedOut,
            }
        }
        Err(e) => {
            event(
                ctx,
                parent,
                EventType::Warning,
                "FinalizeFailed",
                "Finalize",
                format!("{what}: doneWhen: {e}"),
            );
            FinalizeState::Failed
        }
    };
    Ok(Finalizing { state, what })
}

/// Renders the finalize child from the parent alone and creates it — unless an object of
/// that name is already the parent's (created by a reconcile whose result the cache has
/// not shown yet): the child is rendered and created once.
async fn start_finalize(
    ctx: &RuleContext,
    parent: &DynamicObject,
    parent_json: Option<Json>,
) -> Result<Action, ReconcileError> {
    let Some(parent_json) = parent_json else {
        return Ok(Action::requeue(STALE_RETRY));
    };
    let uid = parent.uid().unwrap_or_default();
    let desired = match render_finalize_off_runtime(ctx, parent_json).await? {
        Ok(Some(d)) => d,
        Ok(None) => {
            // Its includeWhen is false for this parent: nothing to wait for.
            return skip_finalize(ctx, parent, FinalizeOutcome::Done).await;
        }
        Err(e) => {
            event(
                ctx,
                parent,
                EventType::Warning,
                "FinalizeFailed",
                "Finalize",
                format!("rendering the finalize child: {e}"),
            );
            return skip_finalize(ctx, parent, FinalizeOutcome::Failed).await;
        }
    };
    let t = target(ctx, parent.namespace().as_deref(), &desired);
    match t.api.get_opt(&t.name).await {
        Ok(Some(o)) if controlled_by(&o, &uid) => return Ok(Action::requeue(STALE_RETRY)),
        Ok(_) => {}
        Err(e) => {
            return Err(ReconcileError::Read {
                what: t.what,
                source: e,
            });
        }
    }
    match ctx.writer.apply(&t.api, &t.name, &desired.object).await {
        Ok(created) => {
            event_about(
                ctx,
                parent,
                Some(created.object_ref(&t.kind.ar)),
                EventType::Normal,
                "Finalizing",
                "Finalize",
                format!(
                    "{} created; waiting for its doneWhen (at most {}s)",
                    t.what,
                    ctx.rule.finalize_timeout().as_secs()
                ),
            );
            Ok(Action::requeue(RECHECK))
        }
        Err(WriteError::NotLeader) => Err(ReconcileError::NotLeader),
        Err(WriteError::Api(e)) => Err(ReconcileError::Apply {
            what: t.what,
            source: e,
        }),
    }
}

/// Records on the parent that its finalize step is over, and how.
async fn mark(
    ctx: &RuleContext,
    parent: &DynamicObject,
    outcome: FinalizeOutcome,
) -> Result<Patched, ReconcileError> {
    let body = json!({"metadata": {
        "resourceVersion": parent.resource_version(),
        "annotations": {labels::FINALIZED: outcome.as_str()},
    }});
    match ctx
        .writer
        .merge_patch(&ctx.parent_api(parent), &parent.name_any(), &body)
        .await
    {
        Ok(p) => Ok(p),
        Err(WriteError::NotLeader) => Err(ReconcileError::NotLeader),
        Err(WriteError::Api(e)) => Err(ReconcileError::Apply {
            what: format!("the annotation {} on the parent", labels::FINALIZED),
            source: e,
        }),
    }
}

/// A finalize step with nothing to run (`includeWhen` false: `Done`) or that cannot run
/// (`Failed`, already reported) is over at once.
async fn skip_finalize(
    ctx: &RuleContext,
    parent: &DynamicObject,
    outcome: FinalizeOutcome,
) -> Result<Action, ReconcileError> {
    Ok(match mark(ctx, parent, outcome).await? {
        Patched::Patched => Action::await_change(),
        Patched::Stale => Action::requeue(STALE_RETRY),
    })
}
