//! Which roles a RoleBinding or ClusterRoleBinding child may bind (issue 45).
//!
//! The API server lets Rulebook create a binding only if it holds every permission of the
//! role bound, or `bind` on that role. Holding `bind` by name is the least privilege: the
//! operator can hand out exactly the roles its rules name and nothing else, and cannot
//! use them itself. So the roles must be known from the rule: the literal `roleRef` of
//! the child's template (read statically, as `adopt.rs` reads names), or, where the
//! template computes it from the parent, an explicit allow-list on the child
//! (`allowedRoleRefs`). A computed `roleRef` lets whoever writes the parent choose the
//! role it gets bound to; without the list that is a load error, with it a `check`
//! warning that names the risk. At render time the rendered `roleRef` must be one of
//! these, whatever the API server would allow: the operator's own grants are not the
//! tenant's boundary.
//!
//! Static reading, not rendering with sample parents: the same reasoning as `adopt.rs`
//! (samples miss what they do not vary). Whatever cannot be read (a `roleRef` from an
//! include or a macro) counts as computed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value as Json;

use super::CompiledRule;
use crate::rules::{ChildRule, Diagnostic};

/// The group of RoleBinding, ClusterRoleBinding, Role and ClusterRole.
pub const RBAC_GROUP: &str = "rbac.authorization.k8s.io";

static ROLE_REF: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^roleRef:\s*(.*?)\s*$").expect("static regex"));
static KEY: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(\s+)([A-Za-z]+):\s*(.*?)\s*$").expect("static regex"));

/// A role a binding names: `Role` or `ClusterRole`, and its name.
pub type RoleName = (String, String);

/// What the template's `roleRef` is.
#[derive(Debug, PartialEq, Eq)]
pub enum RoleRefRead {
    /// Literal `kind` and `name`.
    Literal(RoleName),
    /// Computed (or unreadable); the 1-based template line and why.
    Computed(usize, String),
}

/// Whether `c` is a RoleBinding or ClusterRoleBinding.
pub fn is_binding(c: &ChildRule) -> bool {
    c.api_version.as_str().split('/').next() == Some(RBAC_GROUP)
        && matches!(c.kind.as_str(), "RoleBinding" | "ClusterRoleBinding")
}

/// Reads the top-level `roleRef:` block of a binding's template.
pub fn read(source: &str) -> RoleRefRead {
    let mut start = None;
    let (mut kind, mut name) = (None, None);
    for (n, line) in source.lines().enumerate() {
        if start.is_none() {
            if let Some(m) = ROLE_REF.captures(line) {
                if !m[1].is_empty() {
                    return RoleRefRead::Computed(n + 1, "roleRef is written inline".into());
                }
                start = Some(n + 1);
            }
            continue;
        }
        let Some(m) = KEY.captures(line) else {
            if line.trim().is_empty() || line.trim_start().starts_with('#') {
                continue;
            }
            break;
        };
        let value = m[3].trim_matches(|c| c == '"' || c == '\'').to_string();
        if value.contains("{{") || value.contains("{%") {
            return RoleRefRead::Computed(n + 1, format!("roleRef.{} is computed", &m[2]));
        }
        match &m[2] {
            "kind" => kind = Some(value),
            "name" => name = Some(value),
            _ => {}
        }
    }
    match (start, kind, name) {
        (Some(_), Some(k), Some(n)) if !n.is_empty() => RoleRefRead::Literal((k, n)),
        (Some(line), _, _) => {
            RoleRefRead::Computed(line, "roleRef has no literal kind and name".into())
        }
        (None, _, _) => RoleRefRead::Computed(1, "no top-level roleRef: line was found".into()),
    }
}

/// The roles child `c` may bind, its template's source given: the allow-list when it
/// has one, else the literal `roleRef`; `None` when neither says.
pub fn allowed(c: &ChildRule, source: &str) -> Option<BTreeSet<RoleName>> {
    if !c.allowed_role_refs.is_empty() {
        return Some(
            c.allowed_role_refs
                .iter()
                .map(|r| (r.kind.value.clone(), r.name.value.clone()))
                .collect(),
        );
    }
    match read(source) {
        RoleRefRead::Literal(r) => Some(BTreeSet::from([r])),
        RoleRefRead::Computed(..) => None,
    }
}

/// The roles each binding child of `rule` may bind, by child name (read once at compile;
/// a child whose roles neither says is absent: it may bind none).
pub fn bindable_by_child<'a>(
    rule: &crate::rules::Rule,
    source: &dyn Fn(&str) -> Option<&'a str>,
) -> BTreeMap<String, BTreeSet<RoleName>> {
    rule.spec
        .children
        .iter()
        .filter(|c| is_binding(c))
        .filter_map(|c| {
            let roles = allowed(c, source(c.template.as_str()).unwrap_or(""))?;
            Some((c.name.value.clone(), roles))
        })
        .collect()
}

/// The roles every binding child of `rule` may bind (for `rulebook rbac`: `bind` on
/// them by name).
pub fn bindable(rule: &CompiledRule) -> BTreeSet<RoleName> {
    rule.bindable.values().flatten().cloned().collect()
}

/// Load errors (a computed `roleRef` without `allowedRoleRefs`; an allow-list on a
/// child that binds nothing; a listed kind that is not a role) and `check` warnings (a
/// computed `roleRef` with its list: the risk, named).
pub fn diagnostics(
    rule: &crate::rules::Rule,
    file: &str,
    template_source: &dyn Fn(&str) -> Option<(String, String)>,
) -> (Vec<Diagnostic>, Vec<Diagnostic>) {
    let (mut errors, mut warnings) = (Vec::new(), Vec::new());
    for (i, c) in rule.spec.children.iter().enumerate() {
        if !is_binding(c) {
            if let Some(first) = c.allowed_role_refs.first() {
                errors.push(Diagnostic::at(
                    file,
                    &first.kind,
                    format!("spec.children[{i}].allowedRoleRefs: only a RoleBinding or ClusterRoleBinding child binds roles"),
                ));
            }
            continue;
        }
        for r in &c.allowed_role_refs {
            if !matches!(r.kind.as_str(), "Role" | "ClusterRole") {
                errors.push(Diagnostic::at(
                    file,
                    &r.kind,
                    format!("spec.children[{i}].allowedRoleRefs: kind must be Role or ClusterRole, not '{}'", r.kind.value),
                ));
            }
        }
        let Some((path, source)) = template_source(c.template.as_str()) else {
            continue;
        };
        let RoleRefRead::Computed(line, why) = read(&source) else {
            continue;
        };
        let risk = format!(
            "{path}:{line}: {why}: whoever writes the parent could choose the role its {} binds",
            c.kind.value
        );
        if c.allowed_role_refs.is_empty() {
            errors.push(Diagnostic::at(
                file,
                &c.name,
                format!(
                    "spec.children[{i}] '{}': {risk}; list the roles it may name in allowedRoleRefs (rulebook rbac grants bind on exactly those)",
                    c.name.value
                ),
            ));
        } else {
            warnings.push(Diagnostic::at(
                file,
                &c.name,
                format!(
                    "warning: rule '{}': spec.children[{i}] '{}': {risk} among allowedRoleRefs; any other is refused",
                    rule.metadata.name.value, c.name.value
                ),
            ));
        }
    }
    (errors, warnings)
}

/// The `check` warnings of a loaded rule (its load errors are [`diagnostics`]'s first half).
pub fn warnings(rule: &CompiledRule) -> Vec<Diagnostic> {
    let env = rule.compiled.borrow_owner();
    let source = |t: &str| {
        let path = rule
            .template_files
            .get(t)
            .cloned()
            .unwrap_or_else(|| t.to_string());
        env.get_template(t)
            .ok()
            .map(|s| (path, s.source().to_string()))
    };
    diagnostics(&rule.rule, &rule.file, &source).1
}

/// At render time: the rendered binding's `roleRef` is one the rule allows (`allowed`:
/// the child's set from [`bindable_by_child`]; none, none allowed).
pub fn check_rendered(object: &Json, allowed: Option<&BTreeSet<RoleName>>) -> Result<(), String> {
    let kind = object.pointer("/roleRef/kind").and_then(Json::as_str);
    let name = object.pointer("/roleRef/name").and_then(Json::as_str);
    let (Some(kind), Some(name)) = (kind, name) else {
        return Err("the rendered binding has no roleRef.kind and roleRef.name".into());
    };
    let pair = (kind.to_string(), name.to_string());
    if allowed.is_some_and(|a| a.contains(&pair)) {
        return Ok(());
    }
    Err(format!(
        "the rendered roleRef {kind}/{name} is not one this child may bind (allowed: {})",
        allowed
            .into_iter()
            .flatten()
            .map(|(k, n)| format!("{k}/{n}"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_literal_role_ref_is_read() {
        let t = "apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata:\n  name: x\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: admin\nsubjects:\n  - kind: Group\n    name: {{ parent.spec.group }}\n";
        assert_eq!(
            read(t),
            RoleRefRead::Literal(("ClusterRole".into(), "admin".into()))
        );
    }

    #[test]
    fn a_computed_or_missing_role_ref_is_not_literal() {
        let computed = "roleRef:\n  kind: ClusterRole\n  name: {{ parent.spec.role }}\n";
        assert_eq!(
            read(computed),
            RoleRefRead::Computed(3, "roleRef.name is computed".into())
        );
        let quoted = "roleRef:\n  kind: \"{{ parent.spec.kind }}\"\n  name: view\n";
        assert!(matches!(read(quoted), RoleRefRead::Computed(2, _)));
        assert!(matches!(
            read("{% include 'ref.yaml' %}\n"),
            RoleRefRead::Computed(1, _)
        ));
        assert!(matches!(
            read("roleRef: {{ parent.spec.ref }}\n"),
            RoleRefRead::Computed(1, _)
        ));
        // The name under subjects, after the block, is not the role's.
        let after = "roleRef:\n  kind: ClusterRole\nsubjects:\n  - name: view\n";
        assert!(matches!(read(after), RoleRefRead::Computed(1, _)));
    }
}
