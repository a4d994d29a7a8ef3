//! Render: from a rule and a parent to the desired children, and from the parent and its
//! live children to the parent's status. Pure and deterministic; no cluster.
//!
//! A rule is compiled once ([`CompiledRule::compile`]): its templates, expressions and
//! JSONPaths are parsed at load, never per call. Rendering a parent
//! ([`CompiledRule::render_within`], `children.rs`) and evaluating its status
//! ([`CompiledRule::status_within`], `status_eval.rs`) spend from one [`ParentBudget`].

pub mod admission;
mod admission_names;
pub mod adopt;
pub mod budget;
mod children;
mod compile;
mod compile_exprs;
mod convert;
pub mod deps;
mod diags;
mod env;
mod error;
mod fastyaml;
mod funcs;
mod guarded;
mod limits;
pub mod mentions;
mod names;
mod ready;
pub mod refs;
pub mod role_refs;
pub mod rollout;
mod secrets;
pub mod selector;
mod set;
mod slice;
pub mod status;
mod status_eval;
pub mod targets;
#[cfg(test)]
mod testkit;
pub mod unwaited;

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
pub use children::{Rendered, check_object_name};
pub use env::{json_scalar, yaml_safe};
pub use error::{FailureReason, RenderError, describe};
pub use limits::Limits;
pub use refs::{CacheFilter, RefSelect, RefTarget, cache_filter};
pub use set::{RuleSet, compile, compile_read, load};
pub use slice::{SLICE_FUEL, SLICE_INPUT, SLICE_OUTPUT, SLICE_TIME, weighs_at_most};
pub use status::{Condition, Readiness, StatusReport};

use crate::meta::JsonAt;
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
        /// The one part of the document the path starts in (`parent`, `children`,
        /// `refs`), when it says so plainly; `None`: it may read any.
        root: Option<&'static str>,
        /// It has a descendant segment (`..`): its cost grows with the document's depth
        /// times its keys' lengths ([`status_eval::descendant_path_bytes`]).
        descends: bool,
        /// `allOf: true`: the list only when every element resolves.
        all_of: Option<AllOf>,
    },
    Expr(Expr<'env>),
    Value(Json),
    Cases(Vec<(Option<Expr<'env>>, CaseResult<'env>)>),
}

/// A status JSONPath with `allOf: true`, split at its one list segment
/// (`status_eval::split_all_of`).
struct AllOf {
    /// The path up to and including its list segment: the elements.
    elements: JpQuery,
    /// The rest of the path, from each element: singular.
    each: JpQuery,
    /// The child the path starts in (`$.children.<name>...`): every object the render
    /// wants of it must be live, or the list is not complete.
    child: Option<usize>,
}

enum CaseResult<'env> {
    Value(Json),
    Expr(Expr<'env>),
    Unset,
}

struct Programs<'env> {
    /// `spec.parent.selector.expr`.
    selector: Option<Expr<'env>>,
    children: Vec<ChildProgram<'env>>,
    references: Vec<refs::RefProgram<'env>>,
    /// `spec.deletion.finalize.doneWhen`.
    done_when: Option<Expr<'env>>,
    status: Vec<(String, StatusProgram<'env>)>,
    /// `spec.admission`'s `expr:` checks and defaults.
    admission: admission::AdmissionPrograms<'env>,
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
    /// The same programs in an environment whose fuel per evaluation is
    /// [`slice::SLICE_FUEL`]: a first attempt on the async runtime runs in it
    /// (`slice.rs`).
    slice: Option<Compiled>,
    /// Whether every template and expression is straight-line code, which a slice can
    /// bound (`slice.rs`): only such a rule gets its slice environment.
    straight_line: bool,
    limits: Limits,
    /// Whether templates or expressions call `ready(...)`, or a child has `waitFor`: then
    /// the live children's readiness is computed before anything else is evaluated.
    uses_ready: bool,
    /// Whether a template or expression names `children` (else contexts leave them out).
    reads_children: bool,
    /// What each child waits for: its `waitFor` and the siblings it reads (`deps.rs`).
    depends_on: deps::DependsOn,
    /// The references each child waits for (`waitFor: [refs.<name>]`, `deps::ref_waits`),
    /// as positions in `spec.references`.
    ref_waits: Vec<Vec<usize>>,
    /// Whether a template or expression may read the parent's `status`.
    reads_parent_status: bool,
    /// `rule` in templates and expressions: its name and version.
    rule_value: Value,
    /// The messages of `spec.admission`'s `expr:` checks, compiled in an environment
    /// that prints text (admission.rs).
    messages: Environment<'static>,
    /// `spec.rollout`'s expressions (rollout.rs), when the rule has one.
    pub rollout: Option<Arc<rollout::RolloutProgram>>,
    /// Template name → source, for every template the rule uses: what a rollout keeps
    /// in the cluster to render this version again after a restart.
    pub template_sources: Arc<BTreeMap<String, String>>,
    /// The roles each RoleBinding/ClusterRoleBinding child may bind, by child name, read
    /// once at compile (`role_refs.rs`); a rendered `roleRef` outside its set is refused.
    pub(crate) bindable: BTreeMap<String, BTreeSet<role_refs::RoleName>>,
    /// What the rule does among the rules of its parent kind (set by the rule set:
    /// `rules::decorators`); a rule compiled alone is its kind's only one.
    pub role: crate::rules::decorators::KindRole,
    /// The other rules of its parent kind (set by the rule set:
    /// `rules::decorators::peers`): whose children it never applies over.
    pub peers: Vec<String>,
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
const CONTEXT_VARS: &[&str] = &["parent", "children", "refs", "rule", "ready"];

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
            .at(&["metadata", "name"])
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

/// The live children of one parent, by child name, each list ordered by `forEach` index;
/// and the objects its references found, by reference name (an object, or a list for a
/// `selector`; absent when an optional object is missing).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observed {
    pub children: BTreeMap<String, Vec<Json>>,
    pub refs: BTreeMap<String, Json>,
}

impl Observed {
    /// Groups live objects by their `rulebook.dev/child` label, ordered by index then name.
    /// Their `metadata.managedFields` is dropped: rules never see it (docs/rules.md).
    pub fn from_objects(objects: impl IntoIterator<Item = Json>) -> Observed {
        let mut children: BTreeMap<String, Vec<Json>> = BTreeMap::new();
        for mut o in objects {
            if let Some(Json::Object(meta)) = o.get_mut("metadata") {
                meta.remove("managedFields");
            }
            let Some(name) = o
                .at(&["metadata", "labels"])
                .and_then(|l| l.get(labels::CHILD))
                .and_then(Json::as_str)
            else {
                continue;
            };
            children.entry(name.to_string()).or_default().push(o);
        }
        let refs = BTreeMap::new();
        for list in children.values_mut() {
            list.sort_by_key(|o| {
                let idx = o
                    .at(&["metadata", "annotations"])
                    .and_then(|a| a.get(labels::INDEX))
                    .and_then(Json::as_str)
                    .and_then(|s| s.parse::<usize>().ok())
                    .unwrap_or(usize::MAX);
                let name = o
                    .at(&["metadata", "name"])
                    .and_then(Json::as_str)
                    .unwrap_or("")
                    .to_string();
                (idx, name)
            });
        }
        Observed { children, refs }
    }

    /// Every object observed: the references and the children.
    pub fn objects(&self) -> impl Iterator<Item = &Json> {
        self.refs
            .values()
            .flat_map(|o| match o {
                Json::Array(list) => list.iter(),
                o => std::slice::from_ref(o).iter(),
            })
            .chain(self.children.values().flatten())
    }

    /// The values of every Secret among the references and children, as
    /// [`secret_values_in`] lists them.
    pub fn secret_values(&self) -> Vec<String> {
        secret_values_in(self.objects())
    }

    /// [`Observed::secret_values`], and those of the children about to be written (a
    /// refusal of one child may quote a value that only another, not yet written, holds).
    pub fn secret_values_with(&self, desired: &[DesiredChild]) -> Vec<String> {
        secret_values_in(self.objects().chain(desired.iter().map(|d| &d.object)))
    }
}

pub use secrets::{MIN_REDACTED, redact, secret_values_in};

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
        let s = |p: &[&str]| parent.at(p).and_then(Json::as_str);
        ParentInfo {
            api_version: s(&["apiVersion"]).unwrap_or(""),
            kind: s(&["kind"]).unwrap_or(""),
            name: s(&["metadata", "name"]).unwrap_or(""),
            namespace: s(&["metadata", "namespace"]),
            uid: s(&["metadata", "uid"]).unwrap_or(""),
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
static REFS_REF: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?:^|[^A-Za-z0-9_.])refs\s*(?:\.\s*|\[\s*["'])([A-Za-z_][A-Za-z0-9_]*)"#)
        .expect("static regex")
});
static JSONPATH_REFS_REF: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"^\$\s*(?:\.\s*refs|\[\s*['"]refs['"]\s*\])\s*(?:\.\s*|\[\s*['"])([A-Za-z_][A-Za-z0-9_]*)"#)
        .expect("static regex")
});
/// A call of the `ready(...)` helper.
static READY_CALL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?:^|[^A-Za-z0-9_.])ready\s*\(").expect("static regex"));
/// The part of the status document a JSONPath starts in: `$.parent…`, `$['refs']…`.
static JSONPATH_ROOT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r#"^\$\s*(?:\.\s*(parent|children|refs)\b|\[\s*['"](parent|children|refs)['"]\s*\])"#,
    )
    .expect("static regex")
});

/// A query with only name and index selectors selects at most one node (RFC 9535 §2.3.5.1).
pub(super) fn is_singular(q: &JpQuery) -> bool {
    use jsonpath_rust::parser::model::{Segment, Selector};
    q.segments.iter().all(|s| match s {
        Segment::Selector(sel) => matches!(sel, Selector::Name(_) | Selector::Index(_)),
        Segment::Selectors(sels) => {
            sels.len() == 1 && matches!(sels[0], Selector::Name(_) | Selector::Index(_))
        }
        Segment::Descendant(_) => false,
    })
}

/// Which part of the status document `path` reads, when it names one.
fn jsonpath_root(path: &str) -> Option<&'static str> {
    let m = JSONPATH_ROOT.captures(path)?;
    match m.get(1).or_else(|| m.get(2))?.as_str() {
        "parent" => Some("parent"),
        "children" => Some("children"),
        "refs" => Some("refs"),
        _ => None,
    }
}

static JSONPATH_CHILD_REF: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"^\$\s*(?:\.\s*children|\[\s*['"]children['"]\s*\])\s*(?:\.\s*|\[\s*['"])([A-Za-z_][A-Za-z0-9_]*)"#)
        .expect("static regex")
});

impl CompiledRule {
    pub fn children(&self) -> &[ChildRule] {
        &self.rule.spec.children
    }

    /// Child `i`'s template: its display path and its text (for a schema problem's
    /// `file:line`, openapi::lines).
    pub fn child_template(&self, i: usize) -> Option<(String, String)> {
        let name = self.children().get(i)?.template.value.as_str();
        let env = self.running().borrow_owner();
        let source = env.get_template(name).ok()?.source().to_string();
        let path = self
            .template_files
            .get(name)
            .cloned()
            .unwrap_or_else(|| name.to_string());
        Some((path, source))
    }

    /// The template context: `parent`, `children` (live, by name), `refs`, `rule`, and
    /// `ready(...)` when the rule uses it. Evaluates `readyWhen` of the live children
    /// when the rule needs their readiness, so it runs within an active budget.
    fn context(
        &self,
        parent: &Json,
        observed: &Observed,
    ) -> Result<BTreeMap<&'static str, Value>, RenderError> {
        Ok(self.context_and_readiness(parent, observed)?.0)
    }

    /// [`context`](Self::context), and the readiness of each live child object
    /// (empty when the rule does not use it).
    fn context_and_readiness(
        &self,
        parent: &Json,
        observed: &Observed,
    ) -> Result<(BTreeMap<&'static str, Value>, ready::LiveReadiness), RenderError> {
        let mut children = BTreeMap::new();
        let read = if self.reads_children {
            self.rule.spec.children.as_slice()
        } else {
            &[]
        };
        for (i, c) in read.iter().enumerate() {
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
        ctx.insert("refs", val(&observed.refs));
        ctx.insert("rule", self.rule_value.clone());
        if !self.uses_ready {
            return Ok((ctx, ready::LiveReadiness::default()));
        }
        let readiness = self.live_readiness(&ctx, observed)?;
        ctx.insert("ready", readiness.function());
        Ok((ctx, readiness))
    }

    /// How long the finalize step waits for `doneWhen` (default 10 minutes).
    pub fn finalize_timeout(&self) -> Duration {
        self.rule
            .spec
            .deletion
            .as_ref()
            .and_then(|d| d.finalize.as_ref())
            .and_then(|f| f.timeout.as_ref())
            .and_then(|t| parse_duration(t).ok())
            .unwrap_or(Duration::from_secs(600))
    }

    /// For each child, the positions in `spec.children` of the children it waits for:
    /// those its `waitFor` names and those it reads (`deps.rs`).
    pub fn wait_for_positions(&self) -> Vec<Vec<usize>> {
        self.depends_on
            .iter()
            .map(|d| d.keys().copied().collect())
            .collect()
    }

    /// For each child, what it waits for and why (`waitFor`, or a read at `file:line`).
    pub fn dependencies(&self) -> &[BTreeMap<usize, deps::Why>] {
        &self.depends_on
    }

    /// For each child, the references it waits for (`waitFor: [refs.<name>]`), by name.
    pub fn reference_waits(&self) -> Vec<Vec<&str>> {
        let refs = &self.rule.spec.references;
        self.ref_waits
            .iter()
            .map(|w| {
                w.iter()
                    .filter_map(|&j| refs.get(j))
                    .map(|r| r.name.as_str())
                    .collect()
            })
            .collect()
    }

    /// The order children are created in ([`deps::order`]), as positions.
    pub fn creation_order(&self) -> Vec<usize> {
        deps::order(&self.wait_for_positions())
    }

    /// The bounds this rule renders within.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Whether a template or expression may read the parent's `status`.
    pub fn reads_parent_status(&self) -> bool {
        self.reads_parent_status
    }

    /// Whether what a reconcile computes may depend on its own writes: a template or
    /// expression names `children`, readiness (`ready()`, `waitFor`) decides what is
    /// rendered, or a template or expression may read the parent's `status` (which the
    /// status write changes).
    pub fn depends_on_own_writes(&self) -> bool {
        self.reads_children || self.uses_ready || self.reads_parent_status
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

/// A stable hash of an object (serde_json maps are ordered, so this is canonical).
pub fn object_hash(object: &Json) -> String {
    // The JSON text goes straight into the hash, never into a buffer of its own.
    struct HashSink(Sha256);
    impl std::io::Write for HashSink {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.update(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut h = HashSink(Sha256::new());
    // Writing a `Value` into a sink that never fails cannot fail.
    let _ = serde_json::to_writer(&mut h, object);
    hex::encode(&h.0.finalize()[..8])
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_object_hash_is_the_sha256_of_the_json_text() {
        // Children carry this hash: it must not change with how it is computed.
        let o = serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "a", "labels": {"x": "\u{e9}\"q"}}, "data": {"n": 1.5}});
        let text = serde_json::to_vec(&o).unwrap();
        assert_eq!(object_hash(&o), hex::encode(&Sha256::digest(&text)[..8]));
        assert_eq!(object_hash(&o).len(), 16);
    }
}
