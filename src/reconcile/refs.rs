//! Stage 1b of a reconcile, dereference: the objects a parent's references point at,
//! looked up in the reference caches (never written), and the index that tells the
//! engine which parents to reconcile when a referenced object changes.
//!
//! The index is filled by the reconciles themselves: each records where its parent's
//! references point ([`RefIndex::track`]), before it looks them up, so an object that
//! appears after the lookup still wakes the parent. A watch event of a referenced kind
//! then maps to exactly the parents whose target names it, or whose label selector
//! matches it now or matched its previous version (an object relabelled out of a
//! selector): [`RefIndex::before_update`] reads the previous version from the cache
//! before the event is applied, [`RefIndex::parents_for`] after.
//!
//! Its size is bounded by the parents that exist: a parent's entry goes with its delete
//! event, with a parent relist that no longer has it, and — for a reconcile that was
//! still running when its parent went — right after that reconcile tracked it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::Event;
use serde_json::Value as Json;

use super::admission;
use super::cache;
use super::context::RuleContext;
use super::error::ReconcileError;
use super::wire::is_stub;
use crate::meta::JsonAt;
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
    /// The parents whose selector the previous version of an object matched, from just
    /// before its event was applied to the cache until the event is mapped to parents.
    before: HashMap<Key, HashSet<Key>>,
    /// Cached object names by namespace, for selector look-ups.
    members: HashMap<Option<String>, HashSet<String>>,
    /// A relist in progress: its members replace `members` when it completes.
    relist: Option<HashMap<Option<String>, HashSet<String>>>,
}

impl Maps {
    /// The parents whose selector in `ns` matches `labels`; every parent with a selector
    /// in `ns` when the labels are not known (dropped from a stub).
    fn selecting(
        &self,
        ns: &Option<String>,
        labels: Option<&BTreeMap<String, String>>,
    ) -> Vec<Key> {
        self.by_selector
            .get(ns)
            .into_iter()
            .flatten()
            .filter(|p| {
                self.targets.get(*p).is_some_and(|t| match labels {
                    Some(l) => t.selects_labels(l),
                    None => matches!(t.select, RefSelect::Labels(_)),
                })
            })
            .cloned()
            .collect()
    }

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

    /// Forgets every parent `keep` says no longer exists (after a parent relist).
    pub fn retain(&self, keep: impl Fn(&Key) -> bool) {
        let mut m = lock(&self.maps);
        let gone: Vec<Key> = m.targets.keys().filter(|k| !keep(k)).cloned().collect();
        for k in gone {
            m.untrack(&k);
        }
    }

    /// Follows one watch event of the reference's cache, before the cache applies it:
    /// object names by namespace, and the parents the previous version (`previous`, as
    /// the cache still holds it) matched by selector.
    pub fn before_update(&self, event: &Event<DynamicObject>, previous: Option<&DynamicObject>) {
        let mut m = lock(&self.maps);
        if let (Event::Apply(o) | Event::InitApply(o) | Event::Delete(o), Some(old)) =
            (event, previous)
        {
            let key = (o.namespace(), o.name_any());
            let was = m.selecting(&key.0, known_labels(old));
            if !was.is_empty() {
                m.before.entry(key).or_default().extend(was);
            }
        }
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

    /// The parents to reconcile for a change of `o` (after the cache has applied it):
    /// those naming it, those whose selector matches it, and those whose selector matched
    /// its previous version.
    pub fn parents_for(&self, o: &DynamicObject) -> Vec<Key> {
        let key = (o.namespace(), o.name_any());
        let mut m = lock(&self.maps);
        let mut out: HashSet<Key> = m.by_name.get(&key).cloned().unwrap_or_default();
        out.extend(m.selecting(&key.0, known_labels(o)));
        if let Some(before) = m.before.remove(&key) {
            out.extend(before);
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

/// An object's labels, unless a stub dropped them (too large to keep,
/// [`admission::KEPT_REFERENCE_LABEL_BYTES`]).
fn known_labels(o: &DynamicObject) -> Option<&BTreeMap<String, String>> {
    (!is_stub(o) || admission::labels_kept(&o.metadata)).then(|| o.labels())
}

/// Why a parent's references stop its reconcile.
pub(super) enum Stop {
    /// A required object is missing: nothing is applied or pruned.
    Missing(String),
    /// A selector matches more objects than a parent may read (`Limits::max_for_each`),
    /// or the objects take more bytes (`Limits::parent_reference_bytes`).
    TooMany(String),
}

/// What one parent's references select, as the caches hold it: nothing is read into
/// JSON yet, and [`Selected::weight`] says how much the reading may take.
pub(super) struct Selected {
    found: Vec<(RefTarget, Found)>,
    weight: usize,
}

/// What one target selected.
enum Found {
    One(Arc<DynamicObject>),
    /// By a selector, ordered by name.
    Many(Vec<Arc<DynamicObject>>),
    /// An optional object that is not there.
    Absent,
}

impl Selected {
    /// Bytes of the objects selected, as cached (content and metadata); with objects
    /// cached without content among them, what the parent may read in all
    /// ([`crate::render::Limits::parent_reference_bytes`]), as their size is known only
    /// once they are read.
    pub(super) fn weight(&self) -> usize {
        self.weight
    }
}

/// What [`select`] found: the objects, or why the parent stops before reading them.
pub(super) enum Selection {
    Selected(Selected),
    Stopped(Stop),
}

/// Finds what each target selects in its cache (asking the API server only which stubs
/// a selector matches, by their metadata). Targets are tracked first, so an object
/// created meanwhile wakes the parent; a parent deleted while this reconcile ran is
/// forgotten again at once. Objects that take more than the parent may read, as cached,
/// stop the parent here, before any is read.
pub(super) async fn select(
    ctx: &RuleContext,
    parent: &Key,
    targets: Vec<RefTarget>,
) -> Result<Selection, ReconcileError> {
    let spec = &ctx.rule.rule.spec.references;
    for t in &targets {
        if let Some(kind) = ctx.refs.get(t.reference) {
            kind.index.track(parent.clone(), t.clone());
        }
    }
    let mut oref = ObjectRef::new_with(&parent.1, ctx.parent.ar.clone());
    if let Some(ns) = &parent.0 {
        oref = oref.within(ns);
    }
    if ctx.parent_store.get(&oref).is_none() {
        ctx.refs.iter().for_each(|k| k.index.forget(parent));
    }
    let allowed = ctx.rule.limits().parent_reference_bytes;
    let (mut known, mut stubs) = (0usize, false);
    let mut found = Vec::with_capacity(targets.len());
    for t in targets {
        let (Some(kind), Some(r)) = (ctx.refs.get(t.reference), spec.get(t.reference)) else {
            continue;
        };
        let f = match &t.select {
            RefSelect::Name(name) => match cached(kind, &t.namespace, name) {
                Some(o) => Found::One(o),
                None if r.optional => Found::Absent,
                None => return Ok(Selection::Stopped(missing(r, &t))),
            },
            RefSelect::Labels(want) => match by_labels(ctx, kind, &t, want).await? {
                Ok(list) => Found::Many(list),
                Err(too_many) => {
                    return Ok(Selection::Stopped(Stop::TooMany(format!(
                        "refs.{}: {too_many}",
                        r.name.value
                    ))));
                }
            },
        };
        for o in f.objects() {
            if is_stub(o) {
                stubs = true;
            } else {
                known = known.saturating_add(cached_bytes(o));
            }
        }
        if known > allowed {
            return Ok(Selection::Stopped(over(r, allowed)));
        }
        found.push((t, f));
    }
    let weight = if stubs { allowed } else { known };
    Ok(Selection::Selected(Selected { found, weight }))
}

impl Found {
    fn objects(&self) -> impl Iterator<Item = &Arc<DynamicObject>> {
        let (one, many) = match self {
            Found::One(o) => (Some(o), &[][..]),
            Found::Many(list) => (None, list.as_slice()),
            Found::Absent => (None, &[][..]),
        };
        one.into_iter().chain(many)
    }
}

/// The cached objects `t`'s selector `want` matches (stubs whose labels were dropped
/// asked of the API server), ordered by name; `Err` with the message when more match
/// than a parent may read.
async fn by_labels(
    ctx: &RuleContext,
    kind: &RefKind,
    t: &RefTarget,
    want: &BTreeMap<String, String>,
) -> Result<Result<Vec<Arc<DynamicObject>>, String>, ReconcileError> {
    let limit = ctx.rule.limits().max_for_each;
    let mut names = kind.index.members(&t.namespace);
    names.sort();
    let mut selected = Vec::new();
    let mut unknown = HashMap::new();
    for o in names.iter().filter_map(|n| cached(kind, &t.namespace, n)) {
        match known_labels(&o) {
            Some(l) if t.selects_labels(l) => selected.push(o),
            Some(_) => {}
            None => {
                unknown.insert(o.uid().unwrap_or_default(), o);
            }
        }
    }
    if !unknown.is_empty() && selected.len() <= limit {
        let room = limit - selected.len();
        let listed = list_selected(ctx, kind, &t.namespace, want, &unknown, room);
        selected.extend(listed.await?);
    }
    if selected.len() > limit {
        // With stubs among them, counting stopped past the limit.
        let at_least = if unknown.is_empty() { "" } else { "at least " };
        return Ok(Err(format!(
            "{at_least}{} objects match, more than the limit of {limit}",
            selected.len()
        )));
    }
    selected.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    Ok(Ok(selected))
}

/// The `TooMany` of a reference whose objects take more than `allowed` bytes.
fn over(r: &crate::rules::Reference, allowed: usize) -> Stop {
    Stop::TooMany(format!(
        "refs.{}: the objects read take more than {} MiB, the limit per parent",
        r.name.value,
        allowed >> 20
    ))
}

/// `refs.<name>` for the template context (missing optional ones absent).
pub(super) type Refs = BTreeMap<String, Json>;

/// Reads what [`select`] found into JSON for the templates, `refs.<name>` (an object
/// cached without content from the API server), each charged to what the parent may
/// still read before its JSON is built.
pub(super) async fn read(
    ctx: &RuleContext,
    selected: Selected,
) -> Result<Result<Refs, Stop>, ReconcileError> {
    let spec = &ctx.rule.rule.spec.references;
    let allowed = ctx.rule.limits().parent_reference_bytes;
    let mut left = allowed;
    let mut out = BTreeMap::new();
    for (t, f) in selected.found {
        let (Some(kind), Some(r)) = (ctx.refs.get(t.reference), spec.get(t.reference)) else {
            continue;
        };
        match f {
            Found::Absent => {}
            Found::One(o) => match full(ctx, kind, o, &mut left).await? {
                Read::Found(o) => {
                    out.insert(r.name.value.clone(), o);
                }
                Read::Gone if r.optional => {}
                Read::Gone => return Ok(Err(missing(r, &t))),
                Read::Over => return Ok(Err(over(r, allowed))),
            },
            Found::Many(selected) => {
                let mut list = Vec::with_capacity(selected.len());
                for o in selected {
                    let read = is_stub(&o);
                    match full(ctx, kind, o, &mut left).await? {
                        // A stub is read now: it counts if it still matches.
                        Read::Found(o) if !read || t.selects_labels(&labels_of(&o)) => {
                            list.push(o);
                        }
                        Read::Found(_) | Read::Gone => {}
                        Read::Over => return Ok(Err(over(r, allowed))),
                    }
                }
                out.insert(r.name.value.clone(), Json::Array(list));
            }
        }
    }
    Ok(Ok(out))
}

/// The `ReferenceMissing` message: the reference and where it looked, never a value.
fn missing(r: &crate::rules::Reference, t: &RefTarget) -> Stop {
    let narrowed = match &r.watch_selector {
        Some(sel) => format!(
            " (Rulebook sees only objects matching watchSelector '{}')",
            sel.value
        ),
        None => String::new(),
    };
    Stop::Missing(format!(
        "refs.{}: {} not found{narrowed}",
        r.name.value,
        t.describe(&r.kind.value)
    ))
}

fn cached(kind: &RefKind, ns: &Option<String>, name: &str) -> Option<Arc<DynamicObject>> {
    let mut oref = ObjectRef::new_with(name, kind.ar.clone());
    if let Some(ns) = ns {
        oref = oref.within(ns);
    }
    kind.store.get(&oref)
}

/// What [`full`] read.
enum Read {
    Found(Json),
    /// Not there (any more), or another object by that name now.
    Gone,
    /// Past what the parent may read ([`crate::render::Limits::parent_reference_bytes`]).
    Over,
}

/// Bytes of `o` (content and metadata) as cached, or as read.
pub(super) fn cached_bytes(o: &DynamicObject) -> usize {
    let content = match &o.data {
        Json::String(packed) => packed.len(),
        Json::Null => 0,
        other => {
            let mut n = Counted(0);
            serde_json::to_writer(&mut n, other).map_or(usize::MAX, |()| n.0)
        }
    };
    content.saturating_add(admission::metadata_bytes(&o.metadata))
}

/// Charges `o`'s bytes (content and metadata) to what the parent may still read.
fn charge(o: &DynamicObject, left: &mut usize) -> bool {
    let bytes = cached_bytes(o);
    match left.checked_sub(bytes) {
        Some(l) => {
            *left = l;
            true
        }
        None => false,
    }
}

/// Counts what is written to it.
struct Counted(usize);

impl std::io::Write for Counted {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 = self.0.saturating_add(buf.len());
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The object's JSON (with its apiVersion and kind); one cached without content is read
/// from the API server, and counts only if it is still the object cached (same UID).
/// Each is charged to `left` before its JSON is built.
async fn full(
    ctx: &RuleContext,
    kind: &RefKind,
    o: Arc<DynamicObject>,
    left: &mut usize,
) -> Result<Read, ReconcileError> {
    let found = |o: &DynamicObject, left: &mut usize| {
        if !charge(o, left) {
            return Read::Over;
        }
        cache::to_json_as(o, &kind.ar).map_or(Read::Gone, Read::Found)
    };
    if !is_stub(&o) {
        return Ok(found(&o, left));
    }
    let api: Api<DynamicObject> = match (kind.namespaced, o.namespace()) {
        (true, Some(ns)) => Api::namespaced_with(ctx.client.clone(), &ns, &kind.ar),
        _ => Api::all_with(ctx.client.clone(), &kind.ar),
    };
    match api.get_opt(&o.name_any()).await {
        Ok(Some(fresh)) if fresh.uid() == o.uid() => Ok(found(&fresh, left)),
        Ok(_) => Ok(Read::Gone),
        Err(e) => Err(ReconcileError::Read {
            what: format!("{} {}", kind.ar.kind, o.name_any()),
            source: e,
        }),
    }
}

/// The stubs among `unknown` (by UID; their labels were dropped) that `want` matches,
/// asked of the API server: a list of metadata only with the selector, a page of
/// [`LIST_PAGE`] at a time (a tenant's object may carry a megabyte of metadata), until
/// more than `room` are found. A selector that no label can satisfy (a key or value
/// that is not a valid label) matches none and is not sent.
async fn list_selected(
    ctx: &RuleContext,
    kind: &RefKind,
    ns: &Option<String>,
    want: &BTreeMap<String, String>,
    unknown: &HashMap<String, Arc<DynamicObject>>,
    room: usize,
) -> Result<Vec<Arc<DynamicObject>>, ReconcileError> {
    let Some(selector) = label_selector(want) else {
        return Ok(Vec::new());
    };
    let api: Api<DynamicObject> = match (kind.namespaced, ns) {
        (true, Some(ns)) => Api::namespaced_with(ctx.client.clone(), ns, &kind.ar),
        _ => Api::all_with(ctx.client.clone(), &kind.ar),
    };
    let mut params = ListParams::default().labels(&selector).limit(LIST_PAGE);
    let mut out = Vec::new();
    loop {
        let page = api
            .list_metadata(&params)
            .await
            .map_err(|e| ReconcileError::Read {
                what: format!("{} matching the selector of a reference", kind.ar.plural),
                source: e,
            })?;
        out.extend(
            page.items
                .iter()
                .filter_map(|o| unknown.get(o.metadata.uid.as_deref()?))
                .cloned(),
        );
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) if out.len() <= room => params = params.continue_token(&c),
            _ => return Ok(out),
        }
    }
}

/// Objects per page of [`list_selected`] (as the caches' own listings).
const LIST_PAGE: u32 = 25;

/// `metadata.labels` of an object's JSON.
fn labels_of(o: &Json) -> BTreeMap<String, String> {
    o.at(&["metadata", "labels"])
        .and_then(Json::as_object)
        .map(|l| {
            l.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// `k=v,…` for the API server, when every key and value is a valid label key and value
/// (so that nothing in them can change the selector's meaning).
fn label_selector(want: &BTreeMap<String, String>) -> Option<String> {
    let name = |s: &str| {
        s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
            && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
    };
    let key = |k: &str| match k.split_once('/') {
        Some((prefix, n)) => {
            name(n) && prefix.len() <= 253 && prefix.split('.').all(crate::meta::is_dns_label)
        }
        None => name(k),
    };
    let valid = want
        .iter()
        .all(|(k, v)| key(k) && (v.is_empty() || name(v)));
    (valid && !want.is_empty()).then(|| {
        want.iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
#[path = "refs_tests.rs"]
mod tests;
