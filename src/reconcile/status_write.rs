//! Writing the parent's status (the rule evaluates it: `render::status_eval`; the `Ready`
//! model is `render::status`): compared with what the parent has (or with Rulebook's own
//! last write, when the cache has not caught up with it), written with one server-side
//! apply to the status subresource only when it differs.

use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::events::EventType;
use serde_json::{Value as Json, json};
use tracing::{debug, warn};

use super::context::RuleContext;
use super::error::{ReconcileError, is_not_found};
use super::events::event;
use super::plan::plan_status;
use crate::meta::JsonAt;
use crate::meta::STATUS_RULE_VERSION;
use crate::render::status::ConditionState;
use crate::write::writer::WriteError;

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
    if !ctx.rule.role.main {
        return write_own_condition(ctx, parent, parent_json, Some(ready)).await;
    }
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
    let written = ctx.memory.status_written_since(&uid, parent);
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
    let now = now_rfc3339();
    let Some(mut desired) = plan_status(&live_json, &managed, fields, ready, &now) else {
        return Ok(false);
    };
    // Only in a write made anyway: the `Rollout` condition is never a reason to write.
    super::versions::add_rollout_condition(ctx, &live_json, &mut desired, &now);
    apply_status(ctx, parent, uid, desired, written.is_some()).await?;
    Ok(true)
}

/// The one condition a rule that is not its parent kind's main rule writes,
/// `<RuleName>Ready` (`rules::decorators::condition_type`), as `ready` says, or taken
/// away (`None`: the parent left the rule's selector). Applied under the rule's own
/// field manager, so the main rule's status apply and this one never remove each
/// other's conditions; nothing else of the status is written. No write when the parent
/// already says so; none either without a status subresource (said in the docs, not in
/// an event at every reconcile).
pub(super) async fn write_own_condition(
    ctx: &RuleContext,
    parent: &DynamicObject,
    parent_json: &Json,
    ready: Option<&ConditionState>,
) -> Result<bool, ReconcileError> {
    if !ctx.parent.status_subresource {
        return Ok(false);
    }
    let type_ = crate::rules::decorators::condition_type(&ctx.rule.name);
    let uid = parent.uid().unwrap_or_default();
    let written = ctx.memory.status_written_since(&uid, parent);
    let mut live = parent_json.clone();
    if let (Some(w), Some(o)) = (&written, live.as_object_mut()) {
        o.insert("status".into(), w.clone());
    }
    let previous = crate::render::status::conditions_of(&live);
    let desired = match ready {
        Some(ready) => {
            let generation = live.at(&["metadata", "generation"]).and_then(Json::as_i64);
            let now = now_rfc3339();
            let c =
                crate::render::status::next_condition(&previous, &type_, ready, generation, &now);
            let desired = json!({"conditions": [c]});
            if crate::render::status::status_matches(live.get("status"), &desired) {
                return Ok(false);
            }
            desired
        }
        None if previous.iter().any(|c| c.type_ == type_) => json!({}),
        None => return Ok(false),
    };
    let manager = crate::meta::status_manager(&ctx.rule.name);
    apply_status_as(ctx, parent, uid, desired, written.is_some(), &manager).await?;
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
    ctx.memory.records_version()
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
    if !ctx.rule.role.main {
        // Its own condition only: `Ready` and the held condition are the main rule's.
        if let Some(ready) = ready {
            write_own_condition(ctx, parent, parent_json, Some(ready)).await?;
        }
        return Ok(());
    }
    if !ctx.parent.status_subresource {
        return Ok(());
    }
    let uid = parent.uid().unwrap_or_default();
    let written = ctx.memory.status_written_since(&uid, parent);
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
    super::versions::keep_rollout_condition(&live, &mut desired);
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
    let manager = crate::meta::FIELD_MANAGER;
    apply_status_as(ctx, parent, uid, desired, after_own_write, manager).await
}

/// [`apply_status`] under the field manager `manager`.
async fn apply_status_as(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: String,
    desired: Json,
    after_own_write: bool,
    manager: &str,
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
        .apply_status_as(&api, &parent.name_any(), &body, manager)
        .await
    {
        Ok(applied) => {
            let st = applied.status;
            let meta = applied.metadata.into_meta();
            if desired.get(STATUS_RULE_VERSION).is_some()
                && st.get(STATUS_RULE_VERSION).is_none()
                && ctx.memory.stop_recording_version()
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
                ctx.memory.status_written(uid, rv, &meta, &st);
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
