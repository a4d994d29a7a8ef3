//! `rulebook check` of the `cel:` keys of `spec.admission`, offline: each expression
//! compiles (the `cel` crate's parser, `cel/mod.rs`), reads the variables of its place
//! (`self`/`oldSelf` in a check, `object`/`oldObject` in a default), a check placed in
//! the CRD reads only fields the CRD's schema declares (the API server's type checker
//! refuses the others there), and a default's path is one an apply configuration can
//! name. Types and cost are the API server's to judge: `rulebook check --kubeconfig`
//! dry-runs the generated CRD and policies (`src/cli/cel_dry_run.rs`).
//!
//! The other `spec.admission` checks (one of `cel`/`expr`, operations, failurePolicy)
//! are in `admission.rs`.

use serde_json::Value as Json;

use super::policy::{Placement, placements};
use super::{Loc, Rule, is_identifier};

/// Checks the `cel:` keys of `r`'s `spec.admission`.
pub fn check_cel(r: &Rule, err: &mut impl FnMut((u64, u64), &str, String)) {
    let Some(admission) = &r.spec.admission else {
        return;
    };
    let at = |l: &Loc<String>| (l.line, l.col);
    for (i, v) in admission.validate.iter().enumerate() {
        let Some(cel) = &v.cel else { continue };
        let key = format!("spec.admission.validate[{i}].cel");
        match crate::cel::compile(cel) {
            Err(e) => err(at(cel), &key, format!("does not compile: {e}")),
            Ok(expr) => {
                for wrong in ["object", "oldObject", "parent", "old", "refs"] {
                    if expr.reads(wrong) {
                        err(
                            at(cel),
                            &key,
                            format!(
                                "reads `{wrong}`: a cel check reads `self` (the object) and, on updates, `oldSelf`"
                            ),
                        );
                    }
                }
                let creates_only =
                    !v.operations.is_empty() && v.operations.iter().all(|o| o.as_str() == "CREATE");
                if expr.reads("oldSelf") && creates_only {
                    err(
                        at(cel),
                        &key,
                        "reads oldSelf (a transition rule, run on updates) but its operations are CREATE only".into(),
                    );
                }
            }
        }
    }
    check_crd_fields(r, err);
    for (i, d) in admission.default.iter().enumerate() {
        let Some(cel) = &d.cel else { continue };
        let key = format!("spec.admission.default[{i}]");
        match crate::cel::compile(cel) {
            Err(e) => err(
                at(cel),
                &format!("{key}.cel"),
                format!("does not compile: {e}"),
            ),
            Ok(expr) if expr.reads("self") || expr.reads("oldSelf") => err(
                at(cel),
                &format!("{key}.cel"),
                "reads `self`: a cel default reads `object` (the object being admitted)".into(),
            ),
            Ok(_) => {}
        }
        if d.path.is_empty() || !d.path.split('.').all(is_identifier) {
            err(
                at(&d.path),
                &format!("{key}.path"),
                format!(
                    "'{}' must be field names joined by dots (e.g. spec.image) for a cel default",
                    d.path.value
                ),
            );
        }
    }
}

/// A check placed in the CRD may read only what the CRD's schema declares.
fn check_crd_fields(r: &Rule, err: &mut impl FnMut((u64, u64), &str, String)) {
    let Some(crd) = super::crd::crd_for(r) else {
        return;
    };
    let Some(root) = crd.pointer("/spec/versions/0/schema/openAPIV3Schema") else {
        return;
    };
    for p in placements(r) {
        if p.placement != Placement::Crd {
            continue;
        }
        let Ok(expr) = crate::cel::compile(p.cel) else {
            continue;
        };
        for path in expr.paths_from("self") {
            if path.first().is_none_or(|f| f == "metadata") {
                continue;
            }
            if let Some(missing) = undeclared(root, &path) {
                let cel = p.check.cel.as_ref().map_or((0, 0), |c| (c.line, c.col));
                let schema = if path[0] == "status" {
                    "statusSchema"
                } else {
                    "specSchema"
                };
                err(
                    cel,
                    &format!("spec.admission.validate[{}].cel", p.index),
                    format!(
                        "reads self.{missing}, which the CRD's schema does not declare: a CRD validation rule reads declared fields only (declare it in spec.crd.{schema})"
                    ),
                );
            }
        }
    }
}

/// The first prefix of `path` (e.g. `spec.a.b`) that the schema `root` does not
/// declare. Fields kept by `x-kubernetes-preserve-unknown-fields` are not declared: CEL
/// cannot read them.
fn undeclared(root: &Json, path: &[String]) -> Option<String> {
    let mut node = root;
    for (depth, field) in path.iter().enumerate() {
        if let Some(next) = node.get("properties").and_then(|p| p.get(field)) {
            node = next;
            continue;
        }
        if let Some(ap) = node.get("additionalProperties").filter(|a| a.is_object()) {
            node = ap;
            continue;
        }
        let object = node.get("x-kubernetes-preserve-unknown-fields") == Some(&Json::Bool(true))
            || node.get("properties").is_some()
            || node.get("type").and_then(Json::as_str) == Some("object");
        if object {
            return Some(path[..=depth].join("."));
        }
        // A scalar, a list or an int-or-string: CEL's own functions apply, not fields.
        return None;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(s: &str) -> Vec<String> {
        s.split('.').map(String::from).collect()
    }

    #[test]
    fn undeclared_fields_are_found() {
        let root = json!({"type": "object", "properties": {"spec": {"type": "object", "properties": {
            "replicas": {"type": "integer"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
        }}}});
        assert_eq!(undeclared(&root, &p("spec.replicas")), None);
        assert_eq!(undeclared(&root, &p("spec.labels.x")), None);
        assert_eq!(undeclared(&root, &p("spec.tier")), Some("spec.tier".into()));
        assert_eq!(
            undeclared(&root, &p("spec.free.x")),
            Some("spec.free.x".into())
        );
        assert_eq!(undeclared(&root, &p("status")), Some("status".into()));
    }
}
