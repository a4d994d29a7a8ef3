//! The built-in kinds' schemas `check` and `test` use without `--kubeconfig` or
//! `--openapi`: the OpenAPI v3 documents of Kubernetes v1.36, the version the project
//! tests against, saved by `make openapi` (scripts/openapi-save.py) into `openapi/` and
//! built into the binary (about 0.5 MB of text), so that `rulebook check` works the same
//! from any directory and in CI without a cluster. A test keeps this list equal to the
//! directory's files.

use anyhow::{Context, Result};

use crate::openapi::Catalog;

/// The Kubernetes version of the saved schemas.
pub const VERSION: &str = "v1.36";

/// Every file of `openapi/v1.36/`, in name order.
pub const DOCUMENTS: &[&str] = &[
    include_str!("../../../openapi/v1.36/api__v1.json"),
    include_str!("../../../openapi/v1.36/apis__admissionregistration.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__apiextensions.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__apiregistration.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__apps__v1.json"),
    include_str!("../../../openapi/v1.36/apis__authentication.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__authorization.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__autoscaling__v1.json"),
    include_str!("../../../openapi/v1.36/apis__autoscaling__v2.json"),
    include_str!("../../../openapi/v1.36/apis__batch__v1.json"),
    include_str!("../../../openapi/v1.36/apis__certificates.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__coordination.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__discovery.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__events.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__flowcontrol.apiserver.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__networking.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__node.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__policy__v1.json"),
    include_str!("../../../openapi/v1.36/apis__rbac.authorization.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__resource.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__scheduling.k8s.io__v1.json"),
    include_str!("../../../openapi/v1.36/apis__storage.k8s.io__v1.json"),
];

/// The built-in documents, parsed.
pub fn catalog() -> Result<Catalog> {
    let mut catalog = Catalog::new();
    for (i, text) in DOCUMENTS.iter().enumerate() {
        let doc = serde_json::from_str(text)
            .with_context(|| format!("built-in OpenAPI document {i}: not JSON"))?;
        catalog
            .add_document(doc)
            .with_context(|| format!("built-in OpenAPI document {i}"))?;
    }
    Ok(catalog)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_saved_document_is_built_in_and_knows_the_common_kinds() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("openapi")
            .join(VERSION);
        let files = std::fs::read_dir(&dir)
            .expect("openapi/<version> exists")
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .count();
        assert_eq!(
            files,
            DOCUMENTS.len(),
            "src/cli/schemas/builtin.rs lists every file of {}",
            dir.display()
        );
        let c = catalog().expect("the built-in documents parse");
        for (av, kind) in [
            ("v1", "ConfigMap"),
            ("v1", "Secret"),
            ("v1", "Service"),
            ("apps/v1", "Deployment"),
            ("networking.k8s.io/v1", "NetworkPolicy"),
            ("rbac.authorization.k8s.io/v1", "RoleBinding"),
            ("batch/v1", "CronJob"),
        ] {
            assert!(c.knows(av, kind), "{av} {kind}");
        }
    }
}
