//! Validation of what reaches past one child: `waitFor` between children (known names,
//! no cycles) or on references (`refs.<name>`, a reference of the rule), and `spec.references` (names, one way of finding the object, a namespace
//! only a cluster-scoped parent may compute), and the label-selector syntax they use.

use std::collections::{BTreeMap, BTreeSet};

use super::{ChildRule, KindRef, Rule, check_kind_ref, is_dns_label, is_identifier};

/// `waitFor`: names of other children of the rule, without cycles, or `refs.<name>` of a
/// reference of the rule.
pub(super) fn check_wait_for(r: &Rule, err: &mut impl FnMut((u64, u64), &str, String)) {
    let children = &r.spec.children;
    let index: BTreeMap<&str, usize> = children
        .iter()
        .enumerate()
        .map(|(i, c)| (c.name.as_str(), i))
        .collect();
    let refs: BTreeSet<&str> = r.spec.references.iter().map(|r| r.name.as_str()).collect();
    for (i, c) in children.iter().enumerate() {
        for (j, w) in c.wait_for.iter().enumerate() {
            let key = format!("spec.children[{i}].waitFor[{j}]");
            if let Some(reference) = w.value.strip_prefix("refs.") {
                if !refs.contains(reference) {
                    err(
                        (w.line, w.col),
                        &key,
                        format!(
                            "'{}' names no reference of this rule (spec.references: {})",
                            w.value,
                            if refs.is_empty() {
                                "none".to_string()
                            } else {
                                refs.iter().copied().collect::<Vec<_>>().join(", ")
                            }
                        ),
                    );
                }
            } else if w.value == c.name.value {
                err(
                    (w.line, w.col),
                    &key,
                    "a child cannot wait for itself".into(),
                );
            } else if !index.contains_key(w.as_str()) {
                err(
                    (w.line, w.col),
                    &key,
                    format!(
                        "'{}' is not a child of this rule (name one of spec.children)",
                        w.value
                    ),
                );
            }
        }
    }
    wait_for_cycle(children, &index, err);
}

/// A cycle among the children's `waitFor` entries: depth-first search over them,
/// reported once at the child where the walk closes it.
fn wait_for_cycle(
    children: &[ChildRule],
    index: &BTreeMap<&str, usize>,
    err: &mut impl FnMut((u64, u64), &str, String),
) {
    let mut state = vec![0u8; children.len()]; // 0 new, 1 on the path, 2 done
    fn visit(
        i: usize,
        children: &[ChildRule],
        index: &BTreeMap<&str, usize>,
        state: &mut [u8],
        path: &mut Vec<usize>,
        found: &mut Option<Vec<usize>>,
    ) {
        state[i] = 1;
        path.push(i);
        for w in &children[i].wait_for {
            let Some(&j) = index.get(w.as_str()) else {
                continue;
            };
            if j == i || found.is_some() {
                continue;
            }
            match state[j] {
                0 => visit(j, children, index, state, path, found),
                1 => {
                    let start = path.iter().position(|&p| p == j).unwrap_or(0);
                    *found = Some(path[start..].to_vec());
                }
                _ => {}
            }
        }
        path.pop();
        state[i] = 2;
    }
    for i in 0..children.len() {
        if state[i] == 0 {
            let mut found = None;
            visit(i, children, index, &mut state, &mut Vec::new(), &mut found);
            if let Some(cycle) = found {
                let names: Vec<&str> = cycle
                    .iter()
                    .chain(cycle.first())
                    .map(|&k| children[k].name.as_str())
                    .collect();
                let last = cycle[cycle.len() - 1];
                let at = children[last]
                    .wait_for
                    .first()
                    .map_or((children[last].name.line, children[last].name.col), |w| {
                        (w.line, w.col)
                    });
                err(
                    at,
                    &format!("spec.children[{last}].waitFor"),
                    format!("waitFor makes a cycle: {}", names.join(" -> ")),
                );
                return;
            }
        }
    }
}

/// `spec.references`: names, kinds, exactly one way of finding the object, a namespace
/// that only a cluster-scoped parent may compute.
pub(super) fn check_references(r: &Rule, err: &mut impl FnMut((u64, u64), &str, String)) {
    let mut seen = BTreeSet::new();
    let parent_namespaced = r
        .spec
        .crd
        .as_ref()
        .map(|c| c.scope.as_ref().is_none_or(|s| s.value != "Cluster"));
    for (i, reference) in r.spec.references.iter().enumerate() {
        let key = format!("spec.references[{i}]");
        let name = &reference.name;
        if !is_identifier(name) {
            err(
                (name.line, name.col),
                &format!("{key}.name"),
                format!(
                    "'{}' is not an identifier ([a-zA-Z_][a-zA-Z0-9_]*, usable as refs.<name>)",
                    name.value
                ),
            );
        } else if !seen.insert(name.as_str()) {
            err(
                (name.line, name.col),
                &format!("{key}.name"),
                format!("'{}' is used by another reference of this rule", name.value),
            );
        }
        check_kind_ref(
            &KindRef {
                api_version: reference.api_version.clone(),
                kind: reference.kind.clone(),
                selector: None,
            },
            &key,
            err,
        );
        match (&reference.object_name, &reference.selector) {
            (Some(_), None) | (None, Some(_)) => {}
            _ => err(
                (name.line, name.col),
                &key,
                "needs exactly one of objectName and selector".into(),
            ),
        }
        if let Some(Err(expr)) = reference.literal_namespace()
            && parent_namespaced == Some(true)
        {
            err(
                (expr.line, expr.col),
                &format!("{key}.namespace"),
                format!(
                    "'{}' is not a namespace name: the parent is namespaced, so a reference may name another namespace only literally",
                    expr.value
                ),
            );
        }
        if let Some(sel) = &reference.watch_selector
            && let Err(e) = parse_label_selector(sel)
        {
            err((sel.line, sel.col), &format!("{key}.watchSelector"), e);
        }
    }
}

/// A label selector of `key`, `!key`, `key=value`, `key==value`, `key!=value` terms
/// separated by commas (set-based terms such as `key in (a,b)` are not read here).
pub fn parse_label_selector(s: &str) -> Result<Vec<(String, Option<String>, bool)>, String> {
    let mut terms = Vec::new();
    for term in s.split(',').map(str::trim) {
        if term.is_empty() {
            return Err(format!("'{s}' has an empty term"));
        }
        let (key, value, negated) = if let Some((k, v)) = term.split_once("!=") {
            (k.trim(), Some(v.trim()), true)
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            (k.trim(), Some(v.trim()), false)
        } else if let Some(k) = term.strip_prefix('!') {
            (k.trim(), None, true)
        } else {
            (term, None, false)
        };
        if !is_label_key(key) || value.is_some_and(|v| !is_label_value(v)) {
            return Err(format!(
                "'{term}' is not a label selector term (key, !key, key=value or key!=value)"
            ));
        }
        terms.push((key.to_string(), value.map(str::to_string), negated));
    }
    Ok(terms)
}

/// A label key: an optional DNS-subdomain prefix and `/`, then a name of at most 63
/// characters (alphanumerics, `-`, `_`, `.`; alphanumeric at both ends).
pub fn is_label_key(k: &str) -> bool {
    let (prefix, name) = match k.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    prefix.is_none_or(|p| p.len() <= 253 && p.split('.').all(is_dns_label))
        && !name.is_empty()
        && is_label_value(name)
}

/// A label value: empty, or at most 63 characters of alphanumerics, `-`, `_`, `.`,
/// alphanumeric at both ends.
pub fn is_label_value(v: &str) -> bool {
    v.is_empty()
        || (v.len() <= 63
            && v.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && v.starts_with(|c: char| c.is_ascii_alphanumeric())
            && v.ends_with(|c: char| c.is_ascii_alphanumeric()))
}
