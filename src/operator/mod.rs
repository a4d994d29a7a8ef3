//! `rulebook run`: the long-running operator. Wires the pieces together — the API
//! client, the HTTP endpoint, the first rule set, the reload loop, CRD installation,
//! leader election or shard membership ([`shards`]), and signals — and owns no logic of
//! its own beyond that order.

pub(crate) mod client;
mod git;
mod migrations;
mod rules;
mod shards;

pub use client::gated_client;
use rules::Rules;

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
use crate::metrics::Metrics;
use crate::reload::{ChangeWatcher, RuleSource};
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
    /// The operator-wide default `spec.rollout` (`--default-rollout`).
    pub default_rollout: Option<PathBuf>,
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
    /// Storage-migration rewrites per second at most (0: unpaced).
    pub migration_rate: u32,
    /// Share the parents among replicas by namespace hash (instead of one leader).
    pub sharding: bool,
    /// Filter shards here even when the API server could.
    pub shard_filter_client: bool,
    /// Seconds between moves of ranges for load alone.
    pub shard_rebalance_seconds: u64,
    /// The webhook server (`--webhook-url`/`--webhook-service`); `None`: off.
    pub webhook: Option<crate::webhook::run::Settings>,
    /// Rules from a git repository (`--rules-git`) instead of the directories.
    pub git: Option<crate::gitsource::GitSettings>,
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
    check_flags(&args)?;
    let identity = identity(&args);
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
    let shards = start_shards(&args, &config, &metrics, &lease_ns, &identity).await?;
    let write_gate: Arc<dyn WriteGate> = match &shards {
        Some(s) => s.gate.clone(),
        None => gate.clone(),
    };
    let client = gated_client(config.clone(), write_gate.clone(), metrics.clone())?;
    let engine = new_engine(
        &args, &config, &client, write_gate, &metrics, &lease_ns, &identity,
    )?;
    let mut webhooks = start_webhooks(&args, &config, &metrics).await?;
    // The first activation publishes the CRDs (their conversion) and the webhook
    // configurations with the CA: wait a little for the certificates to be read.
    if let Some(w) = &mut webhooks
        && tokio::time::timeout(
            Duration::from_secs(10),
            w.endpoint.wait_for(Option::is_some),
        )
        .await
        .is_err()
    {
        warn!("the webhook certificates are not read yet; webhooks are published once they are");
    }
    let ruleset_state = Arc::new(RwLock::new(RuleSetState::default()));
    let (git, mut git_commits) = git::start(args.git.as_ref(), &metrics)?;
    let leader_flag = is_leader.clone();
    let app = AppState {
        metrics: metrics.clone(),
        engine: engine.status.clone(),
        ruleset: ruleset_state.clone(),
        leader: Arc::new(move || leader_flag.load(Ordering::SeqCst)),
        sharding: shards.as_ref().map(|s| s.status.clone()),
        webhook: webhooks.as_ref().map(|w| w.health.clone()),
        git: git.clone(),
    };
    let http = serve_http(args.metrics_addr, app);

    let source = RuleSource {
        rules_dir: args.rules.clone(),
        templates_dir: args.templates.clone(),
        default_rollout: args.default_rollout.clone(),
        limits: Limits::default(),
    };
    let mut rules = Rules::new(source, metrics.clone(), ruleset_state);
    git::first_load(git.as_deref(), git_commits.as_mut(), &mut rules).await;
    if let (Some(s), Some(set)) = (&shards, &rules.serving) {
        s.rules_changed(set);
    }
    if let (Some(w), Some(set)) = (&webhooks, &rules.serving) {
        w.rules_changed(set);
    }

    let watcher = if args.watch && git.is_none() {
        Some(ChangeWatcher::new(&[&args.rules, &args.templates])?)
    } else {
        None
    };
    let mut rescan = tokio::time::interval(Duration::from_secs(args.rescan_seconds.max(1)));
    rescan.tick().await;

    let mut election = Election::start(&args, &config, &gate, &lease_ns, &identity)?;
    let mut operator = Operator {
        client,
        engine,
        metrics,
        is_leader,
        shards,
        rules,
        install_crds: args.install_crds,
        webhooks,
        policy_scope: policy_scope(&args)?,
        git,
    };
    let mut events = Events {
        watcher,
        rescan,
        leader: election.leading.take(),
        git: git_commits,
    };
    operator.serve(&args, &mut events).await?;
    operator.shutdown(&gate, election).await;
    http.abort();
    Ok(())
}

/// Refuses the flag combinations `run` cannot honour.
fn check_flags(args: &Settings) -> Result<()> {
    if (args.leader_elect || args.sharding) && args.lease_duration < 3 {
        bail!("--lease-duration must be at least 3 seconds");
    }
    if let Some(w) = &args.webhook {
        crate::webhook::run::check_validity(w).map_err(anyhow::Error::msg)?;
    }
    if args.leader_elect && args.sharding {
        bail!(
            "--sharding namespace replaces --leader-elect: replicas share the parents instead of one leading"
        );
    }
    Ok(())
}

/// This instance's identity: `--identity`, else the host name and pid.
fn identity(args: &Settings) -> String {
    args.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "rulebook".into());
        format!("{host}-{}", std::process::id())
    })
}

/// Starts the webhook server when `--webhook-url` or `--webhook-service` asks for it.
async fn start_webhooks(
    args: &Settings,
    config: &Config,
    metrics: &Metrics,
) -> Result<Option<crate::webhook::run::Webhooks>> {
    let Some(w) = &args.webhook else {
        return Ok(None);
    };
    let scope = crate::webhook::configs::Scope {
        name: w.configuration.clone(),
        own_namespace: w.own_namespace.clone(),
        namespace: args.namespace.clone(),
        selector: args.selector.clone(),
    };
    if let Some(sel) = &scope.selector {
        crate::webhook::configs::label_selector(sel)?;
    }
    if scope.judges_own_namespace() {
        tracing::warn!(
            namespace = ?scope.namespace,
            "--namespace is Rulebook's own namespace: the webhooks of rules on kinds they define (spec.crd) judge it; rules on other kinds keep it excluded, so their expr: checks and defaults are off there (a webhook that does not answer must not lock Rulebook's own objects out)"
        );
    }
    if let Some(ns) = scope.excluded_namespace() {
        tracing::warn!(
            namespace = ns,
            "--namespace names a namespace Rulebook's webhooks never judge: every expr: check and default is off there (cel: policies still apply)"
        );
    }
    Ok(Some(
        crate::webhook::run::Webhooks::start(w, config, scope, metrics.webhook.clone()).await?,
    ))
}

/// The admission policies' scope: the installation (`--lease-name`), `--namespace` and
/// `--selector`.
fn policy_scope(args: &Settings) -> Result<crate::rules::policy::Scope> {
    let selector = match &args.selector {
        Some(sel) => Some(crate::webhook::configs::label_selector(sel)?),
        None => None,
    };
    Ok(crate::rules::policy::Scope {
        installation: args.lease_name.clone(),
        namespace: args.namespace.clone(),
        selector,
    })
}

/// Joins the shard group when `--sharding` asks for it.
async fn start_shards(
    args: &Settings,
    config: &Config,
    metrics: &Arc<Metrics>,
    lease_ns: &str,
    identity: &str,
) -> Result<Option<shards::Shards>> {
    if !args.sharding {
        // `rulebook_shard_mode{mode="off"}`: the alerts tell unsharded replicas by it.
        for (m, on) in [("off", 1), ("server", 0), ("client", 0)] {
            metrics
                .shard_mode
                .get_or_create(&crate::metrics::ModeLabel { mode: m.into() })
                .set(on);
        }
        return Ok(None);
    }
    let shards = shards::Shards::start(
        config,
        metrics.clone(),
        shards::ShardOptions {
            namespace: lease_ns,
            group: &args.lease_name,
            identity,
            duration: Duration::from_secs(args.lease_duration),
            rebalance: Duration::from_secs(args.shard_rebalance_seconds.max(1)),
            client_only: args.shard_filter_client,
        },
    )
    .await?;
    Ok(Some(shards))
}

/// The engine on the gated `client`; sharded, its storage migrations run under a Lease
/// of their own each (there is no leader).
fn new_engine(
    args: &Settings,
    config: &Config,
    client: &Client,
    write_gate: Arc<dyn WriteGate>,
    metrics: &Arc<Metrics>,
    lease_ns: &str,
    identity: &str,
) -> Result<Engine> {
    let mut engine = Engine::new(
        client.clone(),
        engine_config(args, identity),
        metrics.clone(),
        write_gate.clone(),
    );
    // Rules with `spec.serviceAccount` impersonate their account, in this namespace.
    engine.set_identities(crate::engine::Identities::new(
        lease_ns.to_string(),
        Some(Arc::new(client::Impersonating::new(
            config,
            write_gate,
            metrics.clone(),
        ))),
    ));
    if args.sharding {
        engine.lease_migrations(Arc::new(migrations::LeasedMigrations::new(
            config,
            metrics.clone(),
            lease_ns,
            identity,
            Duration::from_secs(args.lease_duration),
        )?));
    }
    Ok(engine)
}

/// The engine's settings from the command line.
fn engine_config(args: &Settings, identity: &str) -> EngineConfig {
    EngineConfig {
        concurrency: args.concurrency.max(1),
        namespace: args.namespace.clone(),
        parent_selector: args.selector.clone(),
        reporter: "rulebook".into(),
        instance: Some(identity.to_string()),
        check_permissions: args.check_permissions,
        cache: crate::cache::admission::CacheLimits {
            per_namespace: args.cache_namespace_mib.saturating_mul(1 << 20),
            total: args.cache_total_mib.saturating_mul(1 << 20),
        },
        inputs_in_flight: args.inputs_in_flight_mib.saturating_mul(1 << 20),
        shard: None,
        migration_rate: std::num::NonZeroU32::new(args.migration_rate),
        rollout_namespace: args
            .lease_namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
    }
}

/// Serves /metrics, /healthz, /readyz and /status in a task of its own.
fn serve_http(addr: SocketAddr, app: AppState) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if let Err(e) = http::serve(addr, app).await {
            error!(error = %e, "HTTP endpoint failed");
        }
    })
}

/// Leader election (`--leader-elect`): the task that holds the lease, and how to reach it.
struct Election {
    /// Tells the election task to give the lease up.
    stop: tokio::sync::watch::Sender<bool>,
    /// Whether this instance leads; `None` without election.
    leading: Option<tokio::sync::watch::Receiver<bool>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Election {
    fn start(
        args: &Settings,
        config: &Config,
        gate: &Arc<LeaseGate>,
        lease_ns: &str,
        identity: &str,
    ) -> Result<Self> {
        // Leadership: without election this process always leads.
        let (stop, election_stopped) = tokio::sync::watch::channel(false);
        if !args.leader_elect {
            return Ok(Self {
                stop,
                leading: None,
                task: None,
            });
        }
        let ns = lease_ns.to_string();
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
            identity,
            Duration::from_secs(args.lease_duration),
        );
        info!(lease = %args.lease_name, namespace = %ns, %identity, "leader election on; waiting for the lease");
        Ok(Self {
            stop,
            leading: Some(rx),
            task: Some(tokio::spawn(election.run(tx, election_stopped))),
        })
    }
}

/// What wakes the operator's loop besides signals and shard changes.
struct Events {
    /// File events in the rules and templates directories (`--watch`).
    watcher: Option<ChangeWatcher>,
    /// The periodic re-scan that backs up missed file events.
    rescan: tokio::time::Interval,
    /// Leadership changes (`--leader-elect`).
    leader: Option<tokio::sync::watch::Receiver<bool>>,
    /// New commits of the git source (`--rules-git`).
    git: Option<tokio::sync::mpsc::Receiver<crate::gitsource::Checkout>>,
}

/// The running operator: the engine, the rule set it serves, and whether (or for which
/// share) it may write.
struct Operator {
    client: Client,
    engine: Engine,
    metrics: Arc<Metrics>,
    is_leader: Arc<AtomicBool>,
    shards: Option<shards::Shards>,
    rules: Rules,
    install_crds: bool,
    /// The webhook server, when on.
    webhooks: Option<crate::webhook::run::Webhooks>,
    /// What the admission policies of `cel:` rules reach, and whose they are.
    policy_scope: crate::rules::policy::Scope,
    /// The git source (`--rules-git`), told which commits went live.
    git: Option<Arc<crate::gitsource::GitSource>>,
}

impl Operator {
    /// Runs the rule set and follows rule, leadership and shard changes until a signal.
    async fn serve(&mut self, args: &Settings, events: &mut Events) -> Result<()> {
        let mut sigterm =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        if self.is_leader.load(Ordering::SeqCst)
            && let Some(set) = &self.rules.serving
        {
            let publish = Publish {
                install_crds: self.install_crds,
                share: None,
                webhooks: self.webhooks.as_ref(),
                policies: &self.policy_scope,
            };
            activate(&self.client, &mut self.engine, set, &publish).await;
        }
        loop {
            let changed = tokio::select! {
                Some(()) = async { match events.watcher.as_mut() { Some(w) => w.changes.recv().await, None => std::future::pending().await } } => {
                    // Watch afresh: a flipped symlink leaves the old watches on the old target.
                    match ChangeWatcher::new(&[&args.rules, &args.templates]) {
                        Ok(w) => events.watcher = Some(w),
                        Err(e) => warn!(error = %e, "cannot re-establish file watches; relying on the periodic re-scan"),
                    }
                    self.rules.reload()
                }
                _ = events.rescan.tick(), if args.watch && self.git.is_none() => self.rules.reload(),
                Some(c) = async { match events.git.as_mut() { Some(rx) => rx.recv().await, None => std::future::pending().await } } => {
                    match &self.git {
                        Some(g) => git::load_commit(g, &c, &mut self.rules),
                        None => false,
                    }
                }
                Ok(()) = async { match events.leader.as_mut() { Some(rx) => rx.changed().await, None => std::future::pending().await } } => {
                    let leading = events.leader.as_ref().is_some_and(|rx| *rx.borrow());
                    self.leadership_changed(leading).await
                }
                Ok(()) = async { match self.shards.as_mut() { Some(s) => s.shares.changed().await, None => std::future::pending().await } } => {
                    self.shares_changed().await;
                    false
                }
                Ok(()) = async { match self.webhooks.as_mut() { Some(w) => w.endpoint.changed().await, None => std::future::pending().await } } => {
                    self.endpoint_changed().await;
                    false
                }
                _ = tokio::signal::ctrl_c() => break,
                _ = sigterm.recv() => break,
            };
            if changed {
                self.rules_changed().await;
            }
        }
        Ok(())
    }

    /// Follows the lease: true when this instance just became the leader.
    async fn leadership_changed(&mut self, leading: bool) -> bool {
        self.is_leader.store(leading, Ordering::SeqCst);
        self.metrics.leader.set(i64::from(leading));
        if leading {
            info!("became the leader");
            true
        } else {
            warn!("lost the lease: stopping all writes");
            self.engine.shutdown().await;
            false
        }
    }

    /// Follows this replica's share of the namespaces.
    async fn shares_changed(&mut self) {
        if let Some(s) = &self.shards {
            if let shards::Switched::To(share) = s
                .switch(&mut self.engine, self.rules.serving.as_ref())
                .await
            {
                let holds = !share.is_empty();
                self.is_leader.store(holds, Ordering::SeqCst);
                self.metrics.leader.set(i64::from(holds));
                if holds && let Some(set) = &self.rules.serving {
                    let publish = Publish {
                        install_crds: self.install_crds,
                        share: Some(&share),
                        webhooks: self.webhooks.as_ref(),
                        policies: &self.policy_scope,
                    };
                    activate(&self.client, &mut self.engine, set, &publish).await;
                }
            }
            if let Some(set) = &self.rules.serving {
                s.refresh(&self.client, set).await;
            }
            s.acknowledge();
        }
    }

    /// A new rule set serves, or this instance just became the leader: run it.
    async fn rules_changed(&mut self) {
        if let (Some(s), Some(set)) = (&self.shards, &self.rules.serving) {
            s.rules_changed(set);
        }
        if let (Some(w), Some(set)) = (&self.webhooks, &self.rules.serving) {
            w.rules_changed(set);
        }
        if self.is_leader.load(Ordering::SeqCst)
            && let Some(set) = &self.rules.serving
        {
            let share = self.shards.as_ref().map(|s| s.gate.claims());
            let publish = Publish {
                install_crds: self.install_crds,
                share: share.as_ref(),
                webhooks: self.webhooks.as_ref(),
                policies: &self.policy_scope,
            };
            activate(&self.client, &mut self.engine, set, &publish).await;
            // A rule with cluster-scoped parents may have come or gone (or its CRD was
            // just installed).
            if let Some(s) = &self.shards {
                s.refresh(&self.client, set).await;
            }
        }
    }

    /// The webhooks' CA bundle changed (or was first read): the writer puts it into the
    /// webhook configurations and the CRDs.
    async fn endpoint_changed(&mut self) {
        if !self.is_leader.load(Ordering::SeqCst) {
            return;
        }
        let Some(set) = &self.rules.serving else {
            return;
        };
        let share = self.shards.as_ref().map(|s| s.gate.claims());
        let publish = Publish {
            install_crds: self.install_crds,
            share: share.as_ref(),
            webhooks: self.webhooks.as_ref(),
            policies: &self.policy_scope,
        };
        publish_objects(&self.client, &self.engine, set, &publish).await;
        if self.install_crds {
            // A CRD that converts is applied only once the webhook has its certificate.
            let mine = |name: &str| share.as_ref().is_none_or(|r| r.holds_namespace(name));
            self.engine.migrate(set, &mine);
        }
    }

    /// Finishes in-flight reconciles, closes the gate, then gives up the share or the lease.
    async fn shutdown(mut self, gate: &LeaseGate, election: Election) {
        info!("shutting down: finishing in-flight reconciles");
        self.engine.shutdown().await;
        self.engine.stop_migrations().await;
        self.is_leader.store(false, Ordering::SeqCst);
        gate.close();
        if let Some(s) = self.shards.take() {
            s.leave().await;
        }
        // Only now, with no write left in flight, give the lease to a standby.
        let _ = election.stop.send(true);
        if let Some(task) = election.task
            && tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .is_err()
        {
            warn!("could not release the lease in time; a standby takes over when it expires");
        }
    }
}

/// What the writer publishes besides reconciling: the CRDs (`--install-crds`) and the
/// webhook configurations, with the webhooks' current CA bundle.
struct Publish<'a> {
    install_crds: bool,
    /// Sharded: this replica's share (it writes the objects whose name hashes into it).
    share: Option<&'a crate::shard::Ranges>,
    webhooks: Option<&'a crate::webhook::run::Webhooks>,
    /// The admission policies' scope (`src/policies.rs`).
    policies: &'a crate::rules::policy::Scope,
}

/// Publishes the CRDs and webhook configurations (see [`Publish`]), then makes the
/// engine run `set`.
async fn activate(client: &Client, engine: &mut Engine, set: &RuleSet, publish: &Publish<'_>) {
    publish_objects(client, engine, set, publish).await;
    if publish.install_crds {
        // Objects stored in a version the CRD no longer stores in are rewritten.
        let mine = |name: &str| publish.share.is_none_or(|r| r.holds_namespace(name));
        engine.migrate(set, &mine);
    }
    engine.apply(set).await;
}

fn converts(set: &RuleSet, rule: &str) -> bool {
    set.rules
        .get(rule)
        .is_some_and(|r| crate::rules::crd::needs_conversion_webhook(&r.rule))
}

/// Applies the CRDs when asked and the webhook configurations when the server is on,
/// and reports each rule's problems with them on `/status`.
async fn publish_objects(client: &Client, engine: &Engine, set: &RuleSet, publish: &Publish<'_>) {
    let mine = |name: &str| publish.share.is_none_or(|r| r.holds_namespace(name));
    // The CA bundle the CRDs' conversion and the webhook configurations must carry.
    let endpoint = publish.webhooks.and_then(|w| w.current());
    let mut problems = Vec::new();
    if publish.install_crds {
        let client_config = endpoint
            .as_ref()
            .map(|e| move |path: &str| e.client_config(path));
        let conversion = client_config
            .as_ref()
            .map(|c| c as crate::crds::ClientConfig<'_>);
        problems.extend(crate::crds::install_with(client, set, &mine, conversion).await);
    }
    problems.extend(crate::policies::publish(client, set, publish.policies, &mine).await);
    match (publish.webhooks, &endpoint) {
        (Some(w), Some(e)) => {
            problems.extend(crate::webhook::apply::publish(client, set, e, &w.scope, &mine).await);
        }
        // The certificates are not read yet: published when they are (`endpoint_changed`).
        (Some(_), None) => {}
        // (A rule that converts is refused by `install_with` when CRDs are installed.)
        (None, _) => problems.extend(
            crate::webhook::unserved(set)
                .into_iter()
                .filter(|(r, _)| !(publish.install_crds && converts(set, r))),
        ),
    }
    for rule in set.rules.keys() {
        let mine: Vec<&str> = problems
            .iter()
            .filter(|(r, _)| r == rule)
            .map(|(_, m)| m.as_str())
            .collect();
        engine
            .status
            .set_problem(rule, (!mine.is_empty()).then(|| mine.join("; ")));
    }
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
