//! Progressive rollout of a rule change, as pure decisions over plain values
//! (docs/reference/rollout.md): which parents are on the new version, how a batch is
//! doing, and what the rollout does next. The operator keeps the state in the cluster
//! and runs these functions; nothing here reads a clock, a cache or the API server.
//!
//! Membership needs no memory per parent: every parent has a [`RankKey`] — whether
//! `order` holds for it (those first), then a stable hash of `namespace/name` — and the
//! state records, for the step reached, a boundary in that order. A parent is on the new
//! version when its key is within the boundary, or when its `status.ruleVersion` already
//! names the new version (sticky: a tenant relabelling a parent never sends it back).
//! Any replica decides the same from the same state.

pub mod condition;

/// The name of the rollout state of `rule` (a ConfigMap in the operator's namespace).
pub fn state_name(rule: &str) -> String {
    format!("{STATE_PREFIX}{rule}")
}

/// The name of the stored `version` of `rule` (a ConfigMap beside the state).
pub fn version_name(rule: &str, version: &str) -> String {
    format!("{VERSION_PREFIX}{rule}-{version}")
}

const STATE_PREFIX: &str = "rulebook-rollout-";
const VERSION_PREFIX: &str = "rulebook-rule-";

/// The rule a rollout object belongs to, from its name ([`state_name`], [`version_name`];
/// a version is hex, without `-`); `None` for any other name. The sharded write gate
/// lets only the replica holding the hash of that rule write it.
pub fn rule_of_object(name: &str) -> Option<&str> {
    if let Some(rule) = name.strip_prefix(STATE_PREFIX) {
        return (!rule.is_empty()).then_some(rule);
    }
    let (rule, version) = name.strip_prefix(VERSION_PREFIX)?.rsplit_once('-')?;
    (!rule.is_empty() && !version.is_empty()).then_some(rule)
}

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::render::rollout::BatchStats;
use crate::rules::rollout::{OnFailure, Target};
use crate::rules::{Rollout, parse_duration};

/// Where a parent is in the rollout order: smaller moves first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RankKey {
    /// 0 when `order` holds for the parent, else 1.
    pub group: u8,
    /// FNV-1a of `namespace/name`.
    pub hash: u64,
}

impl RankKey {
    pub fn of(first: bool, namespace: Option<&str>, name: &str) -> RankKey {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in namespace
            .unwrap_or("")
            .bytes()
            .chain(std::iter::once(b'/'))
            .chain(name.bytes())
        {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        RankKey {
            group: u8::from(!first),
            hash: h,
        }
    }
}

/// Where the rollout is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Batches move as their gates pass.
    Progressing,
    /// `failWhen` held with `onFailure: Pause`: every parent stays where it is.
    Paused,
    /// Every parent is on the new version.
    Complete,
    /// The moved parents went back to the old version.
    RolledBack,
}

/// The rollout of one rule, as kept in the cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RolloutState {
    /// The version parents are on before they move.
    pub from: String,
    /// The version they move to.
    pub to: String,
    /// Versions an interrupted rollout was moving to: a parent on one of them counts as
    /// moved (it never goes back to `from`, except by a rollback).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub superseded: Vec<String>,
    pub phase: Phase,
    /// The step reached, from 0.
    pub step: usize,
    /// Unix seconds: when the rollout started, and when the step reached started.
    pub started: i64,
    pub step_started: i64,
    /// The last key of the step reached; `None` before it is computed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boundary: Option<RankKey>,
    /// The step `boundary` was computed for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boundary_step: Option<usize>,
    /// Held by `rulebook rollout pause`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub held: bool,
    /// Why the rollout stopped, or what it waits for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When each step started (unix seconds), in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps_started: Vec<i64>,
    /// When the rollout completed, failed or was stopped (unix seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<i64>,
    /// The parents on the new version and in all, at the last look.
    #[serde(default)]
    pub moved: u64,
    #[serde(default)]
    pub parents: u64,
}

impl RolloutState {
    /// Whether `other` differs from this state only in its progress — the counters
    /// (`moved`, `parents`) and, while it runs unheld, the `message` (`gate not passed: 37
    /// of 100 moved parents ready`) — which the coordinator writes as it looks: no parent
    /// renders otherwise for them, and the `Rollout` condition reads the message only
    /// when paused, so no reconcile is due (docs/benchmarks.md, "Rollout bookkeeping").
    pub fn differs_only_in_progress(&self, other: &RolloutState) -> bool {
        let running = |s: &RolloutState| s.phase == Phase::Progressing && !s.held;
        let mut a = self.clone();
        a.moved = other.moved;
        a.parents = other.parents;
        if running(self) && running(other) {
            a.message = other.message.clone();
        }
        a == *other
    }

    /// A rule version with nothing to roll out: every parent on `version`.
    pub fn settled(version: &str, now: i64) -> RolloutState {
        RolloutState {
            from: version.to_string(),
            to: version.to_string(),
            superseded: Vec::new(),
            phase: Phase::Complete,
            step: 0,
            started: now,
            step_started: now,
            boundary: None,
            boundary_step: None,
            held: false,
            message: None,
            steps_started: Vec::new(),
            ended: None,
            moved: 0,
            parents: 0,
        }
    }

    /// A rollout to `to` starting now from this state (the rule changed again): from the
    /// version parents were on, and — when this one was still moving — its target
    /// counted as moved, so no parent goes back.
    pub fn next(&self, to: &str, now: i64) -> RolloutState {
        let (from, mut superseded) = match self.phase {
            Phase::Complete => (self.to.clone(), Vec::new()),
            Phase::RolledBack => (self.from.clone(), Vec::new()),
            Phase::Progressing | Phase::Paused => {
                let mut s = self.superseded.clone();
                s.push(self.to.clone());
                (self.from.clone(), s)
            }
        };
        superseded.retain(|v| v != to && *v != from);
        superseded.dedup();
        RolloutState {
            from,
            to: to.to_string(),
            superseded,
            phase: Phase::Progressing,
            step: 0,
            started: now,
            step_started: now,
            boundary: None,
            boundary_step: None,
            held: false,
            message: None,
            steps_started: vec![now],
            ended: None,
            moved: 0,
            parents: 0,
        }
    }

    /// Whether parents still move or may (a settled rule needs no coordinator).
    pub fn active(&self) -> bool {
        self.from != self.to && matches!(self.phase, Phase::Progressing | Phase::Paused)
    }

    /// The versions a parent may be rendered with now (at most three are named).
    pub fn versions(&self) -> Vec<&str> {
        let mut v = vec![self.from.as_str(), self.to.as_str()];
        v.extend(self.superseded.iter().map(String::as_str));
        v.dedup();
        v
    }
}

/// What is known of one parent to place it.
#[derive(Clone, Copy, Debug)]
pub struct ParentFacts<'a> {
    pub key: RankKey,
    /// Its `status.ruleVersion`.
    pub status_version: Option<&'a str>,
    /// Its creation, unix seconds.
    pub created: Option<i64>,
}

/// Whether a parent renders with the new version (`to`) rather than `from`.
pub fn on_new(state: &RolloutState, p: &ParentFacts<'_>) -> bool {
    match state.phase {
        Phase::Complete => true,
        Phase::RolledBack => false,
        Phase::Progressing | Phase::Paused => {
            if let Some(v) = p.status_version
                && (v == state.to || state.superseded.iter().any(|s| s == v))
            {
                return true;
            }
            // A parent created during the first batch waits for it to pass.
            if state.step == 0 && p.created.is_some_and(|c| c > state.started) {
                return false;
            }
            // Until the step's boundary is computed, the previous step's holds.
            state.boundary.is_some_and(|b| p.key <= b)
        }
    }
}

/// The boundary of a step over the keys of every parent, sorted: the last key within
/// the step's count; `None` when it counts none.
pub fn boundary(sorted_keys: &[RankKey], target: Target) -> Option<RankKey> {
    let count = target.count(sorted_keys.len() as u64);
    let i = usize::try_from(count).ok()?.checked_sub(1)?;
    sorted_keys.get(i).copied()
}

/// How one parent is doing, for the batch's figures.
#[derive(Clone, Copy, Debug)]
pub struct ParentHealth {
    /// It renders with the new version ([`on_new`]).
    pub on_new: bool,
    /// Its status says the new version reconciled it.
    pub reported_new: bool,
    /// Its `Ready` condition is `True`.
    pub ready: bool,
    /// When its `Ready` condition last changed (unix seconds).
    pub ready_since: Option<i64>,
}

/// The figures `gate` and `failWhen` see.
pub fn batch_stats(
    state: &RolloutState,
    parents: impl IntoIterator<Item = ParentHealth>,
    now: i64,
) -> BatchStats {
    let mut b = BatchStats {
        age: u64::try_from(now - state.step_started).unwrap_or(0),
        step: state.step as u64,
        ..Default::default()
    };
    for p in parents {
        b.parents += 1;
        if !p.on_new {
            continue;
        }
        b.total += 1;
        if p.reported_new && p.ready {
            b.ready += 1;
            continue;
        }
        // Not ready on the new version since its condition changed (never before the
        // rollout started), or, not reconciled by it yet, since the step started.
        let since = match (p.reported_new, p.ready_since) {
            (true, Some(t)) => t.max(state.started),
            _ => state.step_started,
        };
        b.not_ready_for = b.not_ready_for.max(u64::try_from(now - since).unwrap_or(0));
    }
    b.not_ready = b.total - b.ready;
    b
}

/// What the rollout does next.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Nothing: the batch runs on (why, when there is something to say).
    Hold(Option<String>),
    /// The next step's parents move.
    Advance,
    /// Every parent is on the new version.
    Complete,
    /// `failWhen` held.
    Fail(OnFailure, String),
}

/// A rule's `spec.rollout`, read for deciding.
#[derive(Clone, Debug)]
pub struct Plan {
    pub steps: Vec<(Target, Duration)>,
    pub on_failure: OnFailure,
}

impl Plan {
    /// The plan of a valid `spec.rollout` (a rule that loaded).
    pub fn of(r: &Rollout) -> Plan {
        Plan {
            steps: r
                .steps
                .iter()
                .map(|s| {
                    (
                        Target::of(s).unwrap_or(Target::Percent(100)),
                        s.pause
                            .as_ref()
                            .and_then(|p| parse_duration(p).ok())
                            .unwrap_or_default(),
                    )
                })
                .collect(),
            on_failure: OnFailure::parse(r.on_failure.as_ref()).unwrap_or(OnFailure::Rollback),
        }
    }

    /// The target of step `i` (the last step's past the end: a plan edited shorter).
    pub fn target(&self, i: usize) -> Target {
        self.steps.get(i).map_or(Target::Percent(100), |(t, _)| *t)
    }
}

/// The decision for a batch with figures `batch`, given what `gate` and `failWhen` said.
pub fn decide(
    state: &RolloutState,
    plan: &Plan,
    batch: &BatchStats,
    gate: Result<bool, String>,
    failed: Result<bool, String>,
) -> Decision {
    if state.phase != Phase::Progressing {
        return Decision::Hold(None);
    }
    if state.held {
        return Decision::Hold(Some("paused by rulebook rollout pause".into()));
    }
    if state.boundary_step != Some(state.step) {
        return Decision::Hold(Some("the batch is being placed".into()));
    }
    match failed {
        Ok(true) => {
            return Decision::Fail(
                plan.on_failure,
                format!(
                    "failWhen held at step {}: {} of {} moved parents ready, not ready for {}s",
                    state.step, batch.ready, batch.total, batch.not_ready_for
                ),
            );
        }
        Ok(false) => {}
        Err(e) => return Decision::Hold(Some(e)),
    }
    let pause = plan.steps.get(state.step).map_or(Duration::ZERO, |s| s.1);
    if batch.age < pause.as_secs() {
        return Decision::Hold(Some(format!(
            "step {} pauses {}s",
            state.step,
            pause.as_secs()
        )));
    }
    match gate {
        Ok(true) if state.step + 1 >= plan.steps.len() => Decision::Complete,
        Ok(true) => Decision::Advance,
        Ok(false) => Decision::Hold(Some(format!(
            "gate not passed: {} of {} moved parents ready",
            batch.ready, batch.total
        ))),
        Err(e) => Decision::Hold(Some(e)),
    }
}

impl RolloutState {
    /// The state after `d` at `now`; the same state when nothing changes (then nothing
    /// is written).
    pub fn after(&self, d: &Decision, now: i64) -> RolloutState {
        let mut s = self.clone();
        match d {
            Decision::Hold(msg) => s.message = msg.clone(),
            Decision::Advance => {
                s.step += 1;
                s.step_started = now;
                s.steps_started.push(now);
                s.message = None;
            }
            Decision::Complete => {
                s.phase = Phase::Complete;
                s.message = None;
                s.ended = Some(now);
            }
            Decision::Fail(OnFailure::Rollback, why) => {
                s.phase = Phase::RolledBack;
                s.message = Some(why.clone());
                s.ended = Some(now);
            }
            Decision::Fail(OnFailure::Pause, why) => {
                s.phase = Phase::Paused;
                s.message = Some(why.clone());
            }
        }
        s
    }
}

/// Why a change of a rule cannot run as two versions side by side.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotProgressive {
    #[error("the parent kind changed")]
    Parent,
    #[error("spec.crd changed (the CRD is one for both versions)")]
    Crd,
    #[error("spec.references changed (both versions share the reference caches)")]
    References,
    #[error("the old version has children of {0}, which the new one does not watch")]
    ChildKind(String),
}

/// Whether the change from `old` to `new` can roll out progressively: the same parent
/// kind, CRD and references, and no kind of child the new version does not have (both
/// versions run on the new version's caches). Anything else applies at once.
pub fn progressive(
    old: &crate::rules::Rule,
    new: &crate::rules::Rule,
) -> Result<(), NotProgressive> {
    let (o, n) = (&old.spec, &new.spec);
    if o.parent.api_version.value != n.parent.api_version.value
        || o.parent.kind.value != n.parent.kind.value
    {
        return Err(NotProgressive::Parent);
    }
    if json(&o.crd) != json(&n.crd) {
        return Err(NotProgressive::Crd);
    }
    if json(&o.references) != json(&n.references) {
        return Err(NotProgressive::References);
    }
    for c in &o.children {
        if !n
            .children
            .iter()
            .any(|d| d.api_version.value == c.api_version.value && d.kind.value == c.kind.value)
        {
            return Err(NotProgressive::ChildKind(format!(
                "{} {}",
                c.api_version.value, c.kind.value
            )));
        }
    }
    Ok(())
}

/// A value as JSON, to compare two versions of a rule section (locations aside).
fn json<T: Serialize>(v: &T) -> Option<serde_json::Value> {
    serde_json::to_value(v).ok()
}

#[cfg(test)]
mod tests;

/// The batch (step index) each parent would move in if the rollout started now, for
/// keys sorted as the coordinator sorts them: the first step whose boundary (over every
/// parent, as [`boundary`] computes it) holds the key. What `rulebook diff` prints.
pub fn batches(sorted_keys: &[RankKey], plan: &Plan) -> Vec<usize> {
    let mut bounds: Vec<Option<RankKey>> = Vec::with_capacity(plan.steps.len());
    for i in 0..plan.steps.len() {
        // A boundary never goes back (the coordinator keeps the greater).
        let b = boundary(sorted_keys, plan.target(i)).max(bounds.last().copied().flatten());
        bounds.push(b);
    }
    sorted_keys
        .iter()
        .map(|k| {
            bounds
                .iter()
                .position(|b| b.is_some_and(|b| *k <= b))
                .unwrap_or(plan.steps.len().saturating_sub(1))
        })
        .collect()
}
