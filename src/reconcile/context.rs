//! What every reconcile of one rule shares: the resolved kinds and their caches, the
//! writer, the recorder, and the little memory kept per parent and per child (failures,
//! last warnings, fights, children checked by hash only). Built once per running rule,
//! from what the engine resolved.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::write::recorder::Recorder;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt};

use super::fight::Fights;
use super::inflight::InputBudget;
use super::memo::{Applied, Backoffs, Created, Steady};
use super::plan::is_child_of;
use super::refs::RefKind;
use super::status::StatusWrites;
use crate::meta::labels;
use crate::metrics::Metrics;
use crate::render::{CompiledRule, Scope};
use crate::write::writer::Writer;

/// A kind a rule's children have, with the cache of the rule's children of that kind.
pub struct ChildKind {
    pub ar: ApiResource,
    pub namespaced: bool,
    /// The cached children, also by owner UID.
    pub store: Arc<crate::cache::store::ChildStore>,
    /// Whether any child of this kind is read past its metadata
    /// ([`CompiledRule::reads_child_content`]); if not, its cache keeps no content, and
    /// neither does the status stage's view of an apply's answer.
    pub content_read: bool,
}

impl ChildKind {
    /// The cached child at `oref` as reconciles read it (unpacked: see
    /// [`crate::cache::Packed`]).
    pub fn cached(&self, oref: &ObjectRef<DynamicObject>) -> Option<Arc<DynamicObject>> {
        self.store.get(oref)
    }

    pub fn api(&self, client: &Client, namespace: Option<&str>) -> Api<DynamicObject> {
        match (self.namespaced, namespace) {
            (true, Some(ns)) => Api::namespaced_with(client.clone(), ns, &self.ar),
            _ => Api::all_with(client.clone(), &self.ar),
        }
    }
}

/// The parent kind as the engine resolved it.
pub struct ParentKind {
    pub ar: ApiResource,
    pub namespaced: bool,
    /// Whether the kind has a status subresource (else no status can be written).
    pub status_subresource: bool,
}

/// Everything the engine resolved for a rule, to build its [`RuleContext`] from.
pub struct ContextParts {
    pub rule: Arc<CompiledRule>,
    pub client: Client,
    pub parent: ParentKind,
    pub kinds: Vec<ChildKind>,
    /// Child index in the rule → index in `kinds`.
    pub kind_of_child: Vec<usize>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub writer: Writer,
    /// Shared with the parent watch, which tells it about status writes and deletions.
    pub status_writes: Arc<StatusWrites>,
    /// The parent cache, to reconcile the newest cached version of a parent.
    pub parent_store: Store<DynamicObject>,
    /// One cache per `spec.references[]` entry, in rule order.
    pub refs: Vec<RefKind>,
    /// The parents paused with `rulebook.dev/paused`, shared with `/status`.
    pub paused: Arc<Paused>,
    /// What this rule version's reconciles found steady (the engine keeps it across
    /// restarts of the same version).
    pub steady: Arc<Steady>,
    /// Children applied by this process, until the cache has the applied version (shared
    /// with the children's watches, which see the version arrive).
    pub applied: Arc<Applied>,
    /// Children created by this process in the last few seconds (shared with the
    /// children's watches, which see them arrive).
    pub created: Arc<Created>,
    /// Set while the engine lets go of children of kinds an earlier version of the rule
    /// had ([`OrphansPending`]).
    pub orphans_pending: Arc<OrphansPending>,
    /// The parents in error backoff (shared with the references' watches, whose changes
    /// wait them out).
    pub backoffs: Arc<Backoffs>,
    /// The process's budget of reconcile inputs in flight (one for every rule).
    pub inputs: Arc<InputBudget>,
}

/// Set while the engine lets go of the children of kinds an earlier version of the rule
/// had and some of them are to be orphaned (`engine::dropped`): the new version's caches
/// do not see them, and the garbage collector would delete them with a parent whose
/// finalizer came off. Meanwhile parents keep Rulebook's finalizer, and a parent being
/// deleted waits with it. Also what that clean-up finished: the kinds (group and kind)
/// of which it let go of every child, and where (a sharded replica's share), which the
/// parents there may take off their record of `Orphan` kinds.
#[derive(Debug)]
pub struct OrphansPending {
    running: std::sync::atomic::AtomicBool,
    cleaned: Mutex<Vec<CleanedKind>>,
    /// Counts the kinds cleaned up: the rule's parents are reconciled once more after
    /// each (their record and finalizer may come off), rather than at their next change.
    counter: tokio::sync::watch::Sender<u64>,
}

impl Default for OrphansPending {
    fn default() -> OrphansPending {
        OrphansPending::new(false)
    }
}

/// `(group, kind)`, and the share it was cleaned up in (`None`: everywhere).
type CleanedKind = ((String, String), Option<crate::shard::Ranges>);

impl OrphansPending {
    pub fn new(pending: bool) -> OrphansPending {
        OrphansPending {
            running: std::sync::atomic::AtomicBool::new(pending),
            cleaned: Mutex::default(),
            counter: tokio::sync::watch::Sender::new(0),
        }
    }

    pub fn get(&self) -> bool {
        self.running.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn clear(&self) {
        self.running
            .store(false, std::sync::atomic::Ordering::SeqCst)
    }

    /// Every child of `(group, kind)` within `share` (everywhere: `None`) was let go of.
    pub fn cleaned(&self, group_kind: (String, String), share: Option<crate::shard::Ranges>) {
        lock(&self.cleaned).push((group_kind, share));
        self.counter.send_modify(|n| *n += 1);
    }

    /// One item each time a kind is cleaned up (after this is called).
    pub fn on_cleaned(&self) -> impl futures::Stream<Item = ()> + Send + 'static {
        futures::stream::unfold(self.counter.subscribe(), |mut rx| async move {
            rx.changed().await.ok().map(|()| ((), rx))
        })
    }

    /// Whether every child of `(group, kind)` in `namespace` was let go of.
    pub fn was_cleaned(&self, group: &str, kind: &str, namespace: Option<&str>) -> bool {
        lock(&self.cleaned).iter().any(|((g, k), share)| {
            g == group
                && k == kind
                && share
                    .as_ref()
                    .is_none_or(|r| namespace.is_some_and(|ns| r.holds_namespace(ns)))
        })
    }
}

/// The UIDs of a rule's paused parents.
#[derive(Default)]
pub struct Paused(Mutex<HashSet<String>>);

impl Paused {
    pub fn set(&self, uid: &str, paused: bool) {
        let mut set = lock(&self.0);
        if paused {
            if !set.contains(uid) {
                set.insert(uid.to_string());
            }
        } else {
            set.remove(uid);
        }
    }
    pub fn count(&self) -> usize {
        lock(&self.0).len()
    }
    fn retain(&self, keep: impl Fn(&str) -> bool) {
        lock(&self.0).retain(|uid| keep(uid));
    }
}

/// What a process remembers of one parent's teardown (forgotten when it is done, or the
/// parent is gone). A restart forgets it: the children let go of are found again in the
/// cluster, and the wait for children in deletion starts again.
#[derive(Debug, Default)]
pub struct TeardownMemory {
    /// The children this process has deleted or orphaned (UIDs), so each is let go once
    /// even before the caches show it going.
    pub let_go: HashSet<String>,
    /// When this process first found one of the parent's children in deletion: the
    /// teardown waits for such children at most `teardown::WAVE_TIMEOUT` from then.
    pub waiting_since: Option<std::time::Instant>,
}

/// Everything one rule's reconciles share.
pub struct RuleContext {
    pub rule: Arc<CompiledRule>,
    pub client: Client,
    pub parent: ParentKind,
    pub kinds: Vec<ChildKind>,
    pub kind_of_child: Vec<usize>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub writer: Writer,
    pub backoff: BackoffPolicy,
    pub status_writes: Arc<StatusWrites>,
    pub parent_store: Store<DynamicObject>,
    pub refs: Vec<RefKind>,
    pub paused: Arc<Paused>,
    pub(super) failures: Mutex<HashMap<String, u32>>,
    pub(super) hash_only: Mutex<HashSet<String>>,
    /// The last warning recorded per parent (UID): a digest of its text and its number
    /// (`events.rs`), shared with the sends in flight.
    pub(super) last_warning: Arc<Mutex<HashMap<String, (u64, u64)>>>,
    pub(super) fights: Fights,
    /// Per parent being torn down, what this process remembers of its teardown.
    pub(super) teardowns: Mutex<HashMap<String, TeardownMemory>>,
    /// Parents whose last reconcile had nothing to do, by the fingerprint of its inputs.
    pub(super) steady: Arc<Steady>,
    /// Children applied by this process, until the cache has the applied version.
    pub(super) applied: Arc<Applied>,
    /// Children created by this process in the last few seconds, by kind and name.
    pub(super) created: Arc<Created>,
    /// Whether parents' status records `ruleVersion` (see `status.rs`).
    pub(super) records_version: std::sync::atomic::AtomicBool,
    pub(super) orphans_pending: Arc<OrphansPending>,
    /// The parents in error backoff, until when.
    pub(super) backoffs: Arc<Backoffs>,
    /// The process's budget of reconcile inputs in flight.
    pub(super) inputs: Arc<InputBudget>,
}

/// Children checked by hash only, remembered at most (then forgotten and found again).
const HASH_ONLY_MAX: usize = 10_000;

impl RuleContext {
    pub fn new(p: ContextParts) -> RuleContext {
        let records_version = p.rule.rule.spec.crd.is_some();
        RuleContext {
            rule: p.rule,
            client: p.client,
            parent: p.parent,
            kinds: p.kinds,
            kind_of_child: p.kind_of_child,
            recorder: p.recorder,
            metrics: p.metrics,
            writer: p.writer,
            backoff: BackoffPolicy::default(),
            status_writes: p.status_writes,
            parent_store: p.parent_store,
            refs: p.refs,
            paused: p.paused,
            failures: Mutex::default(),
            hash_only: Mutex::default(),
            last_warning: Arc::default(),
            fights: Fights::default(),
            teardowns: Mutex::default(),
            steady: p.steady,
            applied: p.applied,
            created: p.created,
            records_version: std::sync::atomic::AtomicBool::new(records_version),
            orphans_pending: p.orphans_pending,
            backoffs: p.backoffs,
            inputs: p.inputs,
        }
    }

    /// Whether parents carry Rulebook's finalizer: the rule's deletion steps or `Orphan`
    /// children say so, or children of a kind an earlier version had wait to be orphaned.
    pub fn needs_finalizer(&self) -> bool {
        self.rule.rule.spec.needs_finalizer() || self.orphans_pending.get()
    }

    /// The API of the parent's kind, where `parent` lives.
    pub fn parent_api(&self, parent: &DynamicObject) -> Api<DynamicObject> {
        self.parent_api_as(parent)
    }

    /// [`RuleContext::parent_api`], decoding into `K` (the watch's own form, say).
    pub fn parent_api_as<K>(&self, parent: &DynamicObject) -> Api<K>
    where
        K: kube::Resource<DynamicType = ApiResource, Scope = kube::core::DynamicResourceScope>,
    {
        match (self.parent.namespaced, parent.namespace()) {
            (true, Some(ns)) => Api::namespaced_with(self.client.clone(), &ns, &self.parent.ar),
            _ => Api::all_with(self.client.clone(), &self.parent.ar),
        }
    }

    /// The cache of rule child `child`'s kind.
    pub fn kind_of(&self, child: usize) -> &ChildKind {
        &self.kinds[self.kind_of_child[child]]
    }

    pub fn scope(&self, child: usize) -> Scope {
        match self
            .kind_of_child
            .get(child)
            .and_then(|k| self.kinds.get(*k))
        {
            Some(k) if !k.namespaced => Scope::Cluster,
            _ => Scope::Namespaced,
        }
    }

    /// This parent's children in the caches: labelled with its UID and controlled by it,
    /// and — for a namespaced parent — in its namespace. (An object elsewhere that claims
    /// the parent's UID is someone else's: ownerReferences never cross namespaces.)
    pub fn owned_children(
        &self,
        uid: &str,
        parent_ns: Option<&str>,
    ) -> Vec<(usize, Arc<DynamicObject>)> {
        let mut out = Vec::new();
        for (k, kind) in self.kinds.iter().enumerate() {
            for o in kind.store.owned_by(uid) {
                if self.parent.namespaced
                    && kind.namespaced
                    && o.metadata.namespace.as_deref() != parent_ns
                {
                    continue;
                }
                if o.labels().get(labels::OWNER).map(String::as_str) == Some(uid)
                    && is_child_of(&o, uid)
                {
                    out.push((k, o));
                }
            }
        }
        out
    }

    /// Whether every child cache has completed its first listing.
    pub fn children_listed(&self) -> bool {
        self.kinds.iter().all(|k| k.store.listed())
    }

    /// Whether every reference cache has completed its first listing (a teardown does
    /// not wait for them: it reads no references).
    pub fn references_listed(&self) -> bool {
        self.refs.iter().all(|r| listed(&r.store))
    }

    /// Whether reference `i`'s kind is namespaced.
    pub fn ref_scope(&self, i: usize) -> Scope {
        match self.refs.get(i) {
            Some(r) if !r.namespaced => Scope::Cluster,
            _ => Scope::Namespaced,
        }
    }

    pub fn note_success(&self, uid: &str, key: &super::memo::ParentKey) {
        lock(&self.failures).remove(uid);
        lock(&self.last_warning).remove(uid);
        self.backoffs.succeeded(key);
    }

    /// Counts a failure of parent `uid`; returns how many in a row. (Its backoff is
    /// recorded by the error policy, which decides it.)
    pub fn note_failure(&self, uid: &str) -> u32 {
        let mut f = lock(&self.failures);
        let n = f.entry(uid.to_string()).or_insert(0);
        *n = n.saturating_add(1);
        *n
    }

    /// Forgets what is remembered of parents that were deleted (failures, warnings), and
    /// bounds what is remembered of children, so per-object memory does not only grow.
    pub fn forget_gone(&self) {
        let gone = self.status_writes.take_gone();
        if !gone.is_empty() {
            let mut failures = lock(&self.failures);
            let mut warnings = lock(&self.last_warning);
            let mut teardowns = lock(&self.teardowns);
            for uid in &gone {
                self.paused.set(uid, false);
                self.steady.forget(uid);
                failures.remove(uid);
                warnings.remove(uid);
                teardowns.remove(uid);
            }
        }
        if self.status_writes.take_relisted() {
            self.forget_unlisted();
        }
        let mut hash_only = lock(&self.hash_only);
        if hash_only.len() > HASH_ONLY_MAX {
            hash_only.clear();
        }
    }

    /// Forgets what is remembered of parents the parent cache no longer holds after a
    /// listing: those deleted while the watch was down, or while this rule's controller
    /// was stopped (a lost lease, a share that moved, a rule change), sent no deletion.
    fn forget_unlisted(&self) {
        let live: HashSet<String> = self
            .parent_store
            .state()
            .iter()
            .filter_map(|o| o.uid())
            .collect();
        let keep = |uid: &str| live.contains(uid);
        lock(&self.failures).retain(|uid, _| keep(uid));
        lock(&self.last_warning).retain(|uid, _| keep(uid));
        lock(&self.teardowns).retain(|uid, _| keep(uid));
        self.paused.retain(keep);
        self.steady.retain_uids(keep);
    }
}

/// Per-object exponential backoff after failures.
#[derive(Clone, Debug)]
pub struct BackoffPolicy {
    pub base: Duration,
    pub max: Duration,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        BackoffPolicy {
            base: Duration::from_secs(1),
            max: Duration::from_secs(300),
        }
    }
}

impl BackoffPolicy {
    pub fn delay(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(20);
        let d = self.base.saturating_mul(1u32 << exp);
        d.min(self.max)
    }
}

fn listed(s: &Store<DynamicObject>) -> bool {
    use futures::FutureExt;
    matches!(s.wait_until_ready().now_or_never(), Some(Ok(())))
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let p = BackoffPolicy::default();
        assert_eq!(p.delay(1), Duration::from_secs(1));
        assert_eq!(p.delay(2), Duration::from_secs(2));
        assert_eq!(p.delay(5), Duration::from_secs(16));
        assert_eq!(p.delay(30), Duration::from_secs(300));
    }
}
