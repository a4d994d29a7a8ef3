//! Before a rule starts: does this process hold every permission the rule needs? Asked
//! of the API server (SelfSubjectAccessReview), so a missing verb stops only its rule,
//! with a message naming it, instead of failing its watches and writes one by one.

use std::collections::BTreeMap;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, ApiResource, PostParams};

use crate::rbac::{CHILD_VERBS, PARENT_VERBS, STATUS_VERBS};

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

/// Asks the API server whether this process may do everything `rule` needs.
/// `Err` lists what is missing, e.g. `list, watch mywebs.operator.k8s-summit.org`.
pub(super) async fn check_rule_permissions(
    client: &Client,
    rule: &CompiledRule,
    parent: &ApiResource,
    child_kinds: &[ApiResource],
    namespace: Option<&str>,
) -> Result<(), PermissionError> {
    let mut wanted: Vec<(&ApiResource, Option<&str>, &[&str])> = vec![
        (parent, None, PARENT_VERBS),
        (parent, Some("status"), STATUS_VERBS),
    ];
    for k in child_kinds {
        wanted.push((k, None, CHILD_VERBS));
    }
    let api: Api<SelfSubjectAccessReview> = Api::all(client.clone());
    let mut missing: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (ar, sub, verbs) in wanted {
        for verb in verbs {
            let review = SelfSubjectAccessReview {
                spec: SelfSubjectAccessReviewSpec {
                    resource_attributes: Some(ResourceAttributes {
                        group: Some(ar.group.clone()),
                        resource: Some(ar.plural.clone()),
                        subresource: sub.map(str::to_string),
                        verb: Some(verb.to_string()),
                        namespace: namespace.map(str::to_string),
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
        let _ = rule;
        Err(PermissionError::Missing(
            missing
                .into_iter()
                .map(|(res, verbs)| format!("{} {res}", verbs.join(", ")))
                .collect::<Vec<_>>()
                .join("; "),
        ))
    }
}
