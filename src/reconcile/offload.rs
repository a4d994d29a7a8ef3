//! Rendering and status evaluation: a short first slice on the async runtime, the rest
//! off it, a bounded number at a time.
//!
//! A render is CPU work whose size a tenant controls (the parent's content) up to the
//! rule's budgets. On the async runtime — one worker under `cpu: 1` — one heavy render
//! would freeze health checks, watch streams and lease renewal with it. But most renders
//! are small (the benchmark rule's render and status take about 40 µs together), and
//! handing each to tokio's blocking pool and back cost more CPU than the render: two
//! thread wake-ups per handoff, twice per reconcile. So each render and each status
//! evaluation first runs on the runtime within a slice of its parent's budget
//! ([`SLICE_TIME`], [`SLICE_OUTPUT`], [`SLICE_FUEL`]; [`ParentBudget::slice`]). One that
//! fits is done. One that trips the slice — whatever bound — is dropped and done again
//! from the start on the blocking pool with the parent's whole budget, behind a semaphore
//! of as many slots as the machine has cores, so renders also cannot crowd out each
//! other's parents without bound. Renders are pure: the dropped attempt wrote nothing.
//!
//! The slice bounds the attempt's time, bytes and fuel, and the attempt is made only
//! when the parent and what the reconcile read weigh little enough (`render::slice` says
//! how each is bounded, and what one filter call may still overrun). A panic in the
//! attempt is caught, and the work goes to the pool like any other that trips the slice.
//! Renders that go to the pool, either way, are counted
//! (`rulebook_renders_offloaded_total`).
//!
//! What an evaluation reads travels as one value, [`EvalInputs`] (the parent, what the
//! reconcile observed, the parent's budget): moved into the evaluation, wherever it runs,
//! and handed back in its [`Evaluated`] with the result, for the next stage.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, LazyLock};

use serde_json::Value as Json;
use tokio::sync::Semaphore;

use super::context::RuleContext;
use super::error::ReconcileError;
use crate::metrics;
use crate::render::{
    DesiredChild, Observed, ParentBudget, RefTarget, RenderError, Rendered, SLICE_FUEL,
    SLICE_OUTPUT, SLICE_TIME, Scope, StatusReport,
};

static SLOTS: LazyLock<Semaphore> = LazyLock::new(|| {
    Semaphore::new(
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    )
});

/// What an evaluation over one parent reads and spends: the parent, what the reconcile
/// observed, and the parent's budget. Moved into the evaluation (on the runtime or the
/// blocking pool) and back out in its [`Evaluated`], so the reconcile's next stage gets
/// them again without a copy.
pub(super) struct EvalInputs {
    pub parent: Json,
    pub observed: Observed,
    /// One budget per parent and reconcile: its references, its render, a second render
    /// and its status all spend from it.
    pub budget: ParentBudget,
}

/// What an evaluation hands back: its result, and its inputs with what is left of the
/// budget.
pub(super) struct Evaluated<T> {
    pub result: Result<T, RenderError>,
    pub inputs: EvalInputs,
}

/// Runs `work` over `inputs` (and `extra`, what this evaluation reads besides) within a
/// slice of their budget on the runtime when `fits` (the inputs are light enough:
/// [`CompiledRule::fits_slice`]), and on the blocking pool within the whole budget when
/// they are not or the attempt trips the slice: it ran out of the slice's time, bytes or
/// fuel (a budget error), or panicked.
///
/// [`CompiledRule::fits_slice`]: crate::render::CompiledRule::fits_slice
async fn evaluate<X, T, W>(
    ctx: &RuleContext,
    mut inputs: EvalInputs,
    extra: X,
    fits: bool,
    work: W,
) -> Result<Evaluated<T>, ReconcileError>
where
    X: Send + 'static,
    T: Send + 'static,
    W: Fn(&Json, &Observed, &X, &mut ParentBudget) -> Result<T, RenderError> + Send + 'static,
{
    if fits {
        let mut slice = inputs.budget.slice(SLICE_TIME, SLICE_OUTPUT, SLICE_FUEL);
        let attempt = std::panic::catch_unwind(AssertUnwindSafe(|| {
            work(&inputs.parent, &inputs.observed, &extra, &mut slice)
        }));
        match attempt {
            Ok(result) if !tripped(&result, &slice) => {
                inputs.budget = slice.rejoin(&inputs.budget);
                return Ok(Evaluated { result, inputs });
            }
            _ => {}
        }
    }
    ctx.metrics
        .renders_offloaded
        .get_or_create(&metrics::rule(&ctx.rule.name))
        .inc();
    off_runtime(move || {
        let mut inputs = inputs;
        let result = work(&inputs.parent, &inputs.observed, &extra, &mut inputs.budget);
        Evaluated { result, inputs }
    })
    .await
}

/// Whether a first attempt within `slice` tripped it. Any budget error counts: one of
/// the slice's own bounds, or minijinja running out of the slice environment's fuel.
/// (A per-evaluation bound that the whole budget has too trips it as well: the pool then
/// reports it.)
fn tripped<T>(out: &Result<T, RenderError>, slice: &ParentBudget) -> bool {
    slice.exceeded().is_some() || out.as_ref().is_err_and(RenderError::is_budget_exceeded)
}

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

/// Runs `work` over `inputs` ([`evaluate`]), with `scopes` (per child, or per reference)
/// as the scope function.
async fn evaluate_scoped<T: Send + 'static>(
    ctx: &RuleContext,
    inputs: EvalInputs,
    scopes: Vec<Scope>,
    work: impl Fn(
        &Json,
        &Observed,
        &dyn Fn(usize) -> Scope,
        &mut ParentBudget,
    ) -> Result<T, RenderError>
    + Send
    + 'static,
) -> Result<Evaluated<T>, ReconcileError> {
    let fits = ctx.rule.fits_slice(&inputs.parent, &inputs.observed, []);
    evaluate(
        ctx,
        inputs,
        scopes,
        fits,
        move |parent, observed, scopes, budget| {
            let scope = |i: usize| scopes.get(i).copied().unwrap_or(Scope::Namespaced);
            work(parent, observed, &scope, budget)
        },
    )
    .await
}

/// The desired children of the parent (and those held as they are), rendered within
/// its budget.
pub(super) async fn render_off_runtime(
    ctx: &RuleContext,
    inputs: EvalInputs,
) -> Result<Evaluated<Rendered>, ReconcileError> {
    let rule = ctx.rule.clone();
    let scopes = (0..rule.children().len()).map(|i| ctx.scope(i)).collect();
    evaluate_scoped(ctx, inputs, scopes, move |p, o, scope, b| {
        rule.render_holding_within(p, o, scope, b)
    })
    .await
}

/// Where the parent's references point, evaluated within its budget.
pub(super) async fn targets_off_runtime(
    ctx: &RuleContext,
    inputs: EvalInputs,
) -> Result<Evaluated<Vec<RefTarget>>, ReconcileError> {
    let rule = ctx.rule.clone();
    let scopes = (0..rule.rule.spec.references.len())
        .map(|i| ctx.ref_scope(i))
        .collect();
    evaluate_scoped(ctx, inputs, scopes, move |p, o, scope, b| {
        rule.reference_targets(p, o, scope, b)
    })
    .await
}

/// The parent's status fields and readiness over its `desired` children, evaluated
/// within its budget (the children are dropped with the evaluation).
pub(super) async fn status_off_runtime(
    ctx: &RuleContext,
    inputs: EvalInputs,
    desired: Vec<DesiredChild>,
) -> Result<Evaluated<StatusReport>, ReconcileError> {
    let rule: Arc<_> = ctx.rule.clone();
    let fits = ctx.rule.fits_slice(
        &inputs.parent,
        &inputs.observed,
        desired.iter().map(|d| &d.object),
    );
    evaluate(
        ctx,
        inputs,
        desired,
        fits,
        move |parent, observed, desired, budget| {
            rule.status_within(parent, observed, desired, budget)
        },
    )
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

/// `spec.parent.selector.expr` over the parent, on the blocking pool within the parent's
/// budget.
pub(super) async fn selects_off_runtime(
    ctx: &RuleContext,
    parent: Json,
) -> Result<Result<bool, RenderError>, ReconcileError> {
    let rule = ctx.rule.clone();
    off_runtime(move || rule.selects_expr(&parent, &mut rule.budget())).await
}
