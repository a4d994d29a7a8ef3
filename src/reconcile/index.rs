//! An index of cached children by the UID of the parent that owns them (their
//! `rulebook.dev/owner` label), kept from the same watch events that fill the cache, so
//! a reconcile finds its children without scanning every child of the rule.
//!
//! It holds an entry per cached child, so each key is allocated once and shared by both
//! maps, and each owner's UID once for all its children.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::watcher::Event;

use crate::meta::labels;

/// `(namespace, name)` of a cached object.
pub type Key = (Option<String>, String);

#[derive(Default)]
struct Maps {
    by_owner: HashMap<Arc<str>, HashSet<Arc<Key>>>,
    owner_of: HashMap<Arc<Key>, Arc<str>>,
}

impl Maps {
    fn insert(&mut self, o: &DynamicObject) {
        let key = (o.namespace(), o.name_any());
        self.remove(&key);
        if let Some(owner) = o.labels().get(labels::OWNER) {
            let key = Arc::new(key);
            let owner: Arc<str> = match self.by_owner.get_key_value(owner.as_str()) {
                Some((shared, _)) => shared.clone(),
                None => Arc::from(owner.as_str()),
            };
            self.by_owner
                .entry(owner.clone())
                .or_default()
                .insert(key.clone());
            self.owner_of.insert(key, owner);
        }
    }

    fn remove(&mut self, key: &Key) {
        if let Some(owner) = self.owner_of.remove(key)
            && let Some(set) = self.by_owner.get_mut(&owner)
        {
            set.remove(key);
            if set.is_empty() {
                self.by_owner.remove(&owner);
            }
        }
    }
}

#[derive(Default)]
pub struct OwnerIndex {
    live: Mutex<Maps>,
    /// A relist in progress: it replaces `live` when it completes, as the cache does.
    relist: Mutex<Option<Maps>>,
}

impl OwnerIndex {
    /// Follows one watch event.
    pub fn observe(&self, event: &Event<DynamicObject>) {
        match event {
            Event::Apply(o) => lock(&self.live).insert(o),
            Event::Delete(o) => lock(&self.live).remove(&(o.namespace(), o.name_any())),
            Event::Init => *lock(&self.relist) = Some(Maps::default()),
            Event::InitApply(o) => {
                if let Some(m) = lock(&self.relist).as_mut() {
                    m.insert(o);
                }
            }
            Event::InitDone => {
                if let Some(m) = lock(&self.relist).take() {
                    *lock(&self.live) = m;
                }
            }
        }
    }

    /// The cached objects labelled as owned by `uid`.
    pub fn owned_by(&self, uid: &str) -> Vec<Key> {
        lock(&self.live)
            .by_owner
            .get(uid)
            .map(|s| s.iter().map(|k| (**k).clone()).collect())
            .unwrap_or_default()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(name: &str, owner: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "ns", "labels": {"rulebook.dev/owner": owner}}
        }))
        .unwrap()
    }

    #[test]
    fn follows_applies_deletes_and_relists() {
        let idx = OwnerIndex::default();
        idx.observe(&Event::Apply(obj("a", "u1")));
        idx.observe(&Event::Apply(obj("b", "u1")));
        idx.observe(&Event::Apply(obj("c", "u2")));
        assert_eq!(idx.owned_by("u1").len(), 2);
        // relabelled to another owner
        idx.observe(&Event::Apply(obj("b", "u2")));
        assert_eq!(idx.owned_by("u1"), vec![(Some("ns".into()), "a".into())]);
        idx.observe(&Event::Delete(obj("a", "u1")));
        assert!(idx.owned_by("u1").is_empty());
        // a relist replaces everything when it is done, not before
        idx.observe(&Event::Init);
        idx.observe(&Event::InitApply(obj("z", "u3")));
        assert_eq!(idx.owned_by("u2").len(), 2);
        idx.observe(&Event::InitDone);
        assert!(idx.owned_by("u2").is_empty());
        assert_eq!(idx.owned_by("u3").len(), 1);
    }
}
