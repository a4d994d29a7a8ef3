//! Least-privilege RBAC derived from the rules: what each rule needs, as a ClusterRole
//! (`rulebook rbac`), and the same list checked against the running identity with
//! SelfSubjectAccessReviews before a rule starts.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value as Json, json};

use crate::meta::split_api_version;
use crate::render::{CompiledRule, RuleSet};

mod diff;
pub mod helm;
mod per_rule;
mod policies;
pub use diff::{DIFF_DRY_RUN_VERBS, DIFF_READ_VERBS};

pub const PARENT_VERBS: &[&str] = &["get", "list", "watch"];
pub const STATUS_VERBS: &[&str] = &["patch"];
/// On every parent kind: Rulebook's finalizer and the record of `Orphan` kinds (`teardown`).
pub const FINALIZER_VERBS: &[&str] = &["patch"];
pub const CHILD_VERBS: &[&str] = &["get", "list", "watch", "create", "patch", "delete"];
/// On referenced kinds (`spec.references`): read only.
pub const REF_VERBS: &[&str] = &["get", "list", "watch"];

/// One permission a rule needs: `verbs` on `group`/`resource`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Need {
    pub group: String,
    /// `plural` or `plural/subresource`.
    pub resource: String,
    pub verbs: BTreeSet<String>,
    /// Only these objects (`resourceNames`); empty: every object.
    pub resource_names: BTreeSet<String>,
}

pub use crate::meta::guess_plural;

/// The plural of a kind: from a rule's CRD section when a rule defines that kind.
pub fn plural_of(set: &RuleSet, api_version: &str, kind: &str) -> String {
    for r in set.rules.values() {
        let p = &r.rule.spec.parent;
        if p.api_version.as_str() == api_version
            && p.kind.as_str() == kind
            && let Some(crd) = &r.rule.spec.crd
        {
            return crate::rules::crd::plural(crd, kind);
        }
    }
    guess_plural(kind)
}

fn add(
    needs: &mut BTreeMap<(String, String), BTreeSet<String>>,
    group: &str,
    resource: &str,
    verbs: &[&str],
) {
    needs
        .entry((group.to_string(), resource.to_string()))
        .or_default()
        .extend(verbs.iter().map(|v| v.to_string()));
}

/// Everything a rule set needs, merged and sorted.
pub fn needs(set: &RuleSet) -> Vec<Need> {
    needs_of(set, set.rules.values().map(|r| &**r))
}

/// Everything `rules` (of `set`, which says the plurals of the kinds it defines) need,
/// merged and sorted: the whole set's (`rulebook rbac`), or one rule's (`--per-rule`).
pub fn needs_of<'a>(
    set: &RuleSet,
    rules: impl Iterator<Item = &'a CompiledRule> + Clone,
) -> Vec<Need> {
    let mut needs = BTreeMap::new();
    // References by literal name: (group, resource) → names.
    let mut named: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
    for r in rules.clone() {
        let p = &r.rule.spec.parent;
        let (group, _) = split_api_version(&p.api_version);
        let plural = plural_of(set, &p.api_version, &p.kind);
        add(&mut needs, group, &plural, PARENT_VERBS);
        add(&mut needs, group, &format!("{plural}/status"), STATUS_VERBS);
        // Adding and removing Rulebook's finalizer and the record of `Orphan` kinds,
        // and marking the finalize step done: also for a rule that needs none now,
        // whose parents may carry what an earlier version put there (its finalizer
        // comes off, a teardown takes a kind off the record).
        add(&mut needs, group, &plural, FINALIZER_VERBS);
        // A `namespaceSelector` reads the labels of the parents' namespaces (a watch of
        // the Namespaces, metadata only: engine/wiring.rs).
        if r.selects_by_namespace() {
            add(&mut needs, "", "namespaces", &["get", "list", "watch"]);
        }
        for reference in &r.rule.spec.references {
            let (group, _) = split_api_version(&reference.api_version);
            let plural = plural_of(set, &reference.api_version, &reference.kind);
            match crate::render::cache_filter(reference).fields {
                // The cache watches that one object (a field selector on its name), which
                // Kubernetes authorizes by name for list and watch too.
                Some(f) => {
                    named
                        .entry((group.to_string(), plural))
                        .or_default()
                        .insert(f.trim_start_matches("metadata.name=").to_string());
                }
                None => add(&mut needs, group, &plural, REF_VERBS),
            }
        }
        for c in &r.rule.spec.children {
            let (group, _) = split_api_version(&c.api_version);
            let plural = plural_of(set, &c.api_version, &c.kind);
            add(&mut needs, group, &plural, CHILD_VERBS);
        }
    }
    let by_name = named
        .into_iter()
        .map(|(key, names)| (key, (names, verbs_of(REF_VERBS))))
        .collect();
    let mut out = merge(needs, by_name);
    out.extend(bind_needs(rules));
    out.sort();
    out
}

/// `bind` on the roles that RoleBinding and ClusterRoleBinding children name, by name
/// (`render::role_refs`): what the API server asks of whoever creates a binding to a
/// role with permissions it does not hold itself. Never `escalate`, never every role.
fn bind_needs<'a>(rules: impl Iterator<Item = &'a CompiledRule>) -> Vec<Need> {
    let mut by_kind: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for r in rules {
        for (kind, name) in crate::render::role_refs::bindable(r) {
            let resource = if kind == "ClusterRole" {
                "clusterroles"
            } else {
                "roles"
            };
            by_kind
                .entry(resource.to_string())
                .or_default()
                .insert(name);
        }
    }
    by_kind
        .into_iter()
        .map(|(resource, names)| Need {
            group: crate::render::role_refs::RBAC_GROUP.to_string(),
            resource,
            verbs: verbs_of(&["bind"]),
            resource_names: names,
        })
        .collect()
}

fn verbs_of(verbs: &[&str]) -> BTreeSet<String> {
    verbs.iter().map(|v| v.to_string()).collect()
}

/// `needs` on every object of a resource, and `named` (names, verbs) on some: one list,
/// sorted, without a by-name grant that a grant on every object already covers.
fn merge(
    needs: BTreeMap<(String, String), BTreeSet<String>>,
    named: BTreeMap<(String, String), (BTreeSet<String>, BTreeSet<String>)>,
) -> Vec<Need> {
    let mut out: Vec<Need> = Vec::new();
    for ((group, resource), (names, verbs)) in named {
        if needs
            .get(&(group.clone(), resource.clone()))
            .is_some_and(|have: &BTreeSet<String>| verbs.is_subset(have))
        {
            continue;
        }
        out.push(Need {
            group,
            resource,
            verbs,
            resource_names: names,
        });
    }
    out.extend(needs.into_iter().map(|((group, resource), verbs)| Need {
        group,
        resource,
        verbs,
        resource_names: BTreeSet::new(),
    }));
    out.sort();
    out
}

/// A ClusterRole rule granting one need.
fn rule_of(n: Need) -> Json {
    let mut rule = json!({
        "apiGroups": [n.group],
        "resources": [n.resource],
        "verbs": n.verbs.into_iter().collect::<Vec<_>>(),
    });
    if !n.resource_names.is_empty() {
        rule["resourceNames"] = json!(n.resource_names);
    }
    rule
}

#[derive(Clone, Debug)]
pub struct RbacOptions {
    pub name: String,
    pub service_account: (String, String),
    pub install_crds: bool,
    pub leader_elect: bool,
    /// What `run --sharding namespace` needs (its members' Leases).
    pub sharding: bool,
    /// The Lease `run --leader-elect` uses (`run --lease-name`).
    pub lease_name: String,
    /// The role of `rulebook diff` instead of the operator's.
    pub diff_role: bool,
    /// With `diff_role`: the namespaces whose parents' Secret references `rulebook diff`
    /// may read (RoleBindings there).
    pub diff_namespaces: Vec<String>,
    /// What `run --webhook-url/--webhook-service` needs: the webhook configurations of
    /// this name, and the certificates' Secret `(namespace, name)`.
    pub webhooks: Option<(String, (String, String))>,
    /// `--per-rule`: each rule with `spec.serviceAccount` gets its account and a role of
    /// its own; the operator's role keeps the rest and `impersonate` on those accounts.
    pub per_rule: bool,
}

/// What `run --install-crds` does to a CRD: read it (`get`), apply it (`patch`; an apply
/// that creates the CRD is also authorized as `create` on its name), and wait until it
/// is Established (a `list` and `watch` with a field selector on its name).
pub const CRD_VERBS: &[&str] = &["create", "get", "list", "patch", "watch"];
/// What leader election does to its Lease: read, renew or take over (`update`), and,
/// on standbys, `list` and `watch` it with a field selector on its name.
pub const LEASE_VERBS: &[&str] = &["get", "list", "update", "watch"];

/// A ClusterRole with exactly what the rules need, and its ClusterRoleBinding. Writes
/// to cluster-wide kinds Rulebook does not own are limited by name (`resourceNames`):
/// CRDs to those the rules define, Leases to the one Lease.
pub fn manifests(set: &RuleSet, opts: &RbacOptions) -> Vec<Json> {
    if opts.diff_role {
        return diff::manifests(set, opts);
    }
    // `--per-rule`: the rules with an account of their own are granted to it instead.
    let own = set
        .rules
        .values()
        .map(|r| &**r)
        .filter(|r| !opts.per_rule || r.rule.spec.service_account.is_none());
    let mut rules: Vec<Json> = needs_of(set, own).into_iter().map(rule_of).collect();
    rules.push(events_rule());
    if opts.per_rule {
        rules.extend(per_rule::operator_reads(set, opts));
    }
    // SelfSubjectAccessReviews (the start-up permission check) are allowed to every
    // authenticated user by the built-in system:basic-user role.
    if opts.install_crds {
        let crds: BTreeSet<String> = set
            .rules
            .values()
            .filter_map(|r| crate::rules::crd::crd_name(&r.rule))
            .collect();
        // Kubernetes authorizes the `create` of a server-side apply by the object's name,
        // so every verb is limited to the rules' CRDs. No CRD in the rules: nothing.
        if !crds.is_empty() {
            rules.push(json!({
                "apiGroups": ["apiextensions.k8s.io"],
                "resources": ["customresourcedefinitions"],
                "resourceNames": crds,
                "verbs": CRD_VERBS,
            }));
        }
    }
    if opts.install_crds {
        rules.extend(migration_rules(set));
    }
    if opts.leader_elect {
        rules.push(json!({
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [opts.lease_name],
            "verbs": LEASE_VERBS,
        }));
        // A plain `create` (POST) has no name in its URL, so Kubernetes cannot limit it
        // with resourceNames: this is create on every Lease. A namespaced Role (see
        // deploy/base/leader-election.yaml) confines it to one namespace.
        rules.push(json!({
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["create"],
        }));
    }
    if let Some((configuration, _)) = &opts.webhooks {
        // Server-side apply that creates is authorized as `create` on the name too.
        rules.push(json!({
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["mutatingwebhookconfigurations", "validatingwebhookconfigurations"],
            "resourceNames": [configuration],
            "verbs": WEBHOOK_CONFIG_VERBS,
        }));
    }
    // The admission policies of `cel:` keys (src/policies.rs), by name.
    rules.extend(policies::rbac_rules(set));
    if opts.sharding {
        // Member Leases are named after the members: no resourceNames. The coordinator
        // also counts parents (list, already granted on every parent kind). This grant
        // covers the storage migrations' Leases too (`rulebook-migration-<CRD name>`,
        // operator/migrations.rs): a by-name grant of them would add nothing to it.
        rules.push(json!({
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
        }));
    }
    let mut out = bind(rules, opts);
    if let Some((_, (ns, secret))) = &opts.webhooks {
        out.extend(secret_role(ns, secret, opts));
    }
    if opts.per_rule {
        out.extend(per_rule::manifests(set, opts));
    }
    out
}

/// Events about the parents (and the operator's own, about its caches).
fn events_rule() -> Json {
    json!({"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]})
}

/// What `run` does to its webhook configurations: read, apply (create), delete.
pub const WEBHOOK_CONFIG_VERBS: &[&str] = &["create", "delete", "get", "patch"];
/// What every replica does to the certificates' Secret: read it, and replace it with the
/// resourceVersion it read.
pub const WEBHOOK_SECRET_VERBS: &[&str] = &["get", "update"];

/// A Role in the Secret's namespace: `get` and `update` on the one Secret, and `create`,
/// which Kubernetes cannot limit to a name (a POST has none): a namespaced Role confines
/// it to that namespace rather than every namespace's Secrets.
fn secret_role(ns: &str, secret: &str, opts: &RbacOptions) -> Vec<Json> {
    let name = format!("{}-webhook-secret", opts.name);
    vec![
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": name, "namespace": ns, "labels": labels()},
            "rules": [
                {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [secret], "verbs": WEBHOOK_SECRET_VERBS},
                {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
            ],
        }),
        role_binding(ns, &name, opts),
    ]
}

/// What the storage migration of `run --install-crds` needs for the rules listing
/// versions (`spec.crd.versions`; engine/migrate.rs): `update` on their parents (each
/// stored object is replaced with itself) and `patch` on their CRDs' status (to trim
/// `status.storedVersions`), by name.
fn migration_rules(set: &RuleSet) -> Vec<Json> {
    let versioned: Vec<_> = set
        .rules
        .values()
        .filter(|r| {
            r.rule
                .spec
                .crd
                .as_ref()
                .is_some_and(|c| !c.versions.is_empty())
        })
        .collect();
    let names: BTreeSet<String> = versioned
        .iter()
        .filter_map(|r| crate::rules::crd::crd_name(&r.rule))
        .collect();
    if names.is_empty() {
        return Vec::new();
    }
    let mut out = vec![json!({
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions/status"],
        "resourceNames": names,
        "verbs": ["patch"],
    })];
    for r in versioned {
        let p = &r.rule.spec.parent;
        let (group, _) = split_api_version(&p.api_version);
        out.push(json!({
            "apiGroups": [group],
            "resources": [plural_of(set, &p.api_version, &p.kind)],
            "verbs": ["update"],
        }));
    }
    out
}

/// A ClusterRole with `rules`, and its binding to the options' ServiceAccount.
fn bind(rules: Vec<Json>, opts: &RbacOptions) -> Vec<Json> {
    vec![
        cluster_role(&opts.name, rules),
        binding(None, &opts.name, &opts.name, opts),
    ]
}

fn labels() -> Json {
    json!({"app.kubernetes.io/name": "rulebook", "app.kubernetes.io/managed-by": "rulebook"})
}

fn cluster_role(name: &str, rules: Vec<Json>) -> Json {
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": labels()},
        "rules": rules,
    })
}

/// A RoleBinding `name` in `ns` of the Role `name` to the options' ServiceAccount.
fn role_binding(ns: &str, name: &str, opts: &RbacOptions) -> Json {
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": ns, "labels": labels()},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{
            "kind": "ServiceAccount",
            "namespace": opts.service_account.0,
            "name": opts.service_account.1,
        }],
    })
}

/// A binding of ClusterRole `role` to the options' ServiceAccount: cluster-wide, or in
/// `namespace` only (a RoleBinding).
fn binding(namespace: Option<&str>, name: &str, role: &str, opts: &RbacOptions) -> Json {
    let mut metadata = json!({"name": name, "labels": labels()});
    if let Some(ns) = namespace {
        metadata["namespace"] = json!(ns);
    }
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": if namespace.is_some() { "RoleBinding" } else { "ClusterRoleBinding" },
        "metadata": metadata,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{
            "kind": "ServiceAccount",
            "namespace": opts.service_account.0,
            "name": opts.service_account.1,
        }],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--webhooks`: the two configurations by name, and the Secret in a namespaced Role
    /// (create cannot be limited by name, so it must not be cluster-wide).
    #[test]
    fn webhooks_are_granted_by_name_and_the_secret_in_its_namespace() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let read = crate::rules::read(&root.join("rules"), &root.join("templates"));
        let set = crate::render::compile_read(&read, &crate::render::Limits::default()).unwrap();
        let opts = RbacOptions {
            name: "rulebook".into(),
            service_account: ("rulebook-system".into(), "rulebook".into()),
            install_crds: false,
            leader_elect: false,
            sharding: false,
            lease_name: "rulebook".into(),
            diff_role: false,
            diff_namespaces: vec![],
            webhooks: Some(("hooks".into(), ("ops".into(), "certs".into()))),
            per_rule: false,
        };
        let out = manifests(&set, &opts);
        let cluster_rules = out[0]["rules"].as_array().unwrap();
        let hooks = cluster_rules
            .iter()
            .find(|r| r["apiGroups"] == json!(["admissionregistration.k8s.io"]))
            .expect("the configurations");
        assert_eq!(hooks["resourceNames"], json!(["hooks"]));
        assert_eq!(hooks["verbs"], json!(["create", "delete", "get", "patch"]));
        assert!(
            !cluster_rules
                .iter()
                .any(|r| r["resourceNames"] == json!(["certs"])),
            "the certificates' Secret is granted in its namespace only"
        );
        let role = out.iter().find(|o| o["kind"] == "Role").expect("a Role");
        assert_eq!(role["metadata"]["namespace"], "ops");
        assert_eq!(role["rules"][0]["resourceNames"], json!(["certs"]));
        assert_eq!(role["rules"][0]["verbs"], json!(["get", "update"]));
        assert_eq!(role["rules"][1]["verbs"], json!(["create"]));
        let binding = out
            .iter()
            .find(|o| o["kind"] == "RoleBinding")
            .expect("bound");
        assert_eq!(binding["subjects"][0]["name"], "rulebook");
    }

    /// `--sharding --install-crds` with a versioned rule: what the storage migration
    /// under its own Lease needs (operator/migrations.rs): its Lease (get, list, watch,
    /// create, update), `update` on the parents in every namespace, the CRD's status.
    #[test]
    fn a_sharded_storage_migration_is_granted_its_lease_and_every_namespace() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/versioned");
        let read = crate::rules::read(&root.join("rules"), &root.join("templates"));
        let set = crate::render::compile_read(&read, &crate::render::Limits::default()).unwrap();
        let opts = RbacOptions {
            name: "rulebook".into(),
            service_account: ("rulebook-system".into(), "rulebook".into()),
            install_crds: true,
            leader_elect: false,
            sharding: true,
            lease_name: "rulebook".into(),
            diff_role: false,
            diff_namespaces: vec![],
            webhooks: None,
            per_rule: false,
        };
        let out = manifests(&set, &opts);
        let rules = out[0]["rules"].as_array().unwrap();
        let grants = |group: &str, resource: &str, verb: &str| {
            rules.iter().any(|r| {
                r["apiGroups"] == json!([group])
                    && r["resources"] == json!([resource])
                    && r.get("resourceNames").is_none()
                    && r["verbs"].as_array().unwrap().contains(&json!(verb))
            })
        };
        for verb in ["get", "list", "watch", "create", "update"] {
            assert!(grants("coordination.k8s.io", "leases", verb), "{verb}");
        }
        let parent = &set.rules.values().next().unwrap().rule.spec.parent;
        let (group, _) = split_api_version(&parent.api_version);
        let plural = plural_of(&set, &parent.api_version, &parent.kind);
        assert!(grants(group, &plural, "update"), "{rules:#?}");
        assert!(rules.iter().any(|r| r["resources"]
            == json!(["customresourcedefinitions/status"])
            && r["verbs"] == json!(["patch"])));
    }

    #[test]
    fn plurals_follow_kubernetes() {
        assert_eq!(guess_plural("ConfigMap"), "configmaps");
        assert_eq!(guess_plural("Ingress"), "ingresses");
        assert_eq!(guess_plural("NetworkPolicy"), "networkpolicies");
        assert_eq!(guess_plural("Gateway"), "gateways");
        assert_eq!(guess_plural("Endpoints"), "endpoints");
    }
}
