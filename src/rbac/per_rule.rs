//! `rulebook rbac --per-rule`: a rule with `spec.serviceAccount` runs as that account
//! (`engine/identity.rs`), so it gets the account, a ClusterRole with exactly what that
//! rule needs (the same computation as the operator's role, [`super::needs_of`], over the
//! one rule) and events, and a ClusterRoleBinding. The operator's own role keeps the
//! grants of the rules without an account, its Lease, CRDs, webhook and admission-policy
//! configurations, events, and `impersonate` on exactly those accounts: a Role in the
//! accounts' namespace (the operator's), by `resourceNames`, so it can act as nothing
//! else. A ClusterRole per rule: parents may be in any namespace (`run --namespace`
//! narrows what is watched, not what is granted, as for the operator's own role).

use std::collections::BTreeSet;

use serde_json::{Value as Json, json};

use super::{
    PARENT_VERBS, RbacOptions, cluster_role, events_rule, labels, needs_of, plural_of,
    role_binding, rule_of,
};
use crate::meta::split_api_version;
use crate::render::{CompiledRule, RuleSet};

/// The rules with an account of their own, and the account's name.
fn with_accounts(set: &RuleSet) -> impl Iterator<Item = (&CompiledRule, &str)> {
    set.rules.values().filter_map(|r| {
        r.rule
            .spec
            .service_account
            .as_ref()
            .map(|sa| (&**r, sa.value.as_str()))
    })
}

/// The name of the role and binding of rule `rule`.
pub fn role_name(opts: &RbacOptions, rule: &str) -> String {
    format!("{}-rule-{rule}", opts.name)
}

/// Per rule with an account: the account, its ClusterRole and ClusterRoleBinding; then
/// the operator's `impersonate` on those accounts (a Role and RoleBinding in their
/// namespace). Nothing when no rule has an account.
pub fn manifests(set: &RuleSet, opts: &RbacOptions) -> Vec<Json> {
    let ns = &opts.service_account.0;
    let mut out = Vec::new();
    let mut accounts = BTreeSet::new();
    for (rule, account) in with_accounts(set) {
        accounts.insert(account.to_string());
        let name = role_name(opts, &rule.name);
        let mut rules: Vec<Json> = needs_of(set, std::iter::once(rule))
            .into_iter()
            .map(rule_of)
            .collect();
        rules.push(events_rule());
        out.push(json!({
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": account, "namespace": ns, "labels": labels()},
        }));
        out.push(cluster_role(&name, rules));
        out.push(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name, "labels": labels()},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "namespace": ns, "name": account}],
        }));
    }
    if accounts.is_empty() {
        return out;
    }
    let name = format!("{}-impersonate", opts.name);
    out.push(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "namespace": ns, "labels": labels()},
        "rules": [{
            "apiGroups": [""],
            "resources": ["serviceaccounts"],
            "resourceNames": accounts,
            "verbs": ["impersonate"],
        }],
    }));
    out.push(role_binding(ns, &name, opts));
    out
}

/// What the operator itself still reads of the parents of rules with an account: a
/// sharded replica counts every rule's parents (`shard/`), and a storage migration
/// (`--install-crds`, a rule listing CRD versions) lists the parents it rewrites.
pub fn operator_reads(set: &RuleSet, opts: &RbacOptions) -> Vec<Json> {
    let mut out = Vec::new();
    for (rule, _) in with_accounts(set) {
        let migrates = opts.install_crds
            && rule
                .rule
                .spec
                .crd
                .as_ref()
                .is_some_and(|c| !c.versions.is_empty());
        if !(opts.sharding || migrates) {
            continue;
        }
        let p = &rule.rule.spec.parent;
        let (group, _) = split_api_version(&p.api_version);
        out.push(json!({
            "apiGroups": [group],
            "resources": [plural_of(set, &p.api_version, &p.kind)],
            "verbs": PARENT_VERBS,
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set() -> RuleSet {
        let rule = |name: &str, kind: &str, child: &str, sa: Option<&str>| {
            let mut t = format!(
                "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: {name}\nspec:\n  parent:\n    apiVersion: example.com/v1\n    kind: {kind}\n  children:\n    - name: c\n      apiVersion: v1\n      kind: {child}\n      template: t.yaml\n"
            );
            if let Some(sa) = sa {
                t.push_str(&format!("  serviceAccount: {sa}\n"));
            }
            (format!("{name}.yaml"), t)
        };
        compiled(vec![
            rule("low", "Low", "ConfigMap", Some("low-sa")),
            rule("high", "High", "Secret", Some("high-sa")),
            rule("plain", "Plain", "Service", None),
        ])
    }

    /// The rule files `files`, compiled with one template `t.yaml`.
    pub(super) fn compiled(files: Vec<(String, String)>) -> RuleSet {
        let sources = crate::rules::Sources {
            default_rollout: None,
            rule_files: files,
            templates: [(
                "t.yaml".to_string(),
                ("t.yaml".to_string(), "metadata:\n  name: x\n".to_string()),
            )]
            .into(),
        };
        crate::render::compile(&sources, &crate::render::Limits::default())
            .unwrap_or_else(|e| panic!("{e:?}"))
    }

    fn opts() -> RbacOptions {
        RbacOptions {
            name: "rb".into(),
            service_account: ("ops".into(), "rulebook".into()),
            install_crds: false,
            leader_elect: true,
            sharding: false,
            lease_name: "rb".into(),
            diff_role: false,
            diff_namespaces: vec![],
            webhooks: None,
            per_rule: true,
        }
    }

    fn grants(role: &Json, resource: &str) -> bool {
        role["rules"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|r| r["resources"] == json!([resource]))
    }

    /// Each account holds its own rule's kinds only; the operator holds the rule without
    /// an account, no kind of the others, and `impersonate` on exactly the two accounts.
    #[test]
    fn each_account_holds_its_rule_and_the_operator_the_rest() {
        let out = super::super::manifests(&set(), &opts());
        let by = |kind: &str, name: &str| {
            out.iter()
                .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
                .unwrap_or_else(|| panic!("{kind} {name}: {out:#?}"))
        };
        let operator = by("ClusterRole", "rb");
        assert!(grants(operator, "plains") && grants(operator, "services"));
        for gone in ["lows", "highs", "configmaps", "secrets"] {
            assert!(!grants(operator, gone), "{gone}: {operator:#}");
        }
        assert!(grants(operator, "leases"));
        let low = by("ClusterRole", "rb-rule-low");
        assert!(grants(low, "lows") && grants(low, "lows/status") && grants(low, "configmaps"));
        assert!(!grants(low, "secrets") && !grants(low, "highs") && !grants(low, "leases"));
        assert!(grants(low, "events"));
        let high = by("ClusterRole", "rb-rule-high");
        assert!(grants(high, "secrets") && !grants(high, "configmaps"));
        assert_eq!(
            by("ClusterRoleBinding", "rb-rule-low")["subjects"],
            json!([{"kind": "ServiceAccount", "namespace": "ops", "name": "low-sa"}])
        );
        assert_eq!(
            by("ServiceAccount", "low-sa")["metadata"]["namespace"],
            "ops"
        );
        let imp = by("Role", "rb-impersonate");
        assert_eq!(imp["metadata"]["namespace"], "ops");
        assert_eq!(
            imp["rules"],
            json!([{"apiGroups": [""], "resources": ["serviceaccounts"],
                "resourceNames": ["high-sa", "low-sa"], "verbs": ["impersonate"]}])
        );
        assert_eq!(
            by("RoleBinding", "rb-impersonate")["subjects"][0]["name"],
            "rulebook"
        );
    }

    /// Without `--per-rule` the accounts change nothing: one role for every rule.
    #[test]
    fn without_per_rule_one_role_holds_everything() {
        let out = super::super::manifests(
            &set(),
            &RbacOptions {
                per_rule: false,
                ..opts()
            },
        );
        assert_eq!(out.len(), 2, "{out:#?}");
        for r in ["lows", "highs", "plains", "secrets", "configmaps"] {
            assert!(grants(&out[0], r), "{r}");
        }
    }
}

#[cfg(test)]
mod namespace_selector_tests {
    /// A rule whose selector reads namespace labels is granted reading the Namespaces
    /// (its watch of them); one without is not.
    #[test]
    fn a_namespace_selector_is_granted_the_namespaces_watch() {
        let rule = |name: &str, kind: &str, selector: &str| {
            (
                format!("{name}.yaml"),
                format!(
                    "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: {name}\nspec:\n  parent:\n    apiVersion: example.com/v1\n    kind: {kind}\n{selector}  children:\n    - name: c\n      apiVersion: v1\n      kind: ConfigMap\n      template: t.yaml\n"
                ),
            )
        };
        let set = super::tests::compiled;
        let reads_namespaces = |s: &crate::render::RuleSet| {
            super::super::needs(s)
                .iter()
                .any(|n| format!("{n:?}").contains("\"namespaces\""))
        };
        let with = set(vec![rule(
            "prod",
            "App",
            "    selector:\n      namespaceSelector:\n        matchLabels: {env: prod}\n",
        )]);
        assert!(reads_namespaces(&with));
        let without = set(vec![rule("all", "App", "")]);
        assert!(!reads_namespaces(&without));
    }
}
