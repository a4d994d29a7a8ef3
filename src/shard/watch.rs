//! What a sharded replica's caches go through: the API server's own filter
//! (`shardSelector`, KEP-5866) added to the list and watch requests of the caches of
//! parents and children, and the same filter applied here to every event, which makes
//! the fallback (an API server without the `ShardedListAndWatch` gate ignores the
//! parameter) correct and the server-side mode double-checked.
//!
//! kube 5 has no `shardSelector` in its list and watch parameters. The least code is a
//! tower layer on a client of its own that appends the parameter to every GET: that
//! client serves only the sharded caches' watchers, whose GETs are all lists and
//! watches. (Upstream, `ListParams`/`WatchParams` would grow a `shard_selector` field.)

use std::future::ready;
use std::sync::Arc;

use http::Request;
use http::uri::{PathAndQuery, Uri};
use kube::Client;
use kube::api::DynamicObject;
use kube::runtime::watcher;

use crate::shard::Ranges;
use crate::shard::gate::ShardGate;

/// A replica's share, as the engine runs it.
#[derive(Clone)]
pub struct Sharding {
    pub gate: Arc<ShardGate>,
    /// The ranges the rules run with now (the gate may already hold fewer: it shrinks
    /// before the rules restart).
    pub ranges: Ranges,
    /// Lists and watches parents and children with the API server's shard filter (or
    /// without, in the fallback: see `server_side`).
    pub watch_client: Client,
    /// The `shardSelector` `watch_client` adds to its lists and watches, if any (a rule
    /// with an identity of its own builds its own watch client with it: `engine/identity.rs`).
    pub selector: Option<String>,
    /// Whether the API server applies `shardSelector` itself.
    pub server_side: bool,
    /// Writes the rollout objects of the rules this replica coordinates (the hash of
    /// their name in its ranges), wherever the operator's namespace hashes to
    /// ([`crate::shard::gate::RolloutStoreGate`]).
    pub rollout_client: Client,
}

impl std::fmt::Debug for Sharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sharding")
            .field("ranges", &self.ranges.encode())
            .field("server_side", &self.server_side)
            .finish()
    }
}

/// A client layer that adds `shardSelector=…` to every GET.
#[derive(Clone)]
pub struct SelectorLayer {
    query: Arc<str>,
}

impl SelectorLayer {
    pub fn new(selector: &str) -> SelectorLayer {
        SelectorLayer {
            query: format!("shardSelector={}", encode(selector)).into(),
        }
    }
}

impl<S> tower::Layer<S> for SelectorLayer {
    type Service = WithSelector<S>;
    fn layer(&self, inner: S) -> WithSelector<S> {
        WithSelector {
            inner,
            query: self.query.clone(),
        }
    }
}

#[derive(Clone)]
pub struct WithSelector<S> {
    inner: S,
    query: Arc<str>,
}

impl<S, B> tower::Service<Request<B>> for WithSelector<S>
where
    S: tower::Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        if req.method() == http::Method::GET {
            let uri = req.uri();
            let pq = match uri.query() {
                Some(q) => format!("{}?{q}&{}", uri.path(), self.query),
                None => format!("{}?{}", uri.path(), self.query),
            };
            if let Ok(pq) = PathAndQuery::try_from(pq) {
                let mut parts = uri.clone().into_parts();
                parts.path_and_query = Some(pq);
                if let Ok(new) = Uri::from_parts(parts) {
                    *req.uri_mut() = new;
                }
            }
        }
        self.inner.call(req)
    }
}

/// Percent-encodes a query value (everything but unreserved characters).
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Whether the API server applies `shardSelector`: a list with one carries
/// `metadata.shardInfo` only when it does. Asked with one Lease of `namespace`.
pub async fn server_filters(client: &Client, namespace: &str) -> Result<bool, kube::Error> {
    let selector = Ranges::all().selector().unwrap_or_default();
    let encoded = encode(&selector);
    let req = Request::get(format!(
        "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases?limit=1&shardSelector={encoded}"
    ))
    .body(Vec::new())
    .map_err(kube::Error::HttpError)?;
    let list: serde_json::Value = client.request(req).await?;
    Ok(list["metadata"].get("shardInfo").is_some())
}

/// A filter for a sharded cache's events: objects outside `ranges` never reach it
/// (`None`: not sharded, everything passes).
pub fn keep(
    ranges: Option<Ranges>,
) -> impl FnMut(&Result<watcher::Event<DynamicObject>, watcher::Error>) -> std::future::Ready<bool>
+ Send
+ 'static {
    move |event| {
        ready(match event {
            Ok(
                watcher::Event::Apply(o) | watcher::Event::InitApply(o) | watcher::Event::Delete(o),
            ) => ranges
                .as_ref()
                .is_none_or(|r| r.holds_namespace(o.metadata.namespace.as_deref().unwrap_or(""))),
            _ => true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{Layer, Service, ServiceExt};

    #[tokio::test]
    async fn gets_carry_the_selector_and_writes_do_not() {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        let inner = tower::service_fn(move |req: Request<()>| {
            log.lock().unwrap().push(req.uri().to_string());
            async { Ok::<_, std::convert::Infallible>(()) }
        });
        let mut svc =
            SelectorLayer::new("shardRange(object.metadata.namespace, '0x0', '0x1')").layer(inner);
        let get = Request::get("/api/v1/configmaps?watch=true&labelSelector=a%3Db")
            .body(())
            .unwrap();
        svc.ready().await.unwrap().call(get).await.unwrap();
        let list = Request::get("/api/v1/configmaps").body(()).unwrap();
        svc.ready().await.unwrap().call(list).await.unwrap();
        let patch = Request::patch("/api/v1/namespaces/a/configmaps/x")
            .body(())
            .unwrap();
        svc.ready().await.unwrap().call(patch).await.unwrap();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(
            seen[0],
            "/api/v1/configmaps?watch=true&labelSelector=a%3Db&shardSelector=shardRange%28object.metadata.namespace%2C%20%270x0%27%2C%20%270x1%27%29"
        );
        assert!(seen[1].starts_with("/api/v1/configmaps?shardSelector=shardRange"));
        assert_eq!(seen[2], "/api/v1/namespaces/a/configmaps/x");
    }

    #[test]
    fn the_filter_keeps_only_the_claimed_namespaces() {
        let h = u128::from(crate::shard::fnv1a("mine"));
        let mut keep = keep(Some(Ranges::of([(h, h + 1)])));
        let obj = |ns: &str| {
            let mut o = DynamicObject::new(
                "x",
                &kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&()),
            );
            o.metadata.namespace = Some(ns.into());
            o
        };
        let mut yes = |e| futures::executor::block_on(keep(&Ok(e)));
        assert!(yes(watcher::Event::Apply(obj("mine"))));
        assert!(!yes(watcher::Event::Apply(obj("theirs"))));
        assert!(!yes(watcher::Event::Delete(obj("theirs"))));
        assert!(yes(watcher::Event::InitDone));
    }
}
