//! References (`spec.references`): which objects a parent reads but does not own.
//!
//! Pure, like the rest of render: from a parent, the *targets* of its references (a name
//! or a label selector, in a namespace), evaluated within the parent's budget; from the
//! rule alone, how narrowly each referenced kind can be cached ([`cache_filter`]) and
//! the `check` warning for a reference that would cache a whole kind cluster-wide. The
//! reconcile looks the targets up in its caches and puts what it finds in
//! [`Observed::refs`](super::Observed).
//!
//! A namespaced parent's references stay in its own namespace unless the rule names
//! another one literally: the namespace is never computed from what a tenant writes.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use minijinja::value::{Value, ValueKind};
use regex::Regex;
use serde_json::Value as Json;

use super::budget::ParentBudget;
use super::{CompiledRule, Expr, Observed, RenderError, Scope, truncate_display};
use crate::meta::JsonAt;
use crate::rules::{Diagnostic, Reference, is_label_key, is_label_value};

/// How one reference's object is found.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RefSelect {
    Name(String),
    /// `matchLabels`: every object carrying all of them.
    Labels(BTreeMap<String, String>),
}

/// Where one reference of one parent points.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RefTarget {
    /// Index in `spec.references`.
    pub reference: usize,
    /// `None` for a cluster-scoped kind.
    pub namespace: Option<String>,
    pub select: RefSelect,
}

impl RefTarget {
    /// `Secret db-credentials in namespace team-a`, for messages (never values).
    pub fn describe(&self, kind: &str) -> String {
        let what = match &self.select {
            RefSelect::Name(n) => format!("{kind} {n}"),
            RefSelect::Labels(l) => format!(
                "{kind} with labels {}",
                l.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        };
        match &self.namespace {
            Some(ns) => format!("{what} in namespace {ns}"),
            None => what,
        }
    }

    /// Whether an object with these labels is selected (names are compared by the caller).
    pub fn selects_labels(&self, labels: &BTreeMap<String, String>) -> bool {
        match &self.select {
            RefSelect::Name(_) => false,
            RefSelect::Labels(want) => want.iter().all(|(k, v)| labels.get(k) == Some(v)),
        }
    }
}

/// The compiled expressions of one reference.
pub(super) struct RefProgram<'env> {
    pub(super) object_name: Option<Expr<'env>>,
    pub(super) selector: Option<Expr<'env>>,
    /// `namespace` when it is an expression (cluster-scoped parents only).
    pub(super) namespace: Option<Expr<'env>>,
    /// `readyWhen`, over `ref` (what was found): what `waitFor: [refs.<name>]` waits for.
    pub(super) ready_when: Option<Expr<'env>>,
}

/// What Rulebook caches of a referenced kind: the server-side filters of its watch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheFilter {
    /// Watch this namespace only (a literal `namespace`).
    pub namespace: Option<String>,
    /// A label selector (`watchSelector`, or the literal keys of `selector`).
    pub labels: Option<String>,
    /// A field selector (`metadata.name=<literal objectName>`).
    pub fields: Option<String>,
    /// The keys `labels` was derived from, when it was derived from `selector`: every
    /// evaluated selector must contain them, or its objects might not be cached.
    pub derived_keys: Vec<String>,
}

static STRING_LITERAL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"^\s*(?:'([^'\\{}]*)'|"([^"\\{}]*)")\s*$"#).expect("static regex")
});
static DICT_KEY: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?:^\s*\{|,)\s*(?:'([^']+)'|"([^"]+)")\s*:"#).expect("static regex")
});

/// The literal an expression is, when it is only a quoted string.
pub fn string_literal(expr: &str) -> Option<&str> {
    let c = STRING_LITERAL.captures(expr)?;
    c.get(1).or(c.get(2)).map(|m| m.as_str())
}

/// Lower-case letters, digits, `-` and `.`, at most 253: what most kinds' names are.
fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|p| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        })
}

/// The keys of a selector expression written as a dict literal (`{'team': ...}`), when
/// they are all literal label keys.
fn literal_keys(expr: &str) -> Option<Vec<String>> {
    let t = expr.trim();
    if !t.starts_with('{') || !t.ends_with('}') {
        return None;
    }
    let keys: Vec<String> = DICT_KEY
        .captures_iter(t)
        .filter_map(|c| c.get(1).or(c.get(2)).map(|m| m.as_str().to_string()))
        .collect();
    (!keys.is_empty() && keys.iter().all(|k| is_label_key(k))).then_some(keys)
}

/// How narrowly reference `r` can be cached, from the rule alone.
pub fn cache_filter(r: &Reference) -> CacheFilter {
    let mut f = CacheFilter {
        namespace: r
            .literal_namespace()
            .and_then(Result::ok)
            .map(str::to_string),
        ..CacheFilter::default()
    };
    if let Some(sel) = &r.watch_selector {
        f.labels = Some(sel.trim().to_string());
    } else if let Some(keys) = r.selector.as_ref().and_then(|s| literal_keys(s)) {
        f.labels = Some(keys.join(","));
        f.derived_keys = keys;
    }
    // Only a name that can be an object's goes into a field selector (`a,b` would be two
    // terms; the API server refuses the watch, and the rule would never list).
    if let Some(name) = r
        .object_name
        .as_ref()
        .and_then(|n| string_literal(n))
        .filter(|n| is_dns_subdomain(n))
    {
        f.fields = Some(format!("metadata.name={name}"));
    }
    f
}

/// `check`'s warnings: a reference that caches every object of its kind in every
/// namespace (e.g. every Secret), when the parent is not known to be cluster-scoped.
pub fn warnings(rule: &CompiledRule) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    for (i, r) in rule.rule.spec.references.iter().enumerate() {
        let f = cache_filter(r);
        if f.namespace.is_none() && f.labels.is_none() && f.fields.is_none() {
            out.push(Diagnostic::at(
                &rule.file,
                &r.name,
                format!(
                    "warning: rule '{}': spec.references[{i}] ('{}'): Rulebook will cache every {} in the cluster (or in the namespace `run --namespace` names), content included; narrow it with watchSelector, a literal namespace, a literal objectName or a selector written as {{'key': ...}}",
                    rule.name, r.name.value, r.kind.value
                ),
            ));
        }
    }
    out
}

impl CompiledRule {
    /// Where each of `parent`'s references points, in rule order. `scope(i)` says
    /// whether reference `i`'s kind is namespaced.
    pub fn reference_targets(
        &self,
        parent: &Json,
        observed: &Observed,
        scope: &dyn Fn(usize) -> Scope,
        budget: &mut ParentBudget,
    ) -> Result<Vec<RefTarget>, RenderError> {
        let refs = &self.rule.spec.references;
        if refs.is_empty() {
            return Ok(Vec::new());
        }
        let _active = budget.enter();
        let ctx = self.context(parent, observed)?;
        let programs = &self.running().borrow_dependent().references;
        let parent_ns = parent.at(&["metadata", "namespace"]).and_then(Json::as_str);
        let mut out = Vec::with_capacity(refs.len());
        for (i, (r, p)) in refs.iter().zip(programs).enumerate() {
            let namespace = self.reference_namespace(i, r, p, scope(i), parent_ns, &ctx)?;
            let select = self.reference_select(i, r, p, &ctx)?;
            out.push(RefTarget {
                reference: i,
                namespace,
                select,
            });
        }
        Ok(out)
    }

    /// The namespace reference `i` points into: none for a cluster-scoped kind, else
    /// its literal namespace, else (cluster-scoped parents only) its `namespace`
    /// expression, else the parent's namespace.
    fn reference_namespace(
        &self,
        i: usize,
        r: &Reference,
        p: &RefProgram<'_>,
        scope: Scope,
        parent_ns: Option<&str>,
        ctx: &BTreeMap<&'static str, Value>,
    ) -> Result<Option<String>, RenderError> {
        let fail = |line: u64, message: String| self.reference_error(i, line, message);
        Ok(match (scope, r.literal_namespace(), &p.namespace) {
            (Scope::Cluster, ..) => None,
            (Scope::Namespaced, Some(Ok(ns)), _) => Some(ns.to_string()),
            (Scope::Namespaced, _, Some(e)) => {
                if parent_ns.is_some() {
                    return Err(fail(
                        e.line,
                        "namespace: a namespaced parent's reference may name another namespace only literally".into(),
                    ));
                }
                let v = self.eval(e, ctx)?;
                match v.as_str() {
                    Some(ns) if crate::meta::is_dns_label(ns) => Some(ns.to_string()),
                    _ => {
                        return Err(fail(
                            e.line,
                            format!("namespace gives a {}, not a namespace name", v.kind()),
                        ));
                    }
                }
            }
            (Scope::Namespaced, ..) => match parent_ns {
                Some(ns) => Some(ns.to_string()),
                None => {
                    return Err(fail(
                        r.name.line,
                        format!(
                            "{} is namespaced and the parent is not: give the reference a namespace",
                            r.kind.value
                        ),
                    ));
                }
            },
        })
    }

    /// How reference `i`'s object is found: its `objectName`, else its `selector`.
    fn reference_select(
        &self,
        i: usize,
        r: &Reference,
        p: &RefProgram<'_>,
        ctx: &BTreeMap<&'static str, Value>,
    ) -> Result<RefSelect, RenderError> {
        let fail = |line: u64, message: String| self.reference_error(i, line, message);
        if let Some(e) = &p.object_name {
            let v = self.eval(e, ctx)?;
            match v.as_str() {
                Some(n) if !n.is_empty() && super::check_object_name("name", n).is_ok() => {
                    Ok(RefSelect::Name(n.to_string()))
                }
                _ if v.is_undefined() || v.is_none() => Err(fail(
                    e.line,
                    "objectName is undefined for this parent".into(),
                )),
                _ => Err(fail(
                    e.line,
                    format!("objectName gives a {}, not an object name", v.kind()),
                )),
            }
        } else if let Some(e) = &p.selector {
            let v = self.eval(e, ctx)?;
            let labels = match_labels(&v).map_err(|m| fail(e.line, m))?;
            let filter = cache_filter(r);
            if let Some(k) = filter
                .derived_keys
                .iter()
                .find(|k| !labels.contains_key(*k))
            {
                return Err(fail(
                    e.line,
                    format!(
                        "selector has no key '{k}' for this parent (Rulebook caches only objects labelled with every key the selector is written with)"
                    ),
                ));
            }
            Ok(RefSelect::Labels(labels))
        } else {
            Err(fail(
                r.name.line,
                "has neither objectName nor selector".into(),
            ))
        }
    }

    /// An error in `spec.references[i]`, at `line` of the rule file.
    fn reference_error(&self, i: usize, line: u64, message: String) -> RenderError {
        RenderError::new(
            self.file.clone(),
            Some(line),
            format!("rule '{}': spec.references[{i}]: {message}", self.name),
        )
    }
}

/// A selector expression's value as `matchLabels`: a non-empty map of label keys to
/// label values (numbers and booleans are written as text).
fn match_labels(v: &Value) -> Result<BTreeMap<String, String>, String> {
    if v.kind() != ValueKind::Map {
        return Err(format!(
            "selector gives a {}, not a map of labels",
            v.kind()
        ));
    }
    let mut out = BTreeMap::new();
    let keys = v.try_iter().map_err(|e| e.to_string())?;
    for k in keys {
        let key = k.to_string();
        let item = v.get_item(&k).unwrap_or_default();
        let text = match item.kind() {
            ValueKind::String => item.as_str().unwrap_or("").to_string(),
            ValueKind::Number | ValueKind::Bool => item.to_string(),
            _ => {
                return Err(format!(
                    "selector value of '{}' is {}, not a label value",
                    truncate_display(&key, 80),
                    item.kind()
                ));
            }
        };
        if !is_label_key(&key) || !is_label_value(&text) {
            return Err(format!(
                "selector key {} or its value is not a label (keys and values are at most 63 letters, digits, '-', '_', '.')",
                truncate_display(&key, 80)
            ));
        }
        out.insert(key, text);
    }
    if out.is_empty() {
        return Err("selector is empty: it would select every object of the kind".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_and_keys_are_read_from_the_expression_text() {
        assert_eq!(string_literal("'shared'"), Some("shared"));
        assert_eq!(string_literal(" \"a-b\" "), Some("a-b"));
        assert_eq!(string_literal("parent.spec.x"), None);
        assert_eq!(string_literal("'a' ~ parent.x"), None);
        assert_eq!(
            literal_keys("{'team': parent.spec.team, \"app.kubernetes.io/part-of\": 'x'}"),
            Some(vec!["team".into(), "app.kubernetes.io/part-of".into()])
        );
        assert_eq!(literal_keys("parent.spec.labels"), None);
        assert_eq!(literal_keys("{'bad key': 1}"), None);
    }

    #[test]
    fn selectors_must_be_non_empty_label_maps() {
        let v = crate::render::val(&serde_json::json!({"team": "a", "n": 3}));
        assert_eq!(
            match_labels(&v).unwrap(),
            BTreeMap::from([("n".into(), "3".into()), ("team".into(), "a".into())])
        );
        for bad in [
            serde_json::json!({}),
            serde_json::json!({"team": "a b"}),
            serde_json::json!({"team": {"x": 1}}),
            serde_json::json!(["team"]),
        ] {
            assert!(match_labels(&crate::render::val(&bad)).is_err(), "{bad}");
        }
    }
}
