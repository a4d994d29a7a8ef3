//! The operator's own health (the parents' status is `reconcile::status_write`): what
//! each rule is doing, for `/status` and readiness: its version and file, whether it runs
//! or waits (and why), whether its caches have synced, and problems found outside its
//! controller (a CRD that could not be installed).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use crate::reconcile::Paused;

use kube::runtime::watcher;
use serde::Serialize;

/// Where a rule's controller is.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum RuleState {
    /// Started; its kinds are being resolved.
    Starting,
    /// Its controller runs.
    Running,
    /// It cannot run yet (a kind not served, a permission missing); it retries.
    Waiting,
    /// Sharded: another replica runs it (its parents are cluster-scoped).
    Elsewhere,
}

/// What each rule is doing, for `/status` and readiness.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RuleStatus {
    pub version: String,
    pub file: String,
    pub state: RuleState,
    /// Why the rule waits, or the last watch error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The rule's caches have listed everything once.
    pub synced: bool,
    /// A problem outside the controller, e.g. its CRD could not be installed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// Parents paused with the `rulebook.dev/paused` annotation.
    pub paused: usize,
    /// The storage migration of the rule's CRD (`migrate.rs`), the last one this replica
    /// ran or runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub migration: Option<MigrationStatus>,
    /// The rule's progressive rollout as this replica follows it (`rollout/`), while
    /// two versions run side by side.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rollout: Option<crate::rollout::RolloutState>,
}

/// A storage migration's progress, for `/status`.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MigrationStatus {
    /// The CRD.
    pub crd: String,
    /// The versions objects were stored in besides the storage version.
    pub from: Vec<String>,
    /// The storage version.
    pub to: String,
    pub state: MigrationState,
    /// Objects rewritten so far (by this pass and the one it resumed).
    pub rewritten: u64,
    /// Why the last pass failed (it is retried).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Sharded: the identity of the replica holding the migration's Lease (this one's
    /// own when it migrates), as this replica last read it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
}

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MigrationState {
    Running,
    /// Every object rewritten and `status.storedVersions` trimmed.
    Done,
    /// The last pass failed; another follows.
    Failed,
}

#[derive(Default)]
pub struct EngineStatus {
    rules: RwLock<BTreeMap<String, RuleStatus>>,
    problems: RwLock<BTreeMap<String, String>>,
    paused: RwLock<BTreeMap<String, Arc<Paused>>>,
    migrations: RwLock<BTreeMap<String, MigrationStatus>>,
    rollouts: RwLock<BTreeMap<String, Arc<parking_lot::RwLock<crate::rollout::RolloutState>>>>,
}

impl EngineStatus {
    pub fn snapshot(&self) -> BTreeMap<String, RuleStatus> {
        let mut rules = self.rules.read().map(|r| r.clone()).unwrap_or_default();
        if let Ok(problems) = self.problems.read() {
            for (rule, p) in problems.iter() {
                if let Some(s) = rules.get_mut(rule) {
                    s.problem = Some(p.clone());
                }
            }
        }
        if let Ok(paused) = self.paused.read() {
            for (rule, p) in paused.iter() {
                if let Some(s) = rules.get_mut(rule) {
                    s.paused = p.count();
                }
            }
        }
        if let Ok(migrations) = self.migrations.read() {
            for (rule, m) in migrations.iter() {
                if let Some(s) = rules.get_mut(rule) {
                    s.migration = Some(m.clone());
                }
            }
        }
        if let Ok(rollouts) = self.rollouts.read() {
            for (rule, r) in rollouts.iter() {
                if let Some(s) = rules.get_mut(rule) {
                    s.rollout = Some(r.read().clone());
                }
            }
        }
        rules
    }
    /// Shows (or, with `None`, stops showing) the rollout state `rule` follows.
    pub fn set_rollout(
        &self,
        rule: &str,
        state: Option<Arc<parking_lot::RwLock<crate::rollout::RolloutState>>>,
    ) {
        if let Ok(mut all) = self.rollouts.write() {
            match state {
                Some(s) => all.insert(rule.to_string(), s),
                None => all.remove(rule),
            };
        }
    }
    /// Records (or, with `None`, clears) the storage migration of `rule`'s CRD.
    pub fn set_migration(&self, rule: &str, m: Option<MigrationStatus>) {
        if let Ok(mut all) = self.migrations.write() {
            match m {
                Some(m) => all.insert(rule.to_string(), m),
                None => all.remove(rule),
            };
        }
    }
    /// The recorded storage migration of `rule`'s CRD.
    pub fn migration(&self, rule: &str) -> Option<MigrationStatus> {
        self.migrations.read().ok()?.get(rule).cloned()
    }
    /// Changes the recorded storage migration of `rule`'s CRD, if there is one.
    pub fn update_migration(&self, rule: &str, f: impl FnOnce(&mut MigrationStatus)) {
        if let Ok(mut all) = self.migrations.write()
            && let Some(m) = all.get_mut(rule)
        {
            f(m)
        }
    }
    /// Records (or, with `None`, clears) a problem of `rule` found outside its controller.
    pub fn set_problem(&self, rule: &str, problem: Option<String>) {
        if let Ok(mut p) = self.problems.write() {
            match problem {
                Some(msg) => p.insert(rule.to_string(), msg),
                None => p.remove(rule),
            };
        }
    }
    /// The paused parents of a running rule's controller.
    pub(super) fn set_paused(&self, rule: &str, paused: Arc<Paused>) {
        if let Ok(mut p) = self.paused.write() {
            p.insert(rule.to_string(), paused);
        }
    }
    pub(super) fn update(&self, rule: &str, f: impl FnOnce(&mut RuleStatus)) {
        if let Ok(mut rules) = self.rules.write()
            && let Some(s) = rules.get_mut(rule)
        {
            f(s)
        }
    }
    pub(super) fn insert(&self, rule: &str, status: RuleStatus) {
        if let Ok(mut rules) = self.rules.write() {
            rules.insert(rule.to_string(), status);
        }
    }
    pub(super) fn remove(&self, rule: &str) {
        if let Ok(mut rules) = self.rules.write() {
            rules.remove(rule);
        }
        if let Ok(mut p) = self.paused.write() {
            p.remove(rule);
        }
    }
    /// Every running rule has synced its caches (a waiting rule does not hold readiness back:
    /// it is reported on `/status`, and the others serve).
    pub fn all_synced(&self) -> bool {
        self.rules
            .read()
            .map(|r| {
                r.values()
                    .all(|s| s.synced || s.state == RuleState::Waiting)
            })
            .unwrap_or(false)
    }
}

/// A watch error as `/status` shows it: what failed and the API server's answer (code,
/// reason, message), on `/status` and in the log. A response that could not be decoded
/// is not quoted: serde's message can cite a field of a tenant's object.
pub fn watch_error_summary(e: &watcher::Error) -> String {
    let (what, err) = match e {
        watcher::Error::InitialListFailed(err) => ("listing failed", err),
        watcher::Error::WatchStartFailed(err) => ("starting the watch failed", err),
        watcher::Error::WatchFailed(err) => ("the watch failed", err),
        watcher::Error::WatchError(s) => {
            return format!("the API server ended the watch: {}", api_status(s));
        }
        watcher::Error::NoResourceVersion => return e.to_string(),
    };
    match err {
        kube::Error::Api(s) => format!("{what}: {}", api_status(s)),
        kube::Error::SerdeError(_) => {
            format!("{what}: cannot decode the API server's answer")
        }
        other => format!("{what}: {other}"),
    }
}

/// `403 Forbidden: message`; kube's own reasons for bodies that were no Status (e.g.
/// "Failed to parse error data") are left out.
fn api_status(s: &kube::core::Status) -> String {
    if s.reason.is_empty() || s.reason.contains(' ') {
        format!("{}: {}", s.code, s.message)
    } else {
        format!("{} {}: {}", s.code, s.reason, s.message)
    }
}

/// Keeps `rulebook_cached_objects` current (every 2 s) while the rule runs.
pub(super) fn count_cached(
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    rule: &str,
    parents: kube::runtime::reflector::Store<kube::api::DynamicObject>,
    children: Vec<std::sync::Arc<crate::cache::store::ChildStore>>,
) -> tokio::task::JoinHandle<()> {
    let label = |cache: &str| crate::metrics::CacheLabels {
        rule: rule.to_string(),
        cache: cache.to_string(),
    };
    let (p, c) = (label("parents"), label("children"));
    tokio::spawn(async move {
        loop {
            metrics
                .cached_objects
                .get_or_create(&p)
                .set(parents.len() as i64);
            let n: usize = children.iter().map(|s| s.len()).sum();
            metrics.cached_objects.get_or_create(&c).set(n as i64);
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_errors_on_status_never_quote_objects() {
        let decode = serde_json::from_str::<u32>(r#""tenant-secret-value""#)
            .err()
            .map(kube::Error::SerdeError)
            .expect("a decoding error");
        assert!(
            decode.to_string().contains("tenant-secret-value"),
            "serde quotes the value: the reason for the summary"
        );
        let summary = watch_error_summary(&watcher::Error::InitialListFailed(decode));
        assert_eq!(
            summary,
            "listing failed: cannot decode the API server's answer"
        );
        let forbidden = kube::core::Status::failure("mywebs is forbidden", "Forbidden")
            .with_code(403)
            .boxed();
        assert_eq!(
            watch_error_summary(&watcher::Error::WatchStartFailed(kube::Error::Api(
                forbidden
            ))),
            "starting the watch failed: 403 Forbidden: mywebs is forbidden"
        );
        let not_json =
            kube::core::Status::failure("404 page not found", "Failed to parse error data")
                .with_code(404)
                .boxed();
        assert_eq!(
            watch_error_summary(&watcher::Error::WatchStartFailed(kube::Error::Api(
                not_json
            ))),
            "starting the watch failed: 404: 404 page not found"
        );
    }
}
