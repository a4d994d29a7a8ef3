//! Shared harness for the tests that need the local control plane (`make cluster`).
//!
//! Every test gets its own namespace and, when it runs the operator, its own `rulebook
//! run` process scoped to that namespace, so tests run side by side without seeing each
//! other. A test that cannot reach the cluster fails with instructions; it never skips.

#![allow(dead_code)] // each test binary uses a different part of the harness

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Client, Config};
use serde_json::{Value as Json, json};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn kubeconfig_path() -> PathBuf {
    std::env::var_os("RULEBOOK_TEST_KUBECONFIG")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".cluster/kubeconfig"))
}

/// `tests/cluster/cluster.sh <cmd>` for the cluster the tests run on: the local control
/// plane whose state directory holds the kubeconfig (RULEBOOK_CLUSTER_DIR). `make test`
/// runs the tests that restart the API server or etcd on a second one
/// (`.cluster-restarts`, scripts/test.sh): their restarts must reach that one.
pub fn cluster_sh_command(cmd: &str) -> Command {
    let kubeconfig = kubeconfig_path();
    let dir = kubeconfig.parent().unwrap_or_else(|| Path::new("."));
    // cluster.sh tells its clusters apart by their canonical path (it canonicalizes too).
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mut c = Command::new(repo().join("tests/cluster/cluster.sh"));
    c.arg(cmd).env("RULEBOOK_CLUSTER_DIR", dir);
    c
}

fn no_cluster(why: impl std::fmt::Display) -> ! {
    panic!(
        "the local control plane is not reachable ({why}).\n\
         Start it with `make cluster` (or run everything with `make test`), \
         or point RULEBOOK_TEST_KUBECONFIG at a kubeconfig."
    )
}

/// A client for the local control plane; fails the test loudly when it is not running.
pub async fn client() -> Client {
    let path = kubeconfig_path();
    let kc = Kubeconfig::read_from(&path)
        .unwrap_or_else(|e| no_cluster(format!("cannot read {}: {e}", path.display())));
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap_or_else(|e| no_cluster(e));
    let client = Client::try_from(config).unwrap_or_else(|e| no_cluster(e));
    match client
        .request_text(http::Request::get("/readyz").body(vec![]).unwrap())
        .await
    {
        Ok(body) if body.trim() == "ok" => client,
        Ok(body) => no_cluster(format!("/readyz says {body}")),
        Err(e) => no_cluster(e),
    }
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A unique lower-case name with `prefix`.
pub fn unique(prefix: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() % 1_000_000)
        .unwrap_or(0);
    format!("{prefix}-{}-{t}-{n}", std::process::id() % 10_000)
}

/// Creates a fresh namespace for one test, deleted when the returned guard drops
/// (namespace.rs).
pub async fn namespace(client: &Client, prefix: &str) -> TestNamespace {
    TestNamespace::create(client, prefix).await
}

/// Polls `probe` until it returns `Some`, or fails the test after `timeout` naming `what`.
pub async fn wait_for<T, F, Fut>(timeout: Duration, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        if start.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Like [`wait_for`], but gives `None` after `timeout` instead of failing the test, for a
/// test that reports several findings before it asserts.
pub async fn poll_for<T, F, Fut>(timeout: Duration, mut probe: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return Some(v);
        }
        if start.elapsed() > timeout {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An API for any kind, by apiVersion and kind (plural guessed the Kubernetes way).
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

/// Creates or updates an object from JSON with server-side apply (field manager `test`).
pub async fn apply(api: &Api<DynamicObject>, obj: Json) -> DynamicObject {
    let name = obj["metadata"]["name"].as_str().expect("name").to_string();
    let obj: DynamicObject = serde_json::from_value(obj).expect("object");
    api.patch(
        &name,
        &PatchParams::apply("test").force(),
        &Patch::Apply(&obj),
    )
    .await
    .unwrap_or_else(|e| panic!("apply {name}: {e}"))
}

pub fn to_json(o: &DynamicObject) -> Json {
    serde_json::to_value(o).expect("json")
}

/// The `Ready` condition of an object: `(status, reason, message)`.
pub fn ready_condition(o: &Json) -> Option<(String, String, String)> {
    o.pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Ready")
        .map(|c| {
            (
                c["status"].as_str().unwrap_or("").to_string(),
                c["reason"].as_str().unwrap_or("").to_string(),
                c["message"].as_str().unwrap_or("").to_string(),
            )
        })
}

/// Waits until the object's Ready condition has `status` (and `reason`, when given),
/// for the object's current generation.
pub async fn wait_ready(
    api: &Api<DynamicObject>,
    name: &str,
    status: &str,
    reason: Option<&str>,
    timeout: Duration,
) -> Json {
    let what = format!(
        "{name} to have Ready={status}{}",
        reason.map(|r| format!(" ({r})")).unwrap_or_default()
    );
    wait_for(timeout, &what, || async {
        let o = to_json(&api.get_opt(name).await.ok().flatten()?);
        let (s, r, _) = ready_condition(&o)?;
        let generation = o.pointer("/metadata/generation");
        let observed = o.pointer("/status/observedGeneration");
        (s == status && reason.is_none_or(|want| want == r) && generation == observed).then_some(o)
    })
    .await
}

/// The value of `series` in a Prometheus/OpenMetrics text: the sum over the lines whose
/// name (and labels, when `series` has them) is exactly `series`, or over every series of
/// the name when `series` has no labels; `None` when no line matches.
pub fn parse_metric(text: &str, series: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| {
            l.strip_prefix(series)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

mod http_get;
mod namespace;
mod operator;
pub mod reload;
pub use http_get::http_get;
#[allow(unused_imports)] // not every binary creates several at once
pub use namespace::{TestNamespace, TestNamespaces};
#[allow(unused_imports)] // each test binary uses a different part of the harness
pub use operator::{DEFAULT_LOG, Operator, OperatorBuilder};

/// Copies the repository's rules and templates into a temp dir the test may change.
pub fn copy_rules() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_tree(&repo().join("rules"), &dir.path().join("rules"));
    copy_tree(&repo().join("templates"), &dir.path().join("templates"));
    dir
}

pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read_dir") {
        let entry = entry.expect("entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

/// Reads a sample parent from `examples/`, placed in namespace `ns`.
pub fn example(file: &str, ns: &str) -> Json {
    let text = std::fs::read_to_string(repo().join("examples").join(file)).expect("example");
    let mut o: Json = serde_saphyr::from_str(&text).expect("yaml");
    o["metadata"]["namespace"] = json!(ns);
    o
}

/// A kubeconfig for the local cluster that authenticates with `token`.
pub fn token_kubeconfig(token: &str) -> tempfile::NamedTempFile {
    let admin = Kubeconfig::read_from(kubeconfig_path()).expect("admin kubeconfig");
    let cluster = admin
        .clusters
        .first()
        .and_then(|c| c.cluster.clone())
        .expect("cluster");
    let kc = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {
            "server": cluster.server,
            "certificate-authority-data": cluster.certificate_authority_data,
        }}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "sa"}}],
        "current-context": "sa",
    });
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), serde_json::to_string(&kc).expect("json"))
        .expect("write kubeconfig");
    file
}

/// Runs the `rulebook` binary with `args`; returns stdout, failing the test on a non-zero exit.
pub fn rulebook(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_rulebook"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("run rulebook");
    assert!(
        out.status.success(),
        "rulebook {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// Every object of a YAML stream.
pub fn yaml_objects(text: &str) -> Vec<Json> {
    serde_saphyr::from_multiple::<Json>(text)
        .expect("yaml")
        .into_iter()
        .filter(|o| !o.is_null())
        .collect()
}

/// Applies objects with the admin client (server-side apply, manager `test`).
pub async fn apply_all(client: &kube::Client, objects: &[Json]) {
    for o in objects {
        let av = o["apiVersion"].as_str().unwrap();
        let kind = o["kind"].as_str().unwrap();
        let plural = match kind {
            "CustomResourceDefinition" => "customresourcedefinitions",
            "ClusterRole" => "clusterroles",
            "ClusterRoleBinding" => "clusterrolebindings",
            "Role" => "roles",
            "RoleBinding" => "rolebindings",
            other => panic!("unexpected kind {other}"),
        };
        let ns = o["metadata"]["namespace"].as_str();
        apply(&api(client, ns, av, kind, plural), o.clone()).await;
    }
}

pub async fn wait_established(client: &kube::Client, name: &str) {
    let crds = api(
        client,
        None,
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    );
    wait_for(
        Duration::from_secs(120),
        &format!("CRD {name} to be Established"),
        || async {
            let crd = to_json(&crds.get_opt(name).await.ok()??);
            crd["status"]["conditions"]
                .as_array()?
                .iter()
                .any(|c| c["type"] == "Established" && c["status"] == "True")
                .then_some(())
        },
    )
    .await;
}

/// A ServiceAccount in `ns`, bound to `rbac` (the output of `rulebook rbac`, possibly
/// edited), and a kubeconfig that authenticates as it.
pub async fn service_account_kubeconfig(
    client: &kube::Client,
    ns: &str,
    name: &str,
    rbac: Vec<Json>,
) -> tempfile::NamedTempFile {
    let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(client.clone(), ns);
    let sa: k8s_openapi::api::core::v1::ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    sas.create(&PostParams::default(), &sa).await.unwrap();
    apply_all(client, &rbac).await;
    let request: k8s_openapi::api::authentication::v1::TokenRequest =
        serde_json::from_value(json!({
            "spec": {"audiences": [], "expirationSeconds": 3600}
        }))
        .unwrap();
    let token = sas
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .and_then(|s| s.token)
        .expect("a token");
    token_kubeconfig(&token)
}

/// Waits until the garbage collector watches the kind of `parent`, and returns how long
/// that took. A test that counts on the garbage collector to delete the children of a
/// deleted parent needs this when the parent's CRD is new: the collector starts
/// watching a new kind at its next discovery sync (every 30 s, later while an earlier
/// sync waits for its caches), and a parent it never saw, deleted before then, is only
/// noticed when its backed-off poll of that parent comes round again, minutes later
/// under a full `make test` (seen: a child still there 120 s after its parent went).
///
/// The proof: a copy of `parent` in a namespace of its own (no test's operator watches
/// it), deleted in the foreground. Only the collector takes off the `foregroundDeletion`
/// finalizer, and it can do so only from its watch of that kind; so once the copy is
/// gone, the collector has seen every object of the kind that exists, and sees their
/// deletion as it happens.
pub async fn gc_watches(client: &Client, parent: &Json, plural: &str) -> Duration {
    let started = Instant::now();
    let api_version = parent["apiVersion"].as_str().expect("apiVersion");
    let kind = parent["kind"].as_str().expect("kind");
    let ns = unique("gc-canary");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let body: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
    namespaces
        .create(&PostParams::default(), &body)
        .await
        .expect("create the canary's namespace");
    let canaries = api(client, Some(&ns), api_version, kind, plural);
    let mut canary = parent.clone();
    canary["metadata"] = json!({"name": "canary", "namespace": ns});
    apply(&canaries, canary).await;
    canaries
        .delete("canary", &kube::api::DeleteParams::foreground())
        .await
        .expect("delete the canary in the foreground");
    wait_for(
        Duration::from_secs(240),
        &format!("the garbage collector to watch {kind}"),
        || async {
            canaries
                .get_opt("canary")
                .await
                .ok()?
                .is_none()
                .then_some(())
        },
    )
    .await;
    let _ = namespaces.delete(&ns, &Default::default()).await;
    let took = started.elapsed();
    println!(
        "the garbage collector watches {kind}: {:.1} s",
        took.as_secs_f64()
    );
    took
}
