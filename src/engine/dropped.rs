//! Children of kinds a rule no longer has: the new controller does not watch them, so
//! its pruning cannot see them. Kinds are compared by API group and kind — a child that
//! moves to another version of its kind is the same object — and only objects that are
//! verifiably a parent's of this rule are deleted, through the gated writer.

use std::sync::Arc;

use kube::api::{Api, ApiResource, DynamicObject};
use kube::core::discovery::Scope as KubeScope;
use kube::{Client, ResourceExt};
use tracing::{info, warn};

use super::runner::discover;
use crate::meta::{labels, split_api_version};
use crate::metrics::{self, Metrics};
use crate::reconcile::WriteGate;
use crate::reconcile::writer::{Deleted, WriteError, Writer};
use crate::render::CompiledRule;

/// `(apiVersion, kind)` of children the old version of a rule had and the new one has not,
/// compared by API group and kind: a child that moves to another version of its kind
/// (`autoscaling/v2` → `autoscaling/v1`, a CRD's `v1alpha1` → `v1`) is the same object
/// served at another version, and the new controller watches and keeps it.
pub(super) fn dropped_kinds(old: &CompiledRule, new: &CompiledRule) -> Vec<(String, String)> {
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
pub(super) async fn prune_dropped_kinds(
    client: Client,
    rule: Arc<CompiledRule>,
    kinds: Vec<(String, String)>,
    namespace: Option<String>,
    metrics: Arc<Metrics>,
    gate: Arc<dyn WriteGate>,
    share: Option<crate::shard::Ranges>,
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
        // Sharded: only the children in this replica's namespaces.
        let mine = |o: &&kube::api::DynamicObject| {
            share.as_ref().is_none_or(|r| {
                o.metadata
                    .namespace
                    .as_deref()
                    .is_none_or(|ns| r.holds_namespace(ns))
            })
        };
        for o in list
            .items
            .iter()
            .filter(|o| child_of_rule(o, &rule))
            .filter(mine)
        {
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
