//! The webhook tests' kit: a rule with an `expr:` check on a kind of its own (group
//! `webhook.rulebook.dev`, its CRD installed by the operator) and a ConfigMap child; an
//! operator serving webhooks on a loopback port that the local control plane's API
//! server calls (`--webhook-url https://127.0.0.1:PORT`), with its certificates' Secret
//! and its webhook configurations named for the test; a TLS client that trusts only a
//! given CA bundle; and the clean-up of the cluster-scoped configurations.

#![allow(dead_code)] // each test binary uses a different part of the kit

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use serde_json::{Value as Json, json};

use super::common::*;

pub const GROUP: &str = "webhook.rulebook.dev";
pub const API_VERSION: &str = "webhook.rulebook.dev/v1";
pub const T: Duration = Duration::from_secs(120);

/// What the webhook answers a parent with 5 replicas: the rule's check is
/// `parent.spec.replicas <= 3` with the message `replicas {{ parent.spec.replicas }} is
/// more than 3`, rendered by the admission handler.
pub const RULE_MESSAGE: &str = "replicas 5 is more than 3";
/// The part of the message any refused parent's carries.
pub const REFUSAL: &str = "is more than 3";

/// Whether an API error is the webhook's refusal of a parent with 5 replicas.
pub fn is_refusal(message: &str) -> bool {
    message.contains("denied the request") && message.contains(RULE_MESSAGE)
}

/// A loopback port nobody listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A rule directory with one rule whose parents get an `expr:` check.
pub struct Hooked {
    _dir: tempfile::TempDir,
    pub rules: PathBuf,
    pub templates: PathBuf,
    /// The rule's name, also its file's.
    pub rule: String,
    pub kind: String,
    pub plural: String,
    /// The name of the webhook configurations and of the certificates' Secret.
    pub name: String,
}

impl Hooked {
    /// A rule of a new kind whose check has `failurePolicy` `policy`.
    pub fn new(prefix: &str, policy: &str) -> Hooked {
        let dir = tempfile::tempdir().expect("tempdir");
        let rules = dir.path().join("rules");
        let templates = dir.path().join("templates");
        std::fs::create_dir_all(&rules).unwrap();
        std::fs::create_dir_all(templates.join("hooked")).unwrap();
        let id: String = unique(prefix)
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .collect();
        let kind = format!("Wh{id}");
        let h = Hooked {
            _dir: dir,
            rules,
            templates,
            rule: format!("wh-{id}"),
            plural: format!("{}s", kind.to_lowercase()),
            name: format!("rulebook-test-{id}"),
            kind,
        };
        h.write_rule(policy);
        std::fs::write(
            h.templates.join("hooked/config.yaml"),
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name }}\ndata:\n  replicas: \"{{ parent.spec.replicas }}\"\n",
        )
        .unwrap();
        h
    }

    /// (Re)writes the rule file with `failurePolicy` `policy`.
    pub fn write_rule(&self, policy: &str) {
        let admission = format!(
            "    failurePolicy: {policy}\n    validate:\n      - expr: \"parent.spec.replicas <= 3\"\n        message: \"replicas {{{{ parent.spec.replicas }}}} is more than 3\"\n"
        );
        std::fs::write(
            self.rules.join(format!("{}.yaml", self.rule)),
            self.rule_yaml("", &admission),
        )
        .unwrap();
    }

    /// The rule of this kind with its ConfigMap child: `references` (the lines under
    /// `references:`, none when empty) and `admission` (the lines under `admission:`),
    /// each indented as they stand in the file.
    pub fn rule_yaml(&self, references: &str, admission: &str) -> String {
        let references = if references.is_empty() {
            String::new()
        } else {
            format!("  references:\n{references}")
        };
        format!(
            r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: {rule}
spec:
  parent:
    apiVersion: {API_VERSION}
    kind: {kind}
{references}  children:
    - name: config
      apiVersion: v1
      kind: ConfigMap
      template: hooked/config.yaml
  crd:
    plural: {plural}
    specSchema:
      type: object
      x-kubernetes-preserve-unknown-fields: true
  admission:
{admission}"#,
            rule = self.rule,
            kind = self.kind,
            plural = self.plural,
        )
    }

    pub fn crd_name(&self) -> String {
        format!("{}.{GROUP}", self.plural)
    }

    /// The flags of an operator serving this rule's webhook on `port` (watching `ns`).
    pub fn flags(&self, ns: &str, port: u16) -> Vec<String> {
        [
            "--install-crds",
            "--webhook-bind",
            "127.0.0.1",
            "--webhook-port",
            &port.to_string(),
            "--webhook-url",
            &format!("https://127.0.0.1:{port}"),
            "--webhook-secret",
            &format!("{ns}/{}", self.name),
            "--webhook-configuration",
            &self.name,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    /// An operator on this rule, watching `ns`, serving webhooks on `port`.
    pub fn operator(&self, ns: &str, port: u16) -> OperatorBuilder {
        Operator::on(&self.rules, &self.templates)
            .namespace(ns)
            .flags(&self.flags(ns, port))
    }

    pub fn parents(&self, client: &kube::Client, ns: &str) -> Api<DynamicObject> {
        api(client, Some(ns), API_VERSION, &self.kind, &self.plural)
    }

    /// A parent with `replicas`.
    pub fn parent(&self, name: &str, replicas: i64) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": API_VERSION,
            "kind": self.kind,
            "metadata": {"name": name},
            "spec": {"replicas": replicas},
        }))
        .expect("parent")
    }

    pub fn validating(&self, client: &kube::Client) -> Api<DynamicObject> {
        api(
            client,
            None,
            "admissionregistration.k8s.io/v1",
            "ValidatingWebhookConfiguration",
            "validatingwebhookconfigurations",
        )
    }

    /// Waits until the validating configuration exists with a `caBundle`; returns it.
    pub async fn wait_configuration(&self, client: &kube::Client) -> Json {
        let configs = self.validating(client);
        wait_for(
            T,
            "the generated ValidatingWebhookConfiguration",
            || async {
                let c = to_json(&configs.get_opt(&self.name).await.ok()??);
                let ca = c.pointer("/webhooks/0/clientConfig/caBundle")?.as_str()?;
                (!ca.is_empty()).then_some(c)
            },
        )
        .await
    }

    /// Waits until the API server calls the webhook: a dry-run create of a parent is
    /// refused by the webhook ([`is_refusal`]) (a webhook configuration takes effect a moment after it
    /// is written).
    pub async fn wait_enforced(&self, client: &kube::Client, ns: &str) -> String {
        let parents = self.parents(client, ns);
        wait_for(T, "the API server to call the webhook", || async {
            match parents
                .create(
                    &PostParams {
                        dry_run: true,
                        ..Default::default()
                    },
                    &self.parent("probe", 5),
                )
                .await
            {
                Err(kube::Error::Api(s)) if is_refusal(&s.message) => Some(s.message),
                _ => None,
            }
        })
        .await
    }

    /// Deletes this test's webhook configurations (cluster-scoped, so not with the
    /// namespace).
    pub async fn remove_configurations(&self, client: &kube::Client) {
        let _ = self
            .validating(client)
            .delete(&self.name, &DeleteParams::default())
            .await;
        let mutating = api(
            client,
            None,
            "admissionregistration.k8s.io/v1",
            "MutatingWebhookConfiguration",
            "mutatingwebhookconfigurations",
        );
        let _ = mutating.delete(&self.name, &DeleteParams::default()).await;
    }
}

/// The certificates' Secret's data, decoded: `ca.crt`, `tls.crt`, `ca-bundle.crt`, ...
pub async fn secret_data(
    client: &kube::Client,
    ns: &str,
    name: &str,
) -> Option<std::collections::BTreeMap<String, String>> {
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), ns);
    let s = secrets.get_opt(name).await.ok()??;
    Some(
        s.data?
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).to_string()))
            .collect(),
    )
}

/// What a TLS handshake with `127.0.0.1:port`, trusting only the CAs in `trusted` (PEM),
/// gave: the server's certificate (DER), or the error.
pub async fn handshake(port: u16, trusted: &str) -> Result<Vec<u8>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(trusted.as_bytes()) {
        roots
            .add(c.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    let tls = connector
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (_, conn) = tls.get_ref();
    conn.peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.as_ref().to_vec())
        .ok_or_else(|| "no peer certificate".to_string())
}

/// The DER of each certificate in a PEM text.
pub fn ders(pem: &str) -> Vec<Vec<u8>> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .filter_map(Result::ok)
        .map(|c| c.as_ref().to_vec())
        .collect()
}
