//! The error of a failed render or status evaluation, and why it failed: a mistake in
//! the rule or its templates, or a parent that needs more than its render budget. The
//! operator reports the two differently (`RenderFailed`, `RenderBudgetExceeded`), so a
//! tenant with an oversized parent is told so instead of being shown a template bug.

use minijinja::ErrorKind;

use super::budget;

/// Why a render failed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FailureReason {
    /// The rule, a template or an expression failed for this parent.
    #[default]
    Template,
    /// The parent needs more than a resource bound allows: the per-parent budget
    /// (fuel, output, time), or one evaluation's fuel, output or `forEach` items.
    BudgetExceeded,
}

/// An error while rendering or evaluating, pointing at the template or rule line.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", self.location_and_message())]
pub struct RenderError {
    /// The template file, or the rule file for an expression.
    pub file: String,
    pub line: Option<u64>,
    pub message: String,
    pub reason: FailureReason,
}

impl RenderError {
    /// A template or rule error.
    pub fn new(file: impl Into<String>, line: Option<u64>, message: impl Into<String>) -> Self {
        RenderError {
            file: file.into(),
            line,
            message: message.into(),
            reason: FailureReason::Template,
        }
    }

    /// A parent over a resource bound.
    pub fn budget(file: impl Into<String>, line: Option<u64>, message: impl Into<String>) -> Self {
        RenderError {
            reason: FailureReason::BudgetExceeded,
            ..RenderError::new(file, line, message)
        }
    }

    /// Whether the parent needs more than its render budget (or another resource bound),
    /// rather than hitting a mistake in the rule or its templates.
    pub fn is_budget_exceeded(&self) -> bool {
        self.reason == FailureReason::BudgetExceeded
    }

    /// The `Ready` condition reason for this error: `RenderBudgetExceeded` or `RenderFailed`.
    pub fn condition_reason(&self) -> &'static str {
        match self.reason {
            FailureReason::BudgetExceeded => "RenderBudgetExceeded",
            FailureReason::Template => "RenderFailed",
        }
    }

    /// A minijinja error from an evaluation: a budget error when the active budget was
    /// exceeded (its message, not minijinja's) or the evaluation ran out of fuel.
    pub(super) fn from_minijinja(
        file: &str,
        line: Option<u64>,
        prefix: &str,
        e: &minijinja::Error,
    ) -> Self {
        if let Some(message) = budget::exceeded() {
            return RenderError::budget(file, line, format!("{prefix}{message}"));
        }
        let message = format!("{prefix}{}", describe(e));
        if out_of_fuel(e) {
            RenderError::budget(file, line, message)
        } else {
            RenderError::new(file, line, message)
        }
    }

    fn location_and_message(&self) -> String {
        match self.line {
            Some(l) => format!("{}:{}: {}", self.file, l, self.message),
            None => format!("{}: {}", self.file, self.message),
        }
    }
}

/// Whether `e`, or an error it wraps, is minijinja running out of fuel: an error inside
/// an included template (or a `super()` block) comes back wrapped (`BadInclude`,
/// `EvalBlock`), with the real one as its source.
fn out_of_fuel(e: &minijinja::Error) -> bool {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = next {
        if err
            .downcast_ref::<minijinja::Error>()
            .is_some_and(|m| m.kind() == ErrorKind::OutOfFuel)
        {
            return true;
        }
        next = err.source();
    }
    false
}

/// A minijinja error as one line: what went wrong, without the template dump.
pub fn describe(e: &minijinja::Error) -> String {
    let mut msg = match e.detail() {
        Some(d) => format!("{}: {d}", e.kind()),
        None => e.kind().to_string(),
    };
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    msg
}
