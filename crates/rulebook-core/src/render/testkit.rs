//! Unit tests' way to a compiled rule: one rule file and its templates, compiled as
//! `rulebook check` compiles a rule set, so that each test file states only the rule it
//! is about (was: the same `Sources`-and-compile block in four test files).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{CompiledRule, Limits};

/// Compiles the rule `name` from `rules/<name>.yaml` holding `rule` and the templates
/// `(name, text)` (as `templates/<name>`): the rule, or every diagnostic as
/// `file:line:col: message`.
pub(crate) fn compile_rule(
    name: &str,
    rule: &str,
    templates: &[(&str, &str)],
) -> Result<Arc<CompiledRule>, Vec<String>> {
    let templates: BTreeMap<String, (String, String)> = templates
        .iter()
        .map(|(n, s)| (n.to_string(), (format!("templates/{n}"), s.to_string())))
        .collect();
    let sources = crate::rules::Sources {
        default_rollout: None,
        rule_files: vec![(format!("rules/{name}.yaml"), rule.to_string())],
        templates,
    };
    match super::compile(&sources, &Limits::default()) {
        Ok(mut set) => set
            .rules
            .remove(name)
            .ok_or_else(|| vec![format!("no rule named {name}")]),
        Err(d) => Err(d.0.iter().map(|d| d.to_string()).collect()),
    }
}
