//! The API client every reconcile, event and cleanup writes through.
//!
//! kube's `ClientBuilder` fixes the request body type down to hyper, which leaves no
//! place for the write gate's last check (`write::gate_body`: a write body asks the
//! gate as hyper is about to send it). So this module builds the same stack kube builds
//! for a cluster without a proxy — base URI, kube's retry of 429/503/504, auth, extra
//! headers (the user agent), rustls with the configured connect/read/write timeouts —
//! with that check at the bottom and [`GateLayer`] on top. kube's tracing layer is left
//! out: at the operator's log levels all it wrote was an ERROR line per 5xx answer or
//! connection error, naming neither the request nor the object (its span is at debug);
//! the failure itself still reaches the caller, which reports it with its rule and
//! object.
//!
//! A rule with `spec.serviceAccount` gets the same stack built once more with kube's
//! `auth_info.impersonate` set ([`Impersonating`]): kube's extra-headers layer then sends
//! `Impersonate-User` on each of its requests (`engine/identity.rs` says which).

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::{Body, ClientBuilder, ConfigExt, retry::RetryPolicy};
use kube::{Client, Config};
use tower::retry::RetryLayer;
use tower::util::BoxService;
use tower::{BoxError, ServiceBuilder};

use crate::engine::{BuildClients, IdentityError};
use crate::metrics::Metrics;
use crate::shard::watch::{SelectorLayer, Sharding};
use crate::write::gate::WriteGate;
use crate::write::gate_body::LastCheckLayer;

/// The client stack below [`GateLayer`]: kube's, with the last check at the bottom.
pub type Stack = BoxService<Request<Body>, Response<Incoming>, BoxError>;

/// A builder of a client whose writes pass `gate` three times: when the client accepts a
/// request, when its future first runs, and as hyper sends its body. Callers may add
/// layers (the sharded watch client adds its selector) before `build`.
pub fn gated_builder(
    config: &Config,
    gate: Arc<dyn WriteGate>,
    metrics: Arc<Metrics>,
) -> Result<ClientBuilder<GatedStack>> {
    if config.proxy_url.is_some() {
        // kube is built without its proxy features, so its own builder refuses too.
        bail!("an HTTP or SOCKS proxy to the API server is not supported");
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let https = config
        .rustls_https_connector_with_connector(http)
        .context("cannot set up TLS to the API server")?;
    let mut connector = hyper_timeout::TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let hyper = hyper_util::client::legacy::Builder::new(TokioExecutor::new()).build(connector);
    let retry = config
        .default_retry
        .then(|| RetryLayer::new(RetryPolicy::server_retry()));
    let stack = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(
            config
                .auth_layer()
                .context("cannot set up authentication")?,
        )
        .layer(
            config
                .extra_headers_layer()
                .context("invalid extra headers")?,
        )
        .layer(LastCheckLayer::new(
            gate.clone(),
            metrics.clone(),
            config.cluster_url.path(),
        ))
        .map_err(BoxError::from)
        .service(hyper);
    Ok(crate::write::gate::gate_over(
        BoxService::new(stack),
        config.default_namespace.clone(),
        gate,
        metrics,
    ))
}

/// The gated stack as the builder hands it on.
pub type GatedStack = crate::write::gate::Gated<Stack>;

/// The client every reconcile, event and cleanup uses: its writes pass the write gate.
/// (`rulebook diff` builds one on a gate that never opens: only reads and dry runs pass.)
pub fn gated_client(
    config: Config,
    gate: Arc<dyn WriteGate>,
    metrics: Arc<Metrics>,
) -> Result<Client> {
    Ok(gated_builder(&config, gate, metrics)?.build())
}

/// Builds the clients of rules with `spec.serviceAccount`: the operator's stack, its
/// credentials and its write gate, impersonating the rule's account.
pub struct Impersonating {
    config: Config,
    gate: Arc<dyn WriteGate>,
    metrics: Arc<Metrics>,
}

impl Impersonating {
    /// Over the operator's `config` (its own credentials authenticate; the account's are
    /// never needed) and the write gate its client uses.
    pub fn new(config: &Config, gate: Arc<dyn WriteGate>, metrics: Arc<Metrics>) -> Self {
        Impersonating {
            config: config.clone(),
            gate,
            metrics,
        }
    }

    /// The operator's configuration as `user`: no other impersonation it may carry
    /// (groups, uid, extra) goes along; the API server gives a ServiceAccount its groups.
    fn config_as(&self, user: &str) -> Config {
        let mut config = self.config.clone();
        config.auth_info.impersonate = Some(user.to_string());
        config.auth_info.impersonate_groups = None;
        config.auth_info.impersonate_uid = None;
        config.auth_info.impersonate_user_extra = None;
        config
    }
}

fn build_error(user: &str, e: &anyhow::Error) -> IdentityError {
    IdentityError::Build {
        user: user.to_string(),
        message: format!("{e:#}"),
    }
}

impl BuildClients for Impersonating {
    fn client(&self, user: &str) -> Result<Client, IdentityError> {
        gated_client(
            self.config_as(user),
            self.gate.clone(),
            self.metrics.clone(),
        )
        .map_err(|e| build_error(user, &e))
    }

    fn watch_client(&self, user: &str, sharding: &Sharding) -> Result<Client, IdentityError> {
        let builder = gated_builder(
            &self.config_as(user),
            sharding.gate.clone(),
            self.metrics.clone(),
        )
        .map_err(|e| build_error(user, &e))?;
        Ok(match &sharding.selector {
            Some(selector) => builder.with_layer(&SelectorLayer::new(selector)).build(),
            None => builder.build(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header kube sends for the impersonated account, and only it.
    // A client is built inside a runtime (its buffer spawns a task).
    #[tokio::test]
    async fn an_account_is_impersonated_alone() {
        let mut config = Config::new("https://127.0.0.1:6443".parse().unwrap());
        config.auth_info.impersonate = Some("someone-else".into());
        config.auth_info.impersonate_groups = Some(vec!["system:masters".into()]);
        let gate: Arc<dyn WriteGate> = Arc::new(crate::write::gate::LeaseGate::open());
        let i = Impersonating::new(&config, gate, Arc::new(Metrics::new()));
        let as_low = i.config_as("system:serviceaccount:ops:low");
        assert_eq!(
            as_low.auth_info.impersonate.as_deref(),
            Some("system:serviceaccount:ops:low")
        );
        assert!(as_low.auth_info.impersonate_groups.is_none());
        assert!(i.client("system:serviceaccount:ops:low").is_ok());
    }
}
