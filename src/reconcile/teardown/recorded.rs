//! The kinds of a parent's `Orphan` children, recorded on the parent itself
//! (`rulebook.dev/orphan-kinds`). A child's policy travels on the child, but a child of a
//! kind the rule no longer has is in no cache: the clean-up of a dropped kind
//! (`engine::dropped`) finds it only while the process that saw the edit runs. Cut short
//! — a restart, a lost lease, an edit made while no operator ran — nothing would look
//! for it again, and the garbage collector would delete it with its parent whatever its
//! policy. The parent's record says where to look, from any process, at any time.
//!
//! The record is written with the finalizer, before any `Orphan` child exists, and a kind
//! the rule drops stays on it, keeping the finalizer. Only the teardown (and the release
//! of a removed rule's parents, `engine::released`) looks for the children of such a
//! kind, lets go of them, and then takes the kind off the record.
//!
//! The record is the tenant's to edit like any annotation on its object, so it is
//! trusted no further than the parent's own children: only objects whose controller
//! reference is this parent and which recorded `Orphan` themselves are touched, and only
//! let go of, never deleted. A kind the API server does not serve (at any version of its
//! group) has no objects and is done at once; one Rulebook may not list (its RBAC dropped
//! with the rule) is not, and the parent's deletion waits, saying why.

use std::collections::BTreeSet;

use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::core::GroupVersionKind;
use kube::core::discovery::Scope;
use kube::discovery::pinned_kind;
use kube::{Resource, ResourceExt};

use super::super::context::RuleContext;
use super::super::error::ReconcileError;
use super::super::events::Change;
use super::super::prune::{deletion_policy, orphan_patch};
use super::places::Places;
use crate::cache::wire::orphan_owner;
use crate::meta::{is_dns_label, labels, split_api_version};
use crate::rules::DeletionPolicy;
use crate::write::writer::{Patched, WriteError, Writer};

/// `(apiVersion, kind)` of a child.
pub type Kind = (String, String);

/// Entries of a record read at most: it is the tenant's to write.
const MAX_RECORDED: usize = 32;
/// Objects a page lists at most: anyone may put Rulebook's labels on objects of any size.
const PAGE: u32 = 25;

/// The kinds recorded on `parent` ([`recorded_in`]).
pub(super) fn recorded(parent: &DynamicObject) -> Vec<Kind> {
    recorded_in(parent.annotations())
}

/// The kinds recorded in a parent's `annotations`, as far as they are well formed:
/// `apiVersion/Kind`, separated by commas, at most [`MAX_RECORDED`] of them.
pub fn recorded_in(annotations: &std::collections::BTreeMap<String, String>) -> Vec<Kind> {
    let Some(value) = annotations.get(labels::ORPHAN_KINDS) else {
        return Vec::new();
    };
    let mut kinds: Vec<Kind> = Vec::new();
    for kind in value.split(',').filter_map(|e| parse(e.trim())) {
        if kinds.len() == MAX_RECORDED {
            break;
        }
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    kinds
}

fn parse(entry: &str) -> Option<Kind> {
    let (api_version, kind) = entry.rsplit_once('/')?;
    let (group, version) = split_api_version(api_version);
    let group_ok = group.is_empty() || (group.len() <= 253 && group.split('.').all(is_dns_label));
    let kind_ok = !kind.is_empty()
        && kind.len() <= 63
        && kind.starts_with(|c: char| c.is_ascii_uppercase())
        && kind.chars().all(|c| c.is_ascii_alphanumeric());
    (group_ok && is_dns_label(version) && kind_ok).then(|| (api_version.into(), kind.into()))
}

/// `(group, kind)` of every child of the rule.
fn group_kinds(ctx: &RuleContext) -> BTreeSet<(&str, &str)> {
    ctx.rule
        .children()
        .iter()
        .map(|c| {
            (
                split_api_version(&c.api_version.value).0,
                c.kind.value.as_str(),
            )
        })
        .collect()
}

/// The recorded kinds of `parent` the rule has no child of (compared by group and kind:
/// a child that moves to another version of its kind is cached and seen as before).
pub(super) fn pending(ctx: &RuleContext, parent: &DynamicObject) -> Vec<Kind> {
    let kept = group_kinds(ctx);
    recorded(parent)
        .into_iter()
        .filter(|(av, k)| !kept.contains(&(split_api_version(av).0, k.as_str())))
        .collect()
}

/// The record a parent should carry: the kinds of the rule's `Orphan` children and the
/// kinds still `pending`, sorted; `None` when there are none.
pub(super) fn record(ctx: &RuleContext, pending: &[Kind]) -> Option<String> {
    let kinds: BTreeSet<String> = ctx
        .rule
        .children()
        .iter()
        .filter(|c| c.deletion_policy == DeletionPolicy::Orphan)
        .map(|c| format!("{}/{}", c.api_version.value, c.kind.value))
        .chain(pending.iter().map(|(av, k)| format!("{av}/{k}")))
        .collect();
    (!kinds.is_empty()).then(|| kinds.into_iter().collect::<Vec<_>>().join(","))
}

/// A parent whose `Orphan` children are looked for, and the writer that lets go of them.
pub struct OrphansOf<'a> {
    pub client: &'a kube::Client,
    pub writer: &'a Writer,
    /// The parent kind's API group and kind, and whether it is namespaced.
    pub group: &'a str,
    pub kind: &'a str,
    pub namespaced: bool,
    pub name: &'a str,
    pub namespace: Option<&'a str>,
    /// The namespaces a parent recorded ([`super::places`]; a namespaced parent's own
    /// among them): its namespaced children are looked for there only. `None`:
    /// everywhere (a namespaced parent: its own namespace).
    pub namespaces: Option<&'a BTreeSet<String>>,
    pub uid: &'a str,
    /// Children labelled with this rule are not looked at: they are the rule's own, which
    /// its caches show and its teardown handles as the rule says now.
    pub skip_rule: Option<&'a str>,
    /// Whether the rule as it is now says `Orphan` for an object that recorded it (by
    /// its child's name and kind, as pruning reads it); `None`: the record alone decides.
    pub rule_policy: Option<&'a RulePolicy<'a>>,
}

/// [`OrphansOf::rule_policy`].
pub type RulePolicy<'a> = dyn Fn(&DynamicObject) -> bool + Send + Sync + 'a;

impl<'a> OrphansOf<'a> {
    pub(super) fn of(
        ctx: &'a RuleContext,
        parent: &'a DynamicObject,
        places: &'a Places,
        uid: &'a str,
    ) -> Self {
        OrphansOf {
            client: &ctx.client,
            writer: &ctx.writer,
            group: &ctx.parent.ar.group,
            kind: &ctx.parent.ar.kind,
            namespaced: ctx.parent.namespaced,
            name: parent.meta().name.as_deref().unwrap_or_default(),
            namespace: parent.meta().namespace.as_deref(),
            namespaces: places.namespaces(),
            uid,
            skip_rule: None,
            rule_policy: None,
        }
    }
}

/// One child let go of.
pub struct Orphaned {
    /// `Kind namespace/name`, for messages.
    pub what: String,
    pub related: k8s_openapi::api::core::v1::ObjectReference,
}

impl Orphaned {
    /// As a change reported on the parent.
    fn change(self) -> Change {
        Change {
            reason: "Orphaned",
            what: self.what,
            related: self.related,
            object: None,
            cached_as: None,
        }
    }
}

/// Lets go of the parent's `Orphan` children of each of `kinds`. Returns the kinds not
/// done yet, each with why, and the children let go of, for the parent's events.
pub(super) async fn let_go_of_kinds(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    kinds: &[Kind],
) -> Result<(Vec<(Kind, ReconcileError)>, Vec<Change>), ReconcileError> {
    let places = Places::for_parent(ctx, parent);
    let of = OrphansOf::of(ctx, parent, &places, uid);
    let mut left = Vec::new();
    let mut changes = Vec::new();
    for kind in kinds {
        let mut done = Vec::new();
        let result = orphan_children(&of, kind, &mut done).await;
        changes.extend(done.into_iter().map(Orphaned::change));
        match result {
            Ok(()) => {}
            Err(ReconcileError::NotLeader) => return Err(ReconcileError::NotLeader),
            // The first failure is the parent's to report; the others wait for the next
            // pass rather than cost calls that may fail the same way.
            Err(e) => {
                left.push((kind.clone(), e));
                break;
            }
        }
    }
    Ok((left, changes))
}

/// Lets go of the parent's `Orphan` children of the rule's own kinds that another rule
/// made: the rule was renamed, or replaced by another rule for this parent kind (there is
/// at most one; the old rule's release is skipped while a rule for the kind runs). The
/// rule's caches select by its own name and never show them, so neither its prune nor
/// its teardown's waves would, and the garbage collector would delete them with the
/// parent. Called only where Rulebook's
/// finalizer is about to come off: one paged list per child kind, once per parent.
/// Returns the children let go of, and the first failure.
pub(super) async fn let_go_of_foreign(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
) -> (Vec<Change>, Result<(), ReconcileError>) {
    let mut done = Vec::new();
    let mut result = Ok(());
    let places = Places::for_parent(ctx, parent);
    for kind in &ctx.kinds {
        // A child the rule still has (same name and kind) goes as the rule says now: one
        // it made `Delete` is not let go of here, and its apply relabels it.
        let says_orphan =
            |o: &DynamicObject| deletion_policy(ctx, kind, o) == DeletionPolicy::Orphan;
        let of = OrphansOf {
            skip_rule: Some(&ctx.rule.name),
            rule_policy: Some(&says_orphan),
            ..OrphansOf::of(ctx, parent, &places, uid)
        };
        result = orphan_children_at(&of, &kind.ar, kind.namespaced, &mut done).await;
        if result.is_err() {
            break;
        }
    }
    (done.into_iter().map(Orphaned::change).collect(), result)
}

/// Lets go of every child of `kind` (`(apiVersion, kind)`) whose controller reference is
/// the parent and which recorded `Orphan`, pushing each onto `done`. `Ok` once none is
/// left: also when the API server does not serve the kind (no object of it exists).
pub async fn orphan_children(
    of: &OrphansOf<'_>,
    (api_version, kind): &Kind,
    done: &mut Vec<Orphaned>,
) -> Result<(), ReconcileError> {
    let (group, version) = split_api_version(api_version);
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let read = |source| ReconcileError::Read {
        what: format!("{kind} children with deletionPolicy Orphan"),
        source,
    };
    let unknown = |e: &kube::Error| {
        matches!(e, kube::Error::Discovery(_)) || matches!(e, kube::Error::Api(s) if s.code == 404)
    };
    let (ar, caps) = match pinned_kind(of.client, &gvk).await {
        Ok(found) => found,
        // Not at the recorded version, which its group may have stopped serving: the
        // same objects may be served at another. Not served at all: none exists.
        Err(e) if unknown(&e) => match kube::discovery::group(of.client, group).await {
            Ok(g) => match g
                .resources_by_stability()
                .into_iter()
                .find(|(ar, _)| ar.kind == *kind)
            {
                Some(found) => found,
                None => return Ok(()),
            },
            Err(e) if unknown(&e) => return Ok(()),
            Err(e) => return Err(read(e)),
        },
        Err(e) => return Err(read(e)),
    };
    orphan_children_at(of, &ar, caps.scope == Scope::Namespaced, done).await
}

/// [`orphan_children`] of a kind already resolved: `ar`, namespaced or not.
async fn orphan_children_at(
    of: &OrphansOf<'_>,
    ar: &ApiResource,
    namespaced: bool,
    done: &mut Vec<Orphaned>,
) -> Result<(), ReconcileError> {
    let apis: Vec<Api<DynamicObject>> = match (of.namespaced, of.namespace, of.namespaces) {
        // A namespaced parent owns nothing cluster-scoped, and nothing outside its own
        // namespace but where it recorded placing children (`targetNamespaces`).
        (true, _, _) if !namespaced => return Ok(()),
        (true, Some(ns), None) => vec![Api::namespaced_with(of.client.clone(), ns, ar)],
        // A parent that may place children elsewhere: where it recorded placing them.
        (_, _, Some(set)) if namespaced => set
            .iter()
            .map(|ns| Api::namespaced_with(of.client.clone(), ns, ar))
            .collect(),
        _ => vec![Api::all_with(of.client.clone(), ar)],
    };
    let mut not_done = None;
    for api in apis {
        if let Some(what) = orphan_children_in(of, ar, namespaced, &api, done).await? {
            not_done.get_or_insert(what);
        }
    }
    match not_done {
        None => Ok(()),
        Some(what) => Err(ReconcileError::Conflict(format!(
            "{what} kept changing while it was let go of"
        ))),
    }
}

/// [`orphan_children_at`] where `api` lists. `Some`: one that kept changing.
async fn orphan_children_in(
    of: &OrphansOf<'_>,
    ar: &ApiResource,
    namespaced: bool,
    api: &Api<DynamicObject>,
    done: &mut Vec<Orphaned>,
) -> Result<Option<String>, ReconcileError> {
    let read = |source| ReconcileError::Read {
        what: format!("{} children with deletionPolicy Orphan", ar.kind),
        source,
    };
    // Rulebook's mark and the parent's UID, not the rule's name: a parent's children are
    // its own whatever rule made them (`rulebook release` may not know the rule).
    let mut selector = format!(
        "{}={},{}={}",
        labels::MANAGED_BY,
        labels::MANAGED_BY_VALUE,
        labels::OWNER,
        of.uid
    );
    if let Some(rule) = of.skip_rule {
        selector += &format!(",{}!={rule}", labels::RULE);
    }
    let mut token: Option<String> = None;
    let mut not_done = None;
    loop {
        let mut params = ListParams::default().labels(&selector).limit(PAGE);
        if let Some(t) = &token {
            params = params.continue_token(t);
        }
        let page = api.list_metadata(&params).await.map_err(read)?;
        for item in page.items {
            let obj = DynamicObject {
                types: None,
                metadata: item.metadata,
                data: serde_json::Value::Null,
            };
            if !owned_orphan(of, &obj) || of.rule_policy.is_some_and(|orphan| !orphan(&obj)) {
                continue; // left to the garbage collector with the parent, as its policy says
            }
            match orphan(of, ar, namespaced, obj).await? {
                Orphaning::Done(o) => done.push(o),
                Orphaning::Nothing => {}
                Orphaning::KeptChanging(what) => {
                    not_done.get_or_insert(what);
                }
            }
        }
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            return Ok(not_done);
        }
    }
}

/// Whether `obj` is a child of this very parent (controller reference by UID, kind and
/// name; or, having none, its owner label) that recorded `Orphan`, and not already being
/// deleted.
fn owned_orphan(of: &OrphansOf<'_>, obj: &DynamicObject) -> bool {
    obj.meta().deletion_timestamp.is_none()
        && of
            .skip_rule
            .is_none_or(|rule| obj.labels().get(labels::RULE).map(String::as_str) != Some(rule))
        && DeletionPolicy::recorded(
            obj.annotations()
                .get(labels::DELETION_POLICY)
                .map(String::as_str),
        ) == DeletionPolicy::Orphan
        && (obj.owner_references().iter().any(|r| {
            r.uid == of.uid
                && r.controller == Some(true)
                && r.kind == of.kind
                && r.name == of.name
                && split_api_version(&r.api_version).0 == of.group
        }) || orphan_owner(&obj.metadata) == Some(of.uid))
}

/// A change after the listing is read again and the patch retried this many times.
const CHANGED_RETRIES: u32 = 3;

/// What [`orphan`] came to.
enum Orphaning {
    Done(Orphaned),
    /// Gone, replaced, or no longer this parent's `Orphan` child: nothing to do.
    Nothing,
    /// It changed under every attempt (`Kind namespace/name`).
    KeptChanging(String),
}

/// Orphans one object, each patch conditional on the resourceVersion read (the listing's,
/// then a fresh read's when it changed meanwhile).
async fn orphan(
    of: &OrphansOf<'_>,
    ar: &ApiResource,
    namespaced: bool,
    mut obj: DynamicObject,
) -> Result<Orphaning, ReconcileError> {
    let name = obj.name_any();
    let ns = obj.namespace().filter(|_| namespaced);
    let (api, what) = match &ns {
        Some(ns) => (
            Api::namespaced_with(of.client.clone(), ns, ar),
            format!("{} {ns}/{name}", ar.kind),
        ),
        None => (
            Api::all_with(of.client.clone(), ar),
            format!("{} {name}", ar.kind),
        ),
    };
    for _ in 0..=CHANGED_RETRIES {
        match of
            .writer
            .merge_patch(&api, &name, &orphan_patch(&obj, of.uid))
            .await
        {
            Ok(Patched::Patched) => {
                tracing::info!(child = %what, "orphaned: its deletionPolicy is Orphan");
                return Ok(Orphaning::Done(Orphaned {
                    related: obj.object_ref(ar),
                    what,
                }));
            }
            Ok(Patched::Stale) => {}
            Err(WriteError::NotLeader) => return Err(ReconcileError::NotLeader),
            Err(WriteError::Api(source)) => return Err(ReconcileError::Prune { what, source }),
        }
        let fresh = api
            .get_metadata_opt(&name)
            .await
            .map_err(|source| ReconcileError::Read {
                what: what.clone(),
                source,
            })?;
        match fresh {
            Some(m) if m.metadata.uid == obj.metadata.uid => {
                obj.metadata = m.metadata;
                if !owned_orphan(of, &obj) {
                    return Ok(Orphaning::Nothing);
                }
            }
            _ => return Ok(Orphaning::Nothing),
        }
    }
    Ok(Orphaning::KeptChanging(what))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parent_with(record: &str) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "example.com/v1", "kind": "P",
            "metadata": {"name": "p", "annotations": {labels::ORPHAN_KINDS: record}},
        }))
        .unwrap()
    }

    #[test]
    fn a_record_is_read_as_far_as_it_is_well_formed() {
        let kinds = recorded(&parent_with(
            "v1/PersistentVolumeClaim, apps/v1/StatefulSet,example.com/v1alpha1/Db",
        ));
        assert_eq!(
            kinds,
            vec![
                ("v1".into(), "PersistentVolumeClaim".into()),
                ("apps/v1".into(), "StatefulSet".into()),
                ("example.com/v1alpha1".into(), "Db".into()),
            ]
        );
        for bad in [
            "PersistentVolumeClaim",
            "v1/",
            "/Secret",
            "V1/Secret",
            "v1/secret",
            "a/b/c/Secret",
            "Example.com/v1/Db",
            "example.com/v1/Db-x",
            "example..com/v1/Db",
        ] {
            assert_eq!(recorded(&parent_with(bad)), vec![], "{bad}");
        }
        let many = (0..100)
            .map(|i| format!("example.com/v1/K{i}"))
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(recorded(&parent_with(&many)).len(), MAX_RECORDED);
        let twice = "v1/Secret,v1/Secret, v1/Secret,apps/v1/Deployment";
        assert_eq!(recorded(&parent_with(twice)).len(), 2, "each kind once");
    }
}
