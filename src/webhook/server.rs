//! The webhook's HTTPS server, on its own port, run by every replica (leader or not).
//!
//! Built from `tokio-rustls` and hyper-util's HTTP/1.1 connection, the same connection
//! loop as the metrics endpoint (src/http.rs: a header-read timeout, a connection
//! lifetime, a connection limit) with a TLS handshake in front, and an axum router for
//! the three routes. Not `axum-server`: it adds a crate for what these few lines do, and
//! its `RustlsConfig::reload` swaps the whole `ServerConfig`; here a rustls certificate
//! resolver ([`Resolver`]) reads the current key pair on every handshake, so a renewed
//! certificate serves from the next connection on and connections in flight keep theirs:
//! no restart, no failed request. rustls uses the `ring` provider, as the API client does.
//!
//! Per request ([`Limits`]): a body limit (413), a bound on requests in flight and on the
//! bytes of their bodies, taken from `Content-Length` before the body is read (429 when
//! full), a fair share of them per namespace once the review names it (fair.rs: 429
//! naming the reason when over), and a deadline below the API server's timeout (504 when
//! missed). Every refusal is counted by reason (`rulebook_webhook_refused_total`, never
//! by namespace: tenants choose those names). An
//! HTTP error makes the API server apply the webhook's `failurePolicy` (admission) or fail
//! the read (conversion), so an overloaded or slow replica refuses quickly and clearly
//! instead of holding the API server's request. The body is parsed on the blocking pool
//! and handlers evaluate there too (`handlers.rs`), so neither a large nor a hostile
//! object stalls this runtime's other work (lease renewal, reconciles).

use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use serde_json::Value as Json;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::Handlers;
use super::certs::Bundle;
use super::fair::{Class, Fair};
use crate::metrics::{RefusedLabel, RouteLabel, WebhookLabels, WebhookMetrics};

/// A certificate or key in the bundle does not load.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("the serving certificate does not read: {0}")]
    Pem(String),
    #[error("the serving key is not usable: {0}")]
    Key(rustls::Error),
    #[error("TLS configuration: {0}")]
    Tls(rustls::Error),
}

/// The serving certificate, swapped atomically when the bundle changes.
#[derive(Debug, Default)]
pub struct Resolver {
    current: RwLock<Option<Arc<CertifiedKey>>>,
}

impl Resolver {
    /// Serves `bundle`'s certificate from the next handshake on.
    pub fn set(&self, bundle: &Bundle) -> Result<(), ServerError> {
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(bundle.tls_cert.as_bytes())
                .collect::<Result<_, _>>()
                .map_err(|e| ServerError::Pem(e.to_string()))?;
        let key = PrivateKeyDer::from_pem_slice(bundle.tls_key.as_bytes())
            .map_err(|e| ServerError::Pem(e.to_string()))?;
        let key = provider()
            .key_provider
            .load_private_key(key)
            .map_err(ServerError::Key)?;
        let certified = Arc::new(CertifiedKey::new(chain, key));
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Some(certified);
        Ok(())
    }
}

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

fn provider() -> rustls::crypto::CryptoProvider {
    rustls::crypto::ring::default_provider()
}

/// The TLS configuration: certificates from `resolver`, HTTP/1.1.
pub fn tls_config(resolver: Arc<Resolver>) -> Result<Arc<rustls::ServerConfig>, ServerError> {
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(provider()))
        .with_safe_default_protocol_versions()
        .map_err(ServerError::Tls)?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// What a client may hold of the server, and what one request may cost.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest `AdmissionReview` body. One of an UPDATE holds the object twice; etcd
    /// stores objects of at most 1.5 MiB.
    pub max_body: usize,
    /// Largest `ConversionReview` body: the API server converts a whole page of a list
    /// in one review.
    pub max_convert_body: usize,
    /// Reviews being answered at once; one more is refused with 429.
    pub in_flight: usize,
    /// Reviews of one namespace (or of cluster-scoped objects, or conversions) being
    /// answered at once, a share of `in_flight`; one more is refused with 429 (fair.rs).
    pub per_class: usize,
    /// Evaluations of one such class on the blocking pool at once (the rest of its
    /// reviews wait in the class's own queue), a share of the pool's permits.
    pub per_class_evaluations: usize,
    /// Bytes of the bodies of the reviews being answered, at most (by `Content-Length`,
    /// before a body is read); a review that does not fit is refused with 429.
    pub bytes_in_flight: usize,
    /// An admission review not answered by then gets 504; below the webhooks'
    /// `timeoutSeconds` (5).
    pub deadline: Duration,
    /// The same for a conversion review; below the API server's 30 s for conversion.
    pub convert_deadline: Duration,
    /// Time for the TLS handshake and then for a request's headers.
    pub handshake: Duration,
    /// Longest life of a connection (the API server reconnects).
    pub connection: Duration,
    /// Connections at once; further ones wait in the listen backlog.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body: 4 << 20,
            max_convert_body: 16 << 20,
            in_flight: 32,
            per_class: 8,
            per_class_evaluations: 2,
            bytes_in_flight: 64 << 20,
            deadline: Duration::from_secs(4),
            convert_deadline: Duration::from_secs(25),
            handshake: Duration::from_secs(5),
            connection: Duration::from_secs(300),
            max_connections: 256,
        }
    }
}

/// Whether the server serves, and until when its certificate is valid: `/readyz`.
#[derive(Debug, Default)]
pub struct Health {
    listening: AtomicBool,
    /// Seconds since the epoch; 0 before the first certificate.
    expires: AtomicI64,
}

impl Health {
    pub fn set_expiry(&self, expires: i64) {
        self.expires.store(expires, Ordering::SeqCst);
    }

    /// `Ok` while listening with a certificate valid at `now`; else why not.
    pub fn ready(&self, now: i64) -> Result<(), &'static str> {
        if !self.listening.load(Ordering::SeqCst) {
            return Err("the webhook server is not listening");
        }
        match self.expires.load(Ordering::SeqCst) {
            0 => Err("the webhook server has no certificate yet"),
            t if t <= now => Err("the webhook server's certificate has expired"),
            _ => Ok(()),
        }
    }
}

#[derive(Clone)]
struct Routes {
    handlers: Handlers,
    in_flight: Arc<Semaphore>,
    /// Bodies in flight, in KiB.
    kib_in_flight: Arc<Semaphore>,
    /// Each namespace's share of the reviews in flight.
    fair: Fair,
    limits: Limits,
    metrics: WebhookMetrics,
}

/// The three routes over `handlers`, within `limits`, counted in `metrics`.
pub fn router(handlers: Handlers, limits: Limits, metrics: WebhookMetrics) -> Router {
    let routes = Routes {
        handlers,
        in_flight: Arc::new(Semaphore::new(limits.in_flight.max(1))),
        kib_in_flight: Arc::new(Semaphore::new((limits.bytes_in_flight >> 10).max(1))),
        fair: Fair::new(limits.per_class, limits.per_class_evaluations),
        limits,
        metrics,
    };
    Router::new()
        .route(
            "/validate/{rule}",
            post(|s: State<Routes>, r: Path<String>, q: Request| answer(s, r, q, Route::Validate)),
        )
        .route(
            "/mutate/{rule}",
            post(|s: State<Routes>, r: Path<String>, q: Request| answer(s, r, q, Route::Mutate)),
        )
        .route(
            "/convert/{rule}",
            post(|s: State<Routes>, r: Path<String>, q: Request| answer(s, r, q, Route::Convert)),
        )
        .with_state(routes)
}

#[derive(Clone, Copy)]
enum Route {
    Validate,
    Mutate,
    Convert,
}

impl Route {
    fn as_str(self) -> &'static str {
        match self {
            Route::Validate => "validate",
            Route::Mutate => "mutate",
            Route::Convert => "convert",
        }
    }

    /// The largest body and the deadline of this route's reviews.
    fn limits(self, l: &Limits) -> (usize, Duration) {
        match self {
            Route::Validate | Route::Mutate => (l.max_body, l.deadline),
            Route::Convert => (l.max_convert_body, l.convert_deadline),
        }
    }
}

/// One review, answered and counted.
async fn answer(s: State<Routes>, rule: Path<String>, req: Request, route: Route) -> Response {
    let started = std::time::Instant::now();
    let metrics = s.metrics.clone();
    let response = judge(s, rule, req, route).await;
    let labels = WebhookLabels {
        route: route.as_str().to_string(),
        code: response.status().as_u16().to_string(),
    };
    metrics.requests.get_or_create(&labels).inc();
    metrics
        .duration
        .get_or_create(&RouteLabel {
            route: labels.route,
        })
        .observe(started.elapsed().as_secs_f64());
    response
}

/// A refusal of `status` for `reason` (one of `metrics::WEBHOOK_REFUSED_REASONS`), counted.
fn refuse(s: &Routes, status: StatusCode, reason: &str, message: String) -> Response {
    s.metrics
        .refused
        .get_or_create(&RefusedLabel {
            reason: reason.to_string(),
        })
        .inc();
    (status, message).into_response()
}

/// One review: parsed on the blocking pool, answered by its handler within the deadline.
async fn judge(
    State(s): State<Routes>,
    Path(rule): Path<String>,
    req: Request,
    route: Route,
) -> Response {
    let (max_body, deadline) = route.limits(&s.limits);
    let too_large = |s: &Routes| {
        refuse(
            s,
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            "the review is too large".into(),
        )
    };
    // What the body will weigh, before it is read: its Content-Length, else the most.
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        .unwrap_or(max_body);
    if declared > max_body {
        return too_large(&s);
    }
    let kib = u32::try_from((declared >> 10) + 1).unwrap_or(u32::MAX);
    let Ok(_permit) = s.in_flight.clone().try_acquire_owned() else {
        let m = "too many reviews in flight on this replica".to_string();
        return refuse(&s, StatusCode::TOO_MANY_REQUESTS, "in_flight", m);
    };
    let Ok(_bytes) = s.kib_in_flight.clone().try_acquire_many_owned(kib) else {
        let m = "too many bytes of reviews in flight on this replica".to_string();
        return refuse(&s, StatusCode::TOO_MANY_REQUESTS, "bytes_in_flight", m);
    };
    let Ok(body) = axum::body::to_bytes(req.into_body(), max_body).await else {
        return too_large(&s);
    };
    match tokio::time::timeout(deadline, evaluate(&s, rule, body, route)).await {
        Ok(response) => response,
        Err(_) => refuse(
            &s,
            StatusCode::GATEWAY_TIMEOUT,
            "deadline",
            "the review took longer than the webhook's deadline".into(),
        ),
    }
}

/// A review's body, parsed on the blocking pool, admitted within its class's share and
/// answered by its route's handler.
async fn evaluate(s: &Routes, rule: String, body: axum::body::Bytes, route: Route) -> Response {
    let admission = !matches!(route, Route::Convert);
    let rule_name = rule.clone();
    let parsed = tokio::task::spawn_blocking(move || {
        serde_json::from_slice::<Json>(&body).map_err(|e| {
            // An admission review too deep to read is refused by its uid, not answered
            // 400: a failed call is what `failurePolicy: Ignore` lets through.
            admission
                .then(|| super::admission::unreadable(&body, &rule_name, &e.to_string()))
                .flatten()
        })
    })
    .await
    .ok();
    let review = match parsed {
        Some(Ok(review)) => review,
        Some(Err(Some(denial))) => return axum::Json(denial).into_response(),
        _ => return (StatusCode::BAD_REQUEST, "the body is not a JSON review").into_response(),
    };
    let slot = match s.fair.enter(Class::of(&review, !admission)) {
        Ok(slot) => slot,
        Err(over) => {
            let m = over.to_string();
            return refuse(s, StatusCode::TOO_MANY_REQUESTS, "namespace_share", m);
        }
    };
    let handler = match route {
        Route::Validate => &s.handlers.validate,
        Route::Mutate => &s.handlers.mutate,
        Route::Convert => &s.handlers.convert,
    };
    let answer = handler(rule, review, Some(slot.lane.clone())).await;
    drop(slot);
    match answer {
        // The evaluation itself failed (it panicked): the API server's failure policy.
        Json::Null => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "the review could not be answered",
        )
            .into_response(),
        answer => axum::Json(answer).into_response(),
    }
}

/// Serves `app` over TLS on `listener` within `limits`, until the task is dropped.
pub async fn serve_on(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: Router,
    limits: Limits,
    health: Arc<Health>,
) -> std::io::Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    health.listening.store(true, Ordering::SeqCst);
    let _down = ListeningGuard(health);
    loop {
        let slot = slots
            .clone()
            .acquire_owned()
            .await
            .map_err(std::io::Error::other)?;
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::debug!(error = %e, "webhook: cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let service = TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let Ok(Ok(stream)) =
                tokio::time::timeout(limits.handshake, acceptor.accept(stream)).await
            else {
                return;
            };
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.handshake);
            let mut conn = pin!(builder.serve_connection(TokioIo::new(stream), service));
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = tokio::time::sleep(limits.connection) => {}
            }
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(limits.convert_deadline + limits.handshake, conn).await;
        });
    }
}

/// Marks the server down when its loop ends (or its task is dropped).
struct ListeningGuard(Arc<Health>);

impl Drop for ListeningGuard {
    fn drop(&mut self) {
        self.0.listening.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::certs::{self, Phase, Policy};
    use rustls::pki_types::ServerName;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A first bundle for [`policy`] and a resolver serving it.
    fn serving() -> (certs::Bundle, Arc<Resolver>) {
        let b = certs::next(None, &policy(), jiff::Timestamp::now().as_second(), &[])
            .unwrap()
            .unwrap();
        let resolver = Arc::new(Resolver::default());
        resolver.set(&b).unwrap();
        (b, resolver)
    }

    fn policy() -> Policy {
        Policy {
            ca_validity: Duration::from_secs(3000),
            tls_validity: Duration::from_secs(900),
            settle: Duration::from_secs(10),
            names: vec!["127.0.0.1".into()],
        }
    }

    /// A POST over TLS trusting only the CAs of `trusted`: `(status, body)`.
    async fn post(
        addr: &str,
        trusted: &str,
        path: &str,
        body: &[u8],
    ) -> Result<(u16, String), String> {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(trusted.as_bytes()) {
            roots
                .add(c.map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
        let mut tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| e.to_string())?;
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        tls.write_all(head.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        tls.write_all(body).await.map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        let _ = tls.read_to_end(&mut out).await;
        let text = String::from_utf8_lossy(&out).to_string();
        let status = text
            .get(9..12)
            .and_then(|s| s.parse().ok())
            .ok_or(text.clone())?;
        Ok((
            status,
            text.split("\r\n\r\n").nth(1).unwrap_or("").to_string(),
        ))
    }

    fn echo(delay: Duration) -> Handler {
        Arc::new(
            move |rule: String, review: Json, _lane| -> super::super::Answer {
                Box::pin(async move {
                    tokio::time::sleep(delay).await;
                    serde_json::json!({"rule": rule, "uid": review["request"]["uid"]})
                })
            },
        )
    }

    use super::super::Handler;

    async fn start(resolver: Arc<Resolver>, limits: Limits, delay: Duration) -> String {
        let h = echo(delay);
        let handlers = Handlers {
            validate: h.clone(),
            mutate: h.clone(),
            convert: h,
        };
        serve(resolver, handlers, limits, WebhookMetrics::default()).await
    }

    async fn serve(
        resolver: Arc<Resolver>,
        handlers: Handlers,
        limits: Limits,
        metrics: WebhookMetrics,
    ) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let tls = tls_config(resolver).unwrap();
        let health = Arc::new(Health::default());
        let app = router(handlers, limits, metrics);
        tokio::spawn(serve_on(listener, tls, app, limits, health));
        addr
    }

    /// A handler whose evaluation takes `work` on the blocking pool (2 permits), in the
    /// review's lane, as the admission handlers' do.
    fn slow_on_pool(work: Duration) -> Handler {
        let offload = super::super::offload::Offload::new(2);
        Arc::new(
            move |_rule: String, review: Json, lane| -> super::super::Answer {
                let offload = offload.in_lane(lane);
                Box::pin(async move {
                    offload.run(move || std::thread::sleep(work)).await.map_or(
                        Json::Null,
                        |()| serde_json::json!({"uid": review["request"]["uid"]}),
                    )
                })
            },
        )
    }

    fn review_in(ns: &str, uid: usize) -> Vec<u8> {
        serde_json::to_vec(
            &serde_json::json!({"request": {"uid": uid.to_string(), "namespace": ns}}),
        )
        .unwrap()
    }

    /// One namespace floods slow reviews: it gets its share, the rest of its reviews a
    /// fast 429 naming why, while every review of the other namespaces is answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_namespace_that_floods_gets_its_share_and_the_others_are_answered() {
        let (b, resolver) = serving();
        // Room for every review at once (24 + 6): only the namespace's share refuses.
        let limits = Limits {
            in_flight: 32,
            per_class: 4,
            per_class_evaluations: 1,
            deadline: Duration::from_secs(3),
            ..Limits::default()
        };
        let h = slow_on_pool(Duration::from_millis(250));
        let handlers = Handlers {
            validate: h.clone(),
            mutate: h.clone(),
            convert: h,
        };
        let metrics = WebhookMetrics::default();
        let addr = serve(resolver, handlers, limits, metrics.clone()).await;
        let trusted = b.trusted.clone();
        let flood = (0..24).map(|i| {
            let (addr, trusted) = (addr.clone(), trusted.clone());
            tokio::spawn(async move {
                let started = std::time::Instant::now();
                let r = post(&addr, &trusted, "/validate/a", &review_in("flood", i)).await;
                (r, started.elapsed())
            })
        });
        let flood: Vec<_> = flood.collect();
        // The others arrive while the flood holds its share (and queues in its lane).
        tokio::time::sleep(Duration::from_millis(100)).await;
        let others: Vec<_> = (0..6)
            .map(|i| {
                let (addr, trusted) = (addr.clone(), trusted.clone());
                tokio::spawn(async move {
                    let ns = format!("calm-{}", i % 3);
                    post(&addr, &trusted, "/mutate/a", &review_in(&ns, 100 + i)).await
                })
            })
            .collect();
        for o in others {
            let (status, body) = o.await.unwrap().unwrap();
            assert_eq!(status, 200, "another namespace's review: {body}");
        }
        let (mut answered, mut refused) = (0, 0);
        for f in flood {
            let (r, took) = f.await.unwrap();
            let (status, body) = r.unwrap();
            match status {
                200 => answered += 1,
                429 => {
                    refused += 1;
                    assert!(body.contains(r#"namespace "flood""#), "{body}");
                    assert!(body.contains("fair share"), "{body}");
                    // Not after the flood's evaluations (4 × 250 ms, one at a time).
                    assert!(took < Duration::from_secs(2), "refused fast: {took:?}");
                }
                other => panic!("flood: {other} {body}"),
            }
        }
        assert!(answered >= 4, "the flood got its share: {answered}");
        assert!(refused > 0, "the flood was refused past its share");
        let counted = metrics
            .refused
            .get_or_create(&RefusedLabel {
                reason: "namespace_share".into(),
            })
            .get();
        assert_eq!(counted, refused, "every refusal counted by reason");
    }

    /// A certificate swapped in serves from the next connection, and at every step of
    /// a CA rotation a client trusting the bundle of that step connects.
    #[tokio::test]
    async fn certificates_swap_without_a_restart_and_stay_trusted() {
        // Made 2,100 s ago with a lifetime of 3,000 s: the CA is due for rotation now.
        let p = Policy {
            tls_validity: Duration::from_secs(3000),
            ..policy()
        };
        let now = jiff::Timestamp::now().as_second();
        let first = certs::next(None, &p, now - 2_100, &[]).unwrap().unwrap();
        let resolver = Arc::new(Resolver::default());
        resolver.set(&first).unwrap();
        let addr = start(resolver.clone(), Limits::default(), Duration::ZERO).await;
        let review = br#"{"request":{"uid":"u1"}}"#;
        let (status, body) = post(&addr, &first.trusted, "/validate/app", review)
            .await
            .unwrap();
        assert_eq!(status, 200, "{body}");
        assert!(
            body.contains(r#""rule":"app""#) && body.contains("u1"),
            "{body}"
        );
        // The CA rotation: each bundle served while the API server trusts the one before.
        let t = now;
        let adding = certs::next(Some(&first), &p, t, &[]).unwrap().unwrap();
        assert_eq!(adding.phase, Phase::Adding);
        let dropping = certs::next(Some(&adding), &p, t + 10, &[])
            .unwrap()
            .unwrap();
        let stable = certs::next(Some(&dropping), &p, t + 20, &[])
            .unwrap()
            .unwrap();
        for (serving, trusted) in [
            (&adding, &first),
            (&dropping, &adding),
            (&stable, &dropping),
            (&stable, &stable),
        ] {
            resolver.set(serving).unwrap();
            let (status, _) = post(&addr, &trusted.trusted, "/convert/app", review)
                .await
                .unwrap();
            assert_eq!(status, 200);
        }
        // The old CA alone no longer verifies what serves now: the swap took effect.
        let refused = post(&addr, &first.ca_cert, "/mutate/app", review).await;
        assert!(refused.is_err(), "{refused:?}");
    }

    #[tokio::test]
    async fn requests_are_bounded_in_size_number_and_time() {
        let (b, resolver) = serving();
        let limits = Limits {
            max_body: 1024,
            in_flight: 1,
            deadline: Duration::from_millis(300),
            ..Limits::default()
        };
        let slow = start(resolver.clone(), limits, Duration::from_secs(2)).await;
        let big = vec![b' '; 4096];
        assert_eq!(
            post(&slow, &b.trusted, "/validate/a", &big)
                .await
                .unwrap()
                .0,
            413
        );
        assert_eq!(
            post(&slow, &b.trusted, "/validate/a", b"not json")
                .await
                .unwrap()
                .0,
            400
        );
        let started = std::time::Instant::now();
        let (first, second) = tokio::join!(post(&slow, &b.trusted, "/validate/a", b"{}"), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            post(&slow, &b.trusted, "/validate/a", b"{}").await
        });
        assert_eq!(first.unwrap().0, 504, "past the deadline");
        assert_eq!(second.unwrap().0, 429, "one in flight at most");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            post(&slow, &b.trusted, "/nothing/a", b"{}")
                .await
                .unwrap()
                .0,
            404
        );
        // A conversion may be larger, and take longer.
        let mut page = br#"{"objects":""#.to_vec();
        page.extend(vec![b'x'; 4000]);
        page.extend(br#""}"#);
        assert_eq!(
            post(&slow, &b.trusted, "/convert/a", &page)
                .await
                .unwrap()
                .0,
            200
        );
        // The bytes in flight: a second body that does not fit beside the first is
        // refused at once.
        let budget = Limits {
            max_body: 8192,
            in_flight: 8,
            bytes_in_flight: 6 << 10,
            deadline: Duration::from_millis(500),
            ..Limits::default()
        };
        let tight = start(resolver, budget, Duration::from_secs(2)).await;
        let (first, second) = tokio::join!(post(&tight, &b.trusted, "/validate/a", &page), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            post(&tight, &b.trusted, "/validate/a", &page).await
        });
        assert_eq!(first.unwrap().0, 504);
        assert_eq!(second.unwrap().0, 429, "no room for a second body");
    }

    #[test]
    fn readiness_needs_a_listener_and_a_valid_certificate() {
        let h = Health::default();
        assert!(h.ready(100).is_err());
        h.listening.store(true, Ordering::SeqCst);
        assert_eq!(
            h.ready(100),
            Err("the webhook server has no certificate yet")
        );
        h.set_expiry(200);
        assert_eq!(h.ready(100), Ok(()));
        assert!(h.ready(200).is_err(), "expired");
    }
}
