//! The webhook's certificates kept in one Secret that every replica reads and any
//! replica may advance (`certs::next` decides what is due). Replicas agree without a
//! leader, through the API server's own concurrency control: the Secret is created only
//! if absent (a second creator gets 409 and reads the winner's), and every change is a
//! replace carrying the resourceVersion it was computed from (a replica that lost the
//! race gets 409, reads again and finds nothing left to do). So there are never two CAs.
//!
//! A Secret of that name that is not Rulebook's (no label `app.kubernetes.io/managed-by:
//! rulebook`) is never overwritten: webhooks stay down, and the log says why.
//!
//! Every replica reads the Secret every `refresh` (sooner when a step is due), which is
//! what `settle` (`run::settle`) counts on. Key material never reaches a log line.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;
use tracing::{info, warn};

use super::certs::{self, Bundle, Phase, Policy};

pub const CA_CERT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";
pub const TLS_CERT: &str = "tls.crt";
pub const TLS_KEY: &str = "tls.key";
/// The CAs to trust (`caBundle`).
pub const TRUSTED: &str = "ca-bundle.crt";

const A: &str = "rulebook.dev/webhook-";

/// Why the Secret could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("Secret {0}: {1}")]
    Api(String, kube::Error),
    #[error(
        "Secret {0} exists and is not Rulebook's (no label app.kubernetes.io/managed-by=rulebook); \
         refusing to overwrite it: name another with --webhook-secret"
    )]
    Foreign(String),
    #[error("Secret {0}: {1}")]
    Cert(String, certs::CertError),
}

fn text(data: &BTreeMap<String, ByteString>, key: &str) -> Option<String> {
    data.get(key)
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
}

fn when(annotations: &BTreeMap<String, String>, key: &str) -> Option<i64> {
    let t: jiff::Timestamp = annotations.get(&format!("{A}{key}"))?.parse().ok()?;
    Some(t.as_second())
}

fn rfc3339(t: i64) -> String {
    jiff::Timestamp::from_second(t)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

/// The bundle a Secret holds; `None` when any part is missing or unreadable (it is then
/// replaced by a fresh one).
pub fn from_secret(s: &Secret) -> Option<Bundle> {
    let data = s.data.as_ref()?;
    let ann = s.metadata.annotations.as_ref()?;
    Some(Bundle {
        ca_cert: text(data, CA_CERT)?,
        ca_key: text(data, CA_KEY)?,
        ca_issued: when(ann, "ca-issued")?,
        ca_expires: when(ann, "ca-expires")?,
        tls_cert: text(data, TLS_CERT)?,
        tls_key: text(data, TLS_KEY)?,
        tls_issued: when(ann, "tls-issued")?,
        tls_expires: when(ann, "tls-expires")?,
        tls_names: ann
            .get(&format!("{A}tls-names"))?
            .split(',')
            .filter(|n| !n.is_empty())
            .map(str::to_string)
            .collect(),
        tls_ca: ann.get(&format!("{A}tls-ca"))?.clone(),
        trusted: text(data, TRUSTED)?,
        phase: Phase::parse(ann.get(&format!("{A}rotation"))?)?,
        phase_since: when(ann, "rotation-since")?,
    })
}

/// The Secret holding `b` (times as RFC 3339 annotations, readable with kubectl).
pub fn to_secret(namespace: &str, name: &str, b: &Bundle) -> Secret {
    let bytes = |s: &str| ByteString(s.as_bytes().to_vec());
    let data = BTreeMap::from([
        (CA_CERT.to_string(), bytes(&b.ca_cert)),
        (CA_KEY.to_string(), bytes(&b.ca_key)),
        (TLS_CERT.to_string(), bytes(&b.tls_cert)),
        (TLS_KEY.to_string(), bytes(&b.tls_key)),
        (TRUSTED.to_string(), bytes(&b.trusted)),
    ]);
    let mut ann = BTreeMap::new();
    for (key, t) in [
        ("ca-issued", b.ca_issued),
        ("ca-expires", b.ca_expires),
        ("tls-issued", b.tls_issued),
        ("tls-expires", b.tls_expires),
        ("rotation-since", b.phase_since),
    ] {
        ann.insert(format!("{A}{key}"), rfc3339(t));
    }
    ann.insert(format!("{A}tls-names"), b.tls_names.join(","));
    ann.insert(format!("{A}tls-ca"), b.tls_ca.clone());
    ann.insert(format!("{A}rotation"), b.phase.as_str().to_string());
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            labels: Some(BTreeMap::from([
                (
                    crate::rules::crd::MANAGED_BY_LABEL.to_string(),
                    crate::rules::crd::MANAGED_BY_VALUE.to_string(),
                ),
                ("app.kubernetes.io/name".to_string(), "rulebook".to_string()),
            ])),
            annotations: Some(ann),
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".into()),
        data: Some(data),
        ..Secret::default()
    }
}

fn ours(s: &Secret) -> bool {
    s.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(crate::rules::crd::MANAGED_BY_LABEL))
        .map(String::as_str)
        == Some(crate::rules::crd::MANAGED_BY_VALUE)
}

fn now() -> i64 {
    jiff::Timestamp::now().as_second()
}

/// The Secret `namespace/name` and the schedule its bundle follows.
pub struct Store {
    api: Api<Secret>,
    namespace: String,
    name: String,
    policy: Policy,
}

impl Store {
    pub fn new(client: kube::Client, namespace: &str, name: &str, policy: Policy) -> Store {
        Store {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
            name: name.to_string(),
            policy,
        }
    }

    fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Reads the Secret and writes what is due, until the bundle needs nothing: the
    /// bundle every replica serves from now on.
    pub async fn sync(&self) -> Result<Bundle, StoreError> {
        let api_err = |e| StoreError::Api(self.id(), e);
        // A lost race costs a read; a few in a row means somebody else keeps writing.
        for _ in 0..5 {
            let live = self.api.get_opt(&self.name).await.map_err(api_err)?;
            if let Some(s) = &live
                && !ours(s)
            {
                return Err(StoreError::Foreign(self.id()));
            }
            let current = live.as_ref().and_then(from_secret);
            let next = certs::next(current.as_ref(), &self.policy, now())
                .map_err(|e| StoreError::Cert(self.id(), e))?;
            let Some(next) = next else {
                if let Some(b) = current {
                    return Ok(b);
                }
                continue;
            };
            let mut secret = to_secret(&self.namespace, &self.name, &next);
            let written = match &live {
                None => self.api.create(&PostParams::default(), &secret).await,
                Some(s) => {
                    secret.metadata.resource_version = s.metadata.resource_version.clone();
                    self.api
                        .replace(&self.name, &PostParams::default(), &secret)
                        .await
                }
            };
            match written {
                Ok(_) => {
                    log_step(&self.id(), current.as_ref(), &next);
                    return Ok(next);
                }
                // Another replica wrote first: read what it wrote.
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => return Err(api_err(e)),
            }
        }
        Err(StoreError::Api(
            self.id(),
            kube::Error::Service("the Secret kept changing under us".into()),
        ))
    }

    /// Keeps the bundle current: syncs now, then every `refresh` (sooner when a step is
    /// due), publishing each bundle read on `tx`. Runs until the task is dropped.
    pub async fn keep(self, refresh: Duration, tx: watch::Sender<Option<Arc<Bundle>>>) {
        loop {
            let wait = match self.sync().await {
                Ok(b) => {
                    let wait = certs::until_next(&b, &self.policy, now());
                    tx.send_if_modified(|cur| {
                        if cur.as_deref() == Some(&b) {
                            return false;
                        }
                        *cur = Some(Arc::new(b));
                        true
                    });
                    Duration::from_secs(u64::try_from(wait).unwrap_or(0)).min(refresh)
                }
                Err(e) => {
                    warn!(error = %e, "webhook certificates: cannot read or renew them");
                    refresh.min(Duration::from_secs(5))
                }
            };
            tokio::time::sleep(wait.max(Duration::from_millis(500))).await;
        }
    }
}

fn log_step(id: &str, old: Option<&Bundle>, new: &Bundle) {
    let expires = rfc3339(new.tls_expires);
    match old {
        None => {
            info!(secret = %id, %expires, "webhook certificates: new CA and serving certificate")
        }
        Some(o) if o.ca_cert != new.ca_cert => {
            info!(secret = %id, ca_expires = %rfc3339(new.ca_expires), "webhook certificates: new CA, trusted beside the old one")
        }
        Some(o) if o.trusted != new.trusted => {
            info!(secret = %id, "webhook certificates: old CA no longer trusted")
        }
        Some(_) => {
            info!(secret = %id, %expires, phase = new.phase.as_str(), "webhook certificates: new serving certificate")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bundle_survives_the_secret() {
        let p = Policy {
            ca_validity: Duration::from_secs(3600),
            tls_validity: Duration::from_secs(600),
            settle: Duration::from_secs(30),
            names: vec!["127.0.0.1".into(), "svc.ns.svc".into()],
        };
        let b = certs::next(None, &p, 1_700_000_000).unwrap().unwrap();
        let s = to_secret("ns", "hooks", &b);
        assert_eq!(from_secret(&s), Some(b));
        assert!(ours(&s));
        let mut broken = s.clone();
        broken.data.as_mut().unwrap().remove(TLS_KEY);
        assert_eq!(from_secret(&broken), None, "incomplete: replaced");
    }
}
