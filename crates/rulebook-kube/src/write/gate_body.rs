//! The write gate's last check, made where the request's bytes are written.
//!
//! [`super::gate::GateLayer`] checks a write when the client accepts it and again when
//! its future is first polled. Between that poll and the bytes on the socket the request
//! still waits: for a pooled connection or a new one (TCP and TLS handshakes), in the
//! client's retry backoff after a 429, behind the connection task. A process stopped
//! in that gap (SIGSTOP, a starved runtime) resumes past its lease with the request
//! already through both checks, and sends it while another replica leads — the stalled
//! leader test caught two such writes on a loaded machine.
//!
//! So the body of every write carries one more check: HTTP/1 asks a request body for
//! its first frame right after it has encoded the head into its write buffer and before
//! it flushes either, on the connection task, on the same poll. A closed gate fails that
//! frame; hyper then drops the connection with the head unsent. What remains is the time
//! between this check and the last byte on the socket: the same poll of the same task
//! for a request the socket buffer takes at once; a body of hundreds of KB may need more
//! polls, and a stop between them lets the rest go out. (An empty write body is sent
//! chunked rather than with `content-length: 0`, so that hyper asks it for a frame.)
//!
//! [`LastCheckLayer`] sits at the bottom of the API client's stack (built in
//! `operator::client`), below the retry layer, so a retried write is checked again too.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Request;
use http_body::{Body, Frame, SizeHint};

use super::gate::{WriteGate, WriteRefused, is_write_to};
use crate::counts::WriteCounts;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Wraps each request's body in a [`CheckedBody`]: writes get the gate's check.
#[derive(Clone)]
pub struct LastCheckLayer {
    gate: Arc<dyn WriteGate>,
    metrics: Arc<dyn WriteCounts>,
    /// The path the client's base URI puts before every API path (`""` for most clusters).
    base_path: String,
}

impl LastCheckLayer {
    pub fn new(gate: Arc<dyn WriteGate>, metrics: Arc<dyn WriteCounts>, base_path: &str) -> Self {
        LastCheckLayer {
            gate,
            metrics,
            base_path: base_path.trim_end_matches('/').to_string(),
        }
    }
}

impl<S> tower::Layer<S> for LastCheckLayer {
    type Service = LastCheck<S>;
    fn layer(&self, inner: S) -> LastCheck<S> {
        LastCheck {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct LastCheck<S> {
    inner: S,
    layer: LastCheckLayer,
}

impl<S, B> tower::Service<Request<B>> for LastCheck<S>
where
    S: tower::Service<Request<CheckedBody<B>>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> S::Future {
        // The API path as the gates above saw it: the cluster URL's prefix taken off
        // first, or an access review would count as a write (and name no namespace).
        let full = req.uri().path();
        let path = full.strip_prefix(&self.layer.base_path).unwrap_or(full);
        let check = is_write_to(req.method(), path, req.uri().query()).then(|| Check {
            gate: self.layer.gate.clone(),
            metrics: self.layer.metrics.clone(),
            path: path.to_string(),
        });
        self.inner.call(req.map(|inner| CheckedBody {
            inner,
            state: match check {
                Some(c) => State::Unchecked(c),
                None => State::Passed,
            },
        }))
    }
}

struct Check {
    gate: Arc<dyn WriteGate>,
    metrics: Arc<dyn WriteCounts>,
    path: String,
}

enum State {
    /// A write whose first frame has not been asked for yet.
    Unchecked(Check),
    /// A read, or a write that passed: the body is the inner one.
    Passed,
    /// The gate was closed when the first frame was asked for.
    Refused,
}

/// A request body that asks the write gate before it yields its first frame.
pub struct CheckedBody<B> {
    inner: B,
    state: State,
}

impl<B> Body for CheckedBody<B>
where
    B: Body + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, BoxError>>> {
        if let State::Unchecked(check) = &self.state {
            if !check.gate.may_send(&check.path) {
                check.metrics.count_refused();
                self.state = State::Refused;
                return Poll::Ready(Some(Err(Box::new(WriteRefused))));
            }
            self.state = State::Passed;
        }
        if matches!(self.state, State::Refused) {
            return Poll::Ready(Some(Err(Box::new(WriteRefused))));
        }
        Pin::new(&mut self.inner)
            .poll_frame(cx)
            .map(|frame| frame.map(|r| r.map_err(Into::into)))
    }

    /// Never at its end before the check: hyper sends a body it believes empty without
    /// asking it for a frame.
    fn is_end_stream(&self) -> bool {
        match self.state {
            State::Unchecked(_) => false,
            State::Passed => self.inner.is_end_stream(),
            // Still an error to ask (hyper does not ask again).
            State::Refused => false,
        }
    }

    /// An empty write body reports an unknown length until checked, for the same reason:
    /// with `content-length: 0` hyper has no body to ask.
    fn size_hint(&self) -> SizeHint {
        let hint = self.inner.size_hint();
        match self.state {
            State::Unchecked(_) if hint.exact() == Some(0) => SizeHint::default(),
            _ => hint,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::write::gate::LeaseGate;
    use http_body_util::{BodyExt, Full};
    use std::time::{Duration, Instant};
    use tokio::io::AsyncReadExt;
    use tower::{Layer, Service, ServiceExt};

    fn request(method: http::Method, uri: &str, body: &'static str) -> Request<Full<bytes::Bytes>> {
        Request::builder()
            .method(method)
            .uri(uri)
            .body(Full::new(bytes::Bytes::from_static(body.as_bytes())))
            .unwrap()
    }

    type Echo = LastCheck<
        tower::util::ServiceFn<
            fn(
                Request<CheckedBody<Full<bytes::Bytes>>>,
            ) -> std::future::Ready<
                Result<Request<CheckedBody<Full<bytes::Bytes>>>, std::convert::Infallible>,
            >,
        >,
    >;

    /// A stack whose bottom hands the request back: the body as hyper would get it.
    fn echo(gate: Arc<LeaseGate>, metrics: Arc<dyn WriteCounts>, base: &str) -> Echo {
        LastCheckLayer::new(gate, metrics, base)
            .layer(tower::service_fn(|req| std::future::ready(Ok(req))))
    }

    async fn body_of(
        svc: &mut Echo,
        method: http::Method,
        uri: &str,
        body: &'static str,
    ) -> CheckedBody<Full<bytes::Bytes>> {
        let req = request(method, uri, body);
        match svc.ready().await {
            Ok(s) => match s.call(req).await {
                Ok(r) => r.into_body(),
                Err(e) => match e {},
            },
            Err(e) => match e {},
        }
    }

    #[tokio::test]
    async fn a_write_body_asks_the_gate_at_its_first_frame() {
        let gate = Arc::new(LeaseGate::leased());
        gate.grant_until(Instant::now() + Duration::from_secs(30));
        let metrics = Arc::new(crate::counts::testing::Counted::default());
        let mut svc = echo(gate.clone(), metrics.clone(), "/prefix/");
        let path = "/prefix/api/v1/namespaces/a/configmaps/x";
        // Accepted while the lease held; its body is asked for after the lease lapsed.
        let write = body_of(&mut svc, http::Method::PATCH, path, "{}").await;
        let read = body_of(&mut svc, http::Method::GET, path, "{}").await;
        assert!(!write.is_end_stream());
        gate.revoke();
        assert!(write.collect().await.is_err());
        assert_eq!(metrics.refused(), 1);
        // Reads pass a closed gate.
        assert_eq!(read.collect().await.unwrap().to_bytes().as_ref(), b"{}");
        // A write checked while the gate is open keeps its body.
        gate.grant_until(Instant::now() + Duration::from_secs(30));
        let write = body_of(&mut svc, http::Method::POST, path, "{}").await;
        assert_eq!(write.collect().await.unwrap().to_bytes().as_ref(), b"{}");
        assert_eq!(metrics.refused(), 1);
    }

    /// The sharded gate decides by the namespace in the path: the base URI's prefix
    /// must not hide it.
    #[tokio::test]
    async fn the_gate_sees_the_api_path_without_the_base_prefix() {
        struct OnlyNamespaceA;
        impl WriteGate for OnlyNamespaceA {
            fn may_write(&self) -> bool {
                true
            }
            fn may_send(&self, path: &str) -> bool {
                path.starts_with("/api/v1/namespaces/a/")
            }
        }
        let metrics = Arc::new(crate::counts::testing::Counted::default());
        let layer = LastCheckLayer::new(Arc::new(OnlyNamespaceA), metrics.clone(), "/k8s/c1/");
        let mut svc = layer.layer(tower::service_fn(
            |req: Request<CheckedBody<Full<bytes::Bytes>>>| {
                std::future::ready(Ok::<_, std::convert::Infallible>(req.into_body()))
            },
        ));
        let a = request(
            http::Method::PATCH,
            "/k8s/c1/api/v1/namespaces/a/configmaps/x",
            "{}",
        );
        let b = request(
            http::Method::PATCH,
            "/k8s/c1/api/v1/namespaces/b/configmaps/x",
            "{}",
        );
        let review = request(
            http::Method::POST,
            "/k8s/c1/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            "{}",
        );
        let a = svc.ready().await.unwrap().call(a).await.unwrap();
        let b = svc.ready().await.unwrap().call(b).await.unwrap();
        let review = svc.ready().await.unwrap().call(review).await.unwrap();
        assert!(a.collect().await.is_ok());
        assert!(b.collect().await.is_err());
        // A question to the API server, not a write: no check, whatever the gate says.
        assert!(review.collect().await.is_ok());
        assert_eq!(metrics.refused(), 1);
    }

    #[tokio::test]
    async fn an_empty_write_body_is_still_asked() {
        let gate = Arc::new(LeaseGate::leased());
        let metrics = Arc::new(crate::counts::testing::Counted::default());
        let mut svc = echo(gate, metrics, "");
        let path = "/api/v1/namespaces/a/configmaps/x";
        let body = body_of(&mut svc, http::Method::DELETE, path, "").await;
        assert!(!body.is_end_stream());
        assert_eq!(body.size_hint().exact(), None);
        assert!(body.collect().await.is_err());
    }

    /// Through hyper's own HTTP/1 client against a plain TCP listener: a write handed to
    /// the client while the gate was open, whose connection comes up only after the gate
    /// closed, leaves no byte on the wire.
    #[tokio::test]
    async fn hyper_sends_nothing_of_a_write_refused_at_its_body() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let gate = Arc::new(LeaseGate::leased());
        gate.grant_until(Instant::now() + Duration::from_secs(30));
        let metrics = Arc::new(crate::counts::testing::Counted::default());
        // A connector that connects only once the test says so: the wait for a connection.
        let (connect, may_connect) = tokio::sync::watch::channel(false);
        let http = hyper_util::client::legacy::connect::HttpConnector::new();
        let connector = tower::service_fn(move |uri: http::Uri| {
            let (mut http, mut may_connect) = (http.clone(), may_connect.clone());
            Box::pin(async move {
                may_connect
                    .wait_for(|go| *go)
                    .await
                    .map_err(|e| Box::new(e) as BoxError)?;
                http.call(uri).await.map_err(|e| Box::new(e) as BoxError)
            })
        });
        let hyper =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build::<_, CheckedBody<Full<bytes::Bytes>>>(connector);
        let mut client = LastCheckLayer::new(gate.clone(), metrics.clone(), "").layer(hyper);
        let uri = format!("http://{addr}/api/v1/namespaces/a/configmaps/x");
        let pending =
            client
                .ready()
                .await
                .unwrap()
                .call(request(http::Method::PATCH, &uri, "{\"data\":{}}"));
        let sending = tokio::spawn(pending);
        gate.revoke();
        connect.send(true).unwrap();
        let (mut conn, _) = listener.accept().await.unwrap();
        // The first read ends the wait either way: the request's first bytes, or the end
        // of a connection the client dropped unsent.
        let mut received = vec![0u8; 4096];
        let n = conn.read(&mut received).await.unwrap();
        assert_eq!(
            n,
            0,
            "bytes of a refused write reached the server: {:?}",
            String::from_utf8_lossy(&received[..n])
        );
        let answer = sending.await.unwrap();
        let Err(failure) = answer else {
            panic!("the write was answered: {answer:?}");
        };
        // What the writer turns into `NotLeader`.
        assert!(crate::write::gate::was_refused(&failure), "{failure:?}");
        assert_eq!(metrics.refused(), 1);
    }
}
