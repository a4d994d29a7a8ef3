//! `run --sharding namespace`: the wiring between the membership (which hands this
//! replica its share of the namespace hash space) and the engine (which runs the rules
//! over that share). The order of a change is the safety argument: the write gate
//! shrinks first, then every controller stops (in-flight reconciles finish or are
//! refused), then the caches start again with the new share, and only then is the
//! generation acknowledged, which is what lets the coordinator give a released range
//! to another replica.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use kube::Client;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::engine::{Engine, resolve_kind};
use crate::metrics::{Metrics, ModeLabel};
use crate::render::RuleSet;
use crate::shard::gate::ShardGate;
use crate::shard::members::{Membership, ParentKinds, ShardStatus, Share};
use crate::shard::watch::{SelectorLayer, Sharding, server_filters};
use crate::shard::{Ranges, fnv1a};

/// Where the members meet and how they behave (from the command line).
pub struct ShardOptions<'a> {
    /// The namespace of the member Leases.
    pub namespace: &'a str,
    /// The group's name (`--lease-name`).
    pub group: &'a str,
    pub identity: &'a str,
    pub duration: Duration,
    /// Load alone moves ranges at most this often.
    pub rebalance: Duration,
    /// Filter here even when the API server could.
    pub client_only: bool,
}

/// What [`Shards::switch`] did.
pub enum Switched {
    /// The share is the one running: only the acknowledgement is due.
    Unchanged,
    /// The engine was stopped and set to run this share (nothing, when empty).
    To(Ranges),
}

/// A sharded replica's side of the membership.
pub struct Shards {
    pub gate: Arc<ShardGate>,
    pub shares: watch::Receiver<Share>,
    applied: watch::Sender<u64>,
    rules: watch::Sender<ParentKinds>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    config: kube::Config,
    metrics: Arc<Metrics>,
    server_side: bool,
    /// The member Leases' namespace, where the rollout objects are too.
    namespace: String,
    /// The generation [`Shards::switch`] switched to, for [`Shards::acknowledge`].
    pending: std::sync::Mutex<u64>,
    pub status: Arc<std::sync::RwLock<ShardStatus>>,
}

impl Shards {
    /// Detects whether the API server filters by shard itself and joins the group.
    pub async fn start(
        config: &kube::Config,
        metrics: Arc<Metrics>,
        o: ShardOptions<'_>,
    ) -> Result<Shards> {
        let ShardOptions {
            namespace,
            group,
            identity,
            duration,
            rebalance,
            client_only,
        } = o;
        let gate = Arc::new(ShardGate::default());
        // The membership talks through a client of its own: ungated, with a read
        // timeout shorter than a renewal period.
        let mut lease_config = config.clone();
        lease_config.read_timeout = Some(duration / 3);
        let plain = Client::try_from(lease_config)?;
        let server_side = match server_filters(&plain, namespace).await {
            Ok(yes) => yes && !client_only,
            Err(e) => {
                warn!(error = %e, "cannot tell whether the API server filters shards; filtering here");
                false
            }
        };
        let mode = if server_side { "server" } else { "client" };
        info!(
            mode,
            "sharding by namespace: {}",
            if server_side {
                "the API server filters the watches (ShardedListAndWatch)"
            } else {
                "the API server lacks ShardedListAndWatch; every replica filters the watches itself"
            }
        );
        for m in ["server", "client", "off"] {
            metrics
                .shard_mode
                .get_or_create(&ModeLabel { mode: m.into() })
                .set(i64::from(m == mode));
        }
        let status = Arc::new(std::sync::RwLock::new(ShardStatus {
            mode: mode.into(),
            ..Default::default()
        }));
        let (shares_tx, shares) = watch::channel(Share::default());
        let (applied, applied_rx) = watch::channel(0u64);
        let (rules, rules_rx) = watch::channel(ParentKinds::default());
        let (stop, stop_rx) = watch::channel(false);
        let membership = Membership::new(
            plain,
            gate.clone(),
            namespace,
            group,
            identity,
            duration,
            rebalance,
        )
        .counting_parents_with(Arc::new(|client, api_version, kind| {
            Box::pin(async move {
                resolve_kind(&client, "parent", &api_version, &kind)
                    .await
                    .ok()
            })
        }));
        let task =
            tokio::spawn(membership.run(shares_tx, applied_rx, rules_rx, status.clone(), stop_rx));
        Ok(Shards {
            gate,
            shares,
            applied,
            rules,
            stop,
            task,
            config: config.clone(),
            metrics,
            server_side,
            namespace: namespace.to_string(),
            pending: std::sync::Mutex::new(0),
            status,
        })
    }

    /// Tells the group which rule set this replica runs (a rolling update compares them).
    pub fn rules_changed(&self, set: &RuleSet) {
        let kinds = ParentKinds {
            fingerprint: set.fingerprint.clone(),
            parents: set
                .rules
                .values()
                .map(|r| {
                    let p = &r.rule.spec.parent;
                    (p.api_version.value.clone(), p.kind.value.clone())
                })
                .collect(),
        };
        self.rules.send_if_modified(|k| {
            let changed = *k != kinds;
            *k = kinds;
            changed
        });
    }

    /// Switches the engine to this replica's current share; the caller starts the rules
    /// (when the share is not empty) and then calls [`Shards::acknowledge`].
    pub async fn switch(&self, engine: &mut Engine, set: Option<&RuleSet>) -> Switched {
        // The fence epoch before the share: a fence marks the share first and bumps the
        // epoch second, so a share read before a fence never passes `set_claims_if`.
        let epoch = self.gate.epoch();
        let share = self.shares.borrow().clone();
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = share.generation;
        // A new generation that leaves this replica's share as it was: nothing to do
        // but acknowledge it.
        let running = engine.shard().map(|s| s.ranges.clone()).unwrap_or_default();
        if share.ranges == running {
            self.gate
                .set_claims_if(epoch, share.ranges.clone(), self.gate.owns_cluster_rules());
            return Switched::Unchanged;
        }
        let owns_cluster_rules = match set {
            Some(set) => cluster_rules_in(engine.client(), set, &share.ranges).await,
            None => false,
        };
        // 1. No write outside the new share from now on (none at all after a fence).
        let fenced = !self
            .gate
            .set_claims_if(epoch, share.ranges.clone(), owns_cluster_rules);
        // 2. Every controller stops (in-flight reconciles finish or are refused).
        engine.shutdown().await;
        engine.forget_outside(&if fenced {
            Ranges::none()
        } else {
            share.ranges.clone()
        });
        if fenced {
            engine.set_shard(None);
            self.metrics.shard_share.set(0.0);
            return Switched::To(Ranges::none());
        }
        self.metrics.shard_share.set(share.ranges.percent());
        // 3. The caches start again over the new share (the caller starts the rules).
        engine.set_shard(None);
        if !share.ranges.is_empty() {
            match self.sharding(&share.ranges) {
                Ok(sharding) => engine.set_shard(Some(sharding)),
                Err(e) => {
                    warn!(error = %e, "cannot build the sharded watch client");
                    self.gate.set_claims(Ranges::none(), false);
                    return Switched::To(Ranges::none());
                }
            }
        }
        info!(generation = share.generation, share = %format!("{:.1} %", share.ranges.percent()), "running this replica's share");
        Switched::To(share.ranges)
    }

    /// 4. Only now may the coordinator give what this replica released to another.
    pub fn acknowledge(&self) {
        let generation = *self.pending.lock().unwrap_or_else(|p| p.into_inner());
        self.applied.send_replace(generation);
    }

    /// Recomputes whether this replica owns a rule with cluster-scoped parents (after a
    /// rule set change: such a rule may have come or gone).
    pub async fn refresh(&self, client: &Client, set: &RuleSet) {
        let epoch = self.gate.epoch();
        let owns = cluster_rules_in(client, set, &self.gate.claims()).await;
        self.gate.set_cluster_rules_if(epoch, owns);
    }

    fn sharding(&self, ranges: &Ranges) -> Result<Sharding> {
        // Its requests are reads, but the gate keeps it honest should that change.
        let builder =
            super::client::gated_builder(&self.config, self.gate.clone(), self.metrics.clone())?;
        let selector = ranges.selector().filter(|_| self.server_side);
        let watch_client = match &selector {
            Some(selector) => builder.with_layer(&SelectorLayer::new(selector)).build(),
            None => builder.build(),
        };
        let rollouts = Arc::new(crate::shard::gate::RolloutStoreGate {
            shard: self.gate.clone(),
            namespace: self.namespace.clone(),
        });
        let rollout_client =
            super::client::gated_client(self.config.clone(), rollouts, self.metrics.clone())?;
        Ok(Sharding {
            gate: self.gate.clone(),
            ranges: ranges.clone(),
            watch_client,
            selector,
            server_side: self.server_side,
            rollout_client,
        })
    }

    /// Leaves the group: the caller has stopped every controller.
    pub async fn leave(self) {
        self.gate.set_claims(Ranges::none(), false);
        let _ = self.stop.send(true);
        if tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .is_err()
        {
            warn!("could not leave the shard group in time; the member Lease expires");
        }
    }
}

/// Whether any rule with cluster-scoped parents hashes into `ranges` (its children may
/// be written in any namespace). A rule whose kind cannot be resolved yet does not
/// count (its CRD may not be installed yet: the next rule set change, or share change,
/// looks again).
async fn cluster_rules_in(client: &Client, set: &RuleSet, ranges: &Ranges) -> bool {
    for (name, rule) in &set.rules {
        if !ranges.contains(fnv1a(name)) {
            continue;
        }
        let p = &rule.rule.spec.parent;
        if let Ok((_, false)) =
            resolve_kind(client, "parent", &p.api_version.value, &p.kind.value).await
        {
            return true;
        }
    }
    false
}
