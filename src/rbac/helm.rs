//! `rulebook rbac --helm-values`: the same least-privilege RBAC as `rulebook rbac`, as a
//! values file the Helm chart (deploy/helm/rulebook) renders, so the chart's RBAC and the
//! kustomize base's `rbac.yaml` come from one source: [`super::manifests`]. The chart
//! binds the rules to its own ServiceAccount and names the roles after its release; what
//! the rules grant by name (the webhook configurations, the certificates' Secret) is
//! recorded under `rbac.generatedFor`, and the chart refuses to render when the operator
//! it deploys would use other names than the ones granted.

use serde_json::{Value as Json, json};

use super::RbacOptions;
use crate::render::RuleSet;

/// Why the options cannot be expressed as chart values.
#[derive(Debug, thiserror::Error)]
pub enum HelmValuesError {
    #[error(
        "--helm-values cannot be combined with {0}: the chart renders the operator's role only"
    )]
    Unsupported(&'static str),
}

/// The values document: `rbac.clusterRules` (the ClusterRole's rules),
/// `rbac.webhookSecretRules` (the Role in the release's namespace, with `--webhooks`) and
/// `rbac.generatedFor` (the options that shaped them).
pub fn values(set: &RuleSet, opts: &RbacOptions) -> Result<Json, HelmValuesError> {
    if opts.diff_role {
        return Err(HelmValuesError::Unsupported("--diff-role"));
    }
    if opts.per_rule {
        return Err(HelmValuesError::Unsupported("--per-rule"));
    }
    let objects = super::manifests(set, opts);
    let rules_of = |kind: &str, name: &str| {
        objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .map(|o| o["rules"].clone())
    };
    let cluster_rules = rules_of("ClusterRole", opts.name.as_str()).unwrap_or_else(|| json!([]));
    let webhook_secret_rules = rules_of("Role", format!("{}-webhook-secret", opts.name).as_str())
        .unwrap_or_else(|| json!([]));
    let (configuration, secret) = match &opts.webhooks {
        Some((configuration, (_, secret))) => (json!(configuration), json!(secret)),
        None => (Json::Null, Json::Null),
    };
    Ok(json!({
        "rbac": {
            "generatedFor": {
                "installCrds": opts.install_crds,
                "leaderElect": opts.leader_elect,
                "sharding": opts.sharding,
                "leaseName": opts.lease_name,
                "webhooks": opts.webhooks.is_some(),
                "webhookConfiguration": configuration,
                "webhookSecret": secret,
            },
            "clusterRules": cluster_rules,
            "webhookSecretRules": webhook_secret_rules,
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(webhooks: bool) -> RbacOptions {
        RbacOptions {
            name: "rulebook".into(),
            service_account: ("rulebook-system".into(), "rulebook".into()),
            install_crds: true,
            leader_elect: false,
            sharding: false,
            lease_name: "rulebook".into(),
            diff_role: false,
            diff_namespaces: Vec::new(),
            webhooks: webhooks.then(|| {
                (
                    "rulebook".to_string(),
                    (
                        "rulebook-system".to_string(),
                        "rulebook-webhook".to_string(),
                    ),
                )
            }),
            per_rule: false,
        }
    }

    /// The values hold exactly the rules of the roles `rulebook rbac` prints.
    #[test]
    fn the_values_are_the_manifests_rules() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let read = crate::rules::read(&root.join("rules"), &root.join("templates"));
        let set = crate::render::compile_read(&read, &crate::render::Limits::default()).unwrap();
        for webhooks in [false, true] {
            let o = opts(webhooks);
            let v = values(&set, &o).unwrap();
            let m = super::super::manifests(&set, &o);
            assert_eq!(v["rbac"]["clusterRules"], m[0]["rules"]);
            assert!(
                v["rbac"]["clusterRules"]
                    .as_array()
                    .is_some_and(|r| !r.is_empty())
            );
            let secret = m.iter().find(|o| o["kind"] == "Role");
            assert_eq!(webhooks, secret.is_some());
            assert_eq!(
                v["rbac"]["webhookSecretRules"],
                secret.map_or(json!([]), |s| s["rules"].clone())
            );
            assert_eq!(v["rbac"]["generatedFor"]["webhooks"], json!(webhooks));
        }
        let mut diff = opts(false);
        diff.diff_role = true;
        assert!(values(&set, &diff).is_err());
    }
}
