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
//!
//! The replicas' confirmations of a CA rotation (certs.rs) live in the same Secret, an
//! annotation per replica (`rulebook.dev/webhook-replica-<id>: <time> serving=<CA>
//! trusted=<CA>,<CA>`, fingerprints, no key material): no other object, so no other grant
//! (`rulebook rbac` already gives `update` on this Secret by name). A replica writes its
//! record only while a rotation is under way, once it serves the step it read and again
//! every third of `settle`; a step's write drops every record, so the Secret holds none at
//! rest and a steady state writes nothing. A record older than `settle` (a replica gone)
//! is dropped by the next write.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};
use tracing::{debug, info, warn};

use super::certs::{self, Bundle, Confirmation, Phase, Policy};

pub const CA_CERT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";
pub const TLS_CERT: &str = "tls.crt";
pub const TLS_KEY: &str = "tls.key";
/// The CAs to trust (`caBundle`).
pub const TRUSTED: &str = "ca-bundle.crt";

const A: &str = "rulebook.dev/webhook-";
/// The annotations holding the replicas' confirmations: this prefix and the replica's id.
const REPLICA: &str = "rulebook.dev/webhook-replica-";

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

/// The replicas' confirmations a Secret holds, by replica id (unreadable ones skipped).
pub fn confirmations(s: &Secret) -> BTreeMap<String, Confirmation> {
    let Some(ann) = s.metadata.annotations.as_ref() else {
        return BTreeMap::new();
    };
    ann.iter()
        .filter_map(|(k, v)| {
            let id = k.strip_prefix(REPLICA)?;
            let mut words = v.split(' ');
            let at: jiff::Timestamp = words.next()?.parse().ok()?;
            let serving = words.next()?.strip_prefix("serving=")?.to_string();
            let trusted = words.next()?.strip_prefix("trusted=")?;
            let trusted = trusted.split(',').filter(|t| !t.is_empty());
            Some((
                id.to_string(),
                Confirmation {
                    serving,
                    trusted: trusted.map(str::to_string).collect(),
                    at: at.as_second(),
                },
            ))
        })
        .collect()
}

/// `s` with replica `id`'s confirmation `c`, and without the records older than `stale`
/// seconds at `c.at`.
pub fn confirm(s: &mut Secret, id: &str, c: &Confirmation, stale: i64) {
    let old = confirmations(s);
    let ann = s.metadata.annotations.get_or_insert_with(BTreeMap::new);
    for (other, record) in &old {
        if record.at <= c.at.saturating_sub(stale) {
            ann.remove(&format!("{REPLICA}{other}"));
        }
    }
    ann.insert(
        format!("{REPLICA}{id}"),
        format!(
            "{} serving={} trusted={}",
            rfc3339(c.at),
            c.serving,
            c.trusted.join(",")
        ),
    );
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
    /// This replica's id in the confirmations (one per process).
    replica: String,
}

/// An id for this process: the host name (a pod's name), the process id and the time
/// it started, hashed to 12 hex characters (an annotation key's name part).
fn replica_id() -> String {
    use sha2::Digest as _;
    let host = std::env::var("HOSTNAME").unwrap_or_default();
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let seed = format!("{host}/{}/{started}", std::process::id());
    hex::encode(&sha2::Sha256::digest(seed.as_bytes())[..6])
}

impl Store {
    pub fn new(client: kube::Client, namespace: &str, name: &str, policy: Policy) -> Store {
        Store {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
            name: name.to_string(),
            policy,
            replica: replica_id(),
        }
    }

    fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Reads the Secret and writes what is due, until the bundle needs nothing: the
    /// bundle every replica serves from now on, and the Secret as last read or written.
    pub async fn sync(&self) -> Result<(Bundle, Secret), StoreError> {
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
            let replicas: Vec<Confirmation> = live
                .as_ref()
                .map(confirmations)
                .unwrap_or_default()
                .into_values()
                .collect();
            let next = certs::next(current.as_ref(), &self.policy, now(), &replicas)
                .map_err(|e| StoreError::Cert(self.id(), e))?;
            let Some(next) = next else {
                if let (Some(b), Some(s)) = (current, live) {
                    return Ok((b, s));
                }
                continue;
            };
            // A step drops the confirmations of the one before (module header).
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
                Ok(s) => {
                    log_step(&self.id(), current.as_ref(), &next);
                    return Ok((next, s));
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

    /// While a rotation is under way, records in `secret` that this replica serves and
    /// trusts `b` (which it does by now), when its record says otherwise or is a third
    /// of `settle` old. A lost race (409) is retried at the next read.
    async fn confirm(&self, b: &Bundle, mut secret: Secret) -> Result<(), StoreError> {
        if b.phase == Phase::Stable {
            return Ok(());
        }
        let settle = i64::try_from(self.policy.settle.as_secs()).unwrap_or(i64::MAX / 4);
        let mine = Confirmation::of(b, now());
        let said = confirmations(&secret).remove(&self.replica);
        if said.is_some_and(|c| c.says_the_same(&mine) && c.at > mine.at - settle / 3) {
            return Ok(());
        }
        confirm(&mut secret, &self.replica, &mine, settle);
        match self
            .api
            .replace(&self.name, &PostParams::default(), &secret)
            .await
        {
            Ok(_) => {
                debug!(secret = %self.id(), replica = %self.replica, phase = b.phase.as_str(), serving = %mine.serving, "webhook certificates: confirmed the rotation step");
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(StoreError::Api(self.id(), e)),
        }
    }

    /// Keeps the bundle current: syncs now, then every `refresh` (sooner when a step is
    /// due), handing each new bundle to `serve` (which serves it and publishes its CA
    /// bundle) before confirming it. Runs until the task is dropped.
    pub async fn keep(self, refresh: Duration, mut serve: impl FnMut(&Bundle) + Send) {
        let mut served: Option<Bundle> = None;
        loop {
            let read = match self.sync().await {
                Ok((b, secret)) => {
                    if served.as_ref() != Some(&b) {
                        serve(&b);
                        served = Some(b.clone());
                    }
                    self.confirm(&b, secret).await.map(|()| b)
                }
                Err(e) => Err(e),
            };
            let wait = match read {
                Ok(b) => {
                    let wait = certs::until_next(&b, &self.policy, now());
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
        let b = certs::next(None, &p, 1_700_000_000, &[]).unwrap().unwrap();
        let s = to_secret("ns", "hooks", &b);
        assert_eq!(from_secret(&s), Some(b));
        assert!(ours(&s));
        let mut broken = s.clone();
        broken.data.as_mut().unwrap().remove(TLS_KEY);
        assert_eq!(from_secret(&broken), None, "incomplete: replaced");
    }

    #[test]
    fn confirmations_survive_the_secret_and_stale_ones_go() {
        let p = Policy {
            ca_validity: Duration::from_secs(3600),
            tls_validity: Duration::from_secs(600),
            settle: Duration::from_secs(30),
            names: vec!["127.0.0.1".into()],
        };
        let b = certs::next(None, &p, 1_700_000_000, &[]).unwrap().unwrap();
        let mut s = to_secret("ns", "hooks", &b);
        assert!(confirmations(&s).is_empty(), "a step's write holds none");
        let old = Confirmation::of(&b, 1_700_000_010);
        confirm(&mut s, "aaaaaaaaaaaa", &old, 30);
        let c = Confirmation::of(&b, 1_700_000_030);
        confirm(&mut s, "bbbbbbbbbbbb", &c, 30);
        let read = confirmations(&s);
        assert_eq!(read.get("aaaaaaaaaaaa"), Some(&old));
        assert_eq!(read.get("bbbbbbbbbbbb"), Some(&c));
        assert_eq!(c.trusted, vec![certs::fingerprint(&b.ca_cert)]);
        // 30 s after the first one's: it is gone.
        let later = Confirmation::of(&b, 1_700_000_040);
        confirm(&mut s, "bbbbbbbbbbbb", &later, 30);
        let read = confirmations(&s);
        assert_eq!(read.len(), 1, "{read:?}");
        assert_eq!(from_secret(&s), Some(b), "the bundle reads the same");
        let ann = s.metadata.annotations.as_ref().unwrap();
        assert!(
            ann.values().all(|v| !v.contains("PRIVATE")),
            "no key material in a record"
        );
    }
}
