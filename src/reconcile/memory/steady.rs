//! [`Steady`]: per parent, a fingerprint of every input of its last reconcile that found
//! nothing to do (the parent's resourceVersion, its live children's and its referenced
//! objects' UIDs and resourceVersions: [`super::digest`]). A reconcile whose inputs have
//! the same fingerprint would render the same children, find them up to date and compute
//! the same status, so it stops after observing: a resync of an unchanged parent costs a
//! hash of a few strings, not a render. A reconcile that wrote marks the inputs its
//! writes will leave (the children as applied, the parent as its status write left it)
//! when its render does not read the live children, and awaits those writes' watch
//! events, which then bring no reconcile ([`Steady::expects`]); a reconcile that comes
//! anyway stops early too.
//!
//! Only ever a shortcut to "nothing to do": a miss costs the full reconcile. It outlives
//! one run of the rule's controller (the engine keeps it per rule version:
//! `engine::Engine::start`), so a controller restarted over the same version (a lease
//! regained, a share handed back) does not render every parent again.

use std::collections::HashMap;

use parking_lot::Mutex;

/// Per parent UID, the fingerprint of its last reconcile that had nothing to do, the
/// hash of the parent's namespace (`None` for a cluster-scoped parent), so a sharded
/// replica forgets what it remembers of parents that left its share, and the children
/// whose watch events this process's own writes will bring ([`Steady::expects`]).
#[derive(Default)]
pub struct Steady(Mutex<HashMap<String, Entry>>);

/// Writes awaited per parent at most (then forgotten: a miss costs a reconcile that
/// stops early).
pub(super) const AWAITED_MAX: usize = 64;

struct Entry {
    /// `None` while only writes are awaited.
    fingerprint: Option<u64>,
    namespace: Option<u64>,
    /// Children written, as (hash of UID, resourceVersion of the write's answer), until
    /// that version's watch event comes.
    awaited: Vec<(u64, u64)>,
}

impl Steady {
    pub fn holds(&self, uid: &str, fingerprint: u64) -> bool {
        self.0.lock().get(uid).and_then(|e| e.fingerprint) == Some(fingerprint)
    }
    /// A reconcile of parent `uid` that wrote nothing had these inputs.
    pub fn mark(&self, uid: &str, namespace: Option<&str>, fingerprint: u64) {
        let entry = Entry {
            fingerprint: Some(fingerprint),
            namespace: namespace.map(crate::shard::fnv1a),
            awaited: Vec::new(),
        };
        self.0.lock().insert(uid.to_string(), entry);
    }
    /// A reconcile of parent `uid` wrote, and its writes leave the inputs `fingerprint`
    /// counts: the writes it awaits stay awaited.
    pub fn mark_written(&self, uid: &str, namespace: Option<&str>, fingerprint: u64) {
        let mut m = self.0.lock();
        match m.get_mut(uid) {
            Some(e) => e.fingerprint = Some(fingerprint),
            None => {
                let entry = Entry {
                    fingerprint: Some(fingerprint),
                    namespace: namespace.map(crate::shard::fnv1a),
                    awaited: Vec::new(),
                };
                m.insert(uid.to_string(), entry);
            }
        }
    }
    /// A reconcile of parent `parent` wrote child `child`, and the answer carried
    /// resourceVersion `rv`: that version's watch event is awaited. Only for rules whose
    /// reconciles read neither the live children nor the parent's status, so that the
    /// writing reconcile's outcome is what another would have: it marks the inputs its
    /// writes leave ([`Steady::mark_written`]); or it fails, or waits for a child it
    /// wrote before, and is retried either way.
    pub fn await_write(&self, parent: &str, namespace: Option<&str>, child: &str, rv: u64) {
        let mut m = self.0.lock();
        let e = m.entry(parent.to_string()).or_insert_with(|| Entry {
            fingerprint: None,
            namespace: namespace.map(crate::shard::fnv1a),
            awaited: Vec::new(),
        });
        // One version awaited a child: an earlier one's event may still come, and then
        // brings a reconcile that stops early; nothing piles up.
        let child = crate::shard::fnv1a(child);
        e.awaited.retain(|(c, _)| *c != child);
        if e.awaited.len() >= AWAITED_MAX {
            e.awaited = Vec::new();
        }
        e.awaited.push((child, rv));
    }
    /// A reconcile of `parent` begins: what earlier reconciles awaited is no longer
    /// awaited (it decides from the caches as they are now, and an awaited event it does
    /// not see would have to bring another: a child it finds missing and does not prune,
    /// a write it finds pending, a prune refused because the child moved on). Returns
    /// what was awaited, for [`Steady::resume`].
    pub fn begin(&self, parent: &str) -> Vec<(u64, u64)> {
        let mut m = self.0.lock();
        m.get_mut(parent)
            .map(|e| std::mem::take(&mut e.awaited))
            .unwrap_or_default()
    }
    /// The reconcile that began with [`Steady::begin`] stopped at the fingerprint: it
    /// decided nothing (the inputs are those the last writing reconcile marked, with the
    /// children behind counted as written), so what that reconcile awaited is awaited
    /// again. (An awaited event that came in between brought a reconcile; it will not
    /// come again.)
    pub fn resume(&self, parent: &str, awaited: Vec<(u64, u64)>) {
        if awaited.is_empty() {
            return;
        }
        if let Some(e) = self.0.lock().get_mut(parent) {
            let mine = std::mem::take(&mut e.awaited);
            e.awaited = awaited;
            e.awaited.extend(mine);
        }
    }
    /// Whether a watch event of child `child` at resourceVersion `rv` is one awaited for
    /// parent `parent` ([`Steady::await_write`]): the answer to this process's own write.
    /// It needs no reconcile: while the writing reconcile runs, it leaves (or retries)
    /// exactly those inputs; after it, and until another reconcile begins, the cache
    /// moves towards the inputs it marked (with all its writes in, a reconcile would stop
    /// at the fingerprint; before, it would count the children behind as written:
    /// `Applied::keys_as_applied`), and the status counts them already. The caches hold
    /// the event before this is asked, so a reconcile that begins after it sees it. Any
    /// other version of the child (an edit by someone else, even right after), its
    /// deletion or a relist does not match, nor does a write awaited before a reconcile
    /// that has begun since. Each awaited event matches once.
    pub fn expects(&self, parent: &str, child: &str, rv: u64) -> bool {
        let mut m = self.0.lock();
        let Some(entry) = m.get_mut(parent) else {
            return false;
        };
        let key = (crate::shard::fnv1a(child), rv);
        let Some(i) = entry.awaited.iter().position(|a| *a == key) else {
            return false;
        };
        entry.awaited.swap_remove(i);
        if entry.awaited.is_empty() {
            entry.awaited = Vec::new();
        }
        true
    }
    pub fn forget(&self, uid: &str) {
        self.0.lock().remove(uid);
    }
    /// Keeps only the parents `keep` says exist.
    pub fn retain_uids(&self, keep: impl Fn(&str) -> bool) {
        self.0.lock().retain(|uid, _| keep(uid));
    }
    /// Keeps only the parents whose namespace hash `keep` holds (and every
    /// cluster-scoped one: such a rule moves whole, and runs here only when it is ours).
    pub fn retain_namespaces(&self, keep: impl Fn(u64) -> bool) {
        self.0.lock().retain(|_, e| e.namespace.is_none_or(&keep));
    }
    pub fn len(&self) -> usize {
        self.0.lock().len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
