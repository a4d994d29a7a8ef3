//! The parent's status: computed by the rule, compared with what the parent has (or
//! with Rulebook's own last write, when the cache has not caught up with it), written
//! with one server-side apply to the status subresource only when it differs.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::events::EventType;
use serde_json::{Value as Json, json};
use tracing::{debug, warn};

use super::context::{RuleContext, lock};
use super::error::{ReconcileError, is_not_found};
use super::events::event;
use super::plan::plan_status;
use crate::meta::JsonAt;
use crate::meta::STATUS_RULE_VERSION;
use crate::render::status::ConditionState;
use crate::write::writer::WriteError;

/// The status last written per parent UID, with the parent's resourceVersion after the
/// write. A reconcile works on the parent as cached when it started, which may predate
/// Rulebook's last status write even after the cache has caught up, so an entry is kept
/// for [`STATUS_WRITE_KEEP`] after the parent watch has delivered the write
/// ([`StatusWrites::observe`]); the status itself is held as compact JSON text.
#[derive(Default)]
pub struct StatusWrites {
    written: Mutex<Written>,
    /// UIDs of parents deleted since the last reconcile: their per-parent memory goes.
    gone: Mutex<Vec<String>>,
    /// Whether the parents were listed again since the last reconcile: parents deleted
    /// while the watch was down (or before a restart of the rule) brought no deletion.
    relisted: std::sync::atomic::AtomicBool,
}

struct StatusWrite {
    rv: u64,
    /// [`crate::reconcile::memo::identity`] of the parent as the write left it.
    identity: Option<u64>,
    status: String,
    at: Instant,
    /// The parent watch has delivered this write (or a later version).
    seen: bool,
}

/// How long a status write is remembered after the cache has it: longer than a reconcile
/// that started on the parent before the watch delivered the write takes.
const STATUS_WRITE_KEEP: Duration = Duration::from_secs(10);
/// How long one is remembered at most (its watch event may never come: parent deleted).
const STATUS_WRITE_MAX: Duration = Duration::from_secs(600);
/// How often the writes no longer needed are swept, at most.
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// The writes, and when they were last swept. A sweep runs on the way of any use once
/// [`SWEEP_EVERY`] has passed: every resync reconcile reads the table, so a converged
/// operator holds none of them for long.
#[derive(Default)]
struct Written {
    map: HashMap<String, StatusWrite>,
    swept: Option<Instant>,
}

impl Written {
    fn sweep_if_due(&mut self) -> &mut HashMap<String, StatusWrite> {
        if self.swept.is_none_or(|t| t.elapsed() >= SWEEP_EVERY) {
            self.map.retain(|_, w| {
                let age = w.at.elapsed();
                age < STATUS_WRITE_MAX && !(w.seen && age > STATUS_WRITE_KEEP)
            });
            self.swept = Some(Instant::now());
        }
        &mut self.map
    }
}

impl StatusWrites {
    /// Notes writes the cache now holds; forgets those of deleted parents.
    pub fn observe(&self, event: &kube::runtime::watcher::Event<DynamicObject>) {
        use kube::runtime::watcher::Event;
        let (o, deleted) = match event {
            // Not `InitApply`: the cache holds a relisted object only from `InitDone` on.
            Event::Apply(o) => (o, false),
            Event::Delete(o) => (o, true),
            Event::InitDone => {
                self.relisted
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                return;
            }
            _ => return,
        };
        let Some(uid) = o.uid() else { return };
        let mut table = lock(&self.written);
        let written = table.sweep_if_due();
        if deleted {
            written.remove(&uid);
            lock(&self.gone).push(uid);
        } else if let Some(w) = written.get_mut(&uid)
            && resource_version(o).is_none_or(|seen| seen >= w.rv)
        {
            w.seen = true;
        }
    }

    pub(super) fn record(&self, uid: String, rv: u64, identity: Option<u64>, status: &Json) {
        lock(&self.written).sweep_if_due().insert(
            uid,
            StatusWrite {
                rv,
                identity,
                status: status.to_string(),
                at: Instant::now(),
                seen: false,
            },
        );
    }

    /// The status of the last write of this parent if the cached parent predates it.
    /// resourceVersions are compared as numbers (etcd revisions); a parent whose
    /// resourceVersion is not a number is taken as it is cached.
    pub(super) fn newer_than(&self, uid: &str, cached: &DynamicObject) -> Option<Json> {
        let mut table = lock(&self.written);
        let w = table.sweep_if_due().get(uid)?;
        match resource_version(cached) {
            Some(seen) if seen < w.rv => serde_json::from_str(&w.status).ok(),
            _ => None,
        }
    }

    /// The parent's resourceVersion as far as this process knows: the cached one, or that
    /// of Rulebook's own last status write when the cache has not caught up yet — but only
    /// when that write left the parent as `cached` is otherwise (same generation, labels,
    /// annotations, finalizers): a change someone made before the write landed must not
    /// pass for one this process has seen.
    pub(super) fn latest_rv(&self, uid: &str, cached: &DynamicObject) -> Option<u64> {
        let seen = resource_version(cached);
        let written = lock(&self.written)
            .sweep_if_due()
            .get(uid)
            .filter(|w| w.identity.is_some() && w.identity == super::memo::identity(cached))
            .map(|w| w.rv);
        match (seen, written) {
            (Some(s), Some(w)) => Some(s.max(w)),
            (s, _) => s,
        }
    }

    /// UIDs of the parents deleted since the last call.
    pub fn take_gone(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.gone))
    }

    /// Whether the parents were listed again since the last call.
    pub fn take_relisted(&self) -> bool {
        self.relisted
            .swap(false, std::sync::atomic::Ordering::SeqCst)
    }

    pub fn len(&self) -> usize {
        lock(&self.written).map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn resource_version(o: &DynamicObject) -> Option<u64> {
    o.resource_version().and_then(|v| v.parse::<u64>().ok())
}

/// Writes `.status` when it differs from what the parent has (returns whether it wrote).
/// `fields` is `None` when they could not be computed; then the parent's current values
/// are kept.
pub(super) async fn write_status(
    ctx: &RuleContext,
    parent: &DynamicObject,
    parent_json: &Json,
    fields: Option<&serde_json::Map<String, Json>>,
    ready: &ConditionState,
) -> Result<bool, ReconcileError> {
    if !ctx.parent.status_subresource {
        event(
            ctx,
            parent,
            EventType::Warning,
            "Invalid",
            "Status",
            format!(
                "{} has no status subresource: Rulebook cannot write status or conditions ({}: {})",
                ctx.parent.ar.kind, ready.reason, ready.message
            ),
        );
        return Ok(false);
    }
    let managed = managed_fields(ctx);
    let kept;
    let fields = match fields {
        // A failed reconcile does not claim the rule version that failed.
        Some(f) if records_version(ctx) && completed(ready) => {
            let mut f = f.clone();
            f.insert(
                STATUS_RULE_VERSION.into(),
                Json::String(ctx.rule.version.clone()),
            );
            kept = f;
            &kept
        }
        Some(f) => f,
        None => {
            kept = managed
                .iter()
                .filter_map(|k| {
                    parent_json
                        .at(&["status", k])
                        .map(|v| (k.to_string(), v.clone()))
                })
                .collect();
            &kept
        }
    };
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
    let Some(desired) = plan_status(&live_json, &managed, fields, ready, &now_rfc3339()) else {
        return Ok(false);
    };
    apply_status(ctx, parent, uid, desired, written.is_some()).await?;
    Ok(true)
}

/// Whether this reconcile's one new input is the rule itself
/// ([`super::plan::is_rule_rollout`]). Without `ruleVersion` in the status (a kind whose
/// schema Rulebook did not write) that cannot be told: `false`.
///
/// The status it reads is the newest this process knows: `written`, its own last write,
/// when the cache predates it (a reconcile between a rollout's status write and its
/// watch event is not one of the rollout's).
pub(super) fn rule_rollout_only(
    ctx: &RuleContext,
    parent: &DynamicObject,
    written: Option<&Json>,
    parent_json: &Json,
) -> bool {
    if !records_version(ctx) {
        return false;
    }
    let generation = parent.metadata.generation;
    match written {
        Some(status) => {
            super::plan::is_rule_rollout(&json!({"status": status}), generation, &ctx.rule.version)
        }
        None => super::plan::is_rule_rollout(parent_json, generation, &ctx.rule.version),
    }
}

/// Whether the parent's status has `ruleVersion`: its kind is the rule's own CRD, whose
/// schema Rulebook wrote (another kind's schema might prune the field, and every
/// reconcile would then write it again; a write whose response lacks it turns it off).
fn records_version(ctx: &RuleContext) -> bool {
    ctx.records_version.load(Ordering::Relaxed)
}

/// Whether `ready` is the outcome of a reconcile that went through (the parent's
/// readiness), not of a failure.
fn completed(ready: &ConditionState) -> bool {
    matches!(ready.reason.as_str(), "Ready" | "ChildrenNotReady")
}

/// The `.status` fields Rulebook owns besides `conditions` and `observedGeneration`.
fn managed_fields(ctx: &RuleContext) -> Vec<&str> {
    let mut keys: Vec<&str> = ctx
        .rule
        .rule
        .spec
        .status
        .keys()
        .map(String::as_str)
        .collect();
    if records_version(ctx) {
        keys.push(STATUS_RULE_VERSION);
    }
    keys
}

/// Writes the status of a parent being torn down: its fields as they are, `Ready=False`
/// and `Deleting=True` with the teardown's step as reason and what it waits on as message.
pub(super) async fn write_deleting(
    ctx: &RuleContext,
    parent: &DynamicObject,
    parent_json: &Json,
    step: &ConditionState,
) -> Result<(), ReconcileError> {
    let ready = ConditionState::new(false, "Deleting", &step.message);
    write_held(ctx, parent, parent_json, Some(&ready), "Deleting", step).await
}

/// Writes the status of a paused parent: its fields and `Ready` as they are, and
/// `Paused=True`. Nothing else is written while it is paused.
pub(super) async fn write_paused(
    ctx: &RuleContext,
    parent: &DynamicObject,
    parent_json: &Json,
) -> Result<(), ReconcileError> {
    let paused = ConditionState::new(
        true,
        super::plan::PAUSED_REASON,
        &format!(
            "the {PAUSED} annotation is \"true\": Rulebook does not write to this parent or its children",
            PAUSED = crate::meta::labels::PAUSED
        ),
    );
    write_held(ctx, parent, parent_json, None, "Paused", &paused).await
}

/// The status of a parent whose reconcile is held (torn down, paused): the rule's fields
/// as they are, `Ready` as given (or as it is), and one more condition.
async fn write_held(
    ctx: &RuleContext,
    parent: &DynamicObject,
    parent_json: &Json,
    ready: Option<&ConditionState>,
    type_: &str,
    state: &ConditionState,
) -> Result<(), ReconcileError> {
    if !ctx.parent.status_subresource {
        return Ok(());
    }
    let uid = parent.uid().unwrap_or_default();
    let written = ctx.status_writes.newer_than(&uid, parent);
    let mut live = parent_json.clone();
    if let (Some(w), Some(o)) = (&written, live.as_object_mut()) {
        o.insert("status".into(), w.clone());
    }
    let fields: serde_json::Map<String, Json> = managed_fields(ctx)
        .into_iter()
        .filter_map(|k| Some((k.to_string(), live.at(&["status", k])?.clone())))
        .collect();
    let now = now_rfc3339();
    let previous = crate::render::status::conditions_of(&live);
    let generation = live.at(&["metadata", "generation"]).and_then(Json::as_i64);
    let mut desired = match ready {
        Some(ready) => crate::render::status::desired_status(&live, &fields, ready, &now),
        None => {
            // Ready and observedGeneration exactly as they are (kept in the apply, so they
            // stay Rulebook's): a paused parent's later generations are not observed.
            let mut status = fields.clone();
            if let Some(g) = live.at(&["status", "observedGeneration"]) {
                status.insert("observedGeneration".into(), g.clone());
            }
            let kept: Vec<Json> = previous
                .iter()
                .filter(|c| c.type_ == "Ready")
                .filter_map(|c| serde_json::to_value(c).ok())
                .collect();
            status.insert("conditions".into(), Json::Array(kept));
            Json::Object(status)
        }
    };
    // A held condition keeps the generation it was first set at while it holds.
    let since = match ready {
        None => previous
            .iter()
            .find(|c| c.type_ == type_ && c.reason == state.reason)
            .and_then(|c| c.observed_generation)
            .or(generation),
        Some(_) => generation,
    };
    let held = crate::render::status::next_condition(&previous, type_, state, since, &now);
    if let Some(list) = desired.get_mut("conditions").and_then(Json::as_array_mut) {
        list.push(serde_json::to_value(held).unwrap_or(Json::Null));
    }
    if crate::render::status::status_matches(live.get("status"), &desired) {
        return Ok(());
    }
    apply_status(ctx, parent, uid, desired, written.is_some()).await
}

/// One server-side apply of the parent's status subresource; the write is remembered
/// until the parent watch has delivered it.
async fn apply_status(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: String,
    desired: Json,
    after_own_write: bool,
) -> Result<(), ReconcileError> {
    debug!(
        parent = %parent.name_any(),
        cached_rv = parent.resource_version().unwrap_or_default(),
        after_own_write,
        "writing status"
    );
    let body = json!({
        "apiVersion": ctx.parent.ar.api_version,
        "kind": ctx.parent.ar.kind,
        "metadata": {"name": parent.name_any()},
        "status": desired,
    });
    let api = ctx.parent_api(parent);
    match ctx
        .writer
        .apply_status(&api, &parent.name_any(), &body)
        .await
    {
        Ok(applied) => {
            let st = applied.status;
            let meta = applied.metadata.into_meta();
            if desired.get(STATUS_RULE_VERSION).is_some()
                && st.get(STATUS_RULE_VERSION).is_none()
                && ctx.records_version.swap(false, Ordering::Relaxed)
            {
                // The parent's schema prunes it (a CRD that is not, or not yet,
                // Rulebook's): recording it would write the status at every reconcile.
                warn!(rule = %ctx.rule.name, "the parent kind's status schema has no ruleVersion; the rule version is not recorded on parents");
            }
            if let Some(rv) = meta
                .resource_version
                .as_deref()
                .and_then(|v| v.parse::<u64>().ok())
            {
                ctx.status_writes
                    .record(uid, rv, super::memo::identity_of(&meta), &st);
            }
            Ok(())
        }
        Err(WriteError::NotLeader) => Err(ReconcileError::NotLeader),
        Err(WriteError::Api(e)) if is_not_found(&e) => Ok(()), // the parent is gone
        Err(WriteError::Api(e)) => Err(ReconcileError::Status(e)),
    }
}

/// The current time as the API server writes it in conditions.
pub fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parent_at(rv: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "x/v1", "kind": "P",
            "metadata": {"name": "p", "uid": "u1", "resourceVersion": rv},
            "status": {"phase": "cached"}
        }))
        .unwrap()
    }

    /// A deletion is reported once, and so is a new listing of the parents (after which
    /// the rule forgets parents the listing no longer has: their deletion may have been
    /// missed).
    #[test]
    fn deletions_and_listings_are_reported_once() {
        use kube::runtime::watcher::Event;
        let w = StatusWrites::default();
        assert!(!w.take_relisted());
        w.observe(&Event::Delete(parent_at("5")));
        w.observe(&Event::Init);
        w.observe(&Event::InitApply(parent_at("6")));
        assert!(!w.take_relisted(), "not before the listing is complete");
        w.observe(&Event::InitDone);
        assert_eq!(w.take_gone(), ["u1"]);
        assert!(w.take_gone().is_empty());
        assert!(w.take_relisted());
        assert!(!w.take_relisted());
    }

    #[test]
    fn a_status_write_stands_for_the_parent_only_as_it_was_rendered() {
        let at = |rv: &str, generation: i64| -> DynamicObject {
            serde_json::from_value(json!({
                "apiVersion": "x/v1", "kind": "P",
                "metadata": {"name": "p", "uid": "u1", "resourceVersion": rv,
                             "generation": generation}
            }))
            .unwrap()
        };
        let w = StatusWrites::default();
        // The write left generation 1 at resourceVersion 10.
        w.record(
            "u1".into(),
            10,
            crate::reconcile::memo::identity(&at("10", 1)),
            &json!({}),
        );
        // The cached parent (generation 1, before the write): the write is what is known.
        assert_eq!(w.latest_rv("u1", &at("8", 1)), Some(10));
        // Someone changed the spec before the write landed: the write does not stand for
        // that change; the cached version does.
        assert_eq!(w.latest_rv("u1", &at("9", 2)), Some(9));
        // A write without identity (a kind without generation) never stands in.
        w.record("u1".into(), 12, None, &json!({}));
        assert_eq!(w.latest_rv("u1", &at("8", 1)), Some(8));
    }

    #[test]
    fn a_status_write_counts_until_the_cache_has_caught_up() {
        use kube::runtime::watcher::Event;
        let w = StatusWrites::default();
        w.record("u1".into(), 10, None, &json!({"phase": "written"}));
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
    fn writes_the_cache_has_are_swept_on_the_way_of_any_read() {
        let w = StatusWrites::default();
        w.record("u1".into(), 10, None, &json!({}));
        w.record("u2".into(), 10, None, &json!({}));
        {
            let mut t = lock(&w.written);
            let long_ago = Instant::now()
                .checked_sub(STATUS_WRITE_KEEP + Duration::from_secs(1))
                .unwrap();
            t.map.values_mut().for_each(|w| w.at = long_ago);
            t.map.get_mut("u1").unwrap().seen = true;
            // Not yet due: nothing goes.
            t.swept = Some(Instant::now());
        }
        assert_eq!(w.latest_rv("u3", &parent_at("1")), Some(1));
        assert_eq!(w.len(), 2);
        lock(&w.written).swept = Instant::now().checked_sub(SWEEP_EVERY);
        // A reconcile's read sweeps: the write the cache has goes, the one it has not stays.
        assert_eq!(w.latest_rv("u3", &parent_at("1")), Some(1));
        assert_eq!(w.len(), 1);
        assert!(w.newer_than("u2", &parent_at("9")).is_some());
    }
}
