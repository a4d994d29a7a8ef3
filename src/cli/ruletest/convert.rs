//! `rulebook test` steps that convert the parent between the versions of its CRD
//! (`convert: {to: v1}`, issue 43), and the parent read in the storage version before a
//! render step when it is written in another (as the operator reads it: the rule's
//! templates see the storage version).

use serde_json::Value as Json;

use super::model::{ConvertStep, Expect};
use super::{Failure, matching};
use crate::cli::to_yaml;
use crate::render::CompiledRule;

/// The parent in the version the rule's templates read: converted when it is written
/// in another version of the rule's CRD.
pub fn in_storage_version(rule: &CompiledRule, parent: &Json) -> Result<Json, String> {
    let want = rule.rule.spec.parent.api_version.as_str();
    if parent.get("apiVersion").and_then(Json::as_str) == Some(want) {
        return Ok(parent.clone());
    }
    let version = rule.rule.spec.parent.group_version().1;
    rule.convert(parent, version)
        .map_err(|e| format!("converting the parent to {want}: {e}"))
}

/// The failures of a `convert` step: the parent converted to `step.to`, checked
/// against `expect.object` (a subset) or `expect.error`.
pub fn run(
    rule: &CompiledRule,
    parent: &Json,
    step: &ConvertStep,
    expect: Option<&Expect>,
    at: u64,
) -> Vec<Failure> {
    let outcome = rule.convert(parent, &step.to).map_err(|e| e.to_string());
    let fail = |line, message| Failure {
        line,
        message,
        diff: None,
    };
    let want_error = expect.and_then(|e| e.error.as_ref());
    let want_object = expect.and_then(|e| e.object.as_ref());
    match (outcome, want_error) {
        (Err(e), Some(want)) if e.contains(&want.value) => vec![],
        (Err(e), Some(want)) => vec![fail(
            want.line,
            format!("expected an error containing {:?}, got: {e}", want.value),
        )],
        (Err(e), None) => vec![fail(at, format!("unexpected error: {e}"))],
        (Ok(_), Some(want)) => vec![fail(
            want.line,
            format!(
                "expected an error containing {:?}, but the conversion succeeded",
                want.value
            ),
        )],
        (Ok(got), None) => match want_object {
            None => vec![fail(
                step.to.line,
                "a convert step needs expect.object (or expect.error)".into(),
            )],
            Some(want) => {
                let problems = matching::mismatches(&want.value, &got);
                if problems.is_empty() {
                    return vec![];
                }
                vec![Failure {
                    line: want.line,
                    message: format!("converted object: {}", problems.join("; ")),
                    diff: Some(crate::cli::unified_diff(
                        "expected",
                        "actual",
                        &to_yaml(&want.value).unwrap_or_default(),
                        &to_yaml(&matching::project(&want.value, &got)).unwrap_or_default(),
                    )),
                }]
            }
        },
    }
}
