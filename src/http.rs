//! The HTTP endpoint: `/metrics`, `/healthz`, `/readyz`, `/status`, and with
//! `--rules-git` the push hook `POST /hooks/git` (src/gitsource/hook.rs). It is reachable from
//! the pod network, so it bounds what a client can hold (header time, connection
//! lifetime, connections at once, and connections per client address, so that one
//! client cannot hold every slot and keep the kubelet's probes waiting until the
//! container is restarted) and `/status` says nothing about tenants' objects: rule names,
//! files and states, rule-file errors, and API errors stripped of object content.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::pin::pin;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::engine::{EngineStatus, RuleStatus};
use crate::metrics::Metrics;

/// What the reload loop last saw on disk.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RuleSetState {
    /// A rule set has been loaded (the first valid one, or later ones).
    pub loaded: bool,
    /// The rules on disk are valid (false: the last good rule set still serves).
    pub valid: bool,
    /// Fingerprint of the rule set that serves.
    pub serving: Option<String>,
    /// Every error of the rules on disk, `file:line:col: message`.
    pub errors: Vec<String>,
}

#[derive(Clone)]
pub struct AppState {
    pub metrics: Arc<Metrics>,
    pub engine: Arc<EngineStatus>,
    pub ruleset: Arc<RwLock<RuleSetState>>,
    pub leader: Arc<dyn Fn() -> bool + Send + Sync>,
    /// The sharding (`run --sharding namespace`), for `/status`.
    pub sharding: Option<Arc<RwLock<crate::shard::ShardStatus>>>,
    /// The webhook server, when `run` serves webhooks: ready only while it listens with
    /// a valid certificate.
    pub webhook: Option<Arc<crate::webhook::server::Health>>,
    /// The git source (`--rules-git`): `/status`'s `git` and the push hook.
    pub git: Option<Arc<crate::gitsource::GitSource>>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct StatusBody {
    ruleset: RuleSetState,
    leader: bool,
    rules: BTreeMap<String, RuleStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sharding: Option<crate::shard::ShardStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    git: Option<crate::gitsource::GitStatus>,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .route("/hooks/git", post(git_hook))
        .with_state(state)
}

/// What one client may hold of the endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// Time to send a request's headers; a slower client (slow loris) is disconnected.
    pub header_read: Duration,
    /// Longest life of a connection, keep-alive included. Then the connection finishes
    /// the request in flight (within `header_read` more) and is closed.
    pub connection: Duration,
    /// Connections served at once; further clients wait in the listen backlog.
    pub max_connections: usize,
    /// Connections served at once from one client address; one more is closed at once.
    pub per_client: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_read: Duration::from_secs(10),
            connection: Duration::from_secs(60),
            max_connections: 64,
            per_client: 8,
        }
    }
}

pub async fn serve(addr: SocketAddr, state: AppState) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving /metrics, /healthz, /readyz, /status");
    serve_on(listener, router(state), HttpLimits::default()).await
}

/// Serves `app` (HTTP/1.1) on `listener` within `limits`, until the task is dropped.
pub async fn serve_on(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let clients: Arc<Mutex<HashMap<IpAddr, usize>>> = Arc::default();
    loop {
        // A slot first: at the limit, new connections wait unaccepted.
        let slot = slots
            .clone()
            .acquire_owned()
            .await
            .map_err(std::io::Error::other)?;
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // E.g. out of file descriptors: wait a little rather than spin.
                tracing::debug!(error = %e, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // A client at its share is closed at once, and its slot freed for the next.
        let Some(client) = ClientSlot::take(&clients, peer.ip(), limits.per_client) else {
            drop(stream);
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let _client = client;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read);
            let mut conn = pin!(builder.serve_connection(TokioIo::new(stream), service));
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = tokio::time::sleep(limits.connection) => {}
            }
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(limits.header_read, conn).await;
        });
    }
}

/// One of a client address's connections; the count goes down when it is dropped.
struct ClientSlot {
    clients: Arc<Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl ClientSlot {
    fn take(
        clients: &Arc<Mutex<HashMap<IpAddr, usize>>>,
        ip: IpAddr,
        per_client: usize,
    ) -> Option<ClientSlot> {
        let mut held = clients.lock().unwrap_or_else(|p| p.into_inner());
        let n = held.entry(ip).or_insert(0);
        if *n >= per_client.max(1) {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            clients: clients.clone(),
            ip,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut held = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = held.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}

/// Ready once a rule set is loaded, the webhook server (when on) serves with a valid
/// certificate, and every running rule's caches are synced.
/// Leadership does not gate it: a standby is ready to take over.
async fn readyz(State(s): State<AppState>) -> Response {
    let loaded = s.ruleset.read().map(|r| r.loaded).unwrap_or(false);
    if !loaded {
        return (StatusCode::SERVICE_UNAVAILABLE, "no valid rule set loaded").into_response();
    }
    if let Some(w) = &s.webhook
        && let Err(why) = w.ready(jiff::Timestamp::now().as_second())
    {
        return (StatusCode::SERVICE_UNAVAILABLE, why).into_response();
    }
    if !(s.leader)() {
        return (StatusCode::OK, "ok (standby)").into_response();
    }
    if s.engine.all_synced() {
        (StatusCode::OK, "ok").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "caches not synced yet").into_response()
    }
}

async fn status(State(s): State<AppState>) -> Json<serde_json::Value> {
    let body = StatusBody {
        ruleset: s.ruleset.read().map(|r| r.clone()).unwrap_or_default(),
        leader: (s.leader)(),
        rules: s.engine.snapshot(),
        sharding: s
            .sharding
            .as_ref()
            .and_then(|x| x.read().ok().map(|x| x.clone())),
        git: s.git.as_ref().map(|g| g.status.read().clone()),
    };
    Json(serde_json::to_value(body).unwrap_or_default())
}

/// `POST /hooks/git`: a signed push hook fetches at once (src/gitsource/hook.rs). 404
/// without `--rules-git` and `--git-hook-secret-file`.
async fn git_hook(
    State(s): State<AppState>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    use crate::gitsource::hook::Verdict;
    let Some((git, hook)) = s.git.as_ref().and_then(|g| g.hook.as_ref().map(|h| (g, h))) else {
        return (StatusCode::NOT_FOUND, "no git hook configured").into_response();
    };
    let signature = headers
        .get("x-hub-signature-256")
        .and_then(|v| v.to_str().ok());
    match hook.judge(signature, &body) {
        Verdict::Accepted => {
            git.trigger.notify_one();
            (StatusCode::ACCEPTED, "fetching").into_response()
        }
        Verdict::Unauthorized => (
            StatusCode::UNAUTHORIZED,
            "missing or wrong X-Hub-Signature-256",
        )
            .into_response(),
        Verdict::TooMany => (StatusCode::TOO_MANY_REQUESTS, "too many hooks").into_response(),
    }
}
