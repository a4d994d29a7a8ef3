//! `rulebook run`: the long-running operator. Wires the pieces together — the API
//! client, the HTTP endpoint, the first rule set, the reload loop, CRD installation,
//! leader election or shard membership ([`shards`]), and signals — and owns no logic of
//! its own beyond that order.

pub(crate) mod client;
mod shards;

pub use client::gated_client;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use axum::http::header as http_header;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use tracing::{error, info, warn};

use crate::engine::{Engine, EngineConfig};
use crate::http::{self, AppState, RuleSetState};
use crate::metrics::{Metrics, ReloadLabel};
use crate::reload::{ChangeWatcher, Reload, RuleSource};
use crate::render::Limits;
use crate::render::RuleSet;
use crate::write::gate::{LeaseGate, WriteGate};

/// How `rulebook run` runs: what its command line says (see `cli::RunArgs`).
#[derive(Debug, Clone)]
pub struct Settings {
    /// The rules directory.
    pub rules: PathBuf,
    /// The templates directory.
    pub templates: PathBuf,
    /// Kubeconfig file; default: in-cluster config, then $KUBECONFIG, then ~/.kube/config.
    pub kubeconfig: Option<PathBuf>,
    /// Concurrent reconciles per rule.
    pub concurrency: u16,
    /// Watch parents in this namespace only (default: all namespaces).
    pub namespace: Option<String>,
    /// Label selector on parents, e.g. `shard=a` (to run several instances side by side).
    pub selector: Option<String>,
    /// Address of /metrics, /healthz, /readyz and /status.
    pub metrics_addr: SocketAddr,
    /// Reload rules and templates when they change on disk.
    pub watch: bool,
    /// Seconds between full re-scans of the directories (backs up missed file events).
    pub rescan_seconds: u64,
    /// Apply the CRDs defined in rules at start and on every rule change.
    pub install_crds: bool,
    /// Only the holder of a Lease reconciles.
    pub leader_elect: bool,
    pub lease_name: String,
    /// Namespace of the Lease (default: the pod's namespace, else `default`).
    pub lease_namespace: Option<String>,
    /// Seconds a lease stays valid without renewal.
    pub lease_duration: u64,
    /// This instance's identity (default: the pod name, else the host name and pid).
    pub identity: Option<String>,
    /// Check each rule's permissions (SelfSubjectAccessReview) before starting it.
    pub check_permissions: bool,
    /// MiB of child content cached per namespace; children beyond it are read on demand.
    pub cache_namespace_mib: usize,
    /// MiB of child content cached in all.
    pub cache_total_mib: usize,
    /// MiB of reconcile inputs held at once by all reconciles.
    pub inputs_in_flight_mib: usize,
    /// Share the parents among replicas by namespace hash (instead of one leader).
    pub sharding: bool,
    /// Filter shards here even when the API server could.
    pub shard_filter_client: bool,
    /// Seconds between moves of ranges for load alone.
    pub shard_rebalance_seconds: u64,
}

/// The client configuration from an explicit kubeconfig, or the usual inference. Its
/// user agent names this instance (`rulebook/VERSION (IDENTITY)`), so the API server's
/// audit log tells replicas apart.
pub async fn client_config(kubeconfig: Option<&PathBuf>, identity: &str) -> Result<Config> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?
        }
        None => Config::infer()
            .await
            .context("no Kubernetes configuration found")?,
    };
    config.read_timeout = Some(Duration::from_secs(300));
    let agent = format!(
        "rulebook/{} ({})",
        env!("CARGO_PKG_VERSION"),
        identity.escape_default()
    );
    let agent = http_header::HeaderValue::from_str(&agent).unwrap_or_else(|_| {
        http_header::HeaderValue::from_static(concat!("rulebook/", env!("CARGO_PKG_VERSION")))
    });
    config.headers.push((http_header::USER_AGENT, agent));
    Ok(config)
}

/// The log filter: `RUST_LOG` (default `info`), with kube-client's body logging always off.
/// kube-client logs a whole response body at WARN when it cannot decode it — a LIST page
/// holds every tenant's objects, Secret values among them — an API error's whole status at
/// DEBUG, and other bodies at TRACE; none of it may reach the log, whatever `RUST_LOG`
/// asks for. A directive in `RUST_LOG` cannot undo it: `RUST_LOG`'s filter and this one
/// must both let an event through, so a span directive (`[rule]=trace`), which an
/// `EnvFilter` weighs before its target directives, turns on nothing of kube-client's
/// below ERROR either.
pub fn log_filter<S>(rust_log: Option<&str>) -> impl tracing_subscriber::layer::Filter<S> + use<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::EnvFilter;
    use tracing_subscriber::filter::{FilterExt, filter_fn};
    let filter = rust_log
        .and_then(|v| EnvFilter::try_new(v).ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    // It hints no level of its own (`TRACE`), so `RUST_LOG`'s hint stays the combined
    // filter's and callsites above that level stay disabled for free.
    let no_bodies = filter_fn(|meta| {
        !(meta.target().starts_with("kube_client::client") && *meta.level() > tracing::Level::ERROR)
    })
    .with_max_level_hint(tracing::level_filters::LevelFilter::TRACE);
    filter.and(no_bodies)
}

pub async fn run(args: Settings) -> Result<()> {
    if (args.leader_elect || args.sharding) && args.lease_duration < 3 {
        bail!("--lease-duration must be at least 3 seconds");
    }
    if args.leader_elect && args.sharding {
        bail!(
            "--sharding namespace replaces --leader-elect: replicas share the parents instead of one leading"
        );
    }
    let identity = args.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "rulebook".into());
        format!("{host}-{}", std::process::id())
    });
    let config = client_config(args.kubeconfig.as_ref(), &identity).await?;
    let metrics = Arc::new(Metrics::new());
    let single = !args.leader_elect && !args.sharding;
    let is_leader = Arc::new(AtomicBool::new(single));
    metrics.leader.set(i64::from(single));
    let lease_ns = args
        .lease_namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let gate = Arc::new(if single {
        LeaseGate::open()
    } else {
        LeaseGate::leased()
    });
    let mut shards = if args.sharding {
        Some(
            shards::Shards::start(
                &config,
                metrics.clone(),
                shards::ShardOptions {
                    namespace: &lease_ns,
                    group: &args.lease_name,
                    identity: &identity,
                    duration: Duration::from_secs(args.lease_duration),
                    rebalance: Duration::from_secs(args.shard_rebalance_seconds.max(1)),
                    client_only: args.shard_filter_client,
                },
            )
            .await?,
        )
    } else {
        None
    };
    let write_gate: Arc<dyn WriteGate> = match &shards {
        Some(s) => s.gate.clone(),
        None => gate.clone(),
    };
    let client = gated_client(config.clone(), write_gate.clone(), metrics.clone())?;
    let engine_config = EngineConfig {
        concurrency: args.concurrency.max(1),
        namespace: args.namespace.clone(),
        parent_selector: args.selector.clone(),
        reporter: "rulebook".into(),
        instance: Some(identity.clone()),
        check_permissions: args.check_permissions,
        cache: crate::cache::admission::CacheLimits {
            per_namespace: args.cache_namespace_mib.saturating_mul(1 << 20),
            total: args.cache_total_mib.saturating_mul(1 << 20),
        },
        inputs_in_flight: args.inputs_in_flight_mib.saturating_mul(1 << 20),
        shard: None,
    };
    let mut engine = Engine::new(client.clone(), engine_config, metrics.clone(), write_gate);
    let ruleset_state = Arc::new(RwLock::new(RuleSetState::default()));
    let leader_flag = is_leader.clone();
    let app = AppState {
        metrics: metrics.clone(),
        engine: engine.status.clone(),
        ruleset: ruleset_state.clone(),
        leader: Arc::new(move || leader_flag.load(Ordering::SeqCst)),
        sharding: shards.as_ref().map(|s| s.status.clone()),
    };
    let addr = args.metrics_addr;
    let http = tokio::spawn(async move {
        if let Err(e) = http::serve(addr, app).await {
            error!(error = %e, "HTTP endpoint failed");
        }
    });

    let source = RuleSource {
        rules_dir: args.rules.clone(),
        templates_dir: args.templates.clone(),
        limits: Limits::default(),
    };
    let mut serving: Option<RuleSet> = None;
    let mut last_seen: Option<String> = None;
    let reload = |serving: &mut Option<RuleSet>, last_seen: &mut Option<String>| -> bool {
        match source.load(last_seen.as_deref()) {
            Reload::Unchanged => {
                metrics
                    .reloads
                    .get_or_create(&ReloadLabel {
                        result: "unchanged".into(),
                    })
                    .inc();
                false
            }
            Reload::Valid(set) => {
                info!(rules = set.rules.len(), fingerprint = %set.fingerprint, "rule set loaded");
                *last_seen = Some(set.fingerprint.clone());
                metrics.ruleset_valid.set(1);
                metrics
                    .reloads
                    .get_or_create(&ReloadLabel {
                        result: "applied".into(),
                    })
                    .inc();
                if let Ok(mut s) = ruleset_state.write() {
                    s.loaded = true;
                    s.valid = true;
                    s.serving = Some(set.fingerprint.clone());
                    s.errors.clear();
                }
                *serving = Some(set);
                true
            }
            Reload::Invalid {
                diagnostics: diags,
                fingerprint,
            } => {
                *last_seen = Some(fingerprint);
                metrics.ruleset_valid.set(0);
                metrics
                    .reloads
                    .get_or_create(&ReloadLabel {
                        result: "invalid".into(),
                    })
                    .inc();
                for d in &diags.0 {
                    error!("{d}");
                }
                warn!(
                    errors = diags.0.len(),
                    "the rules on disk are invalid; {}",
                    if serving.is_some() {
                        "the last good rule set keeps serving"
                    } else {
                        "waiting for a valid rule set"
                    }
                );
                if let Ok(mut s) = ruleset_state.write() {
                    s.valid = false;
                    s.errors = diags.0.iter().map(ToString::to_string).collect();
                }
                false
            }
        }
    };
    reload(&mut serving, &mut last_seen);
    if let (Some(s), Some(set)) = (&shards, &serving) {
        s.rules_changed(set);
    }

    let mut watcher = if args.watch {
        Some(ChangeWatcher::new(&[&args.rules, &args.templates])?)
    } else {
        None
    };
    let mut rescan = tokio::time::interval(Duration::from_secs(args.rescan_seconds.max(1)));
    rescan.tick().await;

    // Leadership: without election this process always leads.
    let (stop_election, election_stopped) = tokio::sync::watch::channel(false);
    let (mut leader_rx, election) = if args.leader_elect {
        let ns = lease_ns.clone();
        let (tx, rx) = tokio::sync::watch::channel(false);
        // The lease is renewed through a client of its own: ungated, and with a read
        // timeout shorter than a renewal period, so a hung request cannot outlive it.
        let mut lease_config = config.clone();
        lease_config.read_timeout = Some(Duration::from_secs(args.lease_duration.max(3) / 3));
        let election = crate::leader::LeaderElection::new(
            Client::try_from(lease_config)?,
            gate.clone(),
            &ns,
            &args.lease_name,
            &identity,
            Duration::from_secs(args.lease_duration),
        );
        info!(lease = %args.lease_name, namespace = %ns, %identity, "leader election on; waiting for the lease");
        (
            Some(rx),
            Some(tokio::spawn(election.run(tx, election_stopped))),
        )
    } else {
        (None, None)
    };

    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    if is_leader.load(Ordering::SeqCst)
        && let Some(set) = &serving
    {
        activate(&client, &mut engine, set, args.install_crds, None).await;
    }
    loop {
        let changed = tokio::select! {
            Some(()) = async { match watcher.as_mut() { Some(w) => w.changes.recv().await, None => std::future::pending().await } } => {
                // Watch afresh: a flipped symlink leaves the old watches on the old target.
                match ChangeWatcher::new(&[&args.rules, &args.templates]) {
                    Ok(w) => watcher = Some(w),
                    Err(e) => warn!(error = %e, "cannot re-establish file watches; relying on the periodic re-scan"),
                }
                reload(&mut serving, &mut last_seen)
            }
            _ = rescan.tick(), if args.watch => reload(&mut serving, &mut last_seen),
            Ok(()) = async { match leader_rx.as_mut() { Some(rx) => rx.changed().await, None => std::future::pending().await } } => {
                let leading = leader_rx.as_ref().is_some_and(|rx| *rx.borrow());
                is_leader.store(leading, Ordering::SeqCst);
                metrics.leader.set(i64::from(leading));
                if leading {
                    info!("became the leader");
                    true
                } else {
                    warn!("lost the lease: stopping all writes");
                    engine.shutdown().await;
                    false
                }
            }
            Ok(()) = async { match shards.as_mut() { Some(s) => s.shares.changed().await, None => std::future::pending().await } } => {
                if let Some(s) = &shards {
                    if let shards::Switched::To(share) = s.switch(&mut engine, serving.as_ref()).await {
                        let holds = !share.is_empty();
                        is_leader.store(holds, Ordering::SeqCst);
                        metrics.leader.set(i64::from(holds));
                        if holds && let Some(set) = &serving {
                            activate(&client, &mut engine, set, args.install_crds, Some(&share)).await;
                        }
                    }
                    if let Some(set) = &serving {
                        s.refresh(&client, set).await;
                    }
                    s.acknowledge();
                }
                false
            }
            _ = tokio::signal::ctrl_c() => break,
            _ = sigterm.recv() => break,
        };
        if changed && let (Some(s), Some(set)) = (&shards, &serving) {
            s.rules_changed(set);
        }
        if changed
            && is_leader.load(Ordering::SeqCst)
            && let Some(set) = &serving
        {
            let share = shards.as_ref().map(|s| s.gate.claims());
            activate(&client, &mut engine, set, args.install_crds, share.as_ref()).await;
            // A rule with cluster-scoped parents may have come or gone (or its CRD was
            // just installed).
            if let Some(s) = &shards {
                s.refresh(&client, set).await;
            }
        }
    }

    info!("shutting down: finishing in-flight reconciles");
    engine.shutdown().await;
    is_leader.store(false, Ordering::SeqCst);
    gate.close();
    if let Some(s) = shards.take() {
        s.leave().await;
    }
    // Only now, with no write left in flight, give the lease to a standby.
    let _ = stop_election.send(true);
    if let Some(task) = election
        && tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .is_err()
    {
        warn!("could not release the lease in time; a standby takes over when it expires");
    }
    http.abort();
    Ok(())
}

/// Installs CRDs when asked (sharded: those whose name hashes into `share`), then makes
/// the engine run `set`.
async fn activate(
    client: &Client,
    engine: &mut Engine,
    set: &RuleSet,
    install_crds: bool,
    share: Option<&crate::shard::Ranges>,
) {
    if install_crds {
        let mine = |crd: &str| share.is_none_or(|r| r.holds_namespace(crd));
        let problems = crate::crds::install(client, set, &mine).await;
        for rule in set.rules.keys() {
            let problem = problems
                .iter()
                .find(|(r, _)| r == rule)
                .map(|(_, m)| m.clone());
            engine.status.set_problem(rule, problem);
        }
    }
    engine.apply(set).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::Mutex;
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if let Ok(mut v) = self.0.lock() {
                v.extend_from_slice(buf);
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// kube-client's body logging stays off whatever RUST_LOG says.
    #[test]
    fn response_bodies_never_reach_the_log() {
        for rust_log in [
            None,
            Some("info"),
            Some("trace"),
            Some("info,kube=trace,kube_client=trace"),
            // Span directives, which an EnvFilter weighs before target directives.
            Some("[rule]=trace"),
            Some("info,[{rule=app}]=trace"),
        ] {
            let out = Captured::default();
            let writer = out.clone();
            let subscriber = tracing_subscriber::registry().with(
                tracing_subscriber::fmt::layer()
                    .with_writer(move || writer.clone())
                    .with_filter(log_filter(rust_log)),
            );
            tracing::subscriber::with_default(subscriber, || {
                let span = tracing::info_span!("rule", rule = "app");
                let _inside = span.enter();
                tracing::warn!(target: "kube_client::client", "BODY-OF-A-LIST tenant-password");
                tracing::debug!(target: "kube_client::client", "Unsuccessful: BODY-OF-A-STATUS");
                tracing::trace!(target: "kube_client::client", "Status from BODY-OF-A-STATUS");
                tracing::error!(target: "rulebook", "an error of ours");
            });
            let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
            assert!(!text.contains("BODY-OF"), "{rust_log:?}: {text}");
            assert!(text.contains("an error of ours"), "{rust_log:?}: {text}");
        }
    }
}
