//! Two versions of one rule side by side, during a progressive rollout
//! (docs/reference/rollout.md): the context a reconcile of one parent runs with — the new
//! version's, or the old one's — picked from the rollout state the engine keeps in sync
//! with the cluster, by the pure membership of [`crate::rollout::on_new`]. Both contexts
//! share the caches, the writer and the memory: only the rule differs.
//!
//! A parent whose pick differs from the version its status records is reconciled whole
//! (its steady fingerprint is forgotten: its inputs did not change, the rule did), with
//! an event when it moves or goes back. Its status write (a new `status.ruleVersion`)
//! carries the `Rollout` condition ([`crate::rollout::condition`]); every other status
//! write keeps the one the parent has.

use std::sync::Arc;

use kube::ResourceExt;
use kube::api::DynamicObject;

use serde_json::Value as Json;

use super::context::RuleContext;
pub use super::context::{RolloutView, Versions};
use crate::meta::{JsonAt, STATUS_RULE_VERSION};
use crate::rollout::condition::{TYPE as ROLLOUT_CONDITION, condition};
use crate::rollout::{ParentFacts, RankKey, RolloutState, on_new};

/// Makes `ctx` run beside `old` during the rollout `state`: both contexts see the state
/// (and the new version's number of steps), the pick per parent is [`for_parent`].
pub fn side_by_side(
    ctx: &mut RuleContext,
    mut old: RuleContext,
    state: Arc<parking_lot::RwLock<RolloutState>>,
) {
    let view = RolloutView {
        state: state.clone(),
        steps: ctx
            .rule
            .rule
            .spec
            .rollout
            .as_ref()
            .map_or(1, |r| r.steps.len()),
    };
    old.rollout = Some(view.clone());
    ctx.rollout = Some(view);
    ctx.versions = Some(Versions {
        old: Arc::new(old),
        state,
    });
}

/// Adds the `Rollout` condition to `desired`, a status about to be written anyway (never
/// a reason to write): during a rollout the one [`condition`] gives for the version
/// written, else, and when it has nothing to say, the one `live` (the parent as last
/// written) carries — the apply owns the condition, so leaving it out would remove it.
pub fn add_rollout_condition(ctx: &RuleContext, live: &Json, desired: &mut Json, now: &str) {
    let had = raw_rollout_condition(live);
    let fresh = ctx.rollout.as_ref().and_then(|v| {
        let state = v.state.read();
        let recorded = live
            .at(&["status", STATUS_RULE_VERSION])
            .and_then(Json::as_str);
        condition(&state, v.steps, &ctx.rule.version, recorded, had.is_some())
    });
    let next = match fresh {
        Some(c) => {
            let previous = crate::render::status::conditions_of(live);
            let generation = live.at(&["metadata", "generation"]).and_then(Json::as_i64);
            let next = crate::render::status::next_condition(
                &previous,
                ROLLOUT_CONDITION,
                &c,
                generation,
                now,
            );
            serde_json::to_value(next).ok()
        }
        None => had,
    };
    if let (Some(list), Some(c)) = (
        desired.get_mut("conditions").and_then(Json::as_array_mut),
        next,
    ) {
        list.retain(|x| x.get("type").and_then(Json::as_str) != Some(ROLLOUT_CONDITION));
        list.push(c);
    }
}

/// The `Rollout` condition a parent carries, as it is.
fn raw_rollout_condition(live: &Json) -> Option<Json> {
    live.at(&["status", "conditions"])?
        .as_array()?
        .iter()
        .find(|c| c.get("type").and_then(Json::as_str) == Some(ROLLOUT_CONDITION))
        .cloned()
}

/// Keeps the `Rollout` condition `live` carries in `desired` (a held parent's status:
/// nothing about the rollout changes in it).
pub fn keep_rollout_condition(live: &Json, desired: &mut Json) {
    if let (Some(c), Some(list)) = (
        raw_rollout_condition(live),
        desired.get_mut("conditions").and_then(Json::as_array_mut),
    ) {
        list.push(c);
    }
}

/// The `status.ruleVersion` of a parent as the API server sends it (not the cached,
/// packed form).
pub fn status_version(parent: &DynamicObject) -> Option<&str> {
    parent
        .data
        .get("status")
        .and_then(|s| s.get(STATUS_RULE_VERSION))
        .and_then(|v| v.as_str())
}

/// What is known of `parent` to place it: read from its JSON (the cached form keeps
/// the content packed), and only during a rollout.
fn facts<'a>(
    ctx: &RuleContext,
    parent: &DynamicObject,
    json: &'a serde_json::Value,
) -> ParentFacts<'a> {
    let first = ctx
        .rule
        .rollout
        .as_ref()
        .is_some_and(|p| p.has_order() && p.first(json));
    ParentFacts {
        key: RankKey::of(first, parent.namespace().as_deref(), &parent.name_any()),
        status_version: json
            .get("status")
            .and_then(|s| s.get(STATUS_RULE_VERSION))
            .and_then(|v| v.as_str()),
        created: parent
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_second()),
    }
}

/// The context to reconcile `parent` with: the old version's when the rollout has not
/// moved it (or moved it back), else `ctx` itself.
pub fn for_parent(ctx: &Arc<RuleContext>, parent: &DynamicObject) -> Arc<RuleContext> {
    let Some(v) = &ctx.versions else {
        return ctx.clone();
    };
    let state = v.state.read().clone();
    let json = crate::cache::to_json(parent).unwrap_or_default();
    let facts = facts(ctx, parent, &json);
    let picked = if on_new(&state, &facts) {
        ctx.clone()
    } else {
        v.old.clone()
    };
    let recorded = facts.status_version;
    if recorded.is_some_and(|r| r != picked.rule.version)
        && let Some(uid) = parent.uid()
    {
        // Its inputs did not change, its rule did: a full reconcile.
        picked.memory.forget_steady(&uid);
        let (reason, note) = if Arc::ptr_eq(&picked, ctx) {
            (
                "RolloutMoved",
                format!(
                    "rule version {} (rollout step {})",
                    picked.rule.version, state.step
                ),
            )
        } else {
            (
                "RolloutRolledBack",
                format!("back to rule version {}", picked.rule.version),
            )
        };
        super::events::event(
            &picked,
            parent,
            kube::runtime::events::EventType::Normal,
            reason,
            "Rollout",
            note,
        );
    }
    picked
}
