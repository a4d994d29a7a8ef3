//! `rulebook check` of what Rulebook's webhook server is told about a rule (issue 43):
//! `spec.admission.failurePolicy` is one of the two values the API server takes, since
//! it is copied into the generated webhook configuration, where a bad value would only
//! show as a failed apply at run time.

use super::Rule;

type Err<'a> = dyn FnMut((u64, u64), &str, String) + 'a;

/// The values of a webhook's `failurePolicy`.
pub const FAILURE_POLICIES: &[&str] = &["Fail", "Ignore"];

pub(super) fn check_failure_policy(r: &Rule, err: &mut Err<'_>) {
    let Some(policy) = r
        .spec
        .admission
        .as_ref()
        .and_then(|a| a.failure_policy.as_ref())
    else {
        return;
    };
    if !FAILURE_POLICIES.contains(&policy.as_str()) {
        err(
            (policy.line, policy.col),
            "spec.admission.failurePolicy",
            format!(
                "must be Fail (refuse the request when no Rulebook replica answers) or \
                 Ignore (store it unchecked), not '{}'",
                policy.value
            ),
        );
    }
}
