//! The prunes of a reconcile (its execute stage): delete what this parent owns and no
//! longer renders (and, in a teardown, every child). Only children the parent's caches show as its own (owner
//! label and controller reference both naming its UID — an `Orphan` child has no
//! ownerReference, and recorded its policy instead — in its namespace), each deleted
//! with UID and resourceVersion preconditions, so neither a replacement of the same name
//! nor an object changed since it was read (its controller reference taken back) is
//! touched. A child with `deletionPolicy: Orphan` (in the rule, or recorded on the object
//! for a child the rule no longer has) is let go instead: its controller reference and
//! Rulebook's labels and annotations are removed, conditional on its resourceVersion.

use kube::api::DynamicObject;
use kube::{Resource, ResourceExt};
use serde_json::{Value as Json, json};
use tracing::info;

use super::context::{ChildKind, RuleContext};
use super::error::ReconcileError;
use super::events::Change;
use crate::meta::labels;
use crate::metrics;
use crate::rules::DeletionPolicy;
use crate::write::writer::{Deleted, Patched, WriteError};

/// The rule's child that produced `obj` (by its `rulebook.dev/child` label), with its
/// position in `spec.children`; `None` for a child the rule no longer has.
pub(super) fn child_rule<'a>(
    ctx: &'a RuleContext,
    obj: &DynamicObject,
) -> Option<(usize, &'a crate::rules::ChildRule)> {
    let name = obj.labels().get(labels::CHILD)?;
    ctx.rule
        .children()
        .iter()
        .enumerate()
        .find(|(_, c)| &c.name.value == name)
}

/// What to do with `obj` (of `kind`) when its parent lets go of it: its child's policy in
/// the rule, or, for a child the rule no longer has (no child of that name, or one of
/// another kind), the policy recorded on the object when it was applied
/// (`rulebook.dev/deletion-policy`). The rule as it is now wins over the record.
pub(super) fn deletion_policy(
    ctx: &RuleContext,
    kind: &ChildKind,
    obj: &DynamicObject,
) -> DeletionPolicy {
    let same_kind = |i: usize| {
        ctx.kind_of(i).ar.kind == kind.ar.kind && ctx.kind_of(i).ar.group == kind.ar.group
    };
    match child_rule(ctx, obj) {
        Some((i, c)) if same_kind(i) => c.deletion_policy,
        _ => DeletionPolicy::recorded(
            obj.annotations()
                .get(labels::DELETION_POLICY)
                .map(String::as_str),
        ),
    }
}

/// What letting go of `obj` does: its [`deletion_policy`] — but an object without a
/// controller reference (an `Orphan` child, not applied since its child became `Delete`)
/// is only orphaned: Rulebook deletes only objects whose controller reference is the
/// parent, or (having none) that a namespaced parent placed in another namespace
/// ([`crate::cache::wire::remote_owner`]), which no garbage collector would delete.
pub(super) fn let_go_as(
    ctx: &RuleContext,
    kind: &ChildKind,
    obj: &DynamicObject,
) -> DeletionPolicy {
    if crate::cache::wire::orphan_owner(&obj.metadata).is_some() {
        return DeletionPolicy::Orphan;
    }
    deletion_policy(ctx, kind, obj)
}

/// Lets go of a child the parent no longer wants: deletes it, or orphans it
/// ([`let_go_as`]).
pub(super) async fn leave_child(
    ctx: &RuleContext,
    parent: &DynamicObject,
    kind: &ChildKind,
    obj: &DynamicObject,
) -> Result<Option<Change>, ReconcileError> {
    match let_go_as(ctx, kind, obj) {
        DeletionPolicy::Delete => let_go_of(ctx, parent, kind, obj, true).await,
        DeletionPolicy::Orphan => let_go_of(ctx, parent, kind, obj, false).await,
    }
}

/// The merge patch that orphans `obj` from the parent with UID `parent_uid`: its
/// controller reference to the parent (one an older Rulebook put on an `Orphan` child,
/// or a `Delete` child's) and Rulebook's labels and annotations removed,
/// conditional on the resourceVersion the caller saw.
pub fn orphan_patch(obj: &DynamicObject, parent_uid: &str) -> Json {
    let refs: Vec<_> = obj
        .owner_references()
        .iter()
        .filter(|r| r.uid != parent_uid)
        .cloned()
        .collect();
    let refs = if refs.is_empty() {
        Json::Null
    } else {
        serde_json::to_value(refs).unwrap_or(Json::Null)
    };
    let gone = |keys: &[&str], present: &std::collections::BTreeMap<String, String>| {
        keys.iter()
            .filter(|k| present.contains_key(**k))
            .map(|k| (k.to_string(), Json::Null))
            .collect::<serde_json::Map<_, _>>()
    };
    let label_keys = [
        labels::MANAGED_BY,
        labels::RULE,
        labels::OWNER,
        labels::CHILD,
    ];
    let annotation_keys = [
        labels::DESIRED_HASH,
        labels::RULE_VERSION,
        labels::INDEX,
        labels::DELETION_POLICY,
        labels::PARENT_NAME,
        labels::PARENT_NAMESPACE,
    ];
    json!({"metadata": {
        "resourceVersion": obj.resource_version(),
        "ownerReferences": refs,
        "labels": gone(&label_keys, obj.labels()),
        "annotations": gone(&annotation_keys, obj.annotations()),
    }})
}

/// Lets go of one child: `true` deletes it (UID and resourceVersion preconditions),
/// `false` orphans it (resourceVersion precondition). `None` when there was nothing to
/// do: it is gone, or it changed since it was read and is looked at again on the next
/// pass (the change's watch event brings one).
async fn let_go_of(
    ctx: &RuleContext,
    parent: &DynamicObject,
    kind: &ChildKind,
    obj: &DynamicObject,
    delete: bool,
) -> Result<Option<Change>, ReconcileError> {
    let name = obj.name_any();
    let ns = obj.namespace();
    let what = match &ns {
        Some(ns) => format!("{} {ns}/{name}", kind.ar.kind),
        None => format!("{} {name}", kind.ar.kind),
    };
    let api = kind.api(&ctx.client, ns.as_deref());
    let done = if delete {
        ctx.writer
            .delete(&api, &name, obj.uid(), obj.resource_version())
            .await
            .map(|d| d == Deleted::Deleted)
    } else {
        // A stub keeps only the controller reference and Rulebook's own metadata: the
        // patch is built from the object as the API server holds it, or it would remove
        // every other owner's reference with Rulebook's.
        let fresh;
        let from = if crate::cache::wire::is_stub(obj) {
            match api.get_opt(&name).await {
                Ok(Some(o)) if o.uid() == obj.uid() => {
                    fresh = o;
                    &fresh
                }
                Ok(_) => return Ok(None), // gone, or replaced
                Err(e) => return Err(ReconcileError::Prune { what, source: e }),
            }
        } else {
            obj
        };
        let body = orphan_patch(from, &parent.uid().unwrap_or_default());
        ctx.writer
            .merge_patch(&api, &name, &body)
            .await
            .map(|p| p == Patched::Patched)
    };
    match done {
        Ok(true) => {}
        Ok(false) => return Ok(None),
        Err(WriteError::NotLeader) => return Err(ReconcileError::NotLeader),
        Err(WriteError::Api(e)) => return Err(ReconcileError::Prune { what, source: e }),
    }
    let (reason, verb) = if delete {
        ctx.metrics
            .children_pruned
            .get_or_create(&metrics::rule(&ctx.rule.name))
            .inc();
        ("Pruned", "pruned")
    } else {
        ("Orphaned", "orphaned")
    };
    info!(rule = %ctx.rule.name, parent = %parent.name_any(), child = %what, "{verb}");
    Ok(Some(Change {
        reason,
        what,
        related: obj.object_ref(&kind.ar),
        object: None,
        cached_as: None,
    }))
}
