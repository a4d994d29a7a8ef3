//! The conclude stage of a reconcile, its last: the parent's status evaluated over the
//! children as the reconcile left them, and the [`Outcome`] it comes to — the rule's
//! readiness, or the failure of a stage before. Nothing is written here: the outcome is
//! (`outcome::finish`).

use super::apply_stage::Applied;
use super::context::RuleContext;
use super::dereference::Inputs;
use super::error::ReconcileError;
use super::events::{children_after, observed_after};
use super::offload::{EvalInputs, Evaluated, status_off_runtime};
use super::outcome::{Outcome, Report, SteadyMark, render_failed, settled};
use super::render_stage::Rendered;
use crate::render::Observed;

/// The conclude stage: the parent's status evaluated from the children as this reconcile
/// left them — what was just applied replaces the cached copy, what was just pruned is
/// gone (waiting for the caches would cost a second reconcile and a second status write)
/// — and the outcome: the rule's readiness, or the failure of a stage before.
pub(super) async fn conclude(
    ctx: &RuleContext,
    rendered: Rendered,
    applied: Applied,
) -> Result<Outcome, ReconcileError> {
    let Rendered {
        desired, inputs, ..
    } = rendered;
    let Inputs {
        live,
        mut eval,
        permit,
        cause,
        live_keys,
        seen,
    } = inputs;
    drop(live);
    let Applied {
        mut changes,
        pending,
        failure,
    } = applied;
    if pending && failure.is_none() {
        return Ok(Outcome::Pending { changes, cause });
    }
    // What the caches will hold once this reconcile's writes reach them: when nothing the
    // rule evaluates depends on the live children or the parent's status, a reconcile
    // over exactly that is one with nothing to do (the same render, children as
    // applied, the same status).
    let after = (!changes.is_empty() && !ctx.rule.depends_on_own_writes())
        .then(|| children_after(live_keys, &changes, &eval.observed.refs));
    if !changes.is_empty() {
        eval.observed = observed_after(eval.observed, &mut changes);
    }
    // Secret values a message may quote: the references', the children's as observed,
    // and those this reconcile meant to write (a Secret child's value that an admission
    // webhook quotes in its refusal may be in no cache).
    let secrets = eval.observed.secret_values_with(&desired);
    let Evaluated { result, inputs } = status_off_runtime(ctx, eval, desired).await?;
    let EvalInputs {
        parent: parent_json,
        observed,
        budget,
    } = inputs;
    // Nothing of the inputs is held any more.
    drop((observed, budget, permit));
    let status = match result {
        Ok(status) => status,
        Err(mut e) => {
            e.message = crate::render::redact(&e.message, &secrets);
            return Ok(render_failed(
                ctx,
                parent_json,
                &Observed::default(),
                e,
                "Status",
            ));
        }
    };
    let fields = Some(status.fields);
    let report = match failure {
        Some(err) => {
            let err = err.redacted(&secrets);
            let condition = err.condition();
            Report {
                parent_json,
                fields,
                warning: Some(("Reconcile", condition.message.clone())),
                condition,
                secrets,
                changes,
                cause,
                steady: None,
                result: Err(err),
            }
        }
        None => {
            let steady = match after {
                _ if changes.is_empty() => SteadyMark::Unchanged(seen),
                Some(children) => SteadyMark::Written(children),
                None => SteadyMark::Forget,
            };
            Report {
                parent_json,
                fields,
                condition: status.readiness.condition(),
                secrets,
                warning: None,
                changes,
                cause,
                steady: Some(steady),
                result: Ok(settled()),
            }
        }
    };
    Ok(Outcome::Report(Box::new(report)))
}
