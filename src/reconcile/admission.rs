//! What the child caches may hold: a bound on cached child content, per namespace and in
//! total, so that no tenant can grow the operator's memory by creating objects that carry
//! Rulebook's labels.
//!
//! Child caches select on public labels, which anyone may set in their own namespace.
//! Objects that cannot be children arrive without content already ([`super::wire`]);
//! objects that look like children (owner label = controller reference UID) keep their
//! content while their namespace stays under [`CacheBudget::per_namespace`] and the
//! operator under [`CacheBudget::total`]. Past that an object is cached as a stub
//! (metadata only; a reconcile reads it from the API server when it needs it), counted
//! in a metric, and announced once per namespace in a while by a Warning Event on it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::watcher::Event;

use crate::metrics::{self, Metrics};

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

/// How often the budget event is repeated for one namespace.
const ANNOUNCE_EVERY: Duration = Duration::from_secs(600);

/// Cached bytes by cache and object, shared by every rule's child caches.
pub struct CacheBudget {
    limits: CacheLimits,
    state: Mutex<State>,
    metrics: Arc<Metrics>,
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
    announced: HashMap<String, Instant>,
    next_cache: u64,
}

struct Held {
    namespace: Arc<str>,
    bytes: usize,
}

impl State {
    fn key(&self, cache: u64, ns: &str, name: &str) -> (u64, u64) {
        use std::hash::BuildHasher;
        (cache, self.digest.hash_one((ns, name)))
    }

    fn forget(&mut self, key: &(u64, u64)) {
        if let Some(Held { namespace, bytes }) = self.held.remove(key) {
            self.total = self.total.saturating_sub(bytes);
            if let Some(ns) = self.by_namespace.get_mut(&namespace) {
                *ns = ns.saturating_sub(bytes);
                if *ns == 0 {
                    self.by_namespace.remove(&namespace);
                }
            }
        }
    }

    fn hold(&mut self, key: (u64, u64), ns: &str, bytes: usize) {
        let namespace = match self.by_namespace.get_key_value(ns) {
            Some((shared, _)) => shared.clone(),
            None => Arc::from(ns),
        };
        *self.by_namespace.entry(namespace.clone()).or_insert(0) += bytes;
        self.held.insert(key, Held { namespace, bytes });
        self.total += bytes;
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
    pub fn new(limits: CacheLimits, metrics: Arc<Metrics>) -> CacheBudget {
        CacheBudget {
            limits,
            state: Mutex::default(),
            metrics,
        }
    }

    /// A new cache's id (one per watched child kind of a running rule).
    pub fn cache_id(&self) -> u64 {
        let mut s = lock(&self.state);
        s.next_cache += 1;
        s.next_cache
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
                let bytes = o.data.as_str().map_or(0, str::len);
                let ns_held = s.by_namespace.get(ns.as_str()).copied().unwrap_or(0);
                if bytes == 0 {
                    Admitted::AsIs
                } else if ns_held + bytes > self.limits.per_namespace
                    || s.total + bytes > self.limits.total
                {
                    o.data = serde_json::Value::Null;
                    self.metrics
                        .cache_stubbed
                        .get_or_create(&metrics::rule(rule))
                        .inc();
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
                    s.hold(key, &ns, bytes);
                    Admitted::AsIs
                }
            }
        };
        self.metrics.cache_content_bytes.set(s.total as i64);
        result
    }

    /// Forgets everything cache `cache` held (its rule stopped).
    pub fn drop_cache(&self, cache: u64) {
        let mut s = lock(&self.state);
        let keys: Vec<_> = s.held.keys().filter(|k| k.0 == cache).cloned().collect();
        for k in keys {
            s.forget(&k);
        }
        self.metrics.cache_content_bytes.set(s.total as i64);
    }

    pub fn limits(&self) -> &CacheLimits {
        &self.limits
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cm(ns: &str, name: &str, bytes: usize) -> DynamicObject {
        let mut o: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns}
        }))
        .unwrap();
        o.data = serde_json::Value::String("x".repeat(bytes));
        o
    }

    fn budget(per_namespace: usize, total: usize) -> CacheBudget {
        CacheBudget::new(
            CacheLimits {
                per_namespace,
                total,
            },
            Arc::new(Metrics::new()),
        )
    }

    #[test]
    fn a_namespace_over_its_budget_gets_stubs_and_others_do_not() {
        let b = budget(1000, 10_000);
        let c = b.cache_id();
        for i in 0..3 {
            let mut e = Event::Apply(cm("tenant", &format!("c{i}"), 300));
            assert_eq!(b.admit(c, "r", &mut e), Admitted::AsIs);
        }
        let mut e = Event::Apply(cm("tenant", "c3", 300));
        assert_eq!(
            b.admit(c, "r", &mut e),
            Admitted::Stubbed { announce: true }
        );
        let Event::Apply(o) = &e else { unreachable!() };
        assert!(o.data.is_null());
        // Announced once per namespace in a while.
        let mut e = Event::Apply(cm("tenant", "c4", 300));
        assert_eq!(
            b.admit(c, "r", &mut e),
            Admitted::Stubbed { announce: false }
        );
        // Another namespace is unaffected.
        let mut e = Event::Apply(cm("other", "c0", 300));
        assert_eq!(b.admit(c, "r", &mut e), Admitted::AsIs);
        // A deletion frees room; a replaced object is counted once.
        b.admit(c, "r", &mut Event::Delete(cm("tenant", "c0", 300)));
        let mut e = Event::Apply(cm("tenant", "c1", 300));
        assert_eq!(b.admit(c, "r", &mut e), Admitted::AsIs);
        let mut e = Event::Apply(cm("tenant", "c5", 300));
        assert_eq!(b.admit(c, "r", &mut e), Admitted::AsIs);
        let mut e = Event::Apply(cm("tenant", "c6", 300));
        assert!(matches!(b.admit(c, "r", &mut e), Admitted::Stubbed { .. }));
    }

    #[test]
    fn the_total_bounds_all_namespaces_and_a_relist_counts_afresh() {
        let b = budget(1000, 1000);
        let c = b.cache_id();
        for i in 0..3 {
            let mut e = Event::Apply(cm(&format!("ns{i}"), "c", 300));
            assert_eq!(b.admit(c, "r", &mut e), Admitted::AsIs);
        }
        let mut e = Event::Apply(cm("ns3", "c", 300));
        assert!(matches!(b.admit(c, "r", &mut e), Admitted::Stubbed { .. }));
        b.admit(c, "r", &mut Event::Init);
        let mut e = Event::InitApply(cm("ns3", "c", 300));
        assert_eq!(b.admit(c, "r", &mut e), Admitted::AsIs);
        b.drop_cache(c);
        assert_eq!(lock(&b.state).total, 0);
    }
}
