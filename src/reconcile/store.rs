//! The cache of a rule's children of one kind, filled from its watch stream.
//!
//! Not kube-runtime's reflector store: its key (`ObjectRef`) holds a clone of the kind's
//! `ApiResource` (five strings) and the object's name, namespace, resourceVersion and UID,
//! about 0.6 KB per cached object, and children are most of what Rulebook caches. Here the
//! key is `namespace/name` in one string and the value the child in its lean form
//! ([`super::cache::lean_child`]). Nothing else needs the store: kube-runtime's controller
//! maps children to parents from the watch stream itself.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use kube::api::DynamicObject;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher::Event;

use super::cache::lean_child;

type Map = HashMap<Box<str>, Arc<DynamicObject>>;

#[derive(Default)]
pub struct ChildStore {
    live: RwLock<Map>,
    /// A relist in progress: it replaces `live` when it completes.
    relist: Mutex<Option<Map>>,
    /// Whether a first listing has completed.
    listed: AtomicBool,
}

fn key(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

fn key_of(o: &DynamicObject) -> Option<Box<str>> {
    let name = o.metadata.name.as_deref()?;
    Some(key(o.metadata.namespace.as_deref(), name).into_boxed_str())
}

impl ChildStore {
    /// Follows one watch event, as kube-runtime's store does: a relist replaces the
    /// contents when it is complete, not before.
    pub fn observe(&self, event: &Event<DynamicObject>) {
        match event {
            Event::Apply(o) => {
                if let Some(k) = key_of(o) {
                    write(&self.live).insert(k, Arc::new(lean_child(o)));
                }
            }
            Event::Delete(o) => {
                if let Some(k) = key_of(o) {
                    write(&self.live).remove(&k);
                }
            }
            Event::Init => *lock(&self.relist) = Some(Map::new()),
            Event::InitApply(o) => {
                if let (Some(m), Some(k)) = (lock(&self.relist).as_mut(), key_of(o)) {
                    m.insert(k, Arc::new(lean_child(o)));
                }
            }
            Event::InitDone => {
                if let Some(m) = lock(&self.relist).take() {
                    *write(&self.live) = m;
                }
                self.listed.store(true, Ordering::SeqCst);
            }
        }
    }

    /// The cached child at `oref`, in its lean form.
    pub fn get(&self, oref: &ObjectRef<DynamicObject>) -> Option<Arc<DynamicObject>> {
        read(&self.live)
            .get(key(oref.namespace.as_deref(), &oref.name).as_str())
            .cloned()
    }

    pub fn len(&self) -> usize {
        read(&self.live).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the first listing has completed.
    pub fn listed(&self) -> bool {
        self.listed.load(Ordering::SeqCst)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn read<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ApiResource;
    use serde_json::json;

    fn obj(ns: &str, name: &str, rv: &str) -> DynamicObject {
        let mut o: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns, "resourceVersion": rv,
                         "labels": {"rulebook.dev/owner": "u1"}},
            "data": {"k": "v"}
        }))
        .unwrap();
        super::super::cache::strip_child(&mut o);
        o
    }

    fn oref(ns: &str, name: &str) -> ObjectRef<DynamicObject> {
        let ar = ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&());
        ObjectRef::new_with(name, ar).within(ns)
    }

    fn rv(s: &ChildStore, ns: &str, name: &str) -> Option<String> {
        s.get(&oref(ns, name))?.metadata.resource_version.clone()
    }

    #[test]
    fn follows_applies_deletes_and_relists_and_keeps_children_lean() {
        let s = ChildStore::default();
        assert!(!s.listed());
        s.observe(&Event::Init);
        s.observe(&Event::InitApply(obj("a", "x", "1")));
        // Not visible until the listing is complete.
        assert_eq!(s.len(), 0);
        s.observe(&Event::InitDone);
        assert!(s.listed());
        assert_eq!(rv(&s, "a", "x").as_deref(), Some("1"));
        // Namespaces are part of the key.
        assert_eq!(rv(&s, "b", "x"), None);
        s.observe(&Event::Apply(obj("b", "x", "2")));
        s.observe(&Event::Apply(obj("a", "x", "3")));
        assert_eq!(rv(&s, "a", "x").as_deref(), Some("3"));
        assert_eq!(rv(&s, "b", "x").as_deref(), Some("2"));
        // Stored lean; unpacked, the labels are back.
        let cached = s.get(&oref("a", "x")).unwrap();
        assert!(cached.metadata.labels.is_none());
        let full = super::super::cache::unpack(cached);
        assert_eq!(
            full.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("rulebook.dev/owner"))
                .map(String::as_str),
            Some("u1")
        );
        s.observe(&Event::Delete(obj("b", "x", "2")));
        assert_eq!(rv(&s, "b", "x"), None);
        // A relist replaces everything when it is done, and keeps the old until then.
        s.observe(&Event::Init);
        s.observe(&Event::InitApply(obj("c", "y", "9")));
        assert_eq!(rv(&s, "a", "x").as_deref(), Some("3"));
        s.observe(&Event::InitDone);
        assert_eq!(rv(&s, "a", "x"), None);
        assert_eq!(rv(&s, "c", "y").as_deref(), Some("9"));
        assert_eq!(s.len(), 1);
    }
}
