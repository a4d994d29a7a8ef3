//! Where a parent's teardown looks for its children. A namespaced parent's children are
//! in its namespace. A cluster-scoped parent's namespaced children may be in any
//! namespace, so an object anywhere could claim to be one: its labels and ownerReference
//! are written by whoever may edit objects there. A reconcile counts only children in
//! the namespaces the parent's render places children in (`observe.rs`); the teardown
//! renders nothing, so the parent records those namespaces
//! (`rulebook.dev/child-namespaces`), written before any child is applied in a namespace
//! not recorded yet, and kept while a child it placed is still there. The teardown
//! deletes, waits for and lets go of children in those namespaces only; an object
//! elsewhere that claims the parent is never touched (the garbage collector, following
//! its ownerReference, deals with it once the parent is gone).
//!
//! The record is written only on parents with Rulebook's finalizer (no teardown runs for
//! the others). Like every annotation it is the parent's editor's to change: the
//! teardown trusts it no further than the parent's own children, and an editor who adds
//! a namespace only reaches objects there that claim this very parent. A parent without
//! a record — made by an older Rulebook and deleted before it was reconciled again —
//! is torn down as before, in every namespace.

use std::collections::BTreeSet;

use kube::ResourceExt;
use kube::api::DynamicObject;
use serde_json::json;

use super::super::context::RuleContext;
use super::super::error::ReconcileError;
use super::has_finalizer;
use crate::meta::{JsonAt, is_dns_label, labels};
use crate::render::{DesiredChild, RenderError};
use crate::write::writer::Patched;

/// Namespaces a record holds at most (a namespace name is at most 63 bytes: 64 KiB,
/// a quarter of what all of an object's annotations may hold).
pub const MAX_NAMESPACES: usize = 1000;

/// Where a parent's teardown looks for namespaced children.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Places {
    /// Anywhere the parent could own one: its own namespace (a namespaced parent), or
    /// every namespace (a cluster-scoped parent with no record).
    Anywhere,
    /// The namespaces a cluster-scoped parent recorded.
    Only(BTreeSet<String>),
}

impl Places {
    /// Where `parent` places its children; `confined`: in its own namespace only (a
    /// namespaced parent of a rule without `targetNamespaces`). A cluster-scoped parent:
    /// the namespaces it recorded, or anywhere without a record.
    pub fn of(confined: bool, parent: &DynamicObject) -> Places {
        if confined {
            return Places::Anywhere;
        }
        match recorded_in(parent.annotations()) {
            Some(set) => Places::Only(set),
            None => Places::Anywhere,
        }
    }

    /// Where the parent of `ctx`'s rule places its children: [`of`](Self::of), but a
    /// namespaced parent of a rule with `targetNamespaces` holds its own namespace and
    /// those of its record the rule's list allows — its author's annotation never
    /// reaches further, and without a record it holds its own namespace alone.
    pub fn for_parent(ctx: &RuleContext, parent: &DynamicObject) -> Places {
        let home = parent.namespace();
        if !ctx.parent.namespaced || !ctx.spreads() {
            return Places::of(!ctx.spreads(), parent);
        }
        let mut set: BTreeSet<String> = recorded_in(parent.annotations())
            .unwrap_or_default()
            .into_iter()
            .filter(|ns| ctx.may_place_in(home.as_deref(), ns))
            .collect();
        set.extend(home);
        Places::Only(set)
    }

    /// Whether an object in `namespace` (`None`: cluster-scoped) may be one of the
    /// parent's children.
    pub fn holds(&self, namespace: Option<&str>) -> bool {
        match (self, namespace) {
            (Places::Anywhere, _) | (_, None) => true,
            (Places::Only(set), Some(ns)) => set.contains(ns),
        }
    }

    /// The namespaces to look in for a namespaced kind; `None`: all of them (or, for a
    /// namespaced parent, its own).
    pub fn namespaces(&self) -> Option<&BTreeSet<String>> {
        match self {
            Places::Anywhere => None,
            Places::Only(set) => Some(set),
        }
    }
}

/// The namespaces recorded in a parent's `annotations`, as far as they are well formed
/// (at most [`MAX_NAMESPACES`]); `None` without a record.
pub fn recorded_in(
    annotations: &std::collections::BTreeMap<String, String>,
) -> Option<BTreeSet<String>> {
    let value = annotations.get(labels::CHILD_NAMESPACES)?;
    Some(
        value
            .split(',')
            .map(str::trim)
            .filter(|ns| is_dns_label(ns))
            .take(MAX_NAMESPACES)
            .map(String::from)
            .collect(),
    )
}

/// The record a cluster-scoped parent should carry: the namespaces `desired` places
/// namespaced children in, and those of `recorded` where a child it `owns` still is
/// (placed there by an earlier render: the reconcile leaves it, the teardown deletes it).
pub fn wanted<'a>(
    recorded: Option<&BTreeSet<String>>,
    desired: impl IntoIterator<Item = &'a str>,
    owns: impl IntoIterator<Item = &'a str>,
) -> BTreeSet<String> {
    let mut want: BTreeSet<String> = desired.into_iter().map(String::from).collect();
    if let Some(recorded) = recorded {
        want.extend(
            owns.into_iter()
                .filter(|ns| recorded.contains(*ns))
                .map(String::from),
        );
    }
    want
}

/// What [`record`] did.
pub enum Recorded {
    /// Nothing to write (a namespaced parent, one without the finalizer, or the record
    /// holds what it should).
    Same,
    /// The record was written; the reconcile goes on.
    Written,
    /// The parent changed since it was read: nothing may be applied before it is looked
    /// at again.
    Stale,
    /// The render places children in more namespaces than a record holds.
    TooMany(RenderError),
}

/// Before a reconcile applies `desired`: records on a cluster-scoped parent with the
/// finalizer the namespaces its children go to (one conditional patch, only when the
/// record changes).
pub(in crate::reconcile) async fn record(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    desired: &[DesiredChild],
) -> Result<Recorded, ReconcileError> {
    // The finalizer may have come with this very reconcile (`keep_finalizer`), on a
    // parent read before it.
    if !ctx.spreads() || !(has_finalizer(parent) || ctx.needs_finalizer()) {
        return Ok(Recorded::Same);
    }
    let recorded = recorded_in(parent.annotations());
    let placed = desired
        .iter()
        .filter(|d| ctx.kind_of(d.child).namespaced)
        .filter_map(|d| d.object.at(&["metadata", "namespace"])?.as_str());
    let home = parent.namespace();
    let owned = ctx.owned_children(uid, home.as_deref());
    let owns = owned
        .iter()
        .filter(|(k, _)| ctx.kinds[*k].namespaced)
        .filter_map(|(_, o)| o.metadata.namespace.as_deref());
    // A namespaced parent keeps where its children are, as far as the rule's list
    // allows: its author cannot take a namespace out of the record while a child is
    // still there (the children it owns there are within the list already).
    let kept = ctx.parent.namespaced.then(|| {
        owned
            .iter()
            .filter_map(|(_, o)| o.metadata.namespace.clone())
            .collect::<BTreeSet<String>>()
    });
    let want = wanted(kept.as_ref().or(recorded.as_ref()), placed, owns);
    if recorded.as_ref() == Some(&want) {
        return Ok(Recorded::Same);
    }
    if want.len() > MAX_NAMESPACES {
        return Ok(Recorded::TooMany(RenderError::budget(
            ctx.rule.file.clone(),
            None,
            format!(
                "rule '{}': the parent's children are in {} namespaces, more than the {MAX_NAMESPACES} its teardown can record; nothing is applied",
                ctx.rule.name,
                want.len()
            ),
        )));
    }
    let value = want.into_iter().collect::<Vec<_>>().join(",");
    write(ctx, parent, &value).await
}

/// Writes `value` as the parent's record, conditional on the resourceVersion read.
async fn write(
    ctx: &RuleContext,
    parent: &DynamicObject,
    value: &str,
) -> Result<Recorded, ReconcileError> {
    let body = json!({"metadata": {
        "resourceVersion": parent.resource_version(),
        "annotations": {labels::CHILD_NAMESPACES: value},
    }});
    let api = ctx.parent_api(parent);
    Ok(
        match super::patch_parent(ctx, &api, parent, &body, labels::CHILD_NAMESPACES).await? {
            Patched::Patched => Recorded::Written,
            Patched::Stale => Recorded::Stale,
        },
    )
}

/// Before the teardown creates its finalize child in `namespace`: the record names it
/// (one conditional patch when it does not yet). `false`: the parent changed, or was
/// patched; look again.
pub(super) async fn record_finalize_child(
    ctx: &RuleContext,
    parent: &DynamicObject,
    namespace: Option<&str>,
) -> Result<bool, ReconcileError> {
    let places = Places::for_parent(ctx, parent);
    let (Places::Only(set), Some(ns)) = (&places, namespace) else {
        return Ok(true);
    };
    if set.contains(ns) {
        return Ok(true);
    }
    let mut set = set.clone();
    set.insert(ns.to_string());
    let value = set.into_iter().collect::<Vec<_>>().join(",");
    write(ctx, parent, &value).await?;
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parent(record: Option<&str>) -> DynamicObject {
        let mut p = json!({"apiVersion": "x.com/v1", "kind": "T", "metadata": {"name": "t"}});
        if let Some(r) = record {
            p["metadata"]["annotations"] = json!({labels::CHILD_NAMESPACES: r});
        }
        serde_json::from_value(p).unwrap()
    }

    #[test]
    fn a_cluster_scoped_parent_is_torn_down_where_it_recorded() {
        let p = parent(Some("team-a, team-c,Bad_Name,,"));
        let places = Places::of(false, &p);
        assert_eq!(
            places,
            Places::Only(["team-a".to_string(), "team-c".to_string()].into())
        );
        assert!(places.holds(Some("team-a")));
        assert!(!places.holds(Some("team-b")), "a lookalike's namespace");
        assert!(places.holds(None), "cluster-scoped children");
        // An empty record: no namespaced child anywhere.
        assert!(!Places::of(false, &parent(Some(""))).holds(Some("team-a")));
        // No record (an older Rulebook's parent), or a namespaced parent: as before.
        assert_eq!(Places::of(false, &parent(None)), Places::Anywhere);
        assert_eq!(Places::of(true, &p), Places::Anywhere);
        let many = (0..2000)
            .map(|i| format!("n{i}"))
            .collect::<Vec<_>>()
            .join(",");
        let Places::Only(set) = Places::of(false, &parent(Some(&many))) else {
            panic!("a record");
        };
        assert_eq!(set.len(), MAX_NAMESPACES);
    }

    #[test]
    fn the_record_keeps_where_children_still_are() {
        let recorded: BTreeSet<String> = ["old".to_string(), "gone".to_string()].into();
        // Rendered now: `new`. A child is still in `old` (placed by an earlier render);
        // none in `gone`; the lookalike in `elsewhere` was never recorded.
        let want = wanted(Some(&recorded), ["new"], ["old", "elsewhere", "new"]);
        assert_eq!(want, ["new".to_string(), "old".to_string()].into());
        // The first record: what the render places, whatever claims the parent.
        assert_eq!(
            wanted(None, ["new"], ["elsewhere"]),
            ["new".to_string()].into()
        );
    }
}
