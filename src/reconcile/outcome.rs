//! How one reconcile ends, as a value: the [`Outcome`] every stage may end with (the last,
//! `conclude.rs`, always does), and [`finish`], the one place the reconcile writes its
//! parent's status from the outcome (kro's deferred status write). A stage that stops the
//! reconcile says what the parent's condition is to be; it writes nothing itself. (A
//! parent being deleted is the teardown's: it writes its own `Deleting` condition step by
//! step, `teardown/`.)

use std::time::Duration;

use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use serde_json::{Map, Value as Json};

use super::context::RuleContext;
use super::error::{Reason, ReconcileError};
use super::events::{Cause, Change, event, report_changes};
use super::status_write::{write_paused, write_status};
use crate::metrics;
use crate::render::status::ConditionState;
use crate::render::{Observed, RenderError};

/// How a reconcile ends.
pub(super) enum Outcome {
    /// Nothing to write: deferred until the caches are listed, steady, requeued, or torn
    /// down (the teardown writes its own status).
    Ends(Result<Action, ReconcileError>),
    /// A child this process applied is still cached in its older version: the status
    /// would be computed from it. The changes' events, and a requeue (its watch event
    /// brings the parent back sooner).
    Pending { changes: Vec<Change>, cause: Cause },
    /// The parent is paused: its `Paused` condition, over the parent as JSON.
    Paused(Json),
    /// A `Ready` condition (and the rule's fields) to report.
    Report(Box<Report>),
}

/// The parent's `Ready` condition as a reconcile left it, and what follows the write.
pub(super) struct Report {
    /// The parent as the reconcile read it (for its current status).
    pub parent_json: Json,
    /// The rule's status fields; `None` keeps the parent's current values.
    pub fields: Option<Map<String, Json>>,
    pub condition: ConditionState,
    /// Secret values a refusal of the status write may quote.
    pub secrets: Vec<String>,
    /// A Warning event recorded before the write: its action and note.
    pub warning: Option<(&'static str, String)>,
    /// What the reconcile applied or pruned: one event per kind, after the write.
    pub changes: Vec<Change>,
    pub cause: Cause,
    /// How the steady memo learns of a reconcile that went through (after the write, so
    /// that it counts the write's resourceVersion).
    pub steady: Option<SteadyMark>,
    /// What kube-runtime is told once the status is written.
    pub result: Result<Action, ReconcileError>,
}

/// What the steady memo ([`memory::Steady`](super::memory::Steady)) keeps of a reconcile that went through.
pub(super) enum SteadyMark {
    /// No child written: the same inputs (`seen`, and the parent as the status write left
    /// it) give the same outcome, so the next reconcile of them can stop early.
    Unchanged(u64),
    /// Children written, and nothing the rule evaluates depends on them: the children as
    /// the caches will hold them (each write's event was awaited as it was written:
    /// `Steady::expects`).
    Written(u64),
    /// Children written that the rule reads back: nothing is known.
    Forget,
}

/// What a reconcile that went through asks of kube-runtime: nothing until a change. A
/// rule's resync is the engine's sweep (`engine::resync`), not a requeue per parent.
pub(super) fn settled() -> Action {
    Action::await_change()
}

impl Report {
    /// A failure before anything was applied: `Ready=False` with its reason, the status
    /// fields as they are, and (`warning`) a Warning event with the condition's message.
    fn stopped(parent_json: Json, err: ReconcileError, warning: Option<&'static str>) -> Outcome {
        let condition = err.condition();
        let warning = warning.map(|action| (action, condition.message.clone()));
        Outcome::Report(Box::new(Report {
            parent_json,
            fields: None,
            condition,
            secrets: Vec::new(),
            warning,
            changes: Vec::new(),
            cause: Cause::Inputs,
            steady: None,
            result: Err(err),
        }))
    }
}

/// A required reference is missing: `Ready=False` reason `ReferenceMissing` naming it
/// (never a value), a Warning event, and nothing applied or pruned. The reference's
/// watch wakes the parent when the object appears.
pub(super) fn reference_missing(parent_json: Json, message: String) -> Outcome {
    let condition = ConditionState::new(false, Reason::ReferenceMissing.as_str(), &message);
    Outcome::Report(Box::new(Report {
        parent_json,
        fields: None,
        condition,
        secrets: Vec::new(),
        warning: Some(("Dereference", message)),
        changes: Vec::new(),
        cause: Cause::Inputs,
        steady: None,
        result: Ok(settled()),
    }))
}

/// A render or status evaluation failed: `Ready=False` with the failure's reason on this
/// parent only (its status fields keep their values), and a Warning event. Secret values
/// the parent could read (references, children) are taken out of the message.
pub(super) fn render_failed(
    ctx: &RuleContext,
    parent_json: Json,
    observed: &Observed,
    mut e: RenderError,
    action: &'static str,
) -> Outcome {
    e.message = crate::render::redact(&e.message, &observed.secret_values());
    ctx.metrics
        .render_errors
        .get_or_create(&metrics::rule(&ctx.rule.name))
        .inc();
    Report::stopped(parent_json, ReconcileError::Render(e), Some(action))
}

/// The selector's `expr` failed on this parent: `Ready=False` (or the rule's own
/// condition) with the failure's reason, a Warning event, and nothing applied or pruned.
pub(super) fn selector_failed(ctx: &RuleContext, parent_json: Json, e: RenderError) -> Outcome {
    render_failed(ctx, parent_json, &Observed::default(), e, "Select")
}

/// A parent whose content cannot be read: `Ready=False` with reason `InvalidParent`
/// (over `minimal`, the parent's metadata and status), and no event.
pub(super) fn invalid_parent(minimal: Json, message: String) -> Outcome {
    Report::stopped(minimal, ReconcileError::InvalidParent(message), None)
}

/// Ends the reconcile as `outcome` says: the one place it writes the parent's status.
/// A status write that fails ends the reconcile with that failure (nothing after it:
/// the steady memo learns nothing, no change's event is recorded).
pub(super) async fn finish(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    outcome: Outcome,
) -> Result<Action, ReconcileError> {
    let report = match outcome {
        Outcome::Ends(result) => return result,
        Outcome::Pending { changes, cause } => {
            report_changes(ctx, parent, &changes, cause);
            ctx.memory.forget_steady(uid);
            return Ok(Action::requeue(Duration::from_secs(5)));
        }
        Outcome::Paused(parent_json) => {
            // Nothing is written for a paused parent but its `Paused` condition.
            write_paused(ctx, parent, &parent_json).await?;
            return Ok(Action::await_change());
        }
        Outcome::Report(report) => *report,
    };
    if let Some((action, note)) = report.warning {
        let reason = &report.condition.reason;
        event(ctx, parent, EventType::Warning, reason, action, note);
    }
    // The API server's refusal of a status may quote a value from a Secret.
    let fields = report.fields.as_ref();
    write_status(ctx, parent, &report.parent_json, fields, &report.condition)
        .await
        .map_err(|e| e.redacted(&report.secrets))?;
    if let Some(mark) = report.steady {
        // The parent as its status write left it.
        let ns = parent.metadata.namespace.as_deref();
        match mark {
            SteadyMark::Unchanged(seen) => {
                let inputs = ctx.memory.fingerprint(uid, parent, seen);
                ctx.memory.mark_steady(uid, ns, inputs);
            }
            SteadyMark::Written(children) => {
                let inputs = ctx.memory.fingerprint(uid, parent, children);
                ctx.memory.mark_written(uid, ns, inputs);
            }
            SteadyMark::Forget => ctx.memory.forget_steady(uid),
        }
    }
    // Events: one per kind of change.
    report_changes(ctx, parent, &report.changes, report.cause);
    report.result
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn report(outcome: Outcome) -> Report {
        match outcome {
            Outcome::Report(r) => *r,
            _ => panic!("not a report"),
        }
    }

    /// A reference missing is not a failure of the reconcile (no backoff: the reference's
    /// watch brings the parent back), but the parent says so, with the whole message on
    /// its event; the rule's fields are kept and the steady memo learns nothing.
    #[test]
    fn a_missing_reference_reports_without_failing() {
        let message = format!("refs.db: Secret db not found {}", "x".repeat(1100));
        let r = report(reference_missing(json!({"kind": "P"}), message.clone()));
        assert!(r.result.is_ok());
        assert_eq!(r.condition.reason, "ReferenceMissing");
        assert!(!r.condition.status);
        assert!(
            r.condition.message.len() < message.len(),
            "the condition is cut"
        );
        assert_eq!(r.warning, Some(("Dereference", message)));
        assert!(r.fields.is_none() && r.changes.is_empty() && r.steady.is_none());
    }

    /// A parent that cannot be read fails with `InvalidParent`, without an event.
    #[test]
    fn an_unreadable_parent_fails_without_an_event() {
        let r = report(invalid_parent(json!({}), "too deep".into()));
        assert!(matches!(r.result, Err(ReconcileError::InvalidParent(_))));
        assert_eq!(r.condition.reason, "InvalidParent");
        assert_eq!(r.condition.message, "too deep");
        assert!(r.warning.is_none() && r.fields.is_none() && r.steady.is_none());
    }

    /// A failure before anything was applied: the event says what the condition says.
    #[test]
    fn a_stopped_reconcile_warns_with_its_condition() {
        let err = ReconcileError::Render(RenderError::new("t.yaml", Some(2), "boom"));
        let r = report(Report::stopped(json!({}), err, Some("Render")));
        assert_eq!(r.condition.reason, "RenderFailed");
        assert_eq!(r.warning, Some(("Render", "t.yaml:2: boom".to_string())));
        assert_eq!(
            r.result.err().map(|e| e.reason()),
            Some(Reason::RenderFailed)
        );
    }
}
