//! The order of a rule's children: what each one waits for, spelled (`waitFor`) or
//! inferred from what it reads. A child whose template (or a template it includes
//! statically), `includeWhen`, `forEach` or `readyWhen` reads `children.<name>` of a
//! sibling waits for that sibling exactly as `waitFor: [<name>]` makes it: it is not
//! created until the sibling is live and ready, it is left out when the sibling is left
//! out by its `includeWhen`, and a live one is held as it is while the sibling is gone
//! (`ready.rs` decides each child's state per parent).
//!
//! The reads are found with minijinja's own analysis of each template and expression
//! (`undeclared_variables(true)` gives every `children.<name>...` chain of attribute
//! lookups that is not shadowed by a `set` or loop variable), and `children["<name>"]`
//! subscripts by a pattern over the source with its comments dropped. A child reading
//! itself (to keep a value it generated) is no dependency. A cycle is a `check` error at
//! the read (or `waitFor` entry) that closes it.
//!
//! A `waitFor` entry `refs.<name>` waits for a reference instead ([`ref_waits`]): the
//! child is rendered only while the reference passes its own `readyWhen`, and held as
//! it is meanwhile (`ready.rs`). References take no part in the order or in cycles.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::LazyLock;

use minijinja::Environment;
use regex::Regex;

use super::INCLUDE;
use super::diags::{Diags, line_of};
use crate::rules::{Diagnostic, Rule};

/// `children["name"]` or `children['name']`.
static SUBSCRIPT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r#"(?:^|[^A-Za-z0-9_.])children\s*\[\s*["']([A-Za-z_][A-Za-z0-9_]*)["']\s*\]"#)
        .expect("static regex")
});
static COMMENT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?s)\{#.*?#\}").expect("static regex"));

/// Why a child waits for a sibling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Why {
    /// Its `waitFor` names it.
    WaitFor { line: u64, col: u64 },
    /// A template or expression reads `children.<name>`, at `file:line`.
    Reads { file: String, line: u64 },
}

impl Why {
    /// `waitFor` or `reads children.<name> at file:line`, for `check` and messages.
    pub fn describe(&self, on: &str) -> String {
        match self {
            Why::WaitFor { .. } => "waitFor".to_string(),
            Why::Reads { file, line } => format!("reads children.{on} at {file}:{line}"),
        }
    }
}

/// Each child's dependencies: position in `spec.children` → why (the first reason found;
/// `waitFor` first).
pub(super) type DependsOn = Vec<BTreeMap<usize, Why>>;

/// The names of the children `text` reads by subscript (comments dropped), with the
/// offset of each.
fn subscripts(text: &str) -> Vec<(usize, String)> {
    let text = COMMENT.replace_all(text, |c: &regex::Captures<'_>| {
        // Keep offsets (and so lines) where they were: one space per byte, not per
        // character, or a comment with `é` or `—` would shift every later offset off the
        // original text (into the middle of a character, once).
        c[0].bytes()
            .map(|b| if b == b'\n' { '\n' } else { ' ' })
            .collect::<String>()
    });
    SUBSCRIPT
        .captures_iter(&text)
        .filter_map(|m| Some((m.get(0)?.start(), m.get(1)?.as_str().to_string())))
        .collect()
}

/// The children named by `children.<name>...` in minijinja's nested undeclared
/// variables `vars`.
fn dotted(vars: &std::collections::HashSet<String>) -> BTreeSet<String> {
    vars.iter()
        .filter_map(|v| v.strip_prefix("children."))
        .map(|rest| rest.split('.').next().unwrap_or(rest).to_string())
        .collect()
}

/// The offset of the first read of `children.<name>` in `source` (dotted or subscript).
fn first_read(source: &str, name: &str) -> Option<usize> {
    let re = Regex::new(&format!(
        r#"children\s*(?:\.\s*{n}\b|\[\s*["']{n}["'])"#,
        n = regex::escape(name)
    ))
    .ok()?;
    re.find(source).map(|m| m.start())
}

/// What each child reads of its siblings, and its `waitFor`: the effective dependencies.
/// `templates`: name → (display path, source). The finalize child reads no siblings (it
/// is rendered from the parent alone) and is given none.
pub(super) fn depends_on(
    env: &Environment<'static>,
    rule: &Rule,
    templates: &BTreeMap<String, (String, String)>,
) -> DependsOn {
    let children = &rule.spec.children;
    let index: BTreeMap<&str, usize> = children
        .iter()
        .enumerate()
        .map(|(i, c)| (c.name.as_str(), i))
        .collect();
    let finalize = rule.spec.finalize_child();
    let mut out: DependsOn = vec![BTreeMap::new(); children.len()];
    for (i, c) in children.iter().enumerate() {
        let deps = &mut out[i];
        for w in &c.wait_for {
            if let Some(&j) = index.get(w.as_str())
                && j != i
            {
                deps.entry(j).or_insert(Why::WaitFor {
                    line: w.line,
                    col: w.col,
                });
            }
        }
        if finalize == Some(i) {
            continue;
        }
        let mut add = |name: &str, file: &str, line: u64| {
            if let Some(&j) = index.get(name)
                && j != i
            {
                deps.entry(j).or_insert_with(|| Why::Reads {
                    file: file.to_string(),
                    line,
                });
            }
        };
        // The template and what it includes by name.
        let mut queue = vec![c.template.value.clone()];
        let mut seen = BTreeSet::new();
        while let Some(t) = queue.pop() {
            if !seen.insert(t.clone()) {
                continue;
            }
            let (Ok(tmpl), Some((path, source))) = (env.get_template(&t), templates.get(&t)) else {
                continue;
            };
            let mut names: Vec<(usize, String)> = dotted(&tmpl.undeclared_variables(true))
                .into_iter()
                .map(|n| (first_read(source, &n).unwrap_or(0), n))
                .collect();
            names.extend(subscripts(source));
            names.sort();
            for (offset, n) in names {
                add(&n, path, line_of(source, offset));
            }
            for m in INCLUDE.captures_iter(source) {
                if let Some(inc) = m.get(1).or(m.get(2)) {
                    queue.push(inc.as_str().to_string());
                }
            }
        }
        // Its expressions, at their line in the rule file.
        for e in [&c.include_when, &c.for_each, &c.ready_when]
            .into_iter()
            .flatten()
        {
            let mut names: BTreeSet<String> =
                subscripts(&e.value).into_iter().map(|(_, n)| n).collect();
            if let Ok(expr) = env.compile_expression(&e.value) {
                names.extend(dotted(&expr.undeclared_variables(true)));
            }
            for n in names {
                add(&n, &rule_file_marker(), e.line);
            }
        }
    }
    out
}

/// The references each child waits for (`waitFor: [refs.<name>]`), as positions in
/// `spec.references`, in the order written. Only spelled: a child that reads `refs.x`
/// without naming it in `waitFor` renders with whatever the reference holds.
pub(super) fn ref_waits(rule: &Rule) -> Vec<Vec<usize>> {
    rule.spec
        .children
        .iter()
        .map(|c| {
            let mut out = Vec::new();
            for w in &c.wait_for {
                if let Some(name) = w.value.strip_prefix("refs.")
                    && let Some(j) = rule
                        .spec
                        .references
                        .iter()
                        .position(|r| r.name.value == name)
                    && !out.contains(&j)
                {
                    out.push(j);
                }
            }
            out
        })
        .collect()
}

/// Stands for the rule file in a [`Why::Reads`] found in the rule itself; replaced by
/// [`with_rule_file`] once the file is known.
fn rule_file_marker() -> String {
    "\u{0}rule".to_string()
}

/// `deps` with the rule file's name put where a read was found in the rule itself.
pub(super) fn with_rule_file(mut deps: DependsOn, file: &str) -> DependsOn {
    for d in &mut deps {
        for why in d.values_mut() {
            if let Why::Reads { file: f, .. } = why
                && *f == rule_file_marker()
            {
                *f = file.to_string();
            }
        }
    }
    deps
}

/// The order the children are created in: rule order, except that a child comes after
/// what it waits for (a cycle, refused by [`cycle`], is broken in rule order).
pub fn order(deps: &[Vec<usize>]) -> Vec<usize> {
    let n = deps.len();
    let mut placed = vec![false; n];
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let next = (0..n)
            .find(|&i| !placed[i] && deps[i].iter().all(|&j| j >= n || placed[j]))
            .or_else(|| (0..n).find(|&i| !placed[i]));
        let Some(i) = next else { break };
        placed[i] = true;
        out.push(i);
    }
    out
}

/// A cycle among the children's dependencies that an inferred one takes part in, as a
/// diagnostic at the read that closes it (one made of `waitFor` entries alone is
/// reported by the rule's own check, `rules::links`).
pub(super) fn cycle(rule: &Rule, deps: &DependsOn, at: &Diags<'_>) -> Option<Diagnostic> {
    let n = deps.len();
    // 0 new, 1 on the path, 2 done.
    let mut state = vec![0u8; n];
    for start in 0..n {
        if state[start] != 0 {
            continue;
        }
        let mut path: Vec<usize> = Vec::new();
        if let Some(c) = visit(start, deps, &mut state, &mut path) {
            if c.iter()
                .zip(c.iter().cycle().skip(1))
                .all(|(&a, &b)| matches!(deps[a].get(&b), Some(Why::WaitFor { .. })))
            {
                for s in state.iter_mut().filter(|s| **s == 1) {
                    *s = 2;
                }
                continue;
            }
            let names: Vec<&str> = c
                .iter()
                .chain(c.first())
                .map(|&k| rule.spec.children[k].name.as_str())
                .collect();
            let (last, first) = (c[c.len() - 1], c[0]);
            let message = format!(
                "the children's dependencies make a cycle: {} (a child that reads \
                 children.<name> waits for it, as with waitFor)",
                names.join(" -> ")
            );
            let key = format!("spec.children[{last}]");
            return Some(match deps[last].get(&first) {
                Some(Why::Reads { file, line }) => Diagnostic::new(
                    file.as_str(),
                    *line,
                    0,
                    format!("rule '{}': {key}: {message}", at.name),
                ),
                Some(Why::WaitFor { line, col }) => at.at(*line, *col, &key, message),
                None => at.at(0, 0, &key, message),
            });
        }
    }
    None
}

/// Depth-first search from `i`: the first cycle found, as the children along it.
fn visit(
    i: usize,
    deps: &DependsOn,
    state: &mut [u8],
    path: &mut Vec<usize>,
) -> Option<Vec<usize>> {
    state[i] = 1;
    path.push(i);
    for &j in deps[i].keys() {
        match state.get(j) {
            Some(0) => {
                if let Some(c) = visit(j, deps, state, path) {
                    return Some(c);
                }
            }
            Some(1) => {
                let start = path.iter().position(|&p| p == j).unwrap_or(0);
                return Some(path[start..].to_vec());
            }
            _ => {}
        }
    }
    path.pop();
    state[i] = 2;
    None
}

#[cfg(test)]
#[path = "deps_tests.rs"]
mod tests;
