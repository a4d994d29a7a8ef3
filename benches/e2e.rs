//! End-to-end benchmark driver (`make bench`; docs/benchmarks.md).
//!
//! On the local control plane (`make cluster`), runs each workload against each
//! contender in turn — Rulebook's release binary, the hand-written reference controller
//! (`benches/reference/`), and kro when it was built (`benches/kro/build.sh`) — plus a
//! plain client measuring the API server's own limit, and writes
//! `target/bench/results.{md,json}`, `converge.svg` and `memory.svg`.
//!
//! One run of a contender is noisy and the one that runs first meets another machine than
//! the one that runs last, so the contender list runs `BENCH_REPEATS` times, reversed every
//! other round, and the tables give medians with their range (`runs.rs`). Memory is
//! measured at each of the `BENCH_SCALE_N` sizes, so that the cost per managed object is
//! a fitted slope rather than one point.
//!
//! The benchmark runs only under `cargo bench` (cargo passes `--bench`). First, always,
//! `main` checks the report's arithmetic (`checks.rs`: this target has no libtest
//! harness, so `#[test]` functions would not run); under `cargo test --bench e2e` that
//! check is all it does. Sizes and the set of workloads come from `BENCH_*` environment
//! variables (see [`Cfg::from_env`]). Nothing here asserts on timings.

#[path = "e2e/checks.rs"]
mod checks;
#[path = "e2e/cluster.rs"]
mod cluster;
#[path = "../tests/common/http_get.rs"]
mod http_get;
#[path = "e2e/plot.rs"]
mod plot;
#[path = "e2e/procs.rs"]
mod procs;
#[path = "e2e/report.rs"]
mod report;
#[path = "e2e/runs.rs"]
mod runs;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use kube::Client;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use procs::{Kind, Launch, Proc, Usage};
use serde_json::{Value as Json, json};

/// The benchmark's knobs, from the environment.
#[derive(Clone, Debug)]
pub struct Cfg {
    pub repo: PathBuf,
    pub out: PathBuf,
    pub kubeconfig: PathBuf,
    /// Parents of the converge, update, steady and template workloads.
    pub n: usize,
    /// Parents of the memory-at-scale workload, one run per size (none: skipped).
    pub scale_n: Vec<usize>,
    /// Rounds of the contender list (alternating order; `runs::order`).
    pub repeats: usize,
    /// Seconds of the steady-state window.
    pub steady_seconds: u64,
    /// Concurrent reconciles of every contender.
    pub concurrency: usize,
    /// Concurrency levels of the API server limit sweep.
    pub api_concurrency: Vec<usize>,
    /// Concurrent requests of the driver when it creates or updates parents.
    pub driver_concurrency: usize,
    pub contenders: Vec<Kind>,
    pub workloads: BTreeSet<String>,
    pub timeout: Option<Duration>,
    /// Cargo's target directory: `CARGO_TARGET_DIR` when set (relative to the
    /// repository, where `make bench` runs cargo), else `target/`.
    pub target_dir: PathBuf,
    pub rulebook_bin: PathBuf,
    pub reference_bin: PathBuf,
    pub kro_dir: PathBuf,
    pub kro_bin: PathBuf,
}

/// Where cargo puts its build output: `CARGO_TARGET_DIR` when set (a relative one is
/// relative to the repository, where `make bench` runs cargo), else `<repo>/target`.
/// `.ci/run` sets it to a cache outside the clone.
fn target_dir(repo: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => repo.join(dir), // `join` keeps an absolute path as it is
        None => repo.join("target"),
    }
}

fn env<T: std::str::FromStr>(key: &str, default: T) -> T {
    match std::env::var(key) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{key}={v}: not a valid value")),
        _ => default,
    }
}

impl Cfg {
    fn from_env() -> Cfg {
        let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let list = |key: &str, default: &str| -> Vec<String> {
            std::env::var(key)
                .ok()
                .filter(|v| !v.trim().is_empty())
                .unwrap_or_else(|| default.to_string())
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        };
        let cache = std::env::var_os("RULEBOOK_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/rulebook")
            });
        let kro_version = std::env::var("KRO_VERSION").unwrap_or_else(|_| "v0.9.4".into());
        let target_dir = target_dir(&repo);
        Cfg {
            out: repo.join("target/bench"),
            kubeconfig: std::env::var_os("BENCH_KUBECONFIG")
                .map(PathBuf::from)
                .unwrap_or_else(|| repo.join(".cluster/kubeconfig")),
            n: env("BENCH_N", 1000),
            scale_n: list("BENCH_SCALE_N", "1000,3000,10000")
                .iter()
                .map(|s| s.parse().expect("BENCH_SCALE_N: numbers"))
                .filter(|&m| m > 0)
                .collect(),
            repeats: env("BENCH_REPEATS", 3usize).max(1),
            steady_seconds: env("BENCH_STEADY_SECONDS", 300),
            concurrency: env("BENCH_CONCURRENCY", 4),
            api_concurrency: list("BENCH_API_CONCURRENCY", "1,4,16,64")
                .iter()
                .map(|s| s.parse().expect("BENCH_API_CONCURRENCY: numbers"))
                .collect(),
            driver_concurrency: env("BENCH_DRIVER_CONCURRENCY", 16),
            contenders: list("BENCH_CONTENDERS", "rulebook,reference,kro")
                .iter()
                .map(|s| {
                    Kind::parse(s).unwrap_or_else(|| panic!("BENCH_CONTENDERS: unknown '{s}'"))
                })
                .collect(),
            workloads: list(
                "BENCH_WORKLOADS",
                "api,converge,update,steady,template,scale,render",
            )
            .into_iter()
            .collect(),
            timeout: std::env::var("BENCH_TIMEOUT_SECONDS")
                .ok()
                .and_then(|v| v.parse().ok())
                .map(Duration::from_secs),
            rulebook_bin: target_dir.join("release/rulebook"),
            reference_bin: target_dir.join("release/examples/bench-reference"),
            target_dir,
            kro_bin: cache.join("kro").join(&kro_version).join("bin/controller"),
            kro_dir: cache.join("kro").join(kro_version),
            repo,
        }
    }

    fn wants(&self, w: &str) -> bool {
        self.workloads.contains(w)
    }

    fn timeout_for(&self, parents: usize) -> Duration {
        self.timeout
            .unwrap_or_else(|| Duration::from_secs((parents as u64 / 2).max(300)))
    }
}

/// A point-in-time reading of everything a phase reports.
struct Snap {
    at: Instant,
    usage: Usage,
    writes: BTreeMap<String, f64>,
    reconciles: Option<f64>,
    api: BTreeMap<String, f64>,
    apiserver_cpu: f64,
    etcd_cpu: f64,
    machine_busy: f64,
    driver_cpu: f64,
    /// The control plane's pids at this reading (another test run may restart them).
    apiserver_pid: Option<u32>,
    etcd_pid: Option<u32>,
    audit_offset: Option<u64>,
}

struct Bench {
    cfg: Cfg,
    client: Client,
    run_id: String,
    log_dir: PathBuf,
    apiserver_pid: Option<u32>,
    notes: Vec<String>,
    audit: Option<cluster::Audit>,
    /// The namespace and user agent of the contender running now (audit log filter).
    current: Option<(String, &'static str)>,
    /// The round of the run going on, and its number among all runs (from 1): in its
    /// namespaces' and log files' names, so that no two runs share one.
    round: usize,
    seq: usize,
}

impl Bench {
    async fn snap(&self, p: &Proc) -> Snap {
        let (writes, reconciles) = p.counters().await;
        let api = cluster::apiserver_writes(&self.client)
            .await
            .unwrap_or_default();
        let apiserver_pid = procs::component_pid(&self.cfg.repo, "kube-apiserver");
        let etcd_pid = procs::component_pid(&self.cfg.repo, "etcd");
        let cpu = |pid: Option<u32>| pid.map(|p| procs::usage_of(p).cpu_seconds).unwrap_or(0.0);
        Snap {
            at: Instant::now(),
            usage: p.usage(),
            writes,
            reconciles,
            api,
            apiserver_cpu: cpu(apiserver_pid),
            etcd_cpu: cpu(etcd_pid),
            apiserver_pid,
            etcd_pid,
            audit_offset: self.audit.as_ref().and_then(|a| a.offset()),
            machine_busy: procs::machine_cpu().0,
            driver_cpu: procs::usage_of(std::process::id()).cpu_seconds,
        }
    }

    /// A phase's figures from two readings. `driver` holds the API server writes the
    /// driver itself made in the phase (subtracted from the API server's counts).
    fn phase(
        &self,
        a: &Snap,
        b: &Snap,
        seconds: Option<f64>,
        converged: Option<bool>,
        driver: &[(&str, f64)],
    ) -> Json {
        let writes = cluster::diff(&b.writes, &a.writes);
        let mut api = cluster::diff(&b.api, &a.api);
        for (k, n) in driver {
            if let Some(v) = api.get_mut(*k) {
                *v -= n;
            }
        }
        api.retain(|_, v| *v > 0.0);
        let controller_cpu = b.usage.cpu_seconds - a.usage.cpu_seconds;
        // A control plane restarted by another test run during the phase makes its CPU
        // figures (and usually the timings) meaningless: say so.
        let restarted = a.apiserver_pid != b.apiserver_pid || a.etcd_pid != b.etcd_pid;
        let apiserver_cpu = b.apiserver_cpu - a.apiserver_cpu;
        let etcd_cpu = b.etcd_cpu - a.etcd_cpu;
        let driver_cpu = b.driver_cpu - a.driver_cpu;
        let busy = b.machine_busy - a.machine_busy;
        let mut out = json!({
            "seconds": seconds,
            "window_seconds": (b.at - a.at).as_secs_f64(),
            "converged": converged,
            "writes": writes,
            "writes_total": writes.values().sum::<f64>() + 0.0,
            "reconciles": b.reconciles.zip(a.reconciles).map(|(x, y)| x - y),
            "apiserver_writes": api,
            "apiserver_writes_total": api.values().sum::<f64>() + 0.0,
            "cpu_seconds": controller_cpu,
            "rss_mib": b.usage.rss_mib,
            "hwm_mib": b.usage.hwm_mib,
            "apiserver_cpu_seconds": apiserver_cpu,
            "etcd_cpu_seconds": etcd_cpu,
            "driver_cpu_seconds": driver_cpu,
            "other_cpu_seconds": (busy - controller_cpu - apiserver_cpu - etcd_cpu - driver_cpu).max(0.0),
            "control_plane_restarted": restarted,
        });
        if let (Some(audit), Some((ns, ua)), Some(from), Some(to)) =
            (&self.audit, &self.current, a.audit_offset, b.audit_offset)
        {
            match audit.writes(from, to, ns, ua) {
                Some(c) => {
                    out["audit_writes_total"] = json!(c.contender.values().sum::<f64>() + 0.0);
                    out["audit_writes"] = json!(c.contender);
                    out["audit_others_in_namespace"] = json!(c.others);
                }
                None => out["audit_writes"] = json!("the audit log was rotated during the phase"),
            }
        }
        if restarted {
            out["apiserver_cpu_seconds"] = Json::Null;
            out["etcd_cpu_seconds"] = Json::Null;
            out["other_cpu_seconds"] = Json::Null;
        }
        out
    }

    fn parent_api(&self, kind: Kind, ns: &str) -> Api<DynamicObject> {
        cluster::api(
            &self.client,
            Some(ns),
            kind.parent_api_version(),
            "Bench",
            "benches",
        )
    }

    fn parent(kind: Kind, ns: &str, i: usize, version: u32) -> Json {
        let data = if version == 1 {
            format!("payload-{i:05}-").repeat(6)
        } else {
            format!("updated-{i:05}-v{version}-").repeat(5)
        };
        json!({
            "apiVersion": kind.parent_api_version(), "kind": "Bench",
            "metadata": {"name": format!("b-{i:05}"), "namespace": ns},
            "spec": {"size": i, "data": data},
        })
    }

    /// Creates parents `0..n` with the driver's concurrency (POST).
    async fn create_parents(&self, kind: Kind, ns: &str, n: usize) -> Result<()> {
        let api = self.parent_api(kind, ns);
        let results: Vec<Result<(), kube::Error>> = futures::stream::iter(0..n)
            .map(|i| {
                let api = api.clone();
                async move {
                    let o: DynamicObject =
                        serde_json::from_value(Self::parent(kind, ns, i, 1)).expect("parent");
                    api.create(&PostParams::default(), &o).await.map(|_| ())
                }
            })
            .buffer_unordered(self.cfg.driver_concurrency)
            .collect()
            .await;
        if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
            bail!("creating parents: {e}");
        }
        Ok(())
    }

    /// Changes every parent's spec (merge PATCH).
    async fn update_parents(&self, kind: Kind, ns: &str, n: usize) -> Result<()> {
        let api = self.parent_api(kind, ns);
        let results: Vec<Result<(), kube::Error>> = futures::stream::iter(0..n)
            .map(|i| {
                let api = api.clone();
                async move {
                    let spec = Self::parent(kind, ns, i, 2)["spec"].clone();
                    api.patch(
                        &format!("b-{i:05}"),
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": spec})),
                    )
                    .await
                    .map(|_| ())
                }
            })
            .buffer_unordered(self.cfg.driver_concurrency)
            .collect()
            .await;
        if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
            bail!("updating parents: {e}");
        }
        Ok(())
    }

    /// The same 3N objects the controllers write, server-side applied as fast as a
    /// plain client can, at each concurrency level.
    async fn api_limit(&mut self) -> Result<Vec<Json>> {
        let n = self.cfg.n;
        let mut out = Vec::new();
        for &c in &self.cfg.api_concurrency.clone() {
            let ns = format!("bench-api-c{c}-{}", self.run_id);
            cluster::create_namespace(&self.client, &ns).await?;
            let objects: Vec<(usize, Json)> = (0..n)
                .flat_map(|i| {
                    let name = format!("b-{i:05}");
                    let data = format!("payload-{i:05}-").repeat(6);
                    let meta = |child: String| json!({"name": child, "namespace": ns,
                        "labels": {"app": name, "app.kubernetes.io/managed-by": "bench-api-limit"},
                        "annotations": {"bench.rulebook.dev/desired-hash": "0123456789abcdef"}});
                    [
                        (0, json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(format!("{name}-config")),
                                   "data": {"size": i.to_string(), "data": data}})),
                        (1, json!({"apiVersion": "v1", "kind": "Service", "metadata": meta(name.clone()),
                                   "spec": {"clusterIP": "None", "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}})),
                        (2, json!({"apiVersion": "v1", "kind": "Secret", "metadata": meta(format!("{name}-secret")),
                                   "type": "Opaque", "data": {"token": "Yi0wMDAwMDpwYXlsb2Fk"}})),
                    ]
                })
                .collect();
            let apis = [
                cluster::api(&self.client, Some(&ns), "v1", "ConfigMap", "configmaps"),
                cluster::api(&self.client, Some(&ns), "v1", "Service", "services"),
                cluster::api(&self.client, Some(&ns), "v1", "Secret", "secrets"),
            ];
            let total = objects.len();
            let apiserver0 = self
                .apiserver_pid
                .map(|p| procs::usage_of(p).cpu_seconds)
                .unwrap_or(0.0);
            let start = Instant::now();
            let results: Vec<Result<(), kube::Error>> = futures::stream::iter(objects)
                .map(|(k, o)| {
                    let api = apis[k].clone();
                    async move {
                        let name = o["metadata"]["name"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string();
                        let o: DynamicObject = serde_json::from_value(o).expect("object");
                        api.patch(
                            &name,
                            &PatchParams::apply("bench-api-limit").force(),
                            &Patch::Apply(&o),
                        )
                        .await
                        .map(|_| ())
                    }
                })
                .buffer_unordered(c)
                .collect()
                .await;
            let secs = start.elapsed().as_secs_f64();
            let apiserver_cpu = self
                .apiserver_pid
                .map(|p| procs::usage_of(p).cpu_seconds)
                .unwrap_or(0.0)
                - apiserver0;
            let failed = results.iter().filter(|r| r.is_err()).count();
            if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
                self.notes.push(format!(
                    "API limit at concurrency {c}: {failed} requests failed, e.g. {e}"
                ));
            }
            eprintln!(
                "bench: API limit, concurrency {c}: {total} objects in {secs:.2} s = {:.0} objects/s",
                total as f64 / secs
            );
            out.push(json!({"concurrency": c, "objects": total, "seconds": secs,
                            "objects_per_second": (total - failed) as f64 / secs, "failed": failed,
                            "apiserver_cpu_seconds": apiserver_cpu}));
            cluster::delete_namespace(&self.client, &ns, Duration::from_secs(600)).await?;
        }
        Ok(out)
    }

    /// Installs what a contender needs besides the Bench CRD (kro: its CRDs and the RGD).
    async fn prepare(&self, kind: Kind) -> Result<()> {
        if kind != Kind::Kro {
            return Ok(());
        }
        for entry in std::fs::read_dir(self.cfg.kro_dir.join("crds"))? {
            let text = std::fs::read_to_string(entry?.path())?;
            cluster::apply_yaml(&self.client, &text).await?;
        }
        cluster::wait_crd(
            &self.client,
            "resourcegraphdefinitions.kro.run",
            Duration::from_secs(60),
        )
        .await?;
        Ok(())
    }

    /// After kro starts: the RGD, and its generated CRD served.
    async fn after_start(&self, kind: Kind) -> Result<()> {
        if kind != Kind::Kro {
            return Ok(());
        }
        // An RGD left terminating by an interrupted run (its finalizer needs kro) goes
        // first; now that kro runs it can.
        let rgds = cluster::api(
            &self.client,
            None,
            "kro.run/v1alpha1",
            "ResourceGraphDefinition",
            "resourcegraphdefinitions",
        );
        let start = Instant::now();
        while let Some(o) = rgds.get_opt("benches.kro.bench.rulebook.dev").await? {
            if o.metadata.deletion_timestamp.is_none() {
                break;
            }
            if start.elapsed() > Duration::from_secs(120) {
                bail!("kro's old ResourceGraphDefinition is still terminating");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let text = std::fs::read_to_string(self.cfg.repo.join("benches/kro/rgd.yaml"))?;
        cluster::apply_yaml(&self.client, &text).await?;
        cluster::wait_crd(
            &self.client,
            "benches.kro.bench.rulebook.dev",
            Duration::from_secs(120),
        )
        .await?;
        let rgds = cluster::api(
            &self.client,
            None,
            "kro.run/v1alpha1",
            "ResourceGraphDefinition",
            "resourcegraphdefinitions",
        );
        let start = Instant::now();
        loop {
            let o = serde_json::to_value(rgds.get("benches.kro.bench.rulebook.dev").await?)?;
            if o.pointer("/status/state").and_then(Json::as_str) == Some("Active") {
                break;
            }
            if start.elapsed() > Duration::from_secs(120) {
                bail!(
                    "kro's ResourceGraphDefinition is not Active: {}",
                    o["status"]
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        // kro's instance controller starts when the RGD is active; give it its list.
        tokio::time::sleep(Duration::from_secs(2)).await;
        Ok(())
    }

    /// Removes a contender's parents while it still runs (kro's finalizers need kro),
    /// stops it, and deletes the namespace.
    async fn teardown(&self, mut p: Proc, kind: Kind, ns: &str, n: usize) -> Result<()> {
        if kind == Kind::Kro {
            let api = self.parent_api(kind, ns);
            let _ = api
                .delete_collection(&DeleteParams::background(), &ListParams::default())
                .await;
            let start = Instant::now();
            while api
                .list(&ListParams::default().limit(1))
                .await
                .map(|l| !l.items.is_empty())
                .unwrap_or(false)
            {
                if start.elapsed() > self.cfg.timeout_for(n) {
                    self.note_later(format!("kro: parents in {ns} not deleted in time"));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        if kind == Kind::Kro {
            // The RGD's finalizer needs kro: delete it while kro still runs.
            let rgds = cluster::api(
                &self.client,
                None,
                "kro.run/v1alpha1",
                "ResourceGraphDefinition",
                "resourcegraphdefinitions",
            );
            let _ = rgds
                .delete(
                    "benches.kro.bench.rulebook.dev",
                    &DeleteParams::background(),
                )
                .await;
            let start = Instant::now();
            while rgds
                .get_opt("benches.kro.bench.rulebook.dev")
                .await
                .ok()
                .flatten()
                .is_some()
                && start.elapsed() < Duration::from_secs(120)
            {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        p.stop();
        let secs = cluster::delete_namespace(&self.client, ns, Duration::from_secs(900)).await?;
        eprintln!("bench: namespace {ns} deleted in {secs:.1} s");
        Ok(())
    }

    /// `Rulebook (round 2)`, for the notes.
    fn who(&self, kind: Kind) -> String {
        format!("{} (round {})", kind.title(), self.round)
    }

    /// One run of a contender: the workloads in one process, then memory at each size in
    /// a fresh one. A failure is recorded in the run (`error`, `scale_errors`), not raised.
    async fn contender(&mut self, kind: Kind) -> Json {
        let mut r = json!({"title": kind.title(), "round": self.round, "seq": self.seq,
                           "loadavg_start": loadavg()});
        eprintln!(
            "bench: [{}] round {}, run {}",
            kind.name(),
            self.round,
            self.seq
        );
        if self.cfg.wants("converge") {
            match self.workloads(kind).await {
                Ok(w) => {
                    for (k, v) in w.as_object().into_iter().flatten() {
                        r[k] = v.clone();
                    }
                }
                Err(e) => {
                    eprintln!("bench: [{}] workloads failed: {e:#}", kind.name());
                    r["error"] = json!(format!("{e:#}"));
                }
            }
        }
        if self.cfg.wants("scale") {
            for m in self.cfg.scale_n.clone() {
                match self.scale(kind, m).await {
                    Ok(s) => r["scale"][m.to_string()] = s,
                    Err(e) => {
                        eprintln!("bench: [{}] memory at {m} failed: {e:#}", kind.name());
                        r["scale_errors"][m.to_string()] = json!(format!("{e:#}"));
                    }
                }
            }
        }
        r
    }

    fn note_later(&self, s: String) {
        eprintln!("bench: note: {s}");
    }

    fn launch<'a>(
        &'a self,
        kind: Kind,
        ns: &'a str,
        rules: &'a Path,
        templates: &'a Path,
        tag: &'a str,
    ) -> Launch<'a> {
        Launch {
            kind,
            binary: match kind {
                Kind::Rulebook => &self.cfg.rulebook_bin,
                Kind::Reference => &self.cfg.reference_bin,
                Kind::Kro => &self.cfg.kro_bin,
            },
            kubeconfig: &self.cfg.kubeconfig,
            namespace: ns,
            concurrency: self.cfg.concurrency,
            rules,
            templates,
            log_dir: &self.log_dir,
            tag,
        }
    }

    /// Starts a contender and waits until it is ready; once more if the first process
    /// exited (its metrics port, picked free, may have been taken meanwhile by another
    /// test run on the machine).
    async fn start(
        &mut self,
        kind: Kind,
        ns: &str,
        rules: &Path,
        templates: &Path,
        tag: &str,
    ) -> Result<Proc> {
        let mut p = Proc::start(&self.launch(kind, ns, rules, templates, tag))?;
        match p.wait_ready(Duration::from_secs(120)).await {
            Ok(()) => Ok(p),
            // Dead, or alive with caches that never synced (the reference once sat 120 s
            // without its first listing): once more, with its own log.
            Err(e) => {
                self.notes.push(format!(
                    "{}: first start failed, started again: {e:#}",
                    self.who(kind)
                ));
                p.stop();
                let again = format!("{tag}-again");
                let mut p = Proc::start(&self.launch(kind, ns, rules, templates, &again))?;
                p.wait_ready(Duration::from_secs(120)).await?;
                Ok(p)
            }
        }
    }

    /// Converge, update, steady state and (Rulebook) template change, in one
    /// namespace with one controller process.
    async fn workloads(&mut self, kind: Kind) -> Result<Json> {
        let n = self.cfg.n;
        let ns = format!("bench-{}-{}-{}", kind.name(), self.seq, self.run_id);
        let mut out = json!({});
        // Rulebook reads a copy of the rule, so that the template can change under it.
        let dir = tempfile::tempdir()?;
        let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
        copy_tree(&self.cfg.repo.join("benches/rules"), &rules)?;
        copy_tree(&self.cfg.repo.join("benches/templates"), &templates)?;

        cluster::create_namespace(&self.client, &ns).await?;
        self.current = Some((ns.clone(), kind.user_agent()));
        self.prepare(kind).await?;
        let mut p = self
            .start(
                kind,
                &ns,
                &rules,
                &templates,
                &format!("workloads-{}", self.seq),
            )
            .await?;
        self.after_start(kind).await?;
        let api = self.parent_api(kind, &ns);
        let tracker = cluster::ParentTracker::start(api).await?;
        let timeout = self.cfg.timeout_for(n);

        // Converge.
        eprintln!("bench: [{}] converge: creating {n} parents", kind.name());
        let s0 = self.snap(&p).await;
        let t0 = Instant::now();
        self.create_parents(kind, &ns, n).await?;
        let created = t0.elapsed().as_secs_f64();
        let mut timeline = vec![(0.0, 0)];
        let ok = cluster::wait_count(t0, n, timeout, || tracker.converged(1), &mut timeline).await;
        let secs = t0.elapsed().as_secs_f64();
        let s1 = self.snap(&p).await;
        eprintln!(
            "bench: [{}] converge: {} in {secs:.2} s",
            kind.name(),
            if ok { "converged" } else { "TIMED OUT" }
        );
        let mut phase = self.phase(
            &s0,
            &s1,
            Some(secs),
            Some(ok),
            &[("POST benches", n as f64)],
        );
        phase["timeline"] = json!(timeline);
        phase["parents_created_seconds"] = json!(created);
        out["converge"] = phase;
        if !ok || !p.alive() {
            self.notes.push(format!(
                "{}: converge did not finish ({} of {n}); later workloads skipped",
                self.who(kind),
                tracker.converged(1)
            ));
            self.teardown(p, kind, &ns, n).await?;
            return Ok(out);
        }

        // Update.
        if self.cfg.wants("update") || self.cfg.wants("steady") {
            eprintln!("bench: [{}] update: changing {n} parents", kind.name());
            let t0 = Instant::now();
            self.update_parents(kind, &ns, n).await?;
            let mut timeline = vec![(0.0, 0)];
            let ok =
                cluster::wait_count(t0, n, timeout, || tracker.converged(2), &mut timeline).await;
            let secs = t0.elapsed().as_secs_f64();
            // Writes that trail convergence count for the update, not the steady window.
            tokio::time::sleep(Duration::from_secs(5)).await;
            let s2 = self.snap(&p).await;
            eprintln!(
                "bench: [{}] update: {} in {secs:.2} s",
                kind.name(),
                if ok { "converged" } else { "TIMED OUT" }
            );
            let mut phase = self.phase(
                &s1,
                &s2,
                Some(secs),
                Some(ok),
                &[("PATCH benches", n as f64)],
            );
            phase["timeline"] = json!(timeline);
            phase["children_checked"] = json!(self.check_children(kind, &ns, n).await);
            out["update"] = phase;

            // Steady state.
            if ok && self.cfg.wants("steady") {
                let w = self.cfg.steady_seconds;
                eprintln!("bench: [{}] steady state: watching for {w} s", kind.name());
                tokio::time::sleep(Duration::from_secs(w)).await;
                let s3 = self.snap(&p).await;
                let mut phase = self.phase(&s2, &s3, None, None, &[]);
                phase["converged_after"] = json!(tracker.converged(2));
                eprintln!(
                    "bench: [{}] steady state: {} writes, {:.2} CPU s",
                    kind.name(),
                    phase["writes_total"],
                    phase["cpu_seconds"].as_f64().unwrap_or(0.0)
                );
                out["steady"] = phase;
            }
        }

        // Template change (Rulebook only).
        if kind == Kind::Rulebook && self.cfg.wants("template") {
            // Done when every parent reports the new rule version (status.ruleVersion)
            // and every ConfigMap — the one child whose template changes — has the new
            // content. The Services and Secrets are not written at all.
            let selector = "app.kubernetes.io/managed-by=rulebook,rulebook.dev/rule=bench";
            let cms = vec![cluster::api(
                &self.client,
                Some(&ns),
                "v1",
                "ConfigMap",
                "configmaps",
            )];
            let children = cluster::FieldTracker::start(cms, selector, "/data/revision").await?;
            let parents = cluster::FieldTracker::start(
                vec![self.parent_api(kind, &ns)],
                "",
                "/status/ruleVersion",
            )
            .await?;
            let path = templates.join("bench/configmap.yaml");
            let edited = std::fs::read_to_string(&path)?.replace(
                "  data: {{ parent.spec.data }}\n",
                "  data: {{ parent.spec.data }}\n  revision: \"2\"\n",
            );
            let tmp = templates.join("bench/.configmap.yaml.tmp");
            std::fs::write(&tmp, &edited)?;
            let set = rulebook::render::load(&rules, &templates, &Default::default())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let old_version = set.rules["bench"].version.clone();
            std::fs::rename(&tmp, &path)?;
            let set = rulebook::render::load(&rules, &templates, &Default::default())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let version = set.rules["bench"].version.clone();
            if version == old_version {
                bail!("the template edit did not change the rule version");
            }
            eprintln!(
                "bench: [{}] template change: {old_version} → {version}",
                kind.name()
            );
            let s = self.snap(&p).await;
            let t0 = Instant::now();
            let mut timeline = vec![(0.0, 0)];
            let ok = cluster::wait_count(
                t0,
                n,
                timeout,
                || children.count("2").min(parents.count(&version)),
                &mut timeline,
            )
            .await;
            let secs = t0.elapsed().as_secs_f64();
            tokio::time::sleep(Duration::from_secs(5)).await;
            let s2 = self.snap(&p).await;
            eprintln!(
                "bench: [{}] template change: {} in {secs:.2} s",
                kind.name(),
                if ok { "rolled out" } else { "TIMED OUT" }
            );
            let mut phase = self.phase(&s, &s2, Some(secs), Some(ok), &[]);
            phase["timeline"] = json!(timeline);
            phase["children"] = json!(n);
            phase["key"] = json!(format!("{} and parents' {}", children.key(), parents.key()));
            out["template"] = phase;
        }
        drop(tracker);
        self.teardown(p, kind, &ns, n).await?;
        Ok(out)
    }

    /// Spot-checks that the update reached the children: the ConfigMaps of a few parents
    /// carry the new data.
    async fn check_children(&self, kind: Kind, ns: &str, n: usize) -> String {
        let cms = cluster::api(&self.client, Some(ns), "v1", "ConfigMap", "configmaps");
        let picks = [0, n / 2, n.saturating_sub(1)];
        let mut good = 0;
        for i in picks {
            let want = Self::parent(kind, ns, i, 2)["spec"]["data"].clone();
            if let Ok(o) = cms.get(&format!("b-{i:05}-config")).await
                && o.data["data"]["data"] == want
            {
                good += 1;
            }
        }
        format!(
            "{good}/{} sampled ConfigMaps carry the updated data",
            picks.len()
        )
    }

    /// RSS with `m` parents (3 × that many children) in the caches, in a fresh process.
    async fn scale(&mut self, kind: Kind, m: usize) -> Result<Json> {
        let ns = format!(
            "bench-scale-{}-{m}-{}-{}",
            kind.name(),
            self.seq,
            self.run_id
        );
        let dir = tempfile::tempdir()?;
        let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
        copy_tree(&self.cfg.repo.join("benches/rules"), &rules)?;
        copy_tree(&self.cfg.repo.join("benches/templates"), &templates)?;
        cluster::create_namespace(&self.client, &ns).await?;
        self.current = Some((ns.clone(), kind.user_agent()));
        self.prepare(kind).await?;
        let tag = format!("scale-{m}-{}", self.seq);
        let p = self.start(kind, &ns, &rules, &templates, &tag).await?;
        self.after_start(kind).await?;
        let idle = p.usage();
        let tracker = cluster::ParentTracker::start(self.parent_api(kind, &ns)).await?;
        eprintln!(
            "bench: [{}] memory at scale: creating {m} parents (round {})",
            kind.name(),
            self.round
        );
        let s0 = self.snap(&p).await;
        let t0 = Instant::now();
        self.create_parents(kind, &ns, m).await?;
        let mut timeline = vec![(0.0, 0)];
        let ok = cluster::wait_count(
            t0,
            m,
            self.cfg.timeout_for(m),
            || tracker.converged(1),
            &mut timeline,
        )
        .await;
        let secs = t0.elapsed().as_secs_f64();
        tokio::time::sleep(Duration::from_secs(10)).await;
        let s1 = self.snap(&p).await;
        eprintln!(
            "bench: [{}] memory at scale: {} in {secs:.1} s, RSS {:.1} MiB (peak {:.1})",
            kind.name(),
            if ok { "converged" } else { "TIMED OUT" },
            s1.usage.rss_mib,
            s1.usage.hwm_mib
        );
        let mut phase = self.phase(
            &s0,
            &s1,
            Some(secs),
            Some(ok),
            &[("POST benches", m as f64)],
        );
        phase["parents"] = json!(m);
        phase["children"] = json!(3 * m);
        phase["idle_rss_mib"] = json!(idle.rss_mib);
        phase["timeline"] = json!(timeline);
        drop(tracker);
        self.teardown(p, kind, &ns, m).await?;
        Ok(phase)
    }
}

fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

fn machine() -> Json {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_gib = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map(|kib| kib / 1024.0 / 1024.0)
        .unwrap_or(0.0);
    json!({
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "memory_gib": (mem_gib * 10.0).round() / 10.0,
        "cpu_model": model,
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
    })
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn git_describe(repo: &Path) -> String {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["describe", "--always", "--dirty"])
        .output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// Criterion's estimates for the render benchmark, in nanoseconds, from where criterion
/// writes them: `CRITERION_HOME`, else `<target dir>/criterion`.
fn render_cost(target_dir: &Path) -> Json {
    let criterion = std::env::var_os("CRITERION_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir.join("criterion"));
    let mut out = json!({});
    for group in ["myweb", "bench"] {
        for f in ["render", "status", "render_status"] {
            let path = criterion.join(format!("{group}/{f}/new/estimates.json"));
            if let Ok(text) = std::fs::read_to_string(&path)
                && let Ok(v) = serde_json::from_str::<Json>(&text)
            {
                out[group][f] = json!({
                    "mean_ns": v["mean"]["point_estimate"],
                    "median_ns": v["median"]["point_estimate"],
                    "ci_low_ns": v["mean"]["confidence_interval"]["lower_bound"],
                    "ci_high_ns": v["mean"]["confidence_interval"]["upper_bound"],
                });
            }
        }
    }
    out
}

async fn run(cfg: Cfg) -> Result<Json> {
    std::fs::create_dir_all(&cfg.out)?;
    let log_dir = cfg.out.join("logs");
    std::fs::create_dir_all(&log_dir)?;
    let client = cluster::client(&cfg.kubeconfig).await.with_context(|| {
        format!(
            "the local control plane is not reachable through {} (start it with `make cluster`)",
            cfg.kubeconfig.display()
        )
    })?;
    let k8s_version: Json = serde_json::from_str(
        &client
            .request_text(http::Request::get("/version").body(vec![])?)
            .await?,
    )?;
    for (what, bin) in [
        ("Rulebook", &cfg.rulebook_bin),
        ("the reference controller", &cfg.reference_bin),
    ] {
        if !bin.exists() {
            bail!(
                "{what} is not built at {} (run `make bench`, which builds it)",
                bin.display()
            );
        }
    }
    let run_id = format!(
        "{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs()
            % 1_000_000
    );
    let mut b = Bench {
        apiserver_pid: procs::component_pid(&cfg.repo, "kube-apiserver"),
        cfg: cfg.clone(),
        client: client.clone(),
        run_id,
        log_dir,
        notes: Vec::new(),
        audit: cluster::Audit::open(&cfg.repo.join(".cluster/logs/audit.log")),
        current: None,
        round: 1,
        seq: 0,
    };
    let started = jiff::Timestamp::now().to_string();
    let load_start = loadavg();

    // The Bench CRD, exactly as Rulebook generates it from the rule.
    let crds = std::process::Command::new(&cfg.rulebook_bin)
        .args(["crds", "--rules"])
        .arg(cfg.repo.join("benches/rules"))
        .arg("--templates")
        .arg(cfg.repo.join("benches/templates"))
        .output()?;
    if !crds.status.success() {
        bail!("rulebook crds: {}", String::from_utf8_lossy(&crds.stderr));
    }
    cluster::apply_yaml(&client, &String::from_utf8_lossy(&crds.stdout)).await?;
    cluster::wait_crd(
        &client,
        "benches.bench.rulebook.dev",
        Duration::from_secs(60),
    )
    .await?;

    let mut results = json!({
        "started": started,
        "machine": machine(),
        "kubernetes": k8s_version["gitVersion"],
        "rulebook": git_describe(&cfg.repo),
        "config": {
            "n": cfg.n, "scale_n": cfg.scale_n, "repeats": cfg.repeats,
            "steady_seconds": cfg.steady_seconds,
            "concurrency": cfg.concurrency, "api_concurrency": cfg.api_concurrency,
            "driver_concurrency": cfg.driver_concurrency,
            "contenders": cfg.contenders.iter().map(|k| k.name()).collect::<Vec<_>>(),
            "workloads": cfg.workloads,
        },
        "write_counts_source": "",
        "contenders": {},
    });
    let audit = cfg.repo.join(".cluster/logs/audit.log");
    results["write_counts_source"] = json!(if audit.exists() {
        "the API server's audit log (.cluster/logs/audit.log): requests with the contender's \
         user agent in its namespace, by audit verb (a server-side apply is a patch); plus each \
         controller's own counters (Rulebook: rulebook_api_writes_total; reference: \
         reference_api_writes_total; kro: client-go rest_client_requests_total by method) and \
         apiserver_request_total deltas (every client of the shared cluster)"
    } else {
        "each controller's own counters (Rulebook: rulebook_api_writes_total; reference: its own \
         reference_api_writes_total; kro: client-go rest_client_requests_total by method), \
         cross-checked with the API server's apiserver_request_total (no user-agent label, so it \
         counts every client of the shared cluster; the driver's own writes are subtracted). \
         The local cluster runs without an audit log."
    });

    if cfg.wants("api") {
        eprintln!(
            "bench: API server limit: {} objects at concurrency {:?}",
            3 * cfg.n,
            cfg.api_concurrency
        );
        results["api_limit"] = json!(b.api_limit().await?);
    }

    let mut available: Vec<Kind> = Vec::new();
    for &kind in &cfg.contenders {
        if kind == Kind::Kro && !cfg.kro_dir.join("bin/controller").exists() {
            let why = std::fs::read_to_string(cfg.out.join("kro-build.log"))
                .ok()
                .map(|s| {
                    s.lines()
                        .rev()
                        .take(5)
                        .collect::<Vec<_>>()
                        .into_iter()
                        .rev()
                        .collect::<Vec<_>>()
                        .join(" / ")
                })
                .unwrap_or_else(|| "benches/kro/build.sh was not run".into());
            results["contenders"][kind.name()] =
                json!({"skipped": format!("kro is not built in {}: {why}", cfg.kro_dir.display())});
            continue;
        }
        available.push(kind);
    }
    // Every run kept (`runs`); the tables read the medians (`contenders`) and the ranges
    // (`spread`).
    let mut all_runs: BTreeMap<&str, Vec<Json>> = BTreeMap::new();
    for (seq, (round, kind)) in runs::order(&available, cfg.repeats).into_iter().enumerate() {
        (b.round, b.seq) = (round, seq + 1);
        let r = b.contender(kind).await;
        all_runs.entry(kind.name()).or_default().push(r);
    }
    results["runs"] = json!(all_runs);
    b.notes.extend(runs::recombine(&mut results));
    if cfg.contenders.contains(&Kind::Kro) && cfg.kro_dir.join("bin/controller").exists() {
        // kro leaves the CRD it generated (its RGD went in each teardown, while kro ran).
        let crds = cluster::api(
            &client,
            None,
            "apiextensions.k8s.io/v1",
            "CustomResourceDefinition",
            "customresourcedefinitions",
        );
        let _ = crds
            .delete(
                "benches.kro.bench.rulebook.dev",
                &DeleteParams::background(),
            )
            .await;
    }
    if cfg.wants("render") {
        results["render"] = render_cost(&cfg.target_dir);
    }
    let restarted = procs::component_pid(&cfg.repo, "kube-apiserver") != b.apiserver_pid;
    if restarted {
        b.notes.push("the API server was restarted during the run (another test run?): the figures are not comparable".into());
    }
    results["finished"] = json!(jiff::Timestamp::now().to_string());
    results["loadavg"] = json!({"start": load_start, "end": loadavg()});
    results["notes"] = json!(b.notes);
    Ok(results)
}

/// Writes results.md, converge.svg and (when there is a memory curve) memory.svg into
/// `dir`, removing a memory.svg of an earlier run otherwise; the file names written.
fn write_report(results: &Json, dir: &Path) -> Result<Vec<&'static str>> {
    std::fs::write(dir.join("results.md"), report::markdown(results))?;
    plot::converge(results, &dir.join("converge.svg"))?;
    let mut written = vec!["results.md", "converge.svg"];
    if plot::memory(results, &dir.join("memory.svg"))? {
        written.push("memory.svg");
    } else {
        let _ = std::fs::remove_file(dir.join("memory.svg"));
    }
    Ok(written)
}

fn main() -> Result<()> {
    // The report's arithmetic, checked on every start (see the header).
    if let Err(e) = checks::all() {
        eprintln!("e2e: self-check FAILED: {e}");
        std::process::exit(1);
    }
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "e2e: self-check of the report's arithmetic passed; the end-to-end benchmark runs \
             under `cargo bench --bench e2e` (or `make bench`)"
        );
        return Ok(());
    }
    let cfg = Cfg::from_env();
    // Re-render the report of an earlier run: BENCH_REPORT_ONLY=target/bench/results.json.
    if let Some(path) = std::env::var_os("BENCH_REPORT_ONLY") {
        let mut results: Json = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
        // The medians again from the runs (none in results of before the repeats).
        for note in runs::recombine(&mut results) {
            if !results["notes"]
                .as_array()
                .is_some_and(|a| a.contains(&json!(note)))
            {
                match results["notes"].as_array_mut() {
                    Some(a) => a.push(json!(note)),
                    None => results["notes"] = json!([note]),
                }
            }
        }
        let dir = Path::new(&path).parent().unwrap_or(Path::new("."));
        let written = write_report(&results, dir)?;
        eprintln!(
            "bench: re-rendered {} in {}",
            written.join(", "),
            dir.display()
        );
        return Ok(());
    }
    eprintln!("bench: {cfg:?}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let results = rt.block_on(run(cfg.clone()))?;
    std::fs::write(
        cfg.out.join("results.json"),
        serde_json::to_string_pretty(&results)?,
    )?;
    let written = write_report(&results, &cfg.out)?;
    println!("{}", report::markdown(&results));
    eprintln!(
        "bench: wrote results.json, {} in {}",
        written.join(", "),
        cfg.out.display()
    );
    Ok(())
}
