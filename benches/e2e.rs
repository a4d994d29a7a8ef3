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
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

#[path = "e2e/checks.rs"]
mod checks;
#[path = "e2e/cluster.rs"]
mod cluster;
#[path = "e2e/config.rs"]
mod config;
#[path = "e2e/contender.rs"]
mod contender;
#[path = "e2e/driver.rs"]
mod driver;
#[path = "e2e/host.rs"]
mod host;
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
#[path = "e2e/workloads.rs"]
mod workloads;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use config::Cfg;
use futures::StreamExt;
use host::{copy_tree, git_describe, loadavg, machine, render_cost};
use kube::Client;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use procs::{Kind, Launch, Proc, Usage};
use serde_json::{Value as Json, json};

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
    /// Waits, after a phase converged, until the contender has gone quiet: its own write
    /// and reconcile counters unchanged and under 10 ms of CPU per half second, for two
    /// seconds in a row (at most 30 s). Returns the seconds waited. What a phase's writes
    /// bring back after the parents report ready (the children's watch events, the
    /// reconciles they cause, Events still waiting in an outbox) counts for that phase,
    /// not the next one.
    async fn settle(&self, p: &Proc) -> f64 {
        let t0 = Instant::now();
        let mut last = (p.counters().await, p.usage().cpu_seconds);
        let mut quiet = 0;
        while quiet < 4 && t0.elapsed() < Duration::from_secs(30) {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let now = (p.counters().await, p.usage().cpu_seconds);
            let still = now.0 == last.0 && now.1 - last.1 < 0.010;
            quiet = if still { quiet + 1 } else { 0 };
            last = now;
        }
        t0.elapsed().as_secs_f64()
    }

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
