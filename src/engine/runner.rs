//! One rule's controller: resolve its parent and child kinds (discovery, scopes, the
//! status subresource, permissions), then run a kube-runtime controller over a parent
//! cache and one cache per child kind, each fed by tolerant, budgeted watch streams
//! (wired and run in `wiring.rs`), and start it again when it ends.

use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use kube::api::{ApiResource, GroupVersionKind};
use kube::core::discovery::Scope as KubeScope;
use kube::discovery::pinned_kind;
use tokio::sync::watch;
use tracing::warn;

use super::EngineConfig;
use super::health::{EngineStatus, RuleState};
use crate::cache::admission::CacheBudget;
use crate::meta::split_api_version;
use crate::metrics::{self, Metrics};
use crate::reconcile::WriteGate;
use crate::render::CompiledRule;

/// Why a rule cannot run (yet).
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("{what} {gvk} is not served by the API server (is its CRD installed?)")]
    KindNotFound { what: String, gvk: String },
    #[error("discovery of {gvk} failed: {source}")]
    Discovery {
        gvk: String,
        #[source]
        source: kube::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("missing permissions: {0}")]
    Forbidden(String),
}

pub(super) struct RuleRunner {
    pub(super) rule: Arc<CompiledRule>,
    /// Every request made for the rule: the operator's client, or one impersonating the
    /// rule's `spec.serviceAccount` (`identity.rs`).
    pub(super) client: Client,
    /// Sharded, with an account: its caches' client over the share, as that account.
    pub(super) own_watch: Option<Client>,
    /// The operator's own client: the rollout state in the operator's namespace.
    pub(super) operator_client: Client,
    pub(super) config: EngineConfig,
    pub(super) metrics: Arc<Metrics>,
    pub(super) gate: Arc<dyn WriteGate>,
    pub(super) status: Arc<EngineStatus>,
    pub(super) budget: Arc<CacheBudget>,
    /// Reconcile inputs in flight, for every rule.
    pub(super) inputs: Arc<crate::reconcile::inflight::InputBudget>,
    /// What this rule version's reconciles found steady (kept across restarts).
    pub(super) steady: Arc<crate::reconcile::memory::Steady>,
    /// The process's event outbox (one for every rule).
    pub(super) outbox: crate::write::outbox::Outbox,
    /// Set while the engine lets go of children of kinds an earlier version had.
    pub(super) orphans_pending: Arc<crate::reconcile::memory::OrphansPending>,
    /// The version of the rule this process ran before this one, if it changed.
    pub(super) previous: Option<Arc<CompiledRule>>,
}

/// A rule's kinds as discovery found them.
pub(super) struct Resolved {
    pub(super) parent: ApiResource,
    pub(super) parent_namespaced: bool,
    pub(super) status_subresource: bool,
    /// Distinct child kinds, and for each child its index among them.
    pub(super) kinds: Vec<(ApiResource, bool)>,
    pub(super) kind_of_child: Vec<usize>,
    /// Each reference's kind, in rule order.
    pub(super) refs: Vec<(ApiResource, bool)>,
}

impl RuleRunner {
    pub(super) async fn run(self, mut stopped: watch::Receiver<bool>) {
        let name = self.rule.name.clone();
        let mut attempt: u32 = 0;
        loop {
            if *stopped.borrow() {
                break;
            }
            match self.resolve().await {
                Ok(resolved) if !self.owned(&resolved) => {
                    // A rule with cluster-scoped parents runs whole on one replica.
                    self.status.update(&name, |s| {
                        s.state = RuleState::Elsewhere;
                        s.message =
                            Some("its parents are cluster-scoped; another replica runs it".into());
                    });
                    let _ = stopped.wait_for(|s| *s).await;
                    break;
                }
                Ok(resolved) => {
                    let setup = match self.prepare_rollout().await {
                        Ok(setup) => setup,
                        Err(e) => {
                            warn!(rule = %name, error = %e, "rollout cannot start yet; retrying");
                            self.status.update(&name, |s| {
                                s.state = RuleState::Waiting;
                                s.message = Some(e.to_string());
                            });
                            attempt = attempt.saturating_add(1);
                            let delay = Duration::from_secs(2);
                            tokio::select! {
                                _ = tokio::time::sleep(delay) => {}
                                _ = stopped.changed() => {}
                            }
                            continue;
                        }
                    };
                    attempt = 0;
                    self.metrics
                        .rule_running
                        .get_or_create(&metrics::rule(&name))
                        .set(1);
                    self.status.update(&name, |s| {
                        s.state = RuleState::Running;
                        s.message = None;
                    });
                    self.run_controller(resolved, setup, stopped.clone()).await;
                    self.metrics
                        .rule_running
                        .get_or_create(&metrics::rule(&name))
                        .set(0);
                    if *stopped.borrow() {
                        break;
                    }
                    warn!(rule = %name, "controller ended; restarting");
                }
                Err(e) => {
                    warn!(rule = %name, error = %e, "rule cannot run yet; retrying");
                    self.metrics
                        .rule_running
                        .get_or_create(&metrics::rule(&name))
                        .set(0);
                    self.status.update(&name, |s| {
                        s.state = RuleState::Waiting;
                        s.message = Some(e.to_string());
                        s.synced = false;
                    });
                }
            }
            attempt = attempt.saturating_add(1);
            let delay = crate::reconcile::BackoffPolicy {
                base: Duration::from_secs(2),
                max: Duration::from_secs(60),
            }
            .delay(attempt);
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = stopped.changed() => {}
            }
        }
    }

    /// Whether this replica writes the rule's rollout state: the one that may write
    /// (leader), or under sharding the owner of the rule name's hash.
    pub(super) fn coordinates(&self) -> bool {
        match &self.config.shard {
            Some(shard) => shard.ranges.contains(crate::shard::fnv1a(&self.rule.name)),
            None => self.gate.may_write(),
        }
    }

    /// Where the rollout objects are.
    pub(super) fn rollout_env(&self) -> super::rollout::RolloutEnv {
        super::rollout::RolloutEnv {
            // The operator's own identity (not the rule's account); sharded, through the
            // client fenced by the rule's hash, as the operator's namespace may be in
            // another replica's share.
            client: self.config.shard.as_ref().map_or_else(
                || self.operator_client.clone(),
                |s| s.rollout_client.clone(),
            ),
            namespace: self.config.rollout_namespace.clone(),
        }
    }

    /// The two versions this run of the rule renders with, during a rollout.
    async fn prepare_rollout(
        &self,
    ) -> Result<Option<super::rollout::Setup>, super::rollout::PrepareError> {
        super::rollout::prepare(
            &self.rollout_env(),
            &self.rule,
            self.previous.clone(),
            self.coordinates(),
        )
        .await
    }

    /// Whether the rule is split by namespace when sharded: its parents are namespaced
    /// and keep their children in their own namespace. A rule whose children may be
    /// anywhere (cluster-scoped parents, or `targetNamespaces`) runs whole on one replica.
    pub(super) fn split(&self, r: &Resolved) -> bool {
        r.parent_namespaced && self.rule.rule.spec.target_namespaces.is_none()
    }

    /// Whether this replica runs the rule: always, unless sharded, not split by namespace
    /// ([`split`](Self::split)) and its name hashes into another replica's ranges.
    fn owned(&self, r: &Resolved) -> bool {
        match &self.config.shard {
            Some(shard) if !self.split(r) => {
                shard.ranges.contains(crate::shard::fnv1a(&self.rule.name))
            }
            _ => true,
        }
    }

    async fn resolve(&self) -> Result<Resolved, SetupError> {
        let spec = &self.rule.rule.spec;
        let (parent, parent_caps) = discover(
            &self.client,
            "parent",
            &spec.parent.api_version,
            &spec.parent.kind,
        )
        .await?;
        let parent_namespaced = parent_caps.scope == KubeScope::Namespaced;
        let status_subresource = parent_caps
            .subresources
            .iter()
            .any(|(ar, _)| ar.plural == "status");
        let mut kinds: Vec<(ApiResource, bool)> = Vec::new();
        let mut kind_of_child = Vec::new();
        for c in &spec.children {
            let (ar, caps) = discover(
                &self.client,
                &format!("child '{}'", c.name.value),
                &c.api_version,
                &c.kind,
            )
            .await?;
            let namespaced = caps.scope == KubeScope::Namespaced;
            if parent_namespaced && !namespaced {
                return Err(SetupError::Invalid(format!(
                    "child '{}': {} is cluster-scoped and {} is namespaced; a namespaced parent cannot own a cluster-scoped child",
                    c.name.value, c.kind.value, spec.parent.kind.value
                )));
            }
            let idx = match kinds
                .iter()
                .position(|(k, _)| k.api_version == ar.api_version && k.kind == ar.kind)
            {
                Some(i) => i,
                None => {
                    kinds.push((ar, namespaced));
                    kinds.len() - 1
                }
            };
            kind_of_child.push(idx);
        }
        let mut refs = Vec::new();
        for r in &spec.references {
            let (ar, caps) = discover(
                &self.client,
                &format!("reference '{}'", r.name.value),
                &r.api_version,
                &r.kind,
            )
            .await?;
            if parent_namespaced && matches!(r.literal_namespace(), Some(Err(_))) {
                return Err(SetupError::Invalid(format!(
                    "reference '{}': {} is namespaced, so the reference may name another namespace only literally",
                    r.name.value, spec.parent.kind.value
                )));
            }
            refs.push((ar, caps.scope == KubeScope::Namespaced));
        }
        if self.config.check_permissions {
            super::permissions::check_rule_permissions(
                &self.client,
                &self.rule,
                &parent,
                &kinds.iter().map(|(ar, _)| ar.clone()).collect::<Vec<_>>(),
                &refs
                    .iter()
                    .zip(&spec.references)
                    .map(|((ar, namespaced), r)| {
                        let f = crate::render::cache_filter(r);
                        super::permissions::RefAccess {
                            ar: ar.clone(),
                            namespaced: *namespaced,
                            namespace: f.namespace,
                            name: f
                                .fields
                                .map(|f| f.trim_start_matches("metadata.name=").to_string()),
                        }
                    })
                    .collect::<Vec<_>>(),
                self.config.namespace.as_deref(),
            )
            .await
            .map_err(|e| SetupError::Forbidden(e.to_string()))?;
        }
        Ok(Resolved {
            parent,
            parent_namespaced,
            status_subresource,
            kinds,
            kind_of_child,
            refs,
        })
    }
}

/// A kind's API resource and whether it is namespaced, from discovery.
pub async fn resolve_kind(
    client: &Client,
    what: &str,
    api_version: &str,
    kind: &str,
) -> Result<(ApiResource, bool), SetupError> {
    let (ar, caps) = discover(client, what, api_version, kind).await?;
    Ok((ar, caps.scope == KubeScope::Namespaced))
}

pub(super) async fn discover(
    client: &Client,
    what: &str,
    api_version: &str,
    kind: &str,
) -> Result<(ApiResource, kube::core::discovery::ApiCapabilities), SetupError> {
    let (group, version) = split_api_version(api_version);
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let name = format!("{api_version} {kind}");
    match pinned_kind(client, &gvk).await {
        Ok(found) => Ok(found),
        Err(kube::Error::Api(s)) if s.code == 404 => Err(SetupError::KindNotFound {
            what: what.to_string(),
            gvk: name,
        }),
        Err(kube::Error::Discovery(_)) => Err(SetupError::KindNotFound {
            what: what.to_string(),
            gvk: name,
        }),
        Err(e) => Err(SetupError::Discovery {
            gvk: name,
            source: e,
        }),
    }
}
