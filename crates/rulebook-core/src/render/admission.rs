//! A parent's admission, judged from the rule's `spec.admission` (issue 43): the `expr:`
//! checks and the computed defaults that need Rulebook (the `cel:` rules are enforced by
//! the API server and judged offline elsewhere). Pure: the webhook (src/webhook) turns an
//! `AdmissionReview` into an [`AdmitRequest`] with `refs` read from its caches, and a
//! [`Verdict`] back into the review's answer; `rulebook test` does the same from fixtures.
//!
//! Every check and default runs in the rule's sandbox with the rule's budgets, like a
//! render: a hostile object cannot make the webhook spin.

use serde_json::Value as Json;

use super::{CompiledRule, RenderError};

/// The admission operation being judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Create,
    Update,
}

/// What a check or default sees: the object (`parent`), the stored one on updates
/// (`old`), and the rule's references resolved for the object (`refs`, name → object or
/// list).
#[derive(Clone, Copy, Debug)]
pub struct AdmitRequest<'a> {
    pub operation: Operation,
    pub object: &'a Json,
    pub old: Option<&'a Json>,
    pub refs: &'a serde_json::Map<String, Json>,
}

/// The answer.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Allowed; `patch` is the JSON Patch (RFC 6902) of the computed defaults, empty
    /// when none applied.
    Allowed { patch: Vec<Json> },
    /// Refused by the check at `index` of `spec.admission.validate`, with its rendered,
    /// redacted message and the field it names.
    Denied {
        index: usize,
        message: String,
        field: Option<String>,
    },
}

impl CompiledRule {
    /// Judges `request` against the rule's `expr:` checks, then computes its defaults.
    ///
    /// Placeholder until the admission work lands: an error, never a silent allow.
    pub fn admit(&self, _request: &AdmitRequest) -> Result<Verdict, RenderError> {
        Err(RenderError::new(
            self.file.clone(),
            None,
            "admission checks are not available in this build",
        ))
    }
}
