//! What a template or expression names: the variables it may use, whether it may read
//! the parent's status, the children and references a text mentions. A leaf below both
//! the rule's compile (`compile.rs`) and its expressions' (`compile_exprs.rs`).

use std::collections::BTreeSet;

use minijinja::Environment;
use regex::Regex;

use super::CONTEXT_VARS;

/// The names `re` (a `children.<name>`-style pattern with the name as group 1) finds in
/// `text`, with the offset of each match.
pub(super) fn names_used<'a>(
    re: &'a Regex,
    text: &'a str,
) -> impl Iterator<Item = (usize, &'a str)> + 'a {
    re.captures_iter(text).filter_map(|m| {
        let (whole, name) = (m.get(0)?, m.get(1)?);
        Some((whole.start(), name.as_str()))
    })
}

/// Names of every variable a template or expression may use without defining it.
pub(super) fn allowed_vars(env: &Environment<'_>, extra: &[&str]) -> BTreeSet<String> {
    let mut set: BTreeSet<String> = CONTEXT_VARS.iter().map(|s| s.to_string()).collect();
    set.extend(extra.iter().map(|s| s.to_string()));
    set.extend(env.globals().map(|(k, _)| k.to_string()));
    set
}

/// The variables of a conversion template (`render/convert.rs`).
pub(super) const CONVERSION_VARS: &[&str] = &["object", "parent", "rule"];

/// Names of every variable a conversion template may use without defining it.
pub(super) fn conversion_vars(env: &Environment<'_>) -> BTreeSet<String> {
    let mut set: BTreeSet<String> = CONVERSION_VARS
        .iter()
        .map(|s| s.to_string())
        .collect();
    set.extend(env.globals().map(|(k, _)| k.to_string()));
    set
}

/// Whether a template or expression whose undeclared variables (minijinja's nested form:
/// `parent.spec.x` for a chain of attribute lookups, `parent` alone for any other use of
/// it) are `vars` may read the parent's `status`: any use of `parent` but a lookup under
/// `metadata`, `spec`, `apiVersion` or `kind` counts (`parent["status"]`, `parent.get(...)`,
/// `parent | tojson`, `{% set p = parent %}` all do).
pub(super) fn may_read_parent_status(vars: &std::collections::HashSet<String>) -> bool {
    vars.iter().any(|v| {
        let mut parts = v.split('.');
        parts.next() == Some("parent")
            && !matches!(
                parts.next(),
                Some("metadata" | "spec" | "apiVersion" | "kind")
            )
    })
}
