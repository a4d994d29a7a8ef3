//! Whether the rule takes a parent (`spec.parent.selector`, docs/reference/decorators.md),
//! and what a reconcile does with one it does not take: its own children of the parent
//! let go of (deleted, or orphaned for `deletionPolicy: Orphan`) and its own condition
//! taken off, nothing else. Only what this rule made is touched — its child caches hold
//! only objects labelled with its name (`rulebook.dev/rule`), and its condition is
//! applied under its own field manager — so a parent leaving one rule's selector keeps
//! every other rule's children and conditions. At steady state (nothing left) it writes
//! nothing.

use std::ops::ControlFlow;

use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::controller::Action;

use super::context::RuleContext;
use super::error::ReconcileError;
use super::events::{Cause, report_changes};
use super::outcome::{Outcome, settled};
use super::prune::leave_child;
use super::status_write::write_own_condition;
use crate::cache;

/// Whether the rule takes `parent`: `Continue(true)` or `Continue(false)`; `Break` ends
/// the reconcile when the selector's `expr` fails on it (`Ready=False` with the failure,
/// or the rule's own condition; nothing pruned: a failing expression is no decision).
pub(super) async fn selected(
    ctx: &RuleContext,
    parent: &DynamicObject,
) -> Result<ControlFlow<Outcome, bool>, ReconcileError> {
    let rule = &ctx.rule;
    if !rule.has_selector() {
        return Ok(ControlFlow::Continue(true));
    }
    let namespace_labels = match parent.namespace() {
        Some(ns) if rule.selects_by_namespace() => match ctx.namespace_labels(&ns) {
            Some(labels) => Some(labels),
            // Not cached yet: no decision (a parent would lose its children while the
            // Namespaces are being listed). Looked at again shortly: the list is only
            // swapped in at its end, after the events that woke the parent.
            None => {
                return Ok(ControlFlow::Break(Outcome::Ends(Ok(Action::requeue(
                    std::time::Duration::from_secs(2),
                )))));
            }
        },
        _ => None,
    };
    if !rule.selects_labels(parent.labels(), namespace_labels.as_ref()) {
        return Ok(ControlFlow::Continue(false));
    }
    if !rule.has_selector_expr() {
        return Ok(ControlFlow::Continue(true));
    }
    // A parent that cannot be read (nested too deeply) is no decision either: nothing of
    // it is pruned for an expression that never ran.
    let Some(parent_json) = cache::to_json(parent) else {
        return Ok(ControlFlow::Break(Outcome::Ends(Ok(settled()))));
    };
    match super::offload::selects_off_runtime(ctx, parent_json.clone()).await? {
        Ok(taken) => Ok(ControlFlow::Continue(taken)),
        Err(e) => Ok(ControlFlow::Break(super::outcome::selector_failed(
            ctx,
            parent_json,
            e,
        ))),
    }
}

/// A parent the rule does not take: its children of this rule let go of, its condition
/// taken off (a rule that is not its kind's main rule). The main rule leaves the
/// parent's status as it is (its `Ready` is the parent's own, which other tools read).
pub(super) async fn not_taken(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
) -> Result<Outcome, ReconcileError> {
    let owned = ctx.owned_children(uid, parent.namespace().as_deref());
    let mut changes = Vec::new();
    let mut failure = None;
    for (k, obj) in &owned {
        match leave_child(ctx, parent, &ctx.kinds[*k], obj).await {
            Ok(Some(change)) => changes.push(change),
            Ok(None) => {}
            Err(e @ ReconcileError::NotLeader) => return Err(e),
            Err(e) => {
                failure.get_or_insert(e);
            }
        }
    }
    report_changes(ctx, parent, &changes, Cause::Inputs);
    if !owned.is_empty() {
        ctx.memory.forget_steady(uid);
    }
    if let Some(e) = failure {
        return Err(e);
    }
    if !ctx.rule.role.main
        && let Some(parent_json) = cache::to_json(parent)
    {
        write_own_condition(ctx, parent, &parent_json, None).await?;
    }
    Ok(Outcome::Ends(Ok(settled())))
}

/// What the reconcile of a parent being deleted does for a rule that does not hold
/// Rulebook's finalizer on its kind (`rules::decorators::KindRole::finalizer`): nothing.
/// Its children carry the parent's ownerReference, and the garbage collector removes
/// them; the finalizer, and the teardown it holds the parent for, are another rule's.
pub(super) fn deleted_elsewhere() -> Outcome {
    Outcome::Ends(Ok(Action::await_change()))
}
