//! Where a rollout lives in the cluster, so that every replica (and `rulebook rollout`)
//! sees the same: one ConfigMap per rule with the rollout state
//! (`rulebook-rollout-<rule>`), and one per rule version with its content
//! (`rulebook-rule-<rule>-<version>`: the rule and every template it uses, as JSON,
//! gzip-compressed), from which the old version is compiled again after a restart with
//! new files on disk. Versions are content-addressed (the name carries the version hash),
//! so saving one twice is one read.
//!
//! Compression: `flate2` (the common, well-kept gzip crate, pure Rust with its default
//! miniz_oxide back end).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::Arc;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use serde::{Deserialize, Serialize};

use crate::meta::labels::{MANAGED_BY, MANAGED_BY_VALUE};
use crate::render::{CompiledRule, Limits};
use crate::rollout::RolloutState;

/// The label naming the rule a rollout object belongs to.
pub const ROLLOUT_OF: &str = "rulebook.dev/rollout-of";
/// The label naming the version a version object holds.
pub const VERSION_LABEL: &str = "rulebook.dev/rollout-version";
const STATE_KEY: &str = "state";
const CONTENT_KEY: &str = "rule.json.gz";
/// The most bytes a stored version may inflate to (a ConfigMap holds at most 1 MiB
/// compressed; this bounds what a crafted object could make the operator allocate).
const MAX_INFLATED: u64 = 16 << 20;

/// Why a rollout object could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    Kube(#[from] kube::Error),
    #[error("rollout state of rule '{rule}' does not read: {source}")]
    State {
        rule: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("stored version {version} of rule '{rule}' does not read: {message}")]
    Content {
        rule: String,
        version: String,
        message: String,
    },
}

pub use crate::rollout::{state_name, version_name};

fn meta(name: String, rule: &str, version: Option<&str>) -> ObjectMeta {
    let mut labels = BTreeMap::from([
        (MANAGED_BY.to_string(), MANAGED_BY_VALUE.to_string()),
        (ROLLOUT_OF.to_string(), rule.to_string()),
    ]);
    if let Some(v) = version {
        labels.insert(VERSION_LABEL.to_string(), v.to_string());
    }
    ObjectMeta {
        name: Some(name),
        labels: Some(labels),
        ..Default::default()
    }
}

/// The rollout state of `rule` and its resourceVersion, if there is one.
pub async fn read_state(
    api: &Api<ConfigMap>,
    rule: &str,
) -> Result<Option<(RolloutState, Option<String>)>, StoreError> {
    let Some(cm) = api.get_opt(&state_name(rule)).await? else {
        return Ok(None);
    };
    parse_state(rule, &cm).map(|s| s.map(|s| (s, cm.metadata.resource_version.clone())))
}

/// The state a ConfigMap holds (none when it holds no `state`).
pub fn parse_state(rule: &str, cm: &ConfigMap) -> Result<Option<RolloutState>, StoreError> {
    let Some(text) = cm.data.as_ref().and_then(|d| d.get(STATE_KEY)) else {
        return Ok(None);
    };
    serde_json::from_str(text)
        .map(Some)
        .map_err(|source| StoreError::State {
            rule: rule.to_string(),
            source,
        })
}

/// Writes the rollout state of `rule`: a create without `rv`, else a patch at `rv` (a
/// concurrent writer makes it fail with a conflict: one writer at a time, always).
pub async fn write_state(
    api: &Api<ConfigMap>,
    rule: &str,
    state: &RolloutState,
    rv: Option<String>,
) -> Result<Option<String>, StoreError> {
    let text = serde_json::to_string_pretty(state).map_err(|source| StoreError::State {
        rule: rule.to_string(),
        source,
    })?;
    let Some(rv) = rv else {
        let cm = ConfigMap {
            metadata: meta(state_name(rule), rule, None),
            data: Some(BTreeMap::from([(STATE_KEY.to_string(), text)])),
            ..Default::default()
        };
        let written = api.create(&PostParams::default(), &cm).await?;
        return Ok(written.metadata.resource_version);
    };
    // A merge patch that names the resourceVersion read: the API server refuses it
    // (409) when the object changed since (needs only `patch`, as children do).
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": rv},
        "data": {STATE_KEY: text},
    });
    let written = api
        .patch(
            &state_name(rule),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    Ok(written.metadata.resource_version)
}

/// What a stored version holds.
#[derive(Serialize, Deserialize)]
struct Content {
    file: String,
    rule: serde_json::Value,
    templates: BTreeMap<String, String>,
}

fn gzip(bytes: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes)?;
    e.finish()
}

fn gunzip(bytes: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .take(MAX_INFLATED)
        .read_to_end(&mut out)?;
    Ok(out)
}

/// Keeps `rule`'s content in the cluster unless it is there already.
pub async fn save_version(api: &Api<ConfigMap>, rule: &CompiledRule) -> Result<(), StoreError> {
    let name = version_name(&rule.name, &rule.version);
    if api.get_metadata_opt(&name).await?.is_some() {
        return Ok(());
    }
    let bad = |message: String| StoreError::Content {
        rule: rule.name.clone(),
        version: rule.version.clone(),
        message,
    };
    let content = Content {
        file: rule.file.clone(),
        rule: serde_json::to_value(&rule.rule).map_err(|e| bad(e.to_string()))?,
        templates: (*rule.template_sources).clone(),
    };
    let json = serde_json::to_vec(&content).map_err(|e| bad(e.to_string()))?;
    let cm = ConfigMap {
        metadata: meta(name, &rule.name, Some(&rule.version)),
        binary_data: Some(BTreeMap::from([(
            CONTENT_KEY.to_string(),
            ByteString(gzip(&json).map_err(|e| bad(e.to_string()))?),
        )])),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &cm).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The stored `version` of rule `name`, compiled again with `limits`; `None` when the
/// cluster does not have it.
pub async fn load_version(
    api: &Api<ConfigMap>,
    name: &str,
    version: &str,
    limits: &Limits,
) -> Result<Option<Arc<CompiledRule>>, StoreError> {
    let Some(cm) = api.get_opt(&version_name(name, version)).await? else {
        return Ok(None);
    };
    let bad = |message: String| StoreError::Content {
        rule: name.to_string(),
        version: version.to_string(),
        message,
    };
    let bytes = cm
        .binary_data
        .as_ref()
        .and_then(|d| d.get(CONTENT_KEY))
        .ok_or_else(|| bad(format!("no {CONTENT_KEY}")))?;
    let json = gunzip(&bytes.0).map_err(|e| bad(e.to_string()))?;
    let content: Content = serde_json::from_slice(&json).map_err(|e| bad(e.to_string()))?;
    compile_content(name, version, content, limits).map(Some)
}

/// A stored version compiled again: JSON is YAML, so the rule reads as it did from disk.
fn compile_content(
    name: &str,
    version: &str,
    content: Content,
    limits: &Limits,
) -> Result<Arc<CompiledRule>, StoreError> {
    let bad = |message: String| StoreError::Content {
        rule: name.to_string(),
        version: version.to_string(),
        message,
    };
    let text = serde_json::to_string_pretty(&content.rule).map_err(|e| bad(e.to_string()))?;
    let sources = crate::rules::Sources {
        default_rollout: None,
        rule_files: vec![(format!("{} (version {version})", content.file), text)],
        templates: content
            .templates
            .into_iter()
            .map(|(t, src)| (t.clone(), (t, src)))
            .collect(),
    };
    let set = crate::render::compile(&sources, limits).map_err(|d| bad(d.to_string()))?;
    let rule = set
        .rules
        .get(name)
        .cloned()
        .ok_or_else(|| bad("the stored rule has another name".into()))?;
    if rule.version != version {
        return Err(bad(format!("it compiles to version {}", rule.version)));
    }
    Ok(rule)
}

/// Deletes the stored versions of `rule` other than `keep`.
pub async fn collect_versions(
    api: &Api<ConfigMap>,
    rule: &str,
    keep: &[&str],
) -> Result<usize, StoreError> {
    let lp = ListParams::default().labels(&format!("{ROLLOUT_OF}={rule},{VERSION_LABEL}"));
    let mut deleted = 0;
    for cm in api.list_metadata(&lp).await?.items {
        let v = cm
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(VERSION_LABEL));
        if v.is_some_and(|v| !keep.contains(&v.as_str()))
            && let Some(n) = &cm.metadata.name
        {
            match api.delete(n, &DeleteParams::default()).await {
                Ok(_) => deleted += 1,
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_compiles_again_from_what_is_stored() {
        let text = "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: web\nspec:\n  parent:\n    apiVersion: example.com/v1\n    kind: Web\n  crd:\n    specSchema:\n      type: object\n      x-kubernetes-preserve-unknown-fields: true\n  rollout:\n    steps: [{parents: 1}, {percent: 100, pause: 10s}]\n    gate: \"batch.ready >= batch.total and batch.age >= '1m'\"\n  status:\n    n: {expr: \"parent.spec.n | default(1)\"}\n  children:\n    - name: cm\n      apiVersion: v1\n      kind: ConfigMap\n      template: cm.yaml\n      readyWhen: \"child.data.ok == 'yes'\"\n";
        let sources = crate::rules::Sources {
            default_rollout: None,
            rule_files: vec![("web.yaml".into(), text.into())],
            templates: [(
                "cm.yaml".to_string(),
                (
                    "cm.yaml".to_string(),
                    "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: \"{{ parent.metadata.name }}\"\ndata:\n  x: \"é \\\" {{ 1 }}\"\n".to_string(),
                ),
            )]
            .into(),
        };
        let set =
            crate::render::compile(&sources, &Limits::default()).unwrap_or_else(|e| panic!("{e}"));
        let rule = &set.rules["web"];
        let content = Content {
            file: rule.file.clone(),
            rule: serde_json::to_value(&rule.rule).unwrap_or_default(),
            templates: (*rule.template_sources).clone(),
        };
        let bytes = gzip(&serde_json::to_vec(&content).unwrap_or_default())
            .unwrap_or_else(|e| panic!("{e}"));
        let back: Content = serde_json::from_slice(&gunzip(&bytes).unwrap_or_default())
            .unwrap_or_else(|e| panic!("{e}"));
        let again = compile_content("web", &rule.version, back, &Limits::default())
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(again.version, rule.version);
        assert!(again.rollout.is_some());
    }
}
