//! Per-parent memory: everything a rule's reconciles remember between one reconcile and
//! the next, in one [`ParentMemory`] per running rule. The reconcile stages and the
//! engine's watches ask it questions; none reaches into its maps.
//!
//! # What is kept
//!
//! | memo | keyed by | what | file |
//! |---|---|---|---|
//! | failures | parent UID | reconciles in a row that failed (the error backoff's exponent) | `notes.rs` |
//! | last warning | parent UID | a digest of the last Warning event's text, so a repeated one is not sent again | `notes.rs` |
//! | teardown | parent UID | children let go of, and since when children in deletion are waited for | `notes.rs` |
//! | teardowns | parent UID | the deletion time of each parent whose teardown runs (the oldest is a metric) | here |
//! | steady | parent UID | the fingerprint of the last reconcile with nothing to do; the watch events of own writes awaited | `steady.rs` |
//! | status writes | parent UID | the status this process last wrote, until the watch delivers it | `status_writes.rs` |
//! | paused | parent UID | parents held by `rulebook.dev/paused` (counted on `/status`) | `paused.rs` |
//! | backoffs | parent name | parents in error backoff, until when (and their retries) | `backoff.rs` |
//! | applied | child UID | resourceVersion and desired hash of this process's last apply | `applied.rs` |
//! | created | child kind/name | children created in the last few seconds | `applied.rs` |
//! | hash only | child UID | children whose managed fields do not mirror the desired object | here |
//! | fights | child UID | repairs of a child someone else keeps changing, and their backoff | `fight.rs` |
//! | orphans pending | rule | whether children of a dropped kind wait to be orphaned; kinds cleaned up | `orphans.rs` |
//! | records version | rule | whether parents' status records `ruleVersion` | here |
//!
//! # When it is dropped
//!
//! - **A parent deleted**: its delete event (through [`ParentMemory::parent_event`]) and,
//!   for one deleted while the watch was down, the next listing of the parents without it
//!   make the next reconcile of the rule forget every memo keyed by its UID
//!   ([`ParentMemory::forget_gone`]). Its backoff entry goes with its retry.
//! - **A parent's state moves on**: a success forgets its failures, last warning and
//!   backoff; a finished teardown its teardown; a reconcile that wrote its steady
//!   fingerprint (or replaces it); a status write's entry goes once the watch delivered it.
//! - **The rule's controller stops** (rule reloaded or removed, lease lost, share handed
//!   over): the whole value goes with its [`RuleContext`](super::RuleContext), except
//!   `steady`, which the engine keeps per rule version (`engine::Engine`): a controller
//!   restarted over the same version keeps its fingerprints, a new version starts empty,
//!   and a sharded replica forgets those of namespaces that left its share
//!   (`Engine::forget_outside`). `orphans pending` belongs to the engine's clean-up of
//!   dropped kinds (`engine::dropped`) and lives as long as it.
//!
//! # Bounds
//!
//! Nothing here grows with what a tenant does beyond what exists: the memos keyed by
//! parent hold at most one entry per parent in the cache (forgotten as above); steady
//! awaits at most 64 writes per parent; the memos keyed by child are capped (applied,
//! created and hash only at 10,000 entries, then cleared: a miss costs a second apply, a
//! refused create or a field check), fights are forgotten 10 minutes after their last
//! repair, status writes 10 minutes after the write at most, and teardown's children let
//! go of are only those still owned.
//!
//! # What a restart loses, and why that is safe
//!
//! All of it. Every memo but backoffs, fights and the last warning is only ever a
//! shortcut — to "nothing to do" (steady), to waiting for the cache (applied, created,
//! status writes), to a cheaper check (hash only) — and a miss costs the full reconcile,
//! which each parent gets once at start anyway. Backoffs and fights only ever delay
//! work: a restart retries at once, and a fight that goes on is found again within
//! four repairs. A warning may be recorded once more. A teardown starts its wait for
//! children in deletion again (bounded by `teardown::WAVE_TIMEOUT` per process) and
//! finds the children it let go of in the cluster. `paused` and `orphans pending` are
//! rebuilt from the parents' labels and the rule's record by the first reconciles.

mod applied;
mod backoff;
pub mod digest;
mod fight;
mod notes;
mod orphans;
mod paused;
mod status_writes;
mod steady;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::DynamicObject;
use kube::runtime::watcher;
use parking_lot::Mutex;
use serde_json::Value as Json;

pub use applied::{CREATED_LAG, Created};
pub use backoff::{BackoffPolicy, Backoffs, ParentKey};
pub use orphans::OrphansPending;
pub use paused::Paused;
pub use steady::Steady;

use crate::reconcile::error::ReconcileError;

/// The writes a parent's steady entry awaited when its reconcile began
/// ([`ParentMemory::begin`]), to be awaited again if it stops at the fingerprint.
pub struct Awaited(Vec<(u64, u64)>);

/// Children checked by hash only, remembered at most (then forgotten and found again).
const HASH_ONLY_MAX: usize = 10_000;

/// What a [`ParentMemory`] is built from: the parts that outlive one run of the rule's
/// controller.
pub struct MemoryParts {
    /// What this rule version's reconciles found steady (kept by the engine across
    /// restarts of the same version).
    pub steady: Arc<Steady>,
    /// The engine's clean-up of kinds an earlier version of the rule had.
    pub orphans_pending: Arc<OrphansPending>,
    /// Whether parents' status records `ruleVersion` to begin with (the rule has a CRD).
    pub records_version: bool,
}

/// Everything one running rule remembers per parent (and per child, and the two facts per
/// rule its reconciles read): see the module comment for what, until when, and why a
/// restart may lose it.
pub struct ParentMemory {
    notes: notes::Notes,
    hash_only: Mutex<HashSet<String>>,
    fights: fight::Fights,
    steady: Arc<Steady>,
    applied: applied::Applied,
    created: Created,
    backoffs: Arc<Backoffs>,
    paused: Arc<Paused>,
    status_writes: status_writes::StatusWrites,
    orphans_pending: Arc<OrphansPending>,
    records_version: AtomicBool,
    /// Parents in teardown: their deletion time (Unix seconds).
    teardowns: Mutex<BTreeMap<String, i64>>,
}

impl ParentMemory {
    pub fn new(parts: MemoryParts) -> ParentMemory {
        ParentMemory {
            notes: notes::Notes::default(),
            hash_only: Mutex::default(),
            fights: fight::Fights::default(),
            steady: parts.steady,
            applied: applied::Applied::default(),
            created: Created::default(),
            backoffs: Arc::default(),
            paused: Arc::default(),
            status_writes: status_writes::StatusWrites::default(),
            teardowns: Mutex::default(),
            orphans_pending: parts.orphans_pending,
            records_version: AtomicBool::new(parts.records_version),
        }
    }

    // --- What the engine's watches tell it, and what they ask.

    /// A parent watch event: the status writes the cache now holds, the parents deleted,
    /// a new listing of the parents.
    pub fn parent_event(&self, event: &watcher::Event<DynamicObject>) {
        self.status_writes.observe(event);
    }

    /// Whether a watch event of child `child` at resourceVersion `rv` is one awaited for
    /// parent `parent`: the answer to this process's own write, which needs no reconcile
    /// ([`Steady::expects`]). If so, the child is noted as caught up, as a reconcile
    /// finding it cached would (`created_key` builds its [`Created::key`]).
    pub fn own_write_seen(
        &self,
        parent: &str,
        child: &str,
        rv: u64,
        created_key: impl FnOnce() -> String,
    ) -> bool {
        if !self.steady.expects(parent, child, rv) {
            return false;
        }
        self.applied.caught_up(child, rv);
        self.created.arrived(created_key);
        true
    }

    /// The parents in error backoff: the rule's turns ask it whether a reference's change
    /// may reconcile a parent now, and take the retries from it.
    pub fn backoffs(&self) -> &Arc<Backoffs> {
        &self.backoffs
    }

    /// The paused parents, counted on the operator's `/status`.
    pub fn paused(&self) -> &Arc<Paused> {
        &self.paused
    }

    // --- Forgetting.

    /// Forgets what is remembered of parents that were deleted, and — after a new
    /// listing of the parents — of those `live` (the UIDs the parent cache holds) no
    /// longer has: deleted while the watch was down, or while this rule's controller was
    /// stopped. Bounds what is remembered of children.
    pub fn forget_gone(&self, live: impl FnOnce() -> HashSet<String>) {
        for uid in self.status_writes.take_gone() {
            self.teardowns.lock().remove(&uid);
            self.paused.set(&uid, false);
            self.steady.forget(&uid);
            self.notes.forget(&uid);
        }
        if self.status_writes.take_relisted() {
            let live = live();
            let keep = |uid: &str| live.contains(uid);
            self.notes.retain(keep);
            self.teardowns.lock().retain(|uid, _| keep(uid));
            self.paused.retain(keep);
            self.steady.retain_uids(keep);
        }
        let mut hash_only = self.hash_only.lock();
        if hash_only.len() > HASH_ONLY_MAX {
            hash_only.clear();
        }
    }

    // --- A reconcile's outcome.

    /// Parent `uid` (`key`) reconciled without error.
    pub fn succeeded(&self, uid: &str, key: &ParentKey) {
        self.notes.succeeded(uid);
        self.backoffs.succeeded(key);
    }

    /// Counts a failure of parent `uid`; returns how many in a row. (Its backoff is
    /// recorded by the error policy, which decides it: [`ParentMemory::back_off`].)
    pub fn failed(&self, uid: &str) -> u32 {
        self.notes.failed(uid)
    }

    /// Parent `key` failed, to be retried at `until`.
    pub fn back_off(&self, key: ParentKey, until: tokio::time::Instant) {
        self.backoffs.failed(key, until);
    }

    pub fn set_paused(&self, uid: &str, paused: bool) {
        self.paused.set(uid, paused);
    }

    // --- Steady: whether a reconcile has anything to do.

    /// A reconcile of `uid` begins: what earlier ones awaited is no longer awaited
    /// ([`Steady::begin`]).
    pub fn begin(&self, uid: &str) -> Awaited {
        Awaited(self.steady.begin(uid))
    }

    /// The reconcile that began stopped at the fingerprint: what was awaited is again.
    pub fn resume(&self, uid: &str, awaited: Awaited) {
        self.steady.resume(uid, awaited.0);
    }

    /// The fingerprint of a reconcile's inputs ([`digest::fingerprint`]) with the parent
    /// as this process knows it (its own last status write may not be cached yet).
    pub fn fingerprint(&self, uid: &str, parent: &DynamicObject, observed: u64) -> u64 {
        let rv = self.status_writes.latest_rv(uid, parent);
        digest::fingerprint(parent, rv, observed)
    }

    /// Whether parent `uid` with these live children and references has the inputs of a
    /// reconcile that had nothing to do. A child this process applied and the cache has
    /// not caught up with counts as applied ([`applied::Applied::keys_as_applied`]).
    pub fn is_steady(
        &self,
        uid: &str,
        parent: &DynamicObject,
        live_children: &[(usize, Arc<DynamicObject>)],
        refs: &BTreeMap<String, Json>,
    ) -> bool {
        let kids = self.applied.keys_as_applied(live_children);
        let inputs = self.fingerprint(uid, parent, digest::observed_of(kids, refs));
        if !self.steady.holds(uid, inputs) {
            return false;
        }
        self.applied.forget_caught_up(live_children);
        true
    }

    /// A reconcile of parent `uid` that wrote nothing had inputs `fingerprint`.
    pub fn mark_steady(&self, uid: &str, namespace: Option<&str>, fingerprint: u64) {
        self.steady.mark(uid, namespace, fingerprint);
    }

    /// A reconcile of parent `uid` wrote, and its writes leave inputs `fingerprint`.
    pub fn mark_written(&self, uid: &str, namespace: Option<&str>, fingerprint: u64) {
        self.steady.mark_written(uid, namespace, fingerprint);
    }

    /// Parent `uid`'s next reconcile is a full one.
    pub fn forget_steady(&self, uid: &str) {
        self.steady.forget(uid);
    }

    // --- The parent's status as this process wrote it.

    /// The status of this process's last write of parent `uid` if `cached` predates it.
    pub fn status_written_since(&self, uid: &str, cached: &DynamicObject) -> Option<Json> {
        self.status_writes.newer_than(uid, cached)
    }

    /// This process wrote parent `uid`'s status `status`; the answer had `meta`, whose
    /// resourceVersion is `rv`.
    pub fn status_written(&self, uid: String, rv: u64, meta: &ObjectMeta, status: &Json) {
        let identity = digest::identity_of(meta);
        self.status_writes.record(uid, rv, identity, status);
    }

    /// Whether parents' status records `ruleVersion` (see `status.rs`).
    pub fn records_version(&self) -> bool {
        self.records_version.load(Ordering::Relaxed)
    }

    /// The parent kind's schema dropped `ruleVersion`: it is no longer recorded. Whether
    /// it was until now.
    pub fn stop_recording_version(&self) -> bool {
        self.records_version.swap(false, Ordering::Relaxed)
    }

    // --- Children: this process's writes the caches have not shown yet.

    /// The cache holds the child whose [`Created::key`] `key` builds.
    pub fn child_cached(&self, key: impl FnOnce() -> String) {
        self.created.arrived(key);
    }

    /// Whether `cached` is an older version of a child this process applied with desired
    /// hash `hash` ([`applied::Applied::ahead_of_cache`]).
    pub fn applied_ahead_of(&self, cached: &DynamicObject, hash: &str) -> bool {
        self.applied.ahead_of_cache(cached, hash)
    }

    /// Whether the child at `key`, which the cache does not hold, was created by this
    /// process less than [`CREATED_LAG`] ago.
    pub fn created_on_its_way(&self, key: &str, now: Instant) -> bool {
        self.created.on_its_way(key, now)
    }

    /// This process created the child at `key`.
    pub fn created(&self, key: String, now: Instant) {
        self.created.record(key, now);
    }

    /// This process applied `applied` with desired hash `hash`.
    pub fn applied(&self, applied: &DynamicObject, hash: &str) {
        self.applied.record(applied, hash);
    }

    /// The watch event of child `child` at `rv`, written by a reconcile of `parent`, is
    /// awaited ([`Steady::await_write`]).
    pub fn await_write(&self, parent: &str, namespace: Option<&str>, child: &str, rv: u64) {
        self.steady.await_write(parent, namespace, child, rv);
    }

    /// Whether child `uid` is checked by its hash only.
    pub fn checked_by_hash_only(&self, uid: &str) -> bool {
        self.hash_only.lock().contains(uid)
    }

    /// Child `uid`'s managed fields do not mirror the desired object: it is checked by
    /// its hash only from now on.
    pub fn check_by_hash_only(&self, uid: String) {
        self.hash_only.lock().insert(uid);
    }

    /// Before repairing drift of child `uid` ([`fight::Fights::before_repair`]).
    pub fn before_repair(
        &self,
        uid: &str,
        what: &str,
        by: impl FnOnce() -> String,
        backoff: &BackoffPolicy,
        now: Instant,
    ) -> Result<(), ReconcileError> {
        self.fights.before_repair(uid, what, by, backoff, now)
    }

    // --- Warnings.

    /// Records warning `(digest, number)` on parent `uid`; `false` when the last one
    /// recorded there has the same digest (nothing new to say).
    pub fn warn_once(&self, uid: &str, digest: u64, number: u64) -> bool {
        self.notes.warn_once(uid, digest, number)
    }

    /// Warning `number` of parent `uid` was not sent: it may be recorded again.
    pub fn warning_unsent(&self, uid: &str, number: u64) {
        self.notes.warning_unsent(uid, number);
    }

    // --- Teardowns.

    /// Since when parent `uid`'s teardown waits for children in deletion (`in_deletion`:
    /// one of them is now).
    pub fn teardown_waiting_since(&self, uid: &str, in_deletion: bool) -> Option<Instant> {
        self.notes.waiting_since(uid, in_deletion)
    }

    /// The children of parent `uid` this process let go of, among `still` (those still
    /// owned; the others are forgotten).
    pub fn let_go_among(&self, uid: &str, still: &HashSet<String>) -> HashSet<String> {
        self.notes.let_go_among(uid, still)
    }

    /// This process let go of child `child` of parent `uid`.
    pub fn let_go(&self, uid: &str, child: String) {
        self.notes.let_go(uid, child);
    }

    /// Parent `uid`, deleted at `deleted` (Unix seconds), is being torn down; the
    /// deletion time of the oldest teardown that runs.
    pub fn teardown_runs(&self, uid: &str, deleted: i64) -> i64 {
        let mut t = self.teardowns.lock();
        t.entry(uid.to_string()).or_insert(deleted);
        t.values().copied().min().unwrap_or(0)
    }

    /// The deletion time of the oldest teardown that runs (0: none).
    pub fn oldest_teardown(&self) -> i64 {
        self.teardowns.lock().values().copied().min().unwrap_or(0)
    }

    /// Parent `uid`'s teardown is done.
    pub fn teardown_done(&self, uid: &str) {
        self.teardowns.lock().remove(uid);
        self.notes.teardown_done(uid);
    }

    // --- The rule's clean-up of dropped kinds.

    /// Whether children of a kind an earlier version of the rule had wait to be orphaned.
    pub fn orphans_pending(&self) -> bool {
        self.orphans_pending.get()
    }

    /// Whether every child of `(group, kind)` in `namespace` was let go of.
    pub fn orphans_cleaned(&self, group: &str, kind: &str, namespace: Option<&str>) -> bool {
        self.orphans_pending.was_cleaned(group, kind, namespace)
    }

    /// How many parents have notes (failures, a warning, a teardown): for tests.
    #[cfg(test)]
    fn parents_noted(&self) -> usize {
        self.notes.len()
    }
}

#[cfg(test)]
mod tests;
