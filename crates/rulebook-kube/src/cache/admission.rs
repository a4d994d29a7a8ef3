//! What the caches may hold: a bound on cached content, per namespace and in total, so
//! that no tenant can grow the operator's memory by creating objects that carry
//! Rulebook's labels, or parents (or referenced objects) of any size.
//!
//! Child caches select on public labels, which anyone may set in their own namespace.
//! Objects that cannot be children arrive without content already ([`super::wire`]);
//! objects that look like children (owner label = controller reference UID), parents and
//! referenced objects keep their content while their namespace stays under
//! [`CacheLimits::per_namespace`] and the operator under [`CacheLimits::total`]. Past that
//! an object is cached as a stub (metadata only; a reconcile reads it from the API
//! server when it needs it), counted in a metric, and announced once per namespace in a
//! while by a Warning Event on it.
//!
//! An object's metadata beyond [`METADATA_ALLOWANCE`] counts as well as its content — a
//! tenant's object may carry 256 KiB of annotations, or thousands of labels, owner
//! references or field managers — and a stub keeps only the metadata Rulebook reads of
//! a cached object before it reads the object itself ([`slim`]): Rulebook's own labels
//! and annotations and the controller reference (a reference's stub also keeps its
//! labels, which selectors match, while they are small; a parent's a digest of those it
//! drops). A stub's size is bounded whatever the tenant puts on the object.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::watcher::Event;

use rulebook_core::meta::labels;

use super::packed::is_own_apply;
use crate::counts::CacheCounts;

/// Bounds on cached child content.
#[derive(Clone, Debug)]
pub struct CacheLimits {
    /// Bytes of content one namespace's children may hold in the caches (all rules).
    pub per_namespace: usize,
    /// Bytes of content all cached children may hold.
    pub total: usize,
}

impl Default for CacheLimits {
    fn default() -> Self {
        CacheLimits {
            per_namespace: 32 << 20,
            total: 256 << 20,
        }
    }
}

/// What a cache holds: what its stubs keep of their metadata ([`slim`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheKind {
    Parents = 0,
    Children = 1,
    References = 2,
}

impl CacheKind {
    /// The `cache` label of `rulebook_cache_stubbed_objects_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheKind::Parents => "parents",
            CacheKind::Children => "children",
            CacheKind::References => "references",
        }
    }
}

/// Metadata an object may hold without it counting against the budget: what an
/// ordinary object carries (Rulebook's labels and annotations, its ownerReference and
/// managedFields entry are about 1.5 KiB), so that the budget bounds content as before
/// and what a tenant adds beyond the ordinary (256 KiB of annotations, thousands of
/// labels, owner references or field managers) counts in full.
pub const METADATA_ALLOWANCE: usize = 4 << 10;

/// A Rulebook annotation a stub keeps is at most this long (Rulebook's own are short;
/// anyone may set one on their objects).
const KEPT_ANNOTATION_BYTES: usize = 256;

/// A reference's stub keeps the tenant's labels (selectors match on them) while they
/// take at most this many bytes; past it, only Rulebook's and [`DROPPED_LABELS`], and a
/// reconcile asks the API server which of such objects a selector matches.
pub const KEPT_REFERENCE_LABEL_BYTES: usize = 2 << 10;

/// On a reference's stub, in memory only: its labels were too large to keep
/// ([`KEPT_REFERENCE_LABEL_BYTES`]), so the cache cannot tell which selectors match it.
pub const DROPPED_LABELS: &str = "rulebook.dev/dropped-labels";

/// Whether a cached object's labels are all there (not dropped from a reference's stub).
pub fn labels_kept(m: &ObjectMeta) -> bool {
    m.annotations
        .as_ref()
        .is_none_or(|a| !a.contains_key(DROPPED_LABELS))
}

/// Bytes an object's metadata holds, about as many as its JSON text has.
pub fn metadata_bytes(m: &ObjectMeta) -> usize {
    let len = |s: &Option<String>| s.as_ref().map_or(0, String::len);
    let map = |m: &Option<std::collections::BTreeMap<String, String>>| {
        m.iter()
            .flatten()
            .map(|(k, v)| k.len() + v.len() + 6)
            .sum::<usize>()
    };
    len(&m.name)
        + len(&m.namespace)
        + len(&m.uid)
        + len(&m.resource_version)
        + len(&m.generate_name)
        + map(&m.labels)
        + map(&m.annotations)
        + m.finalizers
            .iter()
            .flatten()
            .map(|f| f.len() + 3)
            .sum::<usize>()
        + (m.owner_references.iter().flatten())
            .map(|r| r.api_version.len() + r.kind.len() + r.name.len() + r.uid.len() + 80)
            .sum::<usize>()
        + (m.managed_fields.iter().flatten())
            .map(|e| {
                len(&e.manager)
                    + len(&e.operation)
                    + len(&e.api_version)
                    + len(&e.subresource)
                    // Rulebook's own field set follows the content it applied, which
                    // counts already; another manager's is kept by no cache.
                    + if is_own_apply(e) {
                        0
                    } else {
                        e.fields_v1.as_ref().map_or(0, |f| match &f.0 {
                            serde_json::Value::String(s) => s.len(),
                            other => other.to_string().len(),
                        })
                    }
                    + 100
            })
            .sum::<usize>()
}

/// On a parent's stub, in memory only: a digest of the labels and annotations it dropped,
/// so that a change to them still passes the parent watch's filter of unchanged parents.
pub const DROPPED_METADATA: &str = "rulebook.dev/stubbed-metadata";

/// A stub's metadata: Rulebook's own labels and annotations ([`labels::OWN`]; a
/// reference's stub also the tenant's labels, which selectors match, up to
/// [`KEPT_REFERENCE_LABEL_BYTES`]), Rulebook's finalizer, the controller reference (not
/// on a reference's stub), no managedFields; a parent's stub also a digest of the
/// labels, annotations and finalizers it dropped
/// ([`DROPPED_METADATA`]). A reconcile reads a stub from the API server before it reads
/// more of it.
pub fn slim(m: &mut ObjectMeta, kind: CacheKind) {
    let ours = |k: &str| labels::OWN.contains(&k);
    let dropped = (kind == CacheKind::Parents).then(|| {
        use std::hash::{Hash, Hasher};
        let mut h = std::hash::DefaultHasher::new();
        m.labels.hash(&mut h);
        m.annotations.hash(&mut h);
        m.finalizers.hash(&mut h);
        format!("{:016x}", h.finish())
    });
    let label_bytes: usize = m
        .labels
        .iter()
        .flatten()
        .map(|(k, v)| k.len() + v.len())
        .sum();
    let keep_labels = kind == CacheKind::References && label_bytes <= KEPT_REFERENCE_LABEL_BYTES;
    if !keep_labels && let Some(l) = m.labels.as_mut() {
        l.retain(|k, _| ours(k));
    }
    if let Some(a) = m.annotations.as_mut() {
        a.retain(|k, v| ours(k) && v.len() <= KEPT_ANNOTATION_BYTES);
    }
    if let Some(digest) = dropped {
        m.annotations
            .get_or_insert_default()
            .insert(DROPPED_METADATA.to_string(), digest);
    }
    if kind == CacheKind::References && !keep_labels {
        m.annotations
            .get_or_insert_default()
            .insert(DROPPED_LABELS.to_string(), String::new());
    }
    // The API server bounds none of these: a finalizer list or an ownerReference may
    // be as long as the object. A stub keeps Rulebook's finalizer (a parent's, read
    // whole before it is patched) and a controller reference of a real object's size
    // (children are matched to parents by it); a reference's stub needs neither.
    if let Some(f) = m.finalizers.as_mut() {
        f.retain(|f| f == rulebook_core::meta::FINALIZER);
    }
    m.generate_name = None;
    if let Some(r) = m.owner_references.as_mut() {
        r.retain(|r| r.controller == Some(true) && kind != CacheKind::References && kept_size(r));
        r.truncate(1);
    }
    m.managed_fields = None;
}

/// An ownerReference a stub keeps is at most this long (a real one: a group and version,
/// a kind, a name of at most 253 bytes and a UID).
const KEPT_OWNER_REFERENCE_BYTES: usize = 768;

/// Whether a stub keeps `r` for its size: a real reference's, at most
/// [`KEPT_OWNER_REFERENCE_BYTES`]. Whatever reads children past the caches must apply the
/// same bound, or it would see a child the caches cannot.
pub fn kept_size(r: &k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference) -> bool {
    r.api_version.len() + r.kind.len() + r.name.len() + r.uid.len() <= KEPT_OWNER_REFERENCE_BYTES
}

/// How often the budget event is repeated for one namespace.
const ANNOUNCE_EVERY: Duration = Duration::from_secs(600);

/// Cached bytes by cache and object, shared by every rule's child caches.
pub struct CacheBudget {
    limits: CacheLimits,
    state: Mutex<State>,
    metrics: Arc<dyn CacheCounts>,
}

#[derive(Default)]
struct State {
    /// (cache id, digest of namespace and name) → what the object's content holds. A
    /// 64-bit digest under a per-process random key, rather than the two strings: this
    /// map has an entry for every cached child. (Two objects of one cache whose digests
    /// collided would share one count; no one can make that happen on purpose.)
    held: HashMap<(u64, u64), Held>,
    digest: std::hash::RandomState,
    /// Bytes held per namespace; its keys are shared with `held`.
    by_namespace: HashMap<Arc<str>, usize>,
    total: usize,
    /// Bytes held per [`CacheKind`] (its discriminant).
    by_kind: [usize; 3],
    announced: HashMap<String, Instant>,
    next_cache: u64,
    kinds: HashMap<u64, CacheKind>,
}

struct Held {
    namespace: Arc<str>,
    bytes: usize,
    kind: CacheKind,
}

impl State {
    fn key(&self, cache: u64, ns: &str, name: &str) -> (u64, u64) {
        use std::hash::BuildHasher;
        (cache, self.digest.hash_one((ns, name)))
    }

    fn forget(&mut self, key: &(u64, u64)) {
        if let Some(Held {
            namespace,
            bytes,
            kind,
        }) = self.held.remove(key)
        {
            self.total = self.total.saturating_sub(bytes);
            let of_kind = &mut self.by_kind[kind as usize];
            *of_kind = of_kind.saturating_sub(bytes);
            if let Some(ns) = self.by_namespace.get_mut(&namespace) {
                *ns = ns.saturating_sub(bytes);
                if *ns == 0 {
                    self.by_namespace.remove(&namespace);
                }
            }
        }
    }

    fn hold(&mut self, key: (u64, u64), ns: &str, bytes: usize, kind: CacheKind) {
        let namespace = match self.by_namespace.get_key_value(ns) {
            Some((shared, _)) => shared.clone(),
            None => Arc::from(ns),
        };
        *self.by_namespace.entry(namespace.clone()).or_insert(0) += bytes;
        self.held.insert(
            key,
            Held {
                namespace,
                bytes,
                kind,
            },
        );
        self.total += bytes;
        self.by_kind[kind as usize] += bytes;
    }
}

/// What [`CacheBudget::admit`] did with one object.
#[derive(Debug, PartialEq)]
pub enum Admitted {
    /// Cached with its content (or it had none to begin with).
    AsIs,
    /// Its content was dropped; `announce` is set when an event should say so.
    Stubbed { announce: bool },
}

impl CacheBudget {
    pub fn new(limits: CacheLimits, metrics: Arc<dyn CacheCounts>) -> CacheBudget {
        CacheBudget {
            limits,
            state: Mutex::default(),
            metrics,
        }
    }

    /// A new cache's id (one per watched child kind or reference of a running rule).
    pub fn cache_id(&self, kind: CacheKind) -> u64 {
        let mut s = lock(&self.state);
        s.next_cache += 1;
        let id = s.next_cache;
        s.kinds.insert(id, kind);
        id
    }

    /// Follows one watch event of cache `cache`: counts the content it brings, or turns
    /// the object into a stub when its namespace or the whole operator is over budget.
    pub fn admit(&self, cache: u64, rule: &str, event: &mut Event<DynamicObject>) -> Admitted {
        let mut s = lock(&self.state);
        let result = match event {
            Event::Init => {
                // The relist replaces this cache's content; count it afresh.
                let keys: Vec<_> = s.held.keys().filter(|k| k.0 == cache).cloned().collect();
                for k in keys {
                    s.forget(&k);
                }
                Admitted::AsIs
            }
            Event::InitDone => Admitted::AsIs,
            Event::Delete(o) => {
                let key = s.key(cache, o.namespace().as_deref().unwrap_or(""), &o.name_any());
                s.forget(&key);
                Admitted::AsIs
            }
            Event::Apply(o) | Event::InitApply(o) => {
                let ns = o.namespace().unwrap_or_default();
                let key = s.key(cache, &ns, &o.name_any());
                s.forget(&key);
                let kind = s.kinds.get(&cache).copied().unwrap_or(CacheKind::Children);
                let ns_held = s.by_namespace.get(ns.as_str()).copied().unwrap_or(0);
                let counted = |m: &ObjectMeta| metadata_bytes(m).saturating_sub(METADATA_ALLOWANCE);
                if o.data.is_null() {
                    // Cached without content already (it cannot be a child).
                    slim(&mut o.metadata, kind);
                    s.hold(key, &ns, counted(&o.metadata), kind);
                    Admitted::AsIs
                } else {
                    let bytes = o.data.as_str().map_or(0, str::len) + counted(&o.metadata);
                    if ns_held + bytes > self.limits.per_namespace
                        || s.total + bytes > self.limits.total
                    {
                        o.data = serde_json::Value::Null;
                        slim(&mut o.metadata, kind);
                        s.hold(key, &ns, counted(&o.metadata), kind);
                        self.metrics.count_stubbed(rule, kind.as_str());
                        let now = Instant::now();
                        let announce = s
                            .announced
                            .get(&ns)
                            .is_none_or(|t| now.duration_since(*t) > ANNOUNCE_EVERY);
                        if announce {
                            s.announced.insert(ns, now);
                        }
                        Admitted::Stubbed { announce }
                    } else {
                        s.hold(key, &ns, bytes, kind);
                        Admitted::AsIs
                    }
                }
            }
        };
        self.publish(&s);
        result
    }

    /// Forgets everything cache `cache` held (its rule stopped).
    pub fn drop_cache(&self, cache: u64) {
        let mut s = lock(&self.state);
        s.kinds.remove(&cache);
        let keys: Vec<_> = s.held.keys().filter(|k| k.0 == cache).cloned().collect();
        for k in keys {
            s.forget(&k);
        }
        self.publish(&s);
    }

    /// The bytes held, by cache, as the metric shows them.
    fn publish(&self, s: &State) {
        for kind in [
            CacheKind::Parents,
            CacheKind::Children,
            CacheKind::References,
        ] {
            let held = i64::try_from(s.by_kind[kind as usize]).unwrap_or(i64::MAX);
            self.metrics.set_content_bytes(kind.as_str(), held);
        }
    }

    pub fn limits(&self) -> &CacheLimits {
        &self.limits
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
#[path = "admission_tests.rs"]
mod tests;
