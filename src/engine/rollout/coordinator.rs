//! The rollout coordinator of one rule: the one replica that writes its rollout state
//! (the leader, or under sharding the owner of the rule name's hash, and in any case
//! through a patch at the resourceVersion it read, so two writers cannot both move a
//! batch). Every tick while the rollout is active it lists the parents (paged), places
//! each ([`crate::rollout::on_new`], the same function the reconciles use), computes the
//! batch's figures, asks `gate` and `failWhen`, and writes the state only when the
//! decision changes it. A settled rollout costs nothing: no tick, no list, no write.

use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::{Client, ResourceExt};
use tracing::{debug, info, warn};

use super::{RolloutEnv, now, store};
use crate::reconcile::versions::status_version;
use crate::render::CompiledRule;
use crate::rollout::{
    Decision, ParentFacts, ParentHealth, Phase, Plan, RankKey, RolloutState, batch_stats, boundary,
    decide, on_new,
};

/// How often an active rollout looks at its parents.
const TICK: Duration = Duration::from_secs(2);
/// Parents per list page.
const PAGE: u32 = 500;

/// The coordinator of one rule's rollout.
pub struct Coordinator {
    pub env: RolloutEnv,
    /// The client parents are listed with (every parent of the rule, not a share).
    pub client: Client,
    pub rule: Arc<CompiledRule>,
    pub parent: ApiResource,
    pub parent_namespaced: bool,
    /// The namespace and label selector the operator watches parents with.
    pub namespace: Option<String>,
    pub selector: Option<String>,
    /// Whether this replica may write now.
    pub may_write: Arc<dyn Fn() -> bool + Send + Sync>,
    pub metrics: Arc<crate::metrics::Metrics>,
}

/// One parent as the coordinator sees it.
struct Seen {
    key: RankKey,
    version: Option<String>,
    created: Option<i64>,
    ready: bool,
    ready_since: Option<i64>,
}

/// Whether a parent's `Ready` condition is `True`, and when it last changed.
pub fn parent_health(parent: &DynamicObject) -> (bool, Option<i64>) {
    let ready = parent
        .data
        .get("status")
        .and_then(|s| s.get("conditions"))
        .and_then(|c| c.as_array())
        .and_then(|cs| {
            cs.iter()
                .find(|c| c.get("type").and_then(|t| t.as_str()) == Some("Ready"))
        });
    let Some(c) = ready else {
        return (false, None);
    };
    let since = c
        .get("lastTransitionTime")
        .and_then(|t| t.as_str())
        .and_then(|t| t.parse::<jiff::Timestamp>().ok())
        .map(|t| t.as_second());
    (
        c.get("status").and_then(|s| s.as_str()) == Some("True"),
        since,
    )
}

impl Coordinator {
    /// Runs until the rollout settles (or the task is aborted with the controller).
    pub async fn run(self) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if !(self.may_write)() {
                continue;
            }
            match self.once().await {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => warn!(rule = %self.rule.name, error = %e, "rollout coordinator"),
            }
        }
        debug!(rule = %self.rule.name, "rollout settled; coordinator stops");
    }

    /// One look: `Ok(false)` once the rollout is settled.
    async fn once(&self) -> Result<bool, store::StoreError> {
        let api = self.env.api();
        let Some((state, rv)) = store::read_state(&api, &self.rule.name).await? else {
            return Ok(false);
        };
        if state.to != self.rule.version {
            return Ok(false); // another version's rollout: not this controller's to run
        }
        if !state.active() {
            self.settle(&api, &state).await?;
            return Ok(false);
        }
        let seen = self.parents().await?;
        let next = self.step(&state, &seen, now());
        if next != state {
            if next.phase != state.phase || next.step != state.step {
                info!(rule = %self.rule.name, phase = ?next.phase, step = next.step, message = next.message.as_deref().unwrap_or(""), "rollout moves");
            }
            store::write_state(&api, &self.rule.name, &next, rv).await?;
        }
        Ok(true)
    }

    /// The state after one look at `seen`, at `now`.
    fn step(&self, state: &RolloutState, seen: &[Seen], now: i64) -> RolloutState {
        let (Some(program), Some(spec)) = (&self.rule.rollout, &self.rule.rule.spec.rollout) else {
            return state.clone();
        };
        let plan = Plan::of(spec);
        let mut s = state.clone();
        if s.boundary_step != Some(s.step) && s.phase == Phase::Progressing {
            let mut keys: Vec<RankKey> = seen.iter().map(|p| p.key).collect();
            keys.sort_unstable();
            // A boundary never goes back: parents deleted since do not un-move others.
            s.boundary = boundary(&keys, plan.target(s.step)).max(s.boundary);
            s.boundary_step = Some(s.step);
            return s; // the batch moves now; it is judged from the next look
        }
        let health: Vec<ParentHealth> = seen
            .iter()
            .map(|p| {
                let facts = ParentFacts {
                    key: p.key,
                    status_version: p.version.as_deref(),
                    created: p.created,
                };
                ParentHealth {
                    on_new: on_new(&s, &facts),
                    reported_new: p.version.as_deref() == Some(s.to.as_str()),
                    ready: p.ready,
                    ready_since: p.ready_since,
                }
            })
            .collect();
        let batch = batch_stats(&s, health, now);
        self.count(&s, batch.total, batch.parents);
        s.moved = batch.total;
        s.parents = batch.parents;
        let gate = program.gate(&batch).map_err(|e| e.to_string());
        let failed = program.failed(&batch).map_err(|e| e.to_string());
        let d = decide(&s, &plan, &batch, gate, failed);
        if matches!(d, Decision::Fail(..)) {
            warn!(rule = %self.rule.name, decision = ?d, "rollout failed");
        }
        s.after(&d, now)
    }

    /// `rulebook_rollout_parents{rule,version}`.
    fn count(&self, s: &RolloutState, moved: u64, all: u64) {
        let set = |version: &str, n: u64| {
            self.metrics
                .rollout_parents
                .get_or_create(&crate::metrics::RuleVersionLabels {
                    rule: self.rule.name.clone(),
                    version: version.to_string(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        };
        set(&s.to, moved);
        set(&s.from, all.saturating_sub(moved));
    }

    /// A settled rollout: the versions no one renders any more are deleted.
    async fn settle(
        &self,
        api: &Api<k8s_openapi::api::core::v1::ConfigMap>,
        s: &RolloutState,
    ) -> Result<(), store::StoreError> {
        let keep = match s.phase {
            Phase::RolledBack => s.from.as_str(),
            _ => s.to.as_str(),
        };
        let n = store::collect_versions(api, &self.rule.name, &[keep]).await?;
        if n > 0 {
            info!(rule = %self.rule.name, deleted = n, "stored rule versions collected");
        }
        Ok(())
    }

    /// Every parent of the rule, placed.
    async fn parents(&self) -> Result<Vec<Seen>, store::StoreError> {
        let api: Api<DynamicObject> = match (self.parent_namespaced, &self.namespace) {
            (true, Some(ns)) => Api::namespaced_with(self.client.clone(), ns, &self.parent),
            _ => Api::all_with(self.client.clone(), &self.parent),
        };
        let mut params = ListParams::default().limit(PAGE);
        if let Some(sel) = &self.selector {
            params = params.labels(sel);
        }
        let program = self.rule.rollout.clone();
        let mut out = Vec::new();
        loop {
            let page = api.list(&params).await?;
            for p in &page.items {
                let first = program.as_ref().is_some_and(|pr| {
                    pr.has_order() && crate::cache::to_json(p).is_some_and(|j| pr.first(&j))
                });
                let (ready, ready_since) = parent_health(p);
                out.push(Seen {
                    key: RankKey::of(first, p.namespace().as_deref(), &p.name_any()),
                    version: status_version(p).map(str::to_string),
                    created: p
                        .metadata
                        .creation_timestamp
                        .as_ref()
                        .map(|t| t.0.as_second()),
                    ready,
                    ready_since,
                });
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => break,
            }
        }
        Ok(out)
    }
}
