//! The pass-throughs a rule's watch streams go through between the API server and the
//! caches: tolerant decoding into the cached form, the cache budget, the first-listing
//! and relist signals, and the filter of parent changes worth a reconcile.

use std::sync::Arc;

use crate::write::recorder::Recorder;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use tracing::{info, warn};

use super::health::EngineStatus;
use crate::cache::admission::{Admitted, CacheBudget};
use crate::cache::wire::{Wire, orphan_owner, remote_owner};
use crate::meta::labels;
use crate::reconcile::ParentMemory;
use crate::reconcile::memory::Created;
use crate::reconcile::refs::RefIndex;
use futures::future::{Ready, ready};
use kube::runtime::reflector::{ObjectRef, Store};
use prometheus_client::metrics::counter::Counter;

/// A watch stream's item, in its cached form.
type WatchResult = Result<watcher::Event<DynamicObject>, watcher::Error>;

/// Objects per page of an initial listing: a page is read whole before it is decoded,
/// so this bounds what one listing holds at once (children may be up to ~1.5 MiB each).
pub(super) const LIST_PAGE_SIZE: u32 = 25;

/// Watch events of tolerantly decoded objects ([`Wire`]) in their cached form.
pub(super) fn packed<const CHILD: bool>(
    event: Result<watcher::Event<Wire<CHILD>>, watcher::Error>,
) -> Result<watcher::Event<DynamicObject>, watcher::Error> {
    use watcher::Event;
    event.map(|e| match e {
        Event::Apply(o) => Event::Apply(o.into_packed()),
        Event::Delete(o) => Event::Delete(o.into_packed()),
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(o.into_packed()),
        Event::InitDone => Event::InitDone,
    })
}

/// A pass-through for one cache's events (parents, children or references) that keeps
/// it within the cache budget, announcing (once per namespace in a while) the objects
/// cached without content.
pub(super) fn admission(
    budget: Arc<CacheBudget>,
    cache_id: u64,
    rule: String,
    ar: ApiResource,
    recorder: Recorder,
) -> impl FnMut(
    Result<watcher::Event<DynamicObject>, watcher::Error>,
) -> Result<watcher::Event<DynamicObject>, watcher::Error> {
    move |mut event| {
        if let Ok(e) = event.as_mut()
            && let Admitted::Stubbed { announce: true } = budget.admit(cache_id, &rule, e)
            && let watcher::Event::Apply(o) | watcher::Event::InitApply(o) = e
        {
            let ns = o.namespace().unwrap_or_default();
            warn!(rule = %rule, namespace = %ns, kind = %ar.kind, "cache budget reached: objects in this namespace are cached without content and read on demand");
            let reference = o.object_ref(&ar);
            let limits = budget.limits().clone();
            let ev = kube::runtime::events::Event {
                type_: kube::runtime::events::EventType::Warning,
                reason: "CacheBudgetExceeded".into(),
                note: Some(format!(
                    "Objects Rulebook watches in this namespace exceed the cache budget ({} MiB per namespace, {} MiB in all); Rulebook reads them from the API server when it needs them",
                    limits.per_namespace >> 20,
                    limits.total >> 20
                )),
                action: "Cache".into(),
                secondary: None,
            };
            recorder.post(ev, reference, |sent| {
                if let Err(e) = sent {
                    tracing::debug!(error = %e, "cannot publish the cache budget event");
                }
            });
        }
        event
    }
}

/// A pass-through for watch events, after `reflect` (the store has swapped in the new
/// listing), that signals each completed listing.
pub(super) fn relisted(
    tx: futures::channel::mpsc::UnboundedSender<()>,
) -> impl FnMut(
    Result<watcher::Event<DynamicObject>, watcher::Error>,
) -> Result<watcher::Event<DynamicObject>, watcher::Error> {
    move |event| {
        if matches!(event, Ok(watcher::Event::InitDone)) {
            let _ = tx.unbounded_send(());
        }
        event
    }
}

/// Marks a rule synced once each of its caches has listed everything once.
#[derive(Clone)]
pub(super) struct CacheSync {
    listed: Arc<Vec<std::sync::atomic::AtomicBool>>,
    status: Arc<EngineStatus>,
    rule: String,
}

impl CacheSync {
    pub(super) fn new(caches: usize, status: Arc<EngineStatus>, rule: String) -> CacheSync {
        CacheSync {
            listed: Arc::new(
                (0..caches)
                    .map(|_| std::sync::atomic::AtomicBool::new(false))
                    .collect(),
            ),
            status,
            rule,
        }
    }

    /// A pass-through for cache `i`'s watch events that notes its first complete listing.
    pub(super) fn observer(
        &self,
        i: usize,
    ) -> impl FnMut(
        Result<watcher::Event<DynamicObject>, watcher::Error>,
    ) -> Result<watcher::Event<DynamicObject>, watcher::Error>
    + use<> {
        let this = self.clone();
        move |event| {
            if matches!(event, Ok(watcher::Event::InitDone))
                && let Some(flag) = this.listed.get(i)
                && !flag.swap(true, std::sync::atomic::Ordering::SeqCst)
                && this
                    .listed
                    .iter()
                    .all(|f| f.load(std::sync::atomic::Ordering::SeqCst))
            {
                this.status.update(&this.rule, |s| s.synced = true);
                info!(rule = %this.rule, "caches synced");
            }
            event
        }
    }
}

/// What makes a parent worth reconciling: its spec (generation; for kinds without one,
/// any change), labels, annotations, finalizers, deletion. Status-only updates, such as
/// Rulebook's own status writes, do not count.
pub(super) fn parent_changed(o: &DynamicObject) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let m = o.meta();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    match m.generation {
        Some(g) => g.hash(&mut h),
        None => m.resource_version.hash(&mut h),
    }
    m.labels.hash(&mut h);
    m.annotations.hash(&mut h);
    m.finalizers.hash(&mut h);
    m.deletion_timestamp.is_some().hash(&mut h);
    Some(h.finish())
}

/// The parents a child's event wakes: kube-runtime's owner mapping, but only the
/// controller reference (Rulebook's child is its controller's alone, and an object with
/// thousands of ownerReferences must not wake thousands of parents per event), and a
/// cluster-scoped parent is referred to without a namespace. kube-runtime's `owns` gives every owner the child's namespace; its store
/// still finds a cluster-scoped parent (it retries without the namespace), but its
/// scheduler keys by the reference, so a Tenant woken by a child and by its own watch was
/// two entries, which may reconcile at the same time — the one that ran on the older view
/// can then write its status last. (Seen once under load: a Tenant left "not ready:
/// quota" after its ResourceQuota got its status.) An `Orphan` child, which has no
/// ownerReference, wakes the parent its annotation names
/// ([`labels::PARENT_NAME`]): the rule's children are all of this parent kind.
pub(super) fn owners_of(
    parent: ApiResource,
    parent_namespaced: bool,
    elsewhere: bool,
) -> impl Fn(DynamicObject) -> Vec<kube::runtime::reflector::ObjectRef<DynamicObject>>
+ Send
+ Sync
+ 'static {
    move |o: DynamicObject| {
        let ns = o
            .metadata
            .namespace
            .as_deref()
            .filter(|_| parent_namespaced);
        let annotations = o.metadata.annotations.as_ref();
        // A child a namespaced parent placed in another namespace (`elsewhere`: the rule
        // has `targetNamespaces`) names the parent's namespace; an `Orphan` one too.
        let home = annotations
            .and_then(|a| a.get(labels::PARENT_NAMESPACE))
            .filter(|_| parent_namespaced && elsewhere)
            .map(String::as_str);
        let orphan = orphan_owner(&o.metadata)
            .and(annotations)
            .and_then(|a| a.get(labels::PARENT_NAME))
            .map(|name| (name, home.or(ns)));
        let remote = remote_owner(&o.metadata)
            .and(annotations)
            .and_then(|a| a.get(labels::PARENT_NAME))
            .zip(home)
            .map(|(name, home)| (name, Some(home)));
        let at = |name: &String, ns: Option<&str>| {
            let p = kube::runtime::reflector::ObjectRef::new_with(name, parent.clone());
            match ns {
                Some(ns) => p.within(ns),
                None => p,
            }
        };
        o.metadata
            .owner_references
            .iter()
            .flatten()
            .filter(|r| controlled_by(r, &parent))
            .map(|r| at(&r.name, ns))
            .chain(orphan.map(|(name, ns)| at(name, ns)))
            .chain(remote.map(|(name, home)| at(name, home)))
            .collect()
    }
}

/// The UID of the parent whose child `m` is, for the rule's parent kind: its controller
/// reference's, or an `Orphan` child's owner label.
fn owner_uid<'a>(m: &'a kube::api::ObjectMeta, parent: &ApiResource) -> Option<&'a str> {
    (m.owner_references.iter().flatten())
        .find(|r| controlled_by(r, parent))
        .map(|r| r.uid.as_str())
        .or_else(|| orphan_owner(m))
        .or_else(|| remote_owner(m))
}

/// Whether an ownerReference is a controller reference to a parent of the rule's kind.
fn controlled_by(r: &OwnerReference, parent: &ApiResource) -> bool {
    r.controller == Some(true) && r.api_version == parent.api_version && r.kind == parent.kind
}

/// A pass-through of the parents' events that tells the rule's memory what the cache
/// holds (its status writes, the parents deleted), and the reference indexes which parents are gone (those deleted while the
/// watch was down too, at the end of a relist).
pub(super) fn parent_seen(
    memory: Arc<ParentMemory>,
    ref_indexes: Vec<Arc<RefIndex>>,
    parents: Store<DynamicObject>,
    parent_ar: ApiResource,
) -> impl FnMut(WatchResult) -> WatchResult {
    move |event| {
        if let Ok(e) = &event {
            memory.parent_event(e);
            match e {
                watcher::Event::Delete(o) => {
                    let key = (o.namespace(), o.name_any());
                    ref_indexes.iter().for_each(|i| i.forget(&key));
                }
                watcher::Event::InitDone if !ref_indexes.is_empty() => {
                    let exists = |(ns, name): &(Option<String>, String)| {
                        let mut oref = ObjectRef::new_with(name, parent_ar.clone());
                        if let Some(ns) = ns {
                            oref = oref.within(ns);
                        }
                        parents.get(&oref).is_some()
                    };
                    ref_indexes.iter().for_each(|i| i.retain(exists));
                }
                _ => {}
            }
        }
        event
    }
}

/// A filter of one child kind's events that leaves out the watch events of this
/// process's own writes which the parent's last reconcile awaits
/// ([`ParentMemory::own_write_seen`]): each would bring a reconcile with nothing to do. Deletions,
/// relists and every other version go through. Counted in
/// `rulebook_child_events_awaited_total{rule}`.
pub(super) fn unawaited(
    parent: ApiResource,
    (kind, memory): (usize, Arc<ParentMemory>),
    counted: Counter,
) -> impl FnMut(&WatchResult) -> Ready<bool> {
    move |event| {
        let Ok(watcher::Event::Apply(o)) = event else {
            return ready(true);
        };
        let m = &o.metadata;
        let rv = m.resource_version.as_deref().and_then(|v| v.parse().ok());
        let (Some(uid), Some(rv)) = (m.uid.as_deref(), rv) else {
            return ready(true);
        };
        let name = m.name.as_deref().unwrap_or_default();
        let key = || Created::key(kind, m.namespace.as_deref(), name);
        if owner_uid(m, &parent).is_some_and(|p| memory.own_write_seen(p, uid, rv, key)) {
            counted.inc();
            return ready(false);
        }
        ready(true)
    }
}

/// kube-runtime's `predicate_filter` with [`parent_changed`], at a smaller cost per
/// parent: its cache keys every object by its name, namespace and UID as three strings;
/// this one by a keyed 64-bit digest of the UID (random per process, so no one can make
/// two parents collide on purpose). As there, an entry not seen for [`CHANGED_TTL`] is
/// forgotten (the next event of that parent passes) and the table is swept as often.
pub(super) struct ChangedFilter {
    seen: std::collections::HashMap<u64, (u64, std::time::Instant)>,
    digest: std::hash::RandomState,
    swept: std::time::Instant,
}

/// kube-runtime's default predicate TTL.
const CHANGED_TTL: std::time::Duration = std::time::Duration::from_secs(3600);

impl ChangedFilter {
    pub(super) fn new() -> ChangedFilter {
        ChangedFilter {
            seen: Default::default(),
            digest: Default::default(),
            swept: std::time::Instant::now(),
        }
    }

    /// Whether `o` passes: the first version seen of a parent, or one that changed in
    /// what [`parent_changed`] covers.
    pub(super) fn changed(&mut self, o: &DynamicObject) -> bool {
        self.changed_at(o, std::time::Instant::now())
    }

    fn changed_at(&mut self, o: &DynamicObject, now: std::time::Instant) -> bool {
        use std::hash::BuildHasher;
        if now.duration_since(self.swept) >= CHANGED_TTL {
            self.seen
                .retain(|_, (_, at)| now.duration_since(*at) < CHANGED_TTL);
            self.swept = now;
        }
        let (Some(value), Some(uid)) = (parent_changed(o), o.metadata.uid.as_deref()) else {
            return true;
        };
        let key = self.digest.hash_one(uid);
        let fresh = self
            .seen
            .get(&key)
            .is_some_and(|(v, at)| *v == value && now.duration_since(*at) < CHANGED_TTL);
        self.seen.insert(key, (value, now));
        !fresh
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value as Json, json};
    use std::time::{Duration, Instant};

    fn parent(uid: &str, generation: i64, status: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "example.com/v1", "kind": "App",
            "metadata": {"name": "p", "namespace": "n", "uid": uid, "generation": generation},
            "status": {"phase": status}
        }))
        .unwrap()
    }

    #[test]
    fn a_child_wakes_its_controller_with_the_parent_kinds_scope() {
        let child: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {"name": "q", "namespace": "team", "ownerReferences": [
                {"apiVersion": "xyz.com/v1", "kind": "Tenant", "name": "t", "uid": "u1", "controller": true},
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "other", "uid": "u2"},
                // Of the parent's kind, but not the controller: woken by nothing here.
                {"apiVersion": "xyz.com/v1", "kind": "Tenant", "name": "t2", "uid": "u3"}
            ]}
        }))
        .unwrap();
        let tenant = ApiResource {
            group: "xyz.com".into(),
            version: "v1".into(),
            api_version: "xyz.com/v1".into(),
            kind: "Tenant".into(),
            plural: "tenants".into(),
        };
        // Cluster-scoped parent: no namespace, so the store finds it.
        let refs = owners_of(tenant.clone(), false, false)(child.clone());
        assert_eq!(refs.len(), 1);
        assert_eq!(
            (refs[0].name.as_str(), refs[0].namespace.as_deref()),
            ("t", None)
        );
        // Namespaced parent: the child's namespace, as kube-runtime does.
        let refs = owners_of(tenant, true, false)(child);
        assert_eq!(refs[0].namespace.as_deref(), Some("team"));
    }

    #[test]
    fn an_orphan_child_wakes_the_parent_it_names() {
        let tenant = ApiResource {
            group: "xyz.com".into(),
            version: "v1".into(),
            api_version: "xyz.com/v1".into(),
            kind: "Tenant".into(),
            plural: "tenants".into(),
        };
        let child = |policy: &str, refs: Json| -> DynamicObject {
            serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": "data", "namespace": "team",
                    "labels": {"rulebook.dev/owner": "u1"},
                    "annotations": {"rulebook.dev/deletion-policy": policy,
                                    "rulebook.dev/parent-name": "t"},
                    "ownerReferences": refs}
            }))
            .unwrap()
        };
        let refs = owners_of(tenant.clone(), false, false)(child("Orphan", json!([])));
        assert_eq!(
            refs.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            ["t"]
        );
        // Not an `Orphan` child (its annotations are anyone's to write): no one.
        assert!(owners_of(tenant.clone(), false, false)(child("Delete", json!([]))).is_empty());
        // With a controller, that one alone.
        let controlled = child(
            "Orphan",
            json!([{"apiVersion": "xyz.com/v1", "kind": "Tenant", "name": "t2", "uid": "u2",
                    "controller": true}]),
        );
        let refs = owners_of(tenant, false, false)(controlled);
        assert_eq!(
            refs.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            ["t2"]
        );
    }

    #[test]
    fn a_parent_passes_when_new_or_changed_not_for_its_status_and_after_the_ttl() {
        let t0 = Instant::now();
        let mut f = ChangedFilter::new();
        assert!(f.changed_at(&parent("u1", 1, "a"), t0));
        // Status only: filtered out.
        assert!(!f.changed_at(&parent("u1", 1, "b"), t0));
        // A new generation passes, as does another parent (same name, new UID).
        assert!(f.changed_at(&parent("u1", 2, "b"), t0));
        assert!(f.changed_at(&parent("u2", 2, "b"), t0));
        assert!(!f.changed_at(&parent("u2", 2, "c"), t0));
        // Unseen for the TTL: passes again, and the sweep forgets the rest.
        let later = t0 + CHANGED_TTL + Duration::from_secs(1);
        assert!(f.changed_at(&parent("u1", 2, "b"), later));
        assert_eq!(f.seen.len(), 1);
    }
}
