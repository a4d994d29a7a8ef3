//! One reconcile of one parent — the only place that writes to the API server, and only
//! through its [`crate::write::writer::Writer`].
//!
//! [`reconcile_inner`] reads as its stages:
//!
//! 0. deletion: a parent being deleted is torn down instead ([`teardown`]); others carry
//!    Rulebook's finalizer exactly when the rule needs it;
//! 1. observe the parent and its live children in the caches; a paused parent stops
//!    here (one `Paused` condition);
//!    1b. dereference: the objects its references point at (a required one missing
//!    stops here, `ReferenceMissing`);
//! 2. render the desired children (a first attempt on the runtime within a slice of
//!    the parent's budget, else on the blocking pool: `offload.rs`);
//! 3. apply those the plan says differ, dependencies first; a conflict holds the parent's
//!    writes, a failure its dependents';
//! 4. prune what the parent owns and no longer renders (or orphan it);
//! 5. status;
//! 6. events.
//!
//! The decisions are pure functions in [`plan`]; each stage lives in its own file. At
//! steady state every stage finds nothing to do and makes no request.

mod apply;
mod apply_stage;
pub mod context;
mod dereference;
pub mod drift;
pub mod error;
mod events;
pub mod inflight;
pub mod memory;
mod observe;
mod offload;
pub mod plan;
mod prune;
pub mod refs;
#[cfg(test)]
mod stages_mock;
pub mod status;
pub mod teardown;
#[cfg(test)]
mod write_answers_tests;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use tracing::debug;
use tracing::warn;

use crate::cache;
use crate::meta::JsonAt;
use crate::metrics::{self, ResultLabels};
use crate::render::Observed;
use dereference::{Inputs, dereference};
use events::{Cause, children_after, event, observed_after, report_changes};
use observe::{Confined, confine_to_rendered_namespaces, read_stubs, unreadable_parent};
use offload::{render_off_runtime, status_off_runtime};
use plan::plan_prunes;
use prune::leave_child;
use status::{write_paused, write_status};
use teardown::places::Recorded;

pub use crate::write::gate::WriteGate;
pub use context::{ChildKind, ContextParts, ParentKind, RuleContext};
pub use error::{Reason, ReconcileError};
pub use memory::{BackoffPolicy, MemoryParts, ParentMemory, Paused};
pub use prune::orphan_patch;

/// Reconciles one parent. Called by the rule's controller.
pub async fn reconcile(
    parent: Arc<DynamicObject>,
    ctx: Arc<RuleContext>,
) -> Result<Action, ReconcileError> {
    let rule = ctx.rule.name.clone();
    let started = Instant::now();
    let gauge = ctx
        .metrics
        .in_flight
        .get_or_create(&metrics::rule(&rule))
        .clone();
    gauge.inc();
    ctx.forget_gone();
    // kube-runtime hands over the parent as cached when the reconcile was scheduled; the
    // cache may hold a newer version by now (Rulebook's own last status write among them).
    let parent = ctx
        .parent_store
        .get(&ObjectRef::from_obj_with(
            parent.as_ref(),
            ctx.parent.ar.clone(),
        ))
        .unwrap_or(parent);
    let uid = parent.uid();
    let key = (parent.namespace(), parent.name_any());
    let result = reconcile_inner(parent, &ctx).await;
    gauge.dec();
    ctx.metrics
        .reconcile_duration
        .get_or_create(&metrics::rule(&rule))
        .observe(started.elapsed().as_secs_f64());
    let label = match &result {
        Ok(_) => "ok",
        Err(e) => e.result_label(),
    };
    ctx.metrics
        .reconciles
        .get_or_create(&ResultLabels {
            rule: rule.clone(),
            result: label.to_string(),
        })
        .inc();
    if result.is_ok()
        && let Some(uid) = uid
    {
        ctx.memory.succeeded(&uid, &key);
    }
    result
}

/// The controller's error policy: exponential backoff per parent, capped; the retry
/// comes through the rule's turns when it ends ([`memory::Backoffs`]).
pub fn error_policy(
    parent: Arc<DynamicObject>,
    err: &ReconcileError,
    ctx: Arc<RuleContext>,
) -> Action {
    if let ReconcileError::Fight { retry_in, .. } = err {
        // Not a failure of the reconcile: it waits out the fight's own backoff, which
        // must not grow the parent's error backoff with every change the other side makes.
        debug!(rule = %ctx.rule.name, parent = %parent.name_any(), retry_in = ?retry_in, "fight backoff");
        return Action::requeue(*retry_in + Duration::from_millis(100));
    }
    let n = ctx.memory.failed(&parent.uid().unwrap_or_default());
    let delay = match err {
        // A template error cannot change until the parent, the rule or a child changes,
        // and each of those reconciles anyway: retry rarely (16 s, 32 s, … the cap).
        ReconcileError::Render(_) => ctx.backoff.delay(n.saturating_add(4)),
        _ => ctx.backoff.delay(n),
    };
    // The retry comes from the backoffs (`memory::Backoffs::retries`) through the rule's
    // turns, as every other trigger: a flood of failing parents retried together takes
    // its namespace's turns, not every worker. Until then, a change of an object the
    // parent references waits (the retry reads it): a tenant's edits cannot cut its
    // failing parents' backoff short.
    ctx.memory.back_off(
        (parent.namespace(), parent.name_any()),
        tokio::time::Instant::now() + delay,
    );
    match err {
        ReconcileError::NotLeader => debug!("not the leader"),
        _ => {
            // The message may quote tenant values (a template error, a conflicting name):
            // it is on the parent's condition and at debug level, not in warnings.
            warn!(rule = %ctx.rule.name, parent = %parent.name_any(), failures = n, retry_in = ?delay, reason = err.reason().as_str(), "reconcile failed");
            debug!(rule = %ctx.rule.name, parent = %parent.name_any(), error = %err, "reconcile failed");
        }
    }
    Action::await_change()
}

async fn reconcile_inner(
    parent: Arc<DynamicObject>,
    ctx: &RuleContext,
) -> Result<Action, ReconcileError> {
    if !ctx.writer.may_write() {
        return Err(ReconcileError::NotLeader);
    }
    let Some(uid) = parent.uid() else {
        return Err(ReconcileError::Invalid("parent has no uid".into()));
    };
    if !ctx.children_listed() {
        // A parent reconciled before its children are cached would see none and report
        // them missing. Each child cache's listing reconciles every parent when it completes.
        debug!(rule = %ctx.rule.name, parent = %parent.name_any(), "child caches not listed yet; deferred");
        return Ok(Action::await_change());
    }
    // A parent cached without content (over the cache budget) is read whole first.
    let Some(parent) = observe::read_stub_parent(ctx, parent).await? else {
        return Ok(Action::await_change()); // gone, or replaced
    };
    let parent: &DynamicObject = &parent;
    // 0. Deletion: a parent being deleted is torn down (or left to the garbage collector
    //    when it does not carry Rulebook's finalizer); others carry the finalizer exactly
    //    when the rule needs it.
    if parent.meta().deletion_timestamp.is_some() {
        return teardown::teardown(ctx, parent, &uid).await;
    }
    let paused = is_paused(parent);
    ctx.memory.set_paused(&uid, paused);
    if paused {
        // Nothing is written for a paused parent but its `Paused` condition.
        let Some(parent_json) = cache::to_json(parent) else {
            return Ok(Action::await_change());
        };
        write_paused(ctx, parent, &parent_json).await?;
        return Ok(Action::await_change());
    }
    if !teardown::keep_finalizer(ctx, parent).await? {
        return Ok(Action::requeue(Duration::from_millis(500)));
    }
    let namespace = parent.namespace();
    let rule = &ctx.rule;

    // 1. Observe: the parent and its live children, as the caches (or, for children cached
    //    without content, the API server) have them. Nothing changed since a reconcile
    //    that had nothing to do (and no references to look at): nothing to do, and
    //    nothing is even read as JSON.
    //    What earlier reconciles awaited is not awaited while this one decides from the
    //    caches (`Steady::begin`), unless it stops at the fingerprint.
    let awaited = ctx.memory.begin(&uid);
    let live_children = read_stubs(ctx, ctx.owned_children(&uid, namespace.as_deref())).await?;
    let no_refs = std::collections::BTreeMap::new();
    if rule.rule.spec.references.is_empty()
        && let Some(done) = skip_if_steady(ctx, parent, &uid, &live_children, &no_refs)
    {
        ctx.memory.resume(&uid, awaited);
        return Ok(done);
    }
    let Some(mut parent_json) = cache::to_json(parent) else {
        return unreadable_parent(ctx, parent).await;
    };
    // The status this process last wrote, when the cache predates it.
    let written = ctx.memory.status_written_since(&uid, parent);
    let cause = if status::rule_rollout_only(ctx, parent, written.as_ref(), &parent_json) {
        Cause::RuleRollout
    } else {
        Cause::Inputs
    };
    if rule.reads_parent_status()
        && let Some(status) = written
        && let Some(p) = parent_json.as_object_mut()
    {
        // The rule reads the status: the parent as this process knows it (the status
        // watch event does not bring a reconcile of its own, and the steady check
        // already counts that write).
        p.insert("status".into(), status);
    }
    let observed = Observed::from_objects(
        live_children
            .iter()
            .filter_map(|(k, o)| cache::to_json_as(o, &ctx.kinds[*k].ar)),
    );

    // 1b. Dereference: where the references point (an expression over the parent), and
    //     what is there. A required object missing: nothing is applied or pruned. The
    //     inputs' weight is held in the process's budget until the status is evaluated.
    let inputs = (parent_json, observed, rule.budget());
    let (parent_json, observed, budget, permit) =
        match dereference(ctx, parent, &live_children, inputs).await? {
            Inputs::Ready(p, o, b, permit) => (p, o, b, permit),
            Inputs::Stop(done) => return done,
        };

    // With references: the same once they are looked up.
    if !rule.rule.spec.references.is_empty()
        && let Some(done) = skip_if_steady(ctx, parent, &uid, &live_children, &observed.refs)
    {
        ctx.memory.resume(&uid, awaited);
        return Ok(done);
    }
    drop(awaited);
    let live_keys = memory::digest::keys(&live_children);
    let seen = memory::digest::observed_of(live_keys.clone(), &observed.refs);
    let inputs = |ctx: &RuleContext| ctx.memory.fingerprint(&uid, parent, seen);

    // 2. Render the desired children (`offload.rs`: on the runtime within a slice, or
    // on the blocking pool).
    let (rendered, parent_json, observed, budget) =
        render_off_runtime(ctx, parent_json, observed, budget).await?;
    let (desired, live_children, observed, budget) =
        match confine_to_rendered_namespaces(ctx, rendered, live_children, observed) {
            Confined::Same(d, l, o) => (d, l, o, budget),
            Confined::Narrowed(l, o) => {
                let (again, _, o, budget) =
                    render_off_runtime(ctx, parent_json.clone(), o, budget).await?;
                (again, l, o, budget)
            }
        };
    let desired = match desired {
        Ok(d) => d,
        Err(e) => return render_failed(ctx, parent, &parent_json, &observed, e, "Render").await,
    };
    // A cluster-scoped parent records where its children go before any is applied
    // there: its teardown looks nowhere else.
    match teardown::places::record(ctx, parent, &uid, &desired).await? {
        Recorded::Same | Recorded::Written => {}
        Recorded::Stale => return Ok(Action::requeue(Duration::from_millis(500))),
        Recorded::TooMany(e) => {
            return render_failed(ctx, parent, &parent_json, &observed, e, "Render").await;
        }
    }

    // 3. Apply (`apply_stage.rs`): rule order, except that a child goes after the
    //    siblings it waits for or names; a conflict holds every write of the parent, a
    //    failure the children that depend on it.
    let applied = apply_stage::apply_children(
        ctx,
        parent,
        &uid,
        namespace.as_deref(),
        &desired,
        &live_children,
    )
    .await;
    let (mut changes, pending, mut failure) = (applied.changes, applied.pending, applied.failure);

    // 4. Prune what this parent owns and no longer renders.
    let wanted: Vec<(usize, Option<&str>, &str)> = desired
        .iter()
        .map(|d| {
            let kind = ctx.kind_of_child[d.child];
            let ns = if ctx.kinds[kind].namespaced {
                d.object
                    .at(&["metadata", "namespace"])
                    .and_then(serde_json::Value::as_str)
            } else {
                None
            };
            (kind, ns, d.object_name())
        })
        .collect();
    for i in plan_prunes(&wanted, &live_children) {
        let (k, obj) = &live_children[i];
        match leave_child(ctx, parent, &ctx.kinds[*k], obj).await {
            Ok(Some(change)) => changes.push(change),
            Ok(None) => {}
            Err(e) => {
                failure.get_or_insert(e);
            }
        }
    }

    // A child this process applied is still cached in its older version: the status
    // would be computed from it. Its watch event brings the parent back (or, should it
    // be lost, the requeue).
    if pending && failure.is_none() {
        report_changes(ctx, parent, &changes, cause);
        ctx.memory.forget_steady(&uid);
        return Ok(Action::requeue(Duration::from_secs(5)));
    }

    // 5. Status, from the children as this reconcile left them: what was just applied
    //    replaces the cached copy, what was just pruned is gone. (Waiting for the caches
    //    would cost a second reconcile and a second status write.)
    // What the caches will hold once this reconcile's writes reach them: when nothing the
    // rule evaluates depends on the live children or the parent's status, a reconcile
    // over exactly that is one with nothing to do (the same render, children as
    // applied, the same status).
    let after = (!changes.is_empty() && !rule.depends_on_own_writes())
        .then(|| children_after(live_keys, &changes, &observed.refs));
    let observed = if changes.is_empty() {
        observed
    } else {
        observed_after(observed, &mut changes)
    };
    // Secret values a message may quote: the references', the children's as observed,
    // and those this reconcile meant to write (a Secret child's value that an admission
    // webhook quotes in its refusal may be in no cache).
    let secrets = observed.secret_values_with(&desired);
    let (report, parent_json) =
        status_off_runtime(ctx, parent_json, observed, desired, budget).await?;
    // Nothing of the inputs is held any more.
    drop(permit);
    let report = match report {
        Ok(report) => report,
        Err(mut e) => {
            e.message = crate::render::redact(&e.message, &secrets);
            return render_failed(ctx, parent, &parent_json, &Observed::default(), e, "Status")
                .await;
        }
    };
    let fields = Some(report.fields);
    let result = match failure {
        Some(err) => {
            let err = err.redacted(&secrets);
            let state = err.condition();
            event(
                ctx,
                parent,
                EventType::Warning,
                &state.reason,
                "Reconcile",
                state.message.clone(),
            );
            // The API server's refusal of a status may quote a value from a Secret.
            write_status(ctx, parent, &parent_json, fields.as_ref(), &state)
                .await
                .map_err(|e| e.redacted(&secrets))?;
            Err(err)
        }
        None => {
            let ready = report.readiness.condition();
            write_status(ctx, parent, &parent_json, fields.as_ref(), &ready)
                .await
                .map_err(|e| e.redacted(&secrets))?;
            // No child written: the same inputs (with the parent as its status write left
            // it) give the same outcome, so the next reconcile of them can stop early.
            let ns = parent.metadata.namespace.as_deref();
            match after {
                _ if changes.is_empty() => ctx.memory.mark_steady(&uid, ns, inputs(ctx)),
                // The watch events its own writes bring reconcile nothing (each was
                // awaited as it was written: `Steady::expects`), and a reconcile
                // something else brings stops early.
                Some(children) => {
                    let inputs = ctx.memory.fingerprint(&uid, parent, children);
                    ctx.memory.mark_written(&uid, ns, inputs);
                }
                None => ctx.memory.forget_steady(&uid),
            }
            Ok(settled())
        }
    };

    // 6. Events: one per kind of change.
    report_changes(ctx, parent, &changes, cause);
    result
}

/// `Some(action)` when the parent's inputs are those of a reconcile that had nothing to
/// do ([`memory::Steady`]): the reconcile stops there.
fn skip_if_steady(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    live_children: &[(usize, Arc<DynamicObject>)],
    refs: &std::collections::BTreeMap<String, serde_json::Value>,
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

/// What a reconcile that went through asks of kube-runtime: nothing until a change. A
/// rule's resync is the engine's sweep (`engine::resync`), not a requeue per parent.
fn settled() -> Action {
    Action::await_change()
}

/// Whether the parent carries `rulebook.dev/paused: "true"`.
fn is_paused(parent: &DynamicObject) -> bool {
    parent
        .annotations()
        .get(crate::meta::labels::PAUSED)
        .is_some_and(|v| v == "true")
}

/// A required reference is missing: `Ready=False` reason `ReferenceMissing` naming it
/// (never a value), a Warning event, and nothing applied or pruned. The reference's
/// watch wakes the parent when the object appears.
async fn reference_missing(
    ctx: &RuleContext,
    parent: &DynamicObject,
    parent_json: &serde_json::Value,
    message: String,
) -> Result<Action, ReconcileError> {
    let state = crate::render::status::ConditionState::new(
        false,
        Reason::ReferenceMissing.as_str(),
        &message,
    );
    event(
        ctx,
        parent,
        EventType::Warning,
        &state.reason,
        "Dereference",
        message,
    );
    write_status(ctx, parent, parent_json, None, &state).await?;
    Ok(settled())
}

/// A render or status evaluation failed: `Ready=False` with the failure's reason on this
/// parent only (its status fields keep their values), and a Warning event. Secret values
/// the parent could read (references, children) are taken out of the message.
async fn render_failed(
    ctx: &RuleContext,
    parent: &DynamicObject,
    parent_json: &serde_json::Value,
    observed: &Observed,
    mut e: crate::render::RenderError,
    action: &str,
) -> Result<Action, ReconcileError> {
    e.message = crate::render::redact(&e.message, &observed.secret_values());
    ctx.metrics
        .render_errors
        .get_or_create(&metrics::rule(&ctx.rule.name))
        .inc();
    let err = ReconcileError::Render(e);
    let state = err.condition();
    event(
        ctx,
        parent,
        EventType::Warning,
        &state.reason,
        action,
        state.message.clone(),
    );
    write_status(ctx, parent, parent_json, None, &state).await?;
    Err(err)
}
