//! The engine: one kube-runtime controller per rule, started, stopped and restarted as
//! the rule set changes. A rule whose kinds cannot be resolved (CRD not installed yet)
//! or that fails in any other way waits and retries on its own; the other rules run on.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::core::discovery::Scope as KubeScope;
use kube::discovery::pinned_kind;
use kube::runtime::controller::{Config as ControllerConfig, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{Instrument, info, info_span, warn};

use crate::meta::labels;
use crate::metrics::{self, Metrics};
use crate::reconcile::admission::{Admitted, CacheBudget, CacheLimits};
use crate::reconcile::wire::Wire;
use crate::reconcile::writer::{Deleted, WriteError, Writer};
use crate::reconcile::{self, ChildKind, ContextParts, ParentKind, RuleContext, WriteGate};
use crate::render::CompiledRule;
use crate::rules::{RuleSet, split_api_version};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Concurrent reconciles per rule (the same parent is never reconciled twice at once).
    pub concurrency: u16,
    /// Watch parents (and children) in this namespace only.
    pub namespace: Option<String>,
    /// Label selector on parents.
    pub parent_selector: Option<String>,
    /// The reporting controller name on events.
    pub reporter: String,
    /// This instance (pod name), on events.
    pub instance: Option<String>,
    /// Check the rule's permissions with SelfSubjectAccessReviews before starting it.
    pub check_permissions: bool,
    /// Bounds on cached child content.
    pub cache: CacheLimits,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            concurrency: 4,
            namespace: None,
            parent_selector: None,
            reporter: "rulebook".into(),
            instance: None,
            check_permissions: true,
            cache: CacheLimits::default(),
        }
    }
}

/// What each rule is doing, for `/status` and readiness.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RuleStatus {
    pub version: String,
    pub file: String,
    /// `starting`, `running` or `waiting`.
    pub state: String,
    /// Why the rule waits, or the last watch error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The rule's caches have listed everything once.
    pub synced: bool,
    /// A problem outside the controller, e.g. its CRD could not be installed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

#[derive(Default)]
pub struct EngineStatus {
    rules: RwLock<BTreeMap<String, RuleStatus>>,
    problems: RwLock<BTreeMap<String, String>>,
}

impl EngineStatus {
    pub fn snapshot(&self) -> BTreeMap<String, RuleStatus> {
        let mut rules = self.rules.read().map(|r| r.clone()).unwrap_or_default();
        if let Ok(problems) = self.problems.read() {
            for (rule, p) in problems.iter() {
                if let Some(s) = rules.get_mut(rule) {
                    s.problem = Some(p.clone());
                }
            }
        }
        rules
    }
    /// Records (or, with `None`, clears) a problem of `rule` found outside its controller.
    pub fn set_problem(&self, rule: &str, problem: Option<String>) {
        if let Ok(mut p) = self.problems.write() {
            match problem {
                Some(msg) => p.insert(rule.to_string(), msg),
                None => p.remove(rule),
            };
        }
    }
    fn update(&self, rule: &str, f: impl FnOnce(&mut RuleStatus)) {
        if let Ok(mut rules) = self.rules.write()
            && let Some(s) = rules.get_mut(rule)
        {
            f(s)
        }
    }
    fn insert(&self, rule: &str, status: RuleStatus) {
        if let Ok(mut rules) = self.rules.write() {
            rules.insert(rule.to_string(), status);
        }
    }
    fn remove(&self, rule: &str) {
        if let Ok(mut rules) = self.rules.write() {
            rules.remove(rule);
        }
    }
    /// Every running rule has synced its caches (a waiting rule does not hold readiness back:
    /// it is reported on `/status`, and the others serve).
    pub fn all_synced(&self) -> bool {
        self.rules
            .read()
            .map(|r| r.values().all(|s| s.synced || s.state == "waiting"))
            .unwrap_or(false)
    }
}

struct RunningRule {
    version: String,
    rule: Arc<CompiledRule>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

pub struct Engine {
    client: Client,
    config: EngineConfig,
    metrics: Arc<Metrics>,
    gate: Arc<dyn WriteGate>,
    pub status: Arc<EngineStatus>,
    running: BTreeMap<String, RunningRule>,
    budget: Arc<CacheBudget>,
}

/// How long a stopping rule may take to finish its in-flight reconciles.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

impl Engine {
    pub fn new(
        client: Client,
        config: EngineConfig,
        metrics: Arc<Metrics>,
        gate: Arc<dyn WriteGate>,
    ) -> Engine {
        let budget = Arc::new(CacheBudget::new(config.cache.clone(), metrics.clone()));
        Engine {
            client,
            config,
            metrics,
            gate,
            status: Arc::default(),
            running: BTreeMap::new(),
            budget,
        }
    }

    /// Makes the running controllers match `set`: stops removed rules (their children
    /// stay), restarts changed ones, starts new ones; unchanged rules are not touched.
    pub async fn apply(&mut self, set: &RuleSet) {
        let stale: Vec<String> = self
            .running
            .iter()
            .filter(|(name, r)| {
                set.rules
                    .get(*name)
                    .is_none_or(|new| new.version != r.version)
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in stale {
            let old = self.running.get(&name).map(|r| r.rule.clone());
            self.stop(&name).await;
            match (old, set.rules.get(&name)) {
                (Some(old), Some(new)) => {
                    let dropped = dropped_kinds(&old, new);
                    if !dropped.is_empty() {
                        tokio::spawn(prune_dropped_kinds(
                            self.client.clone(),
                            old,
                            dropped,
                            self.config.namespace.clone(),
                            self.metrics.clone(),
                            self.gate.clone(),
                        ));
                    }
                }
                _ => info!(rule = %name, "rule removed: controller stopped, its children stay"),
            }
        }
        for (name, rule) in &set.rules {
            if !self.running.contains_key(name) {
                self.start(rule.clone());
            }
        }
    }

    fn start(&mut self, rule: Arc<CompiledRule>) {
        let name = rule.name.clone();
        info!(rule = %name, version = %rule.version, "starting rule");
        self.status.insert(
            &name,
            RuleStatus {
                version: rule.version.clone(),
                file: rule.file.clone(),
                state: "starting".into(),
                message: None,
                synced: false,
                problem: None,
            },
        );
        let (stop, stopped) = watch::channel(false);
        let version = rule.version.clone();
        let runner_rule = rule.clone();
        let runner = RuleRunner {
            rule,
            client: self.client.clone(),
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            gate: self.gate.clone(),
            status: self.status.clone(),
            budget: self.budget.clone(),
        };
        let span = info_span!("rule", rule = %name);
        let task = tokio::spawn(runner.run(stopped).instrument(span));
        self.running.insert(
            name,
            RunningRule {
                version,
                rule: runner_rule,
                stop,
                task,
            },
        );
    }

    async fn stop(&mut self, name: &str) {
        let Some(r) = self.running.remove(name) else {
            return;
        };
        let _ = r.stop.send(true);
        let abort = r.task.abort_handle();
        if tokio::time::timeout(STOP_TIMEOUT, r.task).await.is_err() {
            warn!(rule = %name, "rule did not stop in time; aborting it");
            abort.abort();
        }
        self.status.remove(name);
        self.metrics
            .rule_running
            .get_or_create(&metrics::rule(name))
            .set(0);
    }

    /// Stops every rule, letting in-flight reconciles finish.
    pub async fn shutdown(&mut self) {
        let names: Vec<String> = self.running.keys().cloned().collect();
        for r in self.running.values() {
            let _ = r.stop.send(true);
        }
        for name in names {
            self.stop(&name).await;
        }
    }
}

/// `(apiVersion, kind)` of children the old version of a rule had and the new one has not,
/// compared by API group and kind: a child that moves to another version of its kind
/// (`autoscaling/v2` → `autoscaling/v1`, a CRD's `v1alpha1` → `v1`) is the same object
/// served at another version, and the new controller watches and keeps it.
fn dropped_kinds(old: &CompiledRule, new: &CompiledRule) -> Vec<(String, String)> {
    let group_kind = |api_version: &str, kind: &str| {
        (
            split_api_version(api_version).0.to_string(),
            kind.to_string(),
        )
    };
    let kept: std::collections::BTreeSet<(String, String)> = new
        .children()
        .iter()
        .map(|c| group_kind(&c.api_version.value, &c.kind.value))
        .collect();
    let mut dropped: Vec<(String, String)> = old
        .children()
        .iter()
        .filter(|c| !kept.contains(&group_kind(&c.api_version.value, &c.kind.value)))
        .map(|c| (c.api_version.value.clone(), c.kind.value.clone()))
        .collect();
    dropped.sort();
    dropped.dedup();
    dropped
}

/// Whether `o` is a child that a parent of `rule` created: its owner label is the UID of
/// its controller reference, and that controller is of the rule's parent kind. Labels
/// alone are public: anyone may put them on objects of their own.
fn child_of_rule(o: &DynamicObject, rule: &CompiledRule) -> bool {
    let parent = &rule.rule.spec.parent;
    let parent_group = split_api_version(&parent.api_version.value).0;
    let owner = o.labels().get(labels::OWNER);
    o.owner_references().iter().any(|r| {
        r.controller == Some(true)
            && owner == Some(&r.uid)
            && r.kind == parent.kind.value
            && split_api_version(&r.api_version).0 == parent_group
    })
}

/// Deletes the children of kinds a rule no longer has: the new controller does not watch
/// them, so its pruning cannot see them. Only objects [`child_of_rule`] accepts, each
/// with a UID precondition, and only while this process may write.
async fn prune_dropped_kinds(
    client: Client,
    rule: Arc<CompiledRule>,
    kinds: Vec<(String, String)>,
    namespace: Option<String>,
    metrics: Arc<Metrics>,
    gate: Arc<dyn WriteGate>,
) {
    use kube::api::ListParams;
    let name = &rule.name;
    let writer = Writer::new(gate, metrics.clone(), name);
    let selector = labels::child_selector(name);
    for (api_version, kind) in kinds {
        let (ar, caps) = match discover(&client, "dropped child kind", &api_version, &kind).await {
            Ok(found) => found,
            Err(e) => {
                warn!(rule = %name, %kind, error = %e, "cannot prune children of a kind the rule dropped");
                continue;
            }
        };
        let namespaced = caps.scope == KubeScope::Namespaced;
        let api = kind_api(&client, &ar, namespaced, namespace.as_deref());
        let list = match api.list(&ListParams::default().labels(&selector)).await {
            Ok(l) => l,
            Err(e) => {
                warn!(rule = %name, %kind, error = %e, "cannot list children of a kind the rule dropped");
                continue;
            }
        };
        for o in list.items.iter().filter(|o| child_of_rule(o, &rule)) {
            let child = o.name_any();
            let api = kind_api(&client, &ar, namespaced, o.namespace().as_deref());
            match writer.delete(&api, &child, o.uid()).await {
                Ok(Deleted::Deleted) => {
                    metrics
                        .children_pruned
                        .get_or_create(&metrics::rule(name))
                        .inc();
                    info!(rule = %name, %kind, %child, "pruned: the rule no longer has this kind of child");
                }
                Ok(Deleted::Gone) => {}
                Err(WriteError::NotLeader) => {
                    warn!(rule = %name, %kind, "not pruning children of a dropped kind: not the leader");
                    return;
                }
                Err(e) => warn!(rule = %name, %kind, %child, error = %e, "cannot prune"),
            }
        }
    }
}

/// The API of a kind: in `namespace` when the kind is namespaced and one is given.
pub fn kind_api(
    client: &Client,
    ar: &ApiResource,
    namespaced: bool,
    namespace: Option<&str>,
) -> Api<DynamicObject> {
    match (namespace, namespaced) {
        (Some(ns), true) => Api::namespaced_with(client.clone(), ns, ar),
        _ => Api::all_with(client.clone(), ar),
    }
}

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

struct RuleRunner {
    rule: Arc<CompiledRule>,
    client: Client,
    config: EngineConfig,
    metrics: Arc<Metrics>,
    gate: Arc<dyn WriteGate>,
    status: Arc<EngineStatus>,
    budget: Arc<CacheBudget>,
}

struct Resolved {
    parent: ApiResource,
    parent_namespaced: bool,
    status_subresource: bool,
    /// Distinct child kinds, and for each child its index among them.
    kinds: Vec<(ApiResource, bool)>,
    kind_of_child: Vec<usize>,
}

impl RuleRunner {
    async fn run(self, mut stopped: watch::Receiver<bool>) {
        let name = self.rule.name.clone();
        let mut attempt: u32 = 0;
        loop {
            if *stopped.borrow() {
                break;
            }
            match self.resolve().await {
                Ok(resolved) => {
                    attempt = 0;
                    self.metrics
                        .rule_running
                        .get_or_create(&metrics::rule(&name))
                        .set(1);
                    self.status.update(&name, |s| {
                        s.state = "running".into();
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
                        s.state = "waiting".into();
                        s.message = Some(e.to_string());
                        s.synced = false;
                    });
                }
            }
            attempt = attempt.saturating_add(1);
            let delay = Duration::from_secs(1u64 << attempt.min(6)).min(Duration::from_secs(60));
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = stopped.changed() => {}
            }
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
        if self.config.check_permissions {
            crate::rbac::check_rule_permissions(
                &self.client,
                &self.rule,
                &parent,
                &kinds.iter().map(|(ar, _)| ar.clone()).collect::<Vec<_>>(),
                self.config.namespace.as_deref(),
            )
            .await
            .map_err(SetupError::Forbidden)?;
        }
        Ok(Resolved {
            parent,
            parent_namespaced,
            status_subresource,
            kinds,
            kind_of_child,
        })
    }

    async fn run_controller(&self, r: Resolved, stopped: watch::Receiver<bool>) {
        let name = self.rule.name.clone();
        let ns = self.config.namespace.as_deref();
        let parent_api: Api<Wire<false>> = match (ns, r.parent_namespaced) {
            (Some(ns), true) => Api::namespaced_with(self.client.clone(), ns, &r.parent),
            _ => Api::all_with(self.client.clone(), &r.parent),
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
        let status_writes = Arc::new(crate::reconcile::StatusWrites::default());
        let parent_writer = reflector::store::Writer::new(r.parent.clone());
        let parent_reader = parent_writer.as_reader();
        // Status-only changes (Rulebook's own status writes among them) do not reconcile.
        let synced = CacheSync::new(1 + r.kinds.len(), self.status.clone(), name.clone());
        let parent_stream = watcher(parent_api, parent_wc)
            .default_backoff()
            .map(packed)
            .modify(crate::reconcile::cache::strip_parent)
            .map(synced.observer(0))
            .reflect(parent_writer)
            .map({
                let status_writes = status_writes.clone();
                move |event| {
                    if let Ok(e) = &event {
                        status_writes.observe(e);
                    }
                    event
                }
            })
            .map(relisted(relisted_tx.clone()))
            .applied_objects()
            .predicate_filter(parent_changed, Default::default());
        let mut controller =
            Controller::for_stream_with(parent_stream, parent_reader.clone(), r.parent.clone())
                .with_config(ControllerConfig::default().concurrency(self.config.concurrency));
        let child_selector = labels::child_selector(&name);
        let recorder = Recorder::new(
            self.client.clone(),
            Reporter {
                controller: self.config.reporter.clone(),
                instance: self.config.instance.clone(),
            },
        );
        let mut kinds = Vec::new();
        let mut cache_ids = Vec::new();
        for (i, (ar, namespaced)) in r.kinds.iter().enumerate() {
            let api: Api<Wire<true>> = match (ns, namespaced) {
                (Some(ns), true) => Api::namespaced_with(self.client.clone(), ns, ar),
                _ => Api::all_with(self.client.clone(), ar),
            };
            let writer = reflector::store::Writer::new(ar.clone());
            let reader = writer.as_reader();
            let index = Arc::new(crate::reconcile::index::OwnerIndex::default());
            let indexer = index.clone();
            let cache_id = self.budget.cache_id();
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
            .modify(crate::reconcile::cache::strip_child)
            .map(admit)
            .map(synced.observer(i + 1))
            .map(move |event| {
                if let Ok(e) = &event {
                    indexer.observe(e);
                }
                event
            })
            .reflect(writer)
            .map(relisted(relisted_tx.clone()))
            .touched_objects();
            controller = controller.owns_stream_with(stream, ar.clone());
            kinds.push(ChildKind {
                ar: ar.clone(),
                namespaced: *namespaced,
                store: reader,
                index,
            });
        }
        drop(relisted_tx);
        controller = controller.reconcile_all_on(relisted_rx);
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
            writer: Writer::new(self.gate.clone(), self.metrics.clone(), &name),
            status_writes,
            parent_store: parent_reader.clone(),
        }));
        let mut stop_signal = stopped.clone();
        let shutdown = async move {
            let _ = stop_signal.wait_for(|s| *s).await;
        };
        let status = self.status.clone();
        controller
            .graceful_shutdown_on(shutdown)
            .run(reconcile::reconcile, reconcile::error_policy, ctx)
            .for_each(|res| {
                if let Err(kube::runtime::controller::Error::QueueError(e)) = &res {
                    // A watch failed (API server down, kind deleted): report it; the watcher retries.
                    warn!(rule = %name, error = %e, "watch error");
                    status.update(&name, |s| s.message = Some(format!("watch error: {e}")));
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
            })
            .await;
        for id in cache_ids {
            self.budget.drop_cache(id);
        }
    }
}

/// Objects per page of an initial listing: a page is read whole before it is decoded,
/// so this bounds what one listing holds at once (children may be up to ~1.5 MiB each).
const LIST_PAGE_SIZE: u32 = 25;

/// Watch events of tolerantly decoded objects ([`Wire`]) in their cached form.
fn packed<const CHILD: bool>(
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
fn admission(
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
fn relisted(
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
struct CacheSync {
    listed: Arc<Vec<std::sync::atomic::AtomicBool>>,
    status: Arc<EngineStatus>,
    rule: String,
}

impl CacheSync {
    fn new(caches: usize, status: Arc<EngineStatus>, rule: String) -> CacheSync {
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
    fn observer(
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

async fn discover(
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

/// What makes a parent worth reconciling: its spec (generation; for kinds without one,
/// any change), labels, annotations, finalizers, deletion. Status-only updates, such as
/// Rulebook's own status writes, do not count.
fn parent_changed(o: &DynamicObject) -> Option<u64> {
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
