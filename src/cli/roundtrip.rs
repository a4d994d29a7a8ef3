//! `rulebook check`'s proof that a rule's conversions round-trip (issue 43): every parent
//! of the rule's examples (the YAML files of `examples/` beside the rules directory) and
//! of its `RuleTest` fixtures (`tests/` beside it), converted to each other served
//! version and back, must come back as it was; otherwise the check fails naming the
//! object, the versions and the fields lost or changed (`spec.port: lost`).
//!
//! A conversion that loses a field loses it for every client that reads the object in
//! the other version and writes it back (`kubectl edit` in an old version, an old
//! controller): the API server stores what comes back.

use std::path::Path;

use serde_json::Value as Json;

use super::{RuleDirs, parse_objects, rule_for};
use crate::render::RuleSet;

/// What the round trips found: one line per problem (`file:line: ...`), and per rule with
/// conversions how many objects were tried.
#[derive(Debug, Default)]
pub struct Report {
    pub problems: Vec<String>,
    pub tried: std::collections::BTreeMap<String, usize>,
}

/// Round-trips every example and fixture parent of a rule with conversions.
pub fn check(set: &RuleSet, dirs: &RuleDirs) -> Report {
    let mut report = Report::default();
    for r in set.rules.values() {
        if r.rule
            .spec
            .crd
            .as_ref()
            .is_some_and(|c| !c.conversion.is_empty())
        {
            report.tried.insert(r.name.clone(), 0);
        }
    }
    if report.tried.is_empty() {
        return report;
    }
    let mut samples = examples(dirs);
    samples.extend(super::ruletest::fixture_parents(dirs));
    for (place, object) in &samples {
        let s = |k: &str| object.get(k).and_then(Json::as_str).unwrap_or("");
        let Some(rule) = rule_for(set, s("apiVersion"), s("kind")) else {
            continue;
        };
        let Some(tried) = report.tried.get_mut(&rule.name) else {
            continue;
        };
        *tried += 1;
        let from = crate::meta::split_api_version(s("apiVersion"))
            .1
            .to_string();
        for (via, served) in rule.crd_versions() {
            if !served || via == from {
                continue;
            }
            let name = object
                .pointer("/metadata/name")
                .and_then(Json::as_str)
                .unwrap_or("(unnamed)");
            match rule.round_trip(object, &via) {
                Ok(None) => {}
                Ok(Some(lost)) => report.problems.push(format!(
                    "{place}: rule '{}': {} {name} does not survive {from} → {via} → {from}: {lost}",
                    rule.name,
                    s("kind")
                )),
                Err(e) => report.problems.push(format!(
                    "{place}: rule '{}': {} {name}: round trip {from} → {via} → {from}: {e}",
                    rule.name,
                    s("kind")
                )),
            }
        }
    }
    report
}

/// Every object of the YAML files in `examples/` beside the rules directory, with the
/// line its document starts on.
pub(super) fn examples(dirs: &RuleDirs) -> Vec<(String, Json)> {
    let base = dirs.rules.parent().unwrap_or(Path::new("."));
    let Ok(entries) = std::fs::read_dir(base.join("examples")) else {
        return Vec::new();
    };
    let mut files: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let Ok(objects) = parse_objects(&text) else {
            continue;
        };
        let starts = document_lines(&text);
        for (i, o) in objects.into_iter().enumerate() {
            let line = starts.get(i).copied().unwrap_or(1);
            out.push((format!("{}:{line}", file.display()), o));
        }
    }
    out
}

/// The first line of each non-empty document of a YAML stream.
fn document_lines(text: &str) -> Vec<usize> {
    let mut starts = Vec::new();
    let mut current: Option<usize> = None;
    for (i, l) in text.lines().enumerate() {
        let t = l.trim();
        if t == "---" || t.starts_with("--- ") {
            if let Some(s) = current.take() {
                starts.push(s);
            }
            continue;
        }
        if current.is_none() && !t.is_empty() && !t.starts_with('#') {
            current = Some(i + 1);
        }
    }
    starts.extend(current);
    starts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_start_at_their_first_content_line() {
        assert_eq!(document_lines("a: 1\n---\n# c\nb: 2\n---\n\n"), vec![1, 4]);
    }
}
