//! One reconcile of one parent — the only place that writes to the API server, and only
//! through its [`crate::write::writer::Writer`].
//!
//! [`reconcile_inner`] is a pipeline over values, each stage a function in its own file
//! that hands the next one a value, or ends the reconcile with an [`outcome::Outcome`]:
//!
//! 0. lifecycle ([`lifecycle`]): a parent being deleted is torn down instead
//!    ([`teardown`]); a paused parent stops here (one `Paused` condition); a parent the
//!    rule's `spec.parent.selector` does not take loses this rule's children and stops
//!    here (`select.rs`); others carry Rulebook's finalizer exactly when the rule needs it;
//! 1. observe (`observe.rs`) → `Observation`: the parent and its live children in the
//!    caches (nothing changed since a reconcile with nothing to do: it stops here);
//! 2. dereference (`dereference.rs`) → `Inputs`: the objects its references point at (a
//!    required one missing stops here, `ReferenceMissing`);
//! 3. render (`render_stage.rs`) → `Rendered`: the desired children (a first attempt on
//!    the runtime within a slice of the parent's budget, else on the blocking pool, an
//!    `EvalInputs` value moved in and out: `offload.rs`);
//! 4. plan (`execute.rs`) → `Plan`: every child planned against the caches, and what to
//!    prune, before any write (the decisions are the pure functions of [`plan`]);
//! 5. execute (`execute.rs`) → `Applied`: the applies in dependency order (a conflict
//!    holds the parent's writes, a failure its dependents': `apply_stage.rs`), the prunes;
//! 6. conclude (`conclude.rs`) → `Outcome`: the status evaluated over the children as the
//!    reconcile left them;
//!
//! and [`outcome::finish`] writes the parent's status from the `Outcome`, the one place a
//! reconcile does (then the events of its changes). At steady state every stage finds
//! nothing to do and makes no request.

mod apply;
mod apply_stage;
mod conclude;
pub mod context;
mod dereference;
pub mod drift;
pub mod error;
mod events;
mod execute;
pub mod inflight;
pub mod memory;
mod observe;
mod offload;
mod outcome;
pub mod plan;
mod prune;
pub mod refs;
mod render_stage;
mod select;
#[cfg(test)]
mod stages_mock;
pub mod status_write;
pub mod teardown;
pub mod versions;
#[cfg(test)]
mod write_answers_tests;

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use tracing::{Instrument, debug, warn};

use crate::cache;
use crate::metrics::{self, ResultLabels};
use outcome::Outcome;

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
    // During a progressive rollout: the version this parent is on.
    let ctx = versions::for_parent(&ctx, &parent);
    let uid = parent.uid();
    let key = (parent.namespace(), parent.name_any());
    let result = reconcile_inner(parent, &ctx).await;
    gauge.dec();
    ctx.metrics
        .reconcile_duration
        .get_or_create(&metrics::rule(&rule))
        .observe(started.elapsed().as_secs_f64());
    let label = match &result {
        Ok(_) => error::RESULT_OK,
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

/// A reconcile of `parent`: the preconditions (this process may write, the parent has a
/// UID, the child caches are listed, the parent is read whole), the [`pipeline`] and its
/// outcome written ([`outcome::finish`]).
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
    let outcome = pipeline(ctx, &parent, &uid).await?;
    in_stage(Stage::Finish, outcome::finish(ctx, &parent, &uid, outcome)).await
}

/// The stages of a reconcile, for the context of what each logs and of the error it
/// fails with.
#[derive(Clone, Copy, Debug, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
enum Stage {
    Lifecycle,
    Observe,
    Dereference,
    Render,
    Plan,
    Execute,
    Conclude,
    /// The status written from the outcome.
    Finish,
}

/// The span of one stage: the context of everything it logs.
fn span(stage: Stage) -> tracing::Span {
    let name: &'static str = stage.into();
    tracing::debug_span!("stage", stage = name)
}

/// Runs one stage in its [`span`]; an error it fails with is logged with its stage (the
/// error itself goes to kube-runtime as it is: its condition and label do not change).
async fn in_stage<T>(
    stage: Stage,
    work: impl Future<Output = Result<T, ReconcileError>>,
) -> Result<T, ReconcileError> {
    let result = work.instrument(span(stage)).await;
    if let Err(e) = &result {
        let name: &'static str = stage.into();
        debug!(stage = name, error = %e, "reconcile stage failed");
    }
    result
}

/// The value a stage hands on, or the outcome it ends the reconcile with.
macro_rules! next {
    ($stage:expr) => {
        match $stage {
            ControlFlow::Continue(value) => value,
            ControlFlow::Break(outcome) => return Ok(outcome),
        }
    };
}

/// The stages of a reconcile, each over the value the one before handed on. An error
/// (`?`) ends the reconcile without a status write: a read or write the API server
/// refused, or writes that are not this process's to make any more. (Plan and execute
/// end in a value: a child's failure is the parent's condition, `Applied::failure`.)
async fn pipeline(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
) -> Result<Outcome, ReconcileError> {
    next!(in_stage(Stage::Lifecycle, lifecycle(ctx, parent, uid)).await?);
    let observed = observe::observe(ctx, parent, uid);
    let observation = next!(in_stage(Stage::Observe, observed).await?);
    let dereferenced = dereference::dereference(ctx, parent, uid, observation);
    let inputs = next!(in_stage(Stage::Dereference, dereferenced).await?);
    let rendered = render_stage::render(ctx, parent, uid, inputs);
    let rendered = next!(in_stage(Stage::Render, rendered).await?);
    let plan = execute::plan(ctx, parent, uid, &rendered);
    let plan = plan.instrument(span(Stage::Plan)).await;
    let applied = execute::execute(ctx, parent, uid, &rendered, plan);
    let applied = applied.instrument(span(Stage::Execute)).await;
    in_stage(Stage::Conclude, conclude::conclude(ctx, rendered, applied)).await
}

/// Stage 0: a parent being deleted is torn down (or left to the garbage collector when it
/// does not carry Rulebook's finalizer, or the finalizer is another rule's of its kind);
/// a paused parent gets its `Paused` condition and nothing else; a parent the rule's
/// selector does not take loses this rule's children and condition (`select.rs`); others
/// carry the finalizer exactly when the rule needs it.
async fn lifecycle(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
) -> Result<ControlFlow<Outcome>, ReconcileError> {
    let role = ctx.rule.role;
    if parent.meta().deletion_timestamp.is_some() {
        if !role.finalizer {
            return Ok(ControlFlow::Break(select::deleted_elsewhere()));
        }
        let torn_down = teardown::teardown(ctx, parent, uid).await;
        return Ok(ControlFlow::Break(Outcome::Ends(torn_down)));
    }
    let paused = is_paused(parent);
    ctx.memory.set_paused(uid, paused);
    if paused {
        // The `Paused` condition is the main rule's; the others only hold their writes.
        return Ok(ControlFlow::Break(match cache::to_json(parent) {
            Some(parent_json) if role.main => Outcome::Paused(parent_json),
            _ => Outcome::Ends(Ok(Action::await_change())),
        }));
    }
    let taken = match select::selected(ctx, parent).await? {
        ControlFlow::Continue(taken) => taken,
        ControlFlow::Break(outcome) => return Ok(ControlFlow::Break(outcome)),
    };
    if role.finalizer && !teardown::keep_finalizer(ctx, parent, taken).await? {
        let again = Action::requeue(Duration::from_millis(500));
        return Ok(ControlFlow::Break(Outcome::Ends(Ok(again))));
    }
    if !taken {
        return Ok(ControlFlow::Break(
            select::not_taken(ctx, parent, uid).await?,
        ));
    }
    Ok(ControlFlow::Continue(()))
}

/// Whether the parent carries `rulebook.dev/paused: "true"`.
fn is_paused(parent: &DynamicObject) -> bool {
    parent
        .annotations()
        .get(crate::meta::labels::PAUSED)
        .is_some_and(|v| v == "true")
}
