//! The HTTP endpoint: `/metrics`, `/healthz`, `/readyz`, `/status`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;

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
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct StatusBody {
    ruleset: RuleSetState,
    leader: bool,
    rules: BTreeMap<String, RuleStatus>,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .with_state(state)
}

pub async fn serve(addr: SocketAddr, state: AppState) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving /metrics, /healthz, /readyz, /status");
    axum::serve(listener, router(state)).await
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

/// Ready once a rule set is loaded and every running rule's caches are synced.
/// Leadership does not gate it: a standby is ready to take over.
async fn readyz(State(s): State<AppState>) -> Response {
    let loaded = s.ruleset.read().map(|r| r.loaded).unwrap_or(false);
    if !loaded {
        return (StatusCode::SERVICE_UNAVAILABLE, "no valid rule set loaded").into_response();
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
    };
    Json(serde_json::to_value(body).unwrap_or_default())
}
