//! The watch of a rule's referenced kinds: one cache per reference, filtered by the API
//! server as narrowly as the rule allows, and a pass-through that shows the reference
//! index each object's previous version (so an object relabelled out of a selector
//! still wakes the parents it used to match).

use std::sync::Arc;

use futures::StreamExt;
use kube::api::{Api, ApiResource};
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};

use super::runner::RuleRunner;
use super::streams::{LIST_PAGE_SIZE, admission, packed};
use crate::cache::wire::Wire;
use crate::reconcile::refs::RefIndex;

impl RuleRunner {
    /// The watch of reference `i`'s kind, filtered as narrowly as the rule allows (a
    /// literal namespace, `watchSelector` or the selector's literal keys, a literal
    /// name), into its cache; and the cache.
    #[allow(clippy::type_complexity)]
    pub(super) fn reference_stream(
        &self,
        i: usize,
        cache_id: u64,
        (ar, namespaced): (&ApiResource, bool),
        index: Arc<RefIndex>,
        synced: impl FnMut(
            Result<watcher::Event<kube::api::DynamicObject>, watcher::Error>,
        ) -> Result<watcher::Event<kube::api::DynamicObject>, watcher::Error>
        + Send
        + 'static,
        relisted: impl FnMut(
            Result<watcher::Event<kube::api::DynamicObject>, watcher::Error>,
        )
            -> Result<watcher::Event<kube::api::DynamicObject>, watcher::Error>
        + Send
        + 'static,
    ) -> (
        impl futures::Stream<Item = Result<kube::api::DynamicObject, watcher::Error>> + Send + 'static,
        kube::runtime::reflector::Store<kube::api::DynamicObject>,
    ) {
        let filter = self
            .rule
            .rule
            .spec
            .references
            .get(i)
            .map(crate::render::cache_filter)
            .unwrap_or_default();
        let ns = filter
            .namespace
            .as_deref()
            .or(self.config.namespace.as_deref());
        let api: Api<Wire<false>> = match (ns, namespaced) {
            (Some(ns), true) => Api::namespaced_with(self.client.clone(), ns, ar),
            _ => Api::all_with(self.client.clone(), ar),
        };
        let mut wc = watcher::Config::default()
            .any_semantic()
            .page_size(LIST_PAGE_SIZE);
        if let Some(l) = &filter.labels {
            wc = wc.labels(l);
        }
        if let Some(f) = &filter.fields {
            wc = wc.fields(f);
        }
        let writer = reflector::store::Writer::new(ar.clone());
        let store = writer.as_reader();
        let admit = admission(
            self.budget.clone(),
            cache_id,
            self.rule.name.clone(),
            ar.clone(),
            super::recorder(&self.client, &self.config, &self.outbox),
        );
        let stream = watcher(api, wc)
            .default_backoff()
            .map(packed)
            .modify(crate::cache::strip_parent)
            .map(admit)
            .map(synced)
            .map({
                let store = store.clone();
                let ar = ar.clone();
                move |event| {
                    if let Ok(e) = &event {
                        // The previous version, as the cache holds it until `reflect`.
                        let previous = match e {
                            watcher::Event::Apply(o)
                            | watcher::Event::InitApply(o)
                            | watcher::Event::Delete(o) => store.get(
                                &kube::runtime::reflector::ObjectRef::from_obj_with(o, ar.clone()),
                            ),
                            _ => None,
                        };
                        index.before_update(e, previous.as_deref());
                    }
                    event
                }
            })
            .reflect(writer)
            .map(relisted)
            .touched_objects();
        (stream, store)
    }
}
