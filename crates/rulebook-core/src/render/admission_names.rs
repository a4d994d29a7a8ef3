//! What `rulebook check` says about the names an admission check, default or message
//! uses, beside their syntax ([`super::admission::diagnostics`]): a `refs.<name>` the
//! rule does not declare (it would be undefined on every request, so a check reading it
//! refuses every object, or a default never applies), a variable a message template does
//! not have, and a check that reads `old` but runs on CREATE only (a create has no stored
//! object: such a check could only ever see `old` undefined). Each at the key's
//! `file:line`, like the rule's other expressions (`compile_exprs.rs`).

use std::collections::BTreeSet;

use minijinja::Environment;

use super::REFS_REF;
use super::compile_exprs::Diags;
use super::names::names_used;
use crate::rules::{Diagnostic, Loc, Rule};

/// The variables a message template may use besides the environment's globals.
const MESSAGE_VARS: &[&str] = &["parent", "old", "refs", "rule"];

/// Every problem with the names the rule's admission expressions and messages use.
pub(super) fn diagnostics(
    env: &Environment<'static>,
    rule: &Rule,
    at: &Diags<'_>,
) -> Vec<Diagnostic> {
    let Some(a) = &rule.spec.admission else {
        return Vec::new();
    };
    let declared: BTreeSet<&str> = rule
        .spec
        .references
        .iter()
        .map(|r| r.name.as_str())
        .collect();
    let mut out = Vec::new();
    let mut unknown_refs = |src: &Loc<String>, key: &str| {
        for (_, n) in names_used(&REFS_REF, &src.value) {
            if !declared.contains(n) {
                out.push(at.at(
                    src.line,
                    src.col,
                    key,
                    format!("refs.{n} is not a reference of this rule (spec.references)"),
                ));
            }
        }
    };
    for (i, v) in a.validate.iter().enumerate() {
        let Some(e) = &v.expr else { continue };
        unknown_refs(e, &format!("spec.admission.validate[{i}].expr"));
        unknown_refs(&v.message, &format!("spec.admission.validate[{i}].message"));
    }
    for (i, d) in a.default.iter().enumerate() {
        if let Some(e) = &d.expr {
            unknown_refs(e, &format!("spec.admission.default[{i}].expr"));
        }
    }
    for (i, v) in a.validate.iter().enumerate() {
        let Some(e) = &v.expr else { continue };
        out.extend(message_variables(env, &v.message, i, at));
        out.extend(old_on_create(env, e, &v.operations, i, at));
    }
    out
}

/// Check `i`'s message naming a variable it does not have.
fn message_variables(
    env: &Environment<'static>,
    message: &Loc<String>,
    i: usize,
    at: &Diags<'_>,
) -> Vec<Diagnostic> {
    // Syntax errors are reported by `admission::diagnostics`.
    let Ok(t) = env.template_from_str(&message.value) else {
        return Vec::new();
    };
    let mut allowed: BTreeSet<String> = MESSAGE_VARS.iter().map(|s| s.to_string()).collect();
    allowed.extend(env.globals().map(|(k, _)| k.to_string()));
    let mut unknown: Vec<String> = t
        .undeclared_variables(false)
        .into_iter()
        .filter(|v| !allowed.contains(v))
        .collect();
    unknown.sort();
    unknown
        .into_iter()
        .map(|v| {
            at.at(
                message.line,
                message.col,
                &format!("spec.admission.validate[{i}].message"),
                format!("unknown variable '{v}' (a message may use parent, old, refs and rule)"),
            )
        })
        .collect()
}

/// Check `i` reading `old` while its `operations` leave only CREATE.
fn old_on_create(
    env: &Environment<'static>,
    expr: &Loc<String>,
    operations: &[Loc<String>],
    i: usize,
    at: &Diags<'_>,
) -> Option<Diagnostic> {
    let create_only = !operations.is_empty() && operations.iter().all(|o| o.as_str() == "CREATE");
    let reads_old = env
        .compile_expression(&expr.value)
        .is_ok_and(|e| e.undeclared_variables(false).contains("old"));
    (create_only && reads_old).then(|| {
        at.at(
            expr.line,
            expr.col,
            &format!("spec.admission.validate[{i}].expr"),
            "reads `old`, but runs on CREATE only, where there is no stored object: add UPDATE to its operations (a check reading `old` with no operations runs on updates only)".into(),
        )
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use crate::render::{Limits, compile};
    use crate::rules::Sources;

    fn check(admission: &str) -> String {
        let text = format!(
            r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata: {{name: app}}
spec:
  parent: {{apiVersion: example.com/v1, kind: App}}
  references:
    - {{name: plan, apiVersion: v1, kind: ConfigMap, objectName: "'plan'", optional: true}}
  admission:
{admission}"#
        );
        let sources = Sources {
            default_rollout: None,
            rule_files: vec![("rules/app.yaml".into(), text)],
            templates: BTreeMap::new(),
        };
        match compile(&sources, &Limits::default()) {
            Ok(_) => String::new(),
            Err(d) => d.to_string(),
        }
    }

    #[test]
    fn names_a_rule_does_not_have_are_reported_at_their_line() {
        let out = check(
            r#"    validate:
      - expr: "refs.plans is defined"
        message: "plan {{ parent.spec.plan }} by {{ user }} ({{ refs.other.data }})"
    default:
      - path: spec.image
        expr: "refs.defaults.data.image"
"#,
        );
        for want in [
            "rules/app.yaml:10:15: rule 'app': spec.admission.validate[0].expr: refs.plans is not a reference",
            "rules/app.yaml:11:18: rule 'app': spec.admission.validate[0].message: refs.other is not a reference",
            "rules/app.yaml:11:18: rule 'app': spec.admission.validate[0].message: unknown variable 'user'",
            "rules/app.yaml:14:15: rule 'app': spec.admission.default[0].expr: refs.defaults is not a reference",
        ] {
            assert!(out.contains(want), "missing {want:?} in:\n{out}");
        }
    }

    #[test]
    fn a_check_reading_old_on_create_only_is_refused() {
        let out = check(
            r#"    validate:
      - expr: "parent.spec.tier == old.spec.tier"
        message: "tier is immutable"
        operations: [CREATE]
"#,
        );
        assert!(
            out.contains("rules/app.yaml:10:15: rule 'app': spec.admission.validate[0].expr: reads `old`, but runs on CREATE only"),
            "{out}"
        );
        // With UPDATE, or no operations (updates only, implicitly), and a message over
        // the known variables, the rule compiles.
        for ops in ["[CREATE, UPDATE]", "[UPDATE]", "[]"] {
            let ok = check(&format!(
                r#"    validate:
      - expr: "parent.spec.tier == old.spec.tier and refs.plan is defined"
        message: "tier {{{{ old.spec.tier }}}} cannot become {{{{ parent.spec.tier }}}} ({{{{ rule.name }}}})"
        operations: {ops}
"#
            ));
            assert_eq!(ok, "", "{ops}");
        }
    }
}
