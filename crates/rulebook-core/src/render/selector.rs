//! `spec.parent.selector` at run time: whether a rule takes a parent (several rules may
//! name one kind: docs/reference/decorators.md). The label parts are plain matching over
//! the parent's labels and its namespace's; `expr` is a compiled expression over
//! `parent` evaluated in the rule's sandbox, within the parent's budget, as every other
//! expression is (`compile_exprs.rs` compiles it and refuses any variable but `parent`
//! and `rule`).

use std::collections::BTreeMap;

use serde_json::Value as Json;

use super::{CompiledRule, Observed, ParentBudget, RenderError};

impl CompiledRule {
    /// Whether the rule has `spec.parent.selector` (else it takes every parent).
    pub fn has_selector(&self) -> bool {
        self.rule.spec.parent.selector.is_some()
    }

    /// Whether the selector reads the labels of the parent's namespace.
    pub fn selects_by_namespace(&self) -> bool {
        self.rule
            .spec
            .parent
            .selector
            .as_ref()
            .is_some_and(|s| s.namespace_selector.is_some())
    }

    /// Whether the selector has an `expr` (evaluated with [`CompiledRule::selects_expr`]).
    pub fn has_selector_expr(&self) -> bool {
        self.compiled.borrow_dependent().selector.is_some()
    }

    /// The label parts of the selector over the parent's `labels` and, for a
    /// `namespaceSelector`, its namespace's (`None`: unknown, or a cluster-scoped parent:
    /// not selected). True without a selector.
    pub fn selects_labels(
        &self,
        labels: &BTreeMap<String, String>,
        namespace_labels: Option<&BTreeMap<String, String>>,
    ) -> bool {
        let Some(sel) = &self.rule.spec.parent.selector else {
            return true;
        };
        if !sel.labels().matches(labels) {
            return false;
        }
        match &sel.namespace_selector {
            None => true,
            Some(ns) => namespace_labels.is_some_and(|l| ns.matches(l)),
        }
    }

    /// The selector's `expr` over `parent` (true without one), within `budget`.
    pub fn selects_expr(
        &self,
        parent: &Json,
        budget: &mut ParentBudget,
    ) -> Result<bool, RenderError> {
        let _active = budget.enter();
        let Some(expr) = &self.running().borrow_dependent().selector else {
            return Ok(true);
        };
        let ctx = self.context(parent, &Observed::default())?;
        Ok(self.eval(expr, &ctx)?.is_true())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::Limits;
    use crate::rules::Sources;

    fn compile(selector: &str) -> Result<std::sync::Arc<CompiledRule>, String> {
        let text = format!(
            "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: r\nspec:\n  parent:\n    apiVersion: example.com/v1\n    kind: App\n    selector:\n{selector}\n  children:\n    - name: c\n      apiVersion: v1\n      kind: ConfigMap\n      template: t.yaml\n"
        );
        let sources = Sources {
            default_rollout: None,
            rule_files: vec![("r.yaml".into(), text)],
            templates: [(
                "t.yaml".to_string(),
                ("t.yaml".to_string(), "metadata:\n  name: x\n".to_string()),
            )]
            .into(),
        };
        crate::render::compile(&sources, &Limits::default())
            .map(|s| s.rules["r"].clone())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn labels_and_expr_must_all_match() {
        let r = compile("      matchLabels: {tier: gold}\n      expr: \"parent.spec.size > 2\"")
            .unwrap_or_else(|e| panic!("{e}"));
        let gold: BTreeMap<String, String> = [("tier".to_string(), "gold".to_string())].into();
        assert!(r.selects_labels(&gold, None));
        assert!(!r.selects_labels(&BTreeMap::new(), None));
        let mut b = r.budget();
        let big = serde_json::json!({"metadata": {"name": "a"}, "spec": {"size": 3}});
        let small = serde_json::json!({"metadata": {"name": "a"}, "spec": {"size": 1}});
        assert_eq!(r.selects_expr(&big, &mut b).ok(), Some(true));
        assert_eq!(r.selects_expr(&small, &mut r.budget()).ok(), Some(false));
    }

    #[test]
    fn the_expr_sees_only_the_parent() {
        let e = compile("      expr: \"children.c is defined\"")
            .err()
            .unwrap_or_default();
        assert!(
            e.contains("r.yaml:10:") && e.contains("unknown variable 'children'"),
            "{e}"
        );
    }

    #[test]
    fn a_namespace_selector_needs_the_namespace_labels() {
        let r = compile("      namespaceSelector:\n        matchLabels: {env: prod}")
            .unwrap_or_else(|e| panic!("{e}"));
        let prod: BTreeMap<String, String> = [("env".to_string(), "prod".to_string())].into();
        assert!(r.selects_labels(&BTreeMap::new(), Some(&prod)));
        assert!(!r.selects_labels(&BTreeMap::new(), Some(&BTreeMap::new())));
        assert!(!r.selects_labels(&BTreeMap::new(), None));
    }
}
