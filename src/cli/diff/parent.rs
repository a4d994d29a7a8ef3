//! One parent of `rulebook diff`: its references read (after the base-branch check), a
//! render against its live children, each rendered child compared with what a dry-run
//! apply would leave, the live children it no longer renders, and its status as the
//! operator would write it — a conflict included, with the operator's reason and
//! message. Every Secret value read or rendered on the way is noted in `seen`, for the
//! output's cleaning ([`super::clean`]).

use std::collections::BTreeSet;

use kube::api::{DynamicObject, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::Value as Json;

use super::clean::secret_values;
use super::compare::{Sides, normalize, redact, status_diff};
use super::{Kinds, NotCompared, ObjectChange, display, refs, typed};
use crate::engine::kind_api;
use crate::meta::{FIELD_MANAGER, labels};
use crate::reconcile::ReconcileError;
use crate::reconcile::plan::{
    Adoption, conflict_message, is_child_at, may_adopt, owner_description, remote_home,
};
use crate::render::{CompiledRule, DesiredChild, Observed, RenderError, Rendered, Scope};
use crate::rules::DeletionPolicy;
use crate::write::writer::apply_body;

/// What one parent would see.
pub(super) struct ParentDiff {
    pub parent: String,
    pub unchanged: usize,
    pub annotations_only: usize,
    pub objects: Vec<ObjectChange>,
    pub not_compared: Vec<NotCompared>,
    pub status: Option<Sides>,
    pub error: Option<String>,
    /// Every Secret value read or rendered for this parent.
    pub seen: BTreeSet<String>,
}

/// A live child of the rule: its kind's index in [`Kinds::children`], and the object.
type Live = (usize, DynamicObject);

pub(super) async fn diff_parent(
    client: &Client,
    rule: &CompiledRule,
    kinds: &Kinds,
    parent: &DynamicObject,
    live: &[Live],
) -> ParentDiff {
    let ns = parent.namespace();
    let mut d = ParentDiff {
        parent: display(&kinds.parent.0.kind, ns.as_deref(), &parent.name_any()),
        unchanged: 0,
        annotations_only: 0,
        objects: Vec::new(),
        not_compared: Vec::new(),
        status: None,
        error: None,
        seen: BTreeSet::new(),
    };
    if parent.metadata.deletion_timestamp.is_some() {
        return d; // the operator renders nothing for a parent being deleted
    }
    // With its apiVersion and kind (list items of built-in kinds come without them).
    let Some(parent_json) = typed(parent, &kinds.parent.0) else {
        d.error = Some("the parent cannot be read".into());
        return d;
    };
    // A parent may itself be a Secret.
    d.seen.extend(secret_values(std::iter::once(&parent_json)));
    let (mut observed, desired, live) =
        match observe_and_render(client, rule, kinds, &parent_json, live).await {
            Ok(r) => r,
            Err(e) => {
                d.error = Some(e);
                return d;
            }
        };
    d.seen.extend(secret_values(observed.objects()));
    let Rendered { desired, held } = match desired {
        Ok(rendered) => rendered,
        Err(e) => {
            d.error = Some(e.to_string());
            return d;
        }
    };
    d.seen
        .extend(secret_values(desired.iter().map(|c| &c.object)));
    let uid = parent.uid().unwrap_or_default();
    let scene = Scene {
        client,
        rule,
        kinds,
        uid: &uid,
    };
    let (failure, wanted) = match compare_children(
        &scene,
        &desired,
        ns.as_deref(),
        &live,
        &mut observed,
        &mut d,
    )
    .await
    {
        Ok(r) => r,
        Err(e) => {
            d.error = Some(e);
            return d;
        }
    };
    prunes(rule, kinds, &live, &wanted, &held, &mut d);
    // As the operator writes it: the rule's fields, and a conflict's condition instead of
    // the readiness when there is one.
    let condition = failure
        .as_ref()
        .map(|m| ReconcileError::Conflict(m.clone()).condition());
    match status_diff(
        rule,
        &parent_json,
        &observed,
        &desired,
        &d.parent,
        condition.as_ref(),
    ) {
        Ok(s) => d.status = s,
        Err(e) => d.error = Some(e),
    }
    if let Some(c) = condition {
        d.error
            .get_or_insert(format!("{}: {}", c.reason, c.message));
    }
    d
}

/// Each rendered child compared ([`compare_child`]); a Secret child not compared joins
/// `observed` as the status would see it. The first conflict's message, and where each
/// child goes.
async fn compare_children(
    scene: &Scene<'_>,
    desired: &[DesiredChild],
    ns: Option<&str>,
    live: &[&Live],
    observed: &mut Observed,
    d: &mut ParentDiff,
) -> Result<(Option<String>, BTreeSet<Placed>), String> {
    let mut failure: Option<String> = None;
    let mut wanted = BTreeSet::new();
    for child in desired {
        let at = placed(scene.kinds, child, ns);
        wanted.insert(at.clone());
        let step = compare_child(scene, child, &at, live, d).await;
        let (k, child_ns, name) = at;
        match step {
            Ok(ChildOutcome::Done) => {}
            Ok(ChildOutcome::NotCompared(why)) => {
                d.not_compared.push(NotCompared {
                    parent: d.parent.clone(),
                    kind: scene.kinds.children[k].0.kind.clone(),
                    namespace: child_ns,
                    name,
                    why,
                });
                // The status sees the children as the reconcile would leave them: this
                // one applied, its values unknown.
                observed
                    .children
                    .entry(child.name.clone())
                    .or_default()
                    .push(stand_in(&child.object));
            }
            // Like the operator: a conflict stops only its own child.
            Ok(ChildOutcome::Conflict(message)) => {
                failure.get_or_insert(message);
            }
            Err(e) => return Err(e),
        }
    }
    Ok((failure, wanted))
}

/// A Secret child as the status sees it when it was not read: as rendered, without values.
fn stand_in(object: &Json) -> Json {
    let mut o = object.clone();
    if let Some(map) = o.as_object_mut() {
        map.remove("data");
        map.remove("stringData");
    }
    o
}

/// The parent's references read, and a render against its live children as the operator
/// reads them: a namespaced parent's only in its namespace (an object elsewhere claiming
/// its UID is someone else's) and, with the rule's `targetNamespaces`, the namespaces its
/// render places children in; a cluster-scoped parent's only in the latter.
async fn observe_and_render<'a>(
    client: &Client,
    rule: &CompiledRule,
    kinds: &Kinds,
    parent: &Json,
    live: &'a [Live],
) -> Result<(Observed, Result<Rendered, RenderError>, Vec<&'a Live>), String> {
    let ns = parent
        .pointer("/metadata/namespace")
        .and_then(Json::as_str)
        .map(str::to_string);
    // Children outside one namespace: a cluster-scoped parent's, or a namespaced one's
    // with the rule's `targetNamespaces` (its own namespace besides).
    let spreads = !kinds.parent.1 || rule.rule.spec.target_namespaces.is_some();
    // Elsewhere than a namespaced parent's own namespace, only a child placed there by
    // the parent counts: its claim names the parent's namespace, within the rule's list.
    let targets = rule.rule.spec.target_namespaces.as_deref();
    let uid = parent
        .pointer("/metadata/uid")
        .and_then(Json::as_str)
        .unwrap_or_default();
    let counts = |k: usize, o: &DynamicObject| match (kinds.parent.1, ns.as_deref()) {
        _ if !kinds.children[k].1 => true,
        (false, _) => true,
        (true, home) if o.namespace().as_deref() == home => true,
        (true, Some(home)) => {
            targets.is_some()
                && o.namespace()
                    .is_some_and(|n| crate::render::targets::allowed(targets, &n))
                && crate::reconcile::context::claims_from(&o.metadata, uid, home)
        }
        (true, None) => false,
    };
    let mut live: Vec<&Live> = live.iter().filter(|(k, o)| counts(*k, o)).collect();
    let scope = |i: usize| match kinds.of_child.get(i).map(|k| kinds.children[*k].1) {
        Some(false) => Scope::Cluster,
        _ => Scope::Namespaced,
    };
    let found = refs::dereference(client, rule, kinds, parent).await?;
    // A child of a kind this run does not read (a Secret the diff role may not list) is
    // taken as the reconcile would leave it, rendered: what waits for it (`waitFor`, or a
    // read of `children.X`) is rendered too, rather than held as if it were gone.
    let render = |live: &[&Live]| {
        let objects = live
            .iter()
            .filter_map(|(k, o)| typed(o, &kinds.children[*k].0));
        let mut observed = Observed::from_objects(objects);
        observed.refs = found.clone();
        let mut rendered =
            rule.render_holding_within(parent, &observed, &scope, &mut rule.budget());
        let unread = stand_ins(kinds, rendered.as_ref().ok(), &observed);
        if !unread.is_empty() {
            for (name, object) in unread {
                observed.children.entry(name).or_default().push(object);
            }
            rendered = rule.render_holding_within(parent, &observed, &scope, &mut rule.budget());
        }
        (observed, rendered)
    };
    let (mut observed, mut desired) = render(&live);
    if spreads && let Ok(rendered) = &desired {
        let places: BTreeSet<String> = rendered
            .desired
            .iter()
            .filter_map(|c| {
                c.object
                    .pointer("/metadata/namespace")
                    .and_then(Json::as_str)
            })
            .map(str::to_string)
            .chain(ns.clone())
            .collect();
        let before = live.len();
        live.retain(|(k, o)| {
            !kinds.children[*k].1 || o.namespace().is_some_and(|n| places.contains(&n))
        });
        if live.len() != before {
            (observed, desired) = render(&live);
        }
    }
    Ok((observed, desired, live))
}

/// The rendered children of a kind this run does not read (`kinds.not_read`) that
/// `observed` lacks, as stand-ins ([`stand_in`]) under their child names.
fn stand_ins(
    kinds: &Kinds,
    rendered: Option<&Rendered>,
    observed: &Observed,
) -> Vec<(String, Json)> {
    let Some(rendered) = rendered else {
        return Vec::new();
    };
    rendered
        .desired
        .iter()
        .filter(|c| {
            kinds
                .of_child
                .get(c.child)
                .is_some_and(|k| kinds.not_read.contains_key(k))
        })
        .filter(|c| observed.children.get(&c.name).is_none_or(Vec::is_empty))
        .map(|c| (c.name.clone(), stand_in(&c.object)))
        .collect()
}

/// Where a rendered child goes: its kind's index, namespace and name.
type Placed = (usize, Option<String>, String);

fn placed(kinds: &Kinds, child: &DesiredChild, parent_ns: Option<&str>) -> Placed {
    let k = kinds.of_child[child.child];
    let namespaced = kinds.children[k].1;
    let child_ns = namespaced
        .then(|| {
            child
                .object
                .pointer("/metadata/namespace")
                .and_then(Json::as_str)
                .or(parent_ns)
                .map(str::to_string)
        })
        .flatten();
    (k, child_ns, child.object_name().to_string())
}

/// What became of one rendered child.
enum ChildOutcome {
    /// Counted as unchanged, or its change added to the parent's objects.
    Done,
    /// Not read, with why.
    NotCompared(String),
    /// Someone else's object has its name: the operator's message.
    Conflict(String),
}

/// What every child of one parent is compared in.
struct Scene<'a> {
    client: &'a Client,
    rule: &'a CompiledRule,
    kinds: &'a Kinds,
    /// The parent's.
    uid: &'a str,
}

/// Compares one rendered child with what a dry-run apply would leave.
async fn compare_child(
    scene: &Scene<'_>,
    child: &DesiredChild,
    (k, child_ns, name): &Placed,
    live: &[&Live],
    d: &mut ParentDiff,
) -> Result<ChildOutcome, String> {
    let Scene {
        client,
        rule,
        kinds,
        uid,
    } = *scene;
    let (k, child_ns, name) = (*k, child_ns.clone(), name.clone());
    let (ar, namespaced) = &kinds.children[k];
    if let Some(why) = kinds.not_read.get(&k) {
        return Ok(ChildOutcome::NotCompared(why.clone()));
    }
    let what = display(&ar.kind, child_ns.as_deref(), &name);
    let api = kind_api(client, ar, *namespaced, child_ns.as_deref());
    let found = live
        .iter()
        .find(|(kk, o)| *kk == k && o.namespace() == child_ns && o.name_any() == name);
    let current = match found {
        Some((_, o)) => Some(o.clone()),
        None => match api.get_opt(&name).await {
            // Someone else's object: the operator leaves it alone (a conflict), unless
            // the child may adopt it.
            Ok(Some(o)) if !is_child_at(&o, uid, remote_home(child)) => {
                let adoption = Adoption::of(&rule.children()[child.child], *namespaced);
                if !may_adopt(adoption.allowed(), &o, uid) {
                    let owner = owner_description(&o);
                    return Ok(ChildOutcome::Conflict(conflict_message(
                        &what,
                        &owner,
                        adoption,
                        &child.name,
                    )));
                }
                Some(o)
            }
            Ok(o) => o,
            Err(e) => return Err(format!("reading {what}: {e}")),
        },
    };
    let params = PatchParams::apply(FIELD_MANAGER).force().dry_run();
    let body = Patch::Apply(apply_body(&child.object));
    let after = match api.patch(&name, &params, &body).await {
        Ok(o) => o,
        Err(kube::Error::Api(e)) if e.code == 403 && kinds.is_secret(k) => {
            return Ok(ChildOutcome::NotCompared(
                "the credential may not dry-run apply Secrets".into(),
            ));
        }
        Err(e) => return Err(format!("dry-run apply of {what}: {e}")),
    };
    let before = current.as_ref().and_then(|o| typed(o, ar));
    let after = serde_json::to_value(&after).ok();
    d.seen
        .extend(secret_values(before.iter().chain(after.iter())));
    let (b, a) = (
        before.as_ref().map(normalize),
        after.as_ref().map(normalize),
    );
    if b.is_some() && b == a {
        d.unchanged += 1;
        if before.as_ref().map(|o| &o["metadata"]["annotations"])
            != after.as_ref().map(|o| &o["metadata"]["annotations"])
        {
            d.annotations_only += 1;
        }
        return Ok(ChildOutcome::Done);
    }
    let (b, a) = redact(b.as_ref(), a.as_ref());
    d.objects.push(ObjectChange {
        parent: d.parent.clone(),
        change: if b.is_some() { "changed" } else { "created" },
        kind: ar.kind.clone(),
        namespace: child_ns,
        name,
        diff: String::new(),
        sides: Sides {
            from: format!("{what} (live)"),
            to: format!("{what} (rendered)"),
            before: b,
            after: a,
        },
    });
    Ok(ChildOutcome::Done)
}

/// Live children no longer rendered: pruned, or orphaned by their policy.
fn prunes(
    rule: &CompiledRule,
    kinds: &Kinds,
    live: &[&Live],
    wanted: &BTreeSet<Placed>,
    held: &[String],
    d: &mut ParentDiff,
) {
    for (k, o) in live.iter().copied() {
        let key = (*k, o.namespace(), o.name_any());
        if wanted.contains(&key) {
            continue;
        }
        // Held as it is while what it waits for is gone: the operator leaves it.
        if o.labels()
            .get(labels::CHILD)
            .is_some_and(|c| held.contains(c))
        {
            d.unchanged += 1;
            continue;
        }
        let orphan = o
            .labels()
            .get(labels::CHILD)
            .and_then(|c| rule.children().iter().find(|x| &x.name.value == c))
            .is_some_and(|c| c.deletion_policy == DeletionPolicy::Orphan);
        let (ar, _) = &kinds.children[*k];
        let json = typed(o, ar).map(|j| normalize(&j));
        let (b, _) = redact(json.as_ref(), None);
        let what = display(&ar.kind, o.namespace().as_deref(), &o.name_any());
        d.objects.push(ObjectChange {
            parent: d.parent.clone(),
            change: if orphan { "orphaned" } else { "pruned" },
            kind: ar.kind.clone(),
            namespace: o.namespace(),
            name: o.name_any(),
            diff: String::new(),
            sides: Sides {
                from: format!("{what} (live)"),
                to: "/dev/null".into(),
                before: b,
                after: None,
            },
        });
    }
}
