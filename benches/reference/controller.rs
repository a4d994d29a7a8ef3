//! The reference controller: the benchmark rule (`benches/rules/bench.yaml`) written by
//! hand against kube-rs, as the yardstick Rulebook is measured against
//! (docs/benchmarks.md). Not part of the library and not a product.
//!
//! Per `Bench` parent it owns a ConfigMap, a headless Service and a Secret, and writes
//! `status.configMap`, `status.service`, `status.observedGeneration` and a `Ready`
//! condition. It makes the fewest API calls a careful controller makes:
//!
//! * one server-side apply per child whose desired object changed — decided on the
//!   cached child by a desired-hash annotation, as Rulebook does, so nothing is written
//!   at steady state;
//! * one status apply when the status changed, computed from the apply responses (a
//!   child that was just applied exists, so the parent is Ready in the same reconcile);
//! * no events unless `--events` (then, like Rulebook, one Normal event on the parent
//!   per reconcile that created or updated children, sent in the background through a
//!   bounded outbox: 1,000 queued, 2 in flight), no reads outside the watch caches;
//! * no second write of the same thing when a reconcile runs before the watch event of
//!   its own last write reached the cache (the written resourceVersion is remembered).
//!
//! It serves the CRD that Rulebook generates from the rule (applied by the benchmark
//! driver); the Rust types below only read it. Parent events that change only the
//! status do not reconcile (generation predicate), every parent is requeued after
//! `--requeue-seconds` (Rulebook's `resync`), and `--concurrency` bounds concurrent
//! reconciles as Rulebook's flag does.
//!
//! `/metrics` counts the write requests by verb (`reference_api_writes_total`);
//! `/readyz` answers `ok` once every cache has listed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, predicates, watcher};
use kube::{Client, Config, CustomResource, Resource, ResourceExt};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value as Json, json};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

const MANAGER: &str = "bench-reference";
const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
const OWNER: &str = "bench.rulebook.dev/owner";
const DESIRED_HASH: &str = "bench.rulebook.dev/desired-hash";

#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, JsonSchema)]
#[kube(
    group = "bench.rulebook.dev",
    version = "v1",
    kind = "Bench",
    plural = "benches",
    namespaced,
    status = "BenchStatus"
)]
pub struct BenchSpec {
    pub size: i64,
    pub data: String,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BenchStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub last_transition_time: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

struct Args {
    kubeconfig: Option<PathBuf>,
    namespace: String,
    concurrency: u16,
    metrics_addr: SocketAddr,
    requeue: Duration,
    events: bool,
}

fn args() -> Args {
    let mut a = Args {
        kubeconfig: std::env::var_os("KUBECONFIG").map(PathBuf::from),
        namespace: "default".into(),
        concurrency: 4,
        metrics_addr: "127.0.0.1:8081".parse().expect("addr"),
        requeue: Duration::from_secs(60),
        events: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| usage(&format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--kubeconfig" => a.kubeconfig = Some(value().into()),
            "--namespace" => a.namespace = value(),
            "--concurrency" => {
                a.concurrency = value().parse().unwrap_or_else(|_| usage("--concurrency"))
            }
            "--metrics-addr" => {
                a.metrics_addr = value().parse().unwrap_or_else(|_| usage("--metrics-addr"))
            }
            "--requeue-seconds" => {
                a.requeue = Duration::from_secs(
                    value()
                        .parse()
                        .unwrap_or_else(|_| usage("--requeue-seconds")),
                )
            }
            "--events" => a.events = true,
            _ => usage(&format!("unknown flag {flag}")),
        }
    }
    a
}

fn usage(msg: &str) -> ! {
    eprintln!(
        "bench-reference: {msg}\nusage: bench-reference [--kubeconfig PATH] [--namespace NS] \
         [--concurrency N] [--metrics-addr ADDR] [--requeue-seconds S] [--events]"
    );
    std::process::exit(2)
}

#[derive(Default)]
struct Counters {
    apply: AtomicU64,
    apply_status: AtomicU64,
    events: AtomicU64,
    reconciles: AtomicU64,
    errors: AtomicU64,
    ready: AtomicBool,
}

struct Ctx {
    client: Client,
    configmaps: Store<ConfigMap>,
    services: Store<Service>,
    secrets: Store<Secret>,
    counters: Arc<Counters>,
    requeue: Duration,
    /// Writes whose watch events may not have reached the caches yet: object key →
    /// (what was written, the resourceVersion the API server returned). A reconcile that
    /// reads an older cached object skips a write it already made (the "expectations"
    /// pattern of kube-controller-manager's controllers).
    expected: Mutex<HashMap<String, (String, u64)>>,
    /// With `--events`: places in the event outbox, and senders.
    events: Option<(Arc<Semaphore>, Arc<Semaphore>)>,
}

impl Ctx {
    /// Whether `what` was already written to `key` and the cache is older than that write.
    fn already_written(&self, key: &str, what: &str, cached_rv: Option<&str>) -> bool {
        let mut expected = self.expected.lock().unwrap_or_else(|p| p.into_inner());
        let Some((written, rv)) = expected.get(key) else {
            return false;
        };
        let cached = cached_rv.and_then(|v| v.parse::<u64>().ok());
        match cached {
            Some(c) if c >= *rv => {
                // The cache has caught up: it is the truth again.
                expected.remove(key);
                false
            }
            _ => written == what,
        }
    }

    fn wrote(&self, key: String, what: String, rv: Option<&str>) {
        if let Some(rv) = rv.and_then(|v| v.parse::<u64>().ok()) {
            self.expected
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(key, (what, rv));
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("{0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Invalid(&'static str),
}

fn hash(o: &Json) -> String {
    hex::encode(&Sha256::digest(serde_json::to_vec(o).unwrap_or_default())[..8])
}

/// The three children of a parent, each with its desired hash annotation set.
fn desired(b: &Bench, ns: &str, uid: &str) -> [(Json, String); 3] {
    let name = b.name_any();
    let owner = json!([{
        "apiVersion": "bench.rulebook.dev/v1", "kind": "Bench",
        "name": name, "uid": uid, "controller": true,
    }]);
    let meta = |child: String| {
        json!({
            "name": child, "namespace": ns,
            "labels": {"app": name, MANAGED_BY: MANAGER, OWNER: uid},
            "annotations": {},
            "ownerReferences": owner,
        })
    };
    let token = base64::engine::general_purpose::STANDARD.encode(format!("{name}:{}", b.spec.data));
    let objects = [
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(format!("{name}-config")),
               "data": {"size": b.spec.size.to_string(), "data": b.spec.data}}),
        json!({"apiVersion": "v1", "kind": "Service", "metadata": meta(name.clone()),
               "spec": {"clusterIP": "None",
                        "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}),
        json!({"apiVersion": "v1", "kind": "Secret", "metadata": meta(format!("{name}-secret")),
               "type": "Opaque", "data": {"token": token}}),
    ];
    objects.map(|mut o| {
        let h = hash(&o);
        o["metadata"]["annotations"][DESIRED_HASH] = Json::String(h.clone());
        (o, h)
    })
}

/// Applies `obj` unless the cached child is controlled by `uid` and carries `hash`;
/// `Created` or `Updated` when it applied.
async fn ensure<K>(
    ctx: &Ctx,
    store: &Store<K>,
    ns: &str,
    uid: &str,
    obj: &Json,
    hash: &str,
) -> Result<Option<&'static str>, Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
{
    let name = obj["metadata"]["name"]
        .as_str()
        .ok_or(Error::Invalid("no name"))?;
    let current = store.get(&ObjectRef::new(name).within(ns));
    let up_to_date = current.as_ref().is_some_and(|o| {
        o.owner_references()
            .iter()
            .any(|r| r.uid == uid && r.controller == Some(true))
            && o.annotations().get(DESIRED_HASH).map(String::as_str) == Some(hash)
    });
    if up_to_date {
        return Ok(None);
    }
    let key = format!("{}/{ns}/{name}", K::kind(&()));
    let cached_rv = current.as_ref().and_then(|o| o.resource_version());
    if ctx.already_written(&key, hash, cached_rv.as_deref()) {
        return Ok(None);
    }
    let api: Api<K> = Api::namespaced(ctx.client.clone(), ns);
    let applied = api
        .patch(
            name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(obj),
        )
        .await?;
    ctx.counters.apply.fetch_add(1, Ordering::Relaxed);
    ctx.wrote(key, hash.to_string(), applied.resource_version().as_deref());
    Ok(Some(if current.is_some() {
        "Updated"
    } else {
        "Created"
    }))
}

/// With `--events`, posts one Normal event on the parent naming the children applied
/// (a reason per kind of change, as Rulebook does), sent in the background.
fn post_events(ctx: &Ctx, b: &Bench, applied: &[(Option<&'static str>, &Json)]) {
    let Some((queued, sending)) = &ctx.events else {
        return;
    };
    for reason in ["Created", "Updated"] {
        let names: Vec<String> = applied
            .iter()
            .filter(|(r, _)| *r == Some(reason))
            .map(|(_, o)| {
                let field = |v: &Json| v.as_str().unwrap_or_default().to_string();
                format!("{} {}", field(&o["kind"]), field(&o["metadata"]["name"]))
            })
            .collect();
        if names.is_empty() {
            continue;
        }
        let Ok(slot) = queued.clone().try_acquire_owned() else {
            continue; // the outbox is full: dropped
        };
        let now = jiff::Timestamp::now();
        let event = K8sEvent {
            metadata: ObjectMeta {
                name: Some(format!("{}.{:x}", b.name_any(), now.as_nanosecond())),
                namespace: b.namespace(),
                ..Default::default()
            },
            event_time: Some(MicroTime(now)),
            reporting_controller: Some(MANAGER.into()),
            reporting_instance: Some(MANAGER.into()),
            action: Some("Apply".into()),
            reason: Some(reason.into()),
            type_: Some("Normal".into()),
            note: Some(format!("{}: {}", names.join(", "), reason.to_lowercase())),
            regarding: Some(b.object_ref(&())),
            ..Default::default()
        };
        let (sending, client, counters) =
            (sending.clone(), ctx.client.clone(), ctx.counters.clone());
        let ns = b.namespace().unwrap_or_default();
        tokio::spawn(async move {
            let _slot = slot;
            let Ok(_sender) = sending.acquire_owned().await else {
                return;
            };
            let api: Api<K8sEvent> = Api::namespaced(client, &ns);
            match api.create(&Default::default(), &event).await {
                Ok(_) => _ = counters.events.fetch_add(1, Ordering::Relaxed),
                Err(e) => eprintln!("bench-reference: cannot publish event: {e}"),
            }
        });
    }
}

fn now() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

async fn reconcile(b: Arc<Bench>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    ctx.counters.reconciles.fetch_add(1, Ordering::Relaxed);
    if b.meta().deletion_timestamp.is_some() {
        return Ok(Action::await_change()); // the garbage collector removes the children
    }
    let ns = b.namespace().ok_or(Error::Invalid("no namespace"))?;
    let uid = b.uid().ok_or(Error::Invalid("no uid"))?;
    let [cm, svc, secret] = desired(&b, &ns, &uid);
    let applied = [
        (
            ensure(&ctx, &ctx.configmaps, &ns, &uid, &cm.0, &cm.1).await?,
            &cm.0,
        ),
        (
            ensure(&ctx, &ctx.services, &ns, &uid, &svc.0, &svc.1).await?,
            &svc.0,
        ),
        (
            ensure(&ctx, &ctx.secrets, &ns, &uid, &secret.0, &secret.1).await?,
            &secret.0,
        ),
    ];
    post_events(&ctx, &b, &applied);

    // Every child exists now (applied above or found in the cache): the parent is Ready.
    let generation = b.meta().generation;
    let live = b.status.clone().unwrap_or_default();
    let previous = live.conditions.iter().find(|c| c.type_ == "Ready");
    let ready = Condition {
        type_: "Ready".into(),
        status: "True".into(),
        reason: "Ready".into(),
        message: "all children are ready".into(),
        last_transition_time: previous
            .filter(|c| c.status == "True" && !c.last_transition_time.is_empty())
            .map(|c| c.last_transition_time.clone())
            .unwrap_or_else(now),
        observed_generation: generation,
    };
    let want = BenchStatus {
        config_map: cm.0["metadata"]["name"].as_str().map(String::from),
        service: svc.0["metadata"]["name"].as_str().map(String::from),
        observed_generation: generation,
        conditions: vec![ready.clone()],
    };
    let unchanged = live.config_map == want.config_map
        && live.service == want.service
        && live.observed_generation == want.observed_generation
        && previous == Some(&ready);
    // What the status says, without the transition time (which a stale cache moves).
    let what = format!(
        "{:?}/{:?}/{:?}/{}/{}",
        want.config_map, want.service, want.observed_generation, ready.status, ready.reason
    );
    let key = format!("Bench/{ns}/{}", b.name_any());
    if !unchanged && !ctx.already_written(&key, &what, b.resource_version().as_deref()) {
        let api: Api<Bench> = Api::namespaced(ctx.client.clone(), &ns);
        let body = json!({"apiVersion": "bench.rulebook.dev/v1", "kind": "Bench",
                          "metadata": {"name": b.name_any()}, "status": want});
        match api
            .patch_status(
                &b.name_any(),
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await
        {
            Ok(o) => {
                ctx.counters.apply_status.fetch_add(1, Ordering::Relaxed);
                ctx.wrote(key, what, o.resource_version().as_deref());
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {} // the parent is gone
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Action::requeue(ctx.requeue))
}

fn error_policy(_b: Arc<Bench>, err: &Error, ctx: Arc<Ctx>) -> Action {
    ctx.counters.errors.fetch_add(1, Ordering::Relaxed);
    eprintln!("bench-reference: reconcile failed: {err}");
    Action::requeue(Duration::from_secs(1))
}

/// Children are cached without managedFields and last-applied annotations (only the
/// desired-hash annotation and the owner reference are read).
fn strip<K: Resource>(o: &mut K) {
    o.meta_mut().managed_fields = None;
}

async fn client(kubeconfig: Option<&PathBuf>) -> anyhow::Result<Client> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?
        }
        None => Config::infer().await?,
    };
    config.read_timeout = Some(Duration::from_secs(300));
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static("bench-reference/0.1"),
    ));
    Ok(Client::try_from(config)?)
}

async fn serve(listener: tokio::net::TcpListener, counters: Arc<Counters>) -> anyhow::Result<()> {
    use axum::routing::get;
    let c1 = counters.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let c = c1.clone();
                async move {
                    format!(
                        "reference_api_writes_total{{verb=\"apply\"}} {}\n\
                         reference_api_writes_total{{verb=\"apply_status\"}} {}\n\
                         reference_api_writes_total{{verb=\"event\"}} {}\n\
                         reference_reconciles_total {}\n\
                         reference_reconcile_errors_total {}\n",
                        c.apply.load(Ordering::Relaxed),
                        c.apply_status.load(Ordering::Relaxed),
                        c.events.load(Ordering::Relaxed),
                        c.reconciles.load(Ordering::Relaxed),
                        c.errors.load(Ordering::Relaxed),
                    )
                }
            }),
        )
        .route(
            "/readyz",
            get(move || {
                let c = counters.clone();
                async move {
                    if c.ready.load(Ordering::SeqCst) {
                        (axum::http::StatusCode::OK, "ok")
                    } else {
                        (axum::http::StatusCode::SERVICE_UNAVAILABLE, "syncing")
                    }
                }
            }),
        );
    axum::serve(listener, app).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = args();
    let client = client(args.kubeconfig.as_ref()).await?;
    let counters = Arc::new(Counters::default());
    // Bound before anything else: a port that is taken is an error, not a silent
    // endpoint that never answers.
    let listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.metrics_addr))?;
    tokio::spawn(serve(listener, counters.clone()));
    let ns = args.namespace.as_str();
    let children = watcher::Config::default()
        .labels(&format!("{MANAGED_BY}={MANAGER}"))
        .any_semantic();

    let (parents, parent_writer) = reflector::store::<Bench>();
    let parent_stream = watcher(
        Api::<Bench>::namespaced(client.clone(), ns),
        watcher::Config::default().any_semantic(),
    )
    .default_backoff()
    .modify(strip)
    .reflect(parent_writer)
    .applied_objects()
    .predicate_filter(predicates::generation, Default::default());
    let (configmaps, w) = reflector::store::<ConfigMap>();
    let cm_stream = watcher(
        Api::<ConfigMap>::namespaced(client.clone(), ns),
        children.clone(),
    )
    .default_backoff()
    .modify(strip)
    .reflect(w)
    .touched_objects();
    let (services, w) = reflector::store::<Service>();
    let svc_stream = watcher(
        Api::<Service>::namespaced(client.clone(), ns),
        children.clone(),
    )
    .default_backoff()
    .modify(strip)
    .reflect(w)
    .touched_objects();
    let (secrets, w) = reflector::store::<Secret>();
    let secret_stream = watcher(Api::<Secret>::namespaced(client.clone(), ns), children)
        .default_backoff()
        .modify(strip)
        .reflect(w)
        .touched_objects();

    {
        let (p, c, s, x, flag) = (
            parents.clone(),
            configmaps.clone(),
            services.clone(),
            secrets.clone(),
            counters.clone(),
        );
        tokio::spawn(async move {
            let _ = futures::join!(
                p.wait_until_ready(),
                c.wait_until_ready(),
                s.wait_until_ready(),
                x.wait_until_ready()
            );
            flag.ready.store(true, Ordering::SeqCst);
            eprintln!("bench-reference: caches synced");
        });
    }

    let ctx = Arc::new(Ctx {
        client,
        configmaps,
        services,
        secrets,
        counters,
        requeue: args.requeue,
        expected: Mutex::default(),
        events: args
            .events
            .then(|| (Arc::new(Semaphore::new(1000)), Arc::new(Semaphore::new(2)))),
    });
    Controller::for_stream(parent_stream, parents)
        .owns_stream(cm_stream)
        .owns_stream(svc_stream)
        .owns_stream(secret_stream)
        .with_config(ControllerConfig::default().concurrency(args.concurrency))
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|_| futures::future::ready(()))
        .await;
    Ok(())
}
