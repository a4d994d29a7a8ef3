//! Admission latency through Rulebook's webhook (issue 43; `make bench-admission`,
//! docs/benchmarks.md "Admission latency").
//!
//! On the local control plane (`make cluster`; its API server calls the webhook on
//! 127.0.0.1), one `rulebook run` serving webhooks for two rules of two kinds defined
//! alike, with no children (so reconciles do not compete with the creates): `hooked`,
//! whose `spec.admission` has an `expr:` check (so every create of its kind goes through
//! the validating webhook), and `plain`, with none. Each round creates
//! `ADMISSION_BENCH_N` objects (default 1,000) of one kind from `ADMISSION_BENCH_CLIENTS`
//! concurrent clients (default 4), each client its share one after the other, timing
//! every create from request to answer; `ADMISSION_BENCH_REPEATS` rounds of each kind
//! (default 5), alternating `plain, hooked` and `hooked, plain`, each in a fresh
//! namespace. Reported per kind: the median over the rounds of each round's p50, p99 and
//! throughput, with the range of the rounds.
//!
//! The binary: `ADMISSION_BENCH_BINARY`, else the release binary in cargo's target
//! directory if built, else the debug one (dependencies optimized; docs/benchmarks.md
//! says which one the figures came from). Results: `target/bench/admission.md`. Nothing
//! here asserts on timings; every create must succeed, or the run stops.
//! `ADMISSION_BENCH_DRY_RUN=1` sends server-side dry runs instead (nothing stored; the
//! webhook is called all the same, `sideEffects: None`), for a build whose admission
//! handler refuses every review.
// A benchmark driver reads top to bottom as one story; the function size limit is for
// the product code.
#![allow(clippy::too_many_lines)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::json;

fn env<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const GROUP: &str = "bench.rulebook.dev";

fn rule(name: &str, kind: &str, admission: &str) -> String {
    format!(
        "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: {name}\nspec:\n  parent:\n    apiVersion: {GROUP}/v1\n    kind: {kind}\n  crd:\n    specSchema:\n      type: object\n      x-kubernetes-preserve-unknown-fields: true\n{admission}"
    )
}

/// Percentile `p` (0..=100) of sorted `v`.
fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[i.min(v.len() - 1)]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 50.0)
}

fn range(v: &[f64]) -> (f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

struct Round {
    p50_ms: f64,
    p99_ms: f64,
    per_second: f64,
}

/// Creates `n` objects of `kind` in `ns` from `clients` clients; every latency, in ms.
async fn round(
    client: &kube::Client,
    ns: &str,
    kind: &str,
    n: usize,
    clients: usize,
    dry_run: bool,
) -> Result<Round> {
    let gvk = GroupVersionKind::gvk(GROUP, "v1", kind);
    let ar = ApiResource::from_gvk_with_plural(&gvk, &format!("{}s", kind.to_lowercase()));
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let api = api.clone();
        let kind = kind.to_string();
        let share = n / clients + usize::from(c < n % clients);
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(share);
            for i in 0..share {
                let o: DynamicObject = serde_json::from_value(json!({
                    "apiVersion": format!("{GROUP}/v1"), "kind": kind,
                    "metadata": {"name": format!("o-{c}-{i}")},
                    "spec": {"replicas": 2},
                }))?;
                let t = Instant::now();
                let params = PostParams {
                    dry_run,
                    ..Default::default()
                };
                match api.create(&params, &o).await {
                    Ok(_) => {}
                    // Dry runs through the placeholder handler: its refusal is the answer.
                    Err(kube::Error::Api(s))
                        if dry_run && s.message.contains("denied the request") => {}
                    Err(e) => return Err(e).context(format!("create {kind} o-{c}-{i}")),
                }
                latencies.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            anyhow::Ok(latencies)
        }));
    }
    let mut all = Vec::with_capacity(n);
    for t in tasks {
        all.extend(t.await??);
    }
    let took = started.elapsed().as_secs_f64();
    all.sort_by(f64::total_cmp);
    Ok(Round {
        p50_ms: percentile(&all, 50.0),
        p99_ms: percentile(&all, 99.0),
        per_second: n as f64 / took,
    })
}

async fn wait<F, Fut>(what: &str, mut probe: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !probe().await {
        if start.elapsed() > Duration::from_secs(120) {
            bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

async fn namespace(client: &kube::Client, name: &str) -> Result<()> {
    let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let ns = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    api.create(&PostParams::default(), &ns).await?;
    Ok(())
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "admission: a benchmark; run it with `cargo bench --bench admission` (make bench-admission)"
        );
        return Ok(());
    }
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo.join("target"));
    let binary = std::env::var_os("ADMISSION_BENCH_BINARY")
        .map(PathBuf::from)
        .or_else(|| Some(target.join("release/rulebook")).filter(|p| p.exists()))
        .unwrap_or_else(|| target.join("debug/rulebook"));
    let kubeconfig = std::env::var_os("RULEBOOK_TEST_KUBECONFIG")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo.join(".cluster/kubeconfig"));
    let (n, clients, repeats) = (
        env("ADMISSION_BENCH_N", 1000usize),
        env("ADMISSION_BENCH_CLIENTS", 4usize).max(1),
        env("ADMISSION_BENCH_REPEATS", 5usize).max(1),
    );
    // Server-side dry runs instead of creates: for a build whose admission handler is the
    // placeholder, which refuses every review (its refusal then counts as the answer).
    let dry_run = env("ADMISSION_BENCH_DRY_RUN", 0u8) == 1;
    let kc = Kubeconfig::read_from(&kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    let client = kube::Client::try_from(config)?;

    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs()
        % 1_000_000;
    let (hooked, plain) = (format!("Hooked{stamp}"), format!("Plain{stamp}"));
    let dir = tempfile::tempdir()?;
    let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
    std::fs::create_dir_all(&rules)?;
    std::fs::create_dir_all(&templates)?;
    let check = "  admission:\n    validate:\n      - expr: \"parent.spec.replicas <= 3\"\n        message: \"replicas {{ parent.spec.replicas }} is more than 3\"\n";
    std::fs::write(
        rules.join("hooked.yaml"),
        rule(&format!("hooked-{stamp}"), &hooked, check),
    )?;
    std::fs::write(
        rules.join("plain.yaml"),
        rule(&format!("plain-{stamp}"), &plain, ""),
    )?;
    let secret_ns = format!("adm-bench-{stamp}");
    namespace(&client, &secret_ns).await?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let config_name = format!("rulebook-bench-{stamp}");
    let log = std::fs::File::create(repo.join("target/bench/admission-operator.log"))?;
    let _op = Killed(
        Command::new(&binary)
            .args(["run", "--install-crds", "--webhook-bind", "127.0.0.1"])
            .args(["--webhook-port", &port.to_string()])
            .args(["--webhook-url", &format!("https://127.0.0.1:{port}")])
            .args(["--webhook-secret", &format!("{secret_ns}/webhook")])
            .args(["--webhook-configuration", &config_name])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .arg("--rules")
            .arg(&rules)
            .arg("--templates")
            .arg(&templates)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {}", binary.display()))?,
    );
    // The webhook judges creates of `hooked`: a dry run of a refused object says so.
    let gvk = GroupVersionKind::gvk(GROUP, "v1", &hooked);
    let ar = ApiResource::from_gvk_with_plural(&gvk, &format!("{}s", hooked.to_lowercase()));
    let probe: Api<DynamicObject> = Api::namespaced_with(client.clone(), &secret_ns, &ar);
    let bad: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/v1"), "kind": hooked,
        "metadata": {"name": "probe"}, "spec": {"replicas": 9},
    }))?;
    wait("the webhook to judge creates", || async {
        matches!(
            probe.create(&PostParams { dry_run: true, ..Default::default() }, &bad).await,
            Err(kube::Error::Api(s)) if s.message.contains("denied the request")
        )
    })
    .await?;

    let mut results: Vec<(&str, Round)> = Vec::new();
    for r in 0..repeats {
        let order = if r % 2 == 0 {
            [&plain, &hooked]
        } else {
            [&hooked, &plain]
        };
        for kind in order {
            let ns = format!("adm-bench-{stamp}-{r}-{}", kind.to_lowercase());
            namespace(&client, &ns).await?;
            let got = round(&client, &ns, kind, n, clients, dry_run).await?;
            let label = if kind == &hooked {
                "with the webhook"
            } else {
                "without"
            };
            println!(
                "round {r} {label}: p50 {:.1} ms, p99 {:.1} ms, {:.0} creates/s",
                got.p50_ms, got.p99_ms, got.per_second
            );
            results.push((label, got));
            let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
            let _ = api.delete(&ns, &DeleteParams::default()).await;
        }
    }

    let mut md = format!(
        "| {n} creates, {clients} clients, {repeats} rounds | p50 (ms) | p99 (ms) | creates/s |\n|---|---|---|---|\n"
    );
    for label in ["without", "with the webhook"] {
        let of = |f: fn(&Round) -> f64| -> Vec<f64> {
            results
                .iter()
                .filter(|(l, _)| *l == label)
                .map(|(_, r)| f(r))
                .collect()
        };
        let cell = |v: Vec<f64>| {
            let (lo, hi) = range(&v);
            format!("{:.1} [{lo:.1}–{hi:.1}]", median(v))
        };
        md.push_str(&format!(
            "| {label} | {} | {} | {} |\n",
            cell(of(|r| r.p50_ms)),
            cell(of(|r| r.p99_ms)),
            cell(of(|r| r.per_second))
        ));
    }
    md.push_str(&format!(
        "\nbinary: {}{}\n",
        binary.display(),
        if dry_run {
            "; server-side dry runs"
        } else {
            ""
        }
    ));
    println!("\n{md}");
    std::fs::write(repo.join("target/bench/admission.md"), &md)?;
    let _ = kube::Api::<DynamicObject>::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(
                "admissionregistration.k8s.io",
                "v1",
                "ValidatingWebhookConfiguration",
            ),
            "validatingwebhookconfigurations",
        ),
    )
    .delete(&config_name, &DeleteParams::default())
    .await;
    let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let _ = api.delete(&secret_ns, &DeleteParams::default()).await;
    Ok(())
}
