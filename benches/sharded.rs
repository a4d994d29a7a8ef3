//! One replica against three sharded replicas (issue 19; `make bench-sharded`,
//! docs/benchmarks.md).
//!
//! On the local control plane (`make cluster`, whose API server filters watches by shard
//! with `ShardedListAndWatch`), for each replica count in `SHARD_BENCH_REPLICAS` (default
//! `1,3`), `SHARD_BENCH_REPEATS` times in alternating order: a fresh set of namespaces
//! named alike (`team-<run>-0` …), Rulebook's release binary on the benchmark rule
//! (`benches/rules`: three children per parent) — one replica as `rulebook run` runs by
//! default, or `--sharding namespace` replicas once they share the hash space — then
//! `SHARD_BENCH_N` parents (default 10,000, `SHARD_BENCH_PER_NAMESPACE` per namespace,
//! default 10) created at once. Measured: the time until every parent is Ready, the CPU
//! seconds of the replicas, the API server and etcd over that time, and each replica's
//! RSS once the parents it caches have settled (its `rulebook_cached_objects` gauges
//! stable over two readings), and above its RSS when idle (started and watching, before
//! the first parent): the part of the memory that comes with the load, which sharding
//! divides; the idle part every replica pays in full. The namespaces are deleted after
//! each run.
//!
//! Results: `target/bench/sharded.{md,json}` (medians and ranges). Nothing here asserts on
//! timings; the first thing `main` does is check its own arithmetic.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
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

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use kube::api::{ListParams, PostParams};
use serde_json::{Value as Json, json};

fn env<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Cfg {
    repo: PathBuf,
    out: PathBuf,
    kubeconfig: PathBuf,
    binary: PathBuf,
    n: usize,
    per: usize,
    replicas: Vec<usize>,
    repeats: usize,
    concurrency: usize,
    timeout: Duration,
}

impl Cfg {
    fn from_env() -> Cfg {
        let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .map(|t| if t.is_absolute() { t } else { repo.join(t) })
            .unwrap_or_else(|| repo.join("target"));
        Cfg {
            out: repo.join("target/bench"),
            kubeconfig: std::env::var_os("RULEBOOK_TEST_KUBECONFIG")
                .map(PathBuf::from)
                .unwrap_or_else(|| repo.join(".cluster/kubeconfig")),
            binary: target.join("release/rulebook"),
            n: env("SHARD_BENCH_N", 10_000),
            per: env("SHARD_BENCH_PER_NAMESPACE", 10).max(1),
            replicas: std::env::var("SHARD_BENCH_REPLICAS")
                .unwrap_or_else(|_| "1,3".into())
                .split(',')
                .filter_map(|s| s.trim().parse().ok())
                .filter(|r| *r > 0)
                .collect(),
            repeats: env("SHARD_BENCH_REPEATS", 2).max(1),
            concurrency: env("SHARD_BENCH_CONCURRENCY", 16),
            timeout: Duration::from_secs(env("SHARD_BENCH_TIMEOUT", 1800)),
            repo,
        }
    }
}

/// One replica process.
struct Replica {
    child: Child,
    port: u16,
}

impl Replica {
    fn start(cfg: &Cfg, run: &str, i: usize, sharded: bool, log_dir: &Path) -> Result<Replica> {
        let port = procs::free_port();
        let log = std::fs::File::create(log_dir.join(format!("sharded-{run}-{i}.log")))?;
        let mut cmd = Command::new(&cfg.binary);
        cmd.arg("run")
            .arg("--rules")
            .arg(cfg.repo.join("benches/rules"))
            .arg("--templates")
            .arg(cfg.repo.join("benches/templates"))
            .arg("--kubeconfig")
            .arg(&cfg.kubeconfig)
            .arg("--install-crds")
            .arg("--concurrency")
            .arg(cfg.concurrency.to_string())
            .arg("--identity")
            .arg(format!("{run}-{i}"))
            .arg("--metrics-addr")
            .arg(format!("127.0.0.1:{port}"));
        if sharded {
            cmd.args([
                "--sharding",
                "namespace",
                "--lease-name",
                &format!("sbench-{run}"),
                "--lease-namespace",
                "default",
                "--lease-duration",
                "15",
                // The default rebalance period (60 s). With 20 s, the transient skew of
                // namespaces filling one after another moved ranges twice during a
                // 3,000-parent converge, and a move re-reconciles the moved share.
            ]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", cfg.binary.display()))?;
        Ok(Replica { child, port })
    }

    async fn get(&self, path: &str) -> Option<String> {
        http_get::http_get(&format!("http://127.0.0.1:{}{path}", self.port))
            .await
            .ok()
    }

    async fn sharding(&self) -> Json {
        let s: Json = serde_json::from_str(&self.get("/status").await.unwrap_or_default())
            .unwrap_or_default();
        s["sharding"].clone()
    }

    /// Parents and children in this replica's caches.
    async fn cached(&self) -> f64 {
        let text = self.get("/metrics").await.unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with("rulebook_cached_objects{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// The sum of a counter's series on this replica's /metrics.
    async fn counter(&self, name: &str) -> f64 {
        let text = self.get("/metrics").await.unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Parents in this replica's caches.
    async fn cached_parents(&self) -> f64 {
        let text = self.get("/metrics").await.unwrap_or_default();
        text.lines()
            .filter(|l| {
                l.starts_with("rulebook_cached_objects{") && l.contains("cache=\"parents\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

/// A control-plane component's pid (`.cluster/pids/<name>.pid`).
fn component_pid(cfg: &Cfg, name: &str) -> Option<u32> {
    let dir = cfg.kubeconfig.parent()?;
    std::fs::read_to_string(dir.join(format!("pids/{name}.pid")))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn cpu(pid: Option<u32>) -> f64 {
    pid.map(|p| procs::usage_of(p).cpu_seconds).unwrap_or(0.0)
}

async fn wait<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    within: Duration,
    mut probe: impl FnMut() -> F,
) -> Result<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return Ok(v);
        }
        if start.elapsed() > within {
            bail!("timed out after {within:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// One run: `r` replicas over a fresh set of namespaces.
async fn run(cfg: &Cfg, client: &kube::Client, r: usize, round: usize) -> Result<Json> {
    let run = format!("sb{round}r{r}-{}", std::process::id() % 10_000);
    let spaces: Vec<String> = (0..cfg.n.div_ceil(cfg.per))
        .map(|i| format!("team-{run}-{i}"))
        .collect();
    eprintln!(
        "sharded: {r} replica(s), {} parents over {} namespaces (round {round})",
        cfg.n,
        spaces.len()
    );
    // The replicas watch every Bench in the cluster: parents another run left behind (one
    // still cleaning up) would be reconciled and cached, and counted against this run.
    let everywhere = cluster::api(client, None, "bench.rulebook.dev/v1", "Bench", "benches");
    wait(
        "the parents of earlier runs to be gone",
        Duration::from_secs(900),
        || async {
            match everywhere.list(&ListParams::default().limit(1)).await {
                Ok(l) if l.items.is_empty() => Some(()),
                Err(kube::Error::Api(s)) if s.code == 404 => Some(()),
                _ => None,
            }
        },
    )
    .await?;
    futures::stream::iter(spaces.clone())
        .map(|ns| async move { cluster::create_namespace(client, &ns).await })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<()>>>()?;
    let log_dir = cfg.out.join("logs");
    std::fs::create_dir_all(&log_dir)?;
    let sharded = r > 1;
    let mut replicas = Vec::new();
    for i in 0..r {
        replicas.push(Replica::start(cfg, &run, i, sharded, &log_dir)?);
    }
    // Ready, and (sharded) every member holding a part of the hash space.
    wait(
        "the replicas to be ready",
        Duration::from_secs(120),
        || async {
            for rep in &replicas {
                rep.get("/healthz").await?;
            }
            Some(())
        },
    )
    .await?;
    if sharded {
        wait(
            "the replicas to share the hash space",
            Duration::from_secs(180),
            || async {
                for rep in &replicas {
                    let s = rep.sharding().await;
                    let members = s["members"].as_array().map(Vec::len);
                    let holds = s["ranges"].as_str().is_some_and(|x| !x.is_empty());
                    let settled = s["waitingFor"].as_array().is_some_and(Vec::is_empty);
                    if members != Some(r) || !holds || !settled {
                        return None;
                    }
                }
                Some(())
            },
        )
        .await?;
    }
    let parents = cluster::api(client, None, "bench.rulebook.dev/v1", "Bench", "benches");
    cluster::wait_crd(
        client,
        "benches.bench.rulebook.dev",
        Duration::from_secs(60),
    )
    .await?;
    // Idle: running and watching, before any parent of this run (the memory that does not
    // come with the load: the binary's pages, the runtime, the clients, the empty caches).
    let idle_rss: Vec<f64> = replicas
        .iter()
        .map(|x| procs::usage_of(x.pid()).rss_mib)
        .collect();
    let idle_anon: Vec<f64> = replicas.iter().map(|x| rss_anon_mib(x.pid())).collect();
    let idle_sockets: Vec<usize> = replicas.iter().map(|x| sockets_of(x.pid())).collect();
    let selector = format!("bench.rulebook.dev/run={run}");
    let tracker = cluster::ParentTracker::start_selected(parents.clone(), Some(&selector)).await?;
    let (apiserver, etcd) = (
        component_pid(cfg, "kube-apiserver"),
        component_pid(cfg, "etcd"),
    );
    // The seed: one parent per namespace, so that the members know where the load is
    // (names alike cluster in FNV-1a: an even split of the hash space would leave one
    // member almost everything). The fleet balances on it before the measured part.
    create(client, &spaces, &run, 0..1).await?;
    let seeds = spaces.len();
    if !cluster::wait_count(
        Instant::now(),
        seeds,
        cfg.timeout,
        || tracker.converged(1),
        &mut Vec::new(),
    )
    .await
    {
        bail!("{r} replica(s): the seed parents did not converge");
    }
    let balanced = if sharded {
        balance(&replicas, seeds).await
    } else {
        true
    };
    let cpu0: Vec<f64> = replicas.iter().map(|x| cpu(Some(x.pid()))).collect();
    // What each replica had done before the measured part (the seed, the balancing), and
    // the share generation it started from (a later one means ranges moved during it).
    let mut reconciles0 = Vec::new();
    let mut generation0 = Vec::new();
    for rep in &replicas {
        reconciles0.push(rep.counter("rulebook_reconciles_total").await);
        if sharded {
            generation0.push(rep.sharding().await["generation"].clone());
        }
    }
    let (api0, etcd0) = (cpu(apiserver), cpu(etcd));
    let t0 = Instant::now();
    create(client, &spaces, &run, 1..cfg.per).await?;
    let created = t0.elapsed().as_secs_f64();
    let mut timeline = Vec::new();
    let ok = cluster::wait_count(
        t0,
        spaces.len() * cfg.per,
        cfg.timeout,
        || tracker.converged(1),
        &mut timeline,
    )
    .await;
    let converge = t0.elapsed().as_secs_f64();
    let replica_cpu: Vec<f64> = replicas
        .iter()
        .zip(&cpu0)
        .map(|(x, c0)| cpu(Some(x.pid())) - c0)
        .collect();
    let (api_cpu, etcd_cpu) = (cpu(apiserver) - api0, cpu(etcd) - etcd0);
    if !ok {
        bail!(
            "{r} replica(s): not every parent converged within {:?}",
            cfg.timeout
        );
    }
    // Memory once each replica's caches hold what they will hold: two readings of the
    // cached-object gauges (refreshed every 2 s) 5 s apart agree, and the caches hold
    // every parent and child (4 objects per parent) between them.
    let mut last: Option<Vec<f64>> = None;
    let settling = Instant::now();
    let cached = loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let mut now = Vec::new();
        for rep in &replicas {
            now.push(rep.cached().await);
        }
        let whole = now.iter().sum::<f64>() >= (4 * spaces.len() * cfg.per) as f64;
        if whole && last.as_ref() == Some(&now) {
            break now;
        }
        if settling.elapsed() > Duration::from_secs(300) {
            bail!("the caches did not settle in 300 s: {now:?}");
        }
        last = Some(now);
    };
    let rss: Vec<f64> = replicas
        .iter()
        .map(|x| procs::usage_of(x.pid()).rss_mib)
        .collect();
    // The anonymous part of RSS (the rest is the binary's pages, the same in every
    // replica), and what each replica did: reconciles, and its sharding status.
    let anon: Vec<f64> = replicas.iter().map(|x| rss_anon_mib(x.pid())).collect();
    // What a replica holds whatever its share: open sockets (connections the client keeps
    // for later requests, each with its TLS and HTTP buffers) and threads.
    let sockets: Vec<usize> = replicas.iter().map(|x| sockets_of(x.pid())).collect();
    let threads: Vec<f64> = replicas
        .iter()
        .map(|x| status_field(x.pid(), "Threads:"))
        .collect();
    let mut reconciles = Vec::new();
    let mut shares: Vec<Json> = Vec::new();
    let mut sharding: Vec<Json> = Vec::new();
    for (i, rep) in replicas.iter().enumerate() {
        reconciles.push(rep.counter("rulebook_reconciles_total").await - reconciles0[i]);
        if sharded {
            let s = rep.sharding().await;
            shares.push(s["percentOfHashSpace"].clone());
            sharding.push(json!({
                "generation_at_start": generation0[i],
                "generation": s["generation"],
                "coordinator": s["coordinator"] == s["identity"],
            }));
        }
    }
    eprintln!(
        "sharded: {r} replica(s): converged in {converge:.1} s (created in {created:.1} s); \
         replica CPU {replica_cpu:.1?} s; API server {api_cpu:.1} s, etcd {etcd_cpu:.1} s; \
         RSS {rss:.1?} MiB (anonymous {anon:.1?}; idle {idle_rss:.1?}, anonymous {idle_anon:.1?}); \
         cached objects {cached:?}; sockets {sockets:?} (idle {idle_sockets:?}), threads {threads:?}; \
         reconciles during it {reconciles:?}; sharding {sharding:?}"
    );
    drop(replicas);
    drop(tracker);
    // The next run starts on an empty cluster again (its children go with the namespaces).
    futures::stream::iter(spaces)
        .map(|ns| async move { cluster::delete_namespace(client, &ns, Duration::from_secs(900)).await })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<f64>>>()?;
    Ok(json!({
        "replicas": r,
        "round": round,
        "converge_seconds": converge,
        "seeds": seeds,
        "balanced_before": balanced,
        "create_seconds": created,
        "replica_cpu_seconds": replica_cpu,
        "apiserver_cpu_seconds": api_cpu,
        "etcd_cpu_seconds": etcd_cpu,
        "rss_mib": rss,
        "rss_anon_mib": anon,
        "idle_rss_mib": idle_rss,
        "idle_rss_anon_mib": idle_anon,
        "rss_above_idle_mib": rss.iter().zip(&idle_rss).map(|(a, b)| a - b).collect::<Vec<f64>>(),
        "rss_anon_above_idle_mib": anon.iter().zip(&idle_anon).map(|(a, b)| a - b).collect::<Vec<f64>>(),
        "cached_objects": cached,
        "sockets": sockets,
        "idle_sockets": idle_sockets,
        "threads": threads,
        "reconciles": reconciles,
        "sharding": sharding,
        "share_percent": shares,
    }))
}

/// The anonymous resident memory of a process (`RssAnon`), MiB.
fn rss_anon_mib(pid: u32) -> f64 {
    status_field(pid, "RssAnon:") / 1024.0
}

/// A number from `/proc/<pid>/status` (`field` with its colon); 0 when unreadable.
fn status_field(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with(field))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .unwrap_or(0.0)
}

/// How many sockets a process has open.
fn sockets_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.flatten()
                .filter(|fd| {
                    std::fs::read_link(fd.path())
                        .is_ok_and(|t| t.to_string_lossy().starts_with("socket:"))
                })
                .count()
        })
        .unwrap_or(0)
}

/// Creates parents `b<i>` for each `i` in `names` in every namespace of `spaces`.
async fn create(
    client: &kube::Client,
    spaces: &[String],
    run: &str,
    names: std::ops::Range<usize>,
) -> Result<()> {
    let objects: Vec<(String, Json)> = spaces
        .iter()
        .flat_map(|ns| {
            names.clone().map(move |i| {
                (
                    ns.clone(),
                    json!({
                        "apiVersion": "bench.rulebook.dev/v1", "kind": "Bench",
                        "metadata": {"name": format!("b{i}"), "namespace": ns,
                                     "labels": {"bench.rulebook.dev/run": run}},
                        "spec": {"size": i, "data": format!("payload-{i}")}
                    }),
                )
            })
        })
        .collect();
    futures::stream::iter(objects)
        .map(|(ns, o)| {
            let api = cluster::api(
                client,
                Some(&ns),
                "bench.rulebook.dev/v1",
                "Bench",
                "benches",
            );
            async move {
                let o: kube::api::DynamicObject = serde_json::from_value(o)?;
                api.create(&PostParams::default(), &o).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<()>>>()?;
    Ok(())
}

/// Waits (at most 300 s) until no replica caches more than 40 % of the `total` parents
/// and their caches hold all of them, in two readings 5 s apart; whether it got there.
async fn balance(replicas: &[Replica], total: usize) -> bool {
    let start = Instant::now();
    let mut last: Option<Vec<f64>> = None;
    while start.elapsed() < Duration::from_secs(300) {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let mut now = Vec::new();
        for rep in replicas {
            now.push(rep.cached_parents().await);
        }
        let ok = now.iter().all(|c| *c <= 0.4 * total as f64)
            && now.iter().sum::<f64>() as usize >= total;
        if ok && last.as_ref() == Some(&now) {
            eprintln!(
                "sharded:   balanced on the seed after {:.0} s: {now:?}",
                start.elapsed().as_secs_f64()
            );
            return true;
        }
        last = ok.then_some(now);
    }
    eprintln!("sharded:   not balanced after 300 s; measuring anyway");
    false
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
    match stats(v) {
        Some((m, lo, hi)) if v.len() > 1 => format!("{m:.1}{unit} ({lo:.1}–{hi:.1})"),
        Some((m, _, _)) => format!("{m:.1}{unit}"),
        None => "—".into(),
    }
}

fn report(cfg: &Cfg, runs: &[Json]) -> String {
    let mut md = format!(
        "# One replica against sharded replicas\n\n{} parents ({} per namespace, 3 children each; \
         converge and CPU are of the parents after the first of each namespace), {} round(s); \
         medians (range).\n\n\
         | replicas | converge | replica CPU, all | API server CPU | etcd CPU | RSS per replica | max RSS per replica, % of one replica's | anonymous RSS per replica | max anonymous RSS, % of one replica's | idle RSS per replica | RSS above idle per replica | max RSS above idle, % of one replica's |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
        cfg.n, cfg.per, cfg.repeats
    );
    let of = |r: usize| -> Vec<&Json> { runs.iter().filter(|x| x["replicas"] == r).collect() };
    let nums = |rs: &[&Json], key: &str| -> Vec<f64> {
        rs.iter().filter_map(|x| x[key].as_f64()).collect()
    };
    // Every replica's value of a per-replica key, and each run's largest.
    let each = |rs: &[&Json], key: &str| -> Vec<f64> {
        rs.iter()
            .flat_map(|x| {
                x[key]
                    .as_array()
                    .map(|a| a.iter().filter_map(Json::as_f64).collect::<Vec<_>>())
                    .unwrap_or_default()
            })
            .collect()
    };
    let largest = |rs: &[&Json], key: &str| -> Vec<f64> {
        rs.iter()
            .filter_map(|x| {
                x[key]
                    .as_array()?
                    .iter()
                    .filter_map(Json::as_f64)
                    .reduce(f64::max)
            })
            .collect()
    };
    let single = |key: &str| stats(&each(&of(1), key)).map(|s| s.0);
    let pct = |max: Vec<f64>, of_one: Option<f64>| -> Vec<f64> {
        match of_one {
            Some(s) if s > 0.0 => max.iter().map(|m| m * 100.0 / s).collect(),
            _ => Vec::new(),
        }
    };
    for r in &cfg.replicas {
        let rs = of(*r);
        let cpu_sum: Vec<f64> = rs
            .iter()
            .map(|x| {
                x["replica_cpu_seconds"]
                    .as_array()
                    .map(|a| a.iter().filter_map(Json::as_f64).sum())
                    .unwrap_or(f64::NAN)
            })
            .collect();
        md.push_str(&format!(
            "| {r} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            cell(&nums(&rs, "converge_seconds"), " s"),
            cell(&cpu_sum, " s"),
            cell(&nums(&rs, "apiserver_cpu_seconds"), " s"),
            cell(&nums(&rs, "etcd_cpu_seconds"), " s"),
            cell(&each(&rs, "rss_mib"), " MiB"),
            cell(&pct(largest(&rs, "rss_mib"), single("rss_mib")), " %"),
            cell(&each(&rs, "rss_anon_mib"), " MiB"),
            cell(
                &pct(largest(&rs, "rss_anon_mib"), single("rss_anon_mib")),
                " %"
            ),
            cell(&each(&rs, "idle_rss_mib"), " MiB"),
            cell(&each(&rs, "rss_above_idle_mib"), " MiB"),
            cell(
                &pct(
                    largest(&rs, "rss_above_idle_mib"),
                    single("rss_above_idle_mib")
                ),
                " %"
            ),
        ));
    }
    md.push_str("\nEvery run (`sharded.json`):\n\n");
    for x in runs {
        md.push_str(&format!(
            "- {} replica(s), round {}: converge {:.1} s; CPU {} s; RSS {} MiB (anonymous {}; idle {}); \
             cached objects {}; sockets {} (idle {}), threads {}; reconciles during the converge {}; share {}; sharding {}\n",
            x["replicas"],
            x["round"],
            x["converge_seconds"].as_f64().unwrap_or(f64::NAN),
            x["replica_cpu_seconds"],
            x["rss_mib"],
            x["rss_anon_mib"],
            x["idle_rss_mib"],
            x["cached_objects"],
            x["sockets"],
            x["idle_sockets"],
            x["threads"],
            x["reconciles"],
            x["share_percent"],
            x["sharding"],
        ));
    }
    md
}

fn self_check() {
    assert_eq!(stats(&[3.0, 1.0, 2.0]), Some((2.0, 1.0, 3.0)));
    assert_eq!(stats(&[4.0, 1.0]), Some((2.5, 1.0, 4.0)));
    assert_eq!(stats(&[]), None);
    assert_eq!(cell(&[2.0, 4.0], " s"), "3.0 s (2.0–4.0)");
    assert_eq!(cell(&[2.0], " s"), "2.0 s");
}

fn main() -> Result<()> {
    self_check();
    if !std::env::args().any(|a| a == "--bench") {
        return Ok(());
    }
    let cfg = Cfg::from_env();
    if !cfg.binary.exists() {
        bail!(
            "{} is missing: `make bench-sharded` builds it (cargo build --release)",
            cfg.binary.display()
        );
    }
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let client = cluster::client(&cfg.kubeconfig).await?;
        let mut runs = Vec::new();
        for round in 0..cfg.repeats {
            let mut order = cfg.replicas.clone();
            if round % 2 == 1 {
                order.reverse();
            }
            for r in order {
                match run(&cfg, &client, r, round).await {
                    Ok(x) => runs.push(x),
                    Err(e) => eprintln!("sharded: {r} replica(s), round {round} failed: {e:#}"),
                }
            }
        }
        std::fs::create_dir_all(&cfg.out)?;
        std::fs::write(
            cfg.out.join("sharded.json"),
            serde_json::to_string_pretty(&json!({"runs": runs, "n": cfg.n, "per": cfg.per}))?,
        )?;
        let md = report(&cfg, &runs);
        std::fs::write(cfg.out.join("sharded.md"), &md)?;
        println!("{md}");
        anyhow::Ok(())
    })
}
