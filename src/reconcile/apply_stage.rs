//! The applies of a reconcile (its plan and execute stages, `execute.rs`): which desired
//! children are written, in what order, and what holds a write back.
//!
//! Every child is found and planned against the caches first, before any write
//! (`apply::prepare`). Then the children are written in [`Dependencies::order`] — rule
//! order, except that a child comes after the siblings it `waitFor`s or names (the Secret
//! its Pods read, the ServiceAccount they run as, the Namespace it goes in) — as the
//! [`ApplyGate`] lets them:
//!
//! - a child in `Conflict` (its name is an object this parent does not control) holds
//!   every write of the parent — nothing is created and no content changed — until it is
//!   resolved; a child already up to date is left as it is (never pruned for it). A
//!   conflict the caches show holds everything before the first write; one found only
//!   when a create is refused holds everything after it, and the order has put the
//!   children that name it after it. Otherwise a Deployment would run with someone
//!   else's Secret because it is named like the parent's;
//! - a child that failed holds the children that depend on it; the others are written;
//! - a fight (someone keeps changing a child's fields) holds only that child's repair:
//!   the object is the parent's own.

use std::collections::HashMap;
use std::sync::Arc;

use kube::ResourceExt;
use kube::api::DynamicObject;

use super::apply::{ChildOutcome, Prepared, carry_out, look_up_uncached, prepare};
use super::context::RuleContext;
use super::error::ReconcileError;
use super::events::Change;
use super::plan::{ApplyGate, ChildStep, Dependencies, Hold};
use crate::render::DesiredChild;

/// What the apply stage came to.
pub(super) struct Applied {
    /// What was written (or read, for the status to see).
    pub changes: Vec<Change>,
    /// A child this process wrote moments ago is still cached in its older version.
    pub pending: bool,
    /// The failure the parent reports: a conflict before any other.
    pub failure: Option<ReconcileError>,
}

/// Every desired child planned against the caches, before any write.
pub(super) struct ChildPlan<'a> {
    deps: Dependencies,
    /// Per desired child, its plan; `None` for one that failed to plan.
    prepared: Vec<Option<Prepared<'a>>>,
    /// The children that failed to plan.
    failures: Failures,
}

/// Plans the `desired` children of the parent (`uid`): each found (the API server asked
/// for those no cache holds) and planned against the children the reconcile observed
/// (`live_children`), and the order they go in.
pub(super) async fn plan_children<'a>(
    ctx: &'a RuleContext,
    uid: &str,
    namespace: Option<&str>,
    desired: &[DesiredChild],
    live_children: &[(usize, Arc<DynamicObject>)],
) -> ChildPlan<'a> {
    let lookups = look_up_uncached(ctx, namespace, desired).await;
    // The children `observed` holds; one that reached the cache since is read again.
    let in_observed: HashMap<(usize, String), &Arc<DynamicObject>> = live_children
        .iter()
        .map(|(k, o)| ((*k, o.name_any()), o))
        .collect();
    let deps = Dependencies::of(desired, &ctx.rule.wait_for_positions(), namespace);
    let mut failures = Failures::default();
    let mut prepared: Vec<Option<Prepared<'_>>> = Vec::with_capacity(desired.len());
    for (d, lookup) in desired.iter().zip(lookups) {
        let seen = in_observed
            .get(&(ctx.kind_of_child[d.child], d.object_name().to_string()))
            .copied();
        match prepare(ctx, uid, namespace, d, lookup, seen) {
            Ok(p) => prepared.push(Some(p)),
            Err(e) => {
                failures.note(e);
                prepared.push(None);
            }
        }
    }
    ChildPlan {
        deps,
        prepared,
        failures,
    }
}

/// Carries out `plan` for the `desired` children of `parent`, in dependency order, as
/// the [`ApplyGate`] lets them.
pub(super) async fn apply_children(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    desired: &[DesiredChild],
    plan: ChildPlan<'_>,
) -> Applied {
    let ChildPlan {
        deps,
        mut prepared,
        mut failures,
    } = plan;
    let mut gate = ApplyGate::new(&deps);
    for (i, p) in prepared.iter().enumerate() {
        match p {
            Some(Prepared::Planned(planned)) => gate.planned(i, &planned.step),
            Some(Prepared::Pending) => {}
            None => gate.failed(i),
        }
    }
    let (mut changes, mut pending) = (Vec::new(), false);
    for i in deps.order() {
        let (Some(Some(p)), Some(d)) = (prepared.get_mut(i).map(Option::take), desired.get(i))
        else {
            continue;
        };
        let planned = match p {
            Prepared::Pending => {
                pending = true;
                continue;
            }
            Prepared::Planned(planned) => planned,
        };
        if matches!(planned.step, ChildStep::Apply { .. })
            && let Some(hold) = gate.hold(i)
        {
            failures.held(hold, d.label());
            continue;
        }
        match carry_out(ctx, parent, uid, d, *planned).await {
            Ok(ChildOutcome::Changed(change)) => changes.push(*change),
            Ok(ChildOutcome::UpToDate) => {}
            Err(e @ ReconcileError::Conflict(_)) => {
                gate.conflict(i);
                failures.note(e);
            }
            // The object is the parent's own: only its repair waits.
            Err(e @ ReconcileError::Fight { .. }) => failures.note(e),
            Err(ReconcileError::NotLeader) => {
                failures.note(ReconcileError::NotLeader);
                break;
            }
            Err(e) => {
                gate.failed(i);
                failures.note(e);
            }
        }
    }
    Applied {
        changes,
        pending,
        failure: failures.into_failure(),
    }
}

/// The failures of one apply stage, and the children a conflict held.
#[derive(Default)]
struct Failures {
    first: Option<ReconcileError>,
    /// Children held by a conflict, as `name` or `name[index]`.
    held: Vec<String>,
}

impl Failures {
    /// The parent reports the first failure, but a conflict (the parent is held) before
    /// any other, and `NotLeader` (nothing more can be written) before everything.
    fn note(&mut self, e: ReconcileError) {
        let rank = |e: &ReconcileError| match e {
            ReconcileError::NotLeader => 2,
            ReconcileError::Conflict(_) => 1,
            _ => 0,
        };
        if self.first.as_ref().is_none_or(|f| rank(&e) > rank(f)) {
            self.first = Some(e);
        }
    }

    fn held(&mut self, hold: Hold, label: String) {
        if let Hold::Conflict(_) = hold {
            self.held.push(label);
        }
    }

    /// The failure to report; a conflict's message names the children it held.
    fn into_failure(self) -> Option<ReconcileError> {
        match self.first {
            Some(ReconcileError::Conflict(message)) if !self.held.is_empty() => {
                Some(ReconcileError::Conflict(format!(
                    "{message}; nothing else is applied for this parent until it is resolved (held: {})",
                    self.held.join(", ")
                )))
            }
            other => other,
        }
    }
}
