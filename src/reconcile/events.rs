//! What a reconcile tells people: Events on the parent (one per kind of change, not one
//! per child; a repeated warning once), and the children as the reconcile left them,
//! for the status it writes next.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use kube::api::DynamicObject;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use serde_json::Value as Json;

use super::context::RuleContext;
use super::memory::digest;
use crate::meta::FIELD_MANAGER;
use crate::meta::JsonAt;
use crate::render::Observed;

/// An event on the parent.
pub(super) fn event(
    ctx: &RuleContext,
    parent: &DynamicObject,
    type_: EventType,
    reason: &str,
    action: &str,
    note: String,
) {
    event_about(ctx, parent, None, type_, reason, action, note)
}

/// An event on the parent; `related` names the child it is about, which also keeps
/// events about different children apart (events are deduplicated by reason and object).
pub(super) fn event_about(
    ctx: &RuleContext,
    parent: &DynamicObject,
    related: Option<k8s_openapi::api::core::v1::ObjectReference>,
    type_: EventType,
    reason: &str,
    action: &str,
    note: String,
) {
    if !ctx.writer.may_write() {
        return; // events are writes too
    }
    // A warning is remembered by a digest of its text (a note may run to kilobytes) and
    // a number of its own, so a send that failed forgets only its own warning, not the
    // same text recorded again since.
    let warned = (type_ == EventType::Warning).then(|| {
        (
            parent.uid().unwrap_or_default(),
            warning_digest(reason, &note),
            WARNINGS.fetch_add(1, Ordering::Relaxed),
        )
    });
    if let Some((key, digest, number)) = &warned
        && !ctx.memory.warn_once(key, *digest, *number)
    {
        return; // the same warning again says nothing new
    }
    let reference = parent.object_ref(&ctx.parent.ar);
    let ev = Event {
        type_,
        reason: reason.to_string(),
        note: Some(crate::meta::truncate(&note, 1000)),
        action: action.to_string(),
        secondary: related,
    };
    // Not sent (the outbox full, or the request failed in a way that may pass next
    // time): the next failure may record it after all.
    let memory = ctx.memory.clone();
    ctx.writer.publish(&ctx.recorder, ev, reference, move || {
        if let Some((key, _, number)) = &warned {
            memory.warning_unsent(key, *number);
        }
    });
}

/// Numbers the warnings recorded (see [`event_about`]).
static WARNINGS: AtomicU64 = AtomicU64::new(0);

/// A warning's reason and note as a 64-bit digest, keyed per process.
fn warning_digest(reason: &str, note: &str) -> u64 {
    static KEY: OnceLock<RandomState> = OnceLock::new();
    KEY.get_or_init(RandomState::new).hash_one((reason, note))
}

/// What one apply or prune did, for the reconcile's events and its status.
pub(super) struct Change {
    /// `Created`, `Updated`, `Repaired` or `Pruned`; `Fetched` for an up-to-date child
    /// that the reconcile's first read of the cache did not include (no event, status only).
    pub reason: &'static str,
    pub what: String,
    pub related: k8s_openapi::api::core::v1::ObjectReference,
    /// The object as the API server returned it (applies only).
    pub object: Option<Json>,
    /// The child as the caches will hold it once this write reaches them: its kind (index
    /// in the rule context), UID and resourceVersion (applies and reads only).
    pub cached_as: Option<digest::ChildKey>,
}

/// [`digest::observed`] of the children as this reconcile left them — `live` (as it read
/// them) less what it pruned or rewrote, plus what it applied — which is what the caches
/// hold once its writes reach them. Call before [`observed_after`] takes the objects.
pub(super) fn children_after(
    live: Vec<digest::ChildKey>,
    changes: &[Change],
    refs: &std::collections::BTreeMap<String, Json>,
) -> u64 {
    let touched: HashSet<&str> = changes
        .iter()
        .filter_map(|c| c.related.uid.as_deref())
        .collect();
    let mut kids: Vec<digest::ChildKey> = live
        .into_iter()
        .filter(|(_, uid, _)| uid.as_deref().is_none_or(|u| !touched.contains(u)))
        .collect();
    kids.extend(changes.iter().filter_map(|c| c.cached_as.clone()));
    digest::observed_of(kids, refs)
}

/// An object's apiVersion, kind, namespace ("" for none) and name.
type ObjectKey = (String, String, String, String);

/// The live children after this reconcile's applies and prunes. The applied objects are
/// taken out of `changes` (the events need only their names), so nothing is copied but an
/// applied object that replaces more than one observed one.
pub(super) fn observed_after(observed: Observed, changes: &mut [Change]) -> Observed {
    // apiVersion, kind, namespace and name: a cluster-scoped parent may have children of
    // one name in several namespaces.
    let key_of = |c: &Change| {
        Some((
            c.related.api_version.clone()?,
            c.related.kind.clone()?,
            c.related.namespace.clone().unwrap_or_default(),
            c.related.name.clone()?,
        ))
    };
    let pruned: HashSet<ObjectKey> = changes
        .iter()
        .filter(|c| c.object.is_none())
        .filter_map(key_of)
        .collect();
    let mut applied: HashMap<ObjectKey, Json> = HashMap::new();
    for c in changes.iter_mut() {
        if let Some(key) = key_of(c)
            && let Some(object) = c.object.take()
        {
            applied.insert(key, object);
        }
    }
    let Observed { children, refs } = observed;
    let mut objects: Vec<Json> = Vec::new();
    let mut seen = HashSet::new();
    for o in children.into_values().flatten() {
        let key = (
            o["apiVersion"].as_str().unwrap_or("").to_string(),
            o["kind"].as_str().unwrap_or("").to_string(),
            o["metadata"]["namespace"]
                .as_str()
                .unwrap_or("")
                .to_string(),
            o["metadata"]["name"].as_str().unwrap_or("").to_string(),
        );
        if pruned.contains(&key) {
            continue;
        }
        objects.push(applied.get(&key).cloned().unwrap_or(o));
        seen.insert(key);
    }
    objects.extend(
        applied
            .into_iter()
            .filter(|(key, _)| !seen.contains(key))
            .map(|(_, fresh)| fresh),
    );
    let mut after = Observed::from_objects(objects);
    after.refs = refs;
    after
}

/// What brought a reconcile's changes, as far as their Events go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cause {
    /// The parent, a child or a referenced object (or nothing known): every change is
    /// reported on the parent.
    Inputs,
    /// Only the rule changed ([`super::status::rule_rollout_only`]): its `Updated`
    /// children are not ([`super::plan::reported_on_parent`]).
    RuleRollout,
}

/// One Normal event per kind of change in a reconcile (not one per child: events are
/// writes too), naming every child it concerns.
pub(super) fn report_changes(
    ctx: &RuleContext,
    parent: &DynamicObject,
    changes: &[Change],
    cause: Cause,
) {
    for reason in ["Created", "Updated", "Repaired", "Pruned", "Orphaned"] {
        if !super::plan::reported_on_parent(reason, cause == Cause::RuleRollout) {
            continue;
        }
        let these: Vec<&Change> = changes.iter().filter(|c| c.reason == reason).collect();
        let Some(first) = these.first() else { continue };
        let verb = match reason {
            "Created" => "created",
            "Updated" => "updated",
            "Repaired" => "repaired (fields changed by someone else)",
            "Pruned" => "pruned (no longer rendered)",
            _ => "orphaned (deletionPolicy: Orphan): left in place without owner",
        };
        let list: Vec<&str> = these.iter().map(|c| c.what.as_str()).collect();
        let action = match reason {
            "Pruned" => "Prune",
            "Orphaned" => "Orphan",
            _ => "Apply",
        };
        event_about(
            ctx,
            parent,
            (these.len() == 1).then(|| first.related.clone()),
            EventType::Normal,
            reason,
            action,
            format!("{}: {verb}", list.join(", ")),
        );
    }
}

/// Managers other than Rulebook that hold fields of the object, most recent first.
pub(super) fn other_managers(live: &Json) -> String {
    let mut names: Vec<(String, String)> = live
        .at(&["metadata", "managedFields"])
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn other_managers_are_named_newest_first() {
        let live = json!({"metadata": {"managedFields": [
            {"manager": "rulebook", "operation": "Apply", "time": "2026-01-01T00:00:03Z"},
            {"manager": "kubectl-edit", "operation": "Update", "time": "2026-01-01T00:00:02Z"},
        ]}});
        assert_eq!(other_managers(&live), "field manager kubectl-edit");
        assert_eq!(other_managers(&json!({})), "another client");
    }

    fn object(kind: &str, name: &str, uid: &str, rv: &str) -> std::sync::Arc<DynamicObject> {
        std::sync::Arc::new(
            serde_json::from_value(json!({"apiVersion": "v1", "kind": kind,
                "metadata": {"name": name, "namespace": "n", "uid": uid, "resourceVersion": rv}}))
            .unwrap(),
        )
    }

    fn change(kind: Option<usize>, o: &DynamicObject, applied: bool) -> Change {
        let ar = kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&());
        Change {
            reason: if applied { "Updated" } else { "Pruned" },
            what: String::new(),
            related: o.object_ref(&ar),
            object: applied.then(|| json!({})),
            cached_as: kind.map(|k| (k, o.uid(), o.resource_version())),
        }
    }

    #[test]
    fn the_children_after_a_reconcile_are_those_the_caches_catch_up_to() {
        let refs = std::collections::BTreeMap::new();
        let before = vec![
            (0, object("ConfigMap", "a", "u1", "1")),
            (1, object("Service", "b", "u2", "1")),
            (2, object("Secret", "c", "u3", "1")),
        ];
        // b updated (same UID, new version), c pruned, d created.
        let b = object("Service", "b", "u2", "5");
        let d = object("Secret", "d", "u4", "7");
        let changes = vec![
            change(Some(1), &b, true),
            change(None, &before[2].1, false),
            change(Some(2), &d, true),
        ];
        let after = children_after(digest::keys(&before), &changes, &refs);
        let caught_up = vec![(0, before[0].1.clone()), (1, b.clone()), (2, d.clone())];
        assert_eq!(after, digest::observed(&caught_up, &refs));
        // A cache still behind on any of them differs.
        for behind in [
            vec![
                (0, before[0].1.clone()),
                (1, before[1].1.clone()),
                (2, d.clone()),
            ],
            vec![(0, before[0].1.clone()), (1, b.clone())],
            vec![
                (0, before[0].1.clone()),
                (1, b.clone()),
                (2, d),
                (2, before[2].1.clone()),
            ],
        ] {
            assert_ne!(after, digest::observed(&behind, &refs));
        }
        // Nothing changed: the children as read.
        assert_eq!(
            children_after(digest::keys(&before), &[], &refs),
            digest::observed(&before, &refs)
        );
    }
}
