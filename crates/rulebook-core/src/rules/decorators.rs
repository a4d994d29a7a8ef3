//! Several rules on one parent kind (issue 45 part 3, docs/reference/decorators.md): the
//! `check` of `spec.parent.selector`, the rules a kind's rules must keep between them
//! (one writes the parent's status, one defines its CRD, one has a say in its deletion,
//! one checks it at admission), and each rule's [`KindRole`] among them, which the
//! operator runs it with.
//!
//! Who does what is decided here, from the rule set alone, so that every replica and
//! every `check` agree: the *main* rule of a kind writes the parent's `Ready` condition
//! and its status fields (the rule with `spec.status` or `spec.crd`, else the first by
//! name without a selector, else the first by name); every other rule writes one
//! condition of its own, `<RuleName>Ready` ([`condition_type`]). The *finalizer* rule
//! manages `rulebook.dev/finalizer` on the kind's parents: the one rule that needs it,
//! else the main rule (which takes a stale one off).

use std::collections::BTreeMap;

use super::{Diagnostic, LabelSelector, Rule, SourcedRule, is_label_key, is_label_value};
use crate::meta::split_api_version;

/// What a rule does among the rules of its parent kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KindRole {
    /// Another rule of the set names the same parent kind (group and kind).
    pub shared: bool,
    /// It writes the parent's `Ready` condition and status fields (else only its own
    /// `<RuleName>Ready` condition).
    pub main: bool,
    /// It adds, keeps and removes Rulebook's finalizer on the parents, and tears them
    /// down (else it never touches the finalizer, and leaves its children to the
    /// garbage collector when a parent is deleted).
    pub finalizer: bool,
}

impl KindRole {
    /// The role of a rule alone on its kind.
    pub const SOLE: KindRole = KindRole {
        shared: false,
        main: true,
        finalizer: true,
    };
}

/// `(group, kind)` of a rule's parent: two versions of a kind are the same objects.
fn parent_key(r: &Rule) -> (String, String) {
    let p = &r.spec.parent;
    (
        split_api_version(&p.api_version).0.to_string(),
        p.kind.value.clone(),
    )
}

/// The rules of `rules` by parent kind, each group sorted by rule name.
fn by_kind<'a>(rules: &[&'a Rule]) -> BTreeMap<(String, String), Vec<&'a Rule>> {
    let mut groups: BTreeMap<(String, String), Vec<&Rule>> = BTreeMap::new();
    for r in rules {
        groups.entry(parent_key(r)).or_default().push(r);
    }
    for g in groups.values_mut() {
        g.sort_by(|a, b| a.metadata.name.value.cmp(&b.metadata.name.value));
    }
    groups
}

/// Each rule's role among the rules of its kind, by rule name.
pub fn roles(rules: &[&Rule]) -> BTreeMap<String, KindRole> {
    let mut out = BTreeMap::new();
    for group in by_kind(rules).into_values() {
        if let [only] = group.as_slice() {
            out.insert(only.metadata.name.value.clone(), KindRole::SOLE);
            continue;
        }
        let main = group
            .iter()
            .find(|r| !r.spec.status.is_empty() || r.spec.crd.is_some())
            .or_else(|| group.iter().find(|r| r.spec.parent.selector.is_none()))
            .or_else(|| group.first())
            .map(|r| r.metadata.name.value.as_str());
        // A rule with `targetNamespaces` needs the finalizer too when its parents are
        // namespaced (known from discovery only): it holds it unless another rule has a
        // say in the deletion.
        let finalizer = group
            .iter()
            .find(|r| r.spec.needs_finalizer())
            .or_else(|| group.iter().find(|r| r.spec.target_namespaces.is_some()))
            .map(|r| r.metadata.name.value.as_str())
            .or(main);
        for r in &group {
            let name = r.metadata.name.as_str();
            out.insert(
                name.to_string(),
                KindRole {
                    shared: true,
                    main: Some(name) == main,
                    finalizer: Some(name) == finalizer,
                },
            );
        }
    }
    out
}

/// The other rules of each rule's parent kind, by rule name (sorted; empty for a rule
/// alone on its kind). An object of a parent labelled as a peer's child is that peer's,
/// never to be applied over; one labelled with a rule that is no longer in the set (a
/// renamed rule's) is anyone's to take over that renders it.
pub fn peers(rules: &[&Rule]) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for group in by_kind(rules).into_values() {
        for r in &group {
            let name = r.metadata.name.value.clone();
            let others = group
                .iter()
                .map(|o| o.metadata.name.value.clone())
                .filter(|o| *o != name)
                .collect();
            out.insert(name, others);
        }
    }
    out
}

/// The condition a rule that is not its kind's main rule reports on the parent: its
/// name in PascalCase (each `-`/`.`-separated part capitalised) and `Ready`:
/// `team-namespaces` → `TeamNamespacesReady`.
pub fn condition_type(rule: &str) -> String {
    let mut out = String::new();
    for part in rule.split(['-', '.']).filter(|p| !p.is_empty()) {
        let mut chars = part.chars();
        if let Some(c) = chars.next() {
            out.extend(c.to_uppercase());
            out.push_str(chars.as_str());
        }
    }
    out.push_str("Ready");
    out
}

/// What only one rule of a kind may have: the key, and whether `r` has it.
/// A key only one rule of a kind may have: its name, whether a rule has it, and why.
type OnePerKind = (&'static str, fn(&Rule) -> bool, &'static str);

const ONE_PER_KIND: &[OnePerKind] = &[
    (
        "spec.status",
        |r| !r.spec.status.is_empty(),
        "one rule of a parent kind writes the parent's status; the others report a condition of their own (<RuleName>Ready)",
    ),
    (
        "spec.crd",
        |r| r.spec.crd.is_some(),
        "one rule defines the parent kind's CustomResourceDefinition",
    ),
    (
        "spec.deletion / deletionPolicy: Orphan",
        |r| r.spec.needs_finalizer(),
        "one rule of a parent kind has a say in its deletion (Rulebook's finalizer); the other rules' children go with the parent",
    ),
    (
        "spec.admission",
        |r| r.spec.admission.is_some(),
        "one rule of a parent kind checks it at admission",
    ),
];

/// The line of a rule's `key` (the first status field's, the parent kind's otherwise).
fn line_of(r: &Rule, key: &str) -> u64 {
    match key {
        "spec.status" => r.spec.status.values().map(|v| v.line).min(),
        "spec.deletion / deletionPolicy: Orphan" => r
            .spec
            .children
            .iter()
            .find(|c| c.deletion_policy == super::DeletionPolicy::Orphan)
            .map(|c| c.name.line),
        _ => None,
    }
    .filter(|l| *l > 0)
    .unwrap_or(r.spec.parent.kind.line)
}

/// Load errors of rules that share a parent kind: what only one of them may have.
pub fn check_kinds(parsed: &[SourcedRule], diags: &mut Vec<Diagnostic>) {
    let mut groups: BTreeMap<(String, String), Vec<&SourcedRule>> = BTreeMap::new();
    for sr in parsed {
        groups.entry(parent_key(&sr.rule)).or_default().push(sr);
    }
    for group in groups.values() {
        if group.len() < 2 {
            continue;
        }
        for (key, has, why) in ONE_PER_KIND {
            let mut with = group.iter().filter(|sr| has(&sr.rule));
            let Some(first) = with.next() else { continue };
            for other in with {
                let r = &other.rule;
                diags.push(Diagnostic::new(
                    &other.file,
                    line_of(r, key),
                    0,
                    format!(
                        "rule '{}': {key}: rule '{}' ({}:{}) has it too, and both take parents {} {}: {why}",
                        r.metadata.name.value,
                        first.rule.metadata.name.value,
                        first.file,
                        line_of(&first.rule, key),
                        r.spec.parent.api_version.value,
                        r.spec.parent.kind.value,
                    ),
                ));
            }
        }
        // The status fields are the CRD's: one rule has both.
        let status = group.iter().find(|sr| !sr.rule.spec.status.is_empty());
        let crd = group.iter().find(|sr| sr.rule.spec.crd.is_some());
        if let (Some(s), Some(c)) = (status, crd)
            && s.rule.metadata.name.value != c.rule.metadata.name.value
        {
            diags.push(Diagnostic::new(
                &s.file,
                line_of(&s.rule, "spec.status"),
                0,
                format!(
                    "rule '{}': spec.status: the parent kind's CRD is rule '{}''s ({}:{}): the rule that defines the CRD writes the status",
                    s.rule.metadata.name.value,
                    c.rule.metadata.name.value,
                    c.file,
                    c.rule.spec.parent.kind.line
                ),
            ));
        }
    }
}

/// Load errors of one rule's `spec.parent.selector`.
pub(super) fn check_selector(r: &Rule, err: &mut impl FnMut((u64, u64), &str, String)) {
    let Some(sel) = &r.spec.parent.selector else {
        return;
    };
    let key = "spec.parent.selector";
    check_label_selector(&sel.labels(), key, err);
    if let Some(ns) = &sel.namespace_selector {
        check_label_selector(ns, &format!("{key}.namespaceSelector"), err);
        let p = &r.spec.parent;
        let cluster = crate::meta::is_cluster_scoped_builtin(&p.api_version, &p.kind)
            || r.crd_cluster_scoped();
        if cluster {
            err(
                (p.kind.line, p.kind.col),
                &format!("{key}.namespaceSelector"),
                format!(
                    "{} is cluster-scoped: its parents have no namespace to select by",
                    p.kind.value
                ),
            );
        }
    }
    let empty = sel.match_labels.is_empty()
        && sel.match_expressions.is_empty()
        && sel.namespace_selector.is_none()
        && sel.expr.is_none();
    if empty {
        let p = &r.spec.parent;
        err(
            (p.kind.line, p.kind.col),
            key,
            "is empty: give matchLabels, matchExpressions, namespaceSelector or expr (or leave the selector out to take every parent)".into(),
        );
    }
}

fn check_label_selector(
    s: &LabelSelector,
    key: &str,
    err: &mut impl FnMut((u64, u64), &str, String),
) {
    for (k, v) in &s.match_labels {
        if !is_label_key(k) {
            err(
                (v.line, v.col),
                &format!("{key}.matchLabels"),
                format!("'{k}' is not a label key"),
            );
        }
        if !is_label_value(&v.value) {
            err(
                (v.line, v.col),
                &format!("{key}.matchLabels.{k}"),
                format!("'{}' is not a label value", v.value),
            );
        }
    }
    for (i, e) in s.match_expressions.iter().enumerate() {
        let at = (e.key.line, e.key.col);
        let key = format!("{key}.matchExpressions[{i}]");
        if !is_label_key(&e.key) {
            err(at, &key, format!("'{}' is not a label key", e.key.value));
        }
        let op = e.operator.as_str();
        let with_values = matches!(op, "In" | "NotIn");
        if !with_values && !matches!(op, "Exists" | "DoesNotExist") {
            err(
                (e.operator.line, e.operator.col),
                &format!("{key}.operator"),
                format!("'{op}' is not In, NotIn, Exists or DoesNotExist"),
            );
        } else if with_values && e.values.is_empty() {
            err(at, &key, format!("{op} needs values"));
        } else if !with_values && !e.values.is_empty() {
            err(at, &key, format!("{op} takes no values"));
        }
        if let Some(v) = e.values.iter().find(|v| !is_label_value(v)) {
            err(at, &key, format!("'{v}' is not a label value"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(name: &str, extra: &str) -> Rule {
        let text = format!(
            "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: {name}\nspec:\n  parent:\n    apiVersion: example.com/v1\n    kind: App\n{extra}"
        );
        let mut rules =
            crate::rules::parse_file("r.yaml", &text).unwrap_or_else(|e| panic!("{e:?}"));
        rules.remove(0).rule
    }

    #[test]
    fn peers_are_the_other_rules_of_the_same_parent_group_and_kind() {
        let a = rule("a", "");
        let b = rule("b", "");
        let mut other = rule("c", "");
        other.spec.parent.kind.value = "Other".into();
        let peers = peers(&[&b, &a, &other]);
        assert_eq!(peers["a"], vec!["b".to_string()]);
        assert_eq!(peers["b"], vec!["a".to_string()]);
        assert!(peers["c"].is_empty());
    }

    #[test]
    fn condition_types_are_pascal_case() {
        assert_eq!(condition_type("team-namespaces"), "TeamNamespacesReady");
        assert_eq!(condition_type("gold"), "GoldReady");
        assert_eq!(condition_type("a.b-c2"), "ABC2Ready");
    }

    #[test]
    fn the_status_rule_is_main_and_the_first_needing_it_holds_the_finalizer() {
        let main = rule("zz-main", "  status:\n    phase: {value: x}\n");
        let gold = rule(
            "gold",
            "    selector:\n      matchLabels: {tier: gold}\n  children: []\n",
        );
        let roles = roles(&[&main, &gold]);
        assert_eq!(
            roles["zz-main"],
            KindRole {
                shared: true,
                main: true,
                finalizer: true
            }
        );
        assert_eq!(
            roles["gold"],
            KindRole {
                shared: true,
                main: false,
                finalizer: false
            }
        );
        // Alone on its kind, a rule with a selector is its kind's everything.
        assert_eq!(roles_of(&gold), KindRole::SOLE);
    }

    fn roles_of(r: &Rule) -> KindRole {
        roles(&[r])[r.metadata.name.as_str()]
    }

    #[test]
    fn label_requirements_match_as_kubernetes_does() {
        let labels: BTreeMap<String, String> = [("team".to_string(), "a".to_string())].into();
        let req = |op: &str, values: &[&str]| crate::rules::LabelRequirement {
            key: crate::rules::Loc::new("team".into()),
            operator: crate::rules::Loc::new(op.into()),
            values: values.iter().map(|v| v.to_string()).collect(),
        };
        assert!(req("Exists", &[]).matches(&labels));
        assert!(!req("DoesNotExist", &[]).matches(&labels));
        assert!(req("In", &["a", "b"]).matches(&labels));
        assert!(!req("NotIn", &["a"]).matches(&labels));
        assert!(req("NotIn", &["a"]).matches(&BTreeMap::new()));
        assert!(!req("In", &["a"]).matches(&BTreeMap::new()));
        assert!(!req("Bogus", &[]).matches(&labels));
    }
}
