//! Before a rule starts: does this process hold every permission the rule needs? Asked
//! of the API server (SelfSubjectAccessReview), so a missing verb stops only its rule,
//! with a message naming it, instead of failing its watches and writes one by one.

use std::collections::BTreeMap;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, ApiResource, PostParams};

use crate::rbac::{CHILD_VERBS, PARENT_VERBS, REF_VERBS, STATUS_VERBS};

/// What a rule with a `namespaceSelector` does with the Namespaces.
const NAMESPACE_VERBS: &[&str] = &["get", "list", "watch"];

/// Why a rule's permissions are not (known to be) there.
#[derive(Debug, thiserror::Error)]
pub enum PermissionError {
    #[error("cannot check permissions: {0}")]
    Review(#[source] kube::Error),
    /// What is missing, e.g. `list, watch mywebs.operator.k8s-summit.org; delete secrets`.
    #[error("{0}")]
    Missing(String),
}
use crate::render::CompiledRule;

/// What the operator reads of a referenced kind: where its cache watches (a literal
/// namespace) and, for a literal `objectName`, the one object.
pub(super) struct RefAccess {
    pub ar: ApiResource,
    /// A cluster-scoped kind is watched cluster-wide: asked without a namespace.
    pub namespaced: bool,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

/// Asks the API server whether this process may do everything `rule` needs.
/// `Err` lists what is missing, e.g. `list, watch mywebs.operator.k8s-summit.org`.
pub(super) async fn check_rule_permissions(
    client: &Client,
    rule: &CompiledRule,
    parent: &ApiResource,
    child_kinds: &[ApiResource],
    ref_kinds: &[RefAccess],
    namespace: Option<&str>,
) -> Result<(), PermissionError> {
    // (kind, subresource, verbs, namespace, name)
    type Wanted<'a> = (
        &'a ApiResource,
        Option<&'a str>,
        &'a [&'a str],
        Option<&'a str>,
        Option<&'a str>,
    );
    let mut wanted: Vec<Wanted> = vec![
        (parent, None, PARENT_VERBS, namespace, None),
        (parent, Some("status"), STATUS_VERBS, namespace, None),
    ];
    for k in child_kinds {
        wanted.push((k, None, CHILD_VERBS, namespace, None));
    }
    for r in ref_kinds {
        wanted.push((
            &r.ar,
            None,
            REF_VERBS,
            if r.namespaced {
                r.namespace.as_deref().or(namespace)
            } else {
                None
            },
            r.name.as_deref(),
        ));
    }
    // A `namespaceSelector` reads the labels of the parents' namespaces (a watch of the
    // Namespaces, cluster-wide: engine/wiring.rs), as `rulebook rbac` grants.
    let namespaces = ApiResource::erase::<k8s_openapi::api::core::v1::Namespace>(&());
    if rule.selects_by_namespace() {
        wanted.push((&namespaces, None, NAMESPACE_VERBS, None, None));
    }
    let api: Api<SelfSubjectAccessReview> = Api::all(client.clone());
    let mut missing: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (ar, sub, verbs, namespace, name) in wanted {
        for verb in verbs {
            let review = SelfSubjectAccessReview {
                spec: SelfSubjectAccessReviewSpec {
                    resource_attributes: Some(ResourceAttributes {
                        group: Some(ar.group.clone()),
                        resource: Some(ar.plural.clone()),
                        subresource: sub.map(str::to_string),
                        verb: Some(verb.to_string()),
                        namespace: namespace.map(str::to_string),
                        name: name.map(str::to_string),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            let allowed = match api.create(&PostParams::default(), &review).await {
                Ok(r) => r.status.map(|s| s.allowed).unwrap_or(false),
                Err(e) => return Err(PermissionError::Review(e)),
            };
            if !allowed {
                let res = match (ar.group.as_str(), sub) {
                    ("", None) => ar.plural.clone(),
                    ("", Some(s)) => format!("{}/{s}", ar.plural),
                    (g, None) => format!("{}.{g}", ar.plural),
                    (g, Some(s)) => format!("{}.{g}/{s}", ar.plural),
                };
                missing.entry(res).or_default().push(verb.to_string());
            }
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(PermissionError::Missing(
            missing
                .into_iter()
                .map(|(res, verbs)| format!("{} {res}", verbs.join(", ")))
                .collect::<Vec<_>>()
                .join("; "),
        ))
    }
}
