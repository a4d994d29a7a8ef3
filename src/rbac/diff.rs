//! The role of `rulebook diff` (`rulebook rbac --diff-role`): what a CI job that diffs a
//! pull request's rules needs, and no more, in three parts a reader can tell apart.
//!
//! - `<name>` (ClusterRole + ClusterRoleBinding), reads: `get`, `list` on each parent
//!   kind and each child kind but Secret; on each referenced kind but Secret, `get` on
//!   the names a reference computes (by `resourceNames` when it names the object
//!   literally) and `list` where a selector needs it.
//! - `<name>-dry-run` (ClusterRole + ClusterRoleBinding), the dry-run writes: `create`,
//!   `patch` on each child kind but Secret. Kubernetes has no dry-run verb: a request
//!   with `dryRun=All` is authorized as the write it simulates (RBAC runs before the
//!   request is handled, admission after, and both see a `create` or `patch`), so this is
//!   a real write permission on those kinds, which `rulebook diff` uses only for dry
//!   runs (its client's write gate never opens). Bind it knowingly.
//! - `<name>-secrets` (ClusterRole, bound only by RoleBindings), Secret references:
//!   `get` by `resourceNames` for literal names, `get` (never `list` or `watch`) for
//!   computed ones, `list` only where a selector needs it; bound in the namespaces the
//!   references name literally and those `--namespace` lists. No cluster-wide Secret read.
//!
//! Secret children get no permission at all: `diff` does not read or dry-run them and
//! reports them as not compared. Nor do Secret parents (a rule whose parents are Secrets
//! cannot be diffed with this role).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value as Json;

use super::{RbacOptions, add, binding, cluster_role, merge, plural_of, rule_of};
use crate::meta::split_api_version;
use crate::render::RuleSet;
use crate::rules::Reference;

/// On parent kinds and non-Secret child kinds.
pub const DIFF_READ_VERBS: &[&str] = &["get", "list"];
/// On non-Secret child kinds, for the dry-run applies (see the module's comment).
pub const DIFF_DRY_RUN_VERBS: &[&str] = &["create", "patch"];

/// A `(group, resource)` and the names granted on it.
type Named = BTreeMap<(String, String), (BTreeSet<String>, BTreeSet<String>)>;

/// The three parts of the diff role's needs.
#[derive(Default)]
struct DiffNeeds {
    reads: BTreeMap<(String, String), BTreeSet<String>>,
    reads_named: Named,
    dry_run: BTreeMap<(String, String), BTreeSet<String>>,
    secrets: BTreeMap<(String, String), BTreeSet<String>>,
    secrets_named: Named,
    /// Namespaces Secret references name literally.
    secret_namespaces: BTreeSet<String>,
}

fn is_secret(api_version: &str, kind: &str) -> bool {
    api_version == "v1" && kind == "Secret"
}

/// What `diff` does to reach a reference's objects: `get` one by name (literal or
/// not) or `list` by selector.
fn reference_verb(r: &Reference) -> (&'static str, Option<String>) {
    let literal = crate::render::cache_filter(r)
        .fields
        .map(|f| f.trim_start_matches("metadata.name=").to_string());
    match (literal, &r.object_name) {
        (Some(name), _) => ("get", Some(name)),
        (None, Some(_)) => ("get", None),
        (None, None) => ("list", None),
    }
}

fn gather(set: &RuleSet) -> DiffNeeds {
    let mut n = DiffNeeds::default();
    for r in set.rules.values() {
        let p = &r.rule.spec.parent;
        if !is_secret(&p.api_version, &p.kind) {
            let (group, _) = split_api_version(&p.api_version);
            let plural = plural_of(set, &p.api_version, &p.kind);
            add(&mut n.reads, group, &plural, DIFF_READ_VERBS);
        }
        for reference in &r.rule.spec.references {
            let (group, _) = split_api_version(&reference.api_version);
            let plural = plural_of(set, &reference.api_version, &reference.kind);
            let secret = is_secret(&reference.api_version, &reference.kind);
            if secret && let Some(Ok(ns)) = reference.literal_namespace() {
                n.secret_namespaces.insert(ns.to_string());
            }
            let (all, named) = if secret {
                (&mut n.secrets, &mut n.secrets_named)
            } else {
                (&mut n.reads, &mut n.reads_named)
            };
            match reference_verb(reference) {
                (verb, Some(name)) => {
                    let entry = named.entry((group.to_string(), plural)).or_default();
                    entry.0.insert(name);
                    entry.1.insert(verb.to_string());
                }
                (verb, None) => add(all, group, &plural, &[verb]),
            }
        }
        for c in &r.rule.spec.children {
            if is_secret(&c.api_version, &c.kind) {
                continue;
            }
            let (group, _) = split_api_version(&c.api_version);
            let plural = plural_of(set, &c.api_version, &c.kind);
            add(&mut n.reads, group, &plural, DIFF_READ_VERBS);
            add(&mut n.dry_run, group, &plural, DIFF_DRY_RUN_VERBS);
        }
    }
    n
}

/// The rules of a role: grants on every object, then by name.
fn rules(all: BTreeMap<(String, String), BTreeSet<String>>, named: Named) -> Vec<Json> {
    merge(all, named).into_iter().map(rule_of).collect()
}

/// The diff role's manifests (see the module's comment).
pub fn manifests(set: &RuleSet, opts: &RbacOptions) -> Vec<Json> {
    let n = gather(set);
    let name = &opts.name;
    let mut out = vec![
        cluster_role(name, rules(n.reads, n.reads_named)),
        binding(None, name, name, opts),
    ];
    if !n.dry_run.is_empty() {
        let dry = format!("{name}-dry-run");
        out.push(cluster_role(&dry, rules(n.dry_run, Named::new())));
        out.push(binding(None, &dry, &dry, opts));
    }
    if !n.secrets.is_empty() || !n.secrets_named.is_empty() {
        let secrets = format!("{name}-secrets");
        out.push(cluster_role(&secrets, rules(n.secrets, n.secrets_named)));
        let mut namespaces = n.secret_namespaces;
        namespaces.extend(opts.diff_namespaces.iter().cloned());
        for ns in namespaces {
            out.push(binding(Some(&ns), &secrets, &secrets, opts));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rbac::Need;

    /// Whether `need` is a grant on Secrets.
    fn on_secrets(need: &Need) -> bool {
        need.group.is_empty() && need.resource == "secrets"
    }

    fn shipped() -> RuleSet {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let read = crate::rules::read(&root.join("rules"), &root.join("templates"));
        crate::render::compile_read(&read, &crate::render::Limits::default())
            .unwrap_or_else(|d| panic!("the shipped rules load: {d:?}"))
    }

    fn options() -> RbacOptions {
        RbacOptions {
            name: "rulebook-diff".into(),
            service_account: ("ci".into(), "differ".into()),
            install_crds: false,
            leader_elect: false,
            sharding: false,
            lease_name: "rulebook".into(),
            diff_role: true,
            diff_namespaces: vec!["team-a".into()],
            webhooks: None,
            per_rule: false,
        }
    }

    /// On the shipped rules: nothing bound cluster-wide touches Secrets; the dry-run
    /// writes are a role of their own; the Secret reference of TeamApp (a computed name)
    /// is `get` only, bound in the one namespace named.
    #[test]
    fn the_shipped_rules_diff_role_reads_no_secret_cluster_wide() {
        let out = manifests(&shipped(), &options());
        let kinds: Vec<(&str, &str)> = out
            .iter()
            .map(|o| {
                (
                    o["kind"].as_str().unwrap_or(""),
                    o["metadata"]["name"].as_str().unwrap_or(""),
                )
            })
            .collect();
        assert_eq!(
            kinds,
            vec![
                ("ClusterRole", "rulebook-diff"),
                ("ClusterRoleBinding", "rulebook-diff"),
                ("ClusterRole", "rulebook-diff-dry-run"),
                ("ClusterRoleBinding", "rulebook-diff-dry-run"),
                ("ClusterRole", "rulebook-diff-secrets"),
                ("RoleBinding", "rulebook-diff-secrets"),
            ]
        );
        let grants = |o: &Json| -> Vec<Need> {
            o["rules"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| Need {
                    group: r["apiGroups"][0].as_str().unwrap_or("?").into(),
                    resource: r["resources"][0].as_str().unwrap_or("?").into(),
                    verbs: r["verbs"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect(),
                    resource_names: BTreeSet::new(),
                })
                .collect()
        };
        for role in [&out[0], &out[2]] {
            assert!(!grants(role).iter().any(on_secrets), "{role}");
        }
        let dry = grants(&out[2]);
        assert!(dry.iter().all(|n| n.verbs == verbs(DIFF_DRY_RUN_VERBS)));
        assert!(dry.iter().any(|n| n.resource == "deployments"));
        assert!(
            grants(&out[0])
                .iter()
                .all(|n| n.verbs.is_subset(&verbs(&["get", "list"])))
        );
        assert_eq!(
            out[4]["rules"],
            serde_json::json!([{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}])
        );
        assert_eq!(out[5]["metadata"]["namespace"], "team-a");
        assert_eq!(out[5]["roleRef"]["name"], "rulebook-diff-secrets");
    }

    fn verbs(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }
}
