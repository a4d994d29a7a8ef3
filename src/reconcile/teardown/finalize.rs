//! The finalize step of a teardown: the finalize child, rendered from the parent alone
//! and created once; its `doneWhen` or its timeout; and the marker on the parent
//! (`rulebook.dev/finalized: <outcome>@<deletionTimestamp>`) that says the step is over.
//!
//! The marker names the deletion it belongs to, so a marker written on the parent before
//! it was deleted counts for nothing. The step cannot wait forever: without a finalize
//! child (it cannot be created, or keeps disappearing) it gives up once the timeout has
//! passed since the parent's deletion.

use std::sync::Arc;
use std::time::Duration;

use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use serde_json::{Value as Json, json};

use super::STALE_RETRY;
use crate::cache;
use crate::meta::labels;
use crate::reconcile::apply::target;
use crate::reconcile::context::RuleContext;
use crate::reconcile::error::ReconcileError;
use crate::reconcile::events::{event, event_about};
use crate::reconcile::observe::read_stubs;
use crate::reconcile::offload::{finalize_done_off_runtime, render_finalize_off_runtime};
use crate::reconcile::plan::{FinalizeOutcome, FinalizeState, is_child_of};
use crate::write::writer::{Created, Patched, WriteError};

/// The finalize step as the cluster shows it, and how messages name its child.
pub(super) struct Finalizing {
    pub state: FinalizeState,
    pub what: String,
    /// When the step gives up (RFC 3339), for the parent's status.
    pub deadline: String,
}

/// The parent's deletionTimestamp, as written in the marker.
fn deleted_at(parent: &DynamicObject) -> Option<jiff::Timestamp> {
    parent.meta().deletion_timestamp.as_ref().map(|t| t.0)
}

/// Whether the parent carries the marker of this deletion.
fn marked(parent: &DynamicObject) -> bool {
    let (Some(value), Some(at)) = (
        parent.annotations().get(labels::FINALIZED),
        deleted_at(parent),
    ) else {
        return false;
    };
    value
        .rsplit_once('@')
        .and_then(|(_, t)| t.parse::<jiff::Timestamp>().ok())
        == Some(at)
}

fn rfc3339(t: jiff::Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// How long since `t`.
fn since(t: jiff::Timestamp) -> Duration {
    Duration::try_from(jiff::Timestamp::now().duration_since(t)).unwrap_or(Duration::ZERO)
}

pub(super) async fn finalize_state(
    ctx: &RuleContext,
    parent: &DynamicObject,
    parent_json: Option<&Json>,
    owned: &[(usize, Arc<DynamicObject>)],
) -> Result<Finalizing, ReconcileError> {
    let timeout = ctx.rule.finalize_timeout();
    let deletion = deleted_at(parent).unwrap_or_else(jiff::Timestamp::now);
    let mut f = Finalizing {
        state: FinalizeState::Over,
        what: String::new(),
        deadline: String::new(),
    };
    let Some(idx) = ctx.rule.rule.spec.finalize_child() else {
        return Ok(f);
    };
    let child = &ctx.rule.children()[idx];
    f.what = format!("the finalize child '{}'", child.name.value);
    if marked(parent) {
        return Ok(f);
    }
    let Some(parent_json) = parent_json else {
        failed(
            ctx,
            parent,
            "the parent cannot be read (nested too deeply): no finalize child is rendered".into(),
        );
        f.state = FinalizeState::Failed;
        return Ok(f);
    };
    // Created for this deletion: the finalize child is never rendered before it, so an
    // object older than the deletion that carries its name is someone's lookalike (it
    // would stand in for the real one, and time out at once), pruned with the rest.
    let live: Vec<_> = owned
        .iter()
        .filter(|(_, o)| {
            o.labels().get(labels::CHILD) == Some(&child.name.value)
                && o.metadata
                    .creation_timestamp
                    .as_ref()
                    .is_none_or(|t| t.0 >= deletion)
        })
        .cloned()
        .collect();
    let Some((k, live)) = read_stubs(ctx, live).await?.into_iter().next() else {
        // Not created yet, or gone: try (again) until the timeout since the deletion.
        f.state = if since(deletion) >= timeout {
            FinalizeState::TimedOut
        } else {
            FinalizeState::NotStarted
        };
        return Ok(f);
    };
    f.what = format!("{} {}", ctx.kinds[k].ar.kind, live.name_any());
    let created = live
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or(deletion, |t| t.0);
    f.deadline = created
        .checked_add(jiff::SignedDuration::try_from(timeout).unwrap_or_default())
        .map(rfc3339)
        .unwrap_or_default();
    let Some(child_json) = cache::to_json(&live) else {
        failed(
            ctx,
            parent,
            format!("{}: cannot be read (nested too deeply)", f.what),
        );
        f.state = FinalizeState::Failed;
        return Ok(f);
    };
    // A Secret finalize child's values stay out of the event a failing doneWhen records.
    let secrets = crate::render::secret_values_in(std::iter::once(&child_json));
    f.state = match finalize_done_off_runtime(ctx, parent_json.clone(), child_json).await? {
        Ok(true) => FinalizeState::Done,
        Ok(false) => match timeout.checked_sub(since(created)) {
            Some(remaining) if !remaining.is_zero() => FinalizeState::Running { remaining },
            _ => FinalizeState::TimedOut,
        },
        Err(e) => {
            let message = crate::render::redact(&e.to_string(), &secrets);
            failed(ctx, parent, format!("{}: doneWhen: {message}", f.what));
            FinalizeState::Failed
        }
    };
    Ok(f)
}

/// Renders the finalize child from the parent alone and creates it. The parent is read
/// from the API server first (a cache behind the marker must not start the step again),
/// and an object of the child's name is used only when it is this parent's: one created
/// by a reconcile whose result the cache has not shown yet is waited for; anyone else's
/// is never taken over (the step fails instead).
pub(super) async fn start_finalize(
    ctx: &RuleContext,
    parent: &DynamicObject,
) -> Result<Action, ReconcileError> {
    let api = ctx.parent_api(parent);
    let fresh = match api.get_opt(&parent.name_any()).await {
        Ok(Some(p)) if p.uid() == parent.uid() => p,
        Ok(_) => return Ok(Action::await_change()), // gone
        Err(e) => {
            return Err(ReconcileError::Read {
                what: "the parent".into(),
                source: e,
            });
        }
    };
    if marked(&fresh) {
        return Ok(Action::requeue(STALE_RETRY));
    }
    let Some(parent_json) = cache::to_json(&fresh) else {
        return skip_finalize(ctx, &fresh, FinalizeOutcome::Failed).await;
    };
    let uid = fresh.uid().unwrap_or_default();
    let desired = match render_finalize_off_runtime(ctx, parent_json).await? {
        Ok(Some(d)) => d,
        // Its includeWhen is false for this parent: nothing to wait for.
        Ok(None) => return skip_finalize(ctx, &fresh, FinalizeOutcome::Done).await,
        Err(e) => {
            failed(ctx, parent, format!("rendering the finalize child: {e}"));
            return skip_finalize(ctx, &fresh, FinalizeOutcome::Failed).await;
        }
    };
    let t = target(ctx, fresh.namespace().as_deref(), &desired);
    // A cluster-scoped parent's teardown looks only where the parent recorded placing
    // children: the finalize child's namespace is recorded before it is created.
    if !super::places::record_finalize_child(ctx, &fresh, t.oref.namespace.as_deref()).await? {
        return Ok(Action::requeue(STALE_RETRY));
    }
    match t.api.get_opt(&t.name).await {
        Ok(Some(o)) if is_child_of(&o, &uid) => return Ok(Action::requeue(STALE_RETRY)),
        Ok(Some(_)) => {
            failed(
                ctx,
                parent,
                format!(
                    "{} exists and is not this parent's: the finalize child is not created",
                    t.what
                ),
            );
            return skip_finalize(ctx, &fresh, FinalizeOutcome::Failed).await;
        }
        Ok(None) => {}
        Err(e) => {
            return Err(ReconcileError::Read {
                what: t.what,
                source: e,
            });
        }
    }
    // A create, refused if the name has been taken since the read (nothing written).
    let created = match ctx.writer.create(&t.api, &t.name, &desired.object).await {
        Ok(Created::Created(o)) => Ok(*o),
        Ok(Created::Refused(_)) => return Ok(Action::requeue(STALE_RETRY)),
        Err(e) => Err(e),
    };
    match created {
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
            Ok(Action::requeue(super::RECHECK))
        }
        Err(WriteError::NotLeader) => Err(ReconcileError::NotLeader),
        Err(WriteError::Api(e)) => Err(ReconcileError::Apply {
            what: t.what,
            source: e,
        }),
    }
}

/// Records on the parent that its finalize step is over, and how.
pub(super) async fn mark(
    ctx: &RuleContext,
    parent: &DynamicObject,
    outcome: FinalizeOutcome,
) -> Result<Patched, ReconcileError> {
    let at = deleted_at(parent).map(rfc3339).unwrap_or_default();
    let body = json!({"metadata": {
        "resourceVersion": parent.resource_version(),
        "annotations": {labels::FINALIZED: format!("{}@{at}", outcome.as_str())},
    }});
    let api = ctx.parent_api(parent);
    super::patch_parent(ctx, &api, parent, &body, labels::FINALIZED).await
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

/// The finalize step cannot run: a Warning event says why.
fn failed(ctx: &RuleContext, parent: &DynamicObject, note: String) {
    event(
        ctx,
        parent,
        EventType::Warning,
        "FinalizeFailed",
        "Finalize",
        note,
    );
}
