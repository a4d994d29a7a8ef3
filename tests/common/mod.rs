//! Shared harness for the tests that need the local control plane (`make cluster`).
//!
//! Every test gets its own namespace and, when it runs the operator, its own `rulebook
//! run` process scoped to that namespace, so tests run side by side without seeing each
//! other. A test that cannot reach the cluster fails with instructions; it never skips.

#![allow(dead_code)] // each test binary uses a different part of the harness

use std::future::Future;
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// The operator's `RUST_LOG` unless `RULEBOOK_TEST_LOG` says otherwise: the leader
/// election's debug lines tell a test when a standby has looked at the Lease
/// ([`Operator::wait_standing_by`]).
pub const DEFAULT_LOG: &str = "info,kube=warn,rulebook::leader=debug";

/// A `rulebook run` process, killed when dropped.
pub struct Operator {
    child: Option<Child>,
    pub metrics_port: u16,
    pub log: PathBuf,
}

impl Operator {
    /// Starts the operator on `rules`/`templates`, watching namespace `ns` only, with
    /// `extra` arguments; waits until it serves `/healthz`.
    pub async fn start(
        rules: &Path,
        templates: &Path,
        ns: Option<&str>,
        extra: &[&str],
    ) -> Operator {
        Operator::start_as(&kubeconfig_path(), rules, templates, ns, extra).await
    }

    /// Like [`Operator::start`], with another identity's kubeconfig.
    pub async fn start_as(
        kubeconfig: &Path,
        rules: &Path,
        templates: &Path,
        ns: Option<&str>,
        extra: &[&str],
    ) -> Operator {
        let log = std::env::var("RULEBOOK_TEST_LOG").unwrap_or_else(|_| DEFAULT_LOG.into());
        Operator::start_logging(kubeconfig, rules, templates, ns, extra, &log).await
    }

    /// Like [`Operator::start_as`], logging as `rust_log` says (`RUST_LOG`).
    pub async fn start_logging(
        kubeconfig: &Path,
        rules: &Path,
        templates: &Path,
        ns: Option<&str>,
        extra: &[&str],
        rust_log: &str,
    ) -> Operator {
        let cmd = Command::new(env!("CARGO_BIN_EXE_rulebook"));
        Operator::spawn(cmd, kubeconfig, rules, templates, ns, extra, rust_log).await
    }

    /// Like [`Operator::start`], the process placed in the cgroup whose `cgroup.procs`
    /// is `procs` before it runs (a shell writes its own pid there, then execs the
    /// operator: the same pid, every byte the operator allocates charged to the cgroup).
    pub async fn start_in_cgroup(
        procs: &Path,
        rules: &Path,
        templates: &Path,
        ns: Option<&str>,
        extra: &[&str],
    ) -> Operator {
        let log = std::env::var("RULEBOOK_TEST_LOG").unwrap_or_else(|_| DEFAULT_LOG.into());
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(r#"echo $$ > "$0" && exec "$@""#)
            .arg(procs)
            .arg(env!("CARGO_BIN_EXE_rulebook"));
        Operator::spawn(cmd, &kubeconfig_path(), rules, templates, ns, extra, &log).await
    }

    async fn spawn(
        mut cmd: Command,
        kubeconfig: &Path,
        rules: &Path,
        templates: &Path,
        ns: Option<&str>,
        extra: &[&str],
        rust_log: &str,
    ) -> Operator {
        let metrics_port = free_port();
        let log = std::env::temp_dir().join(format!("{}.log", unique("rulebook-op")));
        let log_file = std::fs::File::create(&log).expect("log file");
        cmd.arg("run")
            .arg("--rules")
            .arg(rules)
            .arg("--templates")
            .arg(templates)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--metrics-addr")
            .arg(format!("127.0.0.1:{metrics_port}"));
        if let Some(ns) = ns {
            cmd.arg("--namespace").arg(ns);
        }
        cmd.args(extra)
            .env("RUST_LOG", rust_log)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("log"))
            .stderr(log_file);
        let child = cmd.spawn().expect("spawn rulebook run");
        let op = Operator {
            child: Some(child),
            metrics_port,
            log,
        };
        let url = format!("http://127.0.0.1:{metrics_port}/healthz");
        wait_for(
            Duration::from_secs(30),
            "the operator's /healthz",
            || async { http_get(&url).await.ok() },
        )
        .await;
        op
    }

    /// Like [`Operator::get`], but `None` for an error status (e.g. `/readyz` answering
    /// 503 while the operator is still starting), for probes that wait.
    pub async fn get_opt(&self, path: &str) -> Option<String> {
        http_get(&format!("http://127.0.0.1:{}{path}", self.metrics_port))
            .await
            .ok()
    }

    pub async fn get(&self, path: &str) -> String {
        http_get(&format!("http://127.0.0.1:{}{path}", self.metrics_port))
            .await
            .unwrap_or_else(|e| {
                panic!("GET {path}: {e}\n--- operator log ---\n{}", self.log_tail())
            })
    }

    /// The value of one metric series, e.g. `rulebook_api_writes_total{rule="x",verb="apply"}`,
    /// or the sum of a family's series (`rulebook_reconciles_total`). Fails the test when
    /// `/metrics` has no such series: an absent series is not a 0 (a renamed metric or
    /// label gives one too), so `metric(..) == 0.0` holds only for a series that is there
    /// and counted nothing. [`Operator::metric_opt`] tells "absent" (`None`) apart.
    pub async fn metric(&self, series: &str) -> f64 {
        let text = self.get("/metrics").await;
        parse_metric(&text, series).unwrap_or_else(|| {
            panic!("/metrics has no series {series} (a renamed metric or label?):\n{text}")
        })
    }

    /// Like [`Operator::metric`], but `None` when `/metrics` has no such series (a family
    /// without series is not listed at all, not even its `# TYPE`).
    pub async fn metric_opt(&self, series: &str) -> Option<f64> {
        parse_metric(&self.get("/metrics").await, series)
    }

    /// Waits until this operator, started with `--leader-elect`, has found the Lease held
    /// by another and stood by (its log says so; [`DEFAULT_LOG`] logs it) — instead of
    /// sleeping a while before checking that a standby does not lead.
    pub async fn wait_standing_by(&self, timeout: Duration) {
        wait_for(
            timeout,
            "the standby to look at the Lease and stand by",
            || async {
                std::fs::read_to_string(&self.log)
                    .ok()?
                    .contains("standing by: the lease is held")
                    .then_some(())
            },
        )
        .await;
    }

    pub fn log_tail(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Sends a signal (e.g. `TERM`, `KILL`) and waits for the process to exit.
    pub fn signal_and_wait(&mut self, signal: &str) -> std::process::ExitStatus {
        self.signal(signal);
        self.wait()
    }

    /// Sends a signal without waiting (see [`Operator::wait`]).
    pub fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status();
    }

    /// How the process ended, if it has (without waiting).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        child.wait().expect("wait")
    }
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

impl Drop for Operator {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- operator log ({}) ---\n{}",
                self.log.display(),
                self.log_tail()
            );
        }
    }
}

mod http_get;
mod namespace;
pub mod reload;
pub use http_get::http_get;
#[allow(unused_imports)] // not every binary creates several at once
pub use namespace::{TestNamespace, TestNamespaces};

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
