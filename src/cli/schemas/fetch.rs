//! The cluster's schemas for `check --kubeconfig` and `test --kubeconfig`: the discovery
//! index `/openapi/v3`, then the document of each group-version the rules' children use
//! (`/openapi/v3/apis/<group>/<version>`, `/openapi/v3/api/v1`, by the index's
//! `serverRelativeURL`, which carries the content hash the API server caches by). A
//! group-version the cluster does not serve is left out: its kinds are then reported as
//! not checked, as any kind without a schema.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value as Json;

use crate::openapi::Catalog;

/// The documents of `api_versions` the cluster of `kubeconfig` serves.
pub async fn catalog(kubeconfig: &Path, api_versions: &BTreeSet<String>) -> Result<Catalog> {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("cannot read {}", kubeconfig.display()))?;
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await?;
    let client = kube::Client::try_from(config)?;
    let index: Json = get(&client, "/openapi/v3").await?;
    let mut catalog = Catalog::new();
    for av in api_versions {
        let key = discovery_path(av);
        let Some(url) = index
            .pointer(&format!(
                "/paths/{}",
                key.replace('~', "~0").replace('/', "~1")
            ))
            .and_then(|p| p.get("serverRelativeURL"))
            .and_then(Json::as_str)
        else {
            continue;
        };
        let doc: Json = get(&client, url).await?;
        catalog
            .add_document(doc)
            .with_context(|| format!("the cluster's {url}"))?;
    }
    Ok(catalog)
}

/// `api/v1` for the core group, `apis/<group>/<version>` for the others.
fn discovery_path(api_version: &str) -> String {
    if api_version.contains('/') {
        format!("apis/{api_version}")
    } else {
        format!("api/{api_version}")
    }
}

async fn get(client: &kube::Client, url: &str) -> Result<Json> {
    let request = http::Request::get(url)
        .header(http::header::ACCEPT, "application/json")
        .body(Vec::new())?;
    let text = client
        .request_text(request)
        .await
        .with_context(|| format!("GET {url}"))?;
    serde_json::from_str(&text).with_context(|| format!("GET {url}: not JSON"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_versions_map_to_their_discovery_paths() {
        assert_eq!(discovery_path("v1"), "api/v1");
        assert_eq!(discovery_path("apps/v1"), "apis/apps/v1");
    }
}
