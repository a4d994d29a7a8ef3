//! The decisions of a reconcile, as pure functions of what it observed: for each desired
//! child whether to apply it (and why), leave it, or refuse it; in which order the
//! children are written and which are held back (a conflict holds the parent, a failure
//! its dependents); which owned children to prune; whether the parent's status needs a write; whether its changes are only a rule
//! rollout's (reported once, not per parent); the next step of a parent's
//! teardown. No API calls, no locks, no clock:
//! the stages in `apply.rs`, `prune.rs` and `status_write.rs` carry the plan out, and
//! `tests/plan.rs` specifies it with objects built in code.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::DynamicObject;
use serde_json::{Map, Value as Json};

use super::drift::{Drift, drift};
use crate::cache;
use crate::meta::JsonAt;
use crate::meta::{FIELD_MANAGER, STATUS_RULE_VERSION, labels};
use crate::render::DesiredChild;
use crate::render::mentions::{Named, mentions};
use crate::render::status::{self, ConditionState};
use crate::rules::DeletionOrder;

/// What a reconcile found under a desired child's name.
#[derive(Clone, Copy, Debug)]
pub enum Live<'a> {
    Absent,
    /// In the cache (with content).
    Cached(&'a DynamicObject),
    /// Read from the API server: not cached yet, or cached without content.
    Fetched(&'a DynamicObject),
}

/// What to do about one desired child.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChildStep {
    /// Nothing to write. `report`: the status must see this object all the same (it was
    /// read from the API server, or reached the cache after the reconcile read its children).
    UpToDate { report: bool },
    /// Apply it: missing, changed, or drifted; `adopt` when it takes over an object
    /// without a controller.
    Apply { why: Drift, adopt: bool },
    /// An object of that name belongs to someone else: leave it alone.
    Conflict { owner: String },
    /// The live object's content cannot be read (nested too deeply).
    Unreadable,
}

/// The step for one desired child of the parent with UID `parent_uid`. `seen`: the object
/// was among the children the reconcile observed (and rendered with); `hash_only`: the
/// drift check trusts the desired-hash annotation alone for this object.
pub fn plan_child(
    parent_uid: &str,
    adopt: bool,
    live: Live<'_>,
    seen: bool,
    desired: &DesiredChild,
    hash_only: bool,
) -> ChildStep {
    let (object, fetched) = match live {
        Live::Absent => (None, false),
        Live::Cached(o) => (Some(o), false),
        Live::Fetched(o) => (Some(o), true),
    };
    let object = match object {
        Some(o) if is_child_at(o, parent_uid, remote_home(desired)) => Some(o),
        Some(o) if may_adopt(adopt, o, parent_uid) => {
            return ChildStep::Apply {
                why: Drift::Missing,
                adopt: true,
            };
        }
        Some(o) => {
            return ChildStep::Conflict {
                owner: owner_description(o),
            };
        }
        None => None,
    };
    if object.is_some_and(|o| !cache::readable(o)) {
        return ChildStep::Unreadable;
    }
    match drift(
        object,
        &desired.hash,
        &desired.object,
        FIELD_MANAGER,
        hash_only,
    ) {
        None => ChildStep::UpToDate {
            report: object.is_some() && (fetched || !seen),
        },
        Some(why) => ChildStep::Apply { why, adopt: false },
    }
}

/// For each desired child (by its position in the render's list), the positions of the
/// siblings it depends on: the objects of the children it `waitFor`s, and those its
/// content names ([`crate::render::mentions`]: the Secret a Pod reads, the ServiceAccount
/// it runs as, the Namespace it goes in, ...).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dependencies {
    on: Vec<Vec<usize>>,
}

impl Dependencies {
    /// `wait_for[c]`: the positions in `spec.children` of the children child `c` waits
    /// for; `namespace`: the parent's, where a namespaced child that names none goes.
    pub fn of(desired: &[DesiredChild], wait_for: &[Vec<usize>], namespace: Option<&str>) -> Self {
        let mut on = vec![Vec::new(); desired.len()];
        if wait_for.iter().any(|w| !w.is_empty()) {
            let mut by_child: HashMap<usize, Vec<usize>> = HashMap::new();
            for (i, d) in desired.iter().enumerate() {
                by_child.entry(d.child).or_default().push(i);
            }
            for (i, d) in desired.iter().enumerate() {
                for c in wait_for.get(d.child).into_iter().flatten() {
                    on[i].extend(by_child.get(c).into_iter().flatten());
                }
            }
        }
        // The siblings others may name: by kind, namespace and name.
        let named: HashMap<(Named, Option<&str>, &str), usize> = desired
            .iter()
            .enumerate()
            .filter_map(|(i, d)| {
                let kind = Named::of(d.api_version(), d.kind())?;
                let ns = (kind != Named::Namespace)
                    .then(|| own_namespace(d, namespace))
                    .flatten();
                Some(((kind, ns, d.object_name()), i))
            })
            .collect();
        if !named.is_empty() {
            for (i, d) in desired.iter().enumerate() {
                let ns = own_namespace(d, namespace);
                for m in mentions(&d.object) {
                    let at = match m.kind {
                        Named::Namespace => None,
                        _ => m.namespace.or(ns),
                    };
                    if let Some(&j) = named.get(&(m.kind, at, m.name)) {
                        on[i].push(j);
                    }
                }
            }
        }
        for (i, deps) in on.iter_mut().enumerate() {
            deps.retain(|&j| j != i);
            deps.sort_unstable();
            deps.dedup();
        }
        Dependencies { on }
    }

    /// The positions the child at `i` depends on.
    pub fn on(&self, i: usize) -> &[usize] {
        self.on.get(i).map_or(&[], Vec::as_slice)
    }

    /// The order to write the children in: rule order, except that a child comes after
    /// those it depends on (a cycle is broken in rule order). A conflict found only when a
    /// child is written then stops the children that name it before any of them is written.
    pub fn order(&self) -> Vec<usize> {
        let n = self.on.len();
        if self.on.iter().all(Vec::is_empty) {
            return (0..n).collect();
        }
        let mut unplaced_deps: Vec<usize> = self.on.iter().map(Vec::len).collect();
        let mut dependents = vec![Vec::new(); n];
        for (i, deps) in self.on.iter().enumerate() {
            for &j in deps {
                dependents[j].push(i);
            }
        }
        let mut ready: BinaryHeap<Reverse<usize>> = (0..n)
            .filter(|&i| unplaced_deps[i] == 0)
            .map(Reverse)
            .collect();
        let mut placed = vec![false; n];
        let mut order = Vec::with_capacity(n);
        let mut first_unplaced = 0;
        while order.len() < n {
            let i = match ready.pop() {
                Some(Reverse(i)) => i,
                None => {
                    // A cycle: the first child not placed yet goes next.
                    while placed[first_unplaced] {
                        first_unplaced += 1;
                    }
                    first_unplaced
                }
            };
            if placed[i] {
                continue;
            }
            placed[i] = true;
            order.push(i);
            for &d in &dependents[i] {
                unplaced_deps[d] = unplaced_deps[d].saturating_sub(1);
                if unplaced_deps[d] == 0 && !placed[d] {
                    ready.push(Reverse(d));
                }
            }
        }
        order
    }
}

/// The namespace a desired child goes in: its own, else the parent's.
fn own_namespace<'a>(d: &'a DesiredChild, namespace: Option<&'a str>) -> Option<&'a str> {
    d.object
        .at(&["metadata", "namespace"])
        .and_then(Json::as_str)
        .or(namespace)
}

/// Why a desired child that needs a write is not written in this reconcile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// The child at this position is in conflict (its name is someone else's object):
    /// nothing new is written for the parent until that is resolved.
    Conflict(usize),
    /// The child at this position, which this one depends on, failed or was held.
    After(usize),
}

/// What a reconcile has learned of its children so far, as it writes them in
/// [`Dependencies::order`]: whether the next one may be written. A conflict holds every
/// write of the parent: a child may name the conflicting object in ways no reading
/// finds, and an object of the child's name that is someone else's is the one case
/// where writing the others would hand that object to the parent's children. A failure
/// holds only the children that depend on it: the others are written (a failing child
/// must not keep a later, unrelated one — a NetworkPolicy — from being applied).
#[derive(Debug)]
pub struct ApplyGate<'a> {
    deps: &'a Dependencies,
    conflict: Option<usize>,
    stopped: Vec<bool>,
}

impl<'a> ApplyGate<'a> {
    pub fn new(deps: &'a Dependencies) -> Self {
        ApplyGate {
            deps,
            conflict: None,
            stopped: vec![false; deps.on.len()],
        }
    }

    /// Takes in the step planned for the child at `i` before anything is written.
    pub fn planned(&mut self, i: usize, step: &ChildStep) {
        match step {
            ChildStep::Conflict { .. } => self.conflict(i),
            ChildStep::Unreadable => self.failed(i),
            ChildStep::UpToDate { .. } | ChildStep::Apply { .. } => {}
        }
    }

    /// The child at `i` is in conflict: planned so from the cache, or found so when its
    /// create was refused.
    pub fn conflict(&mut self, i: usize) {
        self.conflict.get_or_insert(i);
        self.failed(i);
    }

    /// The child at `i` failed (its read or its write).
    pub fn failed(&mut self, i: usize) {
        if let Some(s) = self.stopped.get_mut(i) {
            *s = true;
        }
    }

    /// `None` when the child at `i`, which needs a write, may have it; else why not. A
    /// held child holds the children that depend on it in turn.
    pub fn hold(&mut self, i: usize) -> Option<Hold> {
        let hold = self.conflict.map(Hold::Conflict).or_else(|| {
            self.deps
                .on(i)
                .iter()
                .find(|&&j| self.stopped.get(j).copied().unwrap_or(false))
                .map(|&j| Hold::After(j))
        });
        if hold.is_some() {
            self.failed(i);
        }
        hold
    }
}

/// For each planned step (by position), whether its write is held back, given only what
/// was planned before any write: `None` for a step that is not an `Apply` or may go.
/// (The reconcile goes on with the same [`ApplyGate`] as writes fail or are refused.)
pub fn plan_applies(steps: &[ChildStep], deps: &Dependencies) -> Vec<Option<Hold>> {
    let mut gate = ApplyGate::new(deps);
    for (i, s) in steps.iter().enumerate() {
        gate.planned(i, s);
    }
    let mut out = vec![None; steps.len()];
    for i in deps.order() {
        if let (Some(ChildStep::Apply { .. }), Some(slot)) = (steps.get(i), out.get_mut(i)) {
            *slot = gate.hold(i);
        }
    }
    out
}

/// The positions in `owned` (this parent's live children, by kind index) of those no
/// desired child names: `desired` as `(kind index, namespace, name)`.
pub fn plan_prunes(
    desired: &[(usize, Option<&str>, &str)],
    owned: &[(usize, Arc<DynamicObject>)],
) -> Vec<usize> {
    let wanted: HashSet<(usize, Option<&str>, &str)> = desired.iter().copied().collect();
    owned
        .iter()
        .enumerate()
        .filter(|(_, (k, o))| {
            let ns = o.metadata.namespace.as_deref();
            let name = o.metadata.name.as_deref().unwrap_or("");
            !wanted.contains(&(*k, ns, name))
        })
        .map(|(i, _)| i)
        .collect()
}

/// The status to write, or `None` when the parent already has it. `live` is the parent as
/// the API server holds it (its status possibly Rulebook's own last write); `managed` are
/// the status fields the rule owns; `fields` the values computed now.
pub fn plan_status(
    live: &Json,
    managed: &[&str],
    fields: &Map<String, Json>,
    ready: &ConditionState,
    now: &str,
) -> Option<Json> {
    let desired = status::desired_status(live, fields, ready, now);
    let live_status = live.get("status");
    let stale_field = managed
        .iter()
        .any(|k| !fields.contains_key(*k) && live_status.and_then(|s| s.get(*k)).is_some());
    // A condition Rulebook sets only while a parent is held (`Paused`) goes with the
    // next write: the apply leaves it out, so server-side apply removes it.
    let held = status::conditions_of(live)
        .iter()
        .any(|c| c.type_ == "Paused" && c.reason == PAUSED_REASON);
    if !stale_field && !held && status::status_matches(live_status, &desired) {
        None
    } else {
        Some(desired)
    }
}

/// Whether a reconcile of `parent` (as JSON, with its status) at `generation` runs only
/// because the rule changed: the status records a rule version other than `rule_version`,
/// written by a reconcile that went through (its `Ready` condition has reason `Ready` or
/// `ChildrenNotReady`) for the generation the parent has now. A failed reconcile keeps the
/// old version but observes the new generation, so its status never counts: the tenant's
/// change it could not apply is still to be reported.
pub fn is_rule_rollout(parent: &Json, generation: Option<i64>, rule_version: &str) -> bool {
    let Some(status) = parent.get("status") else {
        return false;
    };
    let recorded = status.get(STATUS_RULE_VERSION).and_then(Json::as_str);
    let observed = status.get("observedGeneration").and_then(Json::as_i64);
    // The conditions are parsed only when the version and generation say it may be one:
    // this runs on every reconcile that gets past the first steady check.
    recorded.is_some_and(|v| v != rule_version)
        && observed.is_some()
        && observed == generation
        && status::conditions_of(parent).iter().any(|c| {
            c.type_ == "Ready"
                && matches!(c.reason.as_str(), "Ready" | "ChildrenNotReady")
                && c.observed_generation.is_some()
                && c.observed_generation == generation
        })
}

/// Whether a change of kind `reason` is reported with a Normal Event on the parent,
/// given what brought the reconcile. A rule rollout's `Updated` children (a template
/// edit: at 10,000 parents, 10,000 Events) are reported once, by the rule's change (the
/// operator's log and `/status`), not on every parent; what a tenant needs to see on
/// its parent — a child created, pruned, orphaned or repaired — is reported whatever
/// brought it.
pub fn reported_on_parent(reason: &str, rollout: bool) -> bool {
    !(rollout && reason == "Updated")
}

/// The reason of the `Paused` condition Rulebook sets while a parent carries
/// `rulebook.dev/paused: "true"`: its own, so that another writer's `Paused` condition
/// (Cluster API writes one, reason `Paused`) is never taken for it.
pub const PAUSED_REASON: &str = "PausedByAnnotation";

/// Whether `o`'s controller reference is the parent with UID `uid`.
pub fn controlled_by(o: &DynamicObject, uid: &str) -> bool {
    o.owner_references()
        .iter()
        .any(|r| r.uid == uid && r.controller == Some(true))
}

/// The other rule of the same parent kind whose child `o` is, by its `rulebook.dev/rule`
/// label: several rules on one kind (decorators) share the parent, so the controller
/// reference alone cannot tell whose child an object is. Such an object is never this
/// rule's to apply, adopt or prune: two rules rendering one name would otherwise
/// overwrite each other's label and fight with every write.
pub fn other_rules_child<'a>(o: &'a DynamicObject, rule: &str) -> Option<&'a str> {
    o.labels()
        .get(labels::RULE)
        .map(String::as_str)
        .filter(|r| *r != rule)
}

/// Whether `o` is a child of the parent with UID `uid`: its controller reference is the
/// parent, or it is one of the parent's `Orphan` children, which carry no ownerReference
/// ([`crate::cache::wire::orphan_owner`]).
pub fn is_child_of(o: &DynamicObject, uid: &str) -> bool {
    controlled_by(o, uid) || crate::cache::wire::orphan_owner(&o.metadata) == Some(uid)
}

/// The parent's namespace a desired child placed in another namespace names
/// (`rulebook.dev/parent-namespace`, set by the render): where an object found at its
/// place may be the parent's by its claim alone.
pub fn remote_home(desired: &DesiredChild) -> Option<&str> {
    desired
        .object
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(labels::PARENT_NAMESPACE))
        .and_then(serde_json::Value::as_str)
}

/// [`is_child_of`], or, with `home` (the namespace of a namespaced parent whose rule
/// places children elsewhere, `targetNamespaces`), a child of that parent there: its
/// claim names the parent's UID and that namespace ([`crate::cache::wire::remote_claim`]).
/// Where the claim is looked at is the caller's to confine (the namespaces the parent
/// may place children in).
pub fn is_child_at(o: &DynamicObject, uid: &str, home: Option<&str>) -> bool {
    is_child_of(o, uid)
        || home.is_some_and(|h| crate::cache::wire::remote_claim(&o.metadata) == Some((uid, h)))
}

/// Whether a child with `adopt: true` may take over `o`: only an object without any
/// controller, and never one labelled as another parent's child (a tenant could name a
/// parent so that its child's name is another parent's child, or any object it wants).
pub fn may_adopt(adopt: bool, o: &DynamicObject, uid: &str) -> bool {
    adopt
        && !o
            .owner_references()
            .iter()
            .any(|r| r.controller == Some(true))
        && o.labels()
            .get(labels::OWNER)
            .is_none_or(|owner| owner == uid)
}

/// Whether a child may take over an existing object without a controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adoption {
    /// `adopt` is off: someone else's object is a conflict.
    Off,
    On,
    /// `adopt: true` on a cluster-scoped kind without `adoptUnsafe: true`: refused (the
    /// load-time check refuses the built-in kinds; this covers the kinds only discovery
    /// knows).
    ClusterScopedRefused,
}

impl Adoption {
    /// The adoption a child of `namespaced` scope gets from its rule.
    pub fn of(child: &crate::rules::ChildRule, namespaced: bool) -> Adoption {
        match (child.adopt, namespaced || child.adopt_unsafe) {
            (false, _) => Adoption::Off,
            (true, true) => Adoption::On,
            (true, false) => Adoption::ClusterScopedRefused,
        }
    }

    pub fn allowed(self) -> bool {
        self == Adoption::On
    }
}

/// The `Conflict` condition's message for child `child` (`what`: `Kind ns/name`), whose
/// name an object of someone else's (`owner`: [`owner_description`]) holds; `rulebook
/// diff` says the same.
pub fn conflict_message(what: &str, owner: &str, adoption: Adoption, child: &str) -> String {
    match adoption {
        Adoption::On => format!(
            "{what} already exists and {owner}; Rulebook adopts only objects that have no controller and no other parent's label"
        ),
        Adoption::ClusterScopedRefused => format!(
            "{what} already exists and {owner}; Rulebook adopts a cluster-scoped object only with `adoptUnsafe: true` on child '{child}'"
        ),
        Adoption::Off => format!(
            "{what} already exists and {owner}; Rulebook leaves it alone (set `adopt: true` on child '{child}' to take it over)"
        ),
    }
}

/// Who an object that is not this parent's belongs to, for the conflict message.
pub fn owner_description(o: &DynamicObject) -> String {
    match o
        .owner_references()
        .iter()
        .find(|r| r.controller == Some(true))
    {
        Some(r) => format!("is controlled by {} {}", r.kind, r.name),
        None if o.labels().contains_key(labels::OWNER) => {
            "is labelled as another parent's child".to_string()
        }
        None => "was not created by Rulebook for this parent".to_string(),
    }
}

/// Where the finalize step of a parent's teardown stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinalizeState {
    /// The rule has no finalize step, or the parent is marked as past it.
    Over,
    /// The finalize child does not exist yet.
    NotStarted,
    /// The finalize child exists and its `doneWhen` holds.
    Done,
    /// `doneWhen` does not hold yet; the timeout is `remaining` away.
    Running { remaining: Duration },
    /// `doneWhen` did not hold within the timeout.
    TimedOut,
    /// The finalize child cannot be rendered or judged (its error is reported).
    Failed,
}

/// How a finalize step ended, as recorded on the parent (`rulebook.dev/finalized`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinalizeOutcome {
    Done,
    TimedOut,
    Failed,
}

impl FinalizeOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            FinalizeOutcome::Done => "done",
            FinalizeOutcome::TimedOut => "timed-out",
            FinalizeOutcome::Failed => "failed",
        }
    }
}

/// One child a parent being torn down still owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owned {
    /// Its child's position in `spec.children` (`usize::MAX` when the rule no longer has
    /// that child: such objects go first).
    pub position: usize,
    /// Already on its way: it has a deletionTimestamp, or this process deleted it.
    pub going: bool,
}

/// The next step of a parent's teardown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TeardownStep {
    /// Render and create the finalize child.
    StartFinalize,
    /// Wait for the finalize child's `doneWhen`, at most `remaining`.
    AwaitFinalize { remaining: Duration },
    /// Record on the parent that the finalize step is over.
    MarkFinalized(FinalizeOutcome),
    /// Delete (or orphan) the children at positions `act` of the owned list and wait
    /// until they and those at `waiting` are gone.
    Wave {
        act: Vec<usize>,
        waiting: Vec<usize>,
    },
    /// Nothing left: remove Rulebook's finalizer.
    RemoveFinalizer,
}

/// The next step of a teardown: the finalize step first, then the owned children in
/// waves — one per child of the rule in reverse rule order (or one wave for all with
/// `order: parallel`), each wave gone before the next is deleted — then the finalizer.
pub fn plan_teardown(
    finalize: FinalizeState,
    owned: &[Owned],
    order: DeletionOrder,
) -> TeardownStep {
    match finalize {
        FinalizeState::Over => {}
        FinalizeState::NotStarted => return TeardownStep::StartFinalize,
        FinalizeState::Running { remaining } => return TeardownStep::AwaitFinalize { remaining },
        FinalizeState::Done => return TeardownStep::MarkFinalized(FinalizeOutcome::Done),
        FinalizeState::TimedOut => return TeardownStep::MarkFinalized(FinalizeOutcome::TimedOut),
        FinalizeState::Failed => return TeardownStep::MarkFinalized(FinalizeOutcome::Failed),
    }
    let Some(last) = owned.iter().map(|o| o.position).max() else {
        return TeardownStep::RemoveFinalizer;
    };
    let in_wave = |o: &Owned| match order {
        DeletionOrder::Reverse => o.position == last,
        DeletionOrder::Parallel => true,
    };
    let (mut act, mut waiting) = (Vec::new(), Vec::new());
    for (i, o) in owned.iter().enumerate().filter(|(_, o)| in_wave(o)) {
        if o.going {
            waiting.push(i);
        } else {
            act.push(i);
        }
    }
    TeardownStep::Wave { act, waiting }
}
