//! One rule's controller: resolve its parent and child kinds (discovery, scopes, the
//! status subresource, permissions), then run a kube-runtime controller over a parent
//! cache and one cache per child kind, each fed by tolerant, budgeted watch streams.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::Client;
use kube::api::{Api, ApiResource, GroupVersionKind};
use kube::core::discovery::Scope as KubeScope;
use kube::discovery::pinned_kind;
use kube::runtime::controller::{Config as ControllerConfig, Controller};
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tracing::warn;

use super::EngineConfig;
use super::health::{EngineStatus, RuleState};
use super::streams::{
    CacheSync, ChangedFilter, LIST_PAGE_SIZE, admission, owners_of, packed, parent_seen, relisted,
    unawaited,
};
use super::turns::{NoBackoff, Turns};
use crate::cache::admission::{CacheBudget, CacheKind};
use crate::cache::wire::Wire;
use crate::meta::{labels, split_api_version};
use crate::metrics::{self, Metrics};
use crate::reconcile::refs::{RefIndex, RefKind};
use crate::reconcile::{
    self, ChildKind, ContextParts, MemoryParts, ParentKind, ParentMemory, RuleContext, WriteGate,
};
use crate::render::CompiledRule;
use crate::write::writer::Writer;

/// Why a rule cannot run (yet).
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("{what} {gvk} is not served by the API server (is its CRD installed?)")]
    KindNotFound { what: String, gvk: String },
    #[error("discovery of {gvk} failed: {source}")]
    Discovery {
        gvk: String,
        #[source]
        source: kube::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("missing permissions: {0}")]
    Forbidden(String),
}

pub(super) struct RuleRunner {
    pub(super) rule: Arc<CompiledRule>,
    pub(super) client: Client,
    pub(super) config: EngineConfig,
    pub(super) metrics: Arc<Metrics>,
    pub(super) gate: Arc<dyn WriteGate>,
    pub(super) status: Arc<EngineStatus>,
    pub(super) budget: Arc<CacheBudget>,
    /// Reconcile inputs in flight, for every rule.
    pub(super) inputs: Arc<crate::reconcile::inflight::InputBudget>,
    /// What this rule version's reconciles found steady (kept across restarts).
    pub(super) steady: Arc<crate::reconcile::memory::Steady>,
    /// The process's event outbox (one for every rule).
    pub(super) outbox: crate::write::outbox::Outbox,
    /// Set while the engine lets go of children of kinds an earlier version had.
    pub(super) orphans_pending: Arc<crate::reconcile::memory::OrphansPending>,
}

struct Resolved {
    parent: ApiResource,
    parent_namespaced: bool,
    status_subresource: bool,
    /// Distinct child kinds, and for each child its index among them.
    kinds: Vec<(ApiResource, bool)>,
    kind_of_child: Vec<usize>,
    /// Each reference's kind, in rule order.
    refs: Vec<(ApiResource, bool)>,
}

impl RuleRunner {
    pub(super) async fn run(self, mut stopped: watch::Receiver<bool>) {
        let name = self.rule.name.clone();
        let mut attempt: u32 = 0;
        loop {
            if *stopped.borrow() {
                break;
            }
            match self.resolve().await {
                Ok(resolved) if !self.owned(&resolved) => {
                    // A rule with cluster-scoped parents runs whole on one replica.
                    self.status.update(&name, |s| {
                        s.state = RuleState::Elsewhere;
                        s.message =
                            Some("its parents are cluster-scoped; another replica runs it".into());
                    });
                    let _ = stopped.wait_for(|s| *s).await;
                    break;
                }
                Ok(resolved) => {
                    attempt = 0;
                    self.metrics
                        .rule_running
                        .get_or_create(&metrics::rule(&name))
                        .set(1);
                    self.status.update(&name, |s| {
                        s.state = RuleState::Running;
                        s.message = None;
                    });
                    self.run_controller(resolved, stopped.clone()).await;
                    self.metrics
                        .rule_running
                        .get_or_create(&metrics::rule(&name))
                        .set(0);
                    if *stopped.borrow() {
                        break;
                    }
                    warn!(rule = %name, "controller ended; restarting");
                }
                Err(e) => {
                    warn!(rule = %name, error = %e, "rule cannot run yet; retrying");
                    self.metrics
                        .rule_running
                        .get_or_create(&metrics::rule(&name))
                        .set(0);
                    self.status.update(&name, |s| {
                        s.state = RuleState::Waiting;
                        s.message = Some(e.to_string());
                        s.synced = false;
                    });
                }
            }
            attempt = attempt.saturating_add(1);
            let delay = crate::reconcile::BackoffPolicy {
                base: Duration::from_secs(2),
                max: Duration::from_secs(60),
            }
            .delay(attempt);
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = stopped.changed() => {}
            }
        }
    }

    /// Whether this replica runs the rule: always, unless sharded and its parents are
    /// cluster-scoped and its name hashes into another replica's ranges.
    fn owned(&self, r: &Resolved) -> bool {
        match &self.config.shard {
            Some(shard) if !r.parent_namespaced => {
                shard.ranges.contains(crate::shard::fnv1a(&self.rule.name))
            }
            _ => true,
        }
    }

    /// The client of the parent and child caches (the shard filter's, when sharded), and
    /// the filter of their events.
    fn watch_client(&self, r: &Resolved) -> (Client, Option<crate::shard::Ranges>) {
        match &self.config.shard {
            Some(shard) if r.parent_namespaced => {
                (shard.watch_client.clone(), Some(shard.ranges.clone()))
            }
            _ => (self.client.clone(), None),
        }
    }

    async fn resolve(&self) -> Result<Resolved, SetupError> {
        let spec = &self.rule.rule.spec;
        let (parent, parent_caps) = discover(
            &self.client,
            "parent",
            &spec.parent.api_version,
            &spec.parent.kind,
        )
        .await?;
        let parent_namespaced = parent_caps.scope == KubeScope::Namespaced;
        let status_subresource = parent_caps
            .subresources
            .iter()
            .any(|(ar, _)| ar.plural == "status");
        let mut kinds: Vec<(ApiResource, bool)> = Vec::new();
        let mut kind_of_child = Vec::new();
        for c in &spec.children {
            let (ar, caps) = discover(
                &self.client,
                &format!("child '{}'", c.name.value),
                &c.api_version,
                &c.kind,
            )
            .await?;
            let namespaced = caps.scope == KubeScope::Namespaced;
            if parent_namespaced && !namespaced {
                return Err(SetupError::Invalid(format!(
                    "child '{}': {} is cluster-scoped and {} is namespaced; a namespaced parent cannot own a cluster-scoped child",
                    c.name.value, c.kind.value, spec.parent.kind.value
                )));
            }
            let idx = match kinds
                .iter()
                .position(|(k, _)| k.api_version == ar.api_version && k.kind == ar.kind)
            {
                Some(i) => i,
                None => {
                    kinds.push((ar, namespaced));
                    kinds.len() - 1
                }
            };
            kind_of_child.push(idx);
        }
        let mut refs = Vec::new();
        for r in &spec.references {
            let (ar, caps) = discover(
                &self.client,
                &format!("reference '{}'", r.name.value),
                &r.api_version,
                &r.kind,
            )
            .await?;
            if parent_namespaced && matches!(r.literal_namespace(), Some(Err(_))) {
                return Err(SetupError::Invalid(format!(
                    "reference '{}': {} is namespaced, so the reference may name another namespace only literally",
                    r.name.value, spec.parent.kind.value
                )));
            }
            refs.push((ar, caps.scope == KubeScope::Namespaced));
        }
        if self.config.check_permissions {
            super::permissions::check_rule_permissions(
                &self.client,
                &self.rule,
                &parent,
                &kinds.iter().map(|(ar, _)| ar.clone()).collect::<Vec<_>>(),
                &refs
                    .iter()
                    .zip(&spec.references)
                    .map(|((ar, namespaced), r)| {
                        let f = crate::render::cache_filter(r);
                        super::permissions::RefAccess {
                            ar: ar.clone(),
                            namespaced: *namespaced,
                            namespace: f.namespace,
                            name: f
                                .fields
                                .map(|f| f.trim_start_matches("metadata.name=").to_string()),
                        }
                    })
                    .collect::<Vec<_>>(),
                self.config.namespace.as_deref(),
            )
            .await
            .map_err(|e| SetupError::Forbidden(e.to_string()))?;
        }
        Ok(Resolved {
            parent,
            parent_namespaced,
            status_subresource,
            kinds,
            kind_of_child,
            refs,
        })
    }

    async fn run_controller(&self, r: Resolved, stopped: watch::Receiver<bool>) {
        let name = self.rule.name.clone();
        let ns = self.config.namespace.as_deref();
        let (watch_client, shard) = self.watch_client(&r);
        let in_shard = || crate::shard::watch::keep(shard.clone());
        let parent_api: Api<Wire<false>> = match (ns, r.parent_namespaced) {
            (Some(ns), true) => Api::namespaced_with(watch_client.clone(), ns, &r.parent),
            _ => Api::all_with(watch_client.clone(), &r.parent),
        };
        let mut parent_wc = watcher::Config::default()
            .any_semantic()
            .page_size(LIST_PAGE_SIZE);
        if let Some(sel) = &self.config.parent_selector {
            parent_wc = parent_wc.labels(sel);
        }
        // Every time a cache (re)lists — at start, and after a watch expired (410) or the
        // API server restarted — every parent is reconciled. A child relist reports the
        // objects that exist, not those deleted in the gap, so no child event would wake
        // their parents; during a parent relist the parent cache keeps its old content
        // until the listing completes, so a parent created in the gap was not in the
        // cache when its own event came, and kube-runtime drops such a reconcile.
        let (relisted_tx, relisted_rx) = futures::channel::mpsc::unbounded::<()>();
        // What the rule remembers per parent, told by the watches below what arrives.
        let memory = Arc::new(ParentMemory::new(MemoryParts {
            steady: self.steady.clone(),
            orphans_pending: self.orphans_pending.clone(),
            records_version: self.rule.rule.spec.crd.is_some(),
        }));
        let parent_writer = reflector::store::Writer::new(r.parent.clone());
        let parent_reader = parent_writer.as_reader();
        // Status-only changes (Rulebook's own status writes among them) do not reconcile.
        let synced = CacheSync::new(
            1 + r.kinds.len() + r.refs.len(),
            self.status.clone(),
            name.clone(),
        );
        let ref_indexes: Vec<Arc<RefIndex>> = r.refs.iter().map(|_| Arc::default()).collect();
        // Set (before the store sees it) by the parents' first complete listing: until
        // then kube-runtime holds the reconciler back, and a graceful shutdown would wait
        // for a store that may never fill (see the end of this function).
        let parents_listed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let recorder = super::recorder(&self.client, &self.config, &self.outbox);
        // Parents count against the cache budget too: a tenant's parents of any size or
        // number are cached as stubs past it, and each reconcile reads its parent then.
        let parent_cache = self.budget.cache_id(CacheKind::Parents);
        let admit_parents = admission(
            self.budget.clone(),
            parent_cache,
            name.clone(),
            r.parent.clone(),
            recorder.clone(),
        );
        let parent_stream = watcher(parent_api, parent_wc)
            .default_backoff()
            .map(packed)
            .filter(in_shard())
            .modify(crate::cache::strip_parent)
            .map(admit_parents)
            .map(synced.observer(0))
            .map({
                let listed = parents_listed.clone();
                move |event| {
                    if matches!(event, Ok(watcher::Event::InitDone)) {
                        listed.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    event
                }
            })
            .reflect(parent_writer)
            .map(parent_seen(
                memory.clone(),
                ref_indexes.clone(),
                parent_reader.clone(),
                r.parent.clone(),
            ))
            .map(relisted(relisted_tx.clone()))
            .applied_objects()
            .filter({
                let mut changed = ChangedFilter::new();
                move |r| futures::future::ready(r.as_ref().map_or(true, |o| changed.changed(o)))
            });
        // Every trigger goes through the namespaces' turns, a failed parent's retry too
        // (`backoffs`); kube-runtime gets them as they come (`reconcile_on` below).
        let turns = Turns::new(
            self.config.concurrency,
            &self.metrics,
            &name,
            memory.backoffs(),
        );
        let mut controller = Controller::for_stream_with(
            turns.watched(parent_stream),
            parent_reader.clone(),
            r.parent.clone(),
        )
        .with_config(ControllerConfig::default().concurrency(self.config.concurrency))
        .trigger_backoff(NoBackoff);
        let child_selector = labels::child_selector(&name);
        let awaited = self
            .metrics
            .child_events_awaited
            .get_or_create(&metrics::rule(&name))
            .clone();
        let mut kinds = Vec::new();
        let mut cache_ids = vec![parent_cache];
        for (i, (ar, namespaced)) in r.kinds.iter().enumerate() {
            let api: Api<Wire<true>> = match (ns, namespaced) {
                (Some(ns), true) => Api::namespaced_with(watch_client.clone(), ns, ar),
                _ => Api::all_with(watch_client.clone(), ar),
            };
            let store = Arc::new(crate::cache::store::ChildStore::new(ar));
            // Whether any child of this kind is read past its metadata.
            let read = (r.kind_of_child.iter().enumerate())
                .any(|(c, &k)| k == i && self.rule.reads_child_content(c));
            let filler = store.clone();
            let cache_id = self.budget.cache_id(CacheKind::Children);
            cache_ids.push(cache_id);
            let admit = admission(
                self.budget.clone(),
                cache_id,
                name.clone(),
                ar.clone(),
                recorder.clone(),
            );
            let stream = watcher(
                api,
                watcher::Config::default()
                    .labels(&child_selector)
                    .any_semantic()
                    .page_size(LIST_PAGE_SIZE),
            )
            .default_backoff()
            .map(packed)
            .filter(in_shard())
            .modify(crate::cache::strip_child)
            .modify(move |o| {
                if !read {
                    crate::cache::without_content(o);
                }
            })
            .map(admit)
            .map(synced.observer(i + 1))
            .map(move |event| {
                if let Ok(e) = &event {
                    filler.observe(e);
                }
                event
            })
            .map(relisted(relisted_tx.clone()))
            .filter(unawaited(
                r.parent.clone(),
                (i, memory.clone()),
                awaited.clone(),
            ))
            .touched_objects();
            let owners = owners_of(r.parent.clone(), r.parent_namespaced);
            controller = controller.watches_stream_with(
                stream,
                turns.mapped(move |o| {
                    owners(o)
                        .into_iter()
                        .map(|p| (p.namespace, p.name))
                        .collect()
                }),
                ar.clone(),
            );
            kinds.push(ChildKind {
                ar: ar.clone(),
                namespaced: *namespaced,
                store,
                content_read: read,
            });
        }
        let mut refs = Vec::new();
        for (i, ((ar, namespaced), index)) in r.refs.iter().zip(&ref_indexes).enumerate() {
            let cache_id = self.budget.cache_id(CacheKind::References);
            cache_ids.push(cache_id);
            let (stream, store) = self.reference_stream(
                i,
                cache_id,
                (ar, *namespaced),
                index.clone(),
                synced.observer(1 + r.kinds.len() + i),
                relisted(relisted_tx.clone()),
            );
            let mapper_index = index.clone();
            controller = controller.watches_stream_with(
                stream,
                turns.mapped_unless_held(move |o: kube::api::DynamicObject| {
                    mapper_index.parents_for(&o)
                }),
                ar.clone(),
            );
            refs.push(RefKind {
                ar: ar.clone(),
                namespaced: *namespaced,
                store,
                index: index.clone(),
            });
        }
        drop(relisted_tx);
        // Every parent once more when a dropped kind is cleaned up (its record may shrink).
        let cleaned = self.orphans_pending.on_cleaned();
        controller = controller.reconcile_on(turns.all_on(
            futures::stream::select(relisted_rx, cleaned),
            parent_reader.clone(),
        ));
        if let Some(every) = self.rule.resync {
            controller = controller.reconcile_on(turns.each_of(super::resync::sweep(
                parent_reader.clone(),
                r.parent.clone(),
                every,
            )));
        }
        controller = controller.reconcile_on(turns.keyed(memory.backoffs().clone().retries()));
        controller = controller.reconcile_on(turns.handed_out(r.parent.clone()));
        let counting = super::health::count_cached(
            self.metrics.clone(),
            &name,
            parent_reader.clone(),
            kinds.iter().map(|k| k.store.clone()).collect(),
        );
        self.status.set_paused(&name, memory.paused().clone());
        let ctx = Arc::new(RuleContext::new(ContextParts {
            rule: self.rule.clone(),
            client: self.client.clone(),
            parent: ParentKind {
                ar: r.parent.clone(),
                namespaced: r.parent_namespaced,
                status_subresource: r.status_subresource,
            },
            kinds,
            kind_of_child: r.kind_of_child,
            recorder,
            metrics: self.metrics.clone(),
            writer: Writer::new(
                match &self.config.shard {
                    Some(s) => s.gate.for_rule(&name, !r.parent_namespaced),
                    None => self.gate.clone(),
                },
                self.metrics.clone(),
                &name,
            ),
            parent_store: parent_reader.clone(),
            refs,
            memory,
            inputs: self.inputs.clone(),
        }));
        let mut stop_signal = stopped.clone();
        let shutdown = async move {
            let _ = stop_signal.wait_for(|s| *s).await;
        };
        let status = self.status.clone();
        let driven = controller
            .graceful_shutdown_on(shutdown)
            .run(reconcile::reconcile, reconcile::error_policy, ctx)
            .for_each(move |res| {
                turns.finished(&res);
                if let Err(kube::runtime::controller::Error::QueueError(e)) = &res {
                    // A watch failed (API server down, kind deleted): report it; the watcher
                    // retries. Logged as summarised: a decode error's own text can quote a
                    // field of a tenant's object.
                    let summary = super::health::watch_error_summary(e);
                    warn!(rule = %name, error = %summary, "watch error");
                    status.update(&name, |s| {
                        s.message = Some(format!("watch error: {summary}"))
                    });
                } else if res.is_ok() {
                    status.update(&name, |s| {
                        if s.message
                            .as_deref()
                            .is_some_and(|m| m.starts_with("watch error"))
                        {
                            s.message = None;
                        }
                    });
                }
                futures::future::ready(())
            });
        // Stopped before the parents were ever listed: no reconcile has started, and
        // kube-runtime's graceful shutdown would wait for the store to be ready first.
        let mut stop = stopped.clone();
        let unlisted_stop = async move {
            let _ = stop.wait_for(|s| *s).await;
            if parents_listed.load(std::sync::atomic::Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            _ = driven => {}
            _ = unlisted_stop => {}
        }
        counting.abort();
        for id in cache_ids {
            self.budget.drop_cache(id);
        }
    }
}

/// A kind's API resource and whether it is namespaced, from discovery.
pub async fn resolve_kind(
    client: &Client,
    what: &str,
    api_version: &str,
    kind: &str,
) -> Result<(ApiResource, bool), SetupError> {
    let (ar, caps) = discover(client, what, api_version, kind).await?;
    Ok((ar, caps.scope == KubeScope::Namespaced))
}

pub(super) async fn discover(
    client: &Client,
    what: &str,
    api_version: &str,
    kind: &str,
) -> Result<(ApiResource, kube::core::discovery::ApiCapabilities), SetupError> {
    let (group, version) = split_api_version(api_version);
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let name = format!("{api_version} {kind}");
    match pinned_kind(client, &gvk).await {
        Ok(found) => Ok(found),
        Err(kube::Error::Api(s)) if s.code == 404 => Err(SetupError::KindNotFound {
            what: what.to_string(),
            gvk: name,
        }),
        Err(kube::Error::Discovery(_)) => Err(SetupError::KindNotFound {
            what: what.to_string(),
            gvk: name,
        }),
        Err(e) => Err(SetupError::Discovery {
            gvk: name,
            source: e,
        }),
    }
}
