//! The dereference stage of a reconcile: where the parent's references point, what they
//! select in the caches (nothing is read yet, so a parent whose objects take more than it
//! may read fails before any is), the weight of everything the render will hold acquired
//! from the process's budget of inputs in flight ([`super::inflight`]), and only then the
//! objects read into JSON for the templates. The caches and the index that maps a
//! referenced object's change to its parents are in [`super::refs`].

use std::collections::{BTreeMap, HashMap};
use std::ops::ControlFlow;
use std::sync::Arc;

use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use serde_json::Value as Json;
use tracing::debug;

use super::context::RuleContext;
use super::error::ReconcileError;
use super::events::Cause;
use super::inflight::InputPermit;
use super::memory::digest::{self as memo, ChildKey};
use super::observe::{Live, Observation, skip_if_steady};
use super::offload::{EvalInputs, targets_off_runtime};
use super::outcome::{Outcome, reference_missing, render_failed};
use super::refs::{
    Key, Read, RefKind, cached, cached_bytes, full, known_labels, labels_of, list_selected,
};
use crate::cache::wire::is_stub;
use crate::render::{RefSelect, RefTarget};

/// What the dereference stage hands on: the parent's inputs with its references read.
pub(super) struct Inputs {
    /// The parent's live children.
    pub live: Live,
    /// The parent, its children and references as JSON, and its budget: what the render
    /// and the status evaluation read.
    pub eval: EvalInputs,
    /// The inputs' weight in the process's budget ([`super::inflight`]), held until the
    /// status is evaluated.
    pub permit: InputPermit,
    pub cause: Cause,
    /// The live children as observed, and the fingerprint of them and the references:
    /// what the steady memo keeps of a reconcile that went through.
    pub live_keys: Vec<ChildKey>,
    pub seen: u64,
}

/// The dereference stage: where the references point and what they select, as cached; the weight of
/// the parent, its live children and those objects acquired from the process's budget of
/// inputs in flight (waiting for room, or failing a parent whose inputs weigh more than
/// one reconcile may hold); and only then the objects read into JSON. A required object
/// missing: nothing is applied or pruned. With references, the reconcile stops here when
/// nothing changed since one that had nothing to do.
pub(super) async fn dereference(
    ctx: &RuleContext,
    parent: &DynamicObject,
    uid: &str,
    observation: Observation,
) -> Result<ControlFlow<Outcome, Inputs>, ReconcileError> {
    use ControlFlow::{Break, Continue};
    let Observation {
        live,
        parent_json,
        observed,
        cause,
        awaited,
    } = observation;
    let budget = ctx.rule.budget();
    let mut eval = EvalInputs {
        parent: parent_json,
        observed,
        budget,
    };
    let with_refs = !ctx.rule.rule.spec.references.is_empty();
    let mut selected = None;
    if with_refs {
        if !ctx.references_listed() {
            // A required reference would look missing. Each reference cache's listing
            // reconciles every parent when it completes.
            debug!(rule = %ctx.rule.name, parent = %parent.name_any(), "reference caches not listed yet; deferred");
            return Ok(Break(Outcome::Ends(Ok(Action::await_change()))));
        }
        let targets = targets_off_runtime(ctx, eval).await?;
        eval = targets.inputs;
        let targets = match targets.result {
            Ok(t) => t,
            Err(e) => {
                return Ok(Break(render_failed(
                    ctx,
                    eval.parent,
                    &eval.observed,
                    e,
                    "Render",
                )));
            }
        };
        let key = (parent.namespace(), parent.name_any());
        match select(ctx, &key, targets).await? {
            Selection::Selected(s) => selected = Some(s),
            Selection::Stopped(stop) => return Ok(Break(stopped(ctx, eval, stop))),
        }
    }
    let weight = cached_bytes(parent)
        .saturating_add(live.iter().map(|(_, o)| cached_bytes(o)).sum())
        .saturating_add(selected.as_ref().map_or(0, Selected::weight));
    let permit = match ctx.inputs.acquire(weight).await {
        Ok(p) => p,
        Err(over) => return Ok(Break(stopped(ctx, eval, Stop::TooMany(over.to_string())))),
    };
    if let Some(s) = selected {
        match read(ctx, s).await? {
            Ok(found) => eval.observed.refs = found,
            Err(stop) => return Ok(Break(stopped(ctx, eval, stop))),
        }
    }
    // With references: the steady check of the observe stage, once they are looked up.
    if with_refs && let Some(done) = skip_if_steady(ctx, parent, uid, &live, &eval.observed.refs) {
        ctx.memory.resume(uid, awaited);
        return Ok(Break(Outcome::Ends(Ok(done))));
    }
    drop(awaited);
    let live_keys = memo::keys(&live);
    let seen = memo::observed_of(live_keys.clone(), &eval.observed.refs);
    Ok(Continue(Inputs {
        live,
        eval,
        permit,
        cause,
        live_keys,
        seen,
    }))
}

/// A parent its references stop: `ReferenceMissing`, or `RenderBudgetExceeded`.
fn stopped(ctx: &RuleContext, eval: EvalInputs, stop: Stop) -> Outcome {
    match stop {
        Stop::Missing(message) => reference_missing(eval.parent, message),
        Stop::TooMany(message) => {
            let e = crate::render::RenderError::budget(ctx.rule.file.clone(), None, message);
            render_failed(ctx, eval.parent, &eval.observed, e, "Render")
        }
    }
}

/// Why a parent's references stop its reconcile.
pub(super) enum Stop {
    /// A required object is missing: nothing is applied or pruned.
    Missing(String),
    /// A selector matches more objects than a parent may read (`Limits::max_for_each`),
    /// or the objects take more bytes (`Limits::parent_reference_bytes`).
    TooMany(String),
}

/// What one parent's references select, as the caches hold it: nothing is read into
/// JSON yet, and [`Selected::weight`] says how much the reading may take.
pub(super) struct Selected {
    found: Vec<(RefTarget, Found)>,
    weight: usize,
}

/// What one target selected.
enum Found {
    One(Arc<DynamicObject>),
    /// By a selector, ordered by name.
    Many(Vec<Arc<DynamicObject>>),
    /// An optional object that is not there.
    Absent,
}

impl Selected {
    /// Bytes of the objects selected, as cached (content and metadata); with objects
    /// cached without content among them, what the parent may read in all
    /// ([`crate::render::Limits::parent_reference_bytes`]), as their size is known only
    /// once they are read.
    pub(super) fn weight(&self) -> usize {
        self.weight
    }
}

/// What [`select`] found: the objects, or why the parent stops before reading them.
pub(super) enum Selection {
    Selected(Selected),
    Stopped(Stop),
}

/// Finds what each target selects in its cache (asking the API server only which stubs
/// a selector matches, by their metadata). Targets are tracked first, so an object
/// created meanwhile wakes the parent; a parent deleted while this reconcile ran is
/// forgotten again at once. Objects that take more than the parent may read, as cached,
/// stop the parent here, before any is read.
pub(super) async fn select(
    ctx: &RuleContext,
    parent: &Key,
    targets: Vec<RefTarget>,
) -> Result<Selection, ReconcileError> {
    let spec = &ctx.rule.rule.spec.references;
    for t in &targets {
        if let Some(kind) = ctx.refs.get(t.reference) {
            kind.index.track(parent.clone(), t.clone());
        }
    }
    let mut oref = ObjectRef::new_with(&parent.1, ctx.parent.ar.clone());
    if let Some(ns) = &parent.0 {
        oref = oref.within(ns);
    }
    if ctx.parent_store.get(&oref).is_none() {
        ctx.refs.iter().for_each(|k| k.index.forget(parent));
    }
    let allowed = ctx.rule.limits().parent_reference_bytes;
    let (mut known, mut stubs) = (0usize, false);
    let mut found = Vec::with_capacity(targets.len());
    for t in targets {
        let (Some(kind), Some(r)) = (ctx.refs.get(t.reference), spec.get(t.reference)) else {
            continue;
        };
        let f = match &t.select {
            RefSelect::Name(name) => match cached(kind, &t.namespace, name) {
                Some(o) => Found::One(o),
                None if r.optional => Found::Absent,
                None => return Ok(Selection::Stopped(missing(r, &t))),
            },
            RefSelect::Labels(want) => match by_labels(ctx, kind, &t, want).await? {
                Ok(list) => Found::Many(list),
                Err(too_many) => {
                    return Ok(Selection::Stopped(Stop::TooMany(format!(
                        "refs.{}: {too_many}",
                        r.name.value
                    ))));
                }
            },
        };
        for o in f.objects() {
            if is_stub(o) {
                stubs = true;
            } else {
                known = known.saturating_add(cached_bytes(o));
            }
        }
        if known > allowed {
            return Ok(Selection::Stopped(over(r, allowed)));
        }
        found.push((t, f));
    }
    let weight = if stubs { allowed } else { known };
    Ok(Selection::Selected(Selected { found, weight }))
}

impl Found {
    fn objects(&self) -> impl Iterator<Item = &Arc<DynamicObject>> {
        let (one, many) = match self {
            Found::One(o) => (Some(o), &[][..]),
            Found::Many(list) => (None, list.as_slice()),
            Found::Absent => (None, &[][..]),
        };
        one.into_iter().chain(many)
    }
}

/// The cached objects `t`'s selector `want` matches (stubs whose labels were dropped
/// asked of the API server), ordered by name; `Err` with the message when more match
/// than a parent may read.
async fn by_labels(
    ctx: &RuleContext,
    kind: &RefKind,
    t: &RefTarget,
    want: &BTreeMap<String, String>,
) -> Result<Result<Vec<Arc<DynamicObject>>, String>, ReconcileError> {
    let limit = ctx.rule.limits().max_for_each;
    let mut names = kind.index.members(&t.namespace);
    names.sort();
    let mut selected = Vec::new();
    let mut unknown = HashMap::new();
    for o in names.iter().filter_map(|n| cached(kind, &t.namespace, n)) {
        match known_labels(&o) {
            Some(l) if t.selects_labels(l) => selected.push(o),
            Some(_) => {}
            None => {
                unknown.insert(o.uid().unwrap_or_default(), o);
            }
        }
    }
    if !unknown.is_empty() && selected.len() <= limit {
        let room = limit - selected.len();
        let listed = list_selected(&ctx.client, kind, &t.namespace, want, &unknown, room);
        selected.extend(listed.await?);
    }
    if selected.len() > limit {
        // With stubs among them, counting stopped past the limit.
        let at_least = if unknown.is_empty() { "" } else { "at least " };
        return Ok(Err(format!(
            "{at_least}{} objects match, more than the limit of {limit}",
            selected.len()
        )));
    }
    selected.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    Ok(Ok(selected))
}

/// The `TooMany` of a reference whose objects take more than `allowed` bytes.
fn over(r: &crate::rules::Reference, allowed: usize) -> Stop {
    Stop::TooMany(format!(
        "refs.{}: the objects read take more than {} MiB, the limit per parent",
        r.name.value,
        allowed >> 20
    ))
}

/// `refs.<name>` for the template context (missing optional ones absent).
pub(super) type Refs = BTreeMap<String, Json>;

/// Reads what [`select`] found into JSON for the templates, `refs.<name>` (an object
/// cached without content from the API server), each charged to what the parent may
/// still read before its JSON is built.
pub(super) async fn read(
    ctx: &RuleContext,
    selected: Selected,
) -> Result<Result<Refs, Stop>, ReconcileError> {
    let spec = &ctx.rule.rule.spec.references;
    let allowed = ctx.rule.limits().parent_reference_bytes;
    let mut left = allowed;
    let mut out = BTreeMap::new();
    for (t, f) in selected.found {
        let (Some(kind), Some(r)) = (ctx.refs.get(t.reference), spec.get(t.reference)) else {
            continue;
        };
        match f {
            Found::Absent => {}
            Found::One(o) => match full(&ctx.client, kind, o, &mut left).await? {
                Read::Found(o) => {
                    out.insert(r.name.value.clone(), o);
                }
                Read::Gone if r.optional => {}
                Read::Gone => return Ok(Err(missing(r, &t))),
                Read::Over => return Ok(Err(over(r, allowed))),
            },
            Found::Many(selected) => {
                let mut list = Vec::with_capacity(selected.len());
                for o in selected {
                    let read = is_stub(&o);
                    match full(&ctx.client, kind, o, &mut left).await? {
                        // A stub is read now: it counts if it still matches.
                        Read::Found(o) if !read || t.selects_labels(&labels_of(&o)) => {
                            list.push(o);
                        }
                        Read::Found(_) | Read::Gone => {}
                        Read::Over => return Ok(Err(over(r, allowed))),
                    }
                }
                out.insert(r.name.value.clone(), Json::Array(list));
            }
        }
    }
    Ok(Ok(out))
}

/// The `ReferenceMissing` message: the reference and where it looked, never a value.
fn missing(r: &crate::rules::Reference, t: &RefTarget) -> Stop {
    let narrowed = match &r.watch_selector {
        Some(sel) => format!(
            " (Rulebook sees only objects matching watchSelector '{}')",
            sel.value
        ),
        None => String::new(),
    };
    Stop::Missing(format!(
        "refs.{}: {} not found{narrowed}",
        r.name.value,
        t.describe(&r.kind.value)
    ))
}
