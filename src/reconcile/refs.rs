//! For the dereference stage of a reconcile: the objects a parent's references point at,
//! looked up in the reference caches (never written), and the index that tells the
//! engine which parents to reconcile when a referenced object changes.
//!
//! The index is filled by the reconciles themselves: each records where its parent's
//! references point ([`RefIndex::track`]), before it looks them up, so an object that
//! appears after the lookup still wakes the parent. A watch event of a referenced kind
//! then maps to exactly the parents whose target names it, or whose label selector
//! matches it now or matched its previous version (an object relabelled out of a
//! selector): [`RefIndex::before_update`] reads the previous version from the cache
//! before the event is applied, [`RefIndex::parents_for`] after.
//!
//! Its size is bounded by the parents that exist: a parent's entry goes with its delete
//! event, with a parent relist that no longer has it, and — for a reconcile that was
//! still running when its parent went — right after that reconcile tracked it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::Event;
use serde_json::Value as Json;

use super::error::ReconcileError;
use crate::cache;
use crate::cache::admission;
use crate::cache::wire::is_stub;
use crate::meta::JsonAt;
use crate::render::{RefSelect, RefTarget};

/// `(namespace, name)` of a parent or a cached object.
pub type Key = (Option<String>, String);

/// The cache of one reference (`spec.references[i]`) and its index.
#[derive(Clone)]
pub struct RefKind {
    pub ar: ApiResource,
    pub namespaced: bool,
    pub store: Store<DynamicObject>,
    pub index: Arc<RefIndex>,
}

#[derive(Default)]
struct Maps {
    /// Where each parent's reference points.
    targets: HashMap<Key, RefTarget>,
    /// Parents by the object their target names.
    by_name: HashMap<Key, HashSet<Key>>,
    /// Parents with a label selector, by the namespace it looks in.
    by_selector: HashMap<Option<String>, HashSet<Key>>,
    /// The parents whose selector the previous version of an object matched, from just
    /// before its event was applied to the cache until the event is mapped to parents.
    before: HashMap<Key, HashSet<Key>>,
    /// Cached object names by namespace, for selector look-ups.
    members: HashMap<Option<String>, HashSet<String>>,
    /// A relist in progress: its members replace `members` when it completes.
    relist: Option<HashMap<Option<String>, HashSet<String>>>,
}

impl Maps {
    /// The parents whose selector in `ns` matches `labels`; every parent with a selector
    /// in `ns` when the labels are not known (dropped from a stub).
    fn selecting(
        &self,
        ns: &Option<String>,
        labels: Option<&BTreeMap<String, String>>,
    ) -> Vec<Key> {
        self.by_selector
            .get(ns)
            .into_iter()
            .flatten()
            .filter(|p| {
                self.targets.get(*p).is_some_and(|t| match labels {
                    Some(l) => t.selects_labels(l),
                    None => matches!(t.select, RefSelect::Labels(_)),
                })
            })
            .cloned()
            .collect()
    }

    fn untrack(&mut self, parent: &Key) {
        let Some(old) = self.targets.remove(parent) else {
            return;
        };
        match &old.select {
            RefSelect::Name(n) => {
                let key = (old.namespace.clone(), n.clone());
                if let Some(set) = self.by_name.get_mut(&key) {
                    set.remove(parent);
                    if set.is_empty() {
                        self.by_name.remove(&key);
                    }
                }
            }
            RefSelect::Labels(_) => {
                if let Some(set) = self.by_selector.get_mut(&old.namespace) {
                    set.remove(parent);
                    if set.is_empty() {
                        self.by_selector.remove(&old.namespace);
                    }
                }
            }
        }
    }
}

/// Which parents read which objects of one reference.
#[derive(Default)]
pub struct RefIndex {
    maps: Mutex<Maps>,
}

impl RefIndex {
    /// Records where `parent`'s reference points now.
    pub fn track(&self, parent: Key, target: RefTarget) {
        let mut m = lock(&self.maps);
        if m.targets.get(&parent) == Some(&target) {
            return;
        }
        m.untrack(&parent);
        match &target.select {
            RefSelect::Name(n) => {
                m.by_name
                    .entry((target.namespace.clone(), n.clone()))
                    .or_default()
                    .insert(parent.clone());
            }
            RefSelect::Labels(_) => {
                m.by_selector
                    .entry(target.namespace.clone())
                    .or_default()
                    .insert(parent.clone());
            }
        }
        m.targets.insert(parent, target);
    }

    /// Forgets a deleted parent.
    pub fn forget(&self, parent: &Key) {
        lock(&self.maps).untrack(parent);
    }

    /// How many parents are tracked (for tests and metrics).
    pub fn parents(&self) -> usize {
        lock(&self.maps).targets.len()
    }

    /// Forgets every parent `keep` says no longer exists (after a parent relist).
    pub fn retain(&self, keep: impl Fn(&Key) -> bool) {
        let mut m = lock(&self.maps);
        let gone: Vec<Key> = m.targets.keys().filter(|k| !keep(k)).cloned().collect();
        for k in gone {
            m.untrack(&k);
        }
    }

    /// Follows one watch event of the reference's cache, before the cache applies it:
    /// object names by namespace, and the parents the previous version (`previous`, as
    /// the cache still holds it) matched by selector.
    pub fn before_update(&self, event: &Event<DynamicObject>, previous: Option<&DynamicObject>) {
        let mut m = lock(&self.maps);
        if let (Event::Apply(o) | Event::InitApply(o) | Event::Delete(o), Some(old)) =
            (event, previous)
        {
            let key = (o.namespace(), o.name_any());
            let was = m.selecting(&key.0, known_labels(old));
            if !was.is_empty() {
                m.before.entry(key).or_default().extend(was);
            }
        }
        match event {
            Event::Apply(o) => {
                m.members
                    .entry(o.namespace())
                    .or_default()
                    .insert(o.name_any());
            }
            Event::Delete(o) => {
                let ns = o.namespace();
                if let Some(set) = m.members.get_mut(&ns) {
                    set.remove(&o.name_any());
                    if set.is_empty() {
                        m.members.remove(&ns);
                    }
                }
            }
            Event::Init => m.relist = Some(HashMap::new()),
            Event::InitApply(o) => {
                if let Some(r) = m.relist.as_mut() {
                    r.entry(o.namespace()).or_default().insert(o.name_any());
                }
            }
            Event::InitDone => {
                if let Some(r) = m.relist.take() {
                    m.members = r;
                }
            }
        }
    }

    /// The parents to reconcile for a change of `o` (after the cache has applied it):
    /// those naming it, those whose selector matches it, and those whose selector matched
    /// its previous version.
    pub fn parents_for(&self, o: &DynamicObject) -> Vec<Key> {
        let key = (o.namespace(), o.name_any());
        let mut m = lock(&self.maps);
        let mut out: HashSet<Key> = m.by_name.get(&key).cloned().unwrap_or_default();
        out.extend(m.selecting(&key.0, known_labels(o)));
        if let Some(before) = m.before.remove(&key) {
            out.extend(before);
        }
        out.into_iter().collect()
    }

    /// Names of the cached objects in `namespace`.
    pub(super) fn members(&self, namespace: &Option<String>) -> Vec<String> {
        lock(&self.maps)
            .members
            .get(namespace)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// An object's labels, unless a stub dropped them (too large to keep,
/// [`admission::KEPT_REFERENCE_LABEL_BYTES`]).
pub(super) fn known_labels(o: &DynamicObject) -> Option<&BTreeMap<String, String>> {
    (!is_stub(o) || admission::labels_kept(&o.metadata)).then(|| o.labels())
}

pub(super) fn cached(
    kind: &RefKind,
    ns: &Option<String>,
    name: &str,
) -> Option<Arc<DynamicObject>> {
    let mut oref = ObjectRef::new_with(name, kind.ar.clone());
    if let Some(ns) = ns {
        oref = oref.within(ns);
    }
    kind.store.get(&oref)
}

/// What [`full`] read.
pub(super) enum Read {
    Found(Json),
    /// Not there (any more), or another object by that name now.
    Gone,
    /// Past what the parent may read ([`crate::render::Limits::parent_reference_bytes`]).
    Over,
}

/// Bytes of `o` (content and metadata) as cached, or as read.
pub(super) fn cached_bytes(o: &DynamicObject) -> usize {
    let content = match &o.data {
        Json::String(packed) => packed.len(),
        Json::Null => 0,
        other => {
            let mut n = Counted(0);
            serde_json::to_writer(&mut n, other).map_or(usize::MAX, |()| n.0)
        }
    };
    content.saturating_add(admission::metadata_bytes(&o.metadata))
}

/// Charges `o`'s bytes (content and metadata) to what the parent may still read.
fn charge(o: &DynamicObject, left: &mut usize) -> bool {
    let bytes = cached_bytes(o);
    match left.checked_sub(bytes) {
        Some(l) => {
            *left = l;
            true
        }
        None => false,
    }
}

/// Counts what is written to it.
struct Counted(usize);

impl std::io::Write for Counted {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 = self.0.saturating_add(buf.len());
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The object's JSON (with its apiVersion and kind); one cached without content is read
/// from the API server, and counts only if it is still the object cached (same UID).
/// Each is charged to `left` before its JSON is built.
pub(super) async fn full(
    client: &kube::Client,
    kind: &RefKind,
    o: Arc<DynamicObject>,
    left: &mut usize,
) -> Result<Read, ReconcileError> {
    let found = |o: &DynamicObject, left: &mut usize| {
        if !charge(o, left) {
            return Read::Over;
        }
        cache::to_json_as(o, &kind.ar).map_or(Read::Gone, Read::Found)
    };
    if !is_stub(&o) {
        return Ok(found(&o, left));
    }
    let api: Api<DynamicObject> = match (kind.namespaced, o.namespace()) {
        (true, Some(ns)) => Api::namespaced_with(client.clone(), &ns, &kind.ar),
        _ => Api::all_with(client.clone(), &kind.ar),
    };
    match api.get_opt(&o.name_any()).await {
        Ok(Some(fresh)) if fresh.uid() == o.uid() => Ok(found(&fresh, left)),
        Ok(_) => Ok(Read::Gone),
        Err(e) => Err(ReconcileError::Read {
            what: format!("{} {}", kind.ar.kind, o.name_any()),
            source: e,
        }),
    }
}

/// The stubs among `unknown` (by UID; their labels were dropped) that `want` matches,
/// asked of the API server: a list of metadata only with the selector, a page of
/// [`LIST_PAGE`] at a time (a tenant's object may carry a megabyte of metadata), until
/// more than `room` are found. A selector that no label can satisfy (a key or value
/// that is not a valid label) matches none and is not sent.
pub(super) async fn list_selected(
    client: &kube::Client,
    kind: &RefKind,
    ns: &Option<String>,
    want: &BTreeMap<String, String>,
    unknown: &HashMap<String, Arc<DynamicObject>>,
    room: usize,
) -> Result<Vec<Arc<DynamicObject>>, ReconcileError> {
    let Some(selector) = label_selector(want) else {
        return Ok(Vec::new());
    };
    let api: Api<DynamicObject> = match (kind.namespaced, ns) {
        (true, Some(ns)) => Api::namespaced_with(client.clone(), ns, &kind.ar),
        _ => Api::all_with(client.clone(), &kind.ar),
    };
    let mut params = ListParams::default().labels(&selector).limit(LIST_PAGE);
    let mut out = Vec::new();
    loop {
        let page = api
            .list_metadata(&params)
            .await
            .map_err(|e| ReconcileError::Read {
                what: format!("{} matching the selector of a reference", kind.ar.plural),
                source: e,
            })?;
        out.extend(
            page.items
                .iter()
                .filter_map(|o| unknown.get(o.metadata.uid.as_deref()?))
                .cloned(),
        );
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) if out.len() <= room => params = params.continue_token(&c),
            _ => return Ok(out),
        }
    }
}

/// Objects per page of [`list_selected`] (as the caches' own listings).
const LIST_PAGE: u32 = 25;

/// `metadata.labels` of an object's JSON.
pub(super) fn labels_of(o: &Json) -> BTreeMap<String, String> {
    o.at(&["metadata", "labels"])
        .and_then(Json::as_object)
        .map(|l| {
            l.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// `k=v,…` for the API server, when every key and value is a valid label key and value
/// (so that nothing in them can change the selector's meaning).
pub(crate) fn label_selector(want: &BTreeMap<String, String>) -> Option<String> {
    let name = |s: &str| {
        s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
            && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
    };
    let key = |k: &str| match k.split_once('/') {
        Some((prefix, n)) => {
            name(n) && prefix.len() <= 253 && prefix.split('.').all(crate::meta::is_dns_label)
        }
        None => name(k),
    };
    let valid = want
        .iter()
        .all(|(k, v)| key(k) && (v.is_empty() || name(v)));
    (valid && !want.is_empty()).then(|| {
        want.iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
#[path = "refs_tests.rs"]
mod tests;
