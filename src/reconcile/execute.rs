//! The plan and execute stages of a reconcile: what the rendered children ask of the
//! cluster, decided before any write ([`plan`]: every child planned against the caches,
//! the children this parent owns and no longer renders), then carried out ([`execute`]:
//! the applies in dependency order as `apply_stage.rs` lets them, then the prunes,
//! `prune.rs`). The decisions themselves are the pure functions of `plan.rs`; this is
//! the only stage of a reconcile that writes children.

use kube::api::DynamicObject;
use serde_json::Value as Json;

use super::apply_stage::{Applied, ChildPlan, apply_children, plan_children};
use super::context::RuleContext;
use super::plan::plan_prunes;
use super::prune::leave_child;
use super::render_stage::Rendered;
use crate::meta::JsonAt;

/// What a reconcile is to do with its children.
pub(super) struct Plan<'a> {
    children: ChildPlan<'a>,
    /// Positions in the live children of those to prune (or orphan).
    prunes: Vec<usize>,
}

/// The plan stage: every desired child planned against the caches, and the live children the
/// parent no longer renders.
pub(super) async fn plan<'a>(
    ctx: &'a RuleContext,
    parent: &DynamicObject,
    uid: &str,
    rendered: &Rendered,
) -> Plan<'a> {
    let (live, desired) = (&rendered.inputs.live, &rendered.desired);
    let namespace = parent.metadata.namespace.as_deref();
    let children = plan_children(ctx, uid, namespace, desired, live).await;
    let wanted: Vec<(usize, Option<&str>, &str)> = desired
        .iter()
        .map(|d| {
            let kind = ctx.kind_of_child[d.child];
            let ns = if ctx.kinds[kind].namespaced {
                d.object
                    .at(&["metadata", "namespace"])
                    .and_then(Json::as_str)
            } else {
                None
            };
            (kind, ns, d.object_name())
        })
        .collect();
    let mut prunes = plan_prunes(&wanted, live);
    // A child held as it is (what it waits for is gone) stays.
    if !rendered.held.is_empty() {
        prunes.retain(|&i| {
            live.get(i).is_none_or(|(_, o)| {
                o.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(crate::meta::labels::CHILD))
                    .is_none_or(|c| !rendered.held.contains(c))
            })
        });
    }
    Plan { children, prunes }
}

/// The execute stage: the plan carried out. Applies first — a conflict holds every write of the
/// parent, a failure the children that depend on it — then the prunes; the first
/// failure of either is the one the parent reports (a conflict before any other).
pub(super) async fn execute(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    rendered: &Rendered,
    plan: Plan<'_>,
) -> Applied {
    let Plan { children, prunes } = plan;
    let mut applied = apply_children(ctx, parent, uid, &rendered.desired, children).await;
    let live = &rendered.inputs.live;
    for i in prunes {
        let Some((k, obj)) = live.get(i) else {
            continue;
        };
        match leave_child(ctx, parent, &ctx.kinds[*k], obj).await {
            Ok(Some(change)) => applied.changes.push(change),
            Ok(None) => {}
            Err(e) => {
                applied.failure.get_or_insert(e);
            }
        }
    }
    applied
}
