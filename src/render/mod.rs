//! Render: from a rule and a parent to the desired children, and from the parent and its
//! live children to the parent's status. Pure and deterministic; no cluster.
//!
//! A rule is compiled once ([`CompiledRule::compile`]): its templates, expressions and
//! JSONPaths are parsed at load, never per call.

mod env;
pub mod status;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use jsonpath_rust::parser::model::JpQuery;
use minijinja::value::Value;
use minijinja::{Environment, Expression};
use regex::Regex;
use serde_json::{Map, Value as Json};
use sha2::{Digest, Sha256};

pub use env::{Limits, json_scalar, yaml_safe};
pub use status::{Condition, Readiness, StatusReport};

use crate::rules::{ChildRule, Diagnostic, Loc, SourcedRule, StatusValue, parse_duration};

/// Labels and annotations Rulebook puts on every child.
pub mod labels {
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    pub const MANAGED_BY_VALUE: &str = "rulebook";
    pub const RULE: &str = "rulebook.dev/rule";
    /// The UID of the parent; with the controller ownerReference, what pruning trusts.
    pub const OWNER: &str = "rulebook.dev/owner";
    /// The rule's child name (`spec.children[].name`) that produced the object.
    pub const CHILD: &str = "rulebook.dev/child";
    /// The rule version (content hash of the rule and its templates) that produced the object.
    pub const RULE_VERSION: &str = "rulebook.dev/rule-version";
    /// The hash of the desired object as last applied.
    pub const DESIRED_HASH: &str = "rulebook.dev/desired-hash";
    /// The `forEach` index of the object.
    pub const INDEX: &str = "rulebook.dev/index";
}

/// An error while rendering or evaluating, pointing at the template or rule line.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", self.location_and_message())]
pub struct RenderError {
    /// The template file, or the rule file for an expression.
    pub file: String,
    pub line: Option<u64>,
    pub message: String,
}

impl RenderError {
    fn location_and_message(&self) -> String {
        match self.line {
            Some(l) => format!("{}:{}: {}", self.file, l, self.message),
            None => format!("{}: {}", self.file, self.message),
        }
    }
}

/// A compiled expression, with the rule position it came from.
struct Expr<'env> {
    expr: Expression<'env, 'static>,
    key: String,
    line: u64,
}

struct ChildProgram<'env> {
    include_when: Option<Expr<'env>>,
    ready_when: Option<Expr<'env>>,
    for_each: Option<Expr<'env>>,
}

enum StatusProgram<'env> {
    JsonPath {
        query: JpQuery,
        singular: bool,
        default: Option<Json>,
    },
    Expr(Expr<'env>),
    Value(Json),
    Cases(Vec<(Option<Expr<'env>>, CaseResult<'env>)>),
}

enum CaseResult<'env> {
    Value(Json),
    Expr(Expr<'env>),
    Unset,
}

struct Programs<'env> {
    children: Vec<ChildProgram<'env>>,
    status: Vec<(String, StatusProgram<'env>)>,
}

self_cell::self_cell!(
    struct Compiled {
        owner: Environment<'static>,
        #[covariant]
        dependent: Programs,
    }
);

/// A rule ready to render: its environment with templates, and every expression compiled.
pub struct CompiledRule {
    pub name: String,
    /// The rule file.
    pub file: String,
    pub rule: crate::rules::Rule,
    /// Content hash of the rule and every template it uses (12 hex digits).
    pub version: String,
    pub resync: Option<Duration>,
    /// Template name → display path, for every template the rule uses (includes too).
    pub template_files: BTreeMap<String, String>,
    compiled: Compiled,
    limits: Limits,
}

impl std::fmt::Debug for CompiledRule {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.debug_struct("CompiledRule")
            .field("name", &self.name)
            .field("file", &self.file)
            .field("version", &self.version)
            .finish()
    }
}

/// The variables a rule's templates and expressions may use.
const CONTEXT_VARS: &[&str] = &["parent", "children", "rule"];

/// One desired child: the object as it would be applied.
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredChild {
    /// Index of the child in `spec.children`.
    pub child: usize,
    /// The child's name in the rule.
    pub name: String,
    /// The `forEach` index, when the child fans out.
    pub index: Option<usize>,
    pub object: Json,
    /// Hash of `object` (without the hash annotation), as recorded on the object.
    pub hash: String,
}

impl DesiredChild {
    pub fn object_name(&self) -> &str {
        self.object
            .pointer("/metadata/name")
            .and_then(Json::as_str)
            .unwrap_or("")
    }
    pub fn api_version(&self) -> &str {
        self.object
            .get("apiVersion")
            .and_then(Json::as_str)
            .unwrap_or("")
    }
    pub fn kind(&self) -> &str {
        self.object.get("kind").and_then(Json::as_str).unwrap_or("")
    }
    /// `shards[2]` or `web`, for messages.
    pub fn label(&self) -> String {
        match self.index {
            Some(i) => format!("{}[{i}]", self.name),
            None => self.name.clone(),
        }
    }
}

/// The live children of one parent, by child name, each list ordered by `forEach` index.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observed {
    pub children: BTreeMap<String, Vec<Json>>,
}

impl Observed {
    /// Groups live objects by their `rulebook.dev/child` label, ordered by index then name.
    pub fn from_objects(objects: impl IntoIterator<Item = Json>) -> Observed {
        let mut children: BTreeMap<String, Vec<Json>> = BTreeMap::new();
        for o in objects {
            let Some(name) = o
                .pointer("/metadata/labels")
                .and_then(|l| l.get(labels::CHILD))
                .and_then(Json::as_str)
            else {
                continue;
            };
            children.entry(name.to_string()).or_default().push(o);
        }
        for list in children.values_mut() {
            list.sort_by_key(|o| {
                let idx = o
                    .pointer("/metadata/annotations")
                    .and_then(|a| a.get(labels::INDEX))
                    .and_then(Json::as_str)
                    .and_then(|s| s.parse::<usize>().ok())
                    .unwrap_or(usize::MAX);
                let name = o
                    .pointer("/metadata/name")
                    .and_then(Json::as_str)
                    .unwrap_or("")
                    .to_string();
                (idx, name)
            });
        }
        Observed { children }
    }
}

/// How Rulebook places one child: namespaced children go in the parent's namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    Namespaced,
    Cluster,
}

/// Who a child belongs to.
#[derive(Clone, Debug)]
pub struct ParentInfo<'a> {
    pub api_version: &'a str,
    pub kind: &'a str,
    pub name: &'a str,
    pub namespace: Option<&'a str>,
    pub uid: &'a str,
}

impl<'a> ParentInfo<'a> {
    pub fn of(parent: &'a Json) -> ParentInfo<'a> {
        let s = |p: &str| parent.pointer(p).and_then(Json::as_str);
        ParentInfo {
            api_version: s("/apiVersion").unwrap_or(""),
            kind: s("/kind").unwrap_or(""),
            name: s("/metadata/name").unwrap_or(""),
            namespace: s("/metadata/namespace"),
            uid: s("/metadata/uid").unwrap_or(""),
        }
    }
}

static TAG: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?s)\{\{.*?\}\}|\{%.*?%\}").expect("static regex"));
static FORBIDDEN: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\|\s*(safe|escape|e)\b|\bautoescape\b").expect("static regex"));
static INCLUDE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"\{%[-+]?\s*(?:include|import|extends|from)\s+(?:"([^"]+)"|'([^']+)'|(\S))"#)
        .expect("static regex")
});
static CHILD_REF: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?:^|[^A-Za-z0-9_.])children\s*(?:\.\s*|\[\s*["'])([A-Za-z_][A-Za-z0-9_]*)"#)
        .expect("static regex")
});
static JSONPATH_CHILD_REF: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"^\$\s*(?:\.\s*children|\[\s*['"]children['"]\s*\])\s*(?:\.\s*|\[\s*['"])([A-Za-z_][A-Za-z0-9_]*)"#)
        .expect("static regex")
});

fn line_of(text: &str, offset: usize) -> u64 {
    text[..offset.min(text.len())].matches('\n').count() as u64 + 1
}

/// Names of every variable a template or expression may use without defining it.
fn allowed_vars(env: &Environment<'_>, extra: &[&str]) -> BTreeSet<String> {
    let mut set: BTreeSet<String> = CONTEXT_VARS.iter().map(|s| s.to_string()).collect();
    set.extend(extra.iter().map(|s| s.to_string()));
    set.extend(env.globals().map(|(k, _)| k.to_string()));
    set
}

impl CompiledRule {
    /// Compiles a parsed rule against the template sources. Every problem is reported.
    pub fn compile(
        sr: &SourcedRule,
        templates: &BTreeMap<String, (String, String)>,
        limits: &Limits,
    ) -> Result<CompiledRule, Vec<Diagnostic>> {
        let rule = &sr.rule;
        let file = sr.file.as_str();
        let name = rule.metadata.name.value.clone();
        let mut diags = Vec::new();
        let child_names: BTreeSet<&str> =
            rule.spec.children.iter().map(|c| c.name.as_str()).collect();
        let diag = |line: u64, col: u64, key: &str, msg: String| {
            Diagnostic::new(file, line, col, format!("rule '{name}': {key}: {msg}"))
        };

        // The templates this rule uses, and everything they include.
        let mut env = env::environment(limits);
        let mut used: BTreeMap<String, String> = BTreeMap::new();
        let mut queue: Vec<String> = Vec::new();
        for (i, c) in rule.spec.children.iter().enumerate() {
            if templates.contains_key(c.template.as_str()) {
                queue.push(c.template.value.clone());
            } else {
                diags.push(diag(
                    c.template.line,
                    c.template.col,
                    &format!("spec.children[{i}].template"),
                    format!(
                        "template '{}' not found in the templates directory",
                        c.template.value
                    ),
                ));
            }
        }
        let mut dynamic_include = false;
        while let Some(t) = queue.pop() {
            if used.contains_key(&t) {
                continue;
            }
            let Some((path, source)) = templates.get(&t) else {
                continue;
            };
            used.insert(t.clone(), path.clone());
            for m in INCLUDE.captures_iter(source) {
                match m.get(1).or(m.get(2)) {
                    Some(inc) if templates.contains_key(inc.as_str()) => {
                        queue.push(inc.as_str().to_string())
                    }
                    Some(inc) => diags.push(Diagnostic::new(
                        path.as_str(),
                        line_of(source, inc.start()),
                        0,
                        format!(
                            "template '{}' not found in the templates directory",
                            inc.as_str()
                        ),
                    )),
                    None => dynamic_include = true,
                }
            }
        }
        if dynamic_include {
            for (t, (path, _)) in templates {
                used.insert(t.clone(), path.clone());
            }
        }
        for (t, path) in &used {
            let source = &templates[t].1;
            for tag in TAG.find_iter(source) {
                if let Some(m) = FORBIDDEN.find(tag.as_str()) {
                    diags.push(Diagnostic::new(
                        path.as_str(),
                        line_of(source, tag.start() + m.start()),
                        0,
                        format!(
                            "'{}' is not allowed: Rulebook prints every value as a safe scalar and \
                             escaping cannot be turned off",
                            m.as_str().trim_start_matches('|').trim()
                        ),
                    ));
                }
            }
            if let Err(e) = env.add_template_owned(t.clone(), source.clone()) {
                diags.push(Diagnostic::new(
                    path.as_str(),
                    e.line().unwrap_or(0) as u64,
                    0,
                    describe(&e),
                ));
            }
        }
        // Unknown variables and unknown children in templates used directly by children.
        let allowed = allowed_vars(&env, &["item", "index"]);
        for (t, path) in &used {
            let Ok(tmpl) = env.get_template(t) else {
                continue;
            };
            let source = tmpl.source();
            for var in tmpl.undeclared_variables(false) {
                if !allowed.contains(&var) {
                    let line = Regex::new(&format!(r"\b{}\b", regex::escape(&var)))
                        .ok()
                        .and_then(|r| r.find(source))
                        .map(|m| line_of(source, m.start()))
                        .unwrap_or(0);
                    diags.push(Diagnostic::new(
                        path.as_str(),
                        line,
                        0,
                        format!(
                            "unknown variable '{var}' (templates see parent, children, rule, and item/index in forEach)"
                        ),
                    ));
                }
            }
            for m in CHILD_REF.captures_iter(source) {
                let (Some(whole), Some(n)) = (m.get(0), m.get(1)) else {
                    continue;
                };
                if !child_names.contains(n.as_str()) {
                    diags.push(Diagnostic::new(
                        path.as_str(),
                        line_of(source, whole.start()),
                        0,
                        format!("children.{} is not a child of rule '{name}'", n.as_str()),
                    ));
                }
            }
        }

        let version = {
            let mut h = Sha256::new();
            h.update(serde_json::to_vec(rule).unwrap_or_default());
            for t in used.keys() {
                h.update(t.as_bytes());
                h.update([0]);
                h.update(templates[t].1.as_bytes());
                h.update([0]);
            }
            hex::encode(&h.finalize()[..6])
        };
        let resync = rule
            .spec
            .resync
            .as_ref()
            .and_then(|r| parse_duration(r).ok());

        let compiled = Compiled::try_new(env, |env| {
            let diags = std::cell::RefCell::new(Vec::new());
            let expr_vars = allowed_vars(env, &[]);
            let compile_expr = |src: &Loc<String>, key: String, extra: &[&str]| {
                let allowed: BTreeSet<String> = expr_vars
                    .iter()
                    .cloned()
                    .chain(extra.iter().map(|s| s.to_string()))
                    .collect();
                match env.compile_expression_owned(src.value.clone()) {
                    Ok(expr) => {
                        let mut ok = true;
                        for var in expr.undeclared_variables(false) {
                            if !allowed.contains(&var) {
                                ok = false;
                                diags.borrow_mut().push(diag(
                                    src.line,
                                    src.col,
                                    &key,
                                    format!(
                                        "unknown variable '{var}' (expressions see {})",
                                        allowed_list(&allowed, extra)
                                    ),
                                ));
                            }
                        }
                        for m in CHILD_REF.captures_iter(&src.value) {
                            if let Some(n) = m.get(1)
                                && !child_names.contains(n.as_str())
                            {
                                ok = false;
                                diags.borrow_mut().push(diag(
                                    src.line,
                                    src.col,
                                    &key,
                                    format!("children.{} is not a child of this rule", n.as_str()),
                                ));
                            }
                        }
                        ok.then_some(Expr {
                            expr,
                            key,
                            line: src.line,
                        })
                    }
                    Err(e) => {
                        diags.borrow_mut().push(diag(
                            src.line,
                            src.col,
                            &key,
                            format!("invalid expression: {}", describe(&e)),
                        ));
                        None
                    }
                }
            };
            let mut children = Vec::new();
            for (i, c) in rule.spec.children.iter().enumerate() {
                let key = |k: &str| format!("spec.children[{i}].{k}");
                let include_when = c
                    .include_when
                    .as_ref()
                    .and_then(|e| compile_expr(e, key("includeWhen"), &[]));
                let for_each = c
                    .for_each
                    .as_ref()
                    .and_then(|e| compile_expr(e, key("forEach"), &[]));
                let ready_when = c
                    .ready_when
                    .as_ref()
                    .and_then(|e| compile_expr(e, key("readyWhen"), &["child", "index"]));
                children.push(ChildProgram {
                    include_when,
                    ready_when,
                    for_each,
                });
            }
            let mut status = Vec::new();
            for (field, v) in &rule.spec.status {
                let key = format!("spec.status.{field}");
                let at = |s: &str| Loc {
                    value: s.to_string(),
                    line: v.line,
                    col: v.col,
                };
                // A case's own position, or the status value's when it is unknown.
                let case_at = |s: &Loc<String>| if s.line > 0 { s.clone() } else { at(s) };
                let program = match &v.value {
                    StatusValue::JsonPath { path, default } => {
                        match jsonpath_rust::parser::parse_json_path(path) {
                            Ok(query) => {
                                if let Some(m) = JSONPATH_CHILD_REF.captures(path)
                                    && let Some(n) = m.get(1)
                                    && !child_names.contains(n.as_str())
                                {
                                    diags.borrow_mut().push(diag(
                                        v.line,
                                        v.col,
                                        &key,
                                        format!(
                                            "children.{} is not a child of this rule",
                                            n.as_str()
                                        ),
                                    ));
                                }
                                let singular = is_singular(&query);
                                Some(StatusProgram::JsonPath {
                                    query,
                                    singular,
                                    default: default.clone(),
                                })
                            }
                            Err(e) => {
                                diags.borrow_mut().push(diag(
                                    v.line,
                                    v.col,
                                    &key,
                                    format!("invalid JSONPath '{path}': {}", one_line(&e)),
                                ));
                                None
                            }
                        }
                    }
                    StatusValue::Expr { expr } => {
                        compile_expr(&at(expr), key.clone(), &[]).map(StatusProgram::Expr)
                    }
                    StatusValue::Value { value } => Some(StatusProgram::Value(value.clone())),
                    StatusValue::Cases { cases } => {
                        let mut out = Vec::new();
                        let mut ok = true;
                        for (j, case) in cases.iter().enumerate() {
                            let ckey = format!("{key}.cases[{j}]");
                            let when = match &case.when {
                                Some(w) => {
                                    match compile_expr(&case_at(w), format!("{ckey}.when"), &[]) {
                                        Some(e) => Some(e),
                                        None => {
                                            ok = false;
                                            None
                                        }
                                    }
                                }
                                None => None,
                            };
                            let result = match (&case.value, &case.expr) {
                                (Some(_), Some(e)) => {
                                    let e = case_at(e);
                                    diags.borrow_mut().push(diag(
                                        e.line,
                                        e.col,
                                        &ckey,
                                        "a case has `value` or `expr`, not both".into(),
                                    ));
                                    ok = false;
                                    CaseResult::Unset
                                }
                                (Some(value), None) => CaseResult::Value(value.clone()),
                                (None, Some(e)) => {
                                    match compile_expr(&case_at(e), format!("{ckey}.expr"), &[]) {
                                        Some(e) => CaseResult::Expr(e),
                                        None => {
                                            ok = false;
                                            CaseResult::Unset
                                        }
                                    }
                                }
                                (None, None) => CaseResult::Unset,
                            };
                            out.push((when, result));
                        }
                        ok.then_some(StatusProgram::Cases(out))
                    }
                };
                if let Some(p) = program {
                    status.push((field.clone(), p));
                }
            }
            let diags = diags.into_inner();
            if diags.is_empty() {
                Ok(Programs { children, status })
            } else {
                Err(diags)
            }
        });
        match compiled {
            Ok(compiled) if diags.is_empty() => Ok(CompiledRule {
                name: name.clone(),
                file: file.to_string(),
                rule: rule.clone(),
                version,
                resync,
                template_files: used,
                compiled,
                limits: limits.clone(),
            }),
            Ok(_) => Err(diags),
            Err(mut more) => {
                diags.append(&mut more);
                Err(diags)
            }
        }
    }

    pub fn children(&self) -> &[ChildRule] {
        &self.rule.spec.children
    }

    /// The template context: `parent`, `children` (live, by name), `rule`.
    fn context(&self, parent: &Json, observed: &Observed) -> BTreeMap<&'static str, Value> {
        let mut children = BTreeMap::new();
        for (i, c) in self.rule.spec.children.iter().enumerate() {
            let live = observed.children.get(c.name.as_str());
            let v = if self.compiled.borrow_dependent().children[i]
                .for_each
                .is_some()
            {
                val(&live.cloned().unwrap_or_default())
            } else {
                match live.and_then(|l| l.first()) {
                    Some(o) => val(&o),
                    None => continue,
                }
            };
            children.insert(c.name.value.clone(), v);
        }
        let mut ctx = BTreeMap::new();
        ctx.insert("parent", val(&parent));
        ctx.insert("children", Value::from(children));
        ctx.insert(
            "rule",
            val(&serde_json::json!({"name": self.name, "version": self.version})),
        );
        ctx
    }

    fn eval(
        &self,
        e: &Expr<'_>,
        ctx: &BTreeMap<&'static str, Value>,
    ) -> Result<Value, RenderError> {
        e.expr.eval(ctx).map_err(|err| RenderError {
            file: self.file.clone(),
            line: Some(e.line),
            message: format!("rule '{}': {}: {}", self.name, e.key, describe(&err)),
        })
    }

    /// The desired children of `parent`, in rule order, fully decorated (namespace,
    /// labels, annotations, controller ownerReference) as they would be applied.
    /// `scope(i)` says whether child `i` is namespaced (from discovery, or assumed).
    pub fn render(
        &self,
        parent: &Json,
        observed: &Observed,
        scope: &dyn Fn(usize) -> Scope,
    ) -> Result<Vec<DesiredChild>, RenderError> {
        let info = ParentInfo::of(parent);
        let ctx = self.context(parent, observed);
        let programs = self.compiled.borrow_dependent();
        let env = self.compiled.borrow_owner();
        let mut out = Vec::new();
        for (i, c) in self.rule.spec.children.iter().enumerate() {
            let p = &programs.children[i];
            if let Some(w) = &p.include_when
                && !self.eval(w, &ctx)?.is_true()
            {
                continue;
            }
            let items: Vec<Option<Value>> = match &p.for_each {
                None => vec![None],
                Some(e) => {
                    let v = self.eval(e, &ctx)?;
                    if v.is_undefined() || v.is_none() {
                        vec![]
                    } else if !matches!(
                        v.kind(),
                        minijinja::value::ValueKind::Seq | minijinja::value::ValueKind::Iterable
                    ) {
                        return Err(RenderError {
                            file: self.file.clone(),
                            line: Some(e.line),
                            message: format!(
                                "rule '{}': {}: gives {} ({}), not a list",
                                self.name,
                                e.key,
                                v.kind(),
                                truncate_display(&v.to_string(), 80)
                            ),
                        });
                    } else {
                        let len = v.len().unwrap_or(0);
                        if len > self.limits.max_for_each {
                            return Err(RenderError {
                                file: self.file.clone(),
                                line: Some(e.line),
                                message: format!(
                                    "rule '{}': {}: {len} items, more than the limit of {}",
                                    self.name, e.key, self.limits.max_for_each
                                ),
                            });
                        }
                        let iter = v.try_iter().map_err(|err| RenderError {
                            file: self.file.clone(),
                            line: Some(e.line),
                            message: format!(
                                "rule '{}': {}: not a list: {}",
                                self.name,
                                e.key,
                                describe(&err)
                            ),
                        })?;
                        iter.take(self.limits.max_for_each).map(Some).collect()
                    }
                }
            };
            let template_path = self
                .template_files
                .get(c.template.as_str())
                .cloned()
                .unwrap_or_else(|| c.template.value.clone());
            let tmpl = env.get_template(&c.template).map_err(|e| RenderError {
                file: template_path.clone(),
                line: None,
                message: describe(&e),
            })?;
            for (idx, item) in items.into_iter().enumerate() {
                let mut local = ctx.clone();
                let index = item.as_ref().map(|_| idx);
                if let Some(item) = item {
                    local.insert("item", item);
                    local.insert("index", Value::from(idx));
                }
                let mut w = env::CappedWriter {
                    buf: Vec::new(),
                    limit: self.limits.max_output_bytes,
                };
                if let Err(e) = tmpl.render_captured_to(&local, &mut w) {
                    return Err(RenderError {
                        file: template_path.clone(),
                        line: e.line().map(|l| l as u64),
                        message: describe(&e),
                    });
                }
                let text = String::from_utf8_lossy(&w.buf);
                let object = parse_rendered(&text).map_err(|(line, message)| RenderError {
                    file: template_path.clone(),
                    line,
                    message,
                })?;
                let object = self
                    .check_and_decorate(c, object, &info, scope(i), index)
                    .map_err(|message| RenderError {
                        file: template_path.clone(),
                        line: None,
                        message,
                    })?;
                let hash = object_hash(&object);
                let mut object = object;
                set_annotation(&mut object, labels::DESIRED_HASH, &hash);
                out.push(DesiredChild {
                    child: i,
                    name: c.name.value.clone(),
                    index,
                    object,
                    hash,
                });
            }
        }
        // Two children rendering the same object would fight each other.
        let mut seen = BTreeMap::new();
        for d in &out {
            let key = (
                d.api_version().to_string(),
                d.kind().to_string(),
                d.object_name().to_string(),
            );
            if let Some(first) = seen.insert(key.clone(), d.label()) {
                return Err(RenderError {
                    file: self.file.clone(),
                    line: None,
                    message: format!(
                        "rule '{}': children {first} and {} both render {} {}",
                        self.name,
                        d.label(),
                        key.1,
                        key.2
                    ),
                });
            }
        }
        Ok(out)
    }

    fn check_and_decorate(
        &self,
        c: &ChildRule,
        mut object: Json,
        parent: &ParentInfo<'_>,
        scope: Scope,
        index: Option<usize>,
    ) -> Result<Json, String> {
        let Some(map) = object.as_object_mut() else {
            return Err("the template must render one YAML mapping (an object)".into());
        };
        for (key, want) in [
            ("apiVersion", &c.api_version.value),
            ("kind", &c.kind.value),
        ] {
            match map.get(key).and_then(Json::as_str) {
                Some(got) if got == want => {}
                Some(got) => {
                    return Err(format!(
                        "rendered {key} '{got}', but the rule declares '{want}'"
                    ));
                }
                None => {
                    map.insert(key.to_string(), Json::String(want.clone()));
                }
            }
        }
        let meta = map
            .entry("metadata")
            .or_insert_with(|| Json::Object(Map::new()));
        let Some(meta) = meta.as_object_mut() else {
            return Err("metadata must be a mapping".into());
        };
        match meta.get("name").and_then(Json::as_str) {
            Some(n) if !n.is_empty() => check_object_name("metadata.name", n)?,
            _ => return Err("the rendered object has no metadata.name".into()),
        }
        if let Some(n) = meta.get("namespace").and_then(Json::as_str) {
            check_object_name("metadata.namespace", n)?;
        }
        match (scope, parent.namespace) {
            (Scope::Namespaced, None) => {
                // A cluster-scoped parent places its namespaced children where the template says.
                if meta.get("namespace").and_then(Json::as_str).is_none() {
                    meta.insert("namespace".into(), Json::String("default".into()));
                }
            }
            (Scope::Namespaced, Some(ns)) => {
                if let Some(got) = meta.get("namespace").and_then(Json::as_str)
                    && got != ns
                {
                    return Err(format!(
                        "the rendered object is in namespace '{got}'; children live in the parent's namespace '{ns}'"
                    ));
                }
                meta.insert("namespace".into(), Json::String(ns.to_string()));
            }
            (Scope::Cluster, Some(_)) => {
                return Err(format!(
                    "{} is cluster-scoped and the parent is namespaced: a cluster-scoped child cannot be owned by a namespaced parent",
                    c.kind.value
                ));
            }
            (Scope::Cluster, None) => {
                meta.remove("namespace");
            }
        }
        let labels_map = meta
            .entry("labels")
            .or_insert_with(|| Json::Object(Map::new()));
        let Some(labels_map) = labels_map.as_object_mut() else {
            return Err("metadata.labels must be a mapping".into());
        };
        labels_map.insert(labels::MANAGED_BY.into(), labels::MANAGED_BY_VALUE.into());
        labels_map.insert(labels::RULE.into(), self.name.clone().into());
        labels_map.insert(labels::OWNER.into(), parent.uid.into());
        labels_map.insert(labels::CHILD.into(), c.name.value.clone().into());
        let ann = meta
            .entry("annotations")
            .or_insert_with(|| Json::Object(Map::new()));
        let Some(ann) = ann.as_object_mut() else {
            return Err("metadata.annotations must be a mapping".into());
        };
        ann.insert(labels::RULE_VERSION.into(), self.version.clone().into());
        ann.remove(labels::DESIRED_HASH);
        match index {
            Some(i) => {
                ann.insert(labels::INDEX.into(), i.to_string().into());
            }
            None => {
                ann.remove(labels::INDEX);
            }
        }
        meta.insert(
            "ownerReferences".into(),
            serde_json::json!([{
                "apiVersion": parent.api_version,
                "kind": parent.kind,
                "name": parent.name,
                "uid": parent.uid,
                "controller": true,
            }]),
        );
        for forbidden in [
            "uid",
            "resourceVersion",
            "generation",
            "creationTimestamp",
            "managedFields",
        ] {
            meta.remove(forbidden);
        }
        map.remove("status");
        Ok(object)
    }

    /// The status Rulebook would write, given the desired and the live children.
    pub fn status(
        &self,
        parent: &Json,
        observed: &Observed,
        desired: &[DesiredChild],
    ) -> Result<StatusReport, RenderError> {
        let ctx = self.context(parent, observed);
        let programs = self.compiled.borrow_dependent();
        let root = serde_json::json!({
            "parent": parent,
            "children": observed_json(&self.rule.spec.children, programs, observed),
        });
        let mut fields = Map::new();
        for (field, program) in &programs.status {
            let value = match program {
                StatusProgram::JsonPath {
                    query,
                    singular,
                    default,
                } => {
                    let found = jsonpath_rust::query::js_path_process(query, &root)
                        .map(|refs| {
                            refs.into_iter()
                                .map(|r| r.val().clone())
                                .collect::<Vec<_>>()
                        })
                        .unwrap_or_default();
                    match (found.len(), singular) {
                        (0, _) => default.clone(),
                        (1, true) => found.into_iter().next(),
                        _ => Some(Json::Array(found)),
                    }
                }
                StatusProgram::Expr(e) => to_json(self.eval(e, &ctx)?),
                StatusProgram::Value(v) => Some(v.clone()),
                StatusProgram::Cases(cases) => {
                    let mut result = None;
                    for (when, then) in cases {
                        let hit = match when {
                            Some(w) => self.eval(w, &ctx)?.is_true(),
                            None => true,
                        };
                        if hit {
                            result = match then {
                                CaseResult::Value(v) => Some(v.clone()),
                                CaseResult::Expr(e) => to_json(self.eval(e, &ctx)?),
                                CaseResult::Unset => None,
                            };
                            break;
                        }
                    }
                    result
                }
            };
            if let Some(v) = value
                && !v.is_null()
            {
                fields.insert(field.clone(), v);
            }
        }
        let readiness = self.readiness(&ctx, observed, desired)?;
        Ok(StatusReport { fields, readiness })
    }

    fn readiness(
        &self,
        ctx: &BTreeMap<&'static str, Value>,
        observed: &Observed,
        desired: &[DesiredChild],
    ) -> Result<Readiness, RenderError> {
        let programs = self.compiled.borrow_dependent();
        let mut missing = Vec::new();
        let mut not_ready = Vec::new();
        for d in desired {
            let live = observed.children.get(&d.name).and_then(|list| {
                list.iter().find(|o| {
                    o.pointer("/metadata/name").and_then(Json::as_str) == Some(d.object_name())
                })
            });
            let Some(live) = live else {
                missing.push(d.label());
                continue;
            };
            if let Some(rw) = &programs.children[d.child].ready_when {
                let mut local = ctx.clone();
                local.insert("child", val(&live));
                if let Some(i) = d.index {
                    local.insert("index", Value::from(i));
                }
                if !self.eval(rw, &local)?.is_true() {
                    not_ready.push(d.label());
                }
            }
        }
        Ok(Readiness { missing, not_ready })
    }
}

/// `children` as JSONPath sees it: objects by name, lists for `forEach`.
fn observed_json(children: &[ChildRule], programs: &Programs<'_>, observed: &Observed) -> Json {
    let mut out = Map::new();
    for (i, c) in children.iter().enumerate() {
        let live = observed.children.get(c.name.as_str());
        if programs.children[i].for_each.is_some() {
            out.insert(
                c.name.value.clone(),
                Json::Array(live.cloned().unwrap_or_default()),
            );
        } else if let Some(o) = live.and_then(|l| l.first()) {
            out.insert(c.name.value.clone(), o.clone());
        }
    }
    Json::Object(out)
}

fn to_json(v: Value) -> Option<Json> {
    if v.is_undefined() || v.is_none() {
        return None;
    }
    serde_json::to_value(&v).ok()
}

/// A query with only name and index selectors selects at most one node (RFC 9535 §2.3.5.1).
fn is_singular(q: &JpQuery) -> bool {
    use jsonpath_rust::parser::model::{Segment, Selector};
    q.segments.iter().all(|s| match s {
        Segment::Selector(sel) => matches!(sel, Selector::Name(_) | Selector::Index(_)),
        Segment::Selectors(sels) => {
            sels.len() == 1 && matches!(sels[0], Selector::Name(_) | Selector::Index(_))
        }
        Segment::Descendant(_) => false,
    })
}

/// Parses one rendered template: a single YAML mapping.
/// The YAML budget for one rendered object: a Kubernetes object is at most about
/// 1.5 MiB, so these bounds are generous for real templates and stop alias bombs and
/// deep nesting written into a template fast. Set here, not left to the crate's defaults.
fn rendered_yaml_options() -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_events = 250_000;
    budget.max_aliases = 1_000;
    budget.max_anchors = 1_000;
    budget.max_recorded_anchor_events = 100_000;
    budget.max_recorded_anchor_bytes = 4 << 20;
    budget.max_depth = 64;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options
}

fn parse_rendered(text: &str) -> Result<Json, (Option<u64>, String)> {
    let docs: Vec<Json> = serde_saphyr::from_multiple_with_options(text, rendered_yaml_options())
        .map_err(|e| {
        (
            e.location().map(|l| l.line()),
            format!(
                "the rendered output is not valid YAML: {}",
                crate::rules::yaml_message(&e)
            ),
        )
    })?;
    let mut docs: Vec<Json> = docs.into_iter().filter(|d| !d.is_null()).collect();
    match docs.len() {
        1 => Ok(docs.remove(0)),
        0 => Err((None, "the template rendered no object".into())),
        n => Err((
            None,
            format!("the template rendered {n} objects; a template renders exactly one"),
        )),
    }
}

fn set_annotation(object: &mut Json, key: &str, value: &str) {
    if let Some(ann) = object
        .pointer_mut("/metadata/annotations")
        .and_then(Json::as_object_mut)
    {
        ann.insert(key.to_string(), Json::String(value.to_string()));
    }
}

/// A stable hash of an object (serde_json maps are ordered, so this is canonical).
pub fn object_hash(object: &Json) -> String {
    let bytes = serde_json::to_vec(object).unwrap_or_default();
    hex::encode(&Sha256::digest(&bytes)[..8])
}

/// A minijinja error as one line: what went wrong, without the template dump.
pub fn describe(e: &minijinja::Error) -> String {
    let mut msg = match e.detail() {
        Some(d) => format!("{}: {d}", e.kind()),
        None => e.kind().to_string(),
    };
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    msg
}

/// A parse error on one line: the JSONPath parser draws the position over several lines
/// (`--> 1:20`, the query, a caret, `= expected ...`).
fn one_line(e: &dyn std::fmt::Display) -> String {
    let text = e.to_string();
    if !text.contains('\n') {
        return text;
    }
    let mut head = "";
    let mut at = None;
    let mut what = Vec::new();
    for (i, l) in text.lines().map(str::trim).enumerate() {
        let (before, pos) = match l.split_once("-->") {
            Some((b, p)) => (b, Some(p)),
            None => (l, None),
        };
        if i == 0 {
            head = before.trim().trim_end_matches(':');
        }
        if let Some(p) = pos {
            at = p.trim().rsplit(':').next();
        } else if let Some(w) = l.strip_prefix("= ") {
            what.push(w);
        }
    }
    match at {
        Some(col) => format!("{head}: at column {col}: {}", what.join("; ")),
        None => format!("{head}: {}", what.join("; ")),
    }
}

fn allowed_list(allowed: &BTreeSet<String>, extra: &[&str]) -> String {
    let mut names: Vec<&str> = CONTEXT_VARS.to_vec();
    names.extend(extra);
    let _ = allowed;
    names.join(", ")
}

/// The rule behind a shared compiled rule, for callers that hold an `Arc`.
pub type SharedRule = Arc<CompiledRule>;

fn truncate_display(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// Any serializable value as a template value.
fn val<T: serde::Serialize>(x: &T) -> Value {
    Value::from(minijinja::value::Serde(x))
}

/// Names go into request URLs: refuse, at render time, what is never a valid object
/// name of any kind (the API server's path-segment rules, plus characters that would
/// change the URL or cannot be in any name), so the parent gets a clear `RenderFailed`
/// instead of a request for another object. Kind-specific rules (DNS subdomain, label)
/// stay with the API server.
pub fn check_object_name(field: &str, name: &str) -> Result<(), String> {
    let bad = name
        .chars()
        .find(|c| matches!(c, '/' | '%' | '?' | '#' | '\\') || c.is_whitespace() || c.is_control());
    let why = if name.len() > 253 {
        Some(format!("is {} bytes long (at most 253)", name.len()))
    } else if name == "." || name == ".." {
        Some("may not be '.' or '..'".to_string())
    } else {
        bad.map(|c| format!("may not contain {c:?}"))
    };
    match why {
        Some(why) => Err(format!(
            "the rendered {field} {:?} {why}: object names are DNS subdomains (lowercase letters, digits, '-' and '.')",
            truncate_name(name)
        )),
        None => Ok(()),
    }
}

fn truncate_name(name: &str) -> String {
    match name.char_indices().nth(64) {
        Some((i, _)) => format!("{}…", &name[..i]),
        None => name.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_would_change_the_request_url_are_refused() {
        for bad in [
            "../../x/configmaps/v",
            "a%2Fb",
            "v/status",
            "v?dryRun=All",
            "c#f",
            ".",
            "..",
            "a b",
            "a\u{7f}",
        ] {
            assert!(check_object_name("metadata.name", bad).is_err(), "{bad:?}");
        }
        let long = "a".repeat(254);
        let err = check_object_name("metadata.name", &long).unwrap_err();
        assert!(err.contains("254 bytes"), "{err}");
        for good in ["web-config", "a.b.c", "system:aggregate-to-view", "x"] {
            assert!(check_object_name("metadata.name", good).is_ok(), "{good:?}");
        }
    }
}
