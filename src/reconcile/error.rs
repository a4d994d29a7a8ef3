//! Why a reconcile did not finish, and the one mapping from that to the parent's `Ready`
//! condition and to the metrics' result label — so a reason is spelled in one place.

use std::time::Duration;

use crate::render::RenderError;
use crate::render::status::ConditionState;

/// The `reason` of a `Ready=False` condition Rulebook sets when a reconcile fails.
/// (`Ready` and `ChildrenNotReady` come from the rule's readiness.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    RenderFailed,
    RenderBudgetExceeded,
    Conflict,
    ApplyFailed,
    PruneFailed,
    StatusFailed,
    InvalidParent,
    InvalidChild,
    /// A required reference (`spec.references`) is missing.
    ReferenceMissing,
    NotLeader,
    Error,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RenderFailed => "RenderFailed",
            Reason::RenderBudgetExceeded => "RenderBudgetExceeded",
            Reason::Conflict => "Conflict",
            Reason::ApplyFailed => "ApplyFailed",
            Reason::PruneFailed => "PruneFailed",
            Reason::StatusFailed => "StatusFailed",
            Reason::InvalidParent => "InvalidParent",
            Reason::InvalidChild => "InvalidChild",
            Reason::ReferenceMissing => "ReferenceMissing",
            Reason::NotLeader => "NotLeader",
            Reason::Error => "Error",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("{0}")]
    Render(#[from] RenderError),
    #[error("applying {what}: {source}")]
    Apply {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("pruning {what}: {source}")]
    Prune {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing status: {0}")]
    Status(#[source] kube::Error),
    #[error("reading {what}: {source}")]
    Read {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{0}")]
    Conflict(String),
    /// Someone else keeps changing a child's fields; the next repair waits `retry_in`.
    #[error("{message}")]
    Fight { message: String, retry_in: Duration },
    /// The parent's content cannot be read (nested too deeply).
    #[error("{0}")]
    InvalidParent(String),
    /// A child's content cannot be read.
    #[error("{0}")]
    InvalidChild(String),
    #[error("{0}")]
    Invalid(String),
    #[error("writes are paused (not the leader)")]
    NotLeader,
    /// A failure whose message quoted a Secret's value, with the value taken out.
    #[error("{message}")]
    Redacted { reason: Reason, message: String },
}

impl ReconcileError {
    /// The `result` label of `rulebook_reconciles_total`.
    pub fn result_label(&self) -> &'static str {
        match self {
            ReconcileError::Render(_) => "render_failed",
            ReconcileError::Conflict(_) | ReconcileError::Fight { .. } => "conflict",
            ReconcileError::Apply { .. } => "apply_failed",
            ReconcileError::NotLeader => "not_leader",
            ReconcileError::Redacted { reason, .. } => match reason {
                Reason::RenderFailed | Reason::RenderBudgetExceeded => "render_failed",
                Reason::Conflict => "conflict",
                Reason::ApplyFailed => "apply_failed",
                _ => "error",
            },
            _ => "error",
        }
    }

    /// This failure with the `secrets` taken out of its message, as the parent's
    /// condition, its event and the logs show it. The whole message is cleaned before
    /// the condition shortens it (a value across the cut would keep its start), and the
    /// failure keeps no other text (an API error's `Display` prints its whole status, the
    /// causes too); only one without secrets to look for, a fight (whose message names
    /// fields and managers, and whose backoff must survive) and `NotLeader` stay as they are.
    pub fn redacted(self, secrets: &[String]) -> ReconcileError {
        if secrets.is_empty()
            || matches!(
                self,
                ReconcileError::Fight { .. } | ReconcileError::NotLeader
            )
        {
            return self;
        }
        ReconcileError::Redacted {
            reason: self.reason(),
            message: crate::render::redact(&self.message(), secrets),
        }
    }

    pub fn reason(&self) -> Reason {
        match self {
            ReconcileError::Render(e) if e.is_budget_exceeded() => Reason::RenderBudgetExceeded,
            ReconcileError::Render(_) => Reason::RenderFailed,
            ReconcileError::Apply { .. } | ReconcileError::Read { .. } => Reason::ApplyFailed,
            ReconcileError::Prune { .. } => Reason::PruneFailed,
            ReconcileError::Status(_) => Reason::StatusFailed,
            ReconcileError::Conflict(_) | ReconcileError::Fight { .. } => Reason::Conflict,
            ReconcileError::InvalidParent(_) => Reason::InvalidParent,
            ReconcileError::InvalidChild(_) => Reason::InvalidChild,
            ReconcileError::NotLeader => Reason::NotLeader,
            ReconcileError::Invalid(_) => Reason::Error,
            ReconcileError::Redacted { reason, .. } => *reason,
        }
    }

    /// The message of the condition, whole.
    fn message(&self) -> String {
        match self {
            ReconcileError::Apply { what, source } => format!("{what}: {}", describe(source)),
            ReconcileError::NotLeader => "writes are paused".to_string(),
            other => other.to_string(),
        }
    }

    /// The `Ready=False` condition this failure sets on its parent.
    pub fn condition(&self) -> ConditionState {
        ConditionState::new(false, self.reason().as_str(), &self.message())
    }
}

/// An API error as people read it: the API server's message and code.
pub fn describe(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
        other => other.to_string(),
    }
}

pub fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_value_is_taken_out_of_a_failure() {
        let err = ReconcileError::Conflict("Invalid value: \"hunter22\"".into());
        let clean = err.redacted(&["hunter22".into()]);
        assert_eq!(clean.reason(), Reason::Conflict);
        assert_eq!(clean.result_label(), "conflict");
        assert_eq!(clean.condition().message, "Invalid value: \"[redacted]\"");
        let untouched = ReconcileError::Conflict("taken".into()).redacted(&[]);
        assert!(matches!(untouched, ReconcileError::Conflict(_)));
    }

    /// A value past the condition's 1,024 bytes, or across the cut, is taken out all
    /// the same, and the redacted failure's own text (the logs) keeps none of it.
    #[test]
    fn a_secret_across_or_past_the_cut_is_taken_out() {
        let secret = "s3cr3t-value-0123456789".to_string();
        for at in [1014, 1100] {
            let message = format!("{}{secret} and more", "x".repeat(at));
            let clean = ReconcileError::Conflict(message).redacted(std::slice::from_ref(&secret));
            assert!(!clean.to_string().contains("s3cr3t"), "at {at}");
            assert!(!clean.condition().message.contains("s3cr3t"), "at {at}");
        }
    }

    #[test]
    fn each_failure_has_one_reason() {
        let render = RenderError::new("t.yaml", Some(3), "boom");
        let c = ReconcileError::Render(render).condition();
        assert_eq!((c.status, c.reason.as_str()), (false, "RenderFailed"));
        assert_eq!(c.message, "t.yaml:3: boom");
        let c = ReconcileError::Conflict("taken".into()).condition();
        assert_eq!(
            (c.reason.as_str(), c.message.as_str()),
            ("Conflict", "taken")
        );
        assert_eq!(ReconcileError::NotLeader.condition().reason, "NotLeader");
        let budget = RenderError::budget("t.yaml", None, "parent exceeds the render budget");
        assert_eq!(
            ReconcileError::Render(budget).condition().reason,
            "RenderBudgetExceeded"
        );
        assert_eq!(
            ReconcileError::InvalidParent("deep".into()).reason(),
            Reason::InvalidParent
        );
    }
}
