//! The engine: one kube-runtime controller per rule, started, stopped and restarted as
//! the rule set changes. A rule whose kinds cannot be resolved (CRD not installed yet)
//! or that fails in any other way waits and retries on its own; the other rules run on.
//!
//! `runner.rs` runs one rule (resolve its kinds, then `wiring.rs` builds its caches and
//! controller and runs it), `streams.rs` holds the pass-throughs its watch streams go
//! through, `dropped.rs` cleans up after a rule drops a kind of child, `released.rs`
//! releases the finalizers of a removed rule's parents, `permissions.rs` checks a rule's
//! RBAC first, `resync.rs` spreads a rule's resyncs over its period, `turns.rs` lets
//! namespaces take turns at a rule's reconciles, `identity.rs` gives a rule with
//! `spec.serviceAccount` clients that impersonate its account.

mod dropped;
mod health;
mod identity;
pub mod migrate;
mod permissions;
mod refstream;
mod released;
mod resync;
pub mod rollout;
mod runner;
mod streams;
mod turns;
mod wiring;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{Instrument, info, info_span, warn};

use crate::cache::admission::{CacheBudget, CacheLimits};
use crate::metrics::{self, Metrics};
use crate::reconcile::WriteGate;
use crate::reconcile::inflight::InputBudget;
use crate::render::{CompiledRule, RuleSet};
use crate::write::outbox::{Outbox, OutboxLimits};
use crate::write::recorder::Recorder;
use dropped::{CleanupEnv, Cleanups, Dropped, dropped_kinds, removed_kinds};
use released::release_removed_rule;
use runner::RuleRunner;

pub use dropped::kind_api;
pub use health::{EngineStatus, MigrationState, MigrationStatus, RuleState, RuleStatus};
pub use identity::{BuildClients, Identities, IdentityError, RuleClients, service_account_user};
pub use released::{ParentsOf, ReleaseError, Released, orphan_kinds, release_parents};
pub use runner::{SetupError, resolve_kind};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Concurrent reconciles per rule (the same parent is never reconciled twice at once).
    pub concurrency: u16,
    /// Watch parents (and children) in this namespace only.
    pub namespace: Option<String>,
    /// Label selector on parents.
    pub parent_selector: Option<String>,
    /// The reporting controller name on events.
    pub reporter: String,
    /// This instance (pod name), on events.
    pub instance: Option<String>,
    /// Check the rule's permissions with SelfSubjectAccessReviews before starting it.
    pub check_permissions: bool,
    /// Bounds on cached child content.
    pub cache: CacheLimits,
    /// Bytes of reconcile inputs (as cached) held at once by all reconciles
    /// (`reconcile::inflight`).
    pub inputs_in_flight: usize,
    /// This replica's share of the parents (`run --sharding namespace`), or everything.
    pub shard: Option<crate::shard::watch::Sharding>,
    /// Storage-migration rewrites per second at most (`None`: unpaced).
    pub migration_rate: Option<std::num::NonZeroU32>,
    /// Where the rollout state and stored versions of the rules are (`rollout/`): the
    /// operator's namespace.
    pub rollout_namespace: String,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            concurrency: 4,
            namespace: None,
            parent_selector: None,
            reporter: "rulebook".into(),
            instance: None,
            check_permissions: true,
            cache: CacheLimits::default(),
            inputs_in_flight: crate::reconcile::inflight::DEFAULT_TOTAL,
            shard: None,
            migration_rate: None,
            rollout_namespace: "default".into(),
        }
    }
}

struct RunningRule {
    version: String,
    rule: Arc<CompiledRule>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

pub struct Engine {
    client: Client,
    config: EngineConfig,
    metrics: Arc<Metrics>,
    gate: Arc<dyn WriteGate>,
    pub status: Arc<EngineStatus>,
    running: BTreeMap<String, RunningRule>,
    budget: Arc<CacheBudget>,
    /// Reconcile inputs in flight, for every rule.
    inputs: Arc<InputBudget>,
    /// Releases of finalizers in flight, by parent `(apiVersion, kind)`.
    releases: BTreeMap<(String, String), JoinHandle<()>>,
    /// Per rule version, what its reconciles found steady: kept across restarts of the
    /// same version (a sharded replica restarts its rules whenever its share changes),
    /// so the parents it kept cost a hash lookup, not a render. Exact fingerprints of
    /// the inputs: a miss costs only a full reconcile.
    steady: BTreeMap<String, (String, Arc<crate::reconcile::memory::Steady>)>,
    /// Where every rule's events wait to be sent (bounded, for the whole process).
    outbox: Outbox,
    /// The clean-ups after kinds of children the rules dropped, one per rule at most.
    cleanups: Cleanups,
    /// Storage migrations of the rules' CRDs in flight (`migrate.rs`).
    migrations: migrate::Migrations,
    /// Who each rule's requests are made as (`identity.rs`).
    identities: Identities,
    /// Rules with a selector stopped because the read skipped their file (a dangling
    /// link), by name: their children are pruned only once the file is gone for good.
    missing: BTreeMap<String, Arc<CompiledRule>>,
}

/// How long a stopping rule may take to finish its in-flight reconciles.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// A rule's parent kind as `(group, kind)`: two versions of a kind are the same objects.
fn parent_kind(rule: &CompiledRule) -> (String, String) {
    let p = &rule.rule.spec.parent;
    (
        crate::meta::split_api_version(&p.api_version.value)
            .0
            .to_string(),
        p.kind.value.clone(),
    )
}

/// Whether a rule of `rules` still reconciles the parents of a removed rule `old`: one
/// for the same kind at any version of its group (the same objects), which takes the
/// finalizer off itself when it has no deletion steps. Then `old`'s parents are not
/// released: a release would let go of `Orphan` children the other rule still has.
/// `key` is `old`'s [`parent_kind`].
fn still_ruled<'a>(
    key: &(String, String),
    mut rules: impl Iterator<Item = &'a CompiledRule>,
) -> bool {
    rules.any(|r| parent_kind(r) == *key)
}

/// An event recorder: its own series cache (a rule run's, as before a restart or a
/// reload), sending through the process's one bounded outbox.
fn recorder(client: &Client, config: &EngineConfig, outbox: &Outbox) -> Recorder {
    Recorder::new(
        client.clone(),
        kube::runtime::events::Reporter {
            controller: config.reporter.clone(),
            instance: config.instance.clone(),
        },
        outbox.clone(),
    )
}

impl Engine {
    pub fn new(
        client: Client,
        config: EngineConfig,
        metrics: Arc<Metrics>,
        gate: Arc<dyn WriteGate>,
    ) -> Engine {
        let budget = Arc::new(CacheBudget::new(config.cache.clone(), metrics.clone()));
        let inputs = InputBudget::new(config.inputs_in_flight, metrics.inputs.clone());
        let outbox = Outbox::new(OutboxLimits::DEFAULT, metrics.events_dropped.clone())
            .counting(metrics.events_unsent.clone());
        Engine {
            // Until the operator says how to impersonate, a rule with an account waits.
            identities: Identities::new(config.rollout_namespace.clone(), None),
            migrations: migrate::Migrations::new(config.migration_rate),
            outbox,
            client,
            config,
            metrics,
            gate,
            status: Arc::default(),
            running: BTreeMap::new(),
            budget,
            inputs,
            releases: BTreeMap::new(),
            steady: BTreeMap::new(),
            cleanups: Cleanups::default(),
            missing: BTreeMap::new(),
        }
    }

    /// Makes the running controllers match `set`: stops removed rules (their children
    /// stay; the finalizers on their parents are released), restarts changed ones,
    /// starts new ones; unchanged rules are not touched.
    pub async fn apply(&mut self, set: &RuleSet) {
        let stale: Vec<String> = self
            .running
            .iter()
            .filter(|(name, r)| {
                // A rule whose part among its kind's rules changed (another rule of its
                // kind came or went) restarts too: it writes other conditions now.
                // So does one whose peers changed (a sibling renamed): it tells their
                // children from those of a rule that is gone by the peers' names.
                set.rules.get(*name).is_none_or(|new| {
                    new.version != r.version || new.role != r.rule.role || new.peers != r.rule.peers
                })
            })
            .map(|(name, _)| name.clone())
            .collect();
        let mut released = Vec::new();
        // The version each changed rule ran until now: a rule with `spec.rollout` moves
        // its parents from it progressively (`rollout/`).
        let mut previous: BTreeMap<String, Arc<CompiledRule>> = BTreeMap::new();
        self.missing_now(set);
        for name in stale {
            let old = self.running.get(&name).map(|r| r.rule.clone());
            // Also a rule that needs no finalizer: its parents may still carry one an
            // earlier version put there (kept for `Orphan` children of a dropped kind).
            if let Some(old) = &old {
                released.push(old.clone());
            }
            self.stop(&name).await;
            // A clean-up still in flight stops first: the new version may have its kinds
            // again. What it had left goes on, less those.
            let new = set.rules.get(&name);
            let mut todo = self.cleanups.stop(&name, new.map(|r| r.as_ref())).await;
            match (old, new) {
                (Some(old), Some(new)) => {
                    previous.insert(name.clone(), old.clone());
                    let kinds = dropped_kinds(&old, new);
                    if !kinds.is_empty() {
                        todo.push(Dropped { old, kinds });
                    }
                    match self.cleanup_env(new) {
                        Ok(env) => self.cleanups.start(name.clone(), todo, env),
                        Err(e) => {
                            warn!(rule = %name, error = %e, "cannot clean up after the kinds the rule dropped");
                        }
                    }
                }
                (Some(old), None) => self.removed(old, set),
                (None, _) => {}
            }
        }
        self.release_removed(&released, set);
        for (name, rule) in &set.rules {
            if !self.running.contains_key(name) {
                if let Some(release) = self.releases.remove(&parent_kind(rule)) {
                    release.abort();
                }
                self.start(rule.clone(), previous.remove(name)).await;
            }
        }
    }

    /// A rule gone from the set (its controller stopped): one with a selector takes no
    /// parent any more, so its children go, as they would for parents leaving its
    /// selector (decorators.md) — but for kinds another rule of the parent kind has: that
    /// rule may render them (the rule renamed), and takes them over. A rule whose file the
    /// read skipped (a dangling link) is missing, not removed: its children stay until the
    /// file is back or gone ([`Engine::missing_now`]).
    fn removed(&mut self, old: Arc<CompiledRule>, set: &RuleSet) {
        let name = old.name.clone();
        if !old.has_selector() {
            info!(rule = %name, "rule removed: controller stopped, its children stay");
            return;
        }
        if set.skipped.contains(&old.file) {
            warn!(rule = %name, file = %old.file, "the file of a rule with spec.parent.selector was skipped (a dangling link): its children stay until it is back or removed");
            self.missing.insert(name, old);
            return;
        }
        let (kinds, kept) = removed_kinds(&old, set);
        if !kept.is_empty() {
            info!(rule = %name, kinds = ?kept, "rule with spec.parent.selector removed: its children of kinds other rules of its parent kind have stay, for them to take over");
        }
        if kinds.is_empty() {
            return;
        }
        info!(rule = %name, kinds = ?kinds, "rule with spec.parent.selector removed: pruning its children");
        // As the removed rule's identity: its children are what its account may delete.
        match self.cleanup_env(&old) {
            Ok(env) => self.cleanups.start(name, vec![Dropped { old, kinds }], env),
            Err(e) => {
                warn!(rule = %name, error = %e, "cannot prune the children of the removed rule");
            }
        }
    }

    /// The rules missing since their file was skipped, against `set`: one back in the set
    /// starts as any new rule; one whose file is still skipped stays missing; one whose
    /// file is gone for good is removed now ([`Engine::removed`]).
    fn missing_now(&mut self, set: &RuleSet) {
        let missing = std::mem::take(&mut self.missing);
        for (name, old) in missing {
            if set.rules.contains_key(&name) {
                info!(rule = %name, "the file of a missing rule is back");
            } else {
                // Still skipped: `removed` keeps it missing.
                self.removed(old, set);
            }
        }
    }

    /// Parents whose rule (or its parent kind) is gone would keep the finalizer for ever:
    /// release them. A rule for their kind starting now cancels that.
    fn release_removed(&mut self, released: &[Arc<CompiledRule>], set: &RuleSet) {
        for old in released {
            let p = &old.rule.spec.parent;
            let key = parent_kind(old);
            if still_ruled(&key, set.rules.values().map(|r| &**r)) {
                continue;
            }
            info!(rule = %old.name, "releasing the finalizers of the parents of a removed rule");
            // As the removed rule's identity: its parents are what its account may patch.
            let client = match self.rule_clients(old) {
                Ok(c) => c.client,
                Err(e) => {
                    warn!(rule = %old.name, error = %e, "cannot release the finalizers of the removed rule's parents");
                    continue;
                }
            };
            let of = ParentsOf {
                api_version: p.api_version.value.clone(),
                kind: p.kind.value.clone(),
                namespace: self.config.namespace.clone(),
                selector: self.config.parent_selector.clone(),
                share: self.config.shard.as_ref().map(|s| s.ranges.clone()),
                orphan_kinds: orphan_kinds(old),
            };
            let task = tokio::spawn(release_removed_rule(
                client.clone(),
                old.clone(),
                of,
                self.metrics.clone(),
                self.gate.clone(),
                recorder(&client, &self.config, &self.outbox),
            ));
            if let Some(previous) = self.releases.insert(key, task) {
                previous.abort();
            }
        }
    }

    /// Says how to build the clients of rules with `spec.serviceAccount`.
    pub fn set_identities(&mut self, identities: Identities) {
        self.identities = identities;
    }

    /// The clients `rule`'s requests go through (`identity.rs`).
    fn rule_clients(&self, rule: &CompiledRule) -> Result<RuleClients, IdentityError> {
        self.identities
            .clients_for(rule, &self.client, self.config.shard.as_ref())
    }

    /// What a clean-up of `rule`'s dropped kinds writes with, as the engine runs now: as
    /// the rule's identity.
    fn cleanup_env(&self, rule: &CompiledRule) -> Result<CleanupEnv, IdentityError> {
        Ok(CleanupEnv {
            client: self.rule_clients(rule)?.client,
            namespace: self.config.namespace.clone(),
            metrics: self.metrics.clone(),
            gate: self.gate.clone(),
            shard: self
                .config
                .shard
                .as_ref()
                .map(|s| (s.gate.clone(), s.ranges.clone())),
        })
    }

    async fn start(&mut self, rule: Arc<CompiledRule>, previous: Option<Arc<CompiledRule>>) {
        let name = rule.name.clone();
        info!(rule = %name, version = %rule.version, "starting rule");
        // A clean-up that stopped when this process could no longer write (a share that
        // moved, a lease lost), or that runs over an old share, goes on now over this one.
        let clients = self.rule_clients(&rule);
        if let Ok(env) = self.cleanup_env(&rule) {
            self.cleanups.resume(&rule, env).await;
        }
        self.metrics.init_rule(&name);
        self.status.insert(
            &name,
            RuleStatus {
                version: rule.version.clone(),
                file: rule.file.clone(),
                state: RuleState::Starting,
                message: None,
                synced: false,
                problem: None,
                paused: 0,
                migration: None,
                rollout: None,
            },
        );
        let (stop, mut stopped) = watch::channel(false);
        let version = rule.version.clone();
        let runner_rule = rule.clone();
        let clients = match clients {
            Ok(c) => c,
            Err(e) => {
                // Never the operator's own identity in place of the rule's: it waits
                // (a rule set change starts it again).
                warn!(rule = %name, error = %e, "rule cannot run");
                self.status.update(&name, |s| {
                    s.state = RuleState::Waiting;
                    s.message = Some(e.to_string());
                });
                let task = tokio::spawn(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                });
                let running = RunningRule {
                    version,
                    rule: runner_rule,
                    stop,
                    task,
                };
                self.running.insert(name, running);
                return;
            }
        };
        let steady = match self.steady.get(&name) {
            Some((v, s)) if *v == version => s.clone(),
            _ => {
                let s = Arc::new(crate::reconcile::memory::Steady::default());
                self.steady
                    .insert(name.clone(), (version.clone(), s.clone()));
                s
            }
        };
        let runner = RuleRunner {
            previous,
            orphans_pending: self.cleanups.orphans_pending(&name),
            steady,
            rule,
            client: clients.client,
            own_watch: clients.watch,
            operator_client: self.client.clone(),
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            gate: self.gate.clone(),
            status: self.status.clone(),
            budget: self.budget.clone(),
            inputs: self.inputs.clone(),
            outbox: self.outbox.clone(),
        };
        let span = info_span!("rule", rule = %name);
        let task = tokio::spawn(runner.run(stopped).instrument(span));
        self.running.insert(
            name,
            RunningRule {
                version,
                rule: runner_rule,
                stop,
                task,
            },
        );
    }

    async fn stop(&mut self, name: &str) {
        let Some(r) = self.running.remove(name) else {
            return;
        };
        let _ = r.stop.send(true);
        let abort = r.task.abort_handle();
        if tokio::time::timeout(STOP_TIMEOUT, r.task).await.is_err() {
            warn!(rule = %name, "rule did not stop in time; aborting it");
            abort.abort();
        }
        self.status.remove(name);
        self.metrics
            .rule_running
            .get_or_create(&metrics::rule(name))
            .set(0);
    }

    /// The engine's (gated) client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The share the rules run over (sharded replicas).
    pub fn shard(&self) -> Option<&crate::shard::watch::Sharding> {
        self.config.shard.as_ref()
    }

    /// The share the rules started from now on run over (sharded replicas).
    pub fn set_shard(&mut self, shard: Option<crate::shard::watch::Sharding>) {
        self.config.shard = shard;
    }

    /// Forgets what the rules found steady of parents outside `ranges`: their namespaces
    /// are another replica's now (a sharded replica's share changed).
    pub fn forget_outside(&self, ranges: &crate::shard::Ranges) {
        for (_, steady) in self.steady.values() {
            steady.retain_namespaces(|h| ranges.contains(h));
        }
    }

    /// Starts the storage migrations of the CRDs of `set` that `mine` accepts (this
    /// replica applies them). Sharded, each runs under a Lease of its own that any
    /// replica may take ([`Engine::lease_migrations`]), whatever its share: `mine` does
    /// not apply; without that, a sharded replica migrates nothing (it writes only its
    /// share, and a migration needs every namespace).
    pub fn migrate(&mut self, set: &RuleSet, mine: &dyn Fn(&str) -> bool) {
        if self.migrations.leased() {
            self.migrations
                .ensure(&self.client, set, &|_| true, &self.status);
            return;
        }
        if self.config.shard.is_some() {
            return;
        }
        self.migrations
            .ensure(&self.client, set, mine, &self.status);
    }

    /// Sharded: storage migrations run under a Lease per CRD, through `runner`.
    pub fn lease_migrations(&mut self, runner: Arc<dyn migrate::LeasedRun>) {
        self.migrations.set_leased(runner);
    }

    /// Stops every storage migration, those under a Lease of their own too, which give
    /// it up (the process stops).
    pub async fn stop_migrations(&mut self) {
        self.migrations.stop_all().await;
    }

    /// Stops every rule, letting in-flight reconciles finish, and the migrations that
    /// run on the engine's client.
    pub async fn shutdown(&mut self) {
        self.migrations.stop();
        let names: Vec<String> = self.running.keys().cloned().collect();
        for r in self.running.values() {
            let _ = r.stop.send(true);
        }
        for name in names {
            self.stop(&name).await;
        }
    }
}

/// The rule `name` of the rule file `text`, compiled with one template `t.yaml` (for the
/// engine's unit tests).
#[cfg(test)]
fn compiled_for_test(name: &str, text: String) -> Arc<CompiledRule> {
    let sources = crate::rules::Sources {
        default_rollout: None,
        rule_files: vec![(format!("{name}.yaml"), text)],
        templates: [(
            "t.yaml".to_string(),
            ("t.yaml".to_string(), "metadata:\n  name: x\n".to_string()),
        )]
        .into(),
    };
    let set = crate::render::compile(&sources, &crate::render::Limits::default())
        .unwrap_or_else(|e| panic!("{e:?}"));
    set.rules[name].clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A compiled rule `name` over `apiVersion`'s `kind`.
    fn rule(name: &str, api_version: &str, kind: &str) -> Arc<CompiledRule> {
        compiled_for_test(
            name,
            format!(
                "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: {name}\nspec:\n  parent:\n    apiVersion: {api_version}\n    kind: {kind}\n  children:\n    - name: c\n      apiVersion: v1\n      kind: ConfigMap\n      template: t.yaml\n      deletionPolicy: Orphan\n"
            ),
        )
    }

    #[test]
    fn a_rule_for_the_same_kind_at_another_version_of_its_group_keeps_the_parents() {
        let old = parent_kind(&rule("a", "example.com/v1", "App"));
        let at_v2 = rule("b", "example.com/v2", "App");
        assert!(still_ruled(&old, [&*at_v2].into_iter()));
        assert!(still_ruled(
            &old,
            [&*rule("c", "example.com/v1", "App")].into_iter()
        ));
        // Another kind, or the same kind in another group: released.
        assert!(!still_ruled(
            &old,
            [&*rule("d", "example.com/v1", "Web")].into_iter()
        ));
        assert!(!still_ruled(
            &old,
            [&*rule("e", "other.io/v1", "App")].into_iter()
        ));
        assert!(!still_ruled(&old, std::iter::empty()));
    }
}
