//! This process's own notes per parent, in one map behind one lock: how many reconciles
//! in a row failed, the last warning recorded on it, and what it remembers of its
//! teardown. An entry goes as soon as it holds nothing ([`Notes`] never keeps an empty
//! one), and with the parent (`super::ParentMemory::forget_gone`).

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use parking_lot::Mutex;

/// The notes of every parent, by UID.
#[derive(Default)]
pub struct Notes(Mutex<HashMap<String, Note>>);

#[derive(Default)]
struct Note {
    /// Reconciles in a row that failed.
    failures: u32,
    /// The last warning recorded (`events.rs`): a digest of its text and its number.
    warning: Option<(u64, u64)>,
    teardown: Option<Teardown>,
}

impl Note {
    fn is_empty(&self) -> bool {
        self.failures == 0 && self.warning.is_none() && self.teardown.is_none()
    }
}

/// What a process remembers of one parent's teardown (forgotten when it is done, or the
/// parent is gone). A restart forgets it: the children let go of are found again in the
/// cluster, and the wait for children in deletion starts again.
#[derive(Debug, Default)]
struct Teardown {
    /// The children this process has deleted or orphaned (UIDs), so each is let go once
    /// even before the caches show it going.
    let_go: HashSet<String>,
    /// When this process first found one of the parent's children in deletion: the
    /// teardown waits for such children at most `teardown::WAVE_TIMEOUT` from then.
    waiting_since: Option<Instant>,
}

impl Notes {
    /// Parent `uid` reconciled without error: its failures and last warning go.
    pub fn succeeded(&self, uid: &str) {
        let mut m = self.0.lock();
        if let Some(n) = m.get_mut(uid) {
            n.failures = 0;
            n.warning = None;
            if n.is_empty() {
                m.remove(uid);
            }
        }
    }

    /// Counts a failure of parent `uid`; returns how many in a row.
    pub fn failed(&self, uid: &str) -> u32 {
        let mut m = self.0.lock();
        let n = &mut m.entry(uid.to_string()).or_default().failures;
        *n = n.saturating_add(1);
        *n
    }

    /// Records warning `(digest, number)` on parent `uid`, unless the last one recorded
    /// has the same digest (then `false`: the same warning again says nothing new).
    pub fn warn_once(&self, uid: &str, digest: u64, number: u64) -> bool {
        let mut m = self.0.lock();
        let note = m.entry(uid.to_string()).or_default();
        if note.warning.is_some_and(|(d, _)| d == digest) {
            return false;
        }
        note.warning = Some((digest, number));
        true
    }

    /// Warning `number` of parent `uid` was not sent: forgotten, unless another was
    /// recorded since.
    pub fn warning_unsent(&self, uid: &str, number: u64) {
        let mut m = self.0.lock();
        if let Some(n) = m.get_mut(uid)
            && n.warning.is_some_and(|(_, w)| w == number)
        {
            n.warning = None;
            if n.is_empty() {
                m.remove(uid);
            }
        }
    }

    /// When this process first found one of parent `uid`'s children in deletion, noting
    /// now if it finds one (`in_deletion`) for the first time.
    pub fn waiting_since(&self, uid: &str, in_deletion: bool) -> Option<Instant> {
        let mut m = self.0.lock();
        let t = m
            .entry(uid.to_string())
            .or_default()
            .teardown
            .get_or_insert_default();
        if t.waiting_since.is_none() && in_deletion {
            t.waiting_since = Some(Instant::now());
        }
        t.waiting_since
    }

    /// The children of parent `uid` this process let go of, among `still` (those still
    /// owned): the others are forgotten, so objects a tenant keeps creating under a
    /// parent being torn down do not pile up here.
    pub fn let_go_among(&self, uid: &str, still: &HashSet<String>) -> HashSet<String> {
        let mut m = self.0.lock();
        match m.get_mut(uid).and_then(|n| n.teardown.as_mut()) {
            Some(t) => {
                t.let_go.retain(|child| still.contains(child));
                t.let_go.clone()
            }
            None => HashSet::new(),
        }
    }

    /// This process let go of child `child` of parent `uid` (deleted or orphaned it).
    pub fn let_go(&self, uid: &str, child: String) {
        let mut m = self.0.lock();
        let t = m
            .entry(uid.to_string())
            .or_default()
            .teardown
            .get_or_insert_default();
        t.let_go.insert(child);
    }

    /// Parent `uid`'s teardown is done: what it remembered goes.
    pub fn teardown_done(&self, uid: &str) {
        let mut m = self.0.lock();
        if let Some(n) = m.get_mut(uid) {
            n.teardown = None;
            if n.is_empty() {
                m.remove(uid);
            }
        }
    }

    /// Forgets parent `uid` whole.
    pub fn forget(&self, uid: &str) {
        self.0.lock().remove(uid);
    }

    /// Keeps only the parents `keep` says exist.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.0.lock().retain(|uid, _| keep(uid));
    }

    /// How many parents have notes.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.0.lock().len()
    }
}
