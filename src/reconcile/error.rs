//! Why a reconcile did not finish, and the one mapping from that to a category
//! ([`Reason`]), from which the parent's `Ready` condition reason and the metrics' result
//! label are both derived — so a reason is spelled in one place. (Measured against
//! strum: its derive gives the reason strings and the iteration the tests use.)

use std::time::Duration;

use crate::render::RenderError;
use crate::render::status::ConditionState;

/// The category of a failed reconcile: the `reason` of the `Ready=False` condition it
/// sets (the variant's name) and, derived from it, the `result` label of
/// `rulebook_reconciles_total` ([`Reason::result_label`]). Every failure is mapped to one
/// category ([`ReconcileError::reason`]) and both spellings come from it, so they cannot
/// disagree. (`Ready` and `ChildrenNotReady` come from the rule's readiness.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::EnumIter, strum::IntoStaticStr)]
pub enum Reason {
    RenderFailed,
    RenderBudgetExceeded,
    Conflict,
    /// An apply was refused, or an object the reconcile needed could not be read.
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

/// The `result` label of a reconcile that went through.
pub const RESULT_OK: &str = "ok";

impl Reason {
    /// The condition's `reason`.
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// The `result` label of `rulebook_reconciles_total`: coarser than the reason, so the
    /// series stay few (the reasons a label groups are on the parents' conditions).
    pub fn result_label(self) -> &'static str {
        match self {
            Reason::RenderFailed | Reason::RenderBudgetExceeded => "render_failed",
            Reason::Conflict => "conflict",
            Reason::ApplyFailed => "apply_failed",
            Reason::NotLeader => "not_leader",
            Reason::PruneFailed
            | Reason::StatusFailed
            | Reason::InvalidParent
            | Reason::InvalidChild
            | Reason::ReferenceMissing
            | Reason::Error => "error",
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
    /// The `result` label of `rulebook_reconciles_total`, from the failure's category.
    pub fn result_label(&self) -> &'static str {
        self.reason().result_label()
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

    /// The failure's category: the one mapping from a failure to its condition reason and
    /// its metric label.
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
    /// One failure of each kind (the match keeps the list whole: a new kind of failure
    /// does not compile until it is added here).
    fn one_of_each() -> Vec<ReconcileError> {
        let api = || {
            kube::Error::Api(Box::new(
                kube::core::Status::failure("refused: hunter22", "Invalid").with_code(422),
            ))
        };
        let all = vec![
            ReconcileError::Render(RenderError::new("t.yaml", Some(3), "boom")),
            ReconcileError::Render(RenderError::budget("t.yaml", None, "too big")),
            ReconcileError::Apply {
                what: "ConfigMap a".into(),
                source: api(),
            },
            ReconcileError::Prune {
                what: "ConfigMap a".into(),
                source: api(),
            },
            ReconcileError::Status(api()),
            ReconcileError::Read {
                what: "the parent".into(),
                source: api(),
            },
            ReconcileError::Conflict("taken: hunter22".into()),
            ReconcileError::Fight {
                message: "fields changed".into(),
                retry_in: Duration::from_secs(1),
            },
            ReconcileError::InvalidParent("deep: hunter22".into()),
            ReconcileError::InvalidChild("deep: hunter22".into()),
            ReconcileError::Invalid("no uid: hunter22".into()),
            ReconcileError::NotLeader,
            ReconcileError::Redacted {
                reason: Reason::PruneFailed,
                message: "gone".into(),
            },
        ];
        for e in &all {
            match e {
                ReconcileError::Render(_)
                | ReconcileError::Apply { .. }
                | ReconcileError::Prune { .. }
                | ReconcileError::Status(_)
                | ReconcileError::Read { .. }
                | ReconcileError::Conflict(_)
                | ReconcileError::Fight { .. }
                | ReconcileError::InvalidParent(_)
                | ReconcileError::InvalidChild(_)
                | ReconcileError::Invalid(_)
                | ReconcileError::NotLeader
                | ReconcileError::Redacted { .. } => {}
            }
        }
        all
    }

    /// Every failure keeps its reason and its label once a secret is taken out of it:
    /// the two are derived from one category (a `Read` failure was reasoned
    /// `ApplyFailed` but labelled `error`, and `apply_failed` once redacted).
    #[test]
    fn a_failure_has_the_same_reason_and_label_redacted_or_not() {
        for e in one_of_each() {
            let (reason, label) = (e.reason(), e.result_label());
            assert_eq!(label, reason.result_label(), "{e:?}");
            assert_eq!(e.condition().reason, reason.as_str(), "{e:?}");
            let clean = e.redacted(&["hunter22".into()]);
            assert_eq!(clean.reason(), reason, "{clean:?}");
            assert_eq!(clean.result_label(), label, "{clean:?}");
        }
        let read = ReconcileError::Read {
            what: "the parent".into(),
            source: kube::Error::Api(Box::new(kube::core::Status::failure("no", "Forbidden"))),
        };
        assert_eq!(
            (read.reason(), read.result_label()),
            (Reason::ApplyFailed, "apply_failed")
        );
    }

    /// Each category has a reason of its own, distinct from the readiness reasons, and
    /// a label; the labels are those `rulebook_reconciles_total`'s help lists.
    #[test]
    fn every_category_maps_to_a_reason_and_a_label() {
        use std::collections::BTreeSet;
        use strum::IntoEnumIterator;
        let mut reasons = BTreeSet::new();
        let mut labels = BTreeSet::from([RESULT_OK]);
        for category in Reason::iter() {
            let reason = category.as_str();
            assert!(!reason.is_empty() && reason.chars().all(|c| c.is_ascii_alphanumeric()));
            assert!(
                reason.starts_with(|c: char| c.is_ascii_uppercase()),
                "{reason}"
            );
            assert!(!["Ready", "ChildrenNotReady"].contains(&reason), "{reason}");
            assert!(reasons.insert(reason), "{reason} twice");
            let label = category.result_label();
            assert!(!label.is_empty() && label != RESULT_OK, "{category:?}");
            assert!(
                label.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "{label}"
            );
            labels.insert(label);
        }
        // Categories whose label must stand apart (tests and alerts count them).
        let apart = [
            Reason::RenderFailed,
            Reason::Conflict,
            Reason::ApplyFailed,
            Reason::NotLeader,
            Reason::Error,
        ];
        let distinct: BTreeSet<_> = apart.iter().map(|r| r.result_label()).collect();
        assert_eq!(distinct.len(), apart.len());
        let metrics = crate::metrics::Metrics::new();
        // A family is printed once it has a series.
        let series = crate::metrics::ResultLabels {
            rule: "r".into(),
            result: RESULT_OK.into(),
        };
        metrics.reconciles.get_or_create(&series).inc();
        let text = metrics.encode();
        let help = text
            .lines()
            .find_map(|l| l.strip_prefix("# HELP rulebook_reconciles "))
            .unwrap_or_else(|| panic!("no help for rulebook_reconciles in\n{text}"));
        let listed: BTreeSet<&str> = help
            .split_once('(')
            .and_then(|(_, rest)| rest.split_once(')'))
            .map(|(list, _)| list.split(", ").collect())
            .unwrap_or_default();
        assert_eq!(
            listed, labels,
            "the help of rulebook_reconciles_total: {help}"
        );
    }
}
