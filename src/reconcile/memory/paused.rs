//! [`Paused`]: the UIDs of a rule's parents paused with `rulebook.dev/paused`, shared
//! with the operator's `/status` (which counts them). A parent's entry goes when it is
//! reconciled unpaused, deleted, or missing from a new listing of the parents.

use std::collections::HashSet;

use parking_lot::Mutex;

/// The UIDs of a rule's paused parents.
#[derive(Default)]
pub struct Paused(Mutex<HashSet<String>>);

impl Paused {
    pub fn set(&self, uid: &str, paused: bool) {
        let mut set = self.0.lock();
        if paused {
            if !set.contains(uid) {
                set.insert(uid.to_string());
            }
        } else {
            set.remove(uid);
        }
    }
    pub fn count(&self) -> usize {
        self.0.lock().len()
    }
    pub(super) fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.0.lock().retain(|uid| keep(uid));
    }
}
