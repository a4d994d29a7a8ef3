//! Evaluating the parent's status: the rule's status fields (JSONPath, expressions,
//! cases) and readiness, within the parent's budget (split out of `mod.rs`).

use std::collections::BTreeMap;

use jsonpath_rust::parser::model::JpQuery;
use minijinja::value::Value;
use serde_json::{Map, Value as Json};

use super::budget::ParentBudget;
use super::{
    AllOf, CaseResult, CompiledRule, DesiredChild, Observed, Programs, Readiness, RenderError,
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
        let programs = self.running().borrow_dependent();
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
                StatusProgram::JsonPath { .. } => {
                    self.jsonpath_value(field, program, &root, observed, desired)?
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

    /// The value of a status JSONPath over `root` (`allOf`: only the complete list).
    fn jsonpath_value(
        &self,
        field: &str,
        program: &StatusProgram<'_>,
        root: &Json,
        observed: &Observed,
        desired: &[DesiredChild],
    ) -> Result<Option<Json>, RenderError> {
        let StatusProgram::JsonPath {
            query,
            singular,
            default,
            descends,
            all_of,
            ..
        } = program
        else {
            return Ok(None);
        };
        if let Some(all_of) = all_of {
            let children = &self.rule.spec.children;
            return Ok(
                all_of_list(all_of, root, observed, desired, children).or_else(|| default.clone())
            );
        }
        if *descends && descendant_path_bytes(root, DESCENDANT_PATH_BYTES) > DESCENDANT_PATH_BYTES {
            return Err(RenderError::budget(
                self.file.clone(),
                None,
                format!(
                    "rule '{}': spec.status.{field}: the JSONPath's `..` would walk more than {} MiB of paths over this parent (its depth times its keys' lengths)",
                    self.name,
                    DESCENDANT_PATH_BYTES >> 20
                ),
            ));
        }
        let found = jsonpath_rust::query::js_path_process(query, root)
            .map(|refs| {
                refs.into_iter()
                    .map(|r| r.val().clone())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        Ok(match (found.len(), singular) {
            (0, _) => default.clone(),
            (1, true) => found.into_iter().next(),
            _ => Some(Json::Array(found)),
        })
    }

    /// Whether anything the rule evaluates may read more of the live child `child` (its
    /// index in `spec.children`) than its metadata: a template or expression that names
    /// `children`, its `readyWhen`, the finalize step (which reads its finalize child), or
    /// a status JSONPath into it past `metadata` (one that may start anywhere counts).
    /// When no child of a kind is read so, its cache keeps metadata only: drift is told
    /// from managedFields, never from values.
    pub fn reads_child_content(&self, child: usize) -> bool {
        let programs = self.compiled.borrow_dependent();
        let Some(spec) = self.rule.spec.children.get(child) else {
            return true;
        };
        if self.reads_children
            || programs
                .children
                .get(child)
                .is_none_or(|c| c.ready_when.is_some())
            || self.rule.spec.finalize_child() == Some(child)
        {
            return true;
        }
        programs.status.iter().any(|(_, p)| match p {
            StatusProgram::JsonPath { query, root, .. } => match root {
                Some("children") => path_reads_content(query, &spec.name.value),
                Some(_) => false,
                None => true,
            },
            // Expressions that name `children` set `reads_children`.
            StatusProgram::Expr(_) | StatusProgram::Value(_) | StatusProgram::Cases(_) => false,
        })
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
        let Some(done_when) = &self.running().borrow_dependent().done_when else {
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
        let programs = self.running().borrow_dependent();
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

/// The list an `allOf` path gives, or `None` until it is complete: every object the
/// render wants of the child the path starts in is live, there is at least one element,
/// and every element gives exactly one value (not `null`) for the rest of the path.
fn all_of_list(
    a: &AllOf,
    root: &Json,
    observed: &Observed,
    desired: &[DesiredChild],
    children: &[ChildRule],
) -> Option<Json> {
    if let Some(i) = a.child {
        let live = observed
            .children
            .get(children.get(i)?.name.as_str())
            .map(Vec::as_slice)
            .unwrap_or_default();
        let all_live = desired.iter().filter(|d| d.child == i).all(|d| {
            live.iter().any(|o| {
                o.at(&["metadata", "name"]).and_then(Json::as_str) == Some(d.object_name())
            })
        });
        if !all_live {
            return None;
        }
    }
    let elements = jsonpath_rust::query::js_path_process(&a.elements, root).ok()?;
    if elements.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(elements.len());
    for e in elements {
        let mut found = jsonpath_rust::query::js_path_process(&a.each, e.val()).ok()?;
        let one = found.pop().map(|r| r.val())?;
        if !found.is_empty() || one.is_null() {
            return None;
        }
        out.push(one.clone());
    }
    Some(Json::Array(out))
}

/// `allOf: true` needs a path whose elements are decidable: exactly one list segment
/// (`[*]`, a slice, a filter, several selectors) and no descendant segment (`..`). Gives
/// the path up to and including that segment (the elements) and the rest, from each
/// element (singular).
pub(super) fn split_all_of(q: &JpQuery) -> Result<(JpQuery, JpQuery), String> {
    use jsonpath_rust::parser::model::{Segment, Selector};
    let single = |sel: &Selector| matches!(sel, Selector::Name(_) | Selector::Index(_));
    let mut list = None;
    for (at, s) in q.segments.iter().enumerate() {
        let is_list = match s {
            Segment::Descendant(_) => {
                return Err("allOf cannot go with a descendant segment (`..`): \
                            its elements are not one list"
                    .into());
            }
            Segment::Selector(sel) => !single(sel),
            Segment::Selectors(sels) => !(sels.len() == 1 && single(&sels[0])),
        };
        if is_list {
            if list.is_some() {
                return Err(format!(
                    "allOf needs a path with one list segment; '{q}' has more, so which \
                     elements must all resolve is ambiguous"
                ));
            }
            list = Some(at);
        }
    }
    let Some(at) = list else {
        return Err(format!(
            "allOf needs a path that gives a list ([*], a slice or a filter where the \
             elements are); '{q}' gives one value"
        ));
    };
    let elements = JpQuery::new(q.segments[..=at].to_vec());
    let each = JpQuery::new(q.segments[at + 1..].to_vec());
    Ok((elements, each))
}

fn to_json(v: Value) -> Option<Json> {
    if v.is_undefined() || v.is_none() {
        return None;
    }
    serde_json::to_value(&v).ok()
}

/// Whether a JSONPath that starts at `children` may read child `name` past its metadata:
/// only `$.children.<name or another selector>.metadata…` does not.
fn path_reads_content(q: &JpQuery, name: &str) -> bool {
    use jsonpath_rust::parser::model::{Segment, Selector};
    let one = |s: &Segment| -> Option<Selector> {
        match s {
            Segment::Selector(sel) => Some(sel.clone()),
            Segment::Selectors(sels) if sels.len() == 1 => Some(sels[0].clone()),
            _ => None,
        }
    };
    let mut segments = q.segments.iter();
    if !matches!(segments.next().and_then(one), Some(Selector::Name(c)) if c == "children") {
        return true;
    }
    match segments.next().and_then(one) {
        // Another child.
        Some(Selector::Name(n)) if n != name => false,
        // This child, or any: past metadata?
        _ => !matches!(
            segments.next().and_then(one),
            Some(Selector::Name(m)) if m == "metadata"
        ),
    }
}

/// What a descendant segment may walk over one parent's status document, in bytes of
/// paths: jsonpath-rust collects every node below the start with its whole path as a
/// string before it selects.
pub(super) const DESCENDANT_PATH_BYTES: usize = 16 << 20;

/// The bytes of the paths of every node of `doc` (each node's depth times its keys'
/// lengths, roughly as jsonpath-rust writes them), counted until past `limit`: a parent
/// nested deep with long keys fails alone rather than take the operator's memory.
pub(super) fn descendant_path_bytes(doc: &Json, limit: usize) -> usize {
    let mut total = 0usize;
    let mut stack: Vec<(&Json, usize)> = vec![(doc, 1)];
    while let Some((node, path)) = stack.pop() {
        let children: Box<dyn Iterator<Item = (usize, &Json)>> = match node {
            Json::Object(m) => Box::new(m.iter().map(|(k, v)| (k.len() + 4, v))),
            Json::Array(a) => Box::new(a.iter().map(|v| (8, v))),
            _ => continue,
        };
        for (step, child) in children {
            let at = path + step;
            total = total.saturating_add(at);
            if total > limit {
                return total;
            }
            stack.push((child, at));
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use crate::render::{CompiledRule, Limits};
    use crate::rules::Sources;
    use std::sync::Arc;

    /// `extra`: lines for the `web` child; `spec`: lines at the level of `children`.
    fn compile(status: &str, extra: &str, spec: &str, template: &str) -> Arc<CompiledRule> {
        let rule = format!(
            "apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: r
spec:
  parent:
    apiVersion: test.rulebook.dev/v1
    kind: P
{spec}  children:
    - name: config
      apiVersion: v1
      kind: ConfigMap
      template: t.yaml
    - name: web
      apiVersion: apps/v1
      kind: Deployment
      template: t.yaml
{extra}  status:
{status}"
        );
        let sources = Sources {
            default_rollout: None,
            rule_files: vec![("rules/r.yaml".to_string(), rule)],
            templates: [(
                "t.yaml".to_string(),
                ("templates/t.yaml".to_string(), template.to_string()),
            )]
            .into(),
        };
        let set =
            crate::render::compile(&sources, &Limits::default()).unwrap_or_else(|d| panic!("{d}"));
        set.rules.values().next().unwrap().clone()
    }

    const T: &str =
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ parent.metadata.name }}\n";

    fn reads(status: &str) -> (bool, bool) {
        let r = compile(status, "", "", T);
        (r.reads_child_content(0), r.reads_child_content(1))
    }

    #[test]
    fn only_what_the_rule_may_read_past_metadata_is_content_read() {
        // Metadata only, by any spelling.
        assert_eq!(
            reads(
                "    a: \"$.children.config.metadata.name\"\n    b: \"$['children']['web']['metadata']['uid']\"\n"
            ),
            (false, false)
        );
        // Past metadata: that child only.
        assert_eq!(
            reads("    a: \"$.children.web.status.readyReplicas\"\n"),
            (false, true)
        );
        assert_eq!(reads("    a: \"$.children.config.data\"\n"), (true, false));
        // The whole child, any child, or a path that may start anywhere: all of them.
        assert_eq!(reads("    a: \"$.children.config\"\n"), (true, false));
        assert_eq!(reads("    a: \"$.children.*.status\"\n"), (true, true));
        assert_eq!(reads("    a: \"$..status\"\n"), (true, true));
        // The parent only.
        assert_eq!(reads("    a: \"$.parent.spec.x\"\n"), (false, false));
        // An expression or template that names `children`: everything.
        assert_eq!(
            reads("    a:\n      expr: \"children.config.metadata.name\"\n"),
            (true, true)
        );
        let t = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ children.web.metadata.name | default('x') }}\n";
        let r = compile("    a: \"$.parent.spec.x\"\n", "", "", t);
        assert!(r.reads_child_content(0) && r.reads_child_content(1));
    }

    /// A `..` path over a parent nested deep with long keys fails that parent with the
    /// budget, before jsonpath-rust builds a path string for every node; over an ordinary
    /// parent it works.
    #[test]
    fn a_descendant_path_over_a_deep_parent_is_bounded() {
        let r = compile("    names: \"$..name\"\n", "", "", T);
        let key = "k".repeat(10_000);
        let mut deep = serde_json::json!({"name": "bottom"});
        for _ in 0..200 {
            deep = serde_json::json!({ key.clone(): deep });
        }
        let parent = serde_json::json!({"metadata": {"name": "p"}, "spec": deep});
        let observed = crate::render::Observed::default();
        let err = r
            .status(&parent, &observed, &[])
            .err()
            .unwrap_or_else(|| panic!("a deep parent's `..` path went through"));
        assert!(err.is_budget_exceeded(), "{err}");
        assert!(err.to_string().contains("spec.status.names"), "{err}");
        let small = serde_json::json!({"metadata": {"name": "p"}, "spec": {"a": {"name": "x"}}});
        let report = r
            .status(&small, &observed, &[])
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(report.fields.get("names").is_some(), "{:?}", report.fields);
        assert!(super::descendant_path_bytes(&small, usize::MAX) < 200);
    }

    #[test]
    fn ready_when_and_the_finalize_child_read_content() {
        let status = "    a: \"$.parent.spec.x\"\n";
        let r = compile(
            status,
            "      readyWhen: \"child.status.ready | default(false)\"\n",
            "",
            T,
        );
        assert!(!r.reads_child_content(0) && r.reads_child_content(1));
        let r = compile(
            status,
            "",
            "  deletion:\n    finalize:\n      child: config\n      doneWhen: \"true\"\n",
            T,
        );
        assert!(r.reads_child_content(0) && !r.reads_child_content(1));
        // Out of range: read, to be safe.
        assert!(r.reads_child_content(7));
    }
}

#[cfg(test)]
#[path = "status_all_of_tests.rs"]
mod all_of_tests;
