//! The pass-throughs a rule's watch streams go through between the API server and the
//! caches: tolerant decoding into the cached form, the cache budget, the first-listing
//! and relist signals, and the filter of parent changes worth a reconcile.

use std::sync::Arc;

use crate::reconcile::recorder::Recorder;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use tracing::{info, warn};

use super::status::EngineStatus;
use crate::reconcile::admission::{Admitted, CacheBudget};
use crate::reconcile::wire::Wire;

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

/// A pass-through for one child cache's events that keeps it within the cache budget,
/// announcing (once per namespace in a while) the objects cached without content.
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
            warn!(rule = %rule, namespace = %ns, "cache budget reached: children in this namespace are cached without content and read on demand");
            let reference = o.object_ref(&ar);
            let limits = budget.limits().clone();
            let recorder = recorder.clone();
            tokio::spawn(async move {
                let ev = kube::runtime::events::Event {
                    type_: kube::runtime::events::EventType::Warning,
                    reason: "CacheBudgetExceeded".into(),
                    note: Some(format!(
                        "Objects with Rulebook's labels in this namespace exceed the cache budget ({} MiB per namespace, {} MiB in all); Rulebook reads them from the API server when it needs them",
                        limits.per_namespace >> 20,
                        limits.total >> 20
                    )),
                    action: "Cache".into(),
                    secondary: None,
                };
                if let Err(e) = recorder.publish(&ev, &reference).await {
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
