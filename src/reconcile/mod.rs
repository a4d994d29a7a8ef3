//! One reconcile of one parent — the only place that writes to the API server.
//!
//! A pipeline: read the parent and its live children from the caches → render the
//! desired children → apply those that differ (server-side apply, in rule order) →
//! prune what this parent owns but no longer renders → write status when it changed →
//! record events. At steady state every step finds nothing to do and makes no request.

pub mod admission;
pub mod cache;
pub mod drift;
pub mod gate;
pub mod index;
mod observe;
mod offload;
pub mod wire;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};
use serde_json::{Value as Json, json};
use tracing::{debug, info, warn};

use crate::metrics::{self, Metrics, ResultLabels};
use crate::render::status::{self, ConditionState};
use crate::render::{CompiledRule, DesiredChild, Observed, RenderError, Scope, labels};
use drift::{Drift, drift, fields_cover};
use observe::{Confined, confine_to_rendered_namespaces, read_stubs, unreadable_parent};
use offload::{render_off_runtime, status_off_runtime};

/// The field manager of every apply, and the `managedFields` entry the drift check reads.
pub const FIELD_MANAGER: &str = "rulebook";

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("{0}")]
    Render(#[from] RenderError),
    #[error("applying {what}: {source}")]
    Apply {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("pruning {what}: {source}")]
    Prune {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing status: {0}")]
    Status(#[source] kube::Error),
    #[error("reading {what}: {source}")]
    Read {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{0}")]
    Conflict(String),
    /// Someone else keeps changing a child's fields; the next repair waits `retry_in`.
    #[error("{message}")]
    Fight { message: String, retry_in: Duration },
    #[error("{0}")]
    Invalid(String),
    #[error("writes are paused (not the leader)")]
    NotLeader,
}

impl ReconcileError {
    fn result_label(&self) -> &'static str {
        match self {
            ReconcileError::Render(_) => "render_failed",
            ReconcileError::Conflict(_) | ReconcileError::Fight { .. } => "conflict",
            ReconcileError::Apply { .. } => "apply_failed",
            ReconcileError::NotLeader => "not_leader",
            _ => "error",
        }
    }
}

/// A kind a rule's children have, with the cache of the rule's children of that kind.
pub struct ChildKind {
    pub ar: ApiResource,
    pub namespaced: bool,
    pub store: Store<DynamicObject>,
    /// The cached children by owner UID.
    pub index: Arc<index::OwnerIndex>,
}

impl ChildKind {
    fn api(&self, client: &Client, namespace: Option<&str>) -> Api<DynamicObject> {
        match (self.namespaced, namespace) {
            (true, Some(ns)) => Api::namespaced_with(client.clone(), ns, &self.ar),
            _ => Api::all_with(client.clone(), &self.ar),
        }
    }
}

pub use gate::WriteGate;

/// Everything one rule's reconciles share.
pub struct RuleContext {
    pub rule: Arc<CompiledRule>,
    pub client: Client,
    pub parent_ar: ApiResource,
    pub parent_namespaced: bool,
    pub status_subresource: bool,
    pub kinds: Vec<ChildKind>,
    /// Child index in the rule → index in `kinds`.
    pub kind_of_child: Vec<usize>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub gate: Arc<dyn WriteGate>,
    pub backoff: BackoffPolicy,
    failures: Mutex<HashMap<String, u32>>,
    hash_only: Mutex<HashSet<String>>,
    last_warning: Mutex<HashMap<String, String>>,
    fights: Mutex<HashMap<String, Fight>>,
    /// Rulebook's status writes the parent cache has not caught up with yet.
    pub status_writes: Arc<StatusWrites>,
    /// The parent cache, to reconcile the newest cached version of a parent.
    pub parent_store: Option<Store<DynamicObject>>,
}

/// The status last written per parent UID, with the parent's resourceVersion after the
/// write. A reconcile works on the parent as cached when it started, which may predate
/// Rulebook's last status write even after the cache has caught up, so an entry is kept
/// for [`STATUS_WRITE_KEEP`] after the parent watch has delivered the write
/// ([`StatusWrites::observe`]); the status itself is held as compact JSON text.
#[derive(Default)]
pub struct StatusWrites {
    written: Mutex<HashMap<String, StatusWrite>>,
    /// UIDs of parents deleted since the last reconcile: their per-parent memory goes.
    gone: Mutex<Vec<String>>,
}

struct StatusWrite {
    rv: u64,
    status: String,
    at: Instant,
    /// The parent watch has delivered this write (or a later version).
    seen: bool,
}

/// How long a status write is remembered after the cache has it.
const STATUS_WRITE_KEEP: Duration = Duration::from_secs(30);
/// How long one is remembered at most (its watch event may never come: parent deleted).
const STATUS_WRITE_MAX: Duration = Duration::from_secs(600);

impl StatusWrites {
    /// Notes writes the cache now holds; forgets those of deleted parents.
    pub fn observe(&self, event: &kube::runtime::watcher::Event<DynamicObject>) {
        use kube::runtime::watcher::Event;
        let (o, deleted) = match event {
            // Not `InitApply`: the cache holds a relisted object only from `InitDone` on.
            Event::Apply(o) => (o, false),
            Event::Delete(o) => (o, true),
            _ => return,
        };
        let Some(uid) = o.uid() else { return };
        let mut written = lock(&self.written);
        if deleted {
            written.remove(&uid);
            lock(&self.gone).push(uid);
        } else if let Some(w) = written.get_mut(&uid)
            && resource_version(o).is_none_or(|seen| seen >= w.rv)
        {
            w.seen = true;
        }
    }

    fn record(&self, uid: String, rv: u64, status: &Json) {
        let mut written = lock(&self.written);
        written.insert(
            uid,
            StatusWrite {
                rv,
                status: status.to_string(),
                at: Instant::now(),
                seen: false,
            },
        );
        // Amortised clean-up: a sweep whenever the map has grown by half since the last.
        if written.len().is_power_of_two() && written.len() >= 64 {
            written.retain(|_, w| {
                let age = w.at.elapsed();
                age < STATUS_WRITE_MAX && !(w.seen && age > STATUS_WRITE_KEEP)
            });
        }
    }

    /// The status of the last write of this parent if the cached parent predates it.
    /// resourceVersions are compared as numbers (etcd revisions); a parent whose
    /// resourceVersion is not a number is taken as it is cached.
    fn newer_than(&self, uid: &str, cached: &DynamicObject) -> Option<Json> {
        let written = lock(&self.written);
        let w = written.get(uid)?;
        match resource_version(cached) {
            Some(seen) if seen < w.rv => serde_json::from_str(&w.status).ok(),
            _ => None,
        }
    }

    pub fn len(&self) -> usize {
        lock(&self.written).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn resource_version(o: &DynamicObject) -> Option<u64> {
    o.resource_version().and_then(|v| v.parse::<u64>().ok())
}

/// Per-object exponential backoff after failures.
#[derive(Clone, Debug)]
pub struct BackoffPolicy {
    pub base: Duration,
    pub max: Duration,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        BackoffPolicy {
            base: Duration::from_secs(1),
            max: Duration::from_secs(300),
        }
    }
}

impl BackoffPolicy {
    pub fn delay(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(20);
        let d = self.base.saturating_mul(1u32 << exp);
        d.min(self.max)
    }
}

/// Re-applies of one child because someone else changed its fields.
struct Fight {
    window_start: Instant,
    reapplies: u32,
    /// Repairs wait until then; `backoff` is how long that block is.
    blocked_until: Option<Instant>,
    backoff: Duration,
    strikes: u32,
    /// The last repair; a fight with no repair for [`FIGHT_FORGET`] is forgotten.
    last_repair: Instant,
}

/// Children checked by hash only, remembered at most (then forgotten and found again).
const HASH_ONLY_MAX: usize = 10_000;

/// More drift repairs than this within [`FIGHT_WINDOW`] is a fight: back off.
const FIGHT_LIMIT: u32 = 3;
const FIGHT_WINDOW: Duration = Duration::from_secs(60);
/// A fight with no repair for this long is over: a later one starts from scratch.
const FIGHT_FORGET: Duration = Duration::from_secs(600);

impl RuleContext {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rule: Arc<CompiledRule>,
        client: Client,
        parent_ar: ApiResource,
        parent_namespaced: bool,
        status_subresource: bool,
        kinds: Vec<ChildKind>,
        kind_of_child: Vec<usize>,
        recorder: Recorder,
        metrics: Arc<Metrics>,
        gate: Arc<dyn WriteGate>,
    ) -> RuleContext {
        RuleContext {
            rule,
            client,
            parent_ar,
            parent_namespaced,
            status_subresource,
            kinds,
            kind_of_child,
            recorder,
            metrics,
            gate,
            backoff: BackoffPolicy::default(),
            failures: Mutex::default(),
            hash_only: Mutex::default(),
            last_warning: Mutex::default(),
            fights: Mutex::default(),
            status_writes: Arc::default(),
            parent_store: None,
        }
    }

    fn scope(&self, child: usize) -> Scope {
        match self
            .kind_of_child
            .get(child)
            .and_then(|k| self.kinds.get(*k))
        {
            Some(k) if !k.namespaced => Scope::Cluster,
            _ => Scope::Namespaced,
        }
    }

    /// This parent's children in the caches: labelled with its UID and controlled by it,
    /// and — for a namespaced parent — in its namespace. (An object elsewhere that claims
    /// the parent's UID is someone else's: ownerReferences never cross namespaces.)
    fn owned_children(
        &self,
        uid: &str,
        parent_ns: Option<&str>,
    ) -> Vec<(usize, Arc<DynamicObject>)> {
        let mut out = Vec::new();
        for (k, kind) in self.kinds.iter().enumerate() {
            for (ns, name) in kind.index.owned_by(uid) {
                if self.parent_namespaced && kind.namespaced && ns.as_deref() != parent_ns {
                    continue;
                }
                let mut oref = ObjectRef::new_with(&name, kind.ar.clone());
                if let Some(ns) = ns {
                    oref = oref.within(&ns);
                }
                if let Some(o) = kind.store.get(&oref)
                    && o.labels().get(labels::OWNER).map(String::as_str) == Some(uid)
                    && controlled_by(&o, uid)
                {
                    out.push((k, o));
                }
            }
        }
        out
    }

    async fn event(
        &self,
        parent: &DynamicObject,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        self.event_about(parent, None, type_, reason, action, note)
            .await
    }

    /// An event on the parent; `related` names the child it is about, which also keeps
    /// events about different children apart (events are deduplicated by reason and object).
    async fn event_about(
        &self,
        parent: &DynamicObject,
        related: Option<k8s_openapi::api::core::v1::ObjectReference>,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        if !self.gate.may_write() {
            return; // events are writes too
        }
        if type_ == EventType::Warning {
            let key = parent.uid().unwrap_or_default();
            let text = format!("{reason}:{note}");
            let mut last = lock(&self.last_warning);
            if last.get(&key) == Some(&text) {
                return; // the same warning again says nothing new
            }
            last.insert(key, text);
        }
        let reference = parent.object_ref(&self.parent_ar);
        let ev = Event {
            type_,
            reason: reason.to_string(),
            note: Some(truncate(&note, 1000)),
            action: action.to_string(),
            secondary: related,
        };
        // Published in the background: an event is a record for people, and the reconcile
        // (and with it the parent's next reconcile) need not wait for its round trip.
        let recorder = self.recorder.clone();
        let metrics = self.metrics.clone();
        let rule = self.rule.name.clone();
        tokio::spawn(async move {
            match recorder.publish(&ev, &reference).await {
                Ok(()) => metrics.write(&rule, "event"),
                Err(e) => debug!(error = %e, "cannot publish event"),
            }
        });
    }

    /// Whether every child cache has completed its first listing.
    fn children_listed(&self) -> bool {
        use futures::FutureExt;
        self.kinds
            .iter()
            .all(|k| matches!(k.store.wait_until_ready().now_or_never(), Some(Ok(()))))
    }

    /// Forgets what is remembered of parents that were deleted (failures, warnings), and
    /// bounds what is remembered of children, so per-object memory does not only grow.
    fn forget_gone(&self) {
        let gone = std::mem::take(&mut *lock(&self.status_writes.gone));
        if !gone.is_empty() {
            let mut failures = lock(&self.failures);
            let mut warnings = lock(&self.last_warning);
            for uid in &gone {
                failures.remove(uid);
                warnings.remove(uid);
            }
        }
        let mut hash_only = lock(&self.hash_only);
        if hash_only.len() > HASH_ONLY_MAX {
            hash_only.clear();
        }
    }

    fn note_success(&self, uid: &str) {
        lock(&self.failures).remove(uid);
        lock(&self.last_warning).remove(uid);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn controlled_by(o: &DynamicObject, uid: &str) -> bool {
    o.owner_references()
        .iter()
        .any(|r| r.uid == uid && r.controller == Some(true))
}

fn describe_api_error(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
        other => other.to_string(),
    }
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// Reconciles one parent. Called by the rule's controller.
pub async fn reconcile(
    parent: Arc<DynamicObject>,
    ctx: Arc<RuleContext>,
) -> Result<Action, ReconcileError> {
    let rule = ctx.rule.name.clone();
    let started = Instant::now();
    let gauge = ctx
        .metrics
        .in_flight
        .get_or_create(&metrics::rule(&rule))
        .clone();
    gauge.inc();
    // kube-runtime hands over the parent as cached when the reconcile was scheduled; the
    // cache may hold a newer version by now (Rulebook's own last status write among them).
    let parent = ctx
        .parent_store
        .as_ref()
        .and_then(|s| {
            s.get(&ObjectRef::from_obj_with(
                parent.as_ref(),
                ctx.parent_ar.clone(),
            ))
        })
        .unwrap_or(parent);
    ctx.forget_gone();
    let result = reconcile_inner(&parent, &ctx).await;
    gauge.dec();
    ctx.metrics
        .reconcile_duration
        .get_or_create(&metrics::rule(&rule))
        .observe(started.elapsed().as_secs_f64());
    let label = match &result {
        Ok(_) => "ok",
        Err(e) => e.result_label(),
    };
    ctx.metrics
        .reconciles
        .get_or_create(&ResultLabels {
            rule: rule.clone(),
            result: label.to_string(),
        })
        .inc();
    if result.is_ok()
        && let Some(uid) = parent.uid()
    {
        ctx.note_success(&uid);
    }
    result
}

/// The controller's error policy: exponential backoff per parent, capped.
pub fn error_policy(
    parent: Arc<DynamicObject>,
    err: &ReconcileError,
    ctx: Arc<RuleContext>,
) -> Action {
    if let ReconcileError::Fight { retry_in, .. } = err {
        // Not a failure of the reconcile: it waits out the fight's own backoff, which
        // must not grow the parent's error backoff with every change the other side makes.
        debug!(rule = %ctx.rule.name, parent = %parent.name_any(), retry_in = ?retry_in, "fight backoff");
        return Action::requeue(*retry_in + Duration::from_millis(100));
    }
    let uid = parent.uid().unwrap_or_default();
    let n = {
        let mut f = lock(&ctx.failures);
        let n = f.entry(uid).or_insert(0);
        *n = n.saturating_add(1);
        *n
    };
    let delay = match err {
        // A template error cannot change until the parent, the rule or a child changes,
        // and each of those reconciles anyway: retry rarely (16 s, 32 s, … the cap).
        ReconcileError::Render(_) => ctx.backoff.delay(n.saturating_add(4)),
        _ => ctx.backoff.delay(n),
    };
    match err {
        ReconcileError::NotLeader => debug!("not the leader"),
        _ => {
            // The message may quote tenant values (a template error, a conflicting name):
            // it is on the parent's condition and at debug level, not in warnings.
            warn!(rule = %ctx.rule.name, parent = %parent.name_any(), failures = n, retry_in = ?delay, reason = err.result_label(), "reconcile failed");
            debug!(rule = %ctx.rule.name, parent = %parent.name_any(), error = %err, "reconcile failed");
        }
    }
    Action::requeue(delay)
}

async fn reconcile_inner(
    parent: &DynamicObject,
    ctx: &RuleContext,
) -> Result<Action, ReconcileError> {
    if !ctx.gate.may_write() {
        return Err(ReconcileError::NotLeader);
    }
    if parent.meta().deletion_timestamp.is_some() {
        return Ok(Action::await_change()); // the garbage collector removes the children
    }
    let Some(uid) = parent.uid() else {
        return Err(ReconcileError::Invalid("parent has no uid".into()));
    };
    if !ctx.children_listed() {
        // A parent reconciled before its children are cached would see none and report
        // them missing. Each child cache's listing reconciles every parent when it completes.
        debug!(rule = %ctx.rule.name, parent = %parent.name_any(), "child caches not listed yet; deferred");
        return Ok(Action::await_change());
    }
    let namespace = parent.namespace();
    let rule = &ctx.rule;
    let Some(parent_json) = cache::to_json(parent) else {
        return unreadable_parent(ctx, parent).await;
    };
    let live_children = read_stubs(ctx, ctx.owned_children(&uid, namespace.as_deref())).await?;
    let observed =
        Observed::from_objects(live_children.iter().filter_map(|(_, o)| cache::to_json(o)));

    let (rendered, parent_json, observed) = render_off_runtime(ctx, parent_json, observed).await?;
    let (desired, live_children, observed) =
        match confine_to_rendered_namespaces(ctx, rendered, live_children, observed) {
            Confined::Same(d, l, o) => (d, l, o),
            Confined::Narrowed(l, o) => {
                let (again, _, o) = render_off_runtime(ctx, parent_json.clone(), o).await?;
                (again, l, o)
            }
        };
    let desired = match desired {
        Ok(d) => d,
        Err(e) => {
            ctx.metrics
                .render_errors
                .get_or_create(&metrics::rule(&rule.name))
                .inc();
            let state = ConditionState::new(false, "RenderFailed", &e.to_string());
            ctx.event(
                parent,
                EventType::Warning,
                "RenderFailed",
                "Render",
                e.to_string(),
            )
            .await;
            write_status(ctx, parent, &parent_json, None, &state).await?;
            return Err(e.into());
        }
    };

    // Apply, in rule order; the first failure stops the rest (later children may depend on earlier ones).
    let mut failure: Option<(ConditionState, ReconcileError)> = None;
    let mut changes: Vec<Change> = Vec::new();
    let lookups = look_up_uncached(ctx, namespace.as_deref(), &desired).await;
    // The children `observed` holds; one that reached the cache since is read again below.
    let in_observed: HashSet<(usize, String)> = live_children
        .iter()
        .map(|(k, o)| (*k, o.name_any()))
        .collect();
    for (d, lookup) in desired.iter().zip(lookups) {
        let seen = in_observed.contains(&(ctx.kind_of_child[d.child], d.object_name().to_string()));
        match apply_child(ctx, parent, &uid, namespace.as_deref(), d, lookup, seen).await {
            Ok(Some(change)) => changes.push(change),
            Ok(None) => {}
            Err((state, err)) => {
                failure = Some((state, err));
                break;
            }
        }
    }

    // Prune what this parent owns and no longer renders.
    let wanted: HashSet<(usize, &str)> = desired
        .iter()
        .map(|d| (ctx.kind_of_child[d.child], d.object_name()))
        .collect();
    for (k, obj) in &live_children {
        let name = obj.name_any();
        if wanted.contains(&(*k, name.as_str())) {
            continue;
        }
        match prune_child(ctx, parent, &ctx.kinds[*k], obj).await {
            Ok(Some(change)) => changes.push(change),
            Ok(None) => {}
            Err(e) => {
                if failure.is_none() {
                    let state = ConditionState::new(false, "PruneFailed", &e.to_string());
                    failure = Some((state, e));
                }
            }
        }
    }
    report_changes(ctx, parent, &changes).await;
    // Status sees the children as this reconcile left them: what was just applied
    // replaces the cached copy, what was just pruned is gone. (Waiting for the caches
    // would cost a second reconcile and a second status write.)
    let observed = if changes.is_empty() {
        observed
    } else {
        observed_after(&observed, &changes)
    };

    // Status.
    let (report, parent_json, _) = status_off_runtime(ctx, parent_json, observed, desired).await?;
    let (fields, ready) = match report {
        Ok(report) => (Some(report.fields), report.readiness.condition()),
        Err(e) => {
            ctx.metrics
                .render_errors
                .get_or_create(&metrics::rule(&rule.name))
                .inc();
            let state = ConditionState::new(false, "RenderFailed", &e.to_string());
            ctx.event(
                parent,
                EventType::Warning,
                "RenderFailed",
                "Status",
                e.to_string(),
            )
            .await;
            write_status(ctx, parent, &parent_json, None, &state).await?;
            return Err(e.into());
        }
    };
    match failure {
        Some((state, err)) => {
            ctx.event(
                parent,
                EventType::Warning,
                &state.reason,
                "Reconcile",
                state.message.clone(),
            )
            .await;
            write_status(ctx, parent, &parent_json, fields.as_ref(), &state).await?;
            Err(err)
        }
        None => {
            write_status(ctx, parent, &parent_json, fields.as_ref(), &ready).await?;
            Ok(match rule.resync {
                Some(every) => Action::requeue(every),
                None => Action::await_change(),
            })
        }
    }
}

/// Applies one desired child when it is missing, changed or drifted.
/// Where a desired child lives: its API, its cache key, and how messages name it.
struct Target<'a> {
    kind: &'a ChildKind,
    api: Api<DynamicObject>,
    oref: ObjectRef<DynamicObject>,
    name: String,
    what: String,
}

fn target<'a>(ctx: &'a RuleContext, namespace: Option<&str>, d: &DesiredChild) -> Target<'a> {
    let kind = &ctx.kinds[ctx.kind_of_child[d.child]];
    let name = d.object_name().to_string();
    let ns = if kind.namespaced {
        d.object
            .pointer("/metadata/namespace")
            .and_then(Json::as_str)
            .or(namespace)
    } else {
        None
    };
    let what = match ns {
        Some(ns) => format!("{} {ns}/{name}", d.kind()),
        None => format!("{} {name}", d.kind()),
    };
    let api = kind.api(&ctx.client, ns);
    let mut oref = ObjectRef::new_with(&name, kind.ar.clone());
    if let Some(ns) = ns {
        oref = oref.within(ns);
    }
    Target {
        kind,
        api,
        oref,
        name,
        what,
    }
}

/// What a GET found for a desired child that is not in the cache.
type Lookup = Option<Result<Option<DynamicObject>, kube::Error>>;

/// GETs the desired children the cache does not hold, a few at a time, in rule order:
/// a name that is not in the cache may belong to a foreign object. Done up front so
/// that a new parent costs one round trip of reads, not one per child before its apply.
async fn look_up_uncached(
    ctx: &RuleContext,
    namespace: Option<&str>,
    desired: &[DesiredChild],
) -> Vec<Lookup> {
    use futures::StreamExt;
    let lookups: Vec<_> = desired.iter().map(|d| look_up(ctx, namespace, d)).collect();
    futures::stream::iter(lookups).buffered(8).collect().await
}

async fn look_up(ctx: &RuleContext, namespace: Option<&str>, d: &DesiredChild) -> Lookup {
    let t = target(ctx, namespace, d);
    if t.kind.store.get(&t.oref).is_some() {
        return None;
    }
    Some(t.api.get_opt(&t.name).await)
}

/// Applies one desired child when it is missing, changed or drifted. `lookup` is what
/// [`look_up_uncached`] found for it.
async fn apply_child(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    namespace: Option<&str>,
    d: &DesiredChild,
    lookup: Lookup,
    seen: bool,
) -> Result<Option<Change>, (ConditionState, ReconcileError)> {
    let Target {
        kind,
        api,
        oref,
        name,
        what,
    } = target(ctx, namespace, d);
    let child_spec = &ctx.rule.children()[d.child];
    let conflict = |owner: String| {
        let msg = if child_spec.adopt {
            format!(
                "{what} already exists and {owner}; Rulebook adopts only objects that have no controller and no other parent's label"
            )
        } else {
            format!(
                "{what} already exists and {owner}; Rulebook leaves it alone (set `adopt: true` on child '{}' to take it over)",
                d.name
            )
        };
        (
            ConditionState::new(false, "Conflict", &msg),
            ReconcileError::Conflict(msg),
        )
    };

    let mut live = kind.store.get(&oref);
    let mut fetched = false;
    if live.as_deref().is_some_and(wire::is_stub) {
        // Cached without content (cache budget): the API server has it.
        live = None;
    }
    match &live {
        Some(o) if controlled_by(o, uid) => {}
        Some(o) => {
            // Labelled for this rule, but not this parent's.
            if !may_adopt(child_spec.adopt, o, uid) {
                return Err(conflict(owner_description(o)));
            }
            live = None;
        }
        None => {
            // Not in the cache: a foreign object of that name must not be taken over silently.
            let found = match lookup {
                Some(found) => found,
                None => api.get_opt(&name).await,
            };
            match found {
                Ok(None) => {}
                Ok(Some(o)) if controlled_by(&o, uid) => {
                    // Ours, but its watch event has not reached the cache yet.
                    fetched = true;
                    live = Some(Arc::new(o));
                }
                Ok(Some(o)) => {
                    if !may_adopt(child_spec.adopt, &o, uid) {
                        return Err(conflict(owner_description(&o)));
                    }
                }
                Err(e) => {
                    let err = ReconcileError::Read {
                        what: what.clone(),
                        source: e,
                    };
                    return Err((
                        ConditionState::new(false, "ApplyFailed", &err.to_string()),
                        err,
                    ));
                }
            }
        }
    }

    let live_json = live.as_ref().and_then(|o| cache::to_json(o));
    if live.is_some() && live_json.is_none() {
        let msg = format!(
            "{what} cannot be read: its content is nested more deeply than Rulebook reads ({} levels)",
            wire::MAX_DEPTH
        );
        return Err((
            ConditionState::new(false, "InvalidChild", &msg),
            ReconcileError::Invalid(msg),
        ));
    }
    let live_uid = live.as_ref().and_then(|o| o.uid()).unwrap_or_default();
    let hash_only = lock(&ctx.hash_only).contains(&live_uid);
    let Some(why) = drift(
        live_json.as_ref(),
        &d.hash,
        &d.object,
        FIELD_MANAGER,
        hash_only,
    ) else {
        // Up to date. If it came from a GET, or reached the cache after this reconcile read
        // the parent's children, the status must see it all the same.
        return Ok(match (fetched || !seen, &live) {
            (true, Some(o)) => Some(Change {
                reason: "Fetched",
                what,
                related: o.object_ref(&kind.ar),
                object: live_json,
            }),
            _ => None,
        });
    };

    if why == Drift::FieldsChanged {
        // Someone else keeps changing fields Rulebook manages: repair, but not in a hot loop.
        let mut fights = lock(&ctx.fights);
        let now = Instant::now();
        fights.retain(|_, f| {
            now.duration_since(f.last_repair) < FIGHT_FORGET
                || f.blocked_until.is_some_and(|u| u > now)
        });
        let f = fights.entry(live_uid.clone()).or_insert(Fight {
            window_start: now,
            reapplies: 0,
            blocked_until: None,
            backoff: Duration::ZERO,
            strikes: 0,
            last_repair: now,
        });
        if let Some(until) = f.blocked_until
            && now < until
        {
            // The message stays the same for the whole block (no countdown), so the
            // reconciles the other side's writes trigger write no status and no event.
            let by = live_json.as_ref().map(other_managers).unwrap_or_default();
            let message = format!(
                "{what}: fields Rulebook manages keep being changed by {by}; Rulebook backs off and repairs them {}s after the last repair",
                f.backoff.as_secs()
            );
            return Err((
                ConditionState::new(false, "Conflict", &message),
                ReconcileError::Fight {
                    message,
                    retry_in: until - now,
                },
            ));
        }
        f.last_repair = now;
        if now.duration_since(f.window_start) > FIGHT_WINDOW {
            f.window_start = now;
            f.reapplies = 0;
        }
        f.reapplies += 1;
        if f.reapplies > FIGHT_LIMIT {
            f.strikes = f.strikes.saturating_add(1);
            let wait = ctx.backoff.delay(f.strikes + 4); // 16 s, 32 s, … up to the cap
            f.blocked_until = Some(now + wait);
            f.backoff = wait;
            f.window_start = now;
            f.reapplies = 0;
        }
    }

    if !ctx.gate.may_write() {
        return Err((
            ConditionState::new(false, "NotLeader", "writes are paused"),
            ReconcileError::NotLeader,
        ));
    }
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let applied = match api
        .patch(&name, &params, &Patch::Apply(apply_body(&d.object)))
        .await
    {
        Ok(o) => o,
        Err(e) => {
            let msg = format!("{what}: {}", describe_api_error(&e));
            return Err((
                ConditionState::new(false, "ApplyFailed", &msg),
                ReconcileError::Apply { what, source: e },
            ));
        }
    };
    ctx.metrics.write(&ctx.rule.name, "apply");
    ctx.metrics
        .children_applied
        .get_or_create(&metrics::rule(&ctx.rule.name))
        .inc();
    if let Ok(applied_json) = serde_json::to_value(&applied)
        && !fields_cover(&applied_json, &d.object, FIELD_MANAGER)
        && let Some(u) = applied.uid()
    {
        // The API server recorded the fields differently than the check reads them:
        // rely on the hash alone for this object rather than re-applying forever.
        warn!(child = %what, "managed fields do not mirror the desired object; checking it by hash only (hand edits of it will not be reverted)");
        lock(&ctx.hash_only).insert(u);
    }
    let (reason, verb) = match why {
        Drift::Missing => ("Created", "created"),
        Drift::DesiredChanged => ("Updated", "updated"),
        Drift::FieldsChanged => ("Repaired", "repaired (fields changed by someone else)"),
    };
    info!(rule = %ctx.rule.name, parent = %parent.name_any(), child = %what, "{verb}");
    Ok(Some(Change {
        reason,
        what,
        related: applied.object_ref(&kind.ar),
        object: serde_json::to_value(&applied).ok(),
    }))
}

/// What one apply or prune did, for the reconcile's events and its status.
struct Change {
    /// `Created`, `Updated`, `Repaired` or `Pruned`; `Fetched` for an up-to-date child
    /// that the reconcile's first read of the cache did not include (no event, status only).
    reason: &'static str,
    what: String,
    related: k8s_openapi::api::core::v1::ObjectReference,
    /// The object as the API server returned it (applies only).
    object: Option<Json>,
}

/// The live children after this reconcile's applies and prunes.
fn observed_after(observed: &Observed, changes: &[Change]) -> Observed {
    let key_of = |c: &Change| Some((c.related.kind.clone()?, c.related.name.clone()?));
    let applied: HashMap<(String, String), &Json> = changes
        .iter()
        .filter_map(|c| Some((key_of(c)?, c.object.as_ref()?)))
        .collect();
    let pruned: HashSet<(String, String)> = changes
        .iter()
        .filter(|c| c.object.is_none())
        .filter_map(key_of)
        .collect();
    let mut objects: Vec<Json> = Vec::new();
    let mut seen = HashSet::new();
    for o in observed.children.values().flatten() {
        let key = (
            o["kind"].as_str().unwrap_or("").to_string(),
            o["metadata"]["name"].as_str().unwrap_or("").to_string(),
        );
        if pruned.contains(&key) {
            continue;
        }
        objects.push(
            applied
                .get(&key)
                .map_or_else(|| o.clone(), |fresh| (*fresh).clone()),
        );
        seen.insert(key);
    }
    for (key, fresh) in &applied {
        if !seen.contains(key) {
            objects.push((*fresh).clone());
        }
    }
    Observed::from_objects(objects)
}

/// One Normal event per kind of change in a reconcile (not one per child: events are
/// writes too), naming every child it concerns.
async fn report_changes(ctx: &RuleContext, parent: &DynamicObject, changes: &[Change]) {
    for reason in ["Created", "Updated", "Repaired", "Pruned"] {
        let these: Vec<&Change> = changes.iter().filter(|c| c.reason == reason).collect();
        let Some(first) = these.first() else { continue };
        let verb = match reason {
            "Created" => "created",
            "Updated" => "updated",
            "Repaired" => "repaired (fields changed by someone else)",
            _ => "pruned (no longer rendered)",
        };
        let list: Vec<&str> = these.iter().map(|c| c.what.as_str()).collect();
        let action = if reason == "Pruned" { "Prune" } else { "Apply" };
        ctx.event_about(
            parent,
            (these.len() == 1).then(|| first.related.clone()),
            EventType::Normal,
            reason,
            action,
            format!("{}: {verb}", list.join(", ")),
        )
        .await;
    }
}

/// Whether a child with `adopt: true` may take over `o`: only an object without any
/// controller, and never one labelled as another parent's child (a tenant could name a
/// parent so that its child's name is another parent's child, or any object it wants).
fn may_adopt(adopt: bool, o: &DynamicObject, uid: &str) -> bool {
    adopt
        && !o
            .owner_references()
            .iter()
            .any(|r| r.controller == Some(true))
        && o.labels()
            .get(labels::OWNER)
            .is_none_or(|owner| owner == uid)
}

fn owner_description(o: &DynamicObject) -> String {
    match o
        .owner_references()
        .iter()
        .find(|r| r.controller == Some(true))
    {
        Some(r) => format!("is controlled by {} {}", r.kind, r.name),
        None if o.labels().contains_key(labels::OWNER) => {
            "is labelled as another parent's child".to_string()
        }
        None => "was not created by Rulebook for this parent".to_string(),
    }
}

/// Managers other than Rulebook that hold fields of the object, most recent first.
fn other_managers(live: &Json) -> String {
    let mut names: Vec<(String, String)> = live
        .pointer("/metadata/managedFields")
        .and_then(Json::as_array)
        .map(|entries| {
            entries
                .iter()
                .filter_map(|e| {
                    let m = e.get("manager")?.as_str()?;
                    (m != FIELD_MANAGER).then(|| {
                        (
                            e.get("time")
                                .and_then(Json::as_str)
                                .unwrap_or("")
                                .to_string(),
                            m.to_string(),
                        )
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names.reverse();
    let list: Vec<String> = names
        .into_iter()
        .map(|(_, m)| m)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if list.is_empty() {
        "another client".into()
    } else {
        format!("field manager {}", list.join(", "))
    }
}

/// Deletes one child this parent no longer renders: only when it carries the parent's
/// UID label and controller ownerReference, and only that exact object (UID precondition).
async fn prune_child(
    ctx: &RuleContext,
    parent: &DynamicObject,
    kind: &ChildKind,
    obj: &DynamicObject,
) -> Result<Option<Change>, ReconcileError> {
    let name = obj.name_any();
    let ns = obj.namespace();
    let what = match &ns {
        Some(ns) => format!("{} {ns}/{name}", kind.ar.kind),
        None => format!("{} {name}", kind.ar.kind),
    };
    let api = kind.api(&ctx.client, ns.as_deref());
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: obj.uid(),
            resource_version: None,
        }),
        ..DeleteParams::background()
    };
    if !ctx.gate.may_write() {
        return Err(ReconcileError::NotLeader);
    }
    match api.delete(&name, &dp).await {
        Ok(_) => {}
        Err(e) if is_not_found(&e) => return Ok(None),
        Err(e) => return Err(ReconcileError::Prune { what, source: e }),
    }
    ctx.metrics.write(&ctx.rule.name, "delete");
    ctx.metrics
        .children_pruned
        .get_or_create(&metrics::rule(&ctx.rule.name))
        .inc();
    info!(rule = %ctx.rule.name, parent = %parent.name_any(), child = %what, "pruned");
    Ok(Some(Change {
        reason: "Pruned",
        what,
        related: obj.object_ref(&kind.ar),
        object: None,
    }))
}

/// Writes `.status` when it differs from what the parent has. `fields` is `None` when
/// they could not be computed; then the parent's current values are kept.
async fn write_status(
    ctx: &RuleContext,
    parent: &DynamicObject,
    parent_json: &Json,
    fields: Option<&serde_json::Map<String, Json>>,
    ready: &ConditionState,
) -> Result<(), ReconcileError> {
    if !ctx.status_subresource {
        ctx.event(
            parent,
            EventType::Warning,
            "Invalid",
            "Status",
            format!(
                "{} has no status subresource: Rulebook cannot write status or conditions ({}: {})",
                ctx.parent_ar.kind, ready.reason, ready.message
            ),
        )
        .await;
        return Ok(());
    }
    let managed: Vec<&str> = ctx
        .rule
        .rule
        .spec
        .status
        .keys()
        .map(String::as_str)
        .collect();
    let kept;
    let fields = match fields {
        Some(f) => f,
        None => {
            kept = managed
                .iter()
                .filter_map(|k| {
                    parent_json
                        .pointer(&format!("/status/{k}"))
                        .map(|v| (k.to_string(), v.clone()))
                })
                .collect();
            &kept
        }
    };
    let now = crate::cli::now_rfc3339();
    let uid = parent.uid().unwrap_or_default();
    // A reconcile can run before Rulebook's last status write of this parent has come
    // back on the watch; the status the API server holds is then the one written, not
    // the cached one. Without this, a reconcile writes the same status twice, or skips
    // a write because the stale cached status happens to match.
    let written = ctx.status_writes.newer_than(&uid, parent);
    let live_json = match &written {
        Some(w) => {
            let mut p = parent_json.clone();
            if let Some(o) = p.as_object_mut() {
                o.insert("status".into(), w.clone());
            }
            p
        }
        None => parent_json.clone(),
    };
    let desired = status::desired_status(&live_json, fields, ready, &now);
    let live = live_json.get("status");
    let stale_field = managed
        .iter()
        .any(|k| !fields.contains_key(*k) && live.and_then(|s| s.get(*k)).is_some());
    if !stale_field && status::status_matches(live, &desired) {
        return Ok(());
    }
    debug!(
        parent = %parent.name_any(),
        cached_rv = parent.resource_version().unwrap_or_default(),
        after_own_write = written.is_some(),
        was = %live.map(Json::to_string).unwrap_or_default(),
        now = %desired,
        "writing status"
    );
    let body = json!({
        "apiVersion": ctx.parent_ar.api_version,
        "kind": ctx.parent_ar.kind,
        "metadata": {"name": parent.name_any()},
        "status": desired,
    });
    if !ctx.gate.may_write() {
        return Err(ReconcileError::NotLeader);
    }
    let api: Api<DynamicObject> = match (ctx.parent_namespaced, parent.namespace()) {
        (true, Some(ns)) => Api::namespaced_with(ctx.client.clone(), &ns, &ctx.parent_ar),
        _ => Api::all_with(ctx.client.clone(), &ctx.parent_ar),
    };
    let params = PatchParams::apply(FIELD_MANAGER).force();
    match api
        .patch_status(
            &parent.name_any(),
            &params,
            &Patch::Apply(apply_body(&body)),
        )
        .await
    {
        Ok(o) => {
            ctx.metrics.write(&ctx.rule.name, "apply_status");
            if let Some(rv) = resource_version(&o) {
                let st = o.data.get("status").cloned().unwrap_or(Json::Null);
                ctx.status_writes.record(uid, rv, &st);
            }
            Ok(())
        }
        Err(e) if is_not_found(&e) => Ok(()), // the parent is gone
        Err(e) => Err(ReconcileError::Status(e)),
    }
}

/// A server-side apply body. The API server reads apply patches with its YAML reader,
/// which refuses DEL, C1 controls, U+FFFE/U+FFFF and takes NEL, LS and PS for line
/// breaks — characters JSON leaves unescaped — so they are sent as `\uXXXX` escapes,
/// which mean the same character to both readers.
fn apply_body(value: &Json) -> Box<serde_json::value::RawValue> {
    let text = value.to_string();
    let safe = crate::render::yaml_safe(&text).into_owned();
    match serde_json::value::RawValue::from_string(safe) {
        Ok(raw) => raw,
        // Unreachable (escaping inside JSON strings keeps valid JSON); send it unescaped.
        Err(_) => serde_json::value::RawValue::from_string(text)
            .unwrap_or_else(|_| Box::<serde_json::value::RawValue>::default()),
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let p = BackoffPolicy::default();
        assert_eq!(p.delay(1), Duration::from_secs(1));
        assert_eq!(p.delay(2), Duration::from_secs(2));
        assert_eq!(p.delay(5), Duration::from_secs(16));
        assert_eq!(p.delay(30), Duration::from_secs(300));
    }

    #[test]
    fn apply_bodies_escape_what_a_yaml_reader_would_change() {
        let v =
            json!({"data": {"v": "a\u{7f}b\u{85}c\u{9f}d\u{2028}e\u{fffe}f\u{ffff}g\"h\u{1f600}"}});
        let body = apply_body(&v);
        let text = body.get();
        assert!(
            text.is_ascii()
                || !text.chars().any(|c| matches!(
                    c,
                    '\u{7f}'..='\u{9f}' | '\u{2028}' | '\u{fffe}' | '\u{ffff}'
                )),
            "{text}"
        );
        assert!(
            text.contains("\\u007f") && text.contains("\\u0085") && text.contains("\\ufffe"),
            "{text}"
        );
        let back: Json = serde_json::from_str(text).unwrap();
        assert_eq!(back, v);
    }

    fn parent_at(rv: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "x/v1", "kind": "P",
            "metadata": {"name": "p", "uid": "u1", "resourceVersion": rv},
            "status": {"phase": "cached"}
        }))
        .unwrap()
    }

    #[test]
    fn a_status_write_counts_until_the_cache_has_caught_up() {
        use kube::runtime::watcher::Event;
        let w = StatusWrites::default();
        w.record("u1".into(), 10, &json!({"phase": "written"}));
        // A cached parent from before the write: the written status is what the server has.
        assert_eq!(
            w.newer_than("u1", &parent_at("9")),
            Some(json!({"phase": "written"}))
        );
        assert_eq!(w.newer_than("u2", &parent_at("9")), None);
        // From the write on, the cache is right.
        assert_eq!(w.newer_than("u1", &parent_at("10")), None);
        assert_eq!(w.newer_than("u1", &parent_at("not-a-number")), None);
        // Once the cache has the write, a reconcile that started on an older version of
        // the parent must still compare with the write.
        w.observe(&Event::Apply(parent_at("11")));
        assert_eq!(
            w.newer_than("u1", &parent_at("9")),
            Some(json!({"phase": "written"}))
        );
        assert_eq!(w.newer_than("u1", &parent_at("11")), None);
        // A deleted parent is forgotten.
        w.observe(&Event::Delete(parent_at("15")));
        assert!(w.is_empty());
    }

    #[test]
    fn other_managers_are_named_newest_first() {
        let live = json!({"metadata": {"managedFields": [
            {"manager": "rulebook", "operation": "Apply", "time": "2026-01-01T00:00:03Z"},
            {"manager": "kubectl-edit", "operation": "Update", "time": "2026-01-01T00:00:02Z"},
        ]}});
        assert_eq!(other_managers(&live), "field manager kubectl-edit");
        assert_eq!(other_managers(&json!({})), "another client");
    }
}
