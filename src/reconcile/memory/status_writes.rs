//! The parents' status as this process last wrote it: per parent UID, the status and the
//! parent's resourceVersion after the write, until the parent watch has delivered it (and
//! a little longer). Also where the parent watch reports what the other memories forget
//! by: the parents deleted, and each new listing of the parents.
//!
//! A reconcile works on the parent as cached when it started, which may predate this
//! process's last status write; without this, it would write the same status twice, or
//! skip a write because the stale cached status happens to match. Bounded in time: an
//! entry goes [`STATUS_WRITE_KEEP`] after the watch delivered the write, or
//! [`STATUS_WRITE_MAX`] after the write (a parent deleted meanwhile).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::DynamicObject;
use parking_lot::Mutex;
use serde_json::Value as Json;

use super::digest::identity;

/// The status last written per parent UID, with the parent's resourceVersion after the
/// write. A reconcile works on the parent as cached when it started, which may predate
/// Rulebook's last status write even after the cache has caught up, so an entry is kept
/// for [`STATUS_WRITE_KEEP`] after the parent watch has delivered the write
/// ([`StatusWrites::observe`]); the status itself is held as compact JSON text.
#[derive(Default)]
pub struct StatusWrites {
    written: Mutex<Written>,
    /// UIDs of parents deleted since the last reconcile: their per-parent memory goes.
    gone: Mutex<Vec<String>>,
    /// Whether the parents were listed again since the last reconcile: parents deleted
    /// while the watch was down (or before a restart of the rule) brought no deletion.
    relisted: std::sync::atomic::AtomicBool,
}

struct StatusWrite {
    rv: u64,
    /// [`identity`] of the parent as the write left it.
    identity: Option<u64>,
    status: String,
    at: Instant,
    /// The parent watch has delivered this write (or a later version).
    seen: bool,
}

/// How long a status write is remembered after the cache has it: longer than a reconcile
/// that started on the parent before the watch delivered the write takes.
const STATUS_WRITE_KEEP: Duration = Duration::from_secs(10);
/// How long one is remembered at most (its watch event may never come: parent deleted).
const STATUS_WRITE_MAX: Duration = Duration::from_secs(600);
/// How often the writes no longer needed are swept, at most.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// The writes, and when they were last swept. A sweep runs on the way of any use once
/// [`SWEEP_EVERY`] has passed: every resync reconcile reads the table, so a converged
/// operator holds none of them for long.
#[derive(Default)]
struct Written {
    map: HashMap<String, StatusWrite>,
    swept: Option<Instant>,
}

impl Written {
    fn sweep_if_due(&mut self) -> &mut HashMap<String, StatusWrite> {
        if self.swept.is_none_or(|t| t.elapsed() >= SWEEP_EVERY) {
            self.map.retain(|_, w| {
                let age = w.at.elapsed();
                age < STATUS_WRITE_MAX && !(w.seen && age > STATUS_WRITE_KEEP)
            });
            self.swept = Some(Instant::now());
        }
        &mut self.map
    }
}

impl StatusWrites {
    /// Notes writes the cache now holds; forgets those of deleted parents.
    pub fn observe(&self, event: &kube::runtime::watcher::Event<DynamicObject>) {
        use kube::runtime::watcher::Event;
        let (o, deleted) = match event {
            // Not `InitApply`: the cache holds a relisted object only from `InitDone` on.
            Event::Apply(o) => (o, false),
            Event::Delete(o) => (o, true),
            Event::InitDone => {
                self.relisted
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                return;
            }
            _ => return,
        };
        let Some(uid) = o.uid() else { return };
        let mut table = self.written.lock();
        let written = table.sweep_if_due();
        if deleted {
            written.remove(&uid);
            self.gone.lock().push(uid);
        } else if let Some(w) = written.get_mut(&uid)
            && resource_version(o).is_none_or(|seen| seen >= w.rv)
        {
            w.seen = true;
        }
    }

    pub fn record(&self, uid: String, rv: u64, identity: Option<u64>, status: &Json) {
        self.written.lock().sweep_if_due().insert(
            uid,
            StatusWrite {
                rv,
                identity,
                status: status.to_string(),
                at: Instant::now(),
                seen: false,
            },
        );
    }

    /// The status of the last write of this parent if the cached parent predates it.
    /// resourceVersions are compared as numbers (etcd revisions); a parent whose
    /// resourceVersion is not a number is taken as it is cached.
    pub fn newer_than(&self, uid: &str, cached: &DynamicObject) -> Option<Json> {
        let mut table = self.written.lock();
        let w = table.sweep_if_due().get(uid)?;
        match resource_version(cached) {
            Some(seen) if seen < w.rv => serde_json::from_str(&w.status).ok(),
            _ => None,
        }
    }

    /// The parent's resourceVersion as far as this process knows: the cached one, or that
    /// of Rulebook's own last status write when the cache has not caught up yet — but only
    /// when that write left the parent as `cached` is otherwise (same generation, labels,
    /// annotations, finalizers): a change someone made before the write landed must not
    /// pass for one this process has seen.
    pub fn latest_rv(&self, uid: &str, cached: &DynamicObject) -> Option<u64> {
        let seen = resource_version(cached);
        let written = self
            .written
            .lock()
            .sweep_if_due()
            .get(uid)
            .filter(|w| w.identity.is_some() && w.identity == identity(cached))
            .map(|w| w.rv);
        match (seen, written) {
            (Some(s), Some(w)) => Some(s.max(w)),
            (s, _) => s,
        }
    }

    /// UIDs of the parents deleted since the last call.
    pub fn take_gone(&self) -> Vec<String> {
        std::mem::take(&mut *self.gone.lock())
    }

    /// Whether the parents were listed again since the last call.
    pub fn take_relisted(&self) -> bool {
        self.relisted
            .swap(false, std::sync::atomic::Ordering::SeqCst)
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.written.lock().map.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn resource_version(o: &DynamicObject) -> Option<u64> {
    o.resource_version().and_then(|v| v.parse::<u64>().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parent_at(rv: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "x/v1", "kind": "P",
            "metadata": {"name": "p", "uid": "u1", "resourceVersion": rv},
            "status": {"phase": "cached"}
        }))
        .unwrap()
    }

    /// A deletion is reported once, and so is a new listing of the parents (after which
    /// the rule forgets parents the listing no longer has: their deletion may have been
    /// missed).
    #[test]
    fn deletions_and_listings_are_reported_once() {
        use kube::runtime::watcher::Event;
        let w = StatusWrites::default();
        assert!(!w.take_relisted());
        w.observe(&Event::Delete(parent_at("5")));
        w.observe(&Event::Init);
        w.observe(&Event::InitApply(parent_at("6")));
        assert!(!w.take_relisted(), "not before the listing is complete");
        w.observe(&Event::InitDone);
        assert_eq!(w.take_gone(), ["u1"]);
        assert!(w.take_gone().is_empty());
        assert!(w.take_relisted());
        assert!(!w.take_relisted());
    }

    #[test]
    fn a_status_write_stands_for_the_parent_only_as_it_was_rendered() {
        let at = |rv: &str, generation: i64| -> DynamicObject {
            serde_json::from_value(json!({
                "apiVersion": "x/v1", "kind": "P",
                "metadata": {"name": "p", "uid": "u1", "resourceVersion": rv,
                             "generation": generation}
            }))
            .unwrap()
        };
        let w = StatusWrites::default();
        // The write left generation 1 at resourceVersion 10.
        w.record("u1".into(), 10, identity(&at("10", 1)), &json!({}));
        // The cached parent (generation 1, before the write): the write is what is known.
        assert_eq!(w.latest_rv("u1", &at("8", 1)), Some(10));
        // Someone changed the spec before the write landed: the write does not stand for
        // that change; the cached version does.
        assert_eq!(w.latest_rv("u1", &at("9", 2)), Some(9));
        // A write without identity (a kind without generation) never stands in.
        w.record("u1".into(), 12, None, &json!({}));
        assert_eq!(w.latest_rv("u1", &at("8", 1)), Some(8));
    }

    #[test]
    fn a_status_write_counts_until_the_cache_has_caught_up() {
        use kube::runtime::watcher::Event;
        let w = StatusWrites::default();
        w.record("u1".into(), 10, None, &json!({"phase": "written"}));
        // A cached parent from before the write: the written status is what the server has.
        assert_eq!(
            w.newer_than("u1", &parent_at("9")),
            Some(json!({"phase": "written"}))
        );
        assert_eq!(w.newer_than("u2", &parent_at("9")), None);
        // From the write on, the cache is right.
        assert_eq!(w.newer_than("u1", &parent_at("10")), None);
        assert_eq!(w.newer_than("u1", &parent_at("not-a-number")), None);
        // Once the cache has the write, a reconcile that started on an older version of
        // the parent must still compare with the write.
        w.observe(&Event::Apply(parent_at("11")));
        assert_eq!(
            w.newer_than("u1", &parent_at("9")),
            Some(json!({"phase": "written"}))
        );
        assert_eq!(w.newer_than("u1", &parent_at("11")), None);
        // A deleted parent is forgotten.
        w.observe(&Event::Delete(parent_at("15")));
        assert!(w.is_empty());
    }

    #[test]
    fn writes_the_cache_has_are_swept_on_the_way_of_any_read() {
        let w = StatusWrites::default();
        w.record("u1".into(), 10, None, &json!({}));
        w.record("u2".into(), 10, None, &json!({}));
        {
            let mut t = w.written.lock();
            let long_ago = Instant::now()
                .checked_sub(STATUS_WRITE_KEEP + Duration::from_secs(1))
                .unwrap();
            t.map.values_mut().for_each(|w| w.at = long_ago);
            t.map.get_mut("u1").unwrap().seen = true;
            // Not yet due: nothing goes.
            t.swept = Some(Instant::now());
        }
        assert_eq!(w.latest_rv("u3", &parent_at("1")), Some(1));
        assert_eq!(w.len(), 2);
        w.written.lock().swept = Instant::now().checked_sub(SWEEP_EVERY);
        // A reconcile's read sweeps: the write the cache has goes, the one it has not stays.
        assert_eq!(w.latest_rv("u3", &parent_at("1")), Some(1));
        assert_eq!(w.len(), 1);
        assert!(w.newer_than("u2", &parent_at("9")).is_some());
    }
}
