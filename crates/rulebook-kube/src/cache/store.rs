//! The cache of a rule's children of one kind, filled from its watch stream, with the
//! children indexed by the UID of the parent that owns them (their `rulebook.dev/owner`
//! label), so a reconcile finds its children without scanning every child of the rule.
//!
//! Not kube-runtime's reflector store: its key (`ObjectRef`) holds a clone of the kind's
//! `ApiResource` (five strings) and the object's name, namespace, resourceVersion and UID,
//! about 0.6 KB per cached object, and children are most of what Rulebook caches. Here the
//! key is `namespace/name` in one shared string (the object map and the owner index hold
//! the same allocation), each owner's UID is held once for all its children, and the value
//! is the child packed as text ([`super::packed::Packed`]; the kind's `apiVersion` and
//! `kind` are held once, by the store). A relist replaces the objects and the index
//! together, when it completes. Nothing else needs the store: kube-runtime's controller
//! maps children to parents from the watch stream itself.
//!
//! Measured against kube-runtime 5's reflector store of `DynamicObject`s with
//! `cargo bench --bench cache_memory` (a counting allocator): 8,436 B of live heap per
//! ConfigMap as the reflector caches it, 1,672 B stored here with its key and owner index;
//! at 10,000 parents the cluster benchmark's RSS went level with the hand-written
//! reference controller's (docs/benchmarks/history/2026-11-25.md, "Lean child cache").

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use kube::ResourceExt;
use kube::api::{ApiResource, DynamicObject, TypeMeta};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher::Event;

use rulebook_core::meta::labels;

use super::packed::Packed;

struct Entry {
    object: Packed,
    owner: Option<Arc<str>>,
}

#[derive(Default)]
struct Maps {
    objects: HashMap<Arc<str>, Entry>,
    /// Owner UID → the keys of its children: a plain list, as an owner has a few children
    /// of a kind (a hash set of three keys costs twice the memory); `forEach` bounds it.
    by_owner: HashMap<Arc<str>, Vec<Arc<str>>>,
}

impl Maps {
    fn insert(&mut self, o: &DynamicObject) {
        let Some(key) = key_of(o) else { return };
        self.remove(&key);
        let Some(object) = Packed::new(o) else { return };
        let owner = o.labels().get(labels::OWNER).map(|owner| {
            let shared: Arc<str> = match self.by_owner.get_key_value(owner.as_str()) {
                Some((shared, _)) => shared.clone(),
                None => Arc::from(owner.as_str()),
            };
            // `remove` above took `key` out of every list.
            self.by_owner
                .entry(shared.clone())
                .or_default()
                .push(key.clone());
            shared
        });
        self.objects.insert(key, Entry { object, owner });
    }

    fn remove(&mut self, key: &str) {
        if let Some(Entry {
            owner: Some(owner), ..
        }) = self.objects.remove(key)
            && let Some(set) = self.by_owner.get_mut(&owner)
        {
            set.retain(|k| &**k != key);
            if set.is_empty() {
                self.by_owner.remove(&owner);
            }
        }
    }
}

pub struct ChildStore {
    /// The `apiVersion` and `kind` of every object of the store.
    types: TypeMeta,
    live: RwLock<Maps>,
    /// A relist in progress: it replaces `live` when it completes.
    relist: Mutex<Option<Maps>>,
    /// Whether a first listing has completed.
    listed: AtomicBool,
}

/// The key of a namespaced object is `namespace/name`, of a cluster-scoped one its
/// name: names never contain `/`, so the two cannot collide.
fn push_key(out: &mut String, namespace: Option<&str>, name: &str) {
    if let Some(ns) = namespace {
        out.push_str(ns);
        out.push('/');
    }
    out.push_str(name);
}

fn key_of(o: &DynamicObject) -> Option<Arc<str>> {
    let name = o.metadata.name.as_deref()?;
    let mut k = String::new();
    push_key(&mut k, o.metadata.namespace.as_deref(), name);
    Some(Arc::from(k))
}

impl ChildStore {
    /// The (empty) store of the children of kind `ar`.
    pub fn new(ar: &ApiResource) -> ChildStore {
        ChildStore {
            types: TypeMeta {
                api_version: ar.api_version.clone(),
                kind: ar.kind.clone(),
            },
            live: RwLock::default(),
            relist: Mutex::default(),
            listed: AtomicBool::default(),
        }
    }

    /// Follows one watch event, as kube-runtime's store does: a relist replaces the
    /// contents when it is complete, not before.
    pub fn observe(&self, event: &Event<DynamicObject>) {
        match event {
            Event::Apply(o) => write(&self.live).insert(o),
            Event::Delete(o) => {
                if let Some(k) = key_of(o) {
                    write(&self.live).remove(&k);
                }
            }
            Event::Init => *lock(&self.relist) = Some(Maps::default()),
            Event::InitApply(o) => {
                if let Some(m) = lock(&self.relist).as_mut() {
                    m.insert(o);
                }
            }
            Event::InitDone => {
                if let Some(m) = lock(&self.relist).take() {
                    // The old maps are freed after the lock is released.
                    let old = std::mem::replace(&mut *write(&self.live), m);
                    drop(old);
                }
                self.listed.store(true, Ordering::SeqCst);
            }
        }
    }

    /// `f` of the cached child at `oref`. (The key is built in a buffer each thread
    /// reuses: lookups are on every reconcile's path.)
    fn with<T>(&self, oref: &ObjectRef<DynamicObject>, f: impl FnOnce(&Packed) -> T) -> Option<T> {
        thread_local! {
            static KEY: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
        }
        KEY.with_borrow_mut(|k| {
            k.clear();
            push_key(k, oref.namespace.as_deref(), &oref.name);
            read(&self.live)
                .objects
                .get(k.as_str())
                .map(|e| f(&e.object))
        })
    }

    /// The cached child at `oref`, unpacked (typed metadata, packed content).
    pub fn get(&self, oref: &ObjectRef<DynamicObject>) -> Option<Arc<DynamicObject>> {
        self.with(oref, |p| p.unpack(Some(&self.types)))
            .flatten()
            .map(Arc::new)
    }

    /// Whether the store holds version `resource_version` of object `uid` at `oref`,
    /// without unpacking it.
    pub fn holds(
        &self,
        oref: &ObjectRef<DynamicObject>,
        uid: &str,
        resource_version: &str,
    ) -> bool {
        self.with(oref, |p| p.holds(uid, resource_version))
            .unwrap_or(false)
    }

    /// Whether the child at `oref` is cached without its content (a stub), without
    /// unpacking it; `None` when it is not cached.
    pub fn is_stub(&self, oref: &ObjectRef<DynamicObject>) -> Option<bool> {
        self.with(oref, Packed::is_stub)
    }

    /// The cached children labelled as owned by `uid`, unpacked.
    pub fn owned_by(&self, uid: &str) -> Vec<Arc<DynamicObject>> {
        let maps = read(&self.live);
        let Some(keys) = maps.by_owner.get(uid) else {
            return Vec::new();
        };
        keys.iter()
            .filter_map(|k| maps.objects.get(k)?.object.unpack(Some(&self.types)))
            .map(Arc::new)
            .collect()
    }

    pub fn len(&self) -> usize {
        read(&self.live).objects.len()
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
    use serde_json::json;

    fn obj(ns: &str, name: &str, rv: &str) -> DynamicObject {
        let mut o: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns, "resourceVersion": rv,
                         "labels": {"rulebook.dev/owner": "u1"}},
            "data": {"k": "v"}
        }))
        .unwrap();
        super::super::packed::strip_child(&mut o);
        o
    }

    fn ar() -> ApiResource {
        ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&())
    }

    fn oref(ns: &str, name: &str) -> ObjectRef<DynamicObject> {
        ObjectRef::new_with(name, ar()).within(ns)
    }

    fn rv(s: &ChildStore, ns: &str, name: &str) -> Option<String> {
        s.get(&oref(ns, name))?.metadata.resource_version.clone()
    }

    #[test]
    fn follows_applies_deletes_and_relists_and_keeps_children_lean() {
        let s = ChildStore::new(&ar());
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
        // Stored packed; read back, the labels are there and the kind is the store's.
        let full = s.get(&oref("a", "x")).unwrap();
        assert_eq!(
            full.types.as_ref().map(|t| t.kind.as_str()),
            Some("ConfigMap")
        );
        assert_eq!(s.is_stub(&oref("a", "x")), Some(false));
        assert_eq!(s.is_stub(&oref("a", "nothing")), None);
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

    fn names(s: &ChildStore, uid: &str) -> Vec<String> {
        let mut v: Vec<String> = s.owned_by(uid).iter().map(|o| o.name_any()).collect();
        v.sort();
        v
    }

    fn owned(ns: &str, name: &str, owner: &str) -> DynamicObject {
        let mut o = obj(ns, name, "1");
        o.metadata.labels = Some([(labels::OWNER.to_string(), owner.to_string())].into());
        o
    }

    #[test]
    fn indexes_children_by_owner_through_applies_deletes_and_relists() {
        let s = ChildStore::new(&ar());
        s.observe(&Event::Apply(owned("ns", "a", "u1")));
        s.observe(&Event::Apply(owned("ns", "b", "u1")));
        s.observe(&Event::Apply(owned("ns", "c", "u2")));
        assert_eq!(names(&s, "u1"), ["a", "b"]);
        // Relabelled to another owner.
        s.observe(&Event::Apply(owned("ns", "b", "u2")));
        assert_eq!(names(&s, "u1"), ["a"]);
        assert_eq!(names(&s, "u2"), ["b", "c"]);
        s.observe(&Event::Delete(owned("ns", "a", "u1")));
        assert!(names(&s, "u1").is_empty());
        // An unlabelled child is cached and owned by no one.
        let mut bare = obj("ns", "d", "1");
        bare.metadata.labels = None;
        s.observe(&Event::Apply(bare));
        assert_eq!(s.len(), 3);
        assert_eq!(names(&s, "u2"), ["b", "c"]);
        // A relist replaces the index with the objects, when it is done.
        s.observe(&Event::Init);
        s.observe(&Event::InitApply(owned("other", "z", "u3")));
        assert_eq!(names(&s, "u2").len(), 2);
        s.observe(&Event::InitDone);
        assert!(names(&s, "u2").is_empty());
        assert_eq!(names(&s, "u3"), ["z"]);
        assert_eq!(s.len(), 1);
    }
}
