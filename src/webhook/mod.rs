//! The webhook third of an operator (issue 43): the HTTPS server every replica runs, the
//! admission webhooks (`spec.admission`: `expr:` checks and computed defaults) and the
//! conversion webhook (`spec.crd.conversion`).
//!
//! Why every replica, leader or not: the API server calls whichever replica its Service
//! or URL reaches, and a webhook that only the leader answered would fail every request
//! during a leader change. Serving needs no lease: it reads the rule set and the caches,
//! and writes nothing.
//!
//! [`Endpoint`] is how the API server reaches us: it is written into the CRD's
//! `spec.conversion` and into the generated webhook configurations. [`Handlers`] is what
//! the server hands a request to: `POST /validate/<rule>`, `/mutate/<rule>` (an
//! `AdmissionReview`) and `/convert/<rule>` (a `ConversionReview`), each answered with the
//! review to send back.

pub mod admission;
pub mod apply;
pub mod certs;
pub mod configs;
pub mod convert;
pub mod fair;
pub mod handlers;
pub mod offload;
pub mod run;
pub mod server;
pub mod store;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use base64::Engine as _;
use serde_json::{Value as Json, json};

use crate::render::RuleSet;

/// A review answered: the JSON to send back.
pub type Answer = Pin<Box<dyn Future<Output = Json> + Send>>;

/// Answers one review for a rule: `(rule name, review, its class's evaluation lane) →
/// answer` (the lane: fair.rs).
pub type Handler = Arc<dyn Fn(String, Json, offload::Lane) -> Answer + Send + Sync>;

/// The server's routes.
#[derive(Clone)]
pub struct Handlers {
    /// `POST /validate/<rule>`: an `AdmissionReview` (admission.k8s.io/v1).
    pub validate: Handler,
    /// `POST /mutate/<rule>`: an `AdmissionReview`; the answer may carry a JSON patch.
    pub mutate: Handler,
    /// `POST /convert/<rule>`: a `ConversionReview` (apiextensions.k8s.io/v1).
    pub convert: Handler,
}

/// Where the API server reaches this process's webhooks, and the CA it must trust.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub base: Base,
    /// PEM of the CA that signed the serving certificate (`caBundle`, base64 on the wire).
    pub ca_bundle_pem: Vec<u8>,
}

/// The address part of a webhook `clientConfig`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Base {
    /// `https://HOST:PORT`, without a path: out of a cluster, e.g. the local control
    /// plane's API server calling 127.0.0.1.
    Url(String),
    /// A Service in front of the replicas (in a cluster).
    Service {
        namespace: String,
        name: String,
        port: u16,
    },
}

impl Endpoint {
    /// The Service of deploy/ (`rulebook-system/rulebook-webhook:443`), without a CA yet:
    /// what the offline commands print when given no endpoint.
    pub fn deploy_service() -> Self {
        Endpoint {
            base: Base::Service {
                namespace: "rulebook-system".into(),
                name: "rulebook-webhook".into(),
                port: 443,
            },
            ca_bundle_pem: Vec::new(),
        }
    }

    /// The `clientConfig` of a webhook served at `path` (e.g. `/convert/myapp`).
    pub fn client_config(&self, path: &str) -> Json {
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca_bundle_pem);
        match &self.base {
            Base::Url(url) => json!({
                "url": format!("{}{path}", url.trim_end_matches('/')),
                "caBundle": ca,
            }),
            Base::Service {
                namespace,
                name,
                port,
            } => json!({
                "service": {"namespace": namespace, "name": name, "port": port, "path": path},
                "caBundle": ca,
            }),
        }
    }
}

/// The rules that need the webhook server while it is off, each with the problem shown
/// on `/status` (the API server enforces nothing of theirs, so it must be seen).
pub fn unserved(set: &RuleSet) -> Vec<(String, String)> {
    set.rules
        .values()
        .filter_map(|r| {
            let what = if configs::validates(r) || configs::mutates(r) {
                "expr: admission checks or defaults"
            } else if r
                .rule
                .spec
                .crd
                .as_ref()
                .is_some_and(|c| !c.conversion.is_empty())
            {
                "a conversion webhook"
            } else {
                return None;
            };
            Some((
                r.name.clone(),
                format!(
                    "the rule has {what}, which Rulebook's webhook server serves: run with \
                     --webhook-url or --webhook-service (docs/cli.md)"
                ),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_endpoint_joins_the_path_and_encodes_the_ca() {
        let e = Endpoint {
            base: Base::Url("https://127.0.0.1:9443/".into()),
            ca_bundle_pem: b"PEM".to_vec(),
        };
        let c = e.client_config("/convert/myapp");
        assert_eq!(c["url"], "https://127.0.0.1:9443/convert/myapp");
        assert_eq!(c["caBundle"], "UEVN");
    }

    #[test]
    fn a_service_endpoint_names_the_service_and_path() {
        let e = Endpoint {
            base: Base::Service {
                namespace: "rulebook-system".into(),
                name: "rulebook-webhook".into(),
                port: 443,
            },
            ca_bundle_pem: b"PEM".to_vec(),
        };
        let c = e.client_config("/validate/myapp");
        assert_eq!(c["service"]["path"], "/validate/myapp");
        assert_eq!(c["service"]["port"], 443);
        assert!(c.get("url").is_none());
    }
}
