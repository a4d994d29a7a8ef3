//! Readiness of the live children before rendering: what `waitFor` and the `ready(...)`
//! helper need. A child is ready when it exists and every one of its live objects passes
//! its `readyWhen` (no `readyWhen`: it exists) — the same meaning the parent's `Ready`
//! condition gives it.

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

    /// The children that wait: included (`includeWhen`), not live yet, with a `waitFor`
    /// child that is not live and ready. Each with the names it waits for.
    ///
    /// `rendered`, for the status: the children the render produced objects for. The
    /// status sees the children as the reconcile left them, so a dependency may be ready
    /// now that was not when the render skipped its dependent: a child with `waitFor`
    /// (and without `forEach`, which may render nothing) that is neither live nor
    /// rendered still waits, for all its `waitFor`.
    pub(super) fn waiting(
        &self,
        ctx: &BTreeMap<&'static str, Value>,
        observed: &Observed,
        readiness: &LiveReadiness,
        rendered: Option<&BTreeSet<usize>>,
    ) -> Result<Vec<(usize, Vec<String>)>, RenderError> {
        let programs = self.running().borrow_dependent();
        let mut out = Vec::new();
        for (i, c) in self.rule.spec.children.iter().enumerate() {
            if c.wait_for.is_empty()
                || observed
                    .children
                    .get(c.name.as_str())
                    .is_some_and(|l| !l.is_empty())
            {
                continue;
            }
            let mut pending: BTreeSet<&str> = c
                .wait_for
                .iter()
                .map(|w| w.as_str())
                .filter(|w| !readiness.child_ready(w))
                .collect();
            if pending.is_empty()
                && let Some(rendered) = rendered
                && !rendered.contains(&i)
                && programs.children[i].for_each.is_none()
            {
                pending = c.wait_for.iter().map(|w| w.as_str()).collect();
            }
            if pending.is_empty() {
                continue;
            }
            if let Some(w) = &programs.children[i].include_when
                && !self.eval(w, ctx)?.is_true()
            {
                continue;
            }
            out.push((i, pending.into_iter().map(str::to_string).collect()));
        }
        Ok(out)
    }
}
