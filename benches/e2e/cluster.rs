//! Talking to the local control plane: a client, namespaces, object APIs, watch-based
//! trackers of parents and children, and the API server's own request counters.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Config};
use serde_json::{Value as Json, json};

pub async fn client(kubeconfig: &Path) -> Result<Client> {
    let kc = Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("cannot read {}", kubeconfig.display()))?;
    let mut config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    config.read_timeout = Some(Duration::from_secs(300));
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static("rulebook-bench-driver"),
    ));
    let client = Client::try_from(config)?;
    let body = client
        .request_text(http::Request::get("/readyz").body(vec![])?)
        .await
        .context("the API server's /readyz")?;
    if body.trim() != "ok" {
        bail!("/readyz says {body}");
    }
    Ok(client)
}

/// An API for any kind by apiVersion, kind and plural.
pub fn api(
    client: &Client,
    ns: Option<&str>,
    api_version: &str,
    kind: &str,
    plural: &str,
) -> Api<DynamicObject> {
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let ar =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
    match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    }
}

pub async fn create_namespace(client: &Client, name: &str) -> Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    // A namespace left over from an interrupted run is removed first.
    if api.get_opt(name).await?.is_some() {
        delete_namespace(client, name, Duration::from_secs(600)).await?;
    }
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name,
        "labels": {"app.kubernetes.io/part-of": "rulebook-bench"}}}))?;
    api.create(&PostParams::default(), &ns).await?;
    Ok(())
}

/// Deletes a namespace and waits until it is gone.
pub async fn delete_namespace(client: &Client, name: &str, timeout: Duration) -> Result<f64> {
    let api: Api<Namespace> = Api::all(client.clone());
    let start = Instant::now();
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(0.0),
        Err(e) => return Err(e.into()),
    }
    loop {
        if api.get_opt(name).await?.is_none() {
            return Ok(start.elapsed().as_secs_f64());
        }
        if start.elapsed() > timeout {
            bail!("namespace {name} still terminating after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Server-side applies every object of a YAML stream (field manager `rulebook-bench`).
pub async fn apply_yaml(client: &Client, text: &str) -> Result<Vec<Json>> {
    let docs: Vec<Json> = serde_saphyr::from_multiple(text).map_err(|e| anyhow!("{e}"))?;
    let mut out = Vec::new();
    for doc in docs.into_iter().filter(|d| !d.is_null()) {
        let av = doc["apiVersion"].as_str().unwrap_or_default().to_string();
        let kind = doc["kind"].as_str().unwrap_or_default().to_string();
        let name = doc["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let plural = match kind.as_str() {
            "CustomResourceDefinition" => "customresourcedefinitions".to_string(),
            "ResourceGraphDefinition" => "resourcegraphdefinitions".to_string(),
            other => format!("{}s", other.to_lowercase()),
        };
        let ns = doc["metadata"]["namespace"].as_str().map(str::to_string);
        let a = api(client, ns.as_deref(), &av, &kind, &plural);
        let obj: DynamicObject = serde_json::from_value(doc)?;
        let applied = a
            .patch(
                &name,
                &PatchParams::apply("rulebook-bench").force(),
                &Patch::Apply(&obj),
            )
            .await
            .with_context(|| format!("applying {kind} {name}"))?;
        out.push(serde_json::to_value(applied)?);
    }
    Ok(out)
}

/// Waits until a CRD is Established and its kind is served.
pub async fn wait_crd(client: &Client, name: &str, timeout: Duration) -> Result<()> {
    let crds = api(
        client,
        None,
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    );
    let start = Instant::now();
    loop {
        if let Some(o) = crds.get_opt(name).await? {
            let o = serde_json::to_value(o)?;
            let established = o
                .pointer("/status/conditions")
                .and_then(Json::as_array)
                .is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "Established" && c["status"] == "True")
                });
            if established {
                return Ok(());
            }
        }
        if start.elapsed() > timeout {
            bail!("CRD {name} not established after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `namespace/name` of an object.
fn key(o: &DynamicObject) -> String {
    format!(
        "{}/{}",
        o.metadata.namespace.as_deref().unwrap_or(""),
        o.metadata.name.as_deref().unwrap_or("")
    )
}

/// One parent as the driver sees it on its watch.
#[derive(Clone, Debug, Default)]
struct ParentState {
    generation: i64,
    observed: Option<i64>,
    ready: bool,
}

/// Watches the parents of one namespace (or all) and counts the converged ones: Ready=True with
/// the current generation observed (`status.observedGeneration`, or the Ready
/// condition's `observedGeneration` for controllers that set only that, such as kro).
pub struct ParentTracker {
    state: Arc<Mutex<HashMap<String, ParentState>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ParentTracker {
    pub async fn start(api: Api<DynamicObject>) -> Result<ParentTracker> {
        ParentTracker::start_selected(api, None).await
    }

    /// Like [`ParentTracker::start`], only for the parents a label selector selects.
    pub async fn start_selected(
        api: Api<DynamicObject>,
        labels: Option<&str>,
    ) -> Result<ParentTracker> {
        let mut config = watcher::Config::default().any_semantic();
        if let Some(l) = labels {
            config = config.labels(l);
        }
        let state: Arc<Mutex<HashMap<String, ParentState>>> = Arc::default();
        let (synced_tx, synced_rx) = tokio::sync::oneshot::channel();
        let s = state.clone();
        let task = tokio::spawn(async move {
            let mut synced = Some(synced_tx);
            let mut stream = watcher(api, config).default_backoff().boxed();
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(watcher::Event::Apply(o)) | Ok(watcher::Event::InitApply(o)) => {
                        let (name, st) = parent_state(&o);
                        s.lock().unwrap().insert(name, st);
                    }
                    Ok(watcher::Event::Delete(o)) => {
                        s.lock().unwrap().remove(&key(&o));
                    }
                    Ok(watcher::Event::Init) => s.lock().unwrap().clear(),
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = synced.take() {
                            let _ = tx.send(());
                        }
                    }
                    Err(e) => eprintln!("bench: parent watch error: {e}"),
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(60), synced_rx)
            .await
            .context("parent watch did not sync")??;
        Ok(ParentTracker { state, task })
    }

    /// Parents converged at generation `min_generation` or later.
    pub fn converged(&self, min_generation: i64) -> usize {
        self.state
            .lock()
            .unwrap()
            .values()
            .filter(|p| {
                p.ready && p.generation >= min_generation && p.observed == Some(p.generation)
            })
            .count()
    }
}

impl Drop for ParentTracker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn parent_state(o: &DynamicObject) -> (String, ParentState) {
    // Keyed by namespace and name: a tracker may watch every namespace (benches/sharded.rs).
    let name = key(o);
    let generation = o.metadata.generation.unwrap_or(0);
    let status = o.data.get("status");
    let ready_cond = status
        .and_then(|s| s.get("conditions"))
        .and_then(Json::as_array)
        .and_then(|c| c.iter().find(|c| c["type"] == "Ready"));
    let ready = ready_cond.is_some_and(|c| c["status"] == "True");
    let observed = status
        .and_then(|s| s.get("observedGeneration"))
        .and_then(Json::as_i64)
        .or_else(|| ready_cond.and_then(|c| c["observedGeneration"].as_i64()));
    (
        name,
        ParentState {
            generation,
            observed,
            ready,
        },
    )
}

/// Watches objects of some kinds in a namespace and counts those whose string at the
/// JSON pointer `key` (e.g. `/status/ruleVersion`) has a given value.
pub struct FieldTracker {
    state: Arc<Mutex<HashMap<String, Option<String>>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    key: String,
}

impl FieldTracker {
    pub async fn start(
        apis: Vec<Api<DynamicObject>>,
        selector: &str,
        key: &str,
    ) -> Result<FieldTracker> {
        let state: Arc<Mutex<HashMap<String, Option<String>>>> = Arc::default();
        let mut tasks = Vec::new();
        let mut synced = Vec::new();
        for (i, api) in apis.into_iter().enumerate() {
            let (tx, rx) = tokio::sync::oneshot::channel();
            synced.push(rx);
            let s = state.clone();
            let key = key.to_string();
            let cfg = watcher::Config::default().labels(selector).any_semantic();
            tasks.push(tokio::spawn(async move {
                let mut tx = Some(tx);
                let mut stream = watcher(api, cfg).default_backoff().boxed();
                while let Some(ev) = stream.next().await {
                    match ev {
                        Ok(watcher::Event::Apply(o)) | Ok(watcher::Event::InitApply(o)) => {
                            let id = format!("{i}/{}", o.metadata.name.clone().unwrap_or_default());
                            let v = serde_json::to_value(&o).ok().and_then(|j| {
                                j.pointer(&key).and_then(|v| v.as_str()).map(str::to_string)
                            });
                            s.lock().unwrap().insert(id, v);
                        }
                        Ok(watcher::Event::Delete(o)) => {
                            let id = format!("{i}/{}", o.metadata.name.clone().unwrap_or_default());
                            s.lock().unwrap().remove(&id);
                        }
                        Ok(watcher::Event::InitDone) => {
                            if let Some(tx) = tx.take() {
                                let _ = tx.send(());
                            }
                        }
                        Ok(watcher::Event::Init) => {}
                        Err(e) => eprintln!("bench: child watch error: {e}"),
                    }
                }
            }));
        }
        for rx in synced {
            tokio::time::timeout(Duration::from_secs(60), rx)
                .await
                .context("child watch did not sync")??;
        }
        Ok(FieldTracker {
            state,
            tasks,
            key: key.to_string(),
        })
    }

    pub fn count(&self, value: &str) -> usize {
        self.state
            .lock()
            .unwrap()
            .values()
            .filter(|v| v.as_deref() == Some(value))
            .count()
    }

    pub fn key(&self) -> &str {
        &self.key
    }
}

impl Drop for FieldTracker {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The API server's `apiserver_request_total` write requests, keyed
/// `VERB resource[/subresource]` (only the resources the benchmark touches). The
/// metric has no user-agent label: it counts every client of the shared cluster.
pub async fn apiserver_writes(client: &Client) -> Result<BTreeMap<String, f64>> {
    let text = client
        .request_text(http::Request::get("/metrics").body(vec![])?)
        .await?;
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |k: &str| -> String {
            let pat = format!("{k}=\"");
            labels
                .split(',')
                .find_map(|kv| {
                    kv.trim()
                        .strip_prefix(&pat)
                        .map(|v| v.trim_end_matches('"').to_string())
                })
                .unwrap_or_default()
        };
        let verb = label("verb");
        if !matches!(
            verb.as_str(),
            "APPLY" | "PATCH" | "POST" | "PUT" | "DELETE" | "DELETECOLLECTION"
        ) {
            continue;
        }
        let resource = label("resource");
        if !matches!(
            resource.as_str(),
            "configmaps" | "services" | "secrets" | "benches" | "events"
        ) {
            continue;
        }
        let sub = label("subresource");
        let key = if sub.is_empty() {
            format!("{verb} {resource}")
        } else {
            format!("{verb} {resource}/{sub}")
        };
        let v: f64 = value.trim().parse().unwrap_or(0.0);
        *out.entry(key).or_insert(0.0) += v;
    }
    Ok(out)
}

pub fn diff(
    after: &BTreeMap<String, f64>,
    before: &BTreeMap<String, f64>,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v > 0.0)
        .collect()
}

/// Polls `probe` every 100 ms until it returns at least `target`, recording
/// `(seconds since start, value)` at every change; gives up after `timeout`.
pub async fn wait_count(
    start: Instant,
    target: usize,
    timeout: Duration,
    mut probe: impl FnMut() -> usize,
    timeline: &mut Vec<(f64, usize)>,
) -> bool {
    let mut last = usize::MAX;
    let mut last_print = Instant::now();
    loop {
        let n = probe();
        if n != last {
            timeline.push((start.elapsed().as_secs_f64(), n));
            last = n;
        }
        if n >= target {
            return true;
        }
        if start.elapsed() > timeout {
            return false;
        }
        if last_print.elapsed() > Duration::from_secs(10) {
            eprintln!(
                "bench:   … {n}/{target} after {:.0} s",
                start.elapsed().as_secs_f64()
            );
            last_print = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The API server's audit log, when the local cluster writes one
/// (`.cluster/logs/audit.log`, JSON lines): write requests per client and namespace.
pub struct Audit {
    pub path: std::path::PathBuf,
}

/// Write requests of one phase from the audit log.
#[derive(Debug, Default)]
pub struct AuditCounts {
    /// By `verb resource[/subresource]`, sent by the contender (user agent) in its namespace.
    pub contender: BTreeMap<String, f64>,
    /// By user agent (up to the first `/`): every other client writing in that namespace.
    pub others: BTreeMap<String, f64>,
}

impl Audit {
    pub fn open(path: &Path) -> Option<Audit> {
        path.exists().then(|| Audit {
            path: path.to_path_buf(),
        })
    }

    /// The log's current size: a phase is the bytes between two offsets.
    pub fn offset(&self) -> Option<u64> {
        std::fs::metadata(&self.path).ok().map(|m| m.len())
    }

    /// Counts the write requests logged between `from` and `to` in namespace `ns`; `None`
    /// when the log was rotated in between. A line cut by an offset belongs to the
    /// phase it started in.
    pub fn writes(&self, from: u64, to: u64, ns: &str, user_agent: &str) -> Option<AuditCounts> {
        use std::io::{Read, Seek, SeekFrom};
        if to < from {
            return None;
        }
        let mut f = std::fs::File::open(&self.path).ok()?;
        let start = from.saturating_sub(1);
        f.seek(SeekFrom::Start(start)).ok()?;
        let mut buf = Vec::new();
        f.by_ref().take(to - start).read_to_end(&mut buf).ok()?;
        // The rest of the line that straddles `to`.
        let mut rest = Vec::new();
        let mut byte = [0u8; 1];
        while !buf.ends_with(b"\n") && f.read(&mut byte).ok()? == 1 {
            rest.push(byte[0]);
            if byte[0] == b'\n' {
                break;
            }
        }
        buf.extend_from_slice(&rest);
        // Skip a line that started before `from`.
        let body = if from == 0 || buf.first() == Some(&b'\n') {
            &buf[usize::from(from != 0)..]
        } else {
            match buf.iter().position(|b| *b == b'\n') {
                Some(i) => &buf[i + 1..],
                None => &[][..],
            }
        };
        let ns_pat = format!("\"namespace\":\"{ns}\"");
        let mut counts = AuditCounts::default();
        for line in body.split(|b| *b == b'\n') {
            let Ok(text) = std::str::from_utf8(line) else {
                continue;
            };
            if !text.contains("\"stage\":\"ResponseComplete\"") || !text.contains(&ns_pat) {
                continue;
            }
            let Ok(ev) = serde_json::from_str::<Json>(text) else {
                continue;
            };
            let verb = ev["verb"].as_str().unwrap_or("");
            if !matches!(
                verb,
                "create" | "update" | "patch" | "delete" | "deletecollection"
            ) {
                continue;
            }
            if ev["objectRef"]["namespace"].as_str() != Some(ns) {
                continue;
            }
            let ua = ev["userAgent"].as_str().unwrap_or("");
            if ua.starts_with(user_agent) {
                let resource = ev["objectRef"]["resource"].as_str().unwrap_or("");
                let key = match ev["objectRef"]["subresource"].as_str() {
                    Some(sub) => format!("{verb} {resource}/{sub}"),
                    None => format!("{verb} {resource}"),
                };
                *counts.contender.entry(key).or_insert(0.0) += 1.0;
            } else {
                let who = ua.split('/').next().unwrap_or("").to_string();
                *counts.others.entry(who).or_insert(0.0) += 1.0;
            }
        }
        Some(counts)
    }
}
