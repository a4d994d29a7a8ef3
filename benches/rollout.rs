//! The cost of the progressive rollout's bookkeeping (issue 44; `make bench-rollout`,
//! docs/benchmarks.md "Rollout bookkeeping").
//!
//! On the local control plane (`make cluster`, whose API server writes an audit log of
//! every write request), `ROLLOUT_BENCH_REPEATS` rounds (default 3), each with two arms in
//! alternating order (`plain, rollout` then `rollout, plain`). An arm: a fresh namespace,
//! a rule of its own kind (one ConfigMap child per parent, `spec.resync` of
//! `ROLLOUT_BENCH_RESYNC` seconds, default 30) and a fresh `rulebook run` on it;
//! `ROLLOUT_BENCH_N` parents (default 1,000) created and converged on template `v1`; then,
//! measured, the template file rewritten to `v2` (hot reload):
//!
//! - `plain`: the rule has no `spec.rollout` — the change reaches every parent at once;
//! - `rollout`: the same rule with `spec.rollout` (`steps: [{percent: 10}, {percent: 100}]`,
//!   `gate: "batch.ready >= batch.total"`, no pause).
//!
//! Measured per arm, from the file write until every child carries `v2`, every parent's
//! `status.ruleVersion` moved (and, with the rollout, its state says `Complete`) and then
//! 5 s without a write: the converge time, the operator's write requests (from the API
//! server's audit log, by user agent `rulebook/` and namespace — the rollout's own
//! ConfigMaps are in the arm's namespace too, `--lease-namespace`), split into children,
//! parent status, rollout state, stored versions and events; the operator's CPU seconds
//! (`/proc/<pid>/stat`), its RSS after the change, the API server's and etcd's CPU.
//! Then, in the `rollout` arm, the steady state: a window of two resync periods (plus 5 s)
//! after the rollout completed, whose write count must be 0 (reported, with the reconciles
//! the window saw, which show both periods swept every parent).
//!
//! Each arm ends by deleting what it created: the parents, then (once their children are
//! gone) the operator, the CRD and the namespace. The binary: `ROLLOUT_BENCH_BINARY`, else
//! the release binary in cargo's target directory if built, else the debug one. Results:
//! `target/bench/rollout.{md,json}` (medians and ranges over the rounds). Nothing here
//! asserts on timings; the first thing `main` does is check its own arithmetic.
// A benchmark driver reads top to bottom as one story; the function size limit is for
// the product code.
#![allow(clippy::too_many_lines)]

#[allow(dead_code)]
#[path = "e2e/cluster.rs"]
mod cluster;
#[allow(dead_code)]
#[path = "../tests/common/http_get.rs"]
mod http_get;
#[allow(dead_code)]
#[path = "e2e/procs.rs"]
mod procs;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value as Json, json};

fn env<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const GROUP: &str = "rbench.rulebook.dev";
const CHILD_LABEL: &str = "rbench.rulebook.dev/child";
const QUIET: Duration = Duration::from_secs(5);

struct Cfg {
    out: PathBuf,
    kubeconfig: PathBuf,
    audit: PathBuf,
    binary: PathBuf,
    n: usize,
    repeats: usize,
    resync: u64,
    timeout: Duration,
}

impl Cfg {
    fn from_env() -> Cfg {
        let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .map(|t| if t.is_absolute() { t } else { repo.join(t) })
            .unwrap_or_else(|| repo.join("target"));
        let kubeconfig = std::env::var_os("RULEBOOK_TEST_KUBECONFIG")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo.join(".cluster/kubeconfig"));
        Cfg {
            out: repo.join("target/bench"),
            audit: kubeconfig
                .parent()
                .map(|d| d.join("logs/audit.log"))
                .unwrap_or_default(),
            kubeconfig,
            binary: std::env::var_os("ROLLOUT_BENCH_BINARY")
                .map(PathBuf::from)
                .or_else(|| Some(target.join("release/rulebook")).filter(|p| p.exists()))
                .unwrap_or_else(|| target.join("debug/rulebook")),
            n: env("ROLLOUT_BENCH_N", 1000usize).max(10),
            repeats: env("ROLLOUT_BENCH_REPEATS", 3usize).max(1),
            resync: env("ROLLOUT_BENCH_RESYNC", 30u64).max(1),
            timeout: Duration::from_secs(env("ROLLOUT_BENCH_TIMEOUT", 900)),
        }
    }
}

const ROLLOUT: &str = "  rollout:\n    steps:\n      - {percent: 10}\n      - {percent: 100}\n    gate: \"batch.ready >= batch.total\"\n";

fn rule(kind: &str, resync: u64, rollout: bool) -> String {
    let lower = kind.to_lowercase();
    format!(
        "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: {lower}\nspec:\n  parent:\n    apiVersion: {GROUP}/v1\n    kind: {kind}\n  crd:\n    plural: {lower}s\n    specSchema:\n      type: object\n      x-kubernetes-preserve-unknown-fields: true\n  resync: {resync}s\n  children:\n    - name: config\n      apiVersion: v1\n      kind: ConfigMap\n      template: child.yaml\n{}",
        if rollout { ROLLOUT } else { "" }
    )
}

fn template(marker: &str) -> String {
    format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{{{ parent.metadata.name }}}}\n  labels:\n    {CHILD_LABEL}: \"true\"\ndata:\n  marker: \"{marker}\"\n  size: \"{{{{ parent.spec.size }}}}\"\n"
    )
}

/// Writes `text` to `path` at once (a rename), so the operator's file watch never reads half.
fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// The operator under test.
struct Operator {
    child: Child,
    port: u16,
}

impl Operator {
    fn start(cfg: &Cfg, dir: &Path, ns: &str, id: &str) -> Result<Operator> {
        let port = procs::free_port();
        std::fs::create_dir_all(cfg.out.join("logs"))?;
        let log = std::fs::File::create(cfg.out.join(format!("logs/rollout-{id}.log")))?;
        let child = Command::new(&cfg.binary)
            .arg("run")
            .arg("--rules")
            .arg(dir.join("rules"))
            .arg("--templates")
            .arg(dir.join("templates"))
            .arg("--kubeconfig")
            .arg(&cfg.kubeconfig)
            .args(["--install-crds", "--namespace", ns, "--lease-namespace", ns])
            .args(["--identity", id])
            .arg("--metrics-addr")
            .arg(format!("127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", cfg.binary.display()))?;
        Ok(Operator { child, port })
    }

    async fn get(&self, path: &str) -> Option<String> {
        http_get::http_get(&format!("http://127.0.0.1:{}{path}", self.port))
            .await
            .ok()
    }

    /// The sum of a counter's series on /metrics.
    async fn counter(&self, name: &str) -> f64 {
        let text = self.get("/metrics").await.unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    fn usage(&self) -> procs::Usage {
        procs::usage_of(self.child.id())
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

/// Watches the objects a label selector selects in one namespace and keeps, by name, the
/// string at a JSON pointer (`/data/marker`, `/status/ruleVersion`).
struct Field {
    state: Arc<Mutex<HashMap<String, String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Field {
    async fn start(api: Api<DynamicObject>, selector: &str, pointer: &str) -> Result<Field> {
        let state: Arc<Mutex<HashMap<String, String>>> = Arc::default();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (s, pointer) = (state.clone(), pointer.to_string());
        let config = watcher::Config::default().labels(selector).any_semantic();
        let task = tokio::spawn(async move {
            let mut tx = Some(tx);
            let mut stream = watcher(api, config).default_backoff().boxed();
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                        let name = o.metadata.name.clone().unwrap_or_default();
                        let v = serde_json::to_value(&o)
                            .ok()
                            .and_then(|j| j.pointer(&pointer)?.as_str().map(str::to_string))
                            .unwrap_or_default();
                        s.lock().unwrap().insert(name, v);
                    }
                    Ok(watcher::Event::Delete(o)) => {
                        s.lock()
                            .unwrap()
                            .remove(&o.metadata.name.clone().unwrap_or_default());
                    }
                    Ok(watcher::Event::Init) => s.lock().unwrap().clear(),
                    Ok(watcher::Event::InitDone) => {
                        if let Some(tx) = tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    Err(e) => eprintln!("rollout bench: watch error: {e}"),
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(60), rx)
            .await
            .context("a watch did not sync")??;
        Ok(Field { state, task })
    }

    fn count(&self, f: impl Fn(&str) -> bool) -> usize {
        self.state.lock().unwrap().values().filter(|v| f(v)).count()
    }

    fn len(&self) -> usize {
        self.state.lock().unwrap().len()
    }

    /// The value most objects have.
    fn common(&self) -> String {
        let mut by: BTreeMap<String, usize> = BTreeMap::new();
        for v in self.state.lock().unwrap().values() {
            *by.entry(v.clone()).or_default() += 1;
        }
        by.into_iter()
            .max_by_key(|(_, c)| *c)
            .map(|(v, _)| v)
            .unwrap_or_default()
    }
}

impl Drop for Field {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn wait_until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) -> Result<f64> {
    let start = Instant::now();
    let mut said = Instant::now();
    while !ok() {
        if start.elapsed() > within {
            bail!("timed out after {within:?} waiting for {what}");
        }
        if said.elapsed() > Duration::from_secs(15) {
            eprintln!(
                "rollout bench:   … waiting for {what} ({:.0} s)",
                start.elapsed().as_secs_f64()
            );
            said = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(start.elapsed().as_secs_f64())
}

/// The operator's write requests between two offsets of the audit log, in namespace `ns`,
/// by class (`children`, `status`, `state`, `versions`, `events`, `other`); `None` when
/// the log was rotated in between.
fn audit_writes(log: &Path, from: u64, to: u64, ns: &str) -> Option<BTreeMap<String, f64>> {
    use std::io::{Read, Seek, SeekFrom};
    if to < from {
        return None;
    }
    let mut f = std::fs::File::open(log).ok()?;
    f.seek(SeekFrom::Start(from)).ok()?;
    let mut buf = Vec::new();
    f.take(to - from).read_to_end(&mut buf).ok()?;
    let ns_pat = format!("\"namespace\":\"{ns}\"");
    let mut out = BTreeMap::new();
    for line in buf.split(|b| *b == b'\n') {
        let Ok(text) = std::str::from_utf8(line) else {
            continue;
        };
        if !text.contains(&ns_pat) || !text.contains("\"userAgent\":\"rulebook/") {
            continue;
        }
        let Ok(ev) = serde_json::from_str::<Json>(text) else {
            continue;
        };
        if ev["stage"] != "ResponseComplete"
            || ev["objectRef"]["namespace"].as_str() != Some(ns)
            || !matches!(
                ev["verb"].as_str(),
                Some("create" | "update" | "patch" | "delete" | "deletecollection")
            )
        {
            continue;
        }
        let resource = ev["objectRef"]["resource"].as_str().unwrap_or("");
        let name = ev["objectRef"]["name"].as_str().unwrap_or("");
        let class = match (resource, ev["objectRef"]["subresource"].as_str()) {
            ("configmaps", None) if name.starts_with("rulebook-rollout-") => "state",
            ("configmaps", None) if name.starts_with("rulebook-rule-") => "versions",
            ("configmaps", None) => "children",
            ("events", _) => "events",
            (_, Some("status")) => "status",
            _ => "other",
        };
        *out.entry(class.to_string()).or_insert(0.0) += 1.0;
    }
    Some(out)
}

fn offset(log: &Path) -> u64 {
    std::fs::metadata(log).map(|m| m.len()).unwrap_or(0)
}

/// Waits until the audit log shows no write of the operator in `ns` for [`QUIET`]
/// (at most `within`); the offset it was quiet from.
async fn quiet(log: &Path, ns: &str, within: Duration) -> Result<u64> {
    let start = Instant::now();
    let mut last = offset(log);
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = offset(log);
        let writes = audit_writes(log, last, now, ns).map_or(1.0, |w| w.values().sum::<f64>());
        if writes > 0.0 {
            since = Instant::now();
        }
        last = now;
        if since.elapsed() >= QUIET {
            return Ok(now);
        }
        if start.elapsed() > within {
            bail!("the operator kept writing in {ns} for {within:?}");
        }
    }
}

/// The rollout state's phase (`None`: no state).
async fn phase(client: &kube::Client, ns: &str, rule: &str) -> Option<String> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let cm = cms
        .get_opt(&format!("rulebook-rollout-{rule}"))
        .await
        .ok()??;
    let state: Json = serde_json::from_str(cm.data?.get("state")?).ok()?;
    state["phase"].as_str().map(str::to_string)
}

fn cpu(pid: Option<u32>) -> f64 {
    pid.map(|p| procs::usage_of(p).cpu_seconds).unwrap_or(0.0)
}

fn component_pid(cfg: &Cfg, name: &str) -> Option<u32> {
    let dir = cfg.kubeconfig.parent()?;
    std::fs::read_to_string(dir.join(format!("pids/{name}.pid")))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The kind, namespace and CRD of one arm.
fn names(rollout: bool, round: usize) -> (String, String, String) {
    let stamp = std::process::id() % 10_000;
    let kind = format!(
        "Rb{}{round}x{stamp}",
        if rollout { "Rollout" } else { "Plain" }
    );
    let lower = kind.to_lowercase();
    let (ns, crd) = (format!("rbench-{lower}"), format!("{lower}s.{GROUP}"));
    (kind, ns, crd)
}

/// Deletes an arm's CRD and namespace (what an arm that failed half-way leaves).
async fn remove(client: &kube::Client, ns: &str, crd: &str, timeout: Duration) -> Result<()> {
    let crds = cluster::api(
        client,
        None,
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
    );
    let _ = crds.delete(crd, &DeleteParams::default()).await;
    cluster::delete_namespace(client, ns, timeout).await?;
    Ok(())
}

/// One arm of one round.
async fn arm(cfg: &Cfg, client: &kube::Client, rollout: bool, round: usize) -> Result<Json> {
    let label = if rollout { "rollout" } else { "plain" };
    let (kind, ns, crd) = names(rollout, round);
    let (lower, n) = (kind.to_lowercase(), cfg.n);
    let plural = format!("{lower}s");
    eprintln!("rollout bench: round {round}, {label}: {n} parents of {kind} in {ns}");
    cluster::create_namespace(client, &ns).await?;
    let dir = tempfile::tempdir()?;
    std::fs::create_dir_all(dir.path().join("rules"))?;
    std::fs::create_dir_all(dir.path().join("templates"))?;
    write_atomic(&dir.path().join("templates/child.yaml"), &template("v1"))?;
    write_atomic(
        &dir.path().join("rules/rule.yaml"),
        &rule(&kind, cfg.resync, rollout),
    )?;
    let op = Operator::start(cfg, dir.path(), &ns, &format!("rb-{lower}"))?;
    cluster::wait_crd(client, &crd, Duration::from_secs(120)).await?;
    let parents = cluster::api(client, Some(&ns), &format!("{GROUP}/v1"), &kind, &plural);
    let children = cluster::api(client, Some(&ns), "v1", "ConfigMap", "configmaps");
    let selector = format!("{GROUP}/bench={lower}");
    let markers = Field::start(children, &format!("{CHILD_LABEL}=true"), "/data/marker").await?;
    let versions = Field::start(parents.clone(), &selector, "/status/ruleVersion").await?;

    // The fleet, converged on v1.
    let t = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let parents = parents.clone();
            let (kind, selector) = (kind.clone(), lower.clone());
            async move {
                let o: DynamicObject = serde_json::from_value(json!({
                    "apiVersion": format!("{GROUP}/v1"), "kind": kind,
                    "metadata": {"name": format!("p{i:04}"),
                                 "labels": {format!("{GROUP}/bench"): selector}},
                    "spec": {"size": i},
                }))?;
                parents.create(&PostParams::default(), &o).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<()>>>()?;
    wait_until("every child on v1", cfg.timeout, || {
        markers.count(|m| m == "v1") == n
    })
    .await?;
    wait_until("every parent's ruleVersion", cfg.timeout, || {
        versions.len() == n && versions.count(|v| !v.is_empty()) == n
    })
    .await?;
    let old = versions.common();
    wait_until("every parent on one version", cfg.timeout, || {
        versions.count(|v| v == old) == n
    })
    .await?;
    let create_converge = t.elapsed().as_secs_f64();
    let a0 = quiet(&cfg.audit, &ns, cfg.timeout).await?;
    let before = op.usage();
    eprintln!(
        "rollout bench:   {n} parents converged on v1 in {create_converge:.1} s (ruleVersion {old}); \
         RSS {:.1} MiB; changing the template",
        before.rss_mib
    );

    // The change.
    let (api_pid, etcd_pid) = (
        component_pid(cfg, "kube-apiserver"),
        component_pid(cfg, "etcd"),
    );
    let (api0, etcd0) = (cpu(api_pid), cpu(etcd_pid));
    let reconciles0 = op.counter("rulebook_reconciles_total").await;
    let counted0 = op.counter("rulebook_api_writes_total").await;
    let t0 = Instant::now();
    write_atomic(&dir.path().join("templates/child.yaml"), &template("v2"))?;
    let children_s = wait_until("every child on v2", cfg.timeout, || {
        markers.count(|m| m == "v2") == n
    })
    .await?;
    wait_until("every parent's ruleVersion moved", cfg.timeout, || {
        versions.count(|v| !v.is_empty() && v != old) == n
    })
    .await?;
    let moved_s = t0.elapsed().as_secs_f64();
    let mut state_phase = None;
    if rollout {
        let start = Instant::now();
        loop {
            state_phase = phase(client, &ns, &lower).await;
            if state_phase.as_deref() == Some("Complete") {
                break;
            }
            if start.elapsed() > cfg.timeout {
                bail!("the rollout state is {state_phase:?}, not Complete");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let complete_s = t0.elapsed().as_secs_f64();
    let a1 = quiet(&cfg.audit, &ns, cfg.timeout).await?;
    let window_s = t0.elapsed().as_secs_f64();
    let after = op.usage();
    let (api_cpu, etcd_cpu) = (cpu(api_pid) - api0, cpu(etcd_pid) - etcd0);
    let reconciles = op.counter("rulebook_reconciles_total").await - reconciles0;
    let counted = op.counter("rulebook_api_writes_total").await - counted0;
    let writes = audit_writes(&cfg.audit, a0, a1, &ns).context("the audit log was rotated")?;
    let total: f64 = writes.values().sum::<f64>() + 0.0;
    eprintln!(
        "rollout bench:   {label}: children on v2 in {children_s:.1} s, every ruleVersion moved in \
         {moved_s:.1} s, complete in {complete_s:.1} s; {total} writes {writes:?} (its own counter: \
         {counted}); CPU {:.1} s, RSS {:.1} MiB (peak {:.1}); API server {api_cpu:.1} s, etcd \
         {etcd_cpu:.1} s; {reconciles} reconciles",
        after.cpu_seconds - before.cpu_seconds,
        after.rss_mib,
        after.hwm_mib
    );

    // Steady state: two resync periods after the rollout completed.
    let mut steady = Json::Null;
    if rollout {
        let window = Duration::from_secs(2 * cfg.resync) + QUIET;
        let (s0, r0, c0) = (
            offset(&cfg.audit),
            op.counter("rulebook_reconciles_total").await,
            op.usage().cpu_seconds,
        );
        tokio::time::sleep(window).await;
        let s1 = offset(&cfg.audit);
        let w = audit_writes(&cfg.audit, s0, s1, &ns).context("the audit log was rotated")?;
        let r = op.counter("rulebook_reconciles_total").await - r0;
        let c = op.usage().cpu_seconds - c0;
        eprintln!(
            "rollout bench:   steady: {} writes {w:?} in {:.0} s, {r} reconciles, CPU {c:.1} s",
            w.values().sum::<f64>() + 0.0,
            window.as_secs_f64()
        );
        steady = json!({
            "window_seconds": window.as_secs_f64(),
            "writes": w.values().sum::<f64>() + 0.0,
            "writes_by_class": w,
            "reconciles": r,
            "cpu_seconds": c,
            "phase": phase(client, &ns, &lower).await,
        });
    }

    // Clean up: the parents, their children, the operator, the CRD, the namespace.
    parents
        .delete_collection(&DeleteParams::background(), &ListParams::default())
        .await?;
    wait_until("the children to be gone", cfg.timeout, || {
        markers.len() == 0
    })
    .await?;
    drop((markers, versions));
    drop(op);
    remove(client, &ns, &crd, cfg.timeout).await?;
    Ok(json!({
        "arm": label,
        "round": round,
        "parents": n,
        "create_converge_seconds": create_converge,
        "children_seconds": children_s,
        "moved_seconds": moved_s,
        "complete_seconds": complete_s,
        "window_seconds": window_s,
        "writes": total,
        "writes_by_class": writes,
        "operator_counted_writes": counted,
        "cpu_seconds": after.cpu_seconds - before.cpu_seconds,
        "rss_before_mib": before.rss_mib,
        "rss_mib": after.rss_mib,
        "hwm_mib": after.hwm_mib,
        "apiserver_cpu_seconds": api_cpu,
        "etcd_cpu_seconds": etcd_cpu,
        "reconciles": reconciles,
        "state_phase": state_phase,
        "steady": steady,
    }))
}

/// Median and range of `v` (`None` when empty).
fn stats(v: &[f64]) -> Option<(f64, f64, f64)> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    let median = if s.len().is_multiple_of(2) {
        (s[m - 1] + s[m]) / 2.0
    } else {
        s[m]
    };
    Some((median, s[0], s[s.len() - 1]))
}

fn cell(v: &[f64], unit: &str) -> String {
    // Counts (no unit) without decimals.
    let p = usize::from(!unit.is_empty());
    match stats(v) {
        Some((m, lo, hi)) if v.len() > 1 && lo < hi => {
            format!("{m:.p$}{unit} ({lo:.p$}–{hi:.p$})")
        }
        Some((m, _, _)) => format!("{m:.p$}{unit}"),
        None => "—".into(),
    }
}

/// The median of `a` over the median of `b`, as `×r`.
fn ratio(a: &[f64], b: &[f64]) -> String {
    match (stats(a), stats(b)) {
        (Some((x, _, _)), Some((y, _, _))) if y > 0.0 => format!("×{:.2}", x / y),
        _ => "—".into(),
    }
}

fn report(cfg: &Cfg, runs: &[Json]) -> String {
    let of = |arm: &str, f: &dyn Fn(&Json) -> Option<f64>| -> Vec<f64> {
        runs.iter()
            .filter(|x| x["arm"] == arm)
            .filter_map(f)
            .collect()
    };
    let rounds = |arm: &str| runs.iter().filter(|x| x["arm"] == arm).count();
    let mut md = format!(
        "# Rollout bookkeeping\n\n{} parents (one ConfigMap child each), a template change \
         hot-reloaded; `spec.resync: {}s`; rounds: {} plain, {} rollout; medians (range).\n\n\
         | | children on v2 | every ruleVersion moved | rollout Complete | writes | children | status | rollout state | stored versions | events | operator CPU | RSS after | peak RSS | API server CPU | etcd CPU |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        cfg.n,
        cfg.resync,
        rounds("plain"),
        rounds("rollout")
    );
    let num = |k: &'static str| move |x: &Json| x[k].as_f64();
    let class =
        |c: &'static str| move |x: &Json| Some(x["writes_by_class"][c].as_f64().unwrap_or(0.0));
    type Col = (Box<dyn Fn(&Json) -> Option<f64>>, &'static str);
    let cols: Vec<Col> = vec![
        (Box::new(num("children_seconds")), " s"),
        (Box::new(num("moved_seconds")), " s"),
        (Box::new(num("complete_seconds")), " s"),
        (Box::new(num("writes")), ""),
        (Box::new(class("children")), ""),
        (Box::new(class("status")), ""),
        (Box::new(class("state")), ""),
        (Box::new(class("versions")), ""),
        (Box::new(class("events")), ""),
        (Box::new(num("cpu_seconds")), " s"),
        (Box::new(num("rss_mib")), " MiB"),
        (Box::new(num("hwm_mib")), " MiB"),
        (Box::new(num("apiserver_cpu_seconds")), " s"),
        (Box::new(num("etcd_cpu_seconds")), " s"),
    ];
    for arm in ["plain", "rollout"] {
        md.push_str(&format!("| {arm} |"));
        for (f, unit) in &cols {
            md.push_str(&format!(" {} |", cell(&of(arm, f.as_ref()), unit)));
        }
        md.push('\n');
    }
    md.push_str("| rollout / plain |");
    for (f, _) in &cols {
        md.push_str(&format!(
            " {} |",
            ratio(&of("rollout", f.as_ref()), &of("plain", f.as_ref()))
        ));
    }
    md.push('\n');
    let steady = |k: &'static str| of("rollout", &move |x: &Json| x["steady"][k].as_f64());
    md.push_str(&format!(
        "\nSteady state after the rollout completed (two resync periods + 5 s, {} s): \
         writes {}; reconciles in the window {} (2 × {} parents = {}); operator CPU {}.\n",
        2 * cfg.resync + QUIET.as_secs(),
        cell(&steady("writes"), ""),
        cell(&steady("reconciles"), ""),
        cfg.n,
        2 * cfg.n,
        cell(&steady("cpu_seconds"), " s"),
    ));
    md.push_str(&format!(
        "\nbinary: {}\n\nEvery arm (`rollout.json`):\n\n",
        cfg.binary.display()
    ));
    for x in runs {
        md.push_str(&format!(
            "- round {}, {}: children {:.1} s, moved {:.1} s, complete {:.1} s (window {:.1} s); \
             writes {} {} (the operator's own counter {}); CPU {:.1} s; RSS {:.1} MiB before, \
             {:.1} after (peak {:.1}); API server {:.1} s, etcd {:.1} s; reconciles {}; \
             fleet created and converged in {:.1} s; steady {}\n",
            x["round"],
            x["arm"],
            x["children_seconds"].as_f64().unwrap_or(f64::NAN),
            x["moved_seconds"].as_f64().unwrap_or(f64::NAN),
            x["complete_seconds"].as_f64().unwrap_or(f64::NAN),
            x["window_seconds"].as_f64().unwrap_or(f64::NAN),
            x["writes"],
            x["writes_by_class"],
            x["operator_counted_writes"],
            x["cpu_seconds"].as_f64().unwrap_or(f64::NAN),
            x["rss_before_mib"].as_f64().unwrap_or(f64::NAN),
            x["rss_mib"].as_f64().unwrap_or(f64::NAN),
            x["hwm_mib"].as_f64().unwrap_or(f64::NAN),
            x["apiserver_cpu_seconds"].as_f64().unwrap_or(f64::NAN),
            x["etcd_cpu_seconds"].as_f64().unwrap_or(f64::NAN),
            x["reconciles"],
            x["create_converge_seconds"].as_f64().unwrap_or(f64::NAN),
            x["steady"],
        ));
    }
    md
}

fn self_check() {
    assert_eq!(stats(&[3.0, 1.0, 2.0]), Some((2.0, 1.0, 3.0)));
    assert_eq!(stats(&[4.0, 1.0]), Some((2.5, 1.0, 4.0)));
    assert_eq!(stats(&[]), None);
    assert_eq!(cell(&[2.0, 4.0], " s"), "3.0 s (2.0–4.0)");
    assert_eq!(cell(&[0.0, 0.0], ""), "0");
    assert_eq!(cell(&[150.0, 157.0, 160.0], ""), "157 (150–160)");
    assert_eq!(ratio(&[3.0], &[2.0]), "×1.50");
    assert_eq!(ratio(&[3.0], &[0.0]), "—");
    let r = rule("RbX", 30, true);
    assert!(r.contains("  resync: 30s\n") && r.ends_with("gate: \"batch.ready >= batch.total\"\n"));
    assert!(template("v2").contains("marker: \"v2\""));
}

fn main() -> Result<()> {
    self_check();
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "rollout: a benchmark; run it with `cargo bench --bench rollout` (make bench-rollout)"
        );
        return Ok(());
    }
    let cfg = Cfg::from_env();
    // The report again from a run's `rollout.json` (its sizes and its binary as recorded).
    if env("ROLLOUT_BENCH_REPORT_ONLY", 0u8) == 1 {
        let path = cfg.out.join("rollout.json");
        let saved: Json = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
        let cfg = Cfg {
            n: saved["n"].as_u64().map_or(cfg.n, |n| n as usize),
            resync: saved["resync"].as_u64().unwrap_or(cfg.resync),
            binary: saved["binary"]
                .as_str()
                .map_or(cfg.binary.clone(), PathBuf::from),
            ..cfg
        };
        let runs = saved["runs"].as_array().cloned().unwrap_or_default();
        let md = report(&cfg, &runs);
        std::fs::write(cfg.out.join("rollout.md"), &md)?;
        println!("{md}");
        return Ok(());
    }
    if !cfg.binary.exists() {
        bail!(
            "{} is missing: `make bench-rollout` builds it (cargo build --release)",
            cfg.binary.display()
        );
    }
    if !cfg.audit.exists() {
        bail!(
            "{} is missing: the writes are counted from the API server's audit log (make cluster)",
            cfg.audit.display()
        );
    }
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let client = cluster::client(&cfg.kubeconfig).await?;
        let mut runs = Vec::new();
        for round in 0..cfg.repeats {
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for rollout in order {
                match arm(&cfg, &client, rollout, round).await {
                    Ok(x) => runs.push(x),
                    Err(e) => {
                        eprintln!("rollout bench: round {round}, rollout {rollout}: failed: {e:#}");
                        let (_, ns, crd) = names(rollout, round);
                        if let Err(e) = remove(&client, &ns, &crd, cfg.timeout).await {
                            eprintln!("rollout bench: cleaning up {ns}: {e:#}");
                        }
                    }
                }
            }
        }
        std::fs::create_dir_all(&cfg.out)?;
        std::fs::write(
            cfg.out.join("rollout.json"),
            serde_json::to_string_pretty(&json!({
                "runs": runs, "n": cfg.n, "resync": cfg.resync,
                "binary": cfg.binary.display().to_string(),
            }))?,
        )?;
        let md = report(&cfg, &runs);
        std::fs::write(cfg.out.join("rollout.md"), &md)?;
        println!("{md}");
        anyhow::Ok(())
    })
}
