//! The write gate: one writer at a time, known by the gate itself.
//!
//! Leadership reaches the gate directly from the lease: [`LeaseGate`] holds the instant
//! until which the last successful renewal entitles this process to write (the renewal's
//! start + two thirds of the lease, on the monotonic clock, which keeps counting while
//! the process is stopped). A process that stalls — SIGSTOP, a long GC-like pause, a
//! starved runtime — finds the gate closed when it resumes, before the main loop has
//! even noticed, and long before a standby may take over (a whole lease after the last
//! renewal it saw).
//!
//! The gate is enforced twice: reconcile stages ask [`WriteGate::may_write`] before each
//! write (to report `NotLeader` cleanly), and [`GateLayer`] sits in the operator's API
//! client, refusing every mutating request that reaches the wire while the gate is
//! closed — events, pruning after a rule change, anything added later — so no write path
//! can bypass it. The lease itself is renewed through a separate, ungated client.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use http::{Method, Request};

use crate::counts::WriteCounts;

/// Whether this process may write now.
pub trait WriteGate: Send + Sync {
    fn may_write(&self) -> bool;

    /// Whether a write to `path` may leave now (the check at the wire). A sharded
    /// replica also checks the namespace the path names.
    fn may_send(&self, _path: &str) -> bool {
        self.may_write()
    }
}

/// Leadership as a deadline. Without leader election the gate is always open.
pub struct LeaseGate {
    always: bool,
    until: Mutex<Option<Instant>>,
    /// Set when the process shuts down or loses the lease: closes at once.
    closed: AtomicBool,
}

impl LeaseGate {
    /// A gate that is always open (no leader election).
    pub fn open() -> LeaseGate {
        LeaseGate {
            always: true,
            until: Mutex::new(None),
            closed: AtomicBool::new(false),
        }
    }

    /// A gate that opens only while a lease renewal says so.
    pub fn leased() -> LeaseGate {
        LeaseGate {
            always: false,
            until: Mutex::new(None),
            closed: AtomicBool::new(false),
        }
    }

    /// A successful renewal (or acquisition) entitles this process to write until `until`.
    pub fn grant_until(&self, until: Instant) {
        *lock(&self.until) = Some(until);
    }

    /// Leadership ended (lost, released, or the process stops): close now.
    pub fn revoke(&self) {
        *lock(&self.until) = None;
    }

    /// Closes the gate for good (shutdown), whatever the lease says.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    /// Whether the gate is open at `now` (for tests and the election's own checks).
    pub fn open_at(&self, now: Instant) -> bool {
        if self.closed.load(Ordering::SeqCst) {
            return false;
        }
        self.always || lock(&self.until).is_some_and(|u| now < u)
    }
}

impl WriteGate for LeaseGate {
    fn may_write(&self) -> bool {
        self.open_at(Instant::now())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The error a refused request fails with.
#[derive(Debug, thiserror::Error)]
#[error("write refused: this process does not hold the leader lease (or it lapsed)")]
pub struct WriteRefused;

/// Whether a request changes something. Reads, and reviews that only ask the API server
/// a question (SelfSubjectAccessReview) or dry-run, pass a closed gate.
pub fn is_write<B>(req: &Request<B>) -> bool {
    is_write_to(req.method(), req.uri().path(), req.uri().query())
}

/// [`is_write`] by parts: `path` is the API path, without any prefix of the cluster URL.
pub fn is_write_to(method: &Method, path: &str, query: Option<&str>) -> bool {
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return false;
    }
    if path.starts_with("/apis/authorization.k8s.io/") {
        return false;
    }
    let dry_run = query.is_some_and(|q| q.split('&').any(|kv| kv == "dryRun=All"));
    !dry_run
}

/// Whether `e` is, or was caused by, a refusal of the gate (at any of its checks in the
/// client): such a failure means "not the leader (any more)", not an API error.
pub fn was_refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if c.is::<WriteRefused>() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// A layer for the API client that refuses writes while the gate is closed.
#[derive(Clone)]
pub struct GateLayer {
    gate: Arc<dyn WriteGate>,
    metrics: Arc<dyn WriteCounts>,
}

impl GateLayer {
    pub fn new(gate: Arc<dyn WriteGate>, metrics: Arc<dyn WriteCounts>) -> GateLayer {
        GateLayer { gate, metrics }
    }
}

impl<S> tower::Layer<S> for GateLayer {
    type Service = Gated<S>;
    fn layer(&self, inner: S) -> Gated<S> {
        Gated {
            inner,
            gate: self.gate.clone(),
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Gated<S> {
    inner: S,
    gate: Arc<dyn WriteGate>,
    metrics: Arc<dyn WriteCounts>,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<S, B> tower::Service<Request<B>> for Gated<S>
where
    S: tower::Service<Request<B>>,
    S::Response: Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // Checked as the request leaves: whatever a caller checked earlier may be stale.
        let write = is_write(&req);
        let path = if write {
            req.uri().path().to_string()
        } else {
            String::new()
        };
        if write && !self.gate.may_send(&path) {
            self.metrics.count_refused();
            return Box::pin(std::future::ready(Err(Box::new(WriteRefused) as BoxError)));
        }
        let fut = self.inner.call(req);
        let (gate, metrics) = (self.gate.clone(), self.metrics.clone());
        Box::pin(async move {
            // And again when the request is first polled, which is when it is sent: the
            // client hands the future to the caller's task, which may run only after a
            // stop (SIGSTOP, a starved process) that outlasted the lease.
            if write && !gate.may_send(&path) {
                metrics.count_refused();
                return Err(Box::new(WriteRefused) as BoxError);
            }
            fut.await.map_err(Into::into)
        })
    }
}

/// The top of the client stack, [`GateLayer`], over `inner`: the operator's client puts
/// it over the connection (`operator/client.rs`), and the reconcile's mock-API tests
/// (`reconcile::stages_mock`) over a `tower_test` mock, so that their requests pass the
/// same gate as the operator's.
pub fn gate_over<S>(
    inner: S,
    default_namespace: String,
    gate: Arc<dyn WriteGate>,
    metrics: Arc<dyn WriteCounts>,
) -> kube::client::ClientBuilder<Gated<S>>
where
    S: tower::Service<Request<kube::client::Body>>,
{
    kube::client::ClientBuilder::new(inner, default_namespace)
        .with_layer(&GateLayer::new(gate, metrics))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_lapsed_lease_closes_the_gate_by_itself() {
        let g = LeaseGate::leased();
        let now = Instant::now();
        assert!(!g.open_at(now));
        g.grant_until(now + Duration::from_secs(10));
        assert!(g.open_at(now));
        assert!(g.open_at(now + Duration::from_secs(9)));
        // Nobody revoked anything: the deadline alone closes it.
        assert!(!g.open_at(now + Duration::from_secs(10)));
        g.grant_until(now + Duration::from_secs(20));
        g.revoke();
        assert!(!g.open_at(now));
        let open = LeaseGate::open();
        assert!(open.open_at(now + Duration::from_secs(1_000_000)));
        open.close();
        assert!(!open.open_at(now));
    }

    #[test]
    fn reads_reviews_and_dry_runs_are_not_writes() {
        let req = |m: Method, uri: &str| Request::builder().method(m).uri(uri).body(()).unwrap();
        assert!(!is_write(&req(
            Method::GET,
            "/api/v1/namespaces/a/configmaps?watch=true"
        )));
        assert!(!is_write(&req(
            Method::POST,
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
        )));
        assert!(!is_write(&req(
            Method::PATCH,
            "/api/v1/namespaces/a/configmaps/x?dryRun=All&fieldManager=rulebook"
        )));
        assert!(is_write(&req(
            Method::PATCH,
            "/api/v1/namespaces/a/configmaps/x?fieldManager=rulebook"
        )));
        assert!(is_write(&req(
            Method::DELETE,
            "/api/v1/namespaces/a/configmaps/x"
        )));
        assert!(is_write(&req(
            Method::POST,
            "/apis/events.k8s.io/v1/namespaces/a/events"
        )));
    }

    #[tokio::test]
    async fn the_layer_refuses_writes_at_the_wire() {
        use tower::{Layer, Service, ServiceExt};
        let gate = Arc::new(LeaseGate::leased());
        let metrics = Arc::new(crate::counts::testing::Counted::default());
        let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = sent.clone();
        let inner = tower::service_fn(move |_req: Request<()>| {
            counter.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, std::convert::Infallible>(()) }
        });
        let mut svc = GateLayer::new(gate.clone(), metrics.clone()).layer(inner);
        let patch = || {
            Request::builder()
                .method(Method::PATCH)
                .uri("/api/v1/namespaces/a/configmaps/x")
                .body(())
                .unwrap()
        };
        let refused = svc.ready().await.unwrap().call(patch()).await;
        assert!(refused.is_err());
        assert_eq!(sent.load(Ordering::SeqCst), 0);
        assert_eq!(metrics.refused(), 1);
        gate.grant_until(Instant::now() + Duration::from_secs(30));
        svc.ready().await.unwrap().call(patch()).await.unwrap();
        assert_eq!(sent.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_write_that_waited_past_the_lease_is_not_sent() {
        use tower::{Layer, Service, ServiceExt};
        let gate = Arc::new(LeaseGate::leased());
        gate.grant_until(Instant::now() + Duration::from_secs(30));
        let metrics = Arc::new(crate::counts::testing::Counted::default());
        let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = sent.clone();
        // Like the HTTP client: nothing goes out until the future is polled.
        let inner = tower::service_fn(move |_req: Request<()>| {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::convert::Infallible>(())
            }
        });
        let mut svc = GateLayer::new(gate.clone(), metrics.clone()).layer(inner);
        let patch = Request::builder()
            .method(Method::PATCH)
            .uri("/api/v1/namespaces/a/configmaps/x")
            .body(())
            .unwrap();
        // Accepted while the lease holds; first polled after it lapsed (a stopped process).
        let pending = svc.ready().await.unwrap().call(patch);
        gate.revoke();
        assert!(pending.await.is_err());
        assert_eq!(sent.load(Ordering::SeqCst), 0);
        assert_eq!(metrics.refused(), 1);
    }
}
