//! What this process wrote and its caches have not shown yet, per child.
//!
//! - [`Applied`]: per child, the resourceVersion and desired hash of Rulebook's last
//!   apply of it. A reconcile that runs before that apply reached the cache sees the old
//!   object, which differs from the desired one; it must not apply it a second time.
//! - [`Created`]: the children this process created in the last few seconds, by kind and
//!   name. A reconcile that runs before such a child reached the cache would otherwise
//!   try to create it again (refused: the name is taken) and then read it; it waits for
//!   the child's watch event instead.
//!
//! Both are only ever a shortcut (to waiting): a miss costs a second apply, or a refused
//! create and a read.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::DynamicObject;
use parking_lot::Mutex;

use super::digest::{ChildKey, keys};

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
        let mut m = self.0.lock();
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
        let mut m = self.0.lock();
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
        let mut m = self.0.lock();
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
        let m = self.0.lock();
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
        let mut m = self.0.lock();
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
        let mut m = self.0.lock();
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
        let mut m = self.0.lock();
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
        let mut m = self.0.lock();
        if !m.is_empty() {
            m.remove(&key());
        }
    }
}

/// A resourceVersion as a number (etcd revisions); `None` when it is not one.
fn rv(o: &DynamicObject) -> Option<u64> {
    o.resource_version().and_then(|v| v.parse().ok())
}
