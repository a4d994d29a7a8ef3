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

use crate::metrics::Metrics;
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
