//! The checks of `spec.admission` that need no template environment (issue 43): the
//! shape of each check and default, `operations`, and where a default
//! may write. Expressions and message templates are compiled with the rule
//! (render/admission.rs) and CEL text by the CEL checks; both report at the same
//! `file:line` positions.
//!
//! Why defaults may write only under `spec`, `metadata.labels` and
//! `metadata.annotations`: the rest of `metadata` is the API server's (a name, a
//! namespace or an owner set by a webhook would move or adopt the object), and `status`
//! is the controller's, which a mutating webhook on the main resource cannot set anyway.

use super::{Loc, Rule};

/// Whether a default may write at `path`: under `spec`, or one label or annotation.
fn may_default(path: &str) -> bool {
    match path_segments(path).as_deref() {
        Some([first, _, ..]) if first == "spec" => true,
        Some([m, kind, _]) => m == "metadata" && (kind == "labels" || kind == "annotations"),
        _ => false,
    }
}

/// Every problem of `r.spec.admission`, through `err(position, key, message)`.
pub fn check_admission(r: &Rule, err: &mut impl FnMut((u64, u64), &str, String)) {
    let Some(a) = &r.spec.admission else {
        return;
    };
    // failurePolicy: rules/webhooks.rs (the webhook server's part).
    let at = |l: &Loc<String>| (l.line, l.col);
    for (i, v) in a.validate.iter().enumerate() {
        let key = format!("spec.admission.validate[{i}]");
        let pos = at(&v.message);
        match (&v.cel, &v.expr) {
            (Some(_), Some(e)) => err(
                at(e),
                &key,
                "has both cel and expr: give exactly one".into(),
            ),
            (None, None) => err(pos, &key, "needs cel or expr".into()),
            (Some(c), None) if c.trim().is_empty() => {
                err(at(c), &format!("{key}.cel"), "is empty".into())
            }
            (None, Some(e)) if e.trim().is_empty() => {
                err(at(e), &format!("{key}.expr"), "is empty".into())
            }
            _ => {}
        }
        if v.message.trim().is_empty() {
            err(pos, &format!("{key}.message"), "is empty".into());
        }
        for op in &v.operations {
            if !matches!(op.as_str(), "CREATE" | "UPDATE") {
                err(
                    at(op),
                    &format!("{key}.operations"),
                    format!("'{}' is not CREATE or UPDATE", op.value),
                );
            }
        }
        if let Some(f) = &v.field_path
            && !is_dotted_path(f)
        {
            err(
                at(f),
                &format!("{key}.fieldPath"),
                format!("'{}' is not a dotted path like spec.replicas", f.value),
            );
        }
    }
    for (i, d) in a.default.iter().enumerate() {
        let key = format!("spec.admission.default[{i}]");
        match (&d.expr, &d.cel) {
            (Some(_), Some(c)) => err(
                at(c),
                &key,
                "has both expr and cel: give exactly one".into(),
            ),
            (None, None) => err(at(&d.path), &key, "needs expr or cel".into()),
            _ => {}
        }
        if !may_default(&d.path) {
            err(
                at(&d.path),
                &format!("{key}.path"),
                format!(
                    "'{}' is not a dotted path under spec, or one key of metadata.labels or metadata.annotations",
                    d.path.value
                ),
            );
        }
    }
}

/// `a.b.c`: segments of letters, digits, `-`, `_`, `/` and `.`-free text, none empty.
/// A label or annotation key with dots (`app.kubernetes.io/name`) is written in
/// brackets: `metadata.labels['app.kubernetes.io/name']`.
pub fn is_dotted_path(path: &str) -> bool {
    path_segments(path).is_some_and(|s| !s.is_empty())
}

/// The segments of a dotted path (`spec.image` → `["spec", "image"]`,
/// `metadata.labels['a.b/c']` → `["metadata", "labels", "a.b/c"]`); `None` when it is
/// not one.
pub fn path_segments(path: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = path.trim();
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("['") {
            let end = after.find("']")?;
            let key = &after[..end];
            if key.is_empty() {
                return None;
            }
            out.push(key.to_string());
            rest = &after[end + 2..];
            rest = rest.strip_prefix('.').unwrap_or(rest);
            continue;
        }
        let end = rest.find(['.', '[']).unwrap_or(rest.len());
        let seg = &rest[..end];
        if seg.is_empty()
            || !seg
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return None;
        }
        out.push(seg.to_string());
        rest = &rest[end..];
        if let Some(r) = rest.strip_prefix('.') {
            if r.is_empty() {
                return None;
            }
            rest = r;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dotted_paths_split_into_keys_with_brackets_for_dotted_keys() {
        assert_eq!(
            path_segments("spec.image"),
            Some(vec!["spec".into(), "image".into()])
        );
        assert_eq!(
            path_segments("metadata.labels['app.kubernetes.io/name']"),
            Some(vec![
                "metadata".into(),
                "labels".into(),
                "app.kubernetes.io/name".into()
            ])
        );
        for bad in [
            "", "spec.", ".spec", "spec..x", "spec.a b", "spec['']", "spec['x",
        ] {
            assert_eq!(path_segments(bad).filter(|s| !s.is_empty()), None, "{bad}");
        }
    }
}
