//! Rules: the rule model, loading a rules directory and a templates directory, and
//! validating them as a whole. Pure: reads files, never talks to a cluster.
//!
//! Every problem becomes a [`Diagnostic`] that says `file:line:col: message`, and loading
//! reports all of them at once.

pub mod admission;
mod cel_check;
pub mod crd;
pub mod decorators;
mod links;
mod load;
pub mod model;
pub mod policy;
pub mod rollout;
pub mod versions;
pub mod webhooks;
mod yaml;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use links::{check_references, check_wait_for};
pub use links::{is_label_key, is_label_value, parse_label_selector};
pub use load::{Read, Sources, read};
pub use model::*;
pub use yaml::yaml_message;
use yaml::{parse_document, split_documents};

/// One problem in the rule set, with the place it comes from.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Diagnostic {
    pub file: String,
    pub line: u64,
    pub col: u64,
    pub message: String,
}

impl Diagnostic {
    pub fn new(file: impl Into<String>, line: u64, col: u64, message: impl Into<String>) -> Self {
        Diagnostic {
            file: file.into(),
            line,
            col,
            message: message.into(),
        }
    }

    pub fn at<T>(file: &str, loc: &Loc<T>, message: impl Into<String>) -> Self {
        Diagnostic::new(file, loc.line, loc.col, message)
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match (self.line, self.col) {
            (0, _) => write!(f, "{}: {}", self.file, self.message),
            (l, 0) => write!(f, "{}:{}: {}", self.file, l, self.message),
            (l, c) => write!(f, "{}:{}:{}: {}", self.file, l, c, self.message),
        }
    }
}

/// Every diagnostic of a rule set that failed to load.
#[derive(Debug, Clone, thiserror::Error)]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

/// A rule as read from disk, before compiling.
#[derive(Clone, Debug)]
pub struct SourcedRule {
    /// The rule file, as given (relative to the working directory when the directory was).
    pub file: String,
    pub rule: Rule,
}

/// Parses and validates a rule set already in memory: the rules that are valid on their
/// own, and every problem found (in any rule). Compiling them is the render layer's.
pub fn parse_and_validate(sources: &Sources) -> (Vec<SourcedRule>, Vec<Diagnostic>) {
    let mut diags = Vec::new();
    let mut parsed = Vec::new();
    for (file, text) in &sources.rule_files {
        // The good documents of a file with a broken one are still checked.
        let (rules, mut d) = parse_documents(file, text);
        parsed.extend(rules);
        diags.append(&mut d);
    }
    // Names are unique across the set.
    let mut names: BTreeMap<&str, &SourcedRule> = BTreeMap::new();
    for sr in &parsed {
        let name = &sr.rule.metadata.name;
        if let Some(first) = names.get(name.as_str()) {
            diags.push(Diagnostic::at(
                &sr.file,
                name,
                format!(
                    "rule '{}': metadata.name is already used by {}:{}",
                    name.value, first.file, first.rule.metadata.name.line
                ),
            ));
        } else {
            names.insert(name, sr);
        }
    }
    // Several rules may take one parent kind; some keys only one of them may have.
    decorators::check_kinds(&parsed, &mut diags);
    let mut valid = Vec::new();
    for sr in parsed {
        let before = diags.len();
        validate_rule(&sr, &mut diags);
        if diags.len() == before {
            valid.push(sr);
        }
    }
    (valid, diags)
}

/// Splits a YAML stream into documents and reads each as a rule. A document that is
/// empty (comments only) is skipped. Line numbers stay those of the whole file.
pub fn parse_file(file: &str, text: &str) -> Result<Vec<SourcedRule>, Vec<Diagnostic>> {
    let (rules, diags) = parse_documents(file, text);
    if diags.is_empty() {
        Ok(rules)
    } else {
        Err(diags)
    }
}

/// The rules of the documents that parse, and a diagnostic for each that does not.
fn parse_documents(file: &str, text: &str) -> (Vec<SourcedRule>, Vec<Diagnostic>) {
    let mut rules = Vec::new();
    let mut diags = Vec::new();
    for doc in split_documents(text) {
        if doc
            .lines()
            .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
        {
            continue;
        }
        match parse_document::<Rule>(&doc) {
            Ok(rule) => rules.push(SourcedRule {
                file: file.to_string(),
                rule,
            }),
            Err((line, col, message)) => diags.push(Diagnostic::new(file, line, col, message)),
        }
    }
    (rules, diags)
}

/// Structural checks of one rule that need no templates.
/// Adoption of a cluster-scoped object takes over something no tenant's namespace holds
/// (an admin's Namespace with its content, a ClusterRole): only with `adoptUnsafe: true`.
/// Kinds whose scope only discovery knows are refused at run time instead.
fn check_adoption(r: &Rule, err: &mut impl FnMut((u64, u64), &str, String)) {
    for (i, c) in r.spec.children.iter().enumerate() {
        if c.adopt
            && !c.adopt_unsafe
            && crate::meta::is_cluster_scoped_builtin(&c.api_version.value, &c.kind.value)
        {
            err(
                (c.name.line, c.name.col),
                &format!("spec.children[{i}].adopt"),
                format!(
                    "{} is cluster-scoped: adopting one takes over an object outside any \
                     tenant's namespace (with its content, for a Namespace); set \
                     `adoptUnsafe: true` on child '{}' if whoever writes the parent may \
                     choose it",
                    c.kind.value, c.name.value
                ),
            );
        }
        if c.adopt_unsafe && !c.adopt {
            err(
                (c.name.line, c.name.col),
                &format!("spec.children[{i}].adoptUnsafe"),
                "has no effect without `adopt: true`".into(),
            );
        }
    }
}

fn validate_rule(sr: &SourcedRule, diags: &mut Vec<Diagnostic>) {
    let file = sr.file.as_str();
    let r = &sr.rule;
    let name = r.metadata.name.as_str();
    let mut err = |loc: (u64, u64), key: &str, msg: String| {
        diags.push(Diagnostic::new(
            file,
            loc.0,
            loc.1,
            format!("rule '{name}': {key}: {msg}"),
        ))
    };
    let at = |l: &Loc<String>| (l.line, l.col);
    if r.api_version.as_str() != API_VERSION {
        err(
            at(&r.api_version),
            "apiVersion",
            format!("must be {API_VERSION}, not '{}'", r.api_version.value),
        );
    }
    if r.kind.as_str() != KIND {
        err(
            at(&r.kind),
            "kind",
            format!("must be {KIND}, not '{}'", r.kind.value),
        );
    }
    if !is_dns_label(name) {
        err(
            at(&r.metadata.name),
            "metadata.name",
            "must be a DNS label: lower-case letters, digits and '-', at most 63 characters".into(),
        );
    }
    check_kind_ref(&r.spec.parent, "spec.parent", &mut err);
    decorators::check_selector(r, &mut err);
    check_children(r, &mut err);
    check_wait_for(r, &mut err);
    check_adoption(r, &mut err);
    check_references(r, &mut err);
    check_status(r, &mut err);
    check_crd(r, &mut err);
    versions::check_versions(r, &mut err);
    webhooks::check_failure_policy(r, &mut err);
    admission::check_admission(r, &mut err);
    cel_check::check_cel(r, &mut err);
    if let Some(resync) = &r.spec.resync
        && let Err(e) = parse_duration(resync)
    {
        err(at(resync), "spec.resync", e.to_string());
    }
    check_finalize(r, &mut err);
    rollout::check_rollout(r, &mut err);
    if let Some(sa) = &r.spec.service_account
        && !crate::meta::is_dns_subdomain(&sa.value)
    {
        err(
            at(sa),
            "spec.serviceAccount",
            format!(
                "'{}' is not a ServiceAccount name (a DNS-1123 subdomain: lower-case letters, digits, '-' and '.', at most 253 characters, each part starting and ending with a letter or digit)",
                sa.value.escape_default()
            ),
        );
    }
}

/// Each child's name, kind, apiVersion (one per kind) and template path.
fn check_children(r: &Rule, err: &mut impl FnMut((u64, u64), &str, String)) {
    let at = |l: &Loc<String>| (l.line, l.col);
    let mut seen = BTreeSet::new();
    // (group, kind) → the first child's index and apiVersion: two versions of one kind
    // are the same objects, and two caches of them would each prune the other's.
    let mut versions: BTreeMap<(&str, &str), (usize, &str)> = BTreeMap::new();
    for (i, c) in r.spec.children.iter().enumerate() {
        let key = format!("spec.children[{i}]");
        let group = split_api_version(&c.api_version.value).0;
        match versions.get(&(group, c.kind.as_str())) {
            Some((first, v)) if *v != c.api_version.as_str() => err(
                at(&c.api_version),
                &format!("{key}.apiVersion"),
                format!(
                    "{} {} is {} in spec.children[{first}]: the children of one kind use one apiVersion (two versions of a kind are the same objects)",
                    c.api_version.value, c.kind.value, v
                ),
            ),
            Some(_) => {}
            None => {
                versions.insert((group, c.kind.as_str()), (i, c.api_version.as_str()));
            }
        }
        if !is_identifier(&c.name) {
            err(
                at(&c.name),
                &format!("{key}.name"),
                format!(
                    "'{}' is not an identifier ([a-zA-Z_][a-zA-Z0-9_]*, usable as children.<name>)",
                    c.name.value
                ),
            );
        } else if !seen.insert(c.name.as_str()) {
            err(
                at(&c.name),
                &format!("{key}.name"),
                format!("'{}' is used by another child of this rule", c.name.value),
            );
        }
        check_kind_ref(
            &KindRef {
                api_version: c.api_version.clone(),
                kind: c.kind.clone(),
                selector: None,
            },
            &key,
            err,
        );
        let t = c.template.as_str();
        if t.is_empty()
            || t.starts_with('/')
            || t.split(['/', '\\']).any(|p| p == ".." || p.is_empty())
        {
            err(
                at(&c.template),
                &format!("{key}.template"),
                format!(
                    "'{t}' must be a relative path inside the templates directory, without '..'"
                ),
            );
        }
    }
}

/// Status keys: JSON field names, and none that Rulebook writes itself.
fn check_status(r: &Rule, err: &mut impl FnMut((u64, u64), &str, String)) {
    for (field, v) in &r.spec.status {
        if !is_status_key(field) {
            err(
                (v.line, v.col),
                &format!("spec.status.{field}"),
                "a status key is a JSON field name ([a-zA-Z_][a-zA-Z0-9_]*)".into(),
            );
        }
        if matches!(field.as_str(), "conditions" | "observedGeneration")
            || field == crate::meta::STATUS_RULE_VERSION
        {
            err(
                (v.line, v.col),
                &format!("spec.status.{field}"),
                "is written by Rulebook itself".into(),
            );
        }
    }
}

/// The CRD section, each problem at the key it comes from.
fn check_crd(r: &Rule, err: &mut impl FnMut((u64, u64), &str, String)) {
    for (key, msg) in crd::validate(r) {
        let at = r
            .spec
            .crd
            .as_ref()
            .and_then(|c| match key.as_str() {
                "spec.crd.specSchema" => c.spec_schema.as_ref().map(|s| (s.line, s.col)),
                "spec.crd.statusSchema" => c.status_schema.as_ref().map(|s| (s.line, s.col)),
                "spec.crd.scope" => c.scope.as_ref().map(|s| (s.line, s.col)),
                "spec.crd.plural" => c.plural.as_ref().map(|s| (s.line, s.col)),
                _ => None,
            })
            .or_else(|| {
                key.strip_prefix("spec.status.")
                    .and_then(|f| r.spec.status.get(f))
                    .map(|v| (v.line, v.col))
            })
            .unwrap_or((r.spec.parent.kind.line, r.spec.parent.kind.col));
        err(at, &key, msg);
    }
}

/// The finalize child: one of the rule's children, one object, rendered from the parent
/// alone; and its timeout.
fn check_finalize(r: &Rule, err: &mut impl FnMut((u64, u64), &str, String)) {
    let at = |l: &Loc<String>| (l.line, l.col);
    if let Some(f) = r.spec.deletion.as_ref().and_then(|d| d.finalize.as_ref()) {
        match r
            .spec
            .children
            .iter()
            .find(|c| c.name.value == f.child.value)
        {
            None => err(
                at(&f.child),
                "spec.deletion.finalize.child",
                format!(
                    "'{}' is not a child of this rule (name one of spec.children)",
                    f.child.value
                ),
            ),
            Some(c) if c.for_each.is_some() => err(
                at(&f.child),
                "spec.deletion.finalize.child",
                format!(
                    "child '{}' has forEach; a finalize child is one object",
                    c.name.value
                ),
            ),
            Some(c) if !c.wait_for.is_empty() => err(
                at(&f.child),
                "spec.deletion.finalize.child",
                format!(
                    "child '{}' has waitFor; a finalize child is rendered once, from the parent alone",
                    c.name.value
                ),
            ),
            Some(_) => {}
        }
        if let Some(t) = &f.timeout
            && let Err(e) = parse_duration(t)
        {
            err(at(t), "spec.deletion.finalize.timeout", e.to_string());
        }
    }
}

pub(crate) fn check_kind_ref(
    k: &KindRef,
    key: &str,
    err: &mut impl FnMut((u64, u64), &str, String),
) {
    let av = k.api_version.as_str();
    let (g, v) = split_api_version(av);
    let ok_group = g.is_empty() || g.split('.').all(is_dns_label);
    if av.is_empty() || !ok_group || !is_dns_label(v) || av.matches('/').count() > 1 {
        err(
            (k.api_version.line, k.api_version.col),
            &format!("{key}.apiVersion"),
            format!("'{av}' is not an apiVersion (group/version, or v1)"),
        );
    }
    let kind = k.kind.as_str();
    if kind.is_empty()
        || !kind.starts_with(|c: char| c.is_ascii_uppercase())
        || !kind.chars().all(|c| c.is_ascii_alphanumeric())
    {
        err(
            (k.kind.line, k.kind.col),
            &format!("{key}.kind"),
            format!("'{kind}' is not a kind (CamelCase, letters and digits)"),
        );
    }
}

pub use crate::meta::is_dns_label;

pub fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn is_status_key(s: &str) -> bool {
    is_identifier(s)
}

/// Why a duration does not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("'{0}' is not a duration like 30s, 10m or 1h30m")]
    Malformed(String),
    #[error("'{0}' is shorter than the minimum of 1s")]
    TooShort(String),
    #[error("'{0}' is longer than the maximum of 87600h (ten years)")]
    TooLong(String),
}

/// The longest duration a rule or flag may give: ten years (a webhook CA lives three by
/// default). Deadlines are computed as `Instant + duration`, which panics past the
/// clock's range; a duration of terms summed up to `Duration::MAX`
/// (`4000000000h4000000000h…`) would get there.
pub const MAX_DURATION: Duration = Duration::from_secs(87600 * 3600);

/// `30s`, `10m`, `1h30m`, `2h`, `500ms`; at least one second, at most ten years
/// ([`MAX_DURATION`]).
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let shown = || match s.char_indices().nth(40) {
        Some((end, _)) => format!("{}…", &s[..end]),
        None => s.to_string(),
    };
    let bad = || DurationError::Malformed(shown());
    let mut total = Duration::ZERO;
    let mut num = String::new();
    let mut chars = s.trim().chars().peekable();
    let mut any = false;
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let n: u64 = num.parse().map_err(|_| bad())?;
        num.clear();
        let unit = match (c, chars.peek()) {
            ('m', Some('s')) => {
                chars.next();
                Duration::from_millis(1)
            }
            ('s', _) => Duration::from_secs(1),
            ('m', _) => Duration::from_secs(60),
            ('h', _) => Duration::from_secs(3600),
            _ => return Err(bad()),
        };
        total = unit
            .checked_mul(u32::try_from(n).map_err(|_| bad())?)
            .and_then(|d| total.checked_add(d))
            .ok_or_else(bad)?;
        any = true;
    }
    if !num.is_empty() || !any {
        return Err(bad());
    }
    if total < Duration::from_secs(1) {
        return Err(DurationError::TooShort(shown()));
    }
    if total > MAX_DURATION {
        return Err(DurationError::TooLong(shown()));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("5x").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("100ms").is_err());
        assert_eq!(parse_duration("87600h"), Ok(MAX_DURATION));
        assert!(matches!(
            parse_duration("87601h"),
            Err(DurationError::TooLong(_))
        ));
        // Terms summed past ten years (once up to `Duration::MAX`, which overflowed the
        // deadlines computed from it), and the message shows 40 characters of it.
        let huge = "4000000000h".repeat(1000);
        match parse_duration(&huge) {
            Err(DurationError::TooLong(shown)) => assert!(shown.chars().count() <= 41, "{shown}"),
            other => panic!("{other:?}"),
        }
    }

    /// `spec.serviceAccount` must be a ServiceAccount name: the error names the file and
    /// the line of the key's value; a good name loads.
    #[test]
    fn a_service_account_is_a_dns_subdomain() {
        let rule = |sa: &str| {
            format!(
                "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: r\nspec:\n  parent:\n    apiVersion: v1\n    kind: ConfigMap\n  serviceAccount: {sa}\n"
            )
        };
        let diags = |sa: &str| {
            let sources = Sources {
                default_rollout: None,
                rule_files: vec![("r.yaml".into(), rule(sa))],
                templates: BTreeMap::new(),
            };
            parse_and_validate(&sources).1
        };
        assert_eq!(diags("rule-low.team"), vec![]);
        for bad in ["Low", "'-low'", "'low-'", "'a..b'", "'a_b'", "\"\""] {
            let d = diags(bad);
            assert_eq!(d.len(), 1, "{bad}: {d:?}");
            assert_eq!((d[0].file.as_str(), d[0].line), ("r.yaml", 9), "{bad}");
            assert!(
                d[0].message.contains("spec.serviceAccount"),
                "{bad}: {}",
                d[0].message
            );
        }
    }
}
