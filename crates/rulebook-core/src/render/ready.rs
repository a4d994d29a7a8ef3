//! Readiness of the live children before rendering: what `waitFor` and the `ready(...)`
//! helper need. A child is ready when it exists and every one of its live objects passes
//! its `readyWhen` (no `readyWhen`: it exists) — the same meaning the parent's `Ready`
//! condition gives it. A reference a child waits for (`waitFor: [refs.<name>]`) is ready
//! when it was found and passes its own `readyWhen`; unlike a sibling, a reference that
//! is not ready holds a live child (not updated, never pruned), so a flapping field
//! cannot prune what was built from it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use minijinja::value::{Value, ValueKind};
use serde_json::Value as Json;

use super::{CompiledRule, Observed, RenderError, labels, val};
use crate::meta::JsonAt;

/// Readiness of each live child object, by `(child name, object name)`.
#[derive(Clone, Debug, Default)]
pub(super) struct LiveReadiness {
    objects: Arc<BTreeMap<(String, String), bool>>,
}

impl LiveReadiness {
    /// Whether child `name` exists and all its live objects are ready.
    pub(super) fn child_ready(&self, name: &str) -> bool {
        let mut any = false;
        for ((child, _), ready) in self.objects.iter() {
            if child == name {
                any = true;
                if !ready {
                    return false;
                }
            }
        }
        any
    }

    /// `ready(x)`: `x` is a live child (`children.db`) or a `forEach` list of them; true
    /// when it is there and ready. Anything else (undefined included) is not ready.
    pub(super) fn function(&self) -> Value {
        let objects = self.objects.clone();
        let one = move |v: &Value| -> bool {
            let child = v
                .get_path_or_default("metadata.labels")
                .get_item(&Value::from(labels::CHILD))
                .ok()
                .and_then(|c| c.as_str().map(str::to_string));
            let name = v
                .get_path_or_default("metadata.name")
                .as_str()
                .map(str::to_string);
            match (child, name) {
                (Some(c), Some(n)) => objects.get(&(c, n)).copied().unwrap_or(false),
                _ => false,
            }
        };
        Value::from_function(move |v: Value| -> bool {
            match v.kind() {
                ValueKind::Seq | ValueKind::Iterable => match v.try_iter() {
                    Ok(items) => {
                        let items: Vec<Value> = items.collect();
                        !items.is_empty() && items.iter().all(&one)
                    }
                    Err(_) => false,
                },
                ValueKind::Map => one(&v),
                _ => false,
            }
        })
    }
}

/// `a.b.c` of a template value, undefined when any step is missing.
trait PathOrDefault {
    fn get_path_or_default(&self, path: &str) -> Value;
}

impl PathOrDefault for Value {
    fn get_path_or_default(&self, path: &str) -> Value {
        let mut v = self.clone();
        for step in path.split('.') {
            v = v.get_attr(step).unwrap_or_default();
        }
        v
    }
}

impl CompiledRule {
    /// Evaluates `readyWhen` for every live child object, with `ctx` (which has no
    /// `ready` yet: `readyWhen` may not call it).
    pub(super) fn live_readiness(
        &self,
        ctx: &BTreeMap<&'static str, Value>,
        observed: &Observed,
    ) -> Result<LiveReadiness, RenderError> {
        let programs = self.running().borrow_dependent();
        let mut objects = BTreeMap::new();
        for (i, c) in self.rule.spec.children.iter().enumerate() {
            let Some(live) = observed.children.get(c.name.as_str()) else {
                continue;
            };
            for (index, o) in live.iter().enumerate() {
                let name = o
                    .at(&["metadata", "name"])
                    .and_then(Json::as_str)
                    .unwrap_or("")
                    .to_string();
                let ready = match &programs.children[i].ready_when {
                    None => true,
                    Some(rw) => {
                        let mut local = ctx.clone();
                        local.insert("child", val(o));
                        if programs.children[i].for_each.is_some() {
                            local.insert("index", Value::from(index));
                        }
                        self.eval(rw, &local)?.is_true()
                    }
                };
                objects.insert((c.name.value.clone(), name), ready);
            }
        }
        Ok(LiveReadiness {
            objects: Arc::new(objects),
        })
    }

    /// What the render does with each child of this parent ([`ChildState`]), decided
    /// in the order of their dependencies (`deps.rs`): a child waiting for one that is
    /// left out is left out too; else its `includeWhen` decides (one that fails while
    /// what it waits for is not there is taken as true: it reads what is not there yet).
    /// The finalize child is [`ChildState::Render`] here: it is rendered apart.
    pub(super) fn child_states(
        &self,
        ctx: &BTreeMap<&'static str, Value>,
        observed: &Observed,
        readiness: &LiveReadiness,
    ) -> Result<Vec<ChildState>, RenderError> {
        let programs = self.running().borrow_dependent();
        let children = &self.rule.spec.children;
        let deps = self.wait_for_positions();
        let finalize = self.rule.spec.finalize_child();
        let live = |j: usize| {
            observed
                .children
                .get(children[j].name.as_str())
                .is_some_and(|l| !l.is_empty())
        };
        let refs_pending = self.refs_not_ready(ctx, observed)?;
        let mut states = vec![ChildState::Render; children.len()];
        for i in super::deps::order(&deps) {
            if finalize == Some(i) {
                continue;
            }
            if deps[i].iter().any(|&j| states[j] == ChildState::LeftOut) {
                states[i] = ChildState::LeftOut;
                continue;
            }
            let is_live = live(i);
            let pending: Vec<String> = deps[i]
                .iter()
                .filter(|&&j| {
                    if is_live {
                        !live(j)
                    } else {
                        !readiness.child_ready(children[j].name.as_str())
                    }
                })
                .map(|&j| children[j].name.value.clone())
                .chain(
                    self.ref_waits[i]
                        .iter()
                        .filter(|&&j| refs_pending.get(j).copied().unwrap_or(true))
                        .map(|&j| format!("refs.{}", self.rule.spec.references[j].name.value)),
                )
                .collect();
            let included = match &programs.children[i].include_when {
                None => true,
                Some(w) => match self.eval(w, ctx) {
                    Ok(v) => v.is_true(),
                    Err(e) if !pending.is_empty() && !e.is_budget_exceeded() => true,
                    Err(e) => return Err(e),
                },
            };
            states[i] = match (included, pending.is_empty(), is_live) {
                (false, _, _) => ChildState::LeftOut,
                (true, true, _) => ChildState::Render,
                (true, false, true) => ChildState::Held(pending),
                (true, false, false) => ChildState::Waits(pending),
            };
        }
        Ok(states)
    }

    /// For each reference, whether a child waits for it (`waitFor: [refs.<name>]`) and it
    /// is not ready: absent (an optional one missing), a `selector` that matches nothing,
    /// or its `readyWhen` (over `ref`, the object or list found) not true.
    fn refs_not_ready(
        &self,
        ctx: &BTreeMap<&'static str, Value>,
        observed: &Observed,
    ) -> Result<Vec<bool>, RenderError> {
        let programs = self.running().borrow_dependent();
        let references = &self.rule.spec.references;
        let mut out = vec![false; references.len()];
        for (j, r) in references.iter().enumerate() {
            if !self.ref_waits.iter().any(|w| w.contains(&j)) {
                continue;
            }
            let found = match observed.refs.get(r.name.as_str()) {
                None | Some(Json::Null) => None,
                Some(Json::Array(list)) if list.is_empty() => None,
                Some(v) => Some(v),
            };
            let ready = match (
                found,
                programs
                    .references
                    .get(j)
                    .and_then(|p| p.ready_when.as_ref()),
            ) {
                (None, _) => false,
                (Some(_), None) => true,
                (Some(v), Some(rw)) => {
                    let mut local = ctx.clone();
                    local.insert("ref", val(v));
                    self.eval(rw, &local)?.is_true()
                }
            };
            out[j] = !ready;
        }
        Ok(out)
    }

    /// The children that wait or are held ([`child_states`](Self::child_states)), each
    /// with the names it waits for.
    ///
    /// `rendered`, for the status: the children the render produced objects for. The
    /// status sees the children as the reconcile left them, so a dependency may be ready
    /// now that was not when the render skipped its dependent: a child with dependencies
    /// (and without `forEach`, which may render nothing) that is neither live nor
    /// rendered still waits, for all of them.
    pub(super) fn waiting(
        &self,
        ctx: &BTreeMap<&'static str, Value>,
        observed: &Observed,
        readiness: &LiveReadiness,
        rendered: Option<&BTreeSet<usize>>,
    ) -> Result<Vec<(usize, Vec<String>)>, RenderError> {
        let programs = self.running().borrow_dependent();
        let children = &self.rule.spec.children;
        let deps = self.wait_for_positions();
        let states = self.child_states(ctx, observed, readiness)?;
        let mut out = Vec::new();
        for (i, state) in states.into_iter().enumerate() {
            match state {
                ChildState::Waits(on) | ChildState::Held(on) => out.push((i, on)),
                ChildState::Render
                    if !deps[i].is_empty()
                        && rendered.is_some_and(|r| !r.contains(&i))
                        && programs.children[i].for_each.is_none()
                        && self.rule.spec.finalize_child() != Some(i)
                        && observed
                            .children
                            .get(children[i].name.as_str())
                            .is_none_or(|l| l.is_empty()) =>
                {
                    out.push((
                        i,
                        deps[i]
                            .iter()
                            .map(|&j| children[j].name.value.clone())
                            .collect(),
                    ));
                }
                _ => {}
            }
        }
        Ok(out)
    }
}

/// What one render does with a child.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum ChildState {
    /// It is rendered.
    Render,
    /// Left out: its `includeWhen` is false, or a child it waits for is left out. A live
    /// one is pruned.
    LeftOut,
    /// Not live, and what it waits for (these: child names, `refs.<name>`) is not live
    /// and ready yet: not created.
    Waits(Vec<String>),
    /// Live, but a child it waits for is gone or a reference it waits for is not ready
    /// (these): held as it is, neither rendered nor pruned, until that is over.
    Held(Vec<String>),
}

#[cfg(test)]
#[path = "ready_refs_tests.rs"]
mod refs_tests;
