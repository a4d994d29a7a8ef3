//! Stage 1b of a reconcile, dereference: the objects a parent's references point at,
//! looked up in the reference caches (never written), and the index that tells the
//! engine which parents to reconcile when a referenced object changes.
//!
//! The index is filled by the reconciles themselves: each records where its parent's
//! references point ([`RefIndex::track`]), before it looks them up, so an object that
//! appears after the lookup still wakes the parent. A watch event of a referenced kind
//! then maps to exactly the parents whose target names it, or whose label selector
//! matches it now or matched it before (an object relabelled out of a selector).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::Event;
use serde_json::Value as Json;

use super::cache;
use super::context::RuleContext;
use super::error::ReconcileError;
use super::wire::is_stub;
use crate::render::{RefSelect, RefTarget};

/// `(namespace, name)` of a parent or a cached object.
pub type Key = (Option<String>, String);

/// The cache of one reference (`spec.references[i]`) and its index.
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
    /// The parents each object last matched by selector (to wake them when it leaves).
    matched: HashMap<Key, HashSet<Key>>,
    /// Cached object names by namespace, for selector look-ups.
    members: HashMap<Option<String>, HashSet<String>>,
    /// A relist in progress: its members replace `members` when it completes.
    relist: Option<HashMap<Option<String>, HashSet<String>>>,
}

impl Maps {
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

    /// Follows one watch event of the reference's cache (object names by namespace).
    pub fn observe(&self, event: &Event<DynamicObject>) {
        let mut m = lock(&self.maps);
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

    /// The parents to reconcile for a change of `o`; `cached`: it is still in the cache
    /// (not deleted).
    pub fn parents_for(&self, o: &DynamicObject, cached: bool) -> Vec<Key> {
        let key = (o.namespace(), o.name_any());
        let labels: BTreeMap<String, String> = o.labels().clone();
        let mut m = lock(&self.maps);
        let mut out: HashSet<Key> = m.by_name.get(&key).cloned().unwrap_or_default();
        let now: HashSet<Key> = m
            .by_selector
            .get(&key.0)
            .into_iter()
            .flatten()
            .filter(|p| m.targets.get(*p).is_some_and(|t| t.selects_labels(&labels)))
            .cloned()
            .collect();
        out.extend(now.iter().cloned());
        if let Some(before) = m.matched.remove(&key) {
            out.extend(before);
        }
        if cached && !now.is_empty() {
            m.matched.insert(key, now);
        }
        out.into_iter().collect()
    }

    /// Names of the cached objects in `namespace`.
    fn members(&self, namespace: &Option<String>) -> Vec<String> {
        lock(&self.maps)
            .members
            .get(namespace)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// What the references of one parent found.
pub(super) enum Dereferenced {
    /// `refs.<name>` for the template context (missing optional ones absent).
    Found(BTreeMap<String, Json>),
    /// A required object is missing: nothing is applied or pruned.
    Missing(String),
}

/// Looks up each target in its cache (an object cached without content is read from the
/// API server). Targets are tracked first, so an object created meanwhile wakes the parent.
pub(super) async fn look_up(
    ctx: &RuleContext,
    parent: &Key,
    targets: Vec<RefTarget>,
) -> Result<Dereferenced, ReconcileError> {
    let spec = &ctx.rule.rule.spec.references;
    for t in &targets {
        if let Some(kind) = ctx.refs.get(t.reference) {
            kind.index.track(parent.clone(), t.clone());
        }
    }
    let mut found = BTreeMap::new();
    for t in targets {
        let (Some(kind), Some(r)) = (ctx.refs.get(t.reference), spec.get(t.reference)) else {
            continue;
        };
        match &t.select {
            RefSelect::Name(name) => match get(ctx, kind, &t.namespace, name).await? {
                Some(o) => {
                    found.insert(r.name.value.clone(), o);
                }
                None if r.optional => {}
                None => {
                    return Ok(Dereferenced::Missing(format!(
                        "refs.{}: {} not found",
                        r.name.value,
                        t.describe(&r.kind.value)
                    )));
                }
            },
            RefSelect::Labels(_) => {
                let mut names = kind.index.members(&t.namespace);
                names.sort();
                let mut list = Vec::new();
                for name in names {
                    let Some(o) = cached(kind, &t.namespace, &name) else {
                        continue;
                    };
                    if !t.selects_labels(o.labels()) {
                        continue;
                    }
                    if let Some(o) = full(ctx, kind, o).await? {
                        list.push(o);
                    }
                }
                found.insert(r.name.value.clone(), Json::Array(list));
            }
        }
    }
    Ok(Dereferenced::Found(found))
}

fn cached(kind: &RefKind, ns: &Option<String>, name: &str) -> Option<Arc<DynamicObject>> {
    let mut oref = ObjectRef::new_with(name, kind.ar.clone());
    if let Some(ns) = ns {
        oref = oref.within(ns);
    }
    kind.store.get(&oref)
}

async fn get(
    ctx: &RuleContext,
    kind: &RefKind,
    ns: &Option<String>,
    name: &str,
) -> Result<Option<Json>, ReconcileError> {
    match cached(kind, ns, name) {
        Some(o) => full(ctx, kind, o).await,
        None => Ok(None),
    }
}

/// The object's JSON; one cached without content is read from the API server.
async fn full(
    ctx: &RuleContext,
    kind: &RefKind,
    o: Arc<DynamicObject>,
) -> Result<Option<Json>, ReconcileError> {
    if !is_stub(&o) {
        return Ok(cache::to_json(&o));
    }
    let api: Api<DynamicObject> = match (kind.namespaced, o.namespace()) {
        (true, Some(ns)) => Api::namespaced_with(ctx.client.clone(), &ns, &kind.ar),
        _ => Api::all_with(ctx.client.clone(), &kind.ar),
    };
    match api.get_opt(&o.name_any()).await {
        Ok(found) => Ok(found.as_ref().and_then(cache::to_json)),
        Err(e) => Err(ReconcileError::Read {
            what: format!("{} {}", kind.ar.kind, o.name_any()),
            source: e,
        }),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(ns: &str, name: &str, labels: Json) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns, "labels": labels}
        }))
        .unwrap()
    }

    fn parent(ns: &str, name: &str) -> Key {
        (Some(ns.into()), name.into())
    }

    #[test]
    fn events_wake_exactly_the_parents_that_read_the_object() {
        let idx = RefIndex::default();
        idx.track(
            parent("a", "p1"),
            RefTarget {
                reference: 0,
                namespace: Some("a".into()),
                select: RefSelect::Name("creds".into()),
            },
        );
        let team = |t: &str| RefTarget {
            reference: 0,
            namespace: Some("a".into()),
            select: RefSelect::Labels(BTreeMap::from([("team".into(), t.into())])),
        };
        idx.track(parent("a", "p2"), team("x"));
        idx.track(parent("a", "p3"), team("y"));
        // By name: only p1; the same name in another namespace: nobody.
        assert_eq!(
            idx.parents_for(&obj("a", "creds", json!({})), true),
            vec![parent("a", "p1")]
        );
        assert!(
            idx.parents_for(&obj("b", "creds", json!({})), true)
                .is_empty()
        );
        // Labelled into p2's selector, then relabelled to p3's: p2 hears it leave.
        assert_eq!(
            idx.parents_for(&obj("a", "s", json!({"team": "x"})), true),
            vec![parent("a", "p2")]
        );
        let mut moved = idx.parents_for(&obj("a", "s", json!({"team": "y"})), true);
        moved.sort();
        assert_eq!(moved, vec![parent("a", "p2"), parent("a", "p3")]);
        // Deleted: p3 once more, then nothing is remembered of it.
        assert_eq!(
            idx.parents_for(&obj("a", "s", json!({"team": "y"})), false),
            vec![parent("a", "p3")]
        );
        assert!(lock(&idx.maps).matched.is_empty());
        // A parent whose reference moves is found under the new target only.
        idx.track(parent("a", "p1"), team("x"));
        assert!(
            idx.parents_for(&obj("a", "creds", json!({})), true)
                .is_empty()
        );
        idx.forget(&parent("a", "p1"));
        idx.forget(&parent("a", "p2"));
        idx.forget(&parent("a", "p3"));
        assert_eq!(idx.parents(), 0);
        assert!(lock(&idx.maps).by_selector.is_empty());
    }

    #[test]
    fn members_follow_the_cache_and_its_relists() {
        let idx = RefIndex::default();
        idx.observe(&Event::Apply(obj("a", "x", json!({}))));
        idx.observe(&Event::Apply(obj("a", "y", json!({}))));
        idx.observe(&Event::Delete(obj("a", "x", json!({}))));
        assert_eq!(idx.members(&Some("a".into())), vec!["y".to_string()]);
        idx.observe(&Event::Init);
        idx.observe(&Event::InitApply(obj("b", "z", json!({}))));
        assert_eq!(idx.members(&Some("a".into())).len(), 1);
        idx.observe(&Event::InitDone);
        assert!(idx.members(&Some("a".into())).is_empty());
        assert_eq!(idx.members(&Some("b".into())), vec!["z".to_string()]);
    }
}
