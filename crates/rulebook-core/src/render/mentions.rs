//! What a rendered child names of the objects beside it: the Secrets, ConfigMaps,
//! ServiceAccounts and PersistentVolumeClaims its pods read, mount or run as, the
//! ServiceAccounts a binding grants to, the Namespace it goes in.
//!
//! A child that names a sibling depends on it: were the sibling's name taken by someone
//! else's object (a `Conflict`), the child would read, mount or grant to that object — a
//! Pod would run with someone else's Secret. So the reconcile applies such a child only
//! after the sibling, and not at all while the sibling failed (`reconcile::plan`), and
//! `rulebook check` warns about a child that names a sibling it does not `waitFor`
//! (`render::unwaited`).
//!
//! The reading goes by key wherever the key is (a Pod, a Deployment's or a CronJob's pod
//! template, a custom resource that spells them the same way), so it needs no schema of
//! each kind; a key taken for a reference when it is none only orders or holds an apply.

use serde_json::{Map, Value as Json};

/// A kind of object that other objects name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Named {
    Secret,
    ConfigMap,
    ServiceAccount,
    PersistentVolumeClaim,
    Namespace,
}

impl Named {
    /// Which of these `api_version`/`kind` is (core `v1` kinds only).
    pub fn of(api_version: &str, kind: &str) -> Option<Named> {
        if api_version != "v1" {
            return None;
        }
        Some(match kind {
            "Secret" => Named::Secret,
            "ConfigMap" => Named::ConfigMap,
            "ServiceAccount" => Named::ServiceAccount,
            "PersistentVolumeClaim" => Named::PersistentVolumeClaim,
            "Namespace" => Named::Namespace,
            _ => return None,
        })
    }

    pub fn kind(self) -> &'static str {
        match self {
            Named::Secret => "Secret",
            Named::ConfigMap => "ConfigMap",
            Named::ServiceAccount => "ServiceAccount",
            Named::PersistentVolumeClaim => "PersistentVolumeClaim",
            Named::Namespace => "Namespace",
        }
    }
}

/// One object a child names: its kind, its name, and the namespace the reference gives
/// (a binding's subject may name one; `None`: the child's own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mention<'a> {
    pub kind: Named,
    pub name: &'a str,
    pub namespace: Option<&'a str>,
}

/// Deeper than this nothing is read (rendered objects are bounded by the render anyway).
const MAX_DEPTH: usize = 64;

/// The objects `object` (a rendered child) names, in document order, possibly repeated.
/// A Secret's or ConfigMap's own content is data and names nothing; the top-level
/// `metadata` names only the child's namespace.
pub fn mentions(object: &Json) -> Vec<Mention<'_>> {
    let mut out = Vec::new();
    let Some(top) = object.as_object() else {
        return out;
    };
    if let Some(ns) = top
        .get("metadata")
        .and_then(|m| m.get("namespace"))
        .and_then(Json::as_str)
    {
        out.push(Mention {
            kind: Named::Namespace,
            name: ns,
            namespace: None,
        });
    }
    let api_version = top.get("apiVersion").and_then(Json::as_str).unwrap_or("");
    let kind = top.get("kind").and_then(Json::as_str).unwrap_or("");
    if matches!(
        Named::of(api_version, kind),
        Some(Named::Secret | Named::ConfigMap)
    ) {
        return out;
    }
    for (k, v) in top {
        if k != "metadata" {
            keyed(k, v, &mut out);
            walk(v, 0, &mut out);
        }
    }
    out
}

fn walk<'a>(value: &'a Json, depth: usize, out: &mut Vec<Mention<'a>>) {
    if depth > MAX_DEPTH {
        return;
    }
    match value {
        Json::Object(m) => {
            for (k, v) in m {
                keyed(k, v, out);
                walk(v, depth + 1, out);
            }
        }
        Json::Array(items) => {
            for v in items {
                walk(v, depth + 1, out);
            }
        }
        _ => {}
    }
}

/// What key `k` with value `v` names, by the keys of the core API: `secretKeyRef`,
/// `secretRef` and any `…SecretRef` (env, envFrom, CSI and other volume sources),
/// `secretName` (a secret volume, an Ingress's TLS), a projected volume's `secret`,
/// `imagePullSecrets`; `configMapKeyRef`, `configMapRef`, a `configMap` volume or
/// projection; `serviceAccountName` (and the older `serviceAccount`), a binding's
/// ServiceAccount `subjects`; `claimName`.
fn keyed<'a>(k: &str, v: &'a Json, out: &mut Vec<Mention<'a>>) {
    let mut push = |kind, name: Option<&'a str>, namespace| {
        if let Some(name) = name.filter(|n| !n.is_empty()) {
            out.push(Mention {
                kind,
                name,
                namespace,
            });
        }
    };
    let field = |f: &str| v.get(f).and_then(Json::as_str);
    match k {
        "secretKeyRef" | "secretRef" => push(Named::Secret, field("name"), None),
        _ if k.ends_with("SecretRef") || k.ends_with("SecretKeyRef") => {
            push(Named::Secret, field("name"), None)
        }
        "secretName" => push(Named::Secret, v.as_str(), None),
        "secret" => push(Named::Secret, field("name"), None),
        "configMapKeyRef" | "configMapRef" | "configMap" => {
            push(Named::ConfigMap, field("name"), None)
        }
        "serviceAccountName" | "serviceAccount" => push(Named::ServiceAccount, v.as_str(), None),
        "claimName" => push(Named::PersistentVolumeClaim, v.as_str(), None),
        "imagePullSecrets" => {
            for item in v.as_array().into_iter().flatten() {
                push(Named::Secret, item.get("name").and_then(Json::as_str), None);
            }
        }
        "subjects" => {
            for item in v
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Json::as_object)
            {
                if str_of(item, "kind") == Some("ServiceAccount") {
                    push(
                        Named::ServiceAccount,
                        str_of(item, "name"),
                        str_of(item, "namespace"),
                    );
                }
            }
        }
        _ => {}
    }
}

fn str_of<'a>(m: &'a Map<String, Json>, key: &str) -> Option<&'a str> {
    m.get(key).and_then(Json::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn names(object: &Json) -> Vec<(Named, &str, Option<&str>)> {
        mentions(object)
            .into_iter()
            .map(|m| (m.kind, m.name, m.namespace))
            .collect()
    }

    #[test]
    fn a_pod_template_names_what_it_reads_mounts_and_runs_as() {
        let deployment = json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "d", "namespace": "team", "labels": {"secretName": "no"}},
            "spec": {"template": {"spec": {
                "serviceAccountName": "runner",
                "imagePullSecrets": [{"name": "pull"}],
                "containers": [{
                    "env": [
                        {"name": "A", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "k"}}},
                        {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "k"}}}
                    ],
                    "envFrom": [{"secretRef": {"name": "all"}}, {"configMapRef": {"name": "more"}}]
                }],
                "volumes": [
                    {"name": "v1", "secret": {"secretName": "mounted"}},
                    {"name": "v2", "configMap": {"name": "files"}},
                    {"name": "v3", "persistentVolumeClaim": {"claimName": "data"}},
                    {"name": "v4", "projected": {"sources": [{"secret": {"name": "proj"}}]}},
                    {"name": "v5", "csi": {"driver": "x", "nodePublishSecretRef": {"name": "csi"}}}
                ]
            }}}
        });
        let got = names(&deployment);
        for want in [
            (Named::Namespace, "team"),
            (Named::ServiceAccount, "runner"),
            (Named::Secret, "pull"),
            (Named::Secret, "creds"),
            (Named::ConfigMap, "settings"),
            (Named::Secret, "all"),
            (Named::ConfigMap, "more"),
            (Named::Secret, "mounted"),
            (Named::ConfigMap, "files"),
            (Named::PersistentVolumeClaim, "data"),
            (Named::Secret, "proj"),
            (Named::Secret, "csi"),
        ] {
            assert!(
                got.iter().any(|(k, n, _)| (*k, *n) == want),
                "{want:?} not in {got:?}"
            );
        }
        // The top-level metadata names only the namespace.
        assert!(!got.iter().any(|(_, n, _)| *n == "no"), "{got:?}");
    }

    #[test]
    fn bindings_name_their_service_account_subjects() {
        let binding = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "b"},
            "subjects": [
                {"kind": "ServiceAccount", "name": "runner"},
                {"kind": "ServiceAccount", "name": "other", "namespace": "elsewhere"},
                {"kind": "Group", "name": "devs"}
            ],
            "roleRef": {"kind": "Role", "name": "r"}
        });
        assert_eq!(
            names(&binding),
            [
                (Named::ServiceAccount, "runner", None),
                (Named::ServiceAccount, "other", Some("elsewhere"))
            ]
        );
    }

    #[test]
    fn data_names_nothing() {
        for kind in ["Secret", "ConfigMap"] {
            let o = json!({"apiVersion": "v1", "kind": kind, "metadata": {"name": "x"},
                           "data": {"secretName": "y", "serviceAccountName": "z"}});
            assert!(names(&o).is_empty(), "{kind}");
        }
        assert_eq!(Named::of("v1", "Secret"), Some(Named::Secret));
        assert_eq!(Named::of("example.com/v1", "Secret"), None);
    }
}
