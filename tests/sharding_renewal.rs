//! A sharded member renews its Lease ahead of everything else: a coordination round
//! that outlasts a renewal period (a slow API server, a slow count of the parents) is
//! dropped at the renewal's deadline, never the other way round. Against the local
//! control plane, with a client that holds every answer to a list of Leases for longer
//! than a whole Lease: were the round awaited before the renewal, the member's write
//! gate would close and its Lease would lapse.

mod common;

use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, ListParams};
use kube::client::ClientBuilder;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use rulebook::shard::gate::ShardGate;
use rulebook::shard::members::{Membership, ParentKinds, ShardStatus, Share};
use tokio::sync::watch;

/// Holds the answer to every list of Leases (a GET on `…/leases` that is not a watch)
/// for `delay`; everything else passes at once.
#[derive(Clone)]
struct SlowLists<S> {
    inner: S,
    delay: Duration,
}

type Boxed<T, E> = Pin<Box<dyn std::future::Future<Output = Result<T, E>> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for SlowLists<S>
where
    S: tower::Service<http::Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Boxed<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let list = req.method() == http::Method::GET
            && req.uri().path().ends_with("/leases")
            && !req.uri().query().unwrap_or("").contains("watch=");
        let answer = self.inner.call(req);
        let delay = self.delay;
        Box::pin(async move {
            if list {
                tokio::time::sleep(delay).await;
            }
            answer.await
        })
    }
}

#[derive(Clone)]
struct SlowListsLayer(Duration);

impl<S> tower::Layer<S> for SlowListsLayer {
    type Service = SlowLists<S>;
    fn layer(&self, inner: S) -> SlowLists<S> {
        SlowLists {
            inner,
            delay: self.0,
        }
    }
}

async fn slow_client(delay: Duration) -> Client {
    let kc = Kubeconfig::read_from(kubeconfig_path()).unwrap();
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    ClientBuilder::try_from(config)
        .unwrap()
        .with_layer(&SlowListsLayer(delay))
        .build()
}

/// The member Lease's renewTime, as the API server has it.
async fn renewed_at(leases: &Api<Lease>, group: &str) -> Option<String> {
    let list = leases
        .list(&ListParams::default().labels(&format!(
            "rulebook.dev/shard-group={group},rulebook.dev/shard-role=member"
        )))
        .await
        .ok()?;
    let lease = list.items.into_iter().next()?;
    let t = lease.spec?.renew_time?;
    Some(t.0.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_round_never_delays_the_lease_renewal() {
    let client = client().await;
    let ns = namespace(&client, "renewal").await;
    let lease = Duration::from_secs(6);
    // Every round lists the group's Leases first, and waits 15 s for the answer: two
    // and a half Leases, so no round ever completes while the test watches.
    let slow = slow_client(Duration::from_secs(15)).await;
    let gate = Arc::new(ShardGate::default());
    let member = Membership::new(
        slow,
        gate.clone(),
        &ns,
        "renewal",
        "member-a",
        lease,
        Duration::from_secs(60),
    );
    let (shares, _shares_rx) = watch::channel(Share::default());
    let (_applied, applied_rx) = watch::channel(0u64);
    let (_rules, rules_rx) = watch::channel(ParentKinds {
        fingerprint: "renewal-test".into(),
        parents: Vec::new(),
    });
    let (stop, stop_rx) = watch::channel(false);
    let status = Arc::new(RwLock::new(ShardStatus::default()));
    let running = tokio::spawn(member.run(shares, applied_rx, rules_rx, status, stop_rx));

    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    // The first renewal creates the Lease and opens the gate.
    let start = Instant::now();
    while !gate.lease().open_at(Instant::now()) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the first renewal opened the member's write gate"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Then for 14 s (seven renewal periods, every round stuck on its list): the gate
    // stays open, and the Lease's renewTime keeps moving.
    let watched = Instant::now();
    let mut stamps = Vec::new();
    while watched.elapsed() < Duration::from_secs(14) {
        assert!(
            gate.lease().open_at(Instant::now()),
            "the gate closed {:?} into the slow rounds: the renewal waited for a round",
            watched.elapsed()
        );
        if let Some(t) = renewed_at(&leases, "renewal").await
            && stamps.last() != Some(&t)
        {
            stamps.push(t);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "renewals seen in 14 s of rounds that never finish: {}",
        stamps.len()
    );
    // One renewal per third of a Lease (2 s): about seven; five leaves room for a slow
    // API server.
    assert!(
        stamps.len() >= 5,
        "the Lease was renewed every third of a Lease while every round hung: {stamps:?}"
    );
    let _ = stop.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(20), running).await;
}
