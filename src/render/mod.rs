//! Render: from a rule and a parent to the desired children, and from the parent and its
//! live children to the parent's status. Pure and deterministic; no cluster.
//!
//! A rule is compiled once ([`CompiledRule::compile`]): its templates, expressions and
//! JSONPaths are parsed at load, never per call. Rendering a parent
//! ([`CompiledRule::render_within`], `children.rs`) and evaluating its status
//! ([`CompiledRule::status_within`], `status_eval.rs`) spend from one [`ParentBudget`].

pub mod adopt;
pub mod budget;
mod children;
mod env;
mod error;
mod guarded;
mod set;
pub mod status;
mod status_eval;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use jsonpath_rust::parser::model::JpQuery;
use minijinja::value::Value;
use minijinja::{Environment, Expression};
use regex::Regex;
use serde_json::Value as Json;
use sha2::{Digest, Sha256};

pub use budget::ParentBudget;
pub use children::check_object_name;
pub use env::{Limits, json_scalar, yaml_safe};
pub use error::{FailureReason, RenderError, describe};
pub use set::{RuleSet, compile, compile_read, load};
pub use status::{Condition, Readiness, StatusReport};

use crate::rules::{ChildRule, Diagnostic, Loc, SourcedRule, StatusValue, parse_duration};

/// Labels and annotations Rulebook puts on every child (the shared vocabulary).
pub use crate::meta::labels;

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
                        // Evaluated with the fuel probe at the end, so its fuel counts
                        // toward the parent's budget.
                        let probed = format!("({})|{}", src.value, guarded::FUEL_PROBE);
                        let expr = env.compile_expression_owned(probed).unwrap_or(expr);
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

    /// A fresh render budget for one parent, from this rule's limits.
    pub fn budget(&self) -> ParentBudget {
        ParentBudget::new(&self.limits)
    }

    /// Evaluates an expression against the active budget: refused when the budget is
    /// spent, and its fuel (reported by the probe filter) is added after.
    fn eval(
        &self,
        e: &Expr<'_>,
        ctx: &BTreeMap<&'static str, Value>,
    ) -> Result<Value, RenderError> {
        let prefix = format!("rule '{}': {}: ", self.name, e.key);
        let at = |message: String| {
            RenderError::budget(
                self.file.clone(),
                Some(e.line),
                format!("{prefix}{message}"),
            )
        };
        budget::before_evaluation().map_err(at)?;
        let v = e
            .expr
            .eval(ctx)
            .map_err(|err| RenderError::from_minijinja(&self.file, Some(e.line), &prefix, &err))?;
        budget::add_fuel(budget::take_probe().unwrap_or(0)).map_err(at)?;
        Ok(v)
    }
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

/// A stable hash of an object (serde_json maps are ordered, so this is canonical).
pub fn object_hash(object: &Json) -> String {
    let bytes = serde_json::to_vec(object).unwrap_or_default();
    hex::encode(&Sha256::digest(&bytes)[..8])
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
