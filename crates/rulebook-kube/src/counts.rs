//! What the kube layer counts, as traits: the operator's metrics registry
//! (`rulebook::metrics::Metrics`) implements them and is passed in as an
//! `Arc<dyn …>`, so this crate names no registry and no metric of the operator's, and
//! its tests count with a plain double. (Not called `metrics`: that is the operator's
//! registry, a layer above this crate in `tests/layering.rs`.)

/// What the write path counts: each write sent, and each write the gate refused.
pub trait WriteCounts: Send + Sync {
    /// A write request of `verb` (`apply`, `apply_status`, `patch`, `delete`, `event`)
    /// for rule `rule` was answered (`rulebook_api_writes_total`).
    fn count_write(&self, rule: &str, verb: &str);
    /// A write was refused by the write gate, in the writer or in the client
    /// (`rulebook_writes_refused_total`).
    fn count_refused(&self);
}

/// What the cache budget counts ([`crate::cache::admission::CacheBudget`]).
pub trait CacheCounts: Send + Sync {
    /// A child of rule `rule` was cached without its content, in cache `cache`
    /// (`parents`, `children` or `references`): `rulebook_cache_stubbed_total`.
    fn count_stubbed(&self, rule: &str, cache: &str);
    /// The bytes the budget counts for cache `cache`, all rules:
    /// `rulebook_cache_content_bytes`.
    fn set_content_bytes(&self, cache: &str, bytes: i64);
}

/// A counting double for this crate's unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::collections::HashMap;
    use std::sync::Mutex;

    #[derive(Default)]
    pub struct Counted {
        pub writes: Mutex<Vec<(String, String)>>,
        pub refused: Mutex<u64>,
        pub stubbed: Mutex<Vec<(String, String)>>,
        pub content_bytes: Mutex<HashMap<String, i64>>,
    }

    impl Counted {
        pub fn refused(&self) -> u64 {
            *self.refused.lock().unwrap()
        }
        pub fn writes(&self) -> usize {
            self.writes.lock().unwrap().len()
        }
        pub fn content_bytes(&self, cache: &str) -> i64 {
            self.content_bytes
                .lock()
                .unwrap()
                .get(cache)
                .copied()
                .unwrap_or(0)
        }
    }

    impl super::WriteCounts for Counted {
        fn count_write(&self, rule: &str, verb: &str) {
            (self.writes.lock().unwrap()).push((rule.to_string(), verb.to_string()));
        }
        fn count_refused(&self) {
            *self.refused.lock().unwrap() += 1;
        }
    }

    impl super::CacheCounts for Counted {
        fn count_stubbed(&self, rule: &str, cache: &str) {
            (self.stubbed.lock().unwrap()).push((rule.to_string(), cache.to_string()));
        }
        fn set_content_bytes(&self, cache: &str, bytes: i64) {
            (self.content_bytes.lock().unwrap()).insert(cache.to_string(), bytes);
        }
    }
}
