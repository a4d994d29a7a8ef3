//! Stage 4 of a reconcile: delete what this parent owns and no longer renders. Only
//! children the parent's caches show as its own (owner label and controller reference
//! both naming its UID, in its namespace), each deleted with a UID precondition, so a
//! replacement of the same name is never touched.

use kube::api::DynamicObject;
use kube::{Resource, ResourceExt};
use tracing::info;

use super::context::{ChildKind, RuleContext};
use super::error::ReconcileError;
use super::events::Change;
use super::writer::{Deleted, WriteError};
use crate::metrics;

pub(super) async fn prune_child(
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
    match ctx.writer.delete(&api, &name, obj.uid()).await {
        Ok(Deleted::Deleted) => {}
        Ok(Deleted::Gone) => return Ok(None),
        Err(WriteError::NotLeader) => return Err(ReconcileError::NotLeader),
        Err(WriteError::Api(e)) => return Err(ReconcileError::Prune { what, source: e }),
    }
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
