//! Two versions of one rule side by side, during a progressive rollout
//! (docs/reference/rollout.md): the context a reconcile of one parent runs with — the new
//! version's, or the old one's — picked from the rollout state the engine keeps in sync
//! with the cluster, by the pure membership of [`crate::rollout::on_new`]. Both contexts
//! share the caches, the writer and the memory: only the rule differs.
//!
//! A parent whose pick differs from the version its status records is reconciled whole
//! (its steady fingerprint is forgotten: its inputs did not change, the rule did), with
//! an event when it moves or goes back.

use std::sync::Arc;

use kube::ResourceExt;
use kube::api::DynamicObject;

use super::context::RuleContext;
pub use super::context::Versions;
use crate::meta::STATUS_RULE_VERSION;
use crate::rollout::{ParentFacts, RankKey, on_new};

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
