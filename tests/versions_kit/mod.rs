//! The versioned rule of the CRD-versions tests (issue 43): a kind of its own in
//! `v1alpha1` (flat `image`, `port`) and `v1` (`container: {image, port}`) converted by
//! the templates of examples/versioned, the operator flags that serve its conversion
//! webhook on a loopback port, and what the tests read of a storage migration: the
//! stored version of every object, from etcd itself ([`stored_versions`]), and
//! `rules.<rule>.migration` of an operator's `/status`. Used by `tests/versions.rs`
//! (one operator) and `tests/webhook_sharded.rs` (sharded replicas).

#![allow(dead_code)] // each test binary uses a different part of the kit

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use kube::api::{Api, DeleteParams, DynamicObject};
use serde_json::{Value as Json, json};

use super::common::*;

pub const GROUP: &str = "versions.rulebook.dev";
pub const T: Duration = Duration::from_secs(120);

/// A rule of a kind of its own in `v1alpha1` (flat `image`, `port`) and `v1`
/// (`container: {image, port}`), with the two conversion templates of
/// examples/versioned.
pub struct Versioned {
    /// The rule directory, unless it lives in another's ([`Versioned::beside`]).
    _dir: Option<tempfile::TempDir>,
    pub rules: PathBuf,
    pub templates: PathBuf,
    pub rule: String,
    pub kind: String,
    pub plural: String,
    /// The webhook configurations' and certificates' Secret's name.
    pub name: String,
}

impl Versioned {
    pub fn new(prefix: &str) -> Versioned {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut v = Versioned::beside(
            &dir.path().join("rules"),
            &dir.path().join("templates"),
            prefix,
        );
        v._dir = Some(dir);
        v
    }

    /// The rule's templates in `templates` (`v/`), its file to be written into `rules`
    /// ([`Versioned::write_rule`]): beside another test rule, run by the same operator.
    pub fn beside(rules: &Path, templates: &Path, prefix: &str) -> Versioned {
        let example = repo().join("examples/versioned/templates/webapp");
        std::fs::create_dir_all(rules).unwrap();
        std::fs::create_dir_all(templates.join("v")).unwrap();
        for t in ["v1alpha1-to-v1.yaml", "v1-to-v1alpha1.yaml"] {
            std::fs::copy(example.join(t), templates.join("v").join(t)).unwrap();
        }
        // The child reads the storage version, whichever it is.
        for (version, image) in [
            ("v1", "parent.spec.container.image"),
            ("v1alpha1", "parent.spec.image"),
        ] {
            std::fs::write(
                templates.join(format!("v/config-{version}.yaml")),
                format!(
                    "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{{{ parent.metadata.name }}}}\ndata:\n  image: {{{{ {image} }}}}\n  readAs: {{{{ parent.apiVersion }}}}\n"
                ),
            )
            .unwrap();
        }
        let id: String = unique(prefix)
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .collect();
        let kind = format!("Vr{id}");
        Versioned {
            _dir: None,
            rules: rules.to_path_buf(),
            templates: templates.to_path_buf(),
            rule: format!("vr-{id}"),
            plural: format!("{}s", kind.to_lowercase()),
            name: format!("rulebook-test-{id}"),
            kind,
        }
    }

    /// (Re)writes the rule with `storage` as the storage version; with a ConfigMap
    /// child when `child`.
    pub fn write_rule(&self, storage: &str, child: bool) {
        let children = if child {
            format!(
                "\n    - name: config\n      apiVersion: v1\n      kind: ConfigMap\n      template: v/config-{storage}.yaml"
            )
        } else {
            " []".to_string()
        };
        let (alpha_storage, one_storage) = (storage == "v1alpha1", storage == "v1");
        let text = format!(
            r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: {rule}
spec:
  parent:
    apiVersion: {GROUP}/{storage}
    kind: {kind}
  children:{children}
  crd:
    plural: {plural}
    versions:
      - name: v1
        storage: {one_storage}
        specSchema:
          type: object
          properties:
            replicas: {{ type: integer }}
            container:
              type: object
              properties:
                image: {{ type: string }}
                port: {{ type: integer }}
      - name: v1alpha1
        storage: {alpha_storage}
        deprecated: true
        specSchema:
          type: object
          properties:
            replicas: {{ type: integer }}
            image: {{ type: string }}
            port: {{ type: integer }}
    conversion:
      - {{ from: v1alpha1, to: v1, template: v/v1alpha1-to-v1.yaml }}
      - {{ from: v1, to: v1alpha1, template: v/v1-to-v1alpha1.yaml }}
"#,
            rule = self.rule,
            kind = self.kind,
            plural = self.plural,
        );
        std::fs::write(self.rules.join(format!("{}.yaml", self.rule)), text).unwrap();
    }

    pub fn crd_name(&self) -> String {
        format!("{}.{GROUP}", self.plural)
    }

    /// An operator on this rule, watching `ns`, serving webhooks on `port`.
    pub fn operator(&self, ns: &str, port: u16) -> OperatorBuilder {
        let flags = [
            "--install-crds".to_string(),
            "--webhook-bind".into(),
            "127.0.0.1".into(),
            "--webhook-port".into(),
            port.to_string(),
            "--webhook-url".into(),
            format!("https://127.0.0.1:{port}"),
            "--webhook-secret".into(),
            format!("{ns}/{}", self.name),
            "--webhook-configuration".into(),
            self.name.clone(),
        ];
        Operator::on(&self.rules, &self.templates)
            .namespace(ns)
            .flags(&flags)
    }

    pub fn api(&self, client: &kube::Client, ns: &str, version: &str) -> Api<DynamicObject> {
        api(
            client,
            Some(ns),
            &format!("{GROUP}/{version}"),
            &self.kind,
            &self.plural,
        )
    }

    pub fn crds(&self, client: &kube::Client) -> Api<DynamicObject> {
        api(
            client,
            None,
            "apiextensions.k8s.io/v1",
            "CustomResourceDefinition",
            "customresourcedefinitions",
        )
    }

    /// Waits until the CRD stores in `storage` and converts through the webhook on one
    /// of `ports` (sharded replicas each publish their own) with a CA bundle; returns it.
    pub async fn wait_crd(&self, client: &kube::Client, ports: &[u16], storage: &str) -> Json {
        let crds = self.crds(client);
        let urls: Vec<String> = ports
            .iter()
            .map(|port| format!("https://127.0.0.1:{port}/convert/{}", self.rule))
            .collect();
        let crd = wait_for(T, "the CRD with its conversion webhook", || async {
            let c = to_json(&crds.get_opt(&self.crd_name()).await.ok()??);
            let cc = c.pointer("/spec/conversion/webhook/clientConfig")?;
            let stores = c["spec"]["versions"]
                .as_array()?
                .iter()
                .any(|v| v["name"] == storage && v["storage"] == true);
            (urls.iter().any(|u| cc["url"] == u.as_str())
                && cc["caBundle"].as_str().is_some_and(|s| !s.is_empty())
                && stores)
                .then_some(c)
        })
        .await;
        wait_established(client, &self.crd_name()).await;
        crd
    }

    /// Deletes the CRD (and so every object of the kind) while the operator still
    /// serves the conversion the API server needs to delete them.
    pub async fn remove_crd(&self, client: &kube::Client) {
        let crds = self.crds(client);
        let _ = crds
            .delete(&self.crd_name(), &DeleteParams::default())
            .await;
        let _ = poll_for(T, || async {
            crds.get_opt(&self.crd_name())
                .await
                .ok()?
                .is_none()
                .then_some(())
        })
        .await;
        for kind in [
            "ValidatingWebhookConfiguration",
            "MutatingWebhookConfiguration",
        ] {
            let plural = format!("{}s", kind.to_lowercase());
            let a = api(
                client,
                None,
                "admissionregistration.k8s.io/v1",
                kind,
                &plural,
            );
            let _ = a.delete(&self.name, &DeleteParams::default()).await;
        }
    }

    pub fn parent_v1alpha1(&self, name: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": format!("{GROUP}/v1alpha1"), "kind": self.kind,
            "metadata": {"name": name},
            "spec": {"replicas": 1, "image": format!("{name}:1"), "port": 8080},
        }))
        .unwrap()
    }
}

/// The storage migration's resume marker on `crd` (its `rulebook.dev/storage-migration`
/// annotation, parsed), or `None` when there is none.
pub fn migration_marker(crd: &Json) -> Option<Json> {
    serde_json::from_str(crd["metadata"]["annotations"]["rulebook.dev/storage-migration"].as_str()?)
        .ok()
}

/// The stored `apiVersion` of every object of the kind in `ns`, read from etcd itself
/// (its JSON gateway, at the port the local control plane records): what the API server
/// cannot show, since it converts what it reads.
pub async fn stored_versions(v: &Versioned, ns: &str) -> BTreeMap<String, usize> {
    let env = std::fs::read_to_string(
        kubeconfig_path()
            .parent()
            .expect("the control plane's directory")
            .join("run/ports.env"),
    )
    .expect("the local control plane's run/ports.env (etcd's port)");
    let port = env
        .lines()
        .find_map(|l| l.strip_prefix("ETCD_CLIENT_PORT="))
        .expect("ETCD_CLIENT_PORT in ports.env");
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let prefix = format!("/registry/{GROUP}/{}/{ns}/", v.plural);
    let mut end = prefix.clone().into_bytes();
    *end.last_mut().unwrap() += 1;
    let body = json!({"key": b64(&prefix), "range_end": base64::engine::general_purpose::STANDARD.encode(&end)});
    let answer = etcd_post(port, "/v3/kv/range", &body.to_string()).await;
    let answer: Json = serde_json::from_str(&answer).expect("etcd's JSON");
    let mut counts = BTreeMap::new();
    for kv in answer["kvs"].as_array().cloned().unwrap_or_default() {
        let value = base64::engine::general_purpose::STANDARD
            .decode(kv["value"].as_str().unwrap())
            .unwrap();
        let stored: Json =
            serde_json::from_slice(&value).expect("a custom resource is stored as JSON");
        *counts
            .entry(stored["apiVersion"].as_str().unwrap().to_string())
            .or_insert(0) += 1;
    }
    counts
}

/// POSTs `body` to etcd's gateway on loopback `port`; the answer's body.
async fn etcd_post(port: &str, path: &str, body: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(format!("127.0.0.1:{port}"))
        .await
        .expect("etcd listens");
    s.write_all(
        format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8(buf).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        out
    } else {
        body.to_string()
    }
}

/// `rules.<rule>.migration` of the operator's `/status`.
pub async fn migration(op: &Operator, rule: &str) -> Option<Json> {
    let s: Json = serde_json::from_str(&op.get_opt("/status").await?).ok()?;
    let m = s["rules"][rule]["migration"].clone();
    (!m.is_null()).then_some(m)
}
