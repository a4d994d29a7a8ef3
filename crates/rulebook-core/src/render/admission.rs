//! A parent's admission, judged from the rule's `spec.admission` (issue 43): the `expr:`
//! checks and the computed defaults that need Rulebook (the `cel:` rules are enforced by
//! the API server and judged offline elsewhere). Pure: the webhook (src/webhook) turns an
//! `AdmissionReview` into an [`AdmitRequest`] with `refs` read for the object, and a
//! [`Verdict`] back into the review's answer; `rulebook test` does the same from fixtures.
//!
//! Every check and default runs in the rule's sandbox and spends from one fresh
//! [`ParentBudget`](super::ParentBudget) per request (fuel, output, time), like one
//! parent's render (at most [`ADMIT_TIME`]): a hostile object cannot make the webhook
//! spin. The expressions are compiled once, with the rule, in its environment
//! ([`AdmissionPrograms`], beside the rule's other programs), and `check` reports those
//! that do not compile at `file:line` ([`diagnostics`]).
//!
//! A denial's message is a template over the same variables, compiled with the rule in
//! a message environment that prints plain text ([`super::env::message_environment`],
//! [`message_templates`]), then redacted: the value of any Secret among the references
//! never reaches the API server's answer.

use std::collections::{BTreeMap, BTreeSet};

use minijinja::Environment;
use minijinja::value::Value;
use serde_json::{Map, Value as Json, json};

use super::diags::Diags;
use super::{CompiledRule, Expr, RenderError, redact, secret_values_in, val};
use crate::rules::admission::path_segments;
use crate::rules::{Diagnostic, Rule, ValidateRule};

/// The admission operation being judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Create,
    Update,
}

/// Which webhook is judging: the API server calls the mutating webhooks first, then
/// validates the schema, then calls the validating ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Defaults only (`/mutate`): never a denial from a check.
    Mutate,
    /// Checks only (`/validate`), on the object as the mutating phase left it.
    Validate,
    /// Defaults, then the checks on the defaulted object (`rulebook test`).
    Both,
}

/// What a check or default sees: the object (`parent`), the stored one on updates
/// (`old`), and the rule's references resolved for the object (`refs`, name → object or
/// list).
#[derive(Clone, Copy, Debug)]
pub struct AdmitRequest<'a> {
    pub phase: Phase,
    pub operation: Operation,
    pub object: &'a Json,
    pub old: Option<&'a Json>,
    pub refs: &'a serde_json::Map<String, Json>,
}

/// The answer.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Allowed; `patch` is the JSON Patch (RFC 6902) of the computed defaults, empty
    /// when none applied.
    Allowed { patch: Vec<Json> },
    /// Refused by the check at `index` of `spec.admission.validate`, with its rendered,
    /// redacted message and the field it names.
    Denied {
        index: usize,
        message: String,
        field: Option<String>,
    },
}

/// The variables of an admission check, default or message.
const ADMISSION_VARS: &[&str] = &["parent", "old", "refs", "rule"];

/// How long one admission request may evaluate (a render may take 5 s): well under the
/// webhook server's deadline (4 s) and the API server's timeout (at most 5 s), so a
/// hostile object's evaluation, answered or abandoned, frees its evaluation slot long
/// before the requests queued behind it time out.
pub const ADMIT_TIME: std::time::Duration = std::time::Duration::from_secs(1);

/// The longest denial message sent back, in characters.
const MAX_MESSAGE: usize = 1024;

impl CompiledRule {
    /// Computes the rule's `expr:` defaults, then judges the defaulted object against
    /// its `expr:` checks (as `request.phase` says), within one fresh budget.
    pub fn admit(&self, request: &AdmitRequest) -> Result<Verdict, RenderError> {
        self.admit_with_warnings(request).map(|(v, _)| v)
    }

    /// [`admit`](Self::admit), and the warnings for the author (the review's
    /// `warnings`, which `kubectl` prints): a default not applied because its value is
    /// undefined, or because a level of its path is there but not an object. They name
    /// fields, never values.
    pub fn admit_with_warnings(
        &self,
        request: &AdmitRequest,
    ) -> Result<(Verdict, Vec<String>), RenderError> {
        let mut warnings = Vec::new();
        let Some(a) = &self.rule.spec.admission else {
            return Ok((Verdict::Allowed { patch: Vec::new() }, warnings));
        };
        let mut budget = self.admission_budget();
        let _active = budget.enter();
        let programs = &self.running().borrow_dependent().admission;
        let mut ctx = self.admission_context(request.object, request);
        let mut object = request.object.clone();
        let mut patch = Vec::new();
        if request.phase != Phase::Validate {
            for (i, d) in a.default.iter().enumerate() {
                let Some(expr) = &d.expr else { continue };
                let Some(segments) = path_segments(&d.path).filter(|s| !s.is_empty()) else {
                    continue;
                };
                if lookup(&object, &segments).is_some() {
                    continue;
                }
                let e = self.compiled_program(programs.defaults.get(i), "default", i, expr)?;
                ctx.insert("parent", val(&object));
                let value = self.eval(e, &ctx)?;
                if value.is_undefined() {
                    warnings.push(format!(
                        "rule {}: {} not defaulted: its expression is undefined",
                        self.name, d.path.value
                    ));
                }
                if value.is_undefined() || value.is_none() {
                    continue;
                }
                let value = self.default_value(i, expr.line, &value)?;
                if !set_absent(&mut object, &segments, value, &mut patch) {
                    warnings.push(format!(
                        "rule {}: {} not defaulted: a field on its path is not an object",
                        self.name, d.path.value
                    ));
                }
            }
        }
        if request.phase != Phase::Mutate {
            ctx.insert("parent", val(&object));
            if let Some(denied) = self.first_denial(programs, a, &ctx, request)? {
                return Ok((denied, warnings));
            }
        }
        Ok((Verdict::Allowed { patch }, warnings))
    }

    /// Default `i`'s value as JSON, its size charged to the request's output budget (it
    /// travels back in the patch: a default built from a tenant's field cannot grow the
    /// answer without bound).
    fn default_value(&self, i: usize, line: u64, value: &Value) -> Result<Json, RenderError> {
        let key = format!("rule '{}': spec.admission.default[{i}]: ", self.name);
        let bytes = super::guarded::json_len(value, None);
        super::budget::charge(super::budget::Charge::Output, bytes)
            .map_err(|e| RenderError::from_minijinja(&self.file, Some(line), &key, &e))?;
        serde_json::to_value(value)
            .map_err(|err| RenderError::new(self.file.clone(), Some(line), format!("{key}{err}")))
    }

    /// The budget of one admission request: the rule's, with at most [`ADMIT_TIME`].
    pub fn admission_budget(&self) -> super::ParentBudget {
        super::ParentBudget::new(&super::Limits {
            parent_time: self.limits.parent_time.min(ADMIT_TIME),
            ..self.limits.clone()
        })
    }

    /// The first `expr:` check that runs for the request and is false, as a denial.
    fn first_denial(
        &self,
        programs: &AdmissionPrograms<'_>,
        a: &crate::rules::Admission,
        ctx: &BTreeMap<&'static str, Value>,
        request: &AdmitRequest,
    ) -> Result<Option<Verdict>, RenderError> {
        for (i, v) in a.validate.iter().enumerate() {
            let Some(expr) = &v.expr else { continue };
            let e = self.compiled_program(programs.checks.get(i), "validate", i, expr)?;
            let reads_old = programs.reads_old.get(i).copied().unwrap_or(true);
            if !applies(v, reads_old, request.operation) {
                continue;
            }
            if !self.eval(e, ctx)?.is_true() {
                let message = self.denial_message(i, v, ctx, request.refs)?;
                return Ok(Some(Verdict::Denied {
                    index: i,
                    message,
                    field: v.field_path.as_ref().map(|f| f.value.clone()),
                }));
            }
        }
        Ok(None)
    }

    fn admission_context(
        &self,
        object: &Json,
        request: &AdmitRequest,
    ) -> BTreeMap<&'static str, Value> {
        let mut ctx: BTreeMap<&'static str, Value> = BTreeMap::new();
        ctx.insert("parent", val(object));
        if let Some(old) = request.old {
            ctx.insert("old", val(old));
        }
        ctx.insert("refs", val(request.refs));
        ctx.insert("rule", self.rule_value.clone());
        ctx
    }

    /// The program of `spec.admission.<list>[i]`, compiled with the rule. A rule that
    /// compiled has every one ([`diagnostics`] refuses the rest); an error rather than a
    /// panic all the same.
    fn compiled_program<'p, 'env>(
        &self,
        program: Option<&'p Option<Expr<'env>>>,
        list: &str,
        i: usize,
        expr: &crate::rules::Loc<String>,
    ) -> Result<&'p Expr<'env>, RenderError> {
        program.and_then(Option::as_ref).ok_or_else(|| {
            RenderError::new(
                self.file.clone(),
                Some(expr.line),
                format!(
                    "rule '{}': spec.admission.{list}[{i}].expr: not compiled",
                    self.name
                ),
            )
        })
    }

    /// Check `i`'s message, rendered over `ctx`, capped, with every Secret value among
    /// the references redacted.
    fn denial_message(
        &self,
        i: usize,
        v: &ValidateRule,
        ctx: &BTreeMap<&'static str, Value>,
        refs: &Map<String, Json>,
    ) -> Result<String, RenderError> {
        let fail = |e: minijinja::Error| {
            RenderError::from_minijinja(
                &self.file,
                Some(v.message.line),
                &format!(
                    "rule '{}': spec.admission.validate[{i}].message: ",
                    self.name
                ),
                &e,
            )
        };
        let text = self
            .messages
            .get_template(&message_name(i))
            .and_then(|t| t.render(ctx))
            .map_err(fail)?;
        let objects: Vec<&Json> = refs
            .values()
            .flat_map(|o| match o {
                Json::Array(list) => list.iter().collect::<Vec<_>>(),
                o => vec![o],
            })
            .collect();
        let secrets = secret_values_in(objects.into_iter());
        let text = redact(&text, &secrets);
        Ok(match text.char_indices().nth(MAX_MESSAGE) {
            Some((at, _)) => format!("{}…", &text[..at]),
            None => text,
        })
    }
}

/// Whether check `v` runs for `op`: its `operations`, else both — but a check that
/// reads `old` only on updates (a create has no old object).
fn applies(v: &ValidateRule, reads_old: bool, op: Operation) -> bool {
    let named = |name: &str| v.operations.iter().any(|o| o.as_str() == name);
    let wanted = match op {
        Operation::Create => "CREATE",
        Operation::Update => "UPDATE",
    };
    if !v.operations.is_empty() {
        return named(wanted);
    }
    op == Operation::Update || !reads_old
}

/// The value at `path` in `object`, if present (null counts as absent).
fn lookup<'a>(object: &'a Json, path: &[String]) -> Option<&'a Json> {
    let mut here = object;
    for key in path {
        here = here.get(key)?;
    }
    (!here.is_null()).then_some(here)
}

/// Sets `path` to `value` in `object` and records the JSON Patch `add` that does the
/// same: at the first missing level, with the rest as nested objects. A level that is
/// there but not an object is left alone (the default does not apply: false).
fn set_absent(object: &mut Json, path: &[String], value: Json, patch: &mut Vec<Json>) -> bool {
    let mut pointer = String::new();
    let mut here = object;
    for (depth, key) in path.iter().enumerate() {
        let Some(map) = here.as_object_mut() else {
            return false;
        };
        pointer.push('/');
        pointer.push_str(&key.replace('~', "~0").replace('/', "~1"));
        let last = depth + 1 == path.len();
        let missing = map.get(key).is_none_or(Json::is_null);
        if last || missing {
            let mut nested = value;
            for k in path[depth + 1..].iter().rev() {
                nested = json!({ k.as_str(): nested });
            }
            let op = if map.contains_key(key) {
                "replace"
            } else {
                "add"
            };
            patch.push(json!({"op": op, "path": pointer, "value": nested.clone()}));
            map.insert(key.clone(), nested);
            return true;
        }
        let Some(next) = map.get_mut(key) else {
            return false;
        };
        here = next;
    }
    false
}

/// The rule's `expr:` checks and defaults, compiled with the rule in its environment
/// (`compile_exprs.rs`), each with the fuel probe at its end so its fuel counts toward
/// the request's budget, as every expression of a rule. `None` for a `cel:` one, and for
/// one that does not compile (which [`diagnostics`] reports, failing the rule).
pub(super) struct AdmissionPrograms<'env> {
    /// Per `validate[]`.
    checks: Vec<Option<Expr<'env>>>,
    /// Per `validate[]`: whether the check reads `old` (then, without `operations`, it
    /// runs on updates only).
    reads_old: Vec<bool>,
    /// Per `default[]`.
    defaults: Vec<Option<Expr<'env>>>,
}

/// Compiles `rule`'s admission expressions in `env`.
pub(super) fn programs<'env>(
    env: &'env Environment<'static>,
    rule: &Rule,
) -> AdmissionPrograms<'env> {
    let compile = |e: &Option<crate::rules::Loc<String>>, key: String| {
        let e = e.as_ref()?;
        let probed = format!("({})|{}", e.value, super::guarded::FUEL_PROBE);
        let expr = env.compile_expression_owned(probed).ok()?;
        Some(Expr {
            expr,
            key,
            line: e.line,
        })
    };
    let Some(a) = &rule.spec.admission else {
        return AdmissionPrograms {
            checks: Vec::new(),
            reads_old: Vec::new(),
            defaults: Vec::new(),
        };
    };
    let checks: Vec<Option<Expr<'env>>> = a
        .validate
        .iter()
        .enumerate()
        .map(|(i, v)| compile(&v.expr, format!("spec.admission.validate[{i}].expr")))
        .collect();
    let reads_old = checks
        .iter()
        .map(|c| {
            c.as_ref()
                .is_some_and(|c| c.expr.undeclared_variables(false).contains("old"))
        })
        .collect();
    let defaults = a
        .default
        .iter()
        .enumerate()
        .map(|(i, d)| compile(&d.expr, format!("spec.admission.default[{i}].expr")))
        .collect();
    AdmissionPrograms {
        checks,
        reads_old,
        defaults,
    }
}

/// The name of check `i`'s message template in the rule's message environment.
fn message_name(i: usize) -> String {
    format!("spec.admission.validate[{i}].message")
}

/// The rule's message environment ([`super::env::message_environment`]) with the
/// message of every `expr:` check compiled in it; one that does not compile is left out
/// (reported by [`diagnostics`]).
pub(super) fn message_templates(rule: &Rule, limits: &super::Limits) -> Environment<'static> {
    let mut env = super::env::message_environment(limits);
    for (i, v) in rule
        .spec
        .admission
        .iter()
        .flat_map(|a| a.validate.iter().enumerate())
    {
        if v.expr.is_some() {
            let _ = env.add_template_owned(message_name(i), v.message.value.clone());
        }
    }
    env
}

/// Every problem of the rule's `expr:` checks, message templates and `expr:` defaults,
/// compiled in `env` (the rule's environment): syntax, and variables other than
/// `parent`, `old`, `refs`, `rule` and the environment's functions.
pub(super) fn diagnostics(
    env: &Environment<'static>,
    rule: &Rule,
    at: &Diags<'_>,
) -> Vec<Diagnostic> {
    let Some(a) = &rule.spec.admission else {
        return Vec::new();
    };
    let mut allowed: BTreeSet<String> = ADMISSION_VARS.iter().map(|s| s.to_string()).collect();
    allowed.extend(env.globals().map(|(k, _)| k.to_string()));
    let mut out = Vec::new();
    let mut check_expr = |text: &str, line: u64, col: u64, key: String| match env
        .compile_expression_owned(text.to_string())
    {
        Err(e) => out.push(at.at(line, col, &key, super::describe(&e))),
        Ok(e) => {
            for v in e.undeclared_variables(false) {
                if !allowed.contains(&v) {
                    out.push(at.at(
                            line,
                            col,
                            &key,
                            format!("unknown variable '{v}' (an admission check may use parent, old, refs and rule)"),
                        ));
                }
            }
        }
    };
    for (i, v) in a.validate.iter().enumerate() {
        if let Some(e) = &v.expr {
            check_expr(
                &e.value,
                e.line,
                e.col,
                format!("spec.admission.validate[{i}].expr"),
            );
        }
    }
    for (i, d) in a.default.iter().enumerate() {
        if let Some(e) = &d.expr {
            check_expr(
                &e.value,
                e.line,
                e.col,
                format!("spec.admission.default[{i}].expr"),
            );
        }
    }
    for (i, v) in a.validate.iter().enumerate() {
        if v.expr.is_some()
            && let Err(e) = Environment::new().template_from_str(&v.message.value)
        {
            out.push(at.at(
                v.message.line,
                v.message.col,
                &format!("spec.admission.validate[{i}].message"),
                super::describe(&e),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::{Limits, compile};
    use crate::rules::Sources;

    const RULE: &str = r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata: {name: app}
spec:
  parent: {apiVersion: example.com/v1, kind: App}
  references:
    - {name: plan, apiVersion: v1, kind: ConfigMap, objectName: "'plan-' ~ parent.spec.plan", optional: true}
    - {name: creds, apiVersion: v1, kind: Secret, objectName: "'creds'", optional: true}
  admission:
    validate:
      - expr: "refs.plan is defined"
        message: "plan {{ parent.spec.plan }} does not exist (creds {{ refs.creds.data.token | default('none') }})"
        fieldPath: spec.plan
      - expr: "parent.spec.tier == old.spec.tier"
        message: "tier is immutable"
      - expr: "(parent.spec.replicas | default(1)) <= 10"
        message: "at most 10 replicas"
        operations: [CREATE]
    default:
      - path: spec.image
        expr: "refs.plan.data.image"
      - path: metadata.labels['app.kubernetes.io/tier']
        expr: "parent.spec.tier"
      - path: spec.size
        expr: "none"
"#;

    fn rule(text: &str) -> std::sync::Arc<CompiledRule> {
        let sources = Sources {
            default_rollout: None,
            rule_files: vec![("rules/app.yaml".into(), text.to_string())],
            templates: BTreeMap::new(),
        };
        let set = compile(&sources, &Limits::default()).unwrap_or_else(|d| panic!("{d}"));
        set.rules["app"].clone()
    }

    fn refs(with_plan: bool) -> Map<String, Json> {
        let mut m = Map::new();
        if with_plan {
            m.insert(
                "plan".into(),
                json!({"kind": "ConfigMap", "data": {"image": "nginx:1.27"}}),
            );
        }
        m.insert(
            "creds".into(),
            json!({"apiVersion": "v1", "kind": "Secret", "data": {"token": "c2VjcmV0LXRva2VuLXZhbHVl"}}),
        );
        m
    }

    fn app(spec: Json) -> Json {
        json!({"apiVersion": "example.com/v1", "kind": "App",
            "metadata": {"name": "a", "namespace": "n"}, "spec": spec})
    }

    #[test]
    fn a_failing_check_denies_with_its_message_and_field() {
        let r = rule(RULE);
        let object = app(json!({"plan": "gold", "tier": "web"}));
        let refs = refs(false);
        let v = r
            .admit(&AdmitRequest {
                phase: Phase::Both,
                operation: Operation::Create,
                object: &object,
                old: None,
                refs: &refs,
            })
            .unwrap();
        let Verdict::Denied {
            index,
            message,
            field,
        } = v
        else {
            panic!("allowed: {v:?}");
        };
        assert_eq!(index, 0);
        assert!(message.starts_with("plan gold does not exist"), "{message}");
        assert_eq!(field.as_deref(), Some("spec.plan"));
    }

    #[test]
    fn a_secret_value_never_reaches_a_denial() {
        let r = rule(RULE);
        let object = app(json!({"plan": "gold"}));
        let refs = refs(false);
        let Verdict::Denied { message, .. } = r
            .admit(&AdmitRequest {
                phase: Phase::Both,
                operation: Operation::Create,
                object: &object,
                old: None,
                refs: &refs,
            })
            .unwrap()
        else {
            panic!("allowed");
        };
        // The template printed the Secret's data (base64 and decoded forms are both
        // redacted by `redact`).
        assert!(!message.contains("c2VjcmV0LXRva2VuLXZhbHVl"), "{message}");
        assert!(!message.contains("secret-token-value"), "{message}");
    }

    #[test]
    fn a_check_reading_old_runs_on_updates_only_and_operations_narrow_a_check() {
        let r = rule(RULE);
        let refs = refs(true);
        let many = app(json!({"plan": "gold", "tier": "web", "replicas": 50}));
        // On create the `old` check is skipped; the replicas check (CREATE only) denies.
        let v = r
            .admit(&AdmitRequest {
                phase: Phase::Both,
                operation: Operation::Create,
                object: &many,
                old: None,
                refs: &refs,
            })
            .unwrap();
        assert!(matches!(v, Verdict::Denied { index: 2, .. }), "{v:?}");
        // On update: the tier check runs and denies a changed tier…
        let old = app(json!({"plan": "gold", "tier": "db"}));
        let v = r
            .admit(&AdmitRequest {
                phase: Phase::Both,
                operation: Operation::Update,
                object: &many,
                old: Some(&old),
                refs: &refs,
            })
            .unwrap();
        assert!(
            matches!(&v, Verdict::Denied { index: 1, message, .. } if message == "tier is immutable"),
            "{v:?}"
        );
        // …and the CREATE-only replicas check does not run.
        let same = app(json!({"plan": "gold", "tier": "db", "replicas": 50}));
        let v = r
            .admit(&AdmitRequest {
                phase: Phase::Both,
                operation: Operation::Update,
                object: &same,
                old: Some(&old),
                refs: &refs,
            })
            .unwrap();
        assert!(matches!(v, Verdict::Allowed { .. }), "{v:?}");
    }

    #[test]
    fn defaults_fill_only_absent_fields_as_a_json_patch() {
        let r = rule(RULE);
        let refs = refs(true);
        let object = app(json!({"plan": "gold", "tier": "web"}));
        let v = r
            .admit(&AdmitRequest {
                phase: Phase::Both,
                operation: Operation::Create,
                object: &object,
                old: None,
                refs: &refs,
            })
            .unwrap();
        let Verdict::Allowed { patch } = v else {
            panic!("denied: {v:?}");
        };
        assert_eq!(
            patch,
            vec![
                json!({"op": "add", "path": "/spec/image", "value": "nginx:1.27"}),
                json!({"op": "add", "path": "/metadata/labels", "value": {"app.kubernetes.io/tier": "web"}}),
            ]
        );
        // A field already set is kept; `none` leaves spec.size absent.
        let set = app(json!({"plan": "gold", "tier": "web", "image": "mine"}));
        let Verdict::Allowed { patch } = r
            .admit(&AdmitRequest {
                phase: Phase::Both,
                operation: Operation::Create,
                object: &set,
                old: None,
                refs: &refs,
            })
            .unwrap()
        else {
            panic!("denied");
        };
        assert_eq!(patch.len(), 1, "{patch:?}");
        assert_eq!(patch[0]["path"], "/metadata/labels");
    }

    /// A default left unapplied says why, naming the field, never a value; one whose
    /// value exceeds the request's output budget refuses the request.
    #[test]
    fn defaults_not_applied_are_warned_and_big_ones_are_charged() {
        let text = RULE.replace(
            "      - path: spec.size\n        expr: \"none\"\n",
            "      - path: spec.size\n        expr: \"none\"\n      - path: spec.limits.cpu\n        expr: \"'1'\"\n      - path: spec.copy\n        expr: \"parent.spec.blob | default('')\"\n",
        );
        let r = rule(&text);
        let refs = refs(false);
        // No plan: spec.image is undefined; spec.limits is a string; size is none.
        let object = app(json!({"plan": "gold", "tier": "web", "limits": "none"}));
        let (v, warnings) = r
            .admit_with_warnings(&AdmitRequest {
                phase: Phase::Mutate,
                operation: Operation::Create,
                object: &object,
                old: None,
                refs: &refs,
            })
            .unwrap();
        assert!(matches!(v, Verdict::Allowed { .. }), "{v:?}");
        assert_eq!(
            warnings,
            vec![
                "rule app: spec.image not defaulted: its expression is undefined".to_string(),
                "rule app: spec.limits.cpu not defaulted: a field on its path is not an object"
                    .to_string(),
            ]
        );
        // A copied megabyte field, with 1 MiB of output per request: refused as over
        // budget before it is put in the patch.
        let sources = Sources {
            default_rollout: None,
            rule_files: vec![("rules/app.yaml".into(), text)],
            templates: BTreeMap::new(),
        };
        let limits = Limits {
            parent_output_bytes: 1 << 20,
            ..Limits::default()
        };
        let set = compile(&sources, &limits).unwrap_or_else(|d| panic!("{d}"));
        let big = app(json!({"plan": "gold", "tier": "web", "blob": "x".repeat(2 << 20)}));
        let out = set.rules["app"].admit(&AdmitRequest {
            phase: Phase::Mutate,
            operation: Operation::Create,
            object: &big,
            old: None,
            refs: &refs,
        });
        let e = out.expect_err("a 2 MiB default within 1 MiB");
        assert!(e.is_budget_exceeded(), "{e}");
    }

    #[test]
    fn a_json_pointer_escapes_slash_and_tilde() {
        let mut o = json!({"metadata": {"labels": {}}});
        let mut patch = Vec::new();
        let path = vec!["metadata".to_string(), "labels".into(), "a.io/b~c".into()];
        set_absent(&mut o, &path, json!("x"), &mut patch);
        assert_eq!(patch[0]["path"], "/metadata/labels/a.io~1b~0c");
        assert_eq!(o["metadata"]["labels"]["a.io/b~c"], "x");
    }

    #[test]
    fn a_request_spends_from_one_budget_and_is_refused_past_it() {
        // A rule whose per-parent fuel is smaller than its checks and defaults need
        // together: each expression alone fits, the request does not.
        let sources = Sources {
            default_rollout: None,
            rule_files: vec![("rules/app.yaml".into(), RULE.to_string())],
            templates: BTreeMap::new(),
        };
        let limits = Limits {
            parent_fuel: 12,
            ..Limits::default()
        };
        let set = compile(&sources, &limits).unwrap_or_else(|d| panic!("{d}"));
        let r = &set.rules["app"];
        let object = app(json!({"plan": "gold", "tier": "web"}));
        let refs = refs(true);
        let out = r.admit(&AdmitRequest {
            phase: Phase::Both,
            operation: Operation::Create,
            object: &object,
            old: None,
            refs: &refs,
        });
        match &out {
            Err(e) => assert!(e.is_budget_exceeded(), "{e}"),
            Ok(v) => panic!("judged within 12 fuel: {v:?}"),
        }
    }

    /// A megabyte string and ten thousand items in the object: judged (a check reading
    /// them, a default, a message printing them) well within the request's time.
    #[test]
    fn a_huge_object_is_judged_within_the_request_budget() {
        let text = RULE.replace(
            "(parent.spec.replicas | default(1)) <= 10",
            "(parent.spec.blob | length) + (parent.spec.items | length) < 100",
        );
        let r = rule(&text);
        let items: Vec<usize> = (0..10_000).collect();
        let object = app(json!({"plan": "gold", "tier": "web",
            "blob": "x".repeat(1 << 20), "items": items}));
        let refs = refs(true);
        let started = std::time::Instant::now();
        let v = r
            .admit(&AdmitRequest {
                phase: Phase::Both,
                operation: Operation::Create,
                object: &object,
                old: None,
                refs: &refs,
            })
            .unwrap();
        let took = started.elapsed();
        assert!(matches!(v, Verdict::Denied { index: 2, .. }), "{v:?}");
        assert!(took < ADMIT_TIME, "judged in {took:?}");
    }

    /// A request spends at most [`ADMIT_TIME`], whatever the rule's render time: past
    /// its clock it is refused as over budget.
    #[test]
    fn a_request_has_its_own_time_bound() {
        let sources = Sources {
            default_rollout: None,
            rule_files: vec![("rules/app.yaml".into(), RULE.to_string())],
            templates: BTreeMap::new(),
        };
        let limits = Limits {
            parent_time: std::time::Duration::from_secs(60),
            ..Limits::default()
        };
        let set = compile(&sources, &limits).unwrap_or_else(|d| panic!("{d}"));
        let r = &set.rules["app"];
        let mut spent = r.admission_budget();
        // The budget's clock: past ADMIT_TIME the next evaluation is refused.
        {
            let _active = spent.enter();
            std::thread::sleep(ADMIT_TIME + std::time::Duration::from_millis(50));
        }
        let _active = spent.enter();
        let e = crate::render::budget::before_evaluation().unwrap_err();
        assert!(e.contains("(limit 1000 ms per parent)"), "{e}");
    }

    #[test]
    fn check_reports_bad_expressions_and_unknown_variables_at_their_line() {
        let bad = RULE
            .replace("expr: \"refs.plan is defined\"", "expr: \"refs.plan is (\"")
            .replace("expr: \"parent.spec.tier\"", "expr: \"children.x\"");
        let sources = Sources {
            default_rollout: None,
            rule_files: vec![("rules/app.yaml".into(), bad)],
            templates: BTreeMap::new(),
        };
        let Err(d) = compile(&sources, &Limits::default()) else {
            panic!("compiled");
        };
        let text = d.to_string();
        assert!(text.contains("rules/app.yaml:11:"), "{text}");
        assert!(text.contains("spec.admission.validate[0].expr"), "{text}");
        assert!(text.contains("unknown variable 'children'"), "{text}");
    }
}
