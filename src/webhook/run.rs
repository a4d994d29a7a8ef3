//! The webhook server as `rulebook run` starts it on every replica: the certificate
//! keeper (`store.rs`, through a client of its own that no write gate closes: a standby
//! serves and renews too), the HTTPS server (`server.rs`) with the handlers
//! (`handlers.rs`), and what the rest of the operator reads from them: the current
//! [`Endpoint`] (whose `caBundle` the leader writes into the webhook configurations and
//! the CRDs) and the server's [`Health`] for `/readyz`.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use super::certs::{Bundle, Policy};
use super::configs::Scope;
use super::server::{self, Health, Limits, Resolver};
use super::store::Store;
use super::{Base, Endpoint, handlers};
use crate::render::RuleSet;

/// `rulebook run`'s webhook flags.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Address and port the server listens on.
    pub bind: IpAddr,
    pub port: u16,
    /// How the API server reaches the server.
    pub base: Base,
    /// The Secret holding the CA and serving certificate, `(namespace, name)`.
    pub secret: (String, String),
    /// The name of the generated webhook configurations.
    pub configuration: String,
    /// Lifetime of a serving certificate, and of the CA.
    pub cert_validity: Duration,
    pub ca_validity: Duration,
    /// How often every replica reads the Secret; a CA rotation step waits [`settle`] at
    /// least, and for every live replica's confirmation.
    pub refresh: Duration,
    /// Rulebook's own namespace (excluded from the webhooks).
    pub own_namespace: Option<String>,
    /// Evaluations at once on the blocking pool.
    pub evaluations: usize,
}

/// The least time between CA rotation steps, and the age at which a replica's
/// confirmation means it is gone (certs.rs): three reads of the Secret by every replica,
/// then 5 s for the leader's write of the new `caBundle` to reach the API server's
/// webhook client.
pub fn settle(refresh: Duration) -> Duration {
    refresh * 3 + Duration::from_secs(5)
}

/// Refuses lifetimes the rotation cannot keep: a serving certificate must outlive a
/// rotation step by the third of its life left when it is renewed, and the CA two steps.
pub fn check_validity(s: &Settings) -> Result<(), String> {
    let step = settle(s.refresh);
    if s.cert_validity < step * 3 {
        return Err(format!(
            "--webhook-cert-validity must be at least 3 × (3 × --webhook-refresh + 5 s) = {}s",
            (step * 3).as_secs()
        ));
    }
    if s.ca_validity < s.cert_validity * 2 {
        return Err("--webhook-ca-validity must be at least twice --webhook-cert-validity".into());
    }
    Ok(())
}

/// The webhook server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {0} for webhooks: {1}")]
    Bind(SocketAddr, std::io::Error),
    #[error(transparent)]
    Server(#[from] server::ServerError),
    #[error("cannot build a client for the webhook certificates: {0}")]
    Client(kube::Error),
}

/// The host names and addresses the serving certificate must name.
pub fn cert_names(base: &Base) -> Vec<String> {
    match base {
        Base::Url(url) => {
            let rest = url.trim_start_matches("https://");
            let authority = rest.split('/').next().unwrap_or(rest);
            let host = match authority.strip_prefix('[') {
                Some(v6) => v6.split(']').next().unwrap_or(v6),
                None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
            };
            vec![host.to_string()]
        }
        Base::Service {
            namespace, name, ..
        } => vec![
            format!("{name}.{namespace}.svc"),
            format!("{name}.{namespace}.svc.cluster.local"),
            format!("{name}.{namespace}"),
            name.clone(),
        ],
    }
}

/// The running webhook server and what the operator reads from it.
pub struct Webhooks {
    /// How the API server reaches us, with the CAs it must trust; `None` until the
    /// certificates are first read.
    pub endpoint: watch::Receiver<Option<Endpoint>>,
    pub health: Arc<Health>,
    pub scope: Scope,
    rules: watch::Sender<Option<Arc<RuleSet>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Webhooks {
    /// Listens on the webhook port and starts keeping and serving the certificates.
    pub async fn start(
        settings: &Settings,
        config: &kube::Config,
        scope: Scope,
        metrics: crate::metrics::WebhookMetrics,
    ) -> Result<Webhooks, StartError> {
        let addr = SocketAddr::new(settings.bind, settings.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| StartError::Bind(addr, e))?;
        let client = kube::Client::try_from(config.clone()).map_err(StartError::Client)?;
        let policy = Policy {
            ca_validity: settings.ca_validity,
            tls_validity: settings.cert_validity,
            settle: settle(settings.refresh),
            names: cert_names(&settings.base),
        };
        let store = Store::new(
            client.clone(),
            &settings.secret.0,
            &settings.secret.1,
            policy,
        );
        let (endpoint_tx, endpoint) = watch::channel(None);
        let (rules, rules_rx) = watch::channel(None);
        let resolver = Arc::new(Resolver::default());
        let health = Arc::new(Health::default());
        let tls = server::tls_config(resolver.clone())?;
        let app = server::router(
            handlers::handlers(
                rules_rx,
                handlers::Offload::new(settings.evaluations),
                super::admission::RefReader::new(Some(client.clone())),
            ),
            Limits::default(),
            metrics.clone(),
        );
        let serving = health.clone();
        let tasks = vec![
            tokio::spawn(store.keep(
                settings.refresh,
                serve(
                    resolver,
                    health.clone(),
                    metrics.certificate_expiry,
                    settings.base.clone(),
                    endpoint_tx,
                ),
            )),
            tokio::spawn(async move {
                if let Err(e) =
                    server::serve_on(listener, tls, app, Limits::default(), serving).await
                {
                    error!(error = %e, "the webhook server stopped");
                }
            }),
        ];
        info!(%addr, secret = %format!("{}/{}", settings.secret.0, settings.secret.1), "serving webhooks");
        Ok(Webhooks {
            endpoint,
            health,
            scope,
            rules,
            tasks,
        })
    }

    /// The handlers judge with `set` from now on.
    pub fn rules_changed(&self, set: &RuleSet) {
        self.rules.send_replace(Some(Arc::new(set.clone())));
    }

    /// The current endpoint, if the certificates have been read.
    pub fn current(&self) -> Option<Endpoint> {
        self.endpoint.borrow().clone()
    }
}

impl Drop for Webhooks {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// What serves each new bundle the keeper reads, before it confirms it (store.rs): the
/// resolver's certificate, readiness and the expiry gauge, and the endpoint (whose CA
/// bundle the leader writes into the webhook configurations and the CRDs).
fn serve(
    resolver: Arc<Resolver>,
    health: Arc<Health>,
    expiry: prometheus_client::metrics::gauge::Gauge,
    base: Base,
    endpoint: watch::Sender<Option<Endpoint>>,
) -> impl FnMut(&Bundle) + Send {
    move |b: &Bundle| {
        match resolver.set(b) {
            Ok(()) => {
                health.set_expiry(b.tls_expires);
                expiry.set(b.tls_expires);
            }
            Err(e) => warn!(error = %e, "webhook certificates: cannot serve the new certificate"),
        }
        let e = Endpoint {
            base: base.clone(),
            ca_bundle_pem: b.trusted.clone().into_bytes(),
        };
        endpoint.send_if_modified(|cur| {
            if cur.as_ref() == Some(&e) {
                return false;
            }
            *cur = Some(e);
            true
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_name_the_host_the_api_server_calls() {
        assert_eq!(
            cert_names(&Base::Url("https://127.0.0.1:9443".into())),
            vec!["127.0.0.1"]
        );
        assert_eq!(
            cert_names(&Base::Url("https://[::1]:9443/x".into())),
            vec!["::1"]
        );
        assert_eq!(
            cert_names(&Base::Url("https://hooks.example.com".into())),
            vec!["hooks.example.com"]
        );
        let svc = cert_names(&Base::Service {
            namespace: "rulebook-system".into(),
            name: "rulebook-webhook".into(),
            port: 443,
        });
        assert_eq!(svc[0], "rulebook-webhook.rulebook-system.svc");
    }
}
