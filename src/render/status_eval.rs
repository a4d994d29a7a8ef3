//! Evaluating the parent's status: the rule's status fields (JSONPath, expressions,
//! cases) and readiness, within the parent's budget (split out of `mod.rs`).

use std::collections::BTreeMap;

use minijinja::value::Value;
use serde_json::{Map, Value as Json};

use super::budget::ParentBudget;
use super::{
    CaseResult, CompiledRule, DesiredChild, Observed, Programs, Readiness, RenderError,
    StatusProgram, StatusReport, val,
};
use crate::meta::JsonAt;
use crate::rules::ChildRule;

impl CompiledRule {
    /// The status Rulebook would write, given the desired and the live children.
    /// Uses a fresh budget; see [`status_within`](Self::status_within).
    pub fn status(
        &self,
        parent: &Json,
        observed: &Observed,
        desired: &[DesiredChild],
    ) -> Result<StatusReport, RenderError> {
        self.status_within(parent, observed, desired, &mut self.budget())
    }

    /// [`status`](Self::status), spending from `budget` (the one the parent's
    /// [`render_within`](Self::render_within) used).
    pub fn status_within(
        &self,
        parent: &Json,
        observed: &Observed,
        desired: &[DesiredChild],
        budget: &mut ParentBudget,
    ) -> Result<StatusReport, RenderError> {
        let _active = budget.enter();
        let programs = self.compiled.borrow_dependent();
        // The template context is built only when something evaluates over it, and the
        // JSONPath document only with the parts the paths read: both copy the parent and
        // the live children.
        let (ctx, live_readiness) = if self.status_needs_context() {
            self.context_and_readiness(parent, observed)?
        } else {
            Default::default()
        };
        let root = self.status_document(parent, observed);
        let mut fields = Map::new();
        for (field, program) in &programs.status {
            let value = match program {
                StatusProgram::JsonPath {
                    query,
                    singular,
                    default,
                    ..
                } => {
                    let found = jsonpath_rust::query::js_path_process(query, &root)
                        .map(|refs| {
                            refs.into_iter()
                                .map(|r| r.val().clone())
                                .collect::<Vec<_>>()
                        })
                        .unwrap_or_default();
                    match (found.len(), singular) {
                        (0, _) => default.clone(),
                        (1, true) => found.into_iter().next(),
                        _ => Some(Json::Array(found)),
                    }
                }
                StatusProgram::Expr(e) => to_json(self.eval(e, &ctx)?),
                StatusProgram::Value(v) => Some(v.clone()),
                StatusProgram::Cases(cases) => {
                    let mut result = None;
                    for (when, then) in cases {
                        let hit = match when {
                            Some(w) => self.eval(w, &ctx)?.is_true(),
                            None => true,
                        };
                        if hit {
                            result = match then {
                                CaseResult::Value(v) => Some(v.clone()),
                                CaseResult::Expr(e) => to_json(self.eval(e, &ctx)?),
                                CaseResult::Unset => None,
                            };
                            break;
                        }
                    }
                    result
                }
            };
            if let Some(v) = value
                && !v.is_null()
            {
                fields.insert(field.clone(), v);
            }
        }
        let mut readiness = self.readiness(&ctx, observed, desired)?;
        let rendered: std::collections::BTreeSet<usize> = desired.iter().map(|d| d.child).collect();
        readiness.waiting = self
            .waiting(&ctx, observed, &live_readiness, Some(&rendered))?
            .into_iter()
            .map(|(i, on)| {
                format!(
                    "{} (for {})",
                    self.rule.spec.children[i].name.value,
                    on.join(", ")
                )
            })
            .collect();
        Ok(StatusReport { fields, readiness })
    }

    /// Whether the status stage evaluates an expression (a status field, `readyWhen`,
    /// the `includeWhen` of a child that waits) or needs the children's readiness.
    fn status_needs_context(&self) -> bool {
        let programs = self.compiled.borrow_dependent();
        self.uses_ready
            || programs.status.iter().any(|(_, p)| {
                !matches!(p, StatusProgram::JsonPath { .. } | StatusProgram::Value(_))
            })
            || programs.children.iter().any(|c| c.ready_when.is_some())
            || self
                .rule
                .spec
                .children
                .iter()
                .any(|c| !c.wait_for.is_empty())
    }

    /// What the status JSONPaths read: `parent`, `children` and `refs`, each only when
    /// a path may start there.
    fn status_document(&self, parent: &Json, observed: &Observed) -> Json {
        let programs = self.compiled.borrow_dependent();
        let mut roots = std::collections::BTreeSet::new();
        for (_, p) in &programs.status {
            if let StatusProgram::JsonPath { root, .. } = p {
                match root {
                    Some(r) => {
                        roots.insert(*r);
                    }
                    None => roots.extend(["parent", "children", "refs"]),
                }
            }
        }
        let mut doc = Map::new();
        for r in roots {
            let part = match r {
                "parent" => parent.clone(),
                "children" => observed_json(&self.rule.spec.children, programs, observed),
                _ => serde_json::to_value(&observed.refs).unwrap_or_default(),
            };
            doc.insert(r.to_string(), part);
        }
        Json::Object(doc)
    }

    /// Whether the finalize step is over: `doneWhen` over the parent and the live
    /// finalize child `child` (false when the rule has no finalize step).
    pub fn finalize_done(
        &self,
        parent: &Json,
        child: &Json,
        budget: &mut ParentBudget,
    ) -> Result<bool, RenderError> {
        let _active = budget.enter();
        let Some(done_when) = &self.compiled.borrow_dependent().done_when else {
            return Ok(false);
        };
        let mut ctx = self.context(parent, &Observed::default())?;
        ctx.insert("child", val(child));
        Ok(self.eval(done_when, &ctx)?.is_true())
    }

    fn readiness(
        &self,
        ctx: &BTreeMap<&'static str, Value>,
        observed: &Observed,
        desired: &[DesiredChild],
    ) -> Result<Readiness, RenderError> {
        let programs = self.compiled.borrow_dependent();
        let mut missing = Vec::new();
        let mut not_ready = Vec::new();
        for d in desired {
            let live = observed.children.get(&d.name).and_then(|list| {
                list.iter().find(|o| {
                    o.at(&["metadata", "name"]).and_then(Json::as_str) == Some(d.object_name())
                })
            });
            let Some(live) = live else {
                missing.push(d.label());
                continue;
            };
            if let Some(rw) = &programs.children[d.child].ready_when {
                let mut local = ctx.clone();
                local.insert("child", val(&live));
                if let Some(i) = d.index {
                    local.insert("index", Value::from(i));
                }
                if !self.eval(rw, &local)?.is_true() {
                    not_ready.push(d.label());
                }
            }
        }
        Ok(Readiness {
            missing,
            not_ready,
            waiting: Vec::new(),
        })
    }
}

/// `children` as JSONPath sees it: objects by name, lists for `forEach`.
fn observed_json(children: &[ChildRule], programs: &Programs<'_>, observed: &Observed) -> Json {
    let mut out = Map::new();
    for (i, c) in children.iter().enumerate() {
        let live = observed.children.get(c.name.as_str());
        if programs.children[i].for_each.is_some() {
            out.insert(
                c.name.value.clone(),
                Json::Array(live.cloned().unwrap_or_default()),
            );
        } else if let Some(o) = live.and_then(|l| l.first()) {
            out.insert(c.name.value.clone(), o.clone());
        }
    }
    Json::Object(out)
}

fn to_json(v: Value) -> Option<Json> {
    if v.is_undefined() || v.is_none() {
        return None;
    }
    serde_json::to_value(&v).ok()
}
