//! One run of a rule's controller, once `runner.rs` has resolved its kinds: the parent
//! watch the controller is built on, one watch per child kind and per reference feeding
//! it (each into its own cache), the other triggers (relists, resyncs, retries, turns
//! handed out), the reconcile context, and the run itself until the engine stops it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::StreamExt;
use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender};
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::controller::{Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;
use tracing::warn;

use super::runner::{Resolved, RuleRunner};
use super::streams::{
    CacheSync, ChangedFilter, LIST_PAGE_SIZE, admission, owners_of, packed, parent_seen, relisted,
    unawaited,
};
use super::turns::{NoBackoff, Turns};
use crate::cache::admission::CacheKind;
use crate::cache::wire::Wire;
use crate::meta::labels;
use crate::metrics;
use crate::reconcile::refs::{RefIndex, RefKind};
use crate::reconcile::{
    self, ChildKind, ContextParts, MemoryParts, ParentKind, ParentMemory, RuleContext,
};
use crate::write::recorder::Recorder;
use crate::write::writer::Writer;

/// A rule's controller, over its parents' cache.
type RuleController = Controller<DynamicObject>;

impl RuleRunner {
    /// Runs the rule's controller over the kinds of `r` until `stopped` (or until it ends),
    /// then gives its caches' budget back.
    pub(super) async fn run_controller(
        &self,
        r: Resolved,
        setup: Option<super::rollout::Setup>,
        stopped: watch::Receiver<bool>,
    ) {
        let name = self.rule.name.clone();
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
            records_version: self.rule.rule.spec.crd.is_some() && self.rule.role.main,
        }));
        let parent_writer = reflector::store::Writer::new(r.parent.clone());
        let recorder = super::recorder(&self.client, &self.config, &self.outbox);
        let mut watches = Watches::new(
            self,
            &r,
            parent_writer.as_reader(),
            relisted_tx,
            memory.clone(),
            recorder.clone(),
        );
        // Every trigger goes through the namespaces' turns, a failed parent's retry too
        // (`backoffs`); kube-runtime gets them as they come (`reconcile_on` in `triggers`).
        let turns = Turns::new(
            self.config.concurrency,
            &self.metrics,
            &name,
            memory.backoffs(),
        );
        let controller = watches.parents(parent_writer, &turns);
        let controller = watches.children(controller, &turns);
        let controller = watches.references(controller, &turns);
        let controller = watches.namespaces(controller, &turns);
        let caches = watches.finish();
        let mut controller = self.triggers(
            controller,
            &turns,
            relisted_rx,
            &caches.parents,
            &r.parent,
            &memory,
        );
        // During a rollout: every parent once more whenever the state moves.
        let mut rollout_tasks = Vec::new();
        if let Some(setup) = &setup {
            let (tx, rx) = futures::channel::mpsc::unbounded::<()>();
            controller = controller.reconcile_on(turns.all_on(rx, caches.parents.clone()));
            rollout_tasks = self.rollout_tasks(&r, setup, tx);
            self.status.set_rollout(&name, Some(setup.state.clone()));
        }
        let counting = super::health::count_cached(
            self.metrics.clone(),
            &name,
            caches.parents.clone(),
            caches.kinds.iter().map(|k| k.store.clone()).collect(),
        );
        self.status.set_paused(&name, memory.paused().clone());
        let (parents_listed, cache_ids) = (caches.parents_listed.clone(), caches.ids.clone());
        let ctx = self.context(r, caches, recorder, memory, setup);
        self.drive(controller, ctx, turns, stopped, parents_listed)
            .await;
        for t in rollout_tasks {
            t.abort();
        }
        self.status.set_rollout(&name, None);
        counting.abort();
        for id in cache_ids {
            self.budget.drop_cache(id);
        }
    }

    /// The client of the parent and child caches (the shard filter's, when sharded), and
    /// the filter of their events.
    fn watch_client(&self, r: &Resolved) -> (Client, Option<crate::shard::Ranges>) {
        match &self.config.shard {
            Some(shard) if self.split(r) => (
                self.own_watch
                    .clone()
                    .unwrap_or_else(|| shard.watch_client.clone()),
                Some(shard.ranges.clone()),
            ),
            _ => (self.client.clone(), None),
        }
    }

    /// The controller with its triggers besides the watches: relists, a dropped kind's
    /// clean-up, the resync sweep, retries, and the turns handed out.
    fn triggers(
        &self,
        mut controller: RuleController,
        turns: &Arc<Turns>,
        relisted_rx: UnboundedReceiver<()>,
        parents: &Store<DynamicObject>,
        parent: &ApiResource,
        memory: &ParentMemory,
    ) -> RuleController {
        // Every parent once more when a dropped kind is cleaned up (its record may shrink).
        let cleaned = self.orphans_pending.on_cleaned();
        controller = controller.reconcile_on(turns.all_on(
            futures::stream::select(relisted_rx, cleaned),
            parents.clone(),
        ));
        if let Some(every) = self.rule.resync {
            controller = controller.reconcile_on(turns.each_of(super::resync::sweep(
                parents.clone(),
                parent.clone(),
                every,
            )));
        }
        controller = controller.reconcile_on(turns.keyed(memory.backoffs().clone().retries()));
        controller.reconcile_on(turns.handed_out(parent.clone()))
    }

    /// The tasks of a rollout: following its state (every replica), and moving it (the
    /// coordinator, while it is active).
    fn rollout_tasks(
        &self,
        r: &Resolved,
        setup: &super::rollout::Setup,
        changed: UnboundedSender<()>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let env = self.rollout_env();
        let mut tasks = vec![tokio::spawn(super::rollout::follow(
            env.clone(),
            self.rule.name.clone(),
            setup.state.clone(),
            changed,
        ))];
        if self.coordinates() && setup.state.read().active() {
            let gate = self.gate.clone();
            let coordinator = super::rollout::Coordinator {
                env,
                client: self.client.clone(),
                rule: self.rule.clone(),
                parent: r.parent.clone(),
                parent_namespaced: r.parent_namespaced,
                namespace: self.config.namespace.clone(),
                selector: self.config.parent_selector.clone(),
                may_write: Arc::new(move || gate.may_write()),
                metrics: self.metrics.clone(),
            };
            tasks.push(tokio::spawn(coordinator.run()));
        }
        tasks
    }

    /// What each reconcile of the rule works with; during a rollout, with the old
    /// version's context beside it (`reconcile::versions`).
    fn context(
        &self,
        r: Resolved,
        caches: Caches,
        recorder: Recorder,
        memory: Arc<ParentMemory>,
        setup: Option<super::rollout::Setup>,
    ) -> Arc<RuleContext> {
        let mut ctx = self.new_context(r, caches, recorder, memory);
        if let Some(setup) = setup {
            // The old version's children by the kinds the new one watches (a rollout
            // starts only when it has them all: `rollout::progressive`).
            let kind_of_child = setup
                .old
                .rule
                .spec
                .children
                .iter()
                .map(|c| {
                    ctx.kinds
                        .iter()
                        .position(|k| {
                            k.ar.api_version == c.api_version.value && k.ar.kind == c.kind.value
                        })
                        .unwrap_or(0)
                })
                .collect();
            let old = ctx.with_rule(setup.old.clone(), kind_of_child);
            reconcile::versions::side_by_side(&mut ctx, old, setup.state);
        }
        Arc::new(ctx)
    }

    fn new_context(
        &self,
        r: Resolved,
        caches: Caches,
        recorder: Recorder,
        memory: Arc<ParentMemory>,
    ) -> RuleContext {
        let name = &self.rule.name;
        let split = self.split(&r);
        let ctx = RuleContext::new(ContextParts {
            rule: self.rule.clone(),
            client: self.client.clone(),
            parent: ParentKind {
                ar: r.parent,
                namespaced: r.parent_namespaced,
                status_subresource: r.status_subresource,
            },
            kinds: caches.kinds,
            kind_of_child: r.kind_of_child,
            recorder,
            metrics: self.metrics.clone(),
            writer: Writer::new(
                match &self.config.shard {
                    Some(s) => s.gate.for_rule(name, !split),
                    None => self.gate.clone(),
                },
                self.metrics.clone(),
                name,
            ),
            parent_store: caches.parents,
            refs: caches.refs,
            memory,
            inputs: self.inputs.clone(),
            namespaces: caches.namespaces,
        });
        // The teardown metric has its series from the start: 0 until one runs.
        ctx.report_teardowns(ctx.memory.oldest_teardown());
        ctx
    }

    /// Runs the controller until `stopped`, reporting watch errors in the rule's status.
    async fn drive(
        &self,
        controller: RuleController,
        ctx: Arc<RuleContext>,
        turns: Arc<Turns>,
        stopped: watch::Receiver<bool>,
        parents_listed: Arc<AtomicBool>,
    ) {
        let name = self.rule.name.clone();
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
        let mut stop = stopped;
        let unlisted_stop = async move {
            let _ = stop.wait_for(|s| *s).await;
            if parents_listed.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            _ = driven => {}
            _ = unlisted_stop => {}
        }
    }
}

/// What a run's watches fill, for its reconciles to read.
struct Caches {
    /// The parent cache.
    parents: Store<DynamicObject>,
    /// Set (before the store sees it) by the parents' first complete listing: until
    /// then kube-runtime holds the reconciler back, and a graceful shutdown would wait
    /// for a store that may never fill (see [`RuleRunner::drive`]).
    parents_listed: Arc<AtomicBool>,
    /// One cache per distinct child kind.
    kinds: Vec<ChildKind>,
    /// One cache per reference, in rule order.
    refs: Vec<RefKind>,
    /// Every cache's entry in the cache budget, given back when the run ends.
    ids: Vec<u64>,
    /// The Namespaces (metadata), for a selector with a `namespaceSelector`.
    namespaces: Option<Store<DynamicObject>>,
}

/// The set-up of a run's watches: what they share while they are built.
struct Watches<'a> {
    runner: &'a RuleRunner,
    r: &'a Resolved,
    /// See [`RuleRunner::watch_client`].
    client: Client,
    shard: Option<crate::shard::Ranges>,
    relisted_tx: UnboundedSender<()>,
    memory: Arc<ParentMemory>,
    synced: CacheSync,
    ref_indexes: Vec<Arc<RefIndex>>,
    recorder: Recorder,
    caches: Caches,
}

impl<'a> Watches<'a> {
    fn new(
        runner: &'a RuleRunner,
        r: &'a Resolved,
        parents: Store<DynamicObject>,
        relisted_tx: UnboundedSender<()>,
        memory: Arc<ParentMemory>,
        recorder: Recorder,
    ) -> Self {
        let (client, shard) = runner.watch_client(r);
        let synced = CacheSync::new(
            1 + r.kinds.len() + r.refs.len(),
            runner.status.clone(),
            runner.rule.name.clone(),
        );
        Watches {
            runner,
            r,
            client,
            shard,
            relisted_tx,
            memory,
            synced,
            ref_indexes: r.refs.iter().map(|_| Arc::default()).collect(),
            recorder,
            caches: Caches {
                parents,
                parents_listed: Arc::new(AtomicBool::new(false)),
                kinds: Vec::new(),
                refs: Vec::new(),
                ids: Vec::new(),
                namespaces: None,
            },
        }
    }

    /// The caches, once every watch is set up. The relist signal's last sender goes with
    /// the set-up: only the watches hold one.
    fn finish(self) -> Caches {
        self.caches
    }

    /// The controller, over the parents' watch (into `writer`'s cache).
    fn parents(
        &mut self,
        writer: reflector::store::Writer<DynamicObject>,
        turns: &Arc<Turns>,
    ) -> RuleController {
        let (runner, r) = (self.runner, self.r);
        let api: Api<Wire<false>> = match (runner.config.namespace.as_deref(), r.parent_namespaced)
        {
            (Some(ns), true) => Api::namespaced_with(self.client.clone(), ns, &r.parent),
            _ => Api::all_with(self.client.clone(), &r.parent),
        };
        let mut wc = watcher::Config::default()
            .any_semantic()
            .page_size(LIST_PAGE_SIZE);
        if let Some(sel) = &runner.config.parent_selector {
            wc = wc.labels(sel);
        }
        // Parents count against the cache budget too: a tenant's parents of any size or
        // number are cached as stubs past it, and each reconcile reads its parent then.
        let cache_id = runner.budget.cache_id(CacheKind::Parents);
        self.caches.ids.push(cache_id);
        let admit = admission(
            runner.budget.clone(),
            cache_id,
            runner.rule.name.clone(),
            r.parent.clone(),
            self.recorder.clone(),
        );
        let stream = watcher(api, wc)
            .default_backoff()
            .map(packed)
            .filter(crate::shard::watch::keep(self.shard.clone()))
            .modify(crate::cache::strip_parent)
            .modify(with_type(&r.parent))
            .map(admit)
            .map(self.synced.observer(0))
            .map({
                let listed = self.caches.parents_listed.clone();
                move |event| {
                    if matches!(event, Ok(watcher::Event::InitDone)) {
                        listed.store(true, Ordering::SeqCst);
                    }
                    event
                }
            })
            .reflect(writer)
            .map(parent_seen(
                self.memory.clone(),
                self.ref_indexes.clone(),
                self.caches.parents.clone(),
                r.parent.clone(),
            ))
            .map(relisted(self.relisted_tx.clone()))
            .applied_objects()
            // Status-only changes (Rulebook's own status writes among them) do not reconcile.
            .filter({
                let mut changed = ChangedFilter::new();
                move |r| futures::future::ready(r.as_ref().map_or(true, |o| changed.changed(o)))
            });
        Controller::for_stream_with(
            turns.watched(stream),
            self.caches.parents.clone(),
            r.parent.clone(),
        )
        .with_config(ControllerConfig::default().concurrency(runner.config.concurrency))
        .trigger_backoff(NoBackoff)
    }

    /// The controller with a watch per child kind, each waking the parents that own
    /// what changed.
    fn children(&mut self, mut controller: RuleController, turns: &Arc<Turns>) -> RuleController {
        let name = &self.runner.rule.name;
        let child_selector = labels::child_selector(name);
        let awaited = self
            .runner
            .metrics
            .child_events_awaited
            .get_or_create(&metrics::rule(name))
            .clone();
        for i in 0..self.r.kinds.len() {
            controller = self.child_kind(controller, turns, i, (&child_selector, &awaited));
        }
        controller
    }

    /// The controller with the watch of child kind `i`, selected by `child_selector`;
    /// the events of writes a reconcile awaits are counted in `awaited` and left out.
    fn child_kind(
        &mut self,
        controller: RuleController,
        turns: &Arc<Turns>,
        i: usize,
        (child_selector, awaited): (&str, &Counter),
    ) -> RuleController {
        let (runner, r) = (self.runner, self.r);
        let (ar, namespaced) = &r.kinds[i];
        let api: Api<Wire<true>> = match (runner.config.namespace.as_deref(), namespaced) {
            (Some(ns), true) => Api::namespaced_with(self.client.clone(), ns, ar),
            _ => Api::all_with(self.client.clone(), ar),
        };
        let store = Arc::new(crate::cache::store::ChildStore::new(ar));
        // Whether any child of this kind is read past its metadata.
        let read = (r.kind_of_child.iter().enumerate())
            .any(|(c, &k)| k == i && runner.rule.reads_child_content(c));
        let filler = store.clone();
        let cache_id = runner.budget.cache_id(CacheKind::Children);
        self.caches.ids.push(cache_id);
        let admit = admission(
            runner.budget.clone(),
            cache_id,
            runner.rule.name.clone(),
            ar.clone(),
            self.recorder.clone(),
        );
        let stream = watcher(
            api,
            watcher::Config::default()
                .labels(child_selector)
                .any_semantic()
                .page_size(LIST_PAGE_SIZE),
        )
        .default_backoff()
        .map(packed)
        .filter(crate::shard::watch::keep(self.shard.clone()))
        .modify(crate::cache::strip_child)
        .modify(move |o| {
            if !read {
                crate::cache::without_content(o);
            }
        })
        .map(admit)
        .map(self.synced.observer(i + 1))
        .map(move |event| {
            if let Ok(e) = &event {
                filler.observe(e);
            }
            event
        })
        .map(relisted(self.relisted_tx.clone()))
        .filter(unawaited(
            r.parent.clone(),
            (i, self.memory.clone()),
            awaited.clone(),
        ))
        .touched_objects();
        let elsewhere = runner.rule.rule.spec.target_namespaces.is_some();
        let owners = owners_of(r.parent.clone(), r.parent_namespaced, elsewhere);
        let controller = controller.watches_stream_with(
            stream,
            turns.mapped(move |o| {
                owners(o)
                    .into_iter()
                    .map(|p| (p.namespace, p.name))
                    .collect()
            }),
            ar.clone(),
        );
        self.caches.kinds.push(ChildKind {
            ar: ar.clone(),
            namespaced: *namespaced,
            store,
            content_read: read,
        });
        controller
    }

    /// For a rule whose selector reads namespace labels (`namespaceSelector`): the
    /// controller with a watch of the Namespaces (their metadata only, cached), each
    /// change waking the rule's parents in that namespace — a namespace relabelled into
    /// or out of the selector takes its parents along.
    fn namespaces(&mut self, controller: RuleController, turns: &Arc<Turns>) -> RuleController {
        if !self.runner.rule.selects_by_namespace() || !self.r.parent_namespaced {
            return controller;
        }
        let ar = ApiResource::erase::<k8s_openapi::api::core::v1::Namespace>(&());
        let api: Api<DynamicObject> = Api::all_with(self.runner.client.clone(), &ar);
        let writer = reflector::store::Writer::new(ar.clone());
        self.caches.namespaces = Some(writer.as_reader());
        let stream = watcher(api, watcher::Config::default().page_size(LIST_PAGE_SIZE))
            .default_backoff()
            .modify(|o: &mut DynamicObject| {
                // Only the labels are read.
                o.data = serde_json::Value::Null;
                o.metadata.managed_fields = None;
                o.metadata.annotations = None;
            })
            .reflect(writer)
            .applied_objects();
        let parents = self.caches.parents.clone();
        controller.watches_stream_with(
            stream,
            turns.mapped(move |ns: DynamicObject| {
                let name = ns.name_any();
                parents
                    .state()
                    .iter()
                    .filter(|p| p.namespace().as_deref() == Some(name.as_str()))
                    .map(|p| (p.namespace(), p.name_any()))
                    .collect()
            }),
            ar,
        )
    }

    /// The controller with a watch per reference, each waking the parents whose
    /// reference matches what changed (unless they are held back).
    fn references(&mut self, mut controller: RuleController, turns: &Arc<Turns>) -> RuleController {
        let (runner, r) = (self.runner, self.r);
        for (i, ((ar, namespaced), index)) in r.refs.iter().zip(&self.ref_indexes).enumerate() {
            let cache_id = runner.budget.cache_id(CacheKind::References);
            self.caches.ids.push(cache_id);
            let (stream, store) = runner.reference_stream(
                i,
                cache_id,
                (ar, *namespaced),
                index.clone(),
                self.synced.observer(1 + r.kinds.len() + i),
                relisted(self.relisted_tx.clone()),
            );
            let mapper_index = index.clone();
            controller = controller.watches_stream_with(
                stream,
                turns.mapped_unless_held(move |o: kube::api::DynamicObject| {
                    mapper_index.parents_for(&o)
                }),
                ar.clone(),
            );
            self.caches.refs.push(RefKind {
                ar: ar.clone(),
                namespaced: *namespaced,
                store,
                index: index.clone(),
            });
        }
        controller
    }
}

/// Sets a parent's `apiVersion` and `kind` from the rule's parent kind where the object
/// lacks them: the API server leaves them out of a list's items for built-in kinds (a
/// Namespace listed at start), and the children's ownerReferences, the templates'
/// `parent.kind` and the events are made from them.
fn with_type(parent: &ApiResource) -> impl FnMut(&mut DynamicObject) + use<> {
    let types = kube::core::TypeMeta {
        api_version: parent.api_version.clone(),
        kind: parent.kind.clone(),
    };
    move |o: &mut DynamicObject| {
        if o.types
            .as_ref()
            .is_none_or(|t| t.kind.is_empty() || t.api_version.is_empty())
        {
            o.types = Some(types.clone());
        }
    }
}
