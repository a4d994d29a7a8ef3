//! Rendering and status evaluation run off the async runtime, a bounded number at a time.
//!
//! A render is CPU work whose size a tenant controls (the parent's content) up to the
//! rule's budgets. On the async runtime — one worker under `cpu: 1` — one heavy render
//! would freeze health checks, watch streams and lease renewal with it. Each render and
//! each status evaluation therefore runs on tokio's blocking pool, behind a semaphore of
//! as many slots as the machine has cores, so renders also cannot crowd out each other's
//! parents without bound.

use std::sync::{Arc, LazyLock};

use serde_json::Value as Json;
use tokio::sync::Semaphore;

use super::context::RuleContext;
use super::error::ReconcileError;
use crate::render::{
    DesiredChild, Observed, ParentBudget, RefTarget, RenderError, Scope, StatusReport,
};

static SLOTS: LazyLock<Semaphore> = LazyLock::new(|| {
    Semaphore::new(
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    )
});

async fn off_runtime<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ReconcileError> {
    let _slot = SLOTS
        .acquire()
        .await
        .map_err(|_| ReconcileError::Invalid("the render pool is closed".into()))?;
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ReconcileError::Invalid(format!("render task failed: {e}")))
}

/// What an evaluation over one parent hands back: its result, its inputs, and what is
/// left of the budget.
pub(super) type Evaluated<T> = (Result<T, RenderError>, Json, Observed, ParentBudget);

/// What a render hands back.
pub(super) type Rendered = Evaluated<Vec<DesiredChild>>;

/// Runs `work` over `parent` and `observed` on the blocking pool within `budget`, with
/// `scopes` (per child, or per reference) as the scope function.
async fn evaluate_off_runtime<T: Send + 'static>(
    parent: Json,
    observed: Observed,
    mut budget: ParentBudget,
    scopes: Vec<Scope>,
    work: impl FnOnce(
        &Json,
        &Observed,
        &dyn Fn(usize) -> Scope,
        &mut ParentBudget,
    ) -> Result<T, RenderError>
    + Send
    + 'static,
) -> Result<Evaluated<T>, ReconcileError> {
    off_runtime(move || {
        let scope = |i: usize| scopes.get(i).copied().unwrap_or(Scope::Namespaced);
        let out = work(&parent, &observed, &scope, &mut budget);
        (out, parent, observed, budget)
    })
    .await
}

/// The desired children of `parent`, rendered on the blocking pool within `budget` (one
/// budget per parent and reconcile: its render, a second render, and its status).
pub(super) async fn render_off_runtime(
    ctx: &RuleContext,
    parent: Json,
    observed: Observed,
    budget: ParentBudget,
) -> Result<Rendered, ReconcileError> {
    let rule = ctx.rule.clone();
    let scopes = (0..rule.children().len()).map(|i| ctx.scope(i)).collect();
    evaluate_off_runtime(parent, observed, budget, scopes, move |p, o, scope, b| {
        rule.render_within(p, o, scope, b)
    })
    .await
}

/// Where `parent`'s references point, evaluated on the blocking pool within `budget`.
pub(super) async fn targets_off_runtime(
    ctx: &RuleContext,
    parent: Json,
    observed: Observed,
    budget: ParentBudget,
) -> Result<Evaluated<Vec<RefTarget>>, ReconcileError> {
    let rule = ctx.rule.clone();
    let scopes = (0..rule.rule.spec.references.len())
        .map(|i| ctx.ref_scope(i))
        .collect();
    evaluate_off_runtime(parent, observed, budget, scopes, move |p, o, scope, b| {
        rule.reference_targets(p, o, scope, b)
    })
    .await
}

/// The parent's status fields and readiness, evaluated on the blocking pool.
pub(super) async fn status_off_runtime(
    ctx: &RuleContext,
    parent: Json,
    observed: Observed,
    desired: Vec<DesiredChild>,
    mut budget: ParentBudget,
) -> Result<(Result<StatusReport, RenderError>, Json), ReconcileError> {
    let rule: Arc<_> = ctx.rule.clone();
    off_runtime(move || {
        let report = rule.status_within(&parent, &observed, &desired, &mut budget);
        (report, parent)
    })
    .await
}

/// The finalize child of a parent being deleted, rendered on the blocking pool.
pub(super) async fn render_finalize_off_runtime(
    ctx: &RuleContext,
    parent: Json,
) -> Result<Result<Option<DesiredChild>, RenderError>, ReconcileError> {
    let rule = ctx.rule.clone();
    let scopes: Vec<Scope> = (0..rule.children().len()).map(|i| ctx.scope(i)).collect();
    off_runtime(move || {
        let scope = |i: usize| scopes.get(i).copied().unwrap_or(Scope::Namespaced);
        rule.render_finalize_within(&parent, &scope, &mut rule.budget())
    })
    .await
}

/// The finalize step's `doneWhen` over the parent and the live finalize child.
pub(super) async fn finalize_done_off_runtime(
    ctx: &RuleContext,
    parent: Json,
    child: Json,
) -> Result<Result<bool, RenderError>, ReconcileError> {
    let rule = ctx.rule.clone();
    off_runtime(move || rule.finalize_done(&parent, &child, &mut rule.budget())).await
}
