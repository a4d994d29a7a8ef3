//! The render stage of a reconcile: the desired children, on the runtime within a slice
//! of the parent's budget or on the blocking pool (`offload.rs`); for a cluster-scoped
//! parent, again without the live children outside the namespaces it renders into
//! (`observe::confine_to_rendered_namespaces`); and, before any child is applied, where
//! they go recorded on a cluster-scoped parent (`teardown::places`). A render that fails
//! stops the reconcile with the failure on the parent's condition: nothing is applied
//! or pruned.

use std::ops::ControlFlow;
use std::time::Duration;

use kube::api::DynamicObject;
use kube::runtime::controller::Action;

use super::context::RuleContext;
use super::dereference::Inputs;
use super::error::ReconcileError;
use super::observe::confine_to_rendered_namespaces;
use super::offload::render_off_runtime;
use super::outcome::{Outcome, render_failed};
use super::teardown::{self, places::Recorded};
use crate::render::DesiredChild;

/// What the render stage hands on: the desired children, and the inputs they were rendered from.
pub(super) struct Rendered {
    pub desired: Vec<DesiredChild>,
    /// The children held as they are (`render::Rendered::held`): never pruned.
    pub held: Vec<String>,
    pub inputs: Inputs,
}

/// The render stage: renders the desired children of `parent` from `inputs`.
pub(super) async fn render(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    mut inputs: Inputs,
) -> Result<ControlFlow<Outcome, Rendered>, ReconcileError> {
    use ControlFlow::{Break, Continue};
    let first = render_off_runtime(ctx, inputs.eval).await?;
    let mut eval = first.inputs;
    let rendered = match first.result {
        Ok(desired) => {
            let (live, observed) = (&mut inputs.live, &mut eval.observed);
            let home = parent.metadata.namespace.as_deref();
            if confine_to_rendered_namespaces(ctx, home, &desired.desired, live, observed) {
                drop(desired);
                let again = render_off_runtime(ctx, eval).await?;
                eval = again.inputs;
                again.result
            } else {
                Ok(desired)
            }
        }
        Err(e) => Err(e),
    };
    let crate::render::Rendered { desired, held } = match rendered {
        Ok(d) => d,
        Err(e) => {
            return Ok(Break(render_failed(
                ctx,
                eval.parent,
                &eval.observed,
                e,
                "Render",
            )));
        }
    };
    // A cluster-scoped parent records where its children go before any is applied
    // there: its teardown looks nowhere else.
    match teardown::places::record(ctx, parent, uid, &desired).await? {
        Recorded::Same | Recorded::Written => {}
        Recorded::Stale => {
            return Ok(Break(Outcome::Ends(Ok(Action::requeue(
                Duration::from_millis(500),
            )))));
        }
        Recorded::TooMany(e) => {
            return Ok(Break(render_failed(
                ctx,
                eval.parent,
                &eval.observed,
                e,
                "Render",
            )));
        }
    }
    inputs.eval = eval;
    Ok(Continue(Rendered {
        desired,
        held,
        inputs,
    }))
}
