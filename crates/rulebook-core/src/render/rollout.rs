//! The expressions of `spec.rollout` — `order` over `parent`, `gate` and `failWhen` over
//! `batch` — compiled and evaluated in the rule's sandbox (`env.rs`: the same filters,
//! fuel and recursion limits as every other expression). A quoted duration literal in
//! `gate` or `failWhen` (`batch.age >= '1m'`) is rewritten to its number of seconds when
//! the rule compiles, since `batch.age` and `batch.notReadyFor` are seconds: the issue's
//! syntax keeps working, and the expression compares numbers.
//!
//! The expressions are few and evaluated rarely (the coordinator's ticks, a reconcile of a
//! parent during a rollout), so each evaluation compiles its expression again rather than
//! keeping a self-referencing environment.

use std::sync::LazyLock;

use minijinja::Environment;
use regex::Regex;
use serde::Serialize;

use super::diags::Diags;
use super::env;
use super::error::describe;
use super::limits::Limits;
use crate::rules::{Diagnostic, Loc, Rollout, Rule};

/// `'1m'`, `"1h30m"`, `'500ms'`: a quoted duration.
static DURATION_LITERAL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(['"])((?:[0-9]+(?:ms|h|m|s))+)(['"])"#).unwrap_or_else(|e| panic!("{e}"))
});

/// `gate`'s default: every moved parent is ready.
pub const DEFAULT_GATE: &str = "batch.ready >= batch.total";

/// What `gate` and `failWhen` see as `batch`: the parents on the new version so far
/// (this batch and those before it).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BatchStats {
    /// Parents on the new version (moved so far).
    pub total: u64,
    /// Of those, the ones the new version reconciled whose `Ready` condition is `True`.
    pub ready: u64,
    /// `total - ready`.
    pub not_ready: u64,
    /// Seconds since this step's parents started moving.
    pub age: u64,
    /// The longest time, in seconds, a moved parent has been not ready.
    pub not_ready_for: u64,
    /// Every parent of the rule.
    pub parents: u64,
    /// The step, from 0.
    pub step: u64,
}

/// The compiled expressions of a rule's `spec.rollout`.
pub struct RolloutProgram {
    env: Environment<'static>,
    order: Option<String>,
    gate: String,
    fail_when: Option<String>,
}

impl std::fmt::Debug for RolloutProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.debug_struct("RolloutProgram")
            .field("order", &self.order)
            .field("gate", &self.gate)
            .field("fail_when", &self.fail_when)
            .finish()
    }
}

/// Why an expression could not give a truth value at run time.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{key}: {message}")]
pub struct RolloutEvalError {
    pub key: &'static str,
    pub message: String,
}

/// `src` with every quoted duration replaced by its seconds (a malformed one stays quoted).
pub fn durations_to_seconds(src: &str) -> String {
    DURATION_LITERAL
        .replace_all(src, |c: &regex::Captures| {
            if c[1] != c[3] {
                return c[0].to_string();
            }
            match seconds(&c[2]) {
                Some(s) => s,
                None => c[0].to_string(),
            }
        })
        .into_owned()
}

/// A duration (`1m`, `1h30m`, `500ms`) in seconds, as the expression should read it.
fn seconds(d: &str) -> Option<String> {
    let mut millis: u64 = 0;
    let mut num = String::new();
    let mut chars = d.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let n: u64 = num.parse().ok()?;
        num.clear();
        let unit = match (c, chars.peek()) {
            ('m', Some('s')) => {
                chars.next();
                1
            }
            ('s', _) => 1_000,
            ('m', _) => 60_000,
            ('h', _) => 3_600_000,
            _ => return None,
        };
        millis = millis.checked_add(n.checked_mul(unit)?)?;
    }
    Some(if millis.is_multiple_of(1000) {
        (millis / 1000).to_string()
    } else {
        format!("{}", millis as f64 / 1000.0)
    })
}

impl RolloutProgram {
    /// The rule's rollout expressions, compiled; every problem as a diagnostic at its
    /// `file:line`. `None` for a rule without `spec.rollout`.
    pub(super) fn compile(
        rule: &Rule,
        limits: &Limits,
        at: &Diags<'_>,
    ) -> Result<Option<RolloutProgram>, Vec<Diagnostic>> {
        let Some(ro) = &rule.spec.rollout else {
            return Ok(None);
        };
        Self::compile_spec(ro, limits, "spec.rollout", &|line, col, key, msg| {
            at.at(line, col, key, msg)
        })
        .map(Some)
    }

    /// The operator-wide default rollout's expressions (`--default-rollout`), compiled on
    /// their own so that a problem points into that file, not into a rule that uses it.
    pub fn check_default(file: &str, ro: &Rollout, limits: &Limits) -> Vec<Diagnostic> {
        let mk = |line, col, key: &str, msg: String| {
            Diagnostic::new(file, line, col, format!("default rollout: {key}: {msg}"))
        };
        Self::compile_spec(ro, limits, "rollout", &mk)
            .err()
            .unwrap_or_default()
    }

    /// One rollout block's expressions; `prefix` is its key, `mk` makes a diagnostic.
    fn compile_spec(
        ro: &Rollout,
        limits: &Limits,
        prefix: &str,
        mk: &dyn Fn(u64, u64, &str, String) -> Diagnostic,
    ) -> Result<RolloutProgram, Vec<Diagnostic>> {
        let env = env::environment(limits);
        let mut diags = Vec::new();
        let mut one = |e: &Option<Loc<String>>, key: &str, var: &str, durations: bool| {
            let e = e.as_ref()?;
            let src = if durations {
                durations_to_seconds(&e.value)
            } else {
                e.value.clone()
            };
            match env.compile_expression(&src) {
                Err(err) => diags.push(mk(
                    e.line,
                    e.col,
                    key,
                    format!("invalid expression: {}", describe(&err)),
                )),
                Ok(expr) => {
                    for v in expr.undeclared_variables(false) {
                        if v != var {
                            diags.push(mk(
                                e.line,
                                e.col,
                                key,
                                format!("unknown variable '{v}' (this expression sees {var})"),
                            ));
                        }
                    }
                }
            }
            Some(src)
        };
        let order = one(&ro.order, &format!("{prefix}.order"), "parent", false);
        let gate = one(&ro.gate, &format!("{prefix}.gate"), "batch", true);
        let fail_when = one(&ro.fail_when, &format!("{prefix}.failWhen"), "batch", true);
        if !diags.is_empty() {
            return Err(diags);
        }
        Ok(RolloutProgram {
            env,
            order,
            gate: gate.unwrap_or_else(|| DEFAULT_GATE.to_string()),
            fail_when,
        })
    }

    fn truth(
        &self,
        key: &'static str,
        src: &str,
        ctx: minijinja::Value,
    ) -> Result<bool, RolloutEvalError> {
        let err = |e: minijinja::Error| RolloutEvalError {
            key,
            message: describe(&e),
        };
        let expr = self.env.compile_expression(src).map_err(err)?;
        Ok(expr.eval(ctx).map_err(err)?.is_true())
    }

    /// Whether the rule says which parents go first.
    pub fn has_order(&self) -> bool {
        self.order.is_some()
    }

    /// Whether `parent` goes first (`order`); false without `order`, and when it fails
    /// (a parent's content cannot make the rollout fail).
    pub fn first(&self, parent: &serde_json::Value) -> bool {
        match &self.order {
            Some(src) => self
                .truth(
                    "spec.rollout.order",
                    src,
                    minijinja::context! { parent => super::val(parent) },
                )
                .unwrap_or(false),
            None => false,
        }
    }

    /// Whether the batch passes `gate`.
    pub fn gate(&self, batch: &BatchStats) -> Result<bool, RolloutEvalError> {
        self.truth(
            "spec.rollout.gate",
            &self.gate,
            minijinja::context! { batch => super::val(&serde_json::to_value(batch).unwrap_or_default()) },
        )
    }

    /// Whether the rollout has failed (`failWhen`; never without it).
    pub fn failed(&self, batch: &BatchStats) -> Result<bool, RolloutEvalError> {
        match &self.fail_when {
            Some(src) => self.truth(
                "spec.rollout.failWhen",
                src,
                minijinja::context! { batch => super::val(&serde_json::to_value(batch).unwrap_or_default()) },
            ),
            None => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_durations_read_as_seconds() {
        assert_eq!(
            durations_to_seconds("batch.ready >= batch.total and batch.age >= '1m'"),
            "batch.ready >= batch.total and batch.age >= 60"
        );
        assert_eq!(
            durations_to_seconds(r#"batch.notReadyFor >= "1h30m""#),
            "batch.notReadyFor >= 5400"
        );
        assert_eq!(
            durations_to_seconds("batch.age >= '1500ms'"),
            "batch.age >= 1.5"
        );
        // Not durations, or mismatched quotes: left alone.
        assert_eq!(durations_to_seconds("'abc' ~ '5x'"), "'abc' ~ '5x'");
        assert_eq!(durations_to_seconds("'1m\""), "'1m\"");
    }

    fn program(yaml_rollout: &str) -> Result<Option<RolloutProgram>, Vec<Diagnostic>> {
        let text = format!(
            "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: r\nspec:\n  parent:\n    apiVersion: v1\n    kind: ConfigMap\n  rollout:\n{yaml_rollout}"
        );
        let rules = crate::rules::parse_file("r.yaml", &text).unwrap_or_else(|e| panic!("{e:?}"));
        let at = Diags {
            file: "r.yaml",
            name: "r",
        };
        RolloutProgram::compile(&rules[0].rule, &Limits::default(), &at)
    }

    #[test]
    fn gate_and_fail_when_over_the_batch() {
        let p = program("    steps: [{percent: 100}]\n    gate: \"batch.ready >= batch.total and batch.age >= '1m'\"\n    failWhen: \"batch.notReadyFor >= '5m'\"\n")
            .unwrap_or_else(|e| panic!("{e:?}"))
            .unwrap_or_else(|| panic!("a program"));
        let mut b = BatchStats {
            total: 2,
            ready: 2,
            age: 59,
            ..Default::default()
        };
        assert!(!p.gate(&b).unwrap_or(true));
        b.age = 60;
        assert!(p.gate(&b).unwrap_or(false));
        b.not_ready_for = 299;
        assert!(!p.failed(&b).unwrap_or(true));
        b.not_ready_for = 300;
        assert!(p.failed(&b).unwrap_or(false));
    }

    #[test]
    fn order_reads_the_parent_and_fails_closed() {
        let p = program("    steps: [{percent: 100}]\n    order: \"parent.metadata.labels['rulebook.dev/canary'] is defined\"\n")
            .unwrap_or_else(|e| panic!("{e:?}"))
            .unwrap_or_else(|| panic!("a program"));
        let canary = serde_json::json!({"metadata": {"labels": {"rulebook.dev/canary": "x"}}});
        assert!(p.first(&canary));
        assert!(!p.first(&serde_json::json!({"metadata": {}})));
        // The default gate.
        let b = BatchStats {
            total: 3,
            ready: 2,
            ..Default::default()
        };
        assert!(!p.gate(&b).unwrap_or(true));
        assert!(!p.failed(&b).unwrap_or(true));
    }

    #[test]
    fn unknown_variables_and_syntax_errors_are_diagnostics_at_their_line() {
        let Err(d) = program(
            "    steps: [{percent: 100}]\n    gate: \"parent.x > 1\"\n    failWhen: \"batch.age >=\"\n",
        ) else {
            panic!("errors expected")
        };
        assert_eq!(d.len(), 2, "{d:?}");
        assert_eq!(d[0].line, 11);
        assert!(d[0].message.contains("unknown variable 'parent'"), "{d:?}");
        assert_eq!(d[1].line, 12);
        assert!(d[1].message.contains("spec.rollout.failWhen"), "{d:?}");
    }
}
