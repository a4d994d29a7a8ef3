//! Progressive rollout of a rule change, the engine's part (docs/reference/rollout.md):
//! before a rule with `spec.rollout` starts, [`prepare`] settles which two versions run
//! side by side (the state in the cluster says, or the version this process ran before,
//! or the stored one after a restart); every replica then follows the state object
//! ([`follow`]) and reconciles every parent when it changes (the pick per parent is
//! `reconcile::versions`); one replica, the coordinator, moves the batches
//! (`coordinator.rs`). The decisions are the pure functions of [`crate::rollout`].

mod coordinator;
pub mod store;

use std::sync::Arc;

use futures::StreamExt;
use futures::channel::mpsc::UnboundedSender;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use parking_lot::RwLock;
use tracing::{debug, info, warn};

pub use coordinator::{Coordinator, parent_health};
use store::StoreError;

use crate::render::{CompiledRule, Limits};
use crate::rollout::{RolloutState, progressive};

/// Where the rollout objects of the rules are: the operator's namespace.
#[derive(Clone)]
pub struct RolloutEnv {
    pub client: Client,
    pub namespace: String,
}

impl RolloutEnv {
    pub fn api(&self) -> Api<ConfigMap> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }
}

/// The two versions of a rule running side by side.
pub struct Setup {
    pub old: Arc<CompiledRule>,
    /// The rollout state as this replica last read it.
    pub state: Arc<RwLock<RolloutState>>,
}

/// Why a rollout could not be set up (yet).
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("waiting for the rollout coordinator to start the rollout to version {0}")]
    NotYet(String),
}

/// Unix seconds now.
pub fn now() -> i64 {
    jiff::Timestamp::now().as_second()
}

/// The rollout `rule` starts with: `None` when the rule has no `spec.rollout` or nothing
/// is rolling out (every parent renders `rule`). `previous` is the version this process
/// ran until now; `coordinates` says whether this replica writes the rollout state.
pub async fn prepare(
    env: &RolloutEnv,
    rule: &Arc<CompiledRule>,
    previous: Option<Arc<CompiledRule>>,
    coordinates: bool,
) -> Result<Option<Setup>, PrepareError> {
    if rule.rollout.is_none() {
        return Ok(None);
    }
    let api = env.api();
    let now = now();
    let (current, rv) = match store::read_state(&api, &rule.name).await? {
        Some((s, rv)) => (Some(s), rv),
        None => (None, None),
    };
    let mut wanted = match (&current, &previous) {
        (Some(s), _) if s.to == rule.version => s.clone(),
        (Some(s), _) => s.next(&rule.version, now),
        (None, Some(p)) if p.version != rule.version => {
            RolloutState::settled(&p.version, now).next(&rule.version, now)
        }
        (None, _) => RolloutState::settled(&rule.version, now),
    };
    let mut old = None;
    if wanted.active() {
        let found = match &previous {
            Some(p) if p.version == wanted.from => Some(p.clone()),
            _ => store::load_version(&api, &rule.name, &wanted.from, &Limits::default()).await?,
        };
        let why = match &found {
            None => Some(format!(
                "version {} is not kept in the cluster: the change applies at once",
                wanted.from
            )),
            Some(o) => progressive(&o.rule, &rule.rule)
                .err()
                .map(|e| format!("not progressive: {e}; the change applies at once")),
        };
        match why {
            Some(why) => {
                warn!(rule = %rule.name, from = %wanted.from, to = %rule.version, "{why}");
                wanted = RolloutState::settled(&rule.version, now);
                wanted.message = Some(why);
            }
            // A stored version is compiled alone, as its kind's only rule: it runs with
            // the role the rule set gives the rule now (decorators: who holds the
            // finalizer, who writes the status) and among the peers it has now, never a role of its
            // own.
            None => {
                old = found.map(|mut o| {
                    if let Some(r) = Arc::get_mut(&mut o) {
                        r.role = rule.role;
                        r.peers = rule.peers.clone();
                    }
                    o
                })
            }
        }
    }
    if coordinates {
        store::save_version(&api, rule).await?;
        if let Some(o) = &old {
            store::save_version(&api, o).await?;
        }
        if current.as_ref() != Some(&wanted) {
            info!(rule = %rule.name, from = %wanted.from, to = %wanted.to, active = wanted.active(), "rollout state written");
            store::write_state(&api, &rule.name, &wanted, rv).await?;
        }
    } else if current.as_ref().is_none_or(|c| c.to != wanted.to) {
        return Err(PrepareError::NotYet(rule.version.clone()));
    } else if let Some(c) = current {
        wanted = c;
    }
    Ok(old.map(|old| Setup {
        old,
        state: Arc::new(RwLock::new(wanted)),
    }))
}

/// Follows the rollout state of `rule` in the cluster into `view`, and sends on
/// `changed` whenever it changes (every parent is then reconciled: some move). A state
/// for other versions than this replica runs (another replica's files) is not followed.
pub async fn follow(
    env: RolloutEnv,
    rule: String,
    view: Arc<RwLock<RolloutState>>,
    changed: UnboundedSender<()>,
) {
    let config =
        watcher::Config::default().fields(&format!("metadata.name={}", store::state_name(&rule)));
    let mut events = watcher(env.api(), config)
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(ev) = events.next().await {
        let cm = match ev {
            Ok(cm) => cm,
            Err(e) => {
                debug!(rule = %rule, error = %e, "rollout state watch");
                continue;
            }
        };
        let Ok(Some(state)) = store::parse_state(&rule, &cm) else {
            continue;
        };
        let mut v = view.write();
        if *v == state {
            continue;
        }
        if (v.from.as_str(), v.to.as_str()) != (state.from.as_str(), state.to.as_str()) {
            debug!(rule = %rule, "rollout state for other versions; not followed");
            continue;
        }
        // Progress counters alone change no parent's version: kept for `/status`, no
        // sweep of every parent.
        let progress_only = v.differs_only_in_progress(&state);
        let (phase, step) = (state.phase, state.step);
        *v = state;
        drop(v);
        if progress_only {
            continue;
        }
        info!(rule = %rule, ?phase, step, "rollout state changed");
        let _ = changed.unbounded_send(());
    }
}
