//! `rulebook check` of a rule's CRD versions and conversions (`spec.crd.versions`,
//! `spec.crd.conversion`, issue 43): what the API server would refuse in the CRD, and what
//! would leave a served version unreadable.
//!
//! * Version names are Kubernetes versions (`v1`, `v1beta2`, `v2alpha1`), unique; exactly
//!   one is `storage: true`, and it is served and is the version of
//!   `spec.parent.apiVersion` (the rule's templates read the storage version: the
//!   operator watches the kind in that version).
//! * `deprecationWarning` only with `deprecated: true` (as the API server says).
//! * Each version's own `specSchema`/`statusSchema` is structural like the top-level ones,
//!   which are the default of versions without their own.
//! * Each conversion names two different existing versions, once per direction, and a
//!   template path inside the templates directory (that the template exists is the
//!   compile's check, which has the directory).
//! * Every ordered pair of served versions has a path: a direct conversion, or one to
//!   the storage version and one from it (the webhook goes through the storage version).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value as Json;

use super::{CrdSpec, Loc, Rule};

/// `v1`, `v1beta2`, `v2alpha1`: Kubernetes' version names (and the order it sorts them
/// in for discovery).
static VERSION: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^v[1-9][0-9]*(?:(?:alpha|beta)[1-9][0-9]*)?$").expect("static regex"));

/// Whether `name` is a Kubernetes version name.
pub fn is_version_name(name: &str) -> bool {
    VERSION.is_match(name)
}

type Err<'a> = dyn FnMut((u64, u64), &str, String) + 'a;

/// Every problem of `spec.crd.versions` and `spec.crd.conversion`, at the key it comes
/// from.
pub(super) fn check_versions(r: &Rule, err: &mut Err<'_>) {
    let Some(crd) = &r.spec.crd else {
        return;
    };
    if crd.versions.is_empty() {
        if let Some(c) = crd.conversion.first() {
            err(
                (c.from.line, c.from.col),
                "spec.crd.conversion",
                "converts between versions, but spec.crd.versions lists none (without it the CRD has one version)"
                    .into(),
            );
        }
        return;
    }
    check_names(crd, err);
    check_storage(r, crd, err);
    check_schemas(r, crd, err);
    check_conversions(crd, err);
    check_paths(crd, err);
}

fn at<T>(l: &Loc<T>) -> (u64, u64) {
    (l.line, l.col)
}

/// Valid, unique names; `deprecationWarning` only on deprecated versions.
fn check_names(crd: &CrdSpec, err: &mut Err<'_>) {
    let mut seen = BTreeSet::new();
    for (i, v) in crd.versions.iter().enumerate() {
        let key = format!("spec.crd.versions[{i}].name");
        if !is_version_name(&v.name) {
            err(
                at(&v.name),
                &key,
                format!(
                    "'{}' is not a Kubernetes version name (v1, v1beta2, v2alpha1: 'v', a number, then optionally alpha or beta and a number)",
                    v.name.value
                ),
            );
        } else if !seen.insert(v.name.as_str()) {
            err(
                at(&v.name),
                &key,
                format!("version '{}' is listed twice", v.name.value),
            );
        }
        if v.deprecation_warning.is_some() && !v.deprecated {
            err(
                at(&v.name),
                &format!("spec.crd.versions[{i}].deprecationWarning"),
                "is only sent for a deprecated version: set `deprecated: true`".into(),
            );
        }
    }
    if !crd.versions.iter().any(|v| v.served) {
        err(
            at(&crd.versions[0].name),
            "spec.crd.versions",
            "no version is served".into(),
        );
    }
}

/// Exactly one storage version, served, and the one of `spec.parent.apiVersion`.
fn check_storage(r: &Rule, crd: &CrdSpec, err: &mut Err<'_>) {
    let storage: Vec<_> = crd.versions.iter().filter(|v| v.storage).collect();
    let parent_version = r.spec.parent.group_version().1;
    let names = || {
        crd.versions
            .iter()
            .map(|v| v.name.value.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match storage.as_slice() {
        [] => err(
            at(&crd.versions[0].name),
            "spec.crd.versions",
            format!(
                "no version has `storage: true`; exactly one of {} must (the version objects are stored in, and the one the rule's templates read)",
                names()
            ),
        ),
        [one] => {
            if !one.served {
                err(
                    at(&one.name),
                    "spec.crd.versions",
                    format!(
                        "the storage version '{}' is not served: the rule watches its parents in it",
                        one.name.value
                    ),
                );
            }
            if one.name.value != parent_version {
                err(
                    at(&r.spec.parent.api_version),
                    "spec.parent.apiVersion",
                    format!(
                        "'{}' is not the storage version '{}': the rule's templates read the storage version, so spec.parent.apiVersion names it (e.g. {}/{})",
                        r.spec.parent.api_version.value,
                        one.name.value,
                        r.spec.parent.group_version().0,
                        one.name.value
                    ),
                );
            }
        }
        [_, second, ..] => err(
            at(&second.name),
            "spec.crd.versions",
            format!(
                "{} versions have `storage: true` ({}); exactly one may",
                storage.len(),
                storage
                    .iter()
                    .map(|v| v.name.value.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
    }
}

/// Each version's own schemas and printer columns, as the top-level ones are checked;
/// the storage version's status schema declares every `spec.status` field.
fn check_schemas(r: &Rule, crd: &CrdSpec, err: &mut Err<'_>) {
    for (i, v) in crd.versions.iter().enumerate() {
        for (key, schema) in [
            ("specSchema", &v.spec_schema),
            ("statusSchema", &v.status_schema),
        ] {
            let Some(s) = schema else { continue };
            let key = format!("spec.crd.versions[{i}].{key}");
            if s.value.get("type").and_then(Json::as_str) != Some("object") {
                err(at(s), &key, "must be `type: object`".into());
            }
            let mut problems = Vec::new();
            super::crd::structural(&s.value, "", &mut problems);
            for p in problems {
                err(at(s), &key, p);
            }
        }
        for (j, c) in v.printer_columns.iter().enumerate() {
            for (key, problem) in super::crd::column_problems(c) {
                err(
                    at(&v.name),
                    &format!("spec.crd.versions[{i}].printerColumns[{j}].{key}"),
                    problem,
                );
            }
        }
        if v.storage
            && let Some(s) = &v.status_schema
        {
            let preserves =
                s.value.get("x-kubernetes-preserve-unknown-fields") == Some(&Json::Bool(true));
            let props = s.value.get("properties").and_then(Json::as_object);
            for (field, value) in &r.spec.status {
                if !preserves && !props.is_some_and(|p| p.contains_key(field)) {
                    err(
                        at(value),
                        &format!("spec.status.{field}"),
                        format!(
                            "is not declared in the statusSchema of the storage version '{}'; the API server would drop it",
                            v.name.value
                        ),
                    );
                }
            }
        }
    }
}

/// Conversions name existing, different versions, each direction once, and a template
/// path inside the templates directory.
fn check_conversions(crd: &CrdSpec, err: &mut Err<'_>) {
    let names: BTreeSet<&str> = crd.versions.iter().map(|v| v.name.as_str()).collect();
    let listed = names.iter().copied().collect::<Vec<_>>().join(", ");
    let mut seen: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for (i, c) in crd.conversion.iter().enumerate() {
        for (key, v) in [("from", &c.from), ("to", &c.to)] {
            if !names.contains(v.as_str()) {
                err(
                    at(v),
                    &format!("spec.crd.conversion[{i}].{key}"),
                    format!(
                        "'{}' is not a version of spec.crd.versions ({listed})",
                        v.value
                    ),
                );
            }
        }
        if c.from.value == c.to.value {
            err(
                at(&c.to),
                &format!("spec.crd.conversion[{i}].to"),
                format!(
                    "converts '{}' to itself (the same version needs no conversion)",
                    c.to.value
                ),
            );
        }
        if let Some(first) = seen.insert((c.from.as_str(), c.to.as_str()), i) {
            err(
                at(&c.from),
                &format!("spec.crd.conversion[{i}]"),
                format!(
                    "{} → {} is already spec.crd.conversion[{first}]: one template per direction",
                    c.from.value, c.to.value
                ),
            );
        }
        let t = c.template.as_str();
        if t.is_empty()
            || t.starts_with('/')
            || t.split(['/', '\\']).any(|p| p == ".." || p.is_empty())
        {
            err(
                at(&c.template),
                &format!("spec.crd.conversion[{i}].template"),
                format!(
                    "'{t}' must be a relative path inside the templates directory, without '..'"
                ),
            );
        }
    }
}

/// Every ordered pair of served versions has a path: direct, or through the storage
/// version.
fn check_paths(crd: &CrdSpec, err: &mut Err<'_>) {
    let Some(storage) = crd.versions.iter().find(|v| v.storage) else {
        return; // reported by check_storage
    };
    let mut names = BTreeSet::new();
    if !crd
        .versions
        .iter()
        .all(|v| is_version_name(&v.name) && names.insert(v.name.as_str()))
    {
        return; // reported by check_names
    }
    let edge = |a: &str, b: &str| {
        crd.conversion
            .iter()
            .any(|c| c.from.value == a && c.to.value == b)
    };
    let served: Vec<_> = crd.versions.iter().filter(|v| v.served).collect();
    let s = storage.name.as_str();
    for a in &served {
        for b in &served {
            let (a_name, b_name) = (a.name.as_str(), b.name.as_str());
            if a_name == b_name || edge(a_name, b_name) || (edge(a_name, s) && edge(s, b_name)) {
                continue;
            }
            let (f, t) = if a_name == s || b_name == s {
                (a_name, b_name)
            } else if !edge(a_name, s) {
                (a_name, s)
            } else {
                (s, b_name)
            };
            err(
                at(&a.name),
                "spec.crd.conversion",
                format!(
                    "no way to convert {a_name} to {b_name}: both are served and the API server converts between them, directly or through the storage version {s}; add `- {{ from: {f}, to: {t}, template: <dir>/{f}-to-{t}.yaml }}`"
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_version_names() {
        for good in ["v1", "v2", "v1beta2", "v2alpha1", "v10beta11"] {
            assert!(is_version_name(good), "{good}");
        }
        for bad in ["1", "v0", "v1beta", "V1", "v1-beta1", "v1gamma1", "version1", ""] {
            assert!(!is_version_name(bad), "{bad}");
        }
    }
}
