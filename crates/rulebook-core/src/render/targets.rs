//! Where a parent may put its children: `spec.targetNamespaces` (issue 45 for
//! cluster-scoped parents, issue 47 for namespaced ones).
//!
//! A namespaced parent's children live in its own namespace (tenancy: `children.rs`
//! `place`), and only where the rule author lists more does a template place one
//! elsewhere: in a namespace the list matches, chosen by the parent's author within the
//! list, never outside it. Such a child carries no ownerReference (see `children.rs`
//! `set_ownership`). A cluster-scoped parent's namespaced children go where the template says, so
//! whoever writes the parent (a Tenant's author) may steer them into any namespace —
//! `kube-system` included — unless the rule says where they may go. The list holds names
//! and `*` patterns (`tenant-*`); a Namespace child's own name must match it too (the
//! namespaces such a parent creates are its targets). Namespaces Kubernetes itself runs
//! in (`kube-*`) are never targets unless listed by their exact name, whatever a pattern
//! matches — with the list or without it. (`default`, where a template that names no
//! namespace puts a child, stays a target without the list, as it always was.)
//!
//! A namespace label selector is not supported yet: it needs the Namespace objects'
//! labels at render time, which the pure render does not have (say so rather than
//! silently ignore it).
//!
//! Hand-written glob matching (only `*`): one wildcard kind over DNS labels does not
//! justify a crate (`globset` compiles regexes for far richer patterns).

use crate::rules::{Diagnostic, Loc, Rule};

/// Namespaces that are never a target unless listed by their exact name.
fn protected(ns: &str) -> bool {
    ns.starts_with("kube-")
}

/// Whether `name` matches `pattern` (`*` stands for any run of characters).
fn matches(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for middle in &parts[1..parts.len() - 1] {
        match rest.find(middle) {
            Some(i) => rest = &rest[i + middle.len()..],
            None => return false,
        }
    }
    true
}

/// Whether namespace `ns` is a target of a rule whose list is `targets` (`None`: the
/// rule has none: anything but a protected namespace).
pub fn allowed(targets: Option<&[Loc<String>]>, ns: &str) -> bool {
    let exact = targets.is_some_and(|t| t.iter().any(|p| p.value == ns));
    if exact {
        return true;
    }
    if protected(ns) {
        return false;
    }
    targets.is_none_or(|t| t.iter().any(|p| matches(&p.value, ns)))
}

/// The refusal of namespace `ns`, for the parent's `Ready=False`; `what` names it
/// ("the child's namespace", "the rendered Namespace").
pub fn refusal(targets: Option<&[Loc<String>]>, ns: &str, what: &str) -> String {
    match targets {
        Some(t) => format!(
            "{what} '{ns}' is not among the rule's targetNamespaces ({})",
            t.iter()
                .map(|p| p.value.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        None => format!(
            "{what} '{ns}' is one of Kubernetes' own namespaces: never a target unless spec.targetNamespaces lists it"
        ),
    }
}

/// Load errors: an empty pattern, or a pattern that is no DNS label with `*`s.
pub fn diagnostics(rule: &Rule, file: &str) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    for (i, p) in rule.spec.target_namespaces.iter().flatten().enumerate() {
        let ok = !p.value.is_empty()
            && p.value.len() <= 63
            && p.value
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '*');
        if !ok {
            out.push(Diagnostic::at(
                file,
                p,
                format!("spec.targetNamespaces[{i}]: '{}' is no namespace name or pattern (lowercase letters, digits, '-' and '*')", p.value),
            ));
        }
    }
    out
}

/// The `check` warning of a cluster-scoped parent (its CRD says `scope: Cluster`, or a
/// built-in cluster-scoped kind) with namespaced children and no `targetNamespaces`.
pub fn warnings(rule: &super::CompiledRule) -> Vec<Diagnostic> {
    let (file, rule) = (&rule.file, &rule.rule);
    let p = &rule.spec.parent;
    let cluster_scoped = rule.crd_cluster_scoped()
        || crate::meta::is_cluster_scoped_builtin(&p.api_version.value, &p.kind.value);
    if !cluster_scoped || rule.spec.target_namespaces.is_some() {
        return Vec::new();
    }
    let namespaced = rule.spec.children.iter().any(|c| {
        !crate::meta::is_cluster_scoped_builtin(&c.api_version.value, &c.kind.value)
            || c.kind.as_str() == "Namespace"
    });
    namespaced
        .then(|| {
            Diagnostic::at(
            file,
            &rule.spec.parent.kind,
            format!(
                "warning: rule '{}': its parents are cluster-scoped and it has no spec.targetNamespaces: whoever writes a parent chooses the namespaces its children go in (any but Kubernetes' own); list them, e.g. targetNamespaces: [\"{}-*\"]",
                rule.metadata.name.value,
                rule.spec.parent.kind.value.to_lowercase()
            ),
        )
        })
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(items: &[&str]) -> Vec<Loc<String>> {
        items.iter().map(|s| Loc::new(s.to_string())).collect()
    }

    #[test]
    fn patterns_match_names() {
        assert!(matches("tenant-*", "tenant-acme"));
        assert!(!matches("tenant-*", "tenants"));
        assert!(matches("*-prod", "web-prod"));
        assert!(matches("a*b*c", "axxbyyc"));
        assert!(!matches("a*b*c", "axxc"));
        assert!(matches("shared", "shared"));
        assert!(!matches("shared", "shared2"));
        assert!(!matches("ab*ba", "aba"));
    }

    #[test]
    fn kubernetes_namespaces_need_their_exact_name() {
        let any = list(&["*"]);
        assert!(allowed(Some(&any), "team-a"));
        assert!(!allowed(Some(&any), "kube-system"));
        assert!(allowed(Some(&any), "default"));
        assert!(!allowed(None, "kube-public"));
        assert!(allowed(None, "team-a"));
        let listed = list(&["kube-system"]);
        assert!(allowed(Some(&listed), "kube-system"));
        assert!(!allowed(Some(&listed), "team-a"));
        let tenants = list(&["tenant-*"]);
        assert!(allowed(Some(&tenants), "tenant-acme"));
        assert!(!allowed(Some(&tenants), "payments"));
    }

    /// A rule over namespaced parents whose ConfigMap goes where `spec.ns` says, with
    /// `spec.targetNamespaces` when `targets` is given.
    fn namespaced_rule(targets: Option<&str>) -> std::sync::Arc<crate::render::CompiledRule> {
        let targets = targets.map_or(String::new(), |t| format!("  targetNamespaces: {t}\n"));
        let rule = format!(
            "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: p\nspec:\n  \
             parent:\n    apiVersion: t.rulebook.dev/v1\n    kind: P\n{targets}  children:\n    \
             - name: cm\n      apiVersion: v1\n      kind: ConfigMap\n      template: cm.yaml\n"
        );
        let template = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name }}\n  \
                        {% if parent.spec.ns %}namespace: {{ parent.spec.ns }}{% endif %}\ndata: {}\n";
        crate::render::testkit::compile_rule("p", &rule, &[("cm.yaml", template)])
            .unwrap_or_else(|d| panic!("{d:?}"))
    }

    fn render_in(
        rule: &crate::render::CompiledRule,
        ns: &str,
    ) -> Result<serde_json::Value, String> {
        let parent = serde_json::json!({"apiVersion": "t.rulebook.dev/v1", "kind": "P",
            "metadata": {"name": "a", "namespace": "home", "uid": "u1"}, "spec": {"ns": ns}});
        rule.render(&parent, &Default::default(), &|_| {
            crate::render::Scope::Namespaced
        })
        .map(|mut d| d.remove(0).object)
        .map_err(|e| e.to_string())
    }

    #[test]
    fn a_namespaced_parent_places_a_child_in_a_listed_namespace_without_an_owner_reference() {
        let rule = namespaced_rule(Some("[\"shared-*\", \"kube-public\"]"));
        // Elsewhere, within the list: no ownerReference (the garbage collector would
        // take a namespaced owner in another namespace for absent), the parent's name
        // and namespace recorded instead, the owner label as on every child.
        let away = render_in(&rule, "shared-a").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(away["metadata"]["namespace"], "shared-a");
        assert!(away["metadata"].get("ownerReferences").is_none(), "{away}");
        let ann = &away["metadata"]["annotations"];
        assert_eq!(ann["rulebook.dev/parent-namespace"], "home");
        assert_eq!(ann["rulebook.dev/parent-name"], "a");
        assert_eq!(away["metadata"]["labels"]["rulebook.dev/owner"], "u1");
        // At home: the controller reference, nothing recorded.
        for ns in ["", "home"] {
            let home = render_in(&rule, ns).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(home["metadata"]["namespace"], "home");
            assert_eq!(home["metadata"]["ownerReferences"][0]["uid"], "u1");
            let ann = &home["metadata"]["annotations"];
            assert!(ann.get("rulebook.dev/parent-namespace").is_none(), "{home}");
            assert!(ann.get("rulebook.dev/parent-name").is_none(), "{home}");
        }
        // A Kubernetes namespace by its exact name only.
        assert!(render_in(&rule, "kube-public").is_ok());
        let refused = render_in(&rule, "kube-system").expect_err("kube-system");
        assert!(
            refused.contains(
                "'kube-system' is not among the rule's targetNamespaces (shared-*, kube-public)"
            ),
            "{refused}"
        );
        let refused = render_in(&rule, "payments").expect_err("outside the list");
        assert!(refused.contains("'payments' is not among"), "{refused}");
    }

    #[test]
    fn without_the_list_a_namespaced_parent_keeps_its_children_at_home() {
        let rule = namespaced_rule(None);
        let refused = render_in(&rule, "shared-a").expect_err("no list");
        assert!(
            refused.contains("children live in the parent's namespace 'home' (or in the rule's spec.targetNamespaces, which it has not)"),
            "{refused}"
        );
        assert!(render_in(&rule, "home").is_ok());
    }
}
