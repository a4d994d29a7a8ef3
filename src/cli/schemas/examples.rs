//! `rulebook check`'s renders for the schema check: every parent of the examples (the YAML
//! files of `examples/` beside the rules directory; the other documents of its file are
//! its live objects, as `rulebook render -f` reads them) and every `RuleTest` fixture's
//! parent (`tests/` beside it, rendered alone: its steps' live objects are `rulebook
//! test`'s), rendered as the operator would render them, each child checked against its
//! kind's schema.
//!
//! A parent that does not render here (a fixture whose template needs the live objects
//! of a step, an example missing a referenced Secret) is a note, not an error: `rulebook
//! test` and `rulebook render` say why; only what did render is checked.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value as Json;

use super::Schemas;
use crate::cli::{RuleDirs, observed, offline_scope, roundtrip, rule_for, ruletest};
use crate::render::RuleSet;

/// What the schema check of the examples found.
#[derive(Debug, Default)]
pub struct Report {
    /// One line per problem (`template:line: path: message (…)`).
    pub problems: Vec<String>,
    /// Per rule: (parents rendered, children checked, problems found).
    pub checked: BTreeMap<String, (usize, usize, usize)>,
    /// One line per parent that did not render.
    pub notes: Vec<String>,
    /// The kinds met without a schema.
    pub unknown: BTreeSet<String>,
}

/// Renders every example and fixture parent of a rule in `set` and checks its children.
pub fn check_examples(set: &RuleSet, dirs: &RuleDirs, schemas: &Schemas) -> Report {
    let mut report = Report::default();
    let examples = roundtrip::examples(dirs);
    // (place, parent, the other objects of its file)
    let mut samples: Vec<(String, Json, Vec<Json>)> = Vec::new();
    for (i, (place, object)) in examples.iter().enumerate() {
        let file = place.rsplit_once(':').map_or(place.as_str(), |(f, _)| f);
        let others = examples
            .iter()
            .enumerate()
            .filter(|(j, (p, _))| *j != i && p.rsplit_once(':').is_some_and(|(f, _)| f == file))
            .map(|(_, (_, o))| o.clone())
            .collect();
        samples.push((place.clone(), object.clone(), others));
    }
    samples.extend(
        ruletest::fixture_parents(dirs)
            .into_iter()
            .map(|(place, parent)| (place, parent, Vec::new())),
    );
    for (place, object, others) in samples {
        let s = |k: &str| object.get(k).and_then(Json::as_str).unwrap_or("");
        let Some(rule) = rule_for(set, s("apiVersion"), s("kind")) else {
            continue;
        };
        let parent = crate::cli::with_render_defaults(rule, object.clone());
        let rendered = ruletest::as_stored(rule, &parent).and_then(|p| {
            observed::render_against(rule, &p, others, &offline_scope(set, rule))
                .map_err(|e| e.to_string())
        });
        let m = match rendered {
            Ok(m) => m,
            Err(e) => {
                report.notes.push(format!(
                    "note: {place}: {} {} did not render here, its children are not checked: {e}",
                    s("kind"),
                    object
                        .pointer("/metadata/name")
                        .and_then(Json::as_str)
                        .unwrap_or("(unnamed)")
                ));
                continue;
            }
        };
        let entry = report.checked.entry(rule.name.clone()).or_default();
        entry.0 += 1;
        entry.1 += m.desired.len();
        let found = schemas.check(rule, &m.desired, &place, &mut report.unknown);
        entry.2 += found.len();
        report.problems.extend(found);
    }
    report
}
