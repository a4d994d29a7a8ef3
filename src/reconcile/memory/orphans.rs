//! [`OrphansPending`]: what the rule's clean-up of kinds an earlier version had tells
//! its reconciles (one value per rule, shared with `engine::dropped`, which sets it): that
//! children of a dropped kind still wait to be orphaned, and which kinds it has finished
//! with, where. Not per parent: its size is the number of kinds a rule dropped.

use parking_lot::Mutex;

/// Set while the engine lets go of the children of kinds an earlier version of the rule
/// had and some of them are to be orphaned (`engine::dropped`): the new version's caches
/// do not see them, and the garbage collector would delete them with a parent whose
/// finalizer came off. Meanwhile parents keep Rulebook's finalizer, and a parent being
/// deleted waits with it. Also what that clean-up finished: the kinds (group and kind)
/// of which it let go of every child, and where (a sharded replica's share), which the
/// parents there may take off their record of `Orphan` kinds.
#[derive(Debug)]
pub struct OrphansPending {
    running: std::sync::atomic::AtomicBool,
    cleaned: Mutex<Vec<CleanedKind>>,
    /// Counts the kinds cleaned up: the rule's parents are reconciled once more after
    /// each (their record and finalizer may come off), rather than at their next change.
    counter: tokio::sync::watch::Sender<u64>,
}

impl Default for OrphansPending {
    fn default() -> OrphansPending {
        OrphansPending::new(false)
    }
}

/// `(group, kind)`, and the share it was cleaned up in (`None`: everywhere).
type CleanedKind = ((String, String), Option<crate::shard::Ranges>);

impl OrphansPending {
    pub fn new(pending: bool) -> OrphansPending {
        OrphansPending {
            running: std::sync::atomic::AtomicBool::new(pending),
            cleaned: Mutex::default(),
            counter: tokio::sync::watch::Sender::new(0),
        }
    }

    pub fn get(&self) -> bool {
        self.running.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn clear(&self) {
        self.running
            .store(false, std::sync::atomic::Ordering::SeqCst)
    }

    /// Every child of `(group, kind)` within `share` (everywhere: `None`) was let go of.
    pub fn cleaned(&self, group_kind: (String, String), share: Option<crate::shard::Ranges>) {
        self.cleaned.lock().push((group_kind, share));
        self.counter.send_modify(|n| *n += 1);
    }

    /// One item each time a kind is cleaned up (after this is called).
    pub fn on_cleaned(&self) -> impl futures::Stream<Item = ()> + Send + 'static {
        futures::stream::unfold(self.counter.subscribe(), |mut rx| async move {
            rx.changed().await.ok().map(|()| ((), rx))
        })
    }

    /// Whether every child of `(group, kind)` in `namespace` was let go of.
    pub fn was_cleaned(&self, group: &str, kind: &str, namespace: Option<&str>) -> bool {
        self.cleaned.lock().iter().any(|((g, k), share)| {
            g == group
                && k == kind
                && share
                    .as_ref()
                    .is_none_or(|r| namespace.is_some_and(|ns| r.holds_namespace(ns)))
        })
    }
}
