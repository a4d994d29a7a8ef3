//! What a rule's reconciles remember so as not to redo work whose inputs did not change.
//!
//! - [`Steady`]: per parent, a fingerprint of every input of its last reconcile that
//!   found nothing to do (the parent's resourceVersion, its live children's and its
//!   referenced objects' UIDs and resourceVersions). A reconcile whose inputs have the
//!   same fingerprint would render the same children, find them up to date and compute
//!   the same status, so it stops after observing: a resync of an unchanged parent costs
//!   a hash of a few strings, not a render. A reconcile that wrote marks the inputs its
//!   writes will leave (the children as applied, the parent as its status write left
//!   it) when its render does not read the live children, and awaits those writes'
//!   watch events, which then bring no reconcile ([`Steady::expects`]); a reconcile that
//!   comes anyway stops early too.
//! - [`Applied`]: per child, the resourceVersion and desired hash of Rulebook's last
//!   apply of it. A reconcile that runs before that apply reached the cache sees the old
//!   object, which differs from the desired one; it must not apply it a second time.
//!
//! - [`Created`]: the children this process created in the last few seconds, by kind and
//!   name. A reconcile that runs before such a child reached the cache would otherwise
//!   try to create it again (refused: the name is taken) and then read it; it waits for
//!   the child's watch event instead.
//!
//! - [`Backoffs`]: the parents in error backoff, by namespace and name, until when. A
//!   change of an object such a parent references does not reconcile it before then
//!   (`engine::turns`): its requeue reads the object at the end of the backoff.
//!
//! All but [`Backoffs`] are only ever a shortcut (to "nothing to do", or to waiting): a
//! miss costs the full reconcile. A [`Backoffs`] entry only ever delays a reconcile
//! that a reference's change brings, to the requeue its failure scheduled; a restart
//! forgets them (each parent is reconciled once at start) and so does a success.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::DynamicObject;
use serde_json::Value as Json;

use super::context::lock;
use crate::meta::JsonAt;

/// The fingerprint of a reconcile's inputs but the parent: its live children's and its
/// referenced objects' UIDs and resourceVersions.
pub fn observed(
    children: &[(usize, Arc<DynamicObject>)],
    refs: &std::collections::BTreeMap<String, Json>,
) -> u64 {
    observed_of(keys(children), refs)
}

/// A child as [`observed`] counts it: its kind (index in the rule context), UID and
/// resourceVersion.
pub type ChildKey = (usize, Option<String>, Option<String>);

/// The [`ChildKey`]s of `children`.
pub fn keys(children: &[(usize, Arc<DynamicObject>)]) -> Vec<ChildKey> {
    children
        .iter()
        .map(|(k, o)| (*k, o.uid(), o.resource_version()))
        .collect()
}

/// [`observed`] of children given by their keys.
pub fn observed_of(
    mut kids: Vec<ChildKey>,
    refs: &std::collections::BTreeMap<String, Json>,
) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    kids.sort();
    kids.hash(&mut h);
    for (name, v) in refs {
        name.hash(&mut h);
        let one = |o: &Json, h: &mut std::collections::hash_map::DefaultHasher| {
            o.at(&["metadata", "uid"]).and_then(Json::as_str).hash(h);
            o.at(&["metadata", "resourceVersion"])
                .and_then(Json::as_str)
                .hash(h);
        };
        match v {
            Json::Array(list) => {
                list.len().hash(&mut h);
                list.iter().for_each(|o| one(o, &mut h));
            }
            o => one(o, &mut h),
        }
    }
    h.finish()
}

/// The fingerprint of a reconcile's inputs: the parent (`parent_rv` is its
/// resourceVersion as this process knows it: its own last status write may not be in
/// the cache yet) and [`observed`].
pub fn fingerprint(parent: &DynamicObject, parent_rv: Option<u64>, observed: u64) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.uid().hash(&mut h);
    parent_rv.hash(&mut h);
    observed.hash(&mut h);
    h.finish()
}

/// What makes a parent worth reconciling, as a hash: its generation, labels,
/// annotations, finalizers and deletion — `None` for kinds without a generation (any
/// change of theirs counts).
pub fn identity(o: &DynamicObject) -> Option<u64> {
    identity_of(&o.metadata)
}

/// [`identity`] of an object's metadata.
pub fn identity_of(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Option<u64> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    m.generation?.hash(&mut h);
    m.labels.hash(&mut h);
    // As cached: without the last-applied annotation (see `cache::strip_parent`).
    m.annotations
        .iter()
        .flatten()
        .filter(|(k, _)| k.as_str() != "kubectl.kubernetes.io/last-applied-configuration")
        .for_each(|kv| kv.hash(&mut h));
    m.finalizers.hash(&mut h);
    m.deletion_timestamp.is_some().hash(&mut h);
    Some(h.finish())
}

/// Per parent UID, the fingerprint of its last reconcile that had nothing to do, the
/// hash of the parent's namespace (`None` for a cluster-scoped parent), so a sharded
/// replica forgets what it remembers of parents that left its share, and the children
/// whose watch events this process's own writes will bring ([`Steady::expects`]).
#[derive(Default)]
pub struct Steady(Mutex<HashMap<String, Entry>>);

/// Writes awaited per parent at most (then forgotten: a miss costs a reconcile that
/// stops early).
const AWAITED_MAX: usize = 64;

struct Entry {
    /// `None` while only writes are awaited.
    fingerprint: Option<u64>,
    namespace: Option<u64>,
    /// Children written, as (hash of UID, resourceVersion of the write's answer), until
    /// that version's watch event comes.
    awaited: Vec<(u64, u64)>,
}

impl Steady {
    pub fn holds(&self, uid: &str, fingerprint: u64) -> bool {
        lock(&self.0).get(uid).and_then(|e| e.fingerprint) == Some(fingerprint)
    }
    /// A reconcile of parent `uid` that wrote nothing had these inputs.
    pub fn mark(&self, uid: &str, namespace: Option<&str>, fingerprint: u64) {
        let entry = Entry {
            fingerprint: Some(fingerprint),
            namespace: namespace.map(crate::shard::fnv1a),
            awaited: Vec::new(),
        };
        lock(&self.0).insert(uid.to_string(), entry);
    }
    /// A reconcile of parent `uid` wrote, and its writes leave the inputs `fingerprint`
    /// counts: the writes it awaits stay awaited.
    pub fn mark_written(&self, uid: &str, namespace: Option<&str>, fingerprint: u64) {
        let mut m = lock(&self.0);
        match m.get_mut(uid) {
            Some(e) => e.fingerprint = Some(fingerprint),
            None => {
                let entry = Entry {
                    fingerprint: Some(fingerprint),
                    namespace: namespace.map(crate::shard::fnv1a),
                    awaited: Vec::new(),
                };
                m.insert(uid.to_string(), entry);
            }
        }
    }
    /// A reconcile of parent `parent` wrote child `child`, and the answer carried
    /// resourceVersion `rv`: that version's watch event is awaited. Only for rules whose
    /// reconciles read neither the live children nor the parent's status, so that the
    /// writing reconcile's outcome is what another would have: it marks the inputs its
    /// writes leave ([`Steady::mark_written`]); or it fails, or waits for a child it
    /// wrote before, and is retried either way.
    pub fn await_write(&self, parent: &str, namespace: Option<&str>, child: &str, rv: u64) {
        let mut m = lock(&self.0);
        let e = m.entry(parent.to_string()).or_insert_with(|| Entry {
            fingerprint: None,
            namespace: namespace.map(crate::shard::fnv1a),
            awaited: Vec::new(),
        });
        // One version awaited a child: an earlier one's event may still come, and then
        // brings a reconcile that stops early; nothing piles up.
        let child = crate::shard::fnv1a(child);
        e.awaited.retain(|(c, _)| *c != child);
        if e.awaited.len() >= AWAITED_MAX {
            e.awaited = Vec::new();
        }
        e.awaited.push((child, rv));
    }
    /// A reconcile of `parent` begins: what earlier reconciles awaited is no longer
    /// awaited (it decides from the caches as they are now, and an awaited event it does
    /// not see would have to bring another: a child it finds missing and does not prune,
    /// a write it finds pending, a prune refused because the child moved on). Returns
    /// what was awaited, for [`Steady::resume`].
    pub fn begin(&self, parent: &str) -> Vec<(u64, u64)> {
        let mut m = lock(&self.0);
        m.get_mut(parent)
            .map(|e| std::mem::take(&mut e.awaited))
            .unwrap_or_default()
    }
    /// The reconcile that began with [`Steady::begin`] stopped at the fingerprint: it
    /// decided nothing (the inputs are those the last writing reconcile marked, with the
    /// children behind counted as written), so what that reconcile awaited is awaited
    /// again. (An awaited event that came in between brought a reconcile; it will not
    /// come again.)
    pub fn resume(&self, parent: &str, awaited: Vec<(u64, u64)>) {
        if awaited.is_empty() {
            return;
        }
        if let Some(e) = lock(&self.0).get_mut(parent) {
            let mine = std::mem::take(&mut e.awaited);
            e.awaited = awaited;
            e.awaited.extend(mine);
        }
    }
    /// Whether a watch event of child `child` at resourceVersion `rv` is one awaited for
    /// parent `parent` ([`Steady::await_write`]): the answer to this process's own write.
    /// It needs no reconcile: while the writing reconcile runs, it leaves (or retries)
    /// exactly those inputs; after it, and until another reconcile begins, the cache
    /// moves towards the inputs it marked (with all its writes in, a reconcile would stop
    /// at the fingerprint; before, it would count the children behind as written:
    /// `Applied::keys_as_applied`), and the status counts them already. The caches hold
    /// the event before this is asked, so a reconcile that begins after it sees it. Any
    /// other version of the child (an edit by someone else, even right after), its
    /// deletion or a relist does not match, nor does a write awaited before a reconcile
    /// that has begun since. Each awaited event matches once.
    pub fn expects(&self, parent: &str, child: &str, rv: u64) -> bool {
        let mut m = lock(&self.0);
        let Some(entry) = m.get_mut(parent) else {
            return false;
        };
        let key = (crate::shard::fnv1a(child), rv);
        let Some(i) = entry.awaited.iter().position(|a| *a == key) else {
            return false;
        };
        entry.awaited.swap_remove(i);
        if entry.awaited.is_empty() {
            entry.awaited = Vec::new();
        }
        true
    }
    pub fn forget(&self, uid: &str) {
        lock(&self.0).remove(uid);
    }
    /// Keeps only the parents `keep` says exist.
    pub fn retain_uids(&self, keep: impl Fn(&str) -> bool) {
        lock(&self.0).retain(|uid, _| keep(uid));
    }
    /// Keeps only the parents whose namespace hash `keep` holds (and every
    /// cluster-scoped one: such a rule moves whole, and runs here only when it is ours).
    pub fn retain_namespaces(&self, keep: impl Fn(u64) -> bool) {
        lock(&self.0).retain(|_, e| e.namespace.is_none_or(&keep));
    }
    pub fn len(&self) -> usize {
        lock(&self.0).len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Children applied at most remembered (then forgotten; a miss costs a second apply).
const APPLIED_MAX: usize = 10_000;

/// Per child UID, the resourceVersion and desired hash of Rulebook's last apply.
#[derive(Default)]
pub struct Applied(Mutex<HashMap<String, (u64, String)>>);

impl Applied {
    pub fn record(&self, applied: &DynamicObject, hash: &str) {
        let (Some(uid), Some(rv)) = (applied.uid(), rv(applied)) else {
            return;
        };
        let mut m = lock(&self.0);
        if m.len() >= APPLIED_MAX {
            m.clear();
        }
        m.insert(uid, (rv, hash.to_string()));
    }

    /// Whether `cached` is an older version of an object Rulebook has already applied
    /// with desired hash `hash` (so applying it again would write the same thing). Once
    /// the cache has caught up, the entry goes.
    pub fn ahead_of_cache(&self, cached: &DynamicObject, hash: &str) -> bool {
        let (Some(uid), Some(seen)) = (cached.uid(), rv(cached)) else {
            return false;
        };
        let mut m = lock(&self.0);
        match m.get(&uid) {
            Some((written, h)) if seen < *written => h == hash,
            Some(_) => {
                m.remove(&uid);
                false
            }
            None => false,
        }
    }

    /// Forgets the entry of child `uid` when the cache has caught up with it (its watch
    /// event at `rv` came and brought no reconcile: [`Steady::expects`]).
    pub fn caught_up(&self, uid: &str, rv: u64) {
        let mut m = lock(&self.0);
        if m.get(uid).is_some_and(|(written, _)| rv >= *written) {
            m.remove(uid);
        }
    }

    /// The [`ChildKey`]s of `children`, each one the cache holds in an older version than
    /// this process applied keyed by the version it applied: the inputs as they are about
    /// to be, which is what the reconcile that applied it fingerprinted for the one its
    /// writes bring ([`keys`] else). So when a parent's two changed children reach the
    /// cache one event at a time, the reconcile the first brings stops early too, instead
    /// of rendering again to find the other pending. A version newer than the one applied
    /// (someone else's write) is taken as it is, and does not match.
    pub fn keys_as_applied(&self, children: &[(usize, Arc<DynamicObject>)]) -> Vec<ChildKey> {
        let m = lock(&self.0);
        if m.is_empty() {
            return keys(children);
        }
        children
            .iter()
            .map(|(k, o)| {
                let written = o
                    .metadata
                    .uid
                    .as_deref()
                    .and_then(|uid| m.get(uid))
                    .filter(|(written, _)| rv(o).is_some_and(|seen| seen < *written));
                match written {
                    Some((written, _)) => (*k, o.uid(), Some(written.to_string())),
                    None => (*k, o.uid(), o.resource_version()),
                }
            })
            .collect()
    }

    /// Forgets the entries of `children` that the cache has caught up with: a reconcile
    /// that stops early never plans them, which is where [`Applied::ahead_of_cache`]
    /// would.
    pub fn forget_caught_up(&self, children: &[(usize, Arc<DynamicObject>)]) {
        let mut m = lock(&self.0);
        if m.is_empty() {
            return;
        }
        for (_, o) in children {
            if let (Some(uid), Some(seen)) = (o.metadata.uid.as_deref(), rv(o))
                && m.get(uid).is_some_and(|(written, _)| seen >= *written)
            {
                m.remove(uid);
            }
        }
    }
}

/// How long after its create a child missing from the cache is taken to be on its way
/// there (a watch event is normally milliseconds behind; past this, it was deleted).
pub const CREATED_LAG: Duration = Duration::from_secs(10);

/// Children created at most remembered (then all are forgotten: a miss costs a refused
/// create and a read).
const CREATED_MAX: usize = 10_000;

/// Children this process created, by [`Created::key`], with when.
#[derive(Default)]
pub struct Created(Mutex<HashMap<String, Instant>>);

impl Created {
    /// The key of a child: its kind's position among the rule's kinds, namespace, name.
    pub fn key(kind: usize, namespace: Option<&str>, name: &str) -> String {
        format!("{kind}/{}/{name}", namespace.unwrap_or(""))
    }

    pub fn record(&self, key: String, now: Instant) {
        let mut m = lock(&self.0);
        // Most entries are never asked about (the cache is usually first): drop the old
        // ones now and then, as the map doubles.
        if m.len() >= 64 && m.len().is_power_of_two() {
            m.retain(|_, at| now.saturating_duration_since(*at) < CREATED_LAG);
        }
        if m.len() >= CREATED_MAX {
            m.clear();
        }
        m.insert(key, now);
    }

    /// Whether the child at `key`, which the cache does not hold, was created by this
    /// process less than [`CREATED_LAG`] ago: its watch event is still to come (and
    /// reconciles the parent again). Asked again before the cache has it — the parent's
    /// other children's events reconcile it meanwhile — the answer stays yes: each of
    /// those reconciles would otherwise send a create the API server refuses, and a read.
    pub fn on_its_way(&self, key: &str, now: Instant) -> bool {
        let mut m = lock(&self.0);
        match m.get(key) {
            Some(at) if now.saturating_duration_since(*at) < CREATED_LAG => true,
            Some(_) => {
                m.remove(key);
                false
            }
            None => false,
        }
    }

    /// The cache holds the child whose key `key` builds now: a later miss means it was
    /// deleted, and is created again at once. (At steady state no create awaits its watch
    /// event, and the key is not built.)
    pub fn arrived(&self, key: impl FnOnce() -> String) {
        let mut m = lock(&self.0);
        if !m.is_empty() {
            m.remove(&key());
        }
    }
}

/// Tokio's clock: the retries sleep on it (and tests pause it).
type TokioInstant = tokio::time::Instant;

/// A parent: `(namespace, name)`.
pub type ParentKey = (Option<String>, String);

/// The parents in error backoff, until when (see the module comment), and their retries:
/// [`Backoffs::retries`] names each parent when its backoff ends, for the rule's turns to
/// reconcile it (a retry takes its namespace's turn like any other trigger: a flood of
/// failing parents retried together does not hold back other namespaces). An entry goes
/// with the parent's next success or its retry.
#[derive(Default)]
pub struct Backoffs {
    state: Mutex<BackoffState>,
    /// Woken when a backoff is set: the retries may be due earlier.
    changed: tokio::sync::Notify,
}

#[derive(Default)]
struct BackoffState {
    until: HashMap<ParentKey, TokioInstant>,
    due: std::collections::BTreeSet<(TokioInstant, ParentKey)>,
}

impl Backoffs {
    /// Parent `key` failed, to be retried at `until`.
    pub fn failed(&self, key: ParentKey, until: TokioInstant) {
        let mut s = lock(&self.state);
        if let Some(was) = s.until.insert(key.clone(), until) {
            s.due.remove(&(was, key.clone()));
        }
        s.due.insert((until, key));
        drop(s);
        self.changed.notify_one();
    }

    /// Parent `key` reconciled without error: no retry.
    pub fn succeeded(&self, key: &ParentKey) {
        let mut s = lock(&self.state);
        if let Some(was) = s.until.remove(key) {
            s.due.remove(&(was, key.clone()));
        }
    }

    /// Whether parent `key` is in error backoff at `now`.
    pub fn holds(&self, key: &ParentKey, now: TokioInstant) -> bool {
        lock(&self.state).until.get(key).is_some_and(|t| *t > now)
    }

    pub fn len(&self) -> usize {
        lock(&self.state).until.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The parent whose retry is due at `now`, taken out.
    fn take_due(&self, now: TokioInstant) -> Result<ParentKey, Option<TokioInstant>> {
        let mut s = lock(&self.state);
        match s.due.first() {
            Some((at, _)) if *at <= now => {}
            Some((at, _)) => return Err(Some(*at)),
            None => return Err(None),
        }
        let (_, key) = s.due.pop_first().ok_or(None)?;
        s.until.remove(&key);
        Ok(key)
    }

    /// Each parent as its backoff ends.
    pub fn retries(self: Arc<Self>) -> impl futures::Stream<Item = ParentKey> + Send + 'static {
        futures::stream::unfold(self, |b| async move {
            loop {
                match b.take_due(TokioInstant::now()) {
                    Ok(key) => return Some((key, b)),
                    Err(Some(at)) => {
                        tokio::select! {
                            () = tokio::time::sleep_until(at) => {}
                            () = b.changed.notified() => {}
                        }
                    }
                    Err(None) => b.changed.notified().await,
                }
            }
        })
    }
}

/// A resourceVersion as a number (etcd revisions); `None` when it is not one.
fn rv(o: &DynamicObject) -> Option<u64> {
    o.resource_version().and_then(|v| v.parse().ok())
}

#[cfg(test)]
#[path = "memo_tests.rs"]
mod tests;
