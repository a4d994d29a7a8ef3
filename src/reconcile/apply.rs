//! One desired child in the plan and execute stages of a reconcile (`apply_stage.rs` runs
//! the applies): found in the cache (a GET for one cached without content) and planned
//! ([`super::plan::plan_child`]) before anything is written ([`prepare`]), then, when the
//! plan says so and the stage lets it, applied with one server-side apply ([`carry_out`]).
//! A child no cache holds is created with an apply the API server refuses if the name is
//! taken (it may belong to a foreign object); only then is it read and planned again.
//! Drift repairs pass the fight check first.

use std::sync::Arc;
use std::time::Instant;

use kube::api::{Api, DynamicObject};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use serde_json::Value as Json;
use tracing::{debug, info, warn};

use super::context::{ChildKind, RuleContext};
use super::drift::{Drift, fields_cover};
use super::error::ReconcileError;
use super::events::{Change, other_managers};
use super::memory;
use super::plan::{Adoption, ChildStep, Live, conflict_message, is_child_at, plan_child};
use crate::cache;
use crate::cache::wire::is_stub;
use crate::meta::FIELD_MANAGER;
use crate::meta::JsonAt;
use crate::metrics;
use crate::render::DesiredChild;
use crate::write::writer::{Created, WriteError};

/// Where a desired child lives: its API, its cache key, and how messages name it.
pub(super) struct Target<'a> {
    pub kind: &'a ChildKind,
    pub api: Api<DynamicObject>,
    pub oref: ObjectRef<DynamicObject>,
    pub name: String,
    pub what: String,
}

pub(super) fn target<'a>(
    ctx: &'a RuleContext,
    namespace: Option<&str>,
    d: &DesiredChild,
) -> Target<'a> {
    let kind = ctx.kind_of(d.child);
    let name = d.object_name().to_string();
    let ns = if kind.namespaced {
        d.object
            .at(&["metadata", "namespace"])
            .and_then(Json::as_str)
            .or(namespace)
    } else {
        None
    };
    let what = match ns {
        Some(ns) => format!("{} {ns}/{name}", d.kind()),
        None => format!("{} {name}", d.kind()),
    };
    let api = kind.api(&ctx.client, ns);
    let mut oref = ObjectRef::new_with(&name, kind.ar.clone());
    if let Some(ns) = ns {
        oref = oref.within(ns);
    }
    Target {
        kind,
        api,
        oref,
        name,
        what,
    }
}

/// What a GET found for a desired child that the cache holds without content (over the
/// cache budget); `None` for every other child.
pub(super) type Lookup = Option<Result<Option<DynamicObject>, kube::Error>>;

/// GETs the desired children the cache holds without content, a few at a time, in rule
/// order (one round trip of reads, not one per child). A child the cache does not hold
/// at all is not read: its apply is a create that the API server refuses if the name is
/// taken ([`crate::write::writer::Writer::create`]), and only then is it read.
pub(super) async fn look_up_uncached(
    ctx: &RuleContext,
    namespace: Option<&str>,
    desired: &[DesiredChild],
) -> Vec<Lookup> {
    use futures::StreamExt;
    let lookups: Vec<_> = desired.iter().map(|d| look_up(ctx, namespace, d)).collect();
    futures::stream::iter(lookups).buffered(8).collect().await
}

async fn look_up(ctx: &RuleContext, namespace: Option<&str>, d: &DesiredChild) -> Lookup {
    let t = target(ctx, namespace, d);
    match t.kind.store.is_stub(&t.oref) {
        Some(true) => Some(t.api.get_opt(&t.name).await),
        _ => None,
    }
}

/// What a reconcile found under a desired child's name, owned.
enum Found {
    Absent,
    Cached(Arc<DynamicObject>),
    Fetched(Box<DynamicObject>),
}

impl Found {
    fn live(&self) -> Live<'_> {
        match self {
            Found::Absent => Live::Absent,
            Found::Cached(o) => Live::Cached(o),
            Found::Fetched(o) => Live::Fetched(o),
        }
    }

    fn object(&self) -> Option<&DynamicObject> {
        match self {
            Found::Absent => None,
            Found::Cached(o) => Some(&**o),
            Found::Fetched(o) => Some(o),
        }
    }
}

/// A desired child as the caches (or a read) show it, before anything is written.
pub(super) enum Prepared<'a> {
    /// Applied (or created) by this process moments ago; the cache still has the older
    /// version (or none). The status would be computed from that: the reconcile leaves it
    /// to the next, which the object's watch event brings.
    Pending,
    Planned(Box<Planned<'a>>),
}

/// A desired child with its plan.
pub(super) struct Planned<'a> {
    t: Target<'a>,
    found: Found,
    /// The reconcile observed (and rendered with) the object.
    seen: bool,
    pub step: ChildStep,
}

/// Finds and plans one desired child, writing nothing. `lookup` is what
/// [`look_up_uncached`] found for it; `seen` the child as the reconcile observed it, if
/// it did (reused while the cache still holds that version).
pub(super) fn prepare<'a>(
    ctx: &'a RuleContext,
    uid: &str,
    namespace: Option<&str>,
    d: &DesiredChild,
    lookup: Lookup,
    seen: Option<&Arc<DynamicObject>>,
) -> Result<Prepared<'a>, ReconcileError> {
    let t = target(ctx, namespace, d);
    // The version the reconcile read its children as, if the cache still holds it (no
    // second unpacking); else what the cache holds now.
    let still_seen = seen.filter(|o| {
        let m = &o.metadata;
        match (m.uid.as_deref(), m.resource_version.as_deref()) {
            (Some(uid), Some(rv)) => t.kind.store.holds(&t.oref, uid, rv),
            _ => false,
        }
    });
    let cached = match still_seen {
        Some(o) => Some(o.clone()),
        None => t.kind.store.get(&t.oref),
    }
    .filter(|o| !is_stub(o));
    let fetched = match (&cached, lookup) {
        (None, Some(found)) => found.map_err(|source| ReconcileError::Read {
            what: t.what.clone(),
            source,
        })?,
        _ => None,
    };
    let found = match (cached, fetched) {
        (Some(o), _) => Found::Cached(o),
        (None, Some(o)) => Found::Fetched(Box::new(o)),
        (None, None) => Found::Absent,
    };
    match &found {
        Found::Cached(o) => {
            ctx.memory.child_cached(|| created_key(ctx, d, &t));
            if ctx.memory.applied_ahead_of(o, &d.hash) {
                // Applied by this process already; the cache has not caught up yet. Its
                // watch event reconciles the parent again, with the object as applied.
                return Ok(Prepared::Pending);
            }
        }
        // Created by this process moments ago; the cache has not seen it yet. Its watch
        // event reconciles the parent again, with the object in the cache.
        Found::Absent
            if ctx
                .memory
                .created_on_its_way(&created_key(ctx, d, &t), Instant::now()) =>
        {
            return Ok(Prepared::Pending);
        }
        _ => {}
    }
    let step = plan_found(ctx, uid, d, &found, seen.is_some());
    Ok(Prepared::Planned(Box::new(Planned {
        t,
        found,
        seen: seen.is_some(),
        step,
    })))
}

fn plan_found(
    ctx: &RuleContext,
    uid: &str,
    d: &DesiredChild,
    found: &Found,
    seen: bool,
) -> ChildStep {
    // Only another rule of the set's: a rule takes over what a rule no longer in the set
    // left (a renamed rule's children), as its kind's only rule or among several.
    if let Some(other) = found
        .object()
        .filter(|o| is_child_at(o, uid, super::plan::remote_home(d)))
        .and_then(|o| super::plan::other_rules_child(o, &ctx.rule.name))
        .filter(|other| ctx.rule.peers.iter().any(|p| p == other))
    {
        return ChildStep::Conflict {
            owner: format!("rule '{other}', of the same parent"),
        };
    }
    let live_uid = found.object().and_then(|o| o.uid()).unwrap_or_default();
    let hash_only = ctx.memory.checked_by_hash_only(&live_uid);
    let adoption = Adoption::of(
        &ctx.rule.children()[d.child],
        ctx.kind_of(d.child).namespaced,
    );
    plan_child(uid, adoption.allowed(), found.live(), seen, d, hash_only)
}

/// Carries out the plan of one desired child: a write for an `Apply` step (a create for
/// a child no cache holds: refused when the name is taken, and then the object is read
/// and planned again), a report for the status, or the failure its plan is.
pub(super) async fn carry_out(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    d: &DesiredChild,
    planned: Planned<'_>,
) -> Result<ChildOutcome, ReconcileError> {
    let refusal = match settle(ctx, parent, uid, d, &planned).await? {
        Settled::Done(outcome) => return Ok(outcome),
        Settled::Taken(refusal) => refusal,
    };
    // The name is taken though no cache holds it (a foreign object, or one of ours the
    // cache has not seen yet): read it and plan again.
    let t = planned.t;
    let found = t
        .api
        .get_opt(&t.name)
        .await
        .map_err(|source| ReconcileError::Read {
            what: t.what.clone(),
            source,
        })?;
    let Some(found) = found else {
        // Nothing there: gone again already, or the 409 was about something else. Either
        // way the create failed; the parent says so and retries.
        return Err(ReconcileError::Apply {
            what: t.what.clone(),
            source: refusal,
        });
    };
    let found = Found::Fetched(Box::new(found));
    let step = plan_found(ctx, uid, d, &found, planned.seen);
    let again = Planned {
        t,
        found,
        seen: planned.seen,
        step,
    };
    match settle(ctx, parent, uid, d, &again).await? {
        Settled::Done(outcome) => Ok(outcome),
        // Unreachable: a fetched object is never created.
        Settled::Taken(refusal) => Err(ReconcileError::Apply {
            what: again.t.what.clone(),
            source: refusal,
        }),
    }
}

fn created_key(ctx: &RuleContext, d: &DesiredChild, t: &Target<'_>) -> String {
    memory::Created::key(
        ctx.kind_of_child[d.child],
        t.oref.namespace.as_deref(),
        &t.name,
    )
}

/// What [`settle`] came to.
enum Settled {
    Done(ChildOutcome),
    /// The child looked absent, and its create was refused with 409 (the name is taken):
    /// nothing written.
    Taken(kube::Error),
}

/// The failure of a child whose name belongs to an object this parent does not control.
fn conflict(ctx: &RuleContext, d: &DesiredChild, what: &str, owner: &str) -> ReconcileError {
    let adoption = Adoption::of(
        &ctx.rule.children()[d.child],
        ctx.kind_of(d.child).namespaced,
    );
    ReconcileError::Conflict(conflict_message(what, owner, adoption, &d.name))
}

/// The failure of a child whose live content cannot be read.
fn unreadable(what: &str) -> ReconcileError {
    ReconcileError::InvalidChild(format!(
        "{what} cannot be read: its content is nested more deeply than Rulebook reads ({} levels)",
        cache::MAX_DEPTH
    ))
}

/// Carries out one planned step.
async fn settle(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    d: &DesiredChild,
    planned: &Planned<'_>,
) -> Result<Settled, ReconcileError> {
    let t = &planned.t;
    let what = &t.what;
    let live_object = planned.found.object();
    let live_uid = live_object.and_then(|o| o.uid()).unwrap_or_default();
    let why = match &planned.step {
        ChildStep::UpToDate { report } => {
            // If it came from a GET, or reached the cache after this reconcile read the
            // parent's children, the status must see it all the same.
            return Ok(Settled::Done(match (*report, live_object) {
                (true, Some(o)) => ChildOutcome::Changed(Box::new(Change {
                    reason: "Fetched",
                    what: what.clone(),
                    related: o.object_ref(&t.kind.ar),
                    object: cache::to_json(o),
                    cached_as: Some((ctx.kind_of_child[d.child], o.uid(), o.resource_version())),
                })),
                _ => ChildOutcome::UpToDate,
            }));
        }
        ChildStep::Conflict { owner } => return Err(conflict(ctx, d, what, owner)),
        ChildStep::Unreadable => return Err(unreadable(what)),
        ChildStep::Apply { why, .. } => why.clone(),
    };

    if why == Drift::FieldsChanged {
        // Someone else keeps changing fields Rulebook manages: repair, but not in a hot loop.
        let by = || {
            live_object
                .and_then(cache::to_json_with_managed_fields)
                .as_ref()
                .map(other_managers)
                .unwrap_or_default()
        };
        ctx.memory
            .before_repair(&live_uid, what, by, &ctx.backoff, Instant::now())?;
    }
    write(ctx, parent, uid, d, t, live_object, why).await
}

/// Writes one desired child planned as `why`: creates it (`live_object` is `None`) or
/// applies it to the live object, and records the write.
async fn write(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    d: &DesiredChild,
    t: &Target<'_>,
    live_object: Option<&DynamicObject>,
    why: Drift,
) -> Result<Settled, ReconcileError> {
    let what = &t.what;
    // The write carries the ownership check to the API server: a create is refused if
    // the name is taken; an update, if the name now belongs to another object than the
    // one planned against (or to none).
    let written = match (
        live_object,
        live_object.and_then(|o| o.metadata.uid.as_deref()),
    ) {
        (None, _) => match ctx.writer.create(&t.api, &t.name, &d.object).await {
            Ok(Created::Created(o)) => {
                ctx.memory.created(created_key(ctx, d, t), Instant::now());
                Ok(*o)
            }
            Ok(Created::Refused(e)) => return Ok(Settled::Taken(e)),
            Err(e) => Err(e),
        },
        (Some(_), Some(live_uid)) => {
            ctx.writer
                .apply_to(&t.api, &t.name, &d.object, live_uid)
                .await
        }
        (Some(_), None) => {
            return Err(ReconcileError::InvalidChild(format!(
                "{what} has no uid: Rulebook cannot tell whose it is"
            )));
        }
    };
    let mut applied = match written {
        Ok(o) => o,
        Err(WriteError::NotLeader) => return Err(ReconcileError::NotLeader),
        Err(WriteError::Api(e)) => {
            return Err(ReconcileError::Apply {
                what: what.clone(),
                source: e,
            });
        }
    };
    ctx.memory.applied(&applied, &d.hash);
    if !ctx.rule.depends_on_own_writes()
        && let (Some(child), Some(rv)) = (applied.uid(), applied.resource_version())
        && let Ok(rv) = rv.parse()
    {
        // The watch event this write brings needs no reconcile (`Steady::await_write`).
        ctx.memory
            .await_write(uid, parent.metadata.namespace.as_deref(), &child, rv);
    }
    ctx.metrics
        .children_applied
        .get_or_create(&metrics::rule(&ctx.rule.name))
        .inc();
    if !fields_cover(&applied, &d.object, FIELD_MANAGER)
        && let Some(u) = applied.uid()
    {
        // The API server recorded the fields differently than the check reads them:
        // rely on the hash alone for this object rather than re-applying forever.
        warn!(child = %what, "managed fields do not mirror the desired object; checking it by hash only (hand edits of it will not be reverted)");
        ctx.memory.check_by_hash_only(u);
    }
    let (reason, verb) = match why {
        Drift::Missing => ("Created", "created"),
        Drift::DesiredChanged => ("Updated", "updated"),
        Drift::FieldsChanged => ("Repaired", "repaired (fields changed by someone else)"),
    };
    // Creations and updates are Events on the parent (one per kind of change) and in the
    // audit log; a log line each would be the busiest thing an operator writes.
    if why == Drift::FieldsChanged {
        info!(rule = %ctx.rule.name, parent = %parent.name_any(), child = %what, "{verb}");
    } else {
        debug!(rule = %ctx.rule.name, parent = %parent.name_any(), child = %what, "{verb}");
    }
    if !t.kind.content_read {
        // Nothing reads it: the status sees the child as the cache holds it.
        cache::without_content(&mut applied);
    }
    Ok(Settled::Done(ChildOutcome::Changed(Box::new(Change {
        reason,
        what: what.clone(),
        related: applied.object_ref(&t.kind.ar),
        cached_as: Some((
            ctx.kind_of_child[d.child],
            applied.uid(),
            applied.resource_version(),
        )),
        object: cache::into_json(applied),
    }))))
}

/// What became of one desired child.
pub(super) enum ChildOutcome {
    /// Written (or read from the API server, for the status to see).
    Changed(Box<Change>),
    UpToDate,
}
