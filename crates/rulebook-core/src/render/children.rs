//! Rendering one parent's children: `forEach` and `includeWhen`, each template render
//! within the parent's budget, and the checks and decoration that make the rendered
//! text an object Rulebook can apply (split out of `mod.rs`, which holds compiling).

use std::collections::BTreeMap;

use minijinja::value::Value;
use serde_json::{Map, Value as Json};

use super::budget::{self, ParentBudget};
use super::ready::ChildState;
use super::{
    CompiledRule, DesiredChild, Expr, Observed, ParentInfo, RenderError, Scope, describe, env,
    labels, object_hash,
};
use crate::meta::JsonAt;
use crate::rules::ChildRule;

/// What a render gives: the desired children, and the live children held as they are.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rendered {
    pub desired: Vec<DesiredChild>,
    /// Names (in `spec.children`) of the children held: live, not rendered, not to be
    /// pruned, because a child they wait for is gone.
    pub held: Vec<String>,
}

impl CompiledRule {
    /// The desired children of `parent`, in rule order, fully decorated (namespace,
    /// labels, annotations, controller ownerReference) as they would be applied.
    /// `scope(i)` says whether child `i` is namespaced (from discovery, or assumed).
    /// Uses a fresh budget; see [`render_within`](Self::render_within).
    pub fn render(
        &self,
        parent: &Json,
        observed: &Observed,
        scope: &dyn Fn(usize) -> Scope,
    ) -> Result<Vec<DesiredChild>, RenderError> {
        self.render_within(parent, observed, scope, &mut self.budget())
    }

    /// [`render`](Self::render), spending from `budget`: pass the same budget to
    /// [`status_within`](Self::status_within) so one parent's render and status share it.
    /// The finalize child (`spec.deletion.finalize.child`) is never among them.
    pub fn render_within(
        &self,
        parent: &Json,
        observed: &Observed,
        scope: &dyn Fn(usize) -> Scope,
        budget: &mut ParentBudget,
    ) -> Result<Vec<DesiredChild>, RenderError> {
        self.render_selected(parent, observed, scope, budget, false)
    }

    /// The finalize child of a parent being deleted, rendered from the parent alone (no
    /// live children): `None` when the rule has none or its `includeWhen` is false.
    pub fn render_finalize_within(
        &self,
        parent: &Json,
        scope: &dyn Fn(usize) -> Scope,
        budget: &mut ParentBudget,
    ) -> Result<Option<DesiredChild>, RenderError> {
        let out = self.render_selected(parent, &Observed::default(), scope, budget, true)?;
        Ok(out.into_iter().next())
    }

    /// [`render_within`](Self::render_within), and the names of the live children held
    /// as they are (neither rendered nor to be pruned): a child they wait for is gone
    /// (`ready.rs`, [`ChildState::Held`]).
    pub fn render_holding_within(
        &self,
        parent: &Json,
        observed: &Observed,
        scope: &dyn Fn(usize) -> Scope,
        budget: &mut ParentBudget,
    ) -> Result<Rendered, RenderError> {
        let _active = budget.enter();
        let (ctx, readiness) = self.context_and_readiness(parent, observed)?;
        let states = self.child_states(&ctx, observed, &readiness)?;
        let held = states
            .iter()
            .enumerate()
            .filter(|(_, s)| matches!(s, ChildState::Held(_)))
            .map(|(i, _)| self.rule.spec.children[i].name.value.clone())
            .collect();
        let desired = self.render_states(parent, &ctx, scope, Some(&states))?;
        Ok(Rendered { desired, held })
    }

    /// Renders the children that are (`finalize`) or are not the finalize child.
    fn render_selected(
        &self,
        parent: &Json,
        observed: &Observed,
        scope: &dyn Fn(usize) -> Scope,
        budget: &mut ParentBudget,
        finalize: bool,
    ) -> Result<Vec<DesiredChild>, RenderError> {
        if !finalize {
            return Ok(self
                .render_holding_within(parent, observed, scope, budget)?
                .desired);
        }
        let _active = budget.enter();
        let (ctx, _) = self.context_and_readiness(parent, observed)?;
        self.render_states(parent, &ctx, scope, None)
    }

    /// Renders the children whose state is [`ChildState::Render`]; with no `states`,
    /// the finalize child alone, when its `includeWhen` holds.
    fn render_states(
        &self,
        parent: &Json,
        ctx: &BTreeMap<&'static str, Value>,
        scope: &dyn Fn(usize) -> Scope,
        states: Option<&[ChildState]>,
    ) -> Result<Vec<DesiredChild>, RenderError> {
        let info = ParentInfo::of(parent);
        let programs = self.running().borrow_dependent();
        let env = self.running().borrow_owner();
        let finalize_child = self.rule.spec.finalize_child();
        let mut out = Vec::new();
        for (i, c) in self.rule.spec.children.iter().enumerate() {
            let p = &programs.children[i];
            match states {
                Some(states) => {
                    if finalize_child == Some(i) || states.get(i) != Some(&ChildState::Render) {
                        continue;
                    }
                }
                None => {
                    if finalize_child != Some(i) {
                        continue;
                    }
                    if let Some(w) = &p.include_when
                        && !self.eval(w, ctx)?.is_true()
                    {
                        continue;
                    }
                }
            }
            let items = self.for_each_items(p.for_each.as_ref(), ctx)?;
            let template_path = self
                .template_files
                .get(c.template.as_str())
                .cloned()
                .unwrap_or_else(|| c.template.value.clone());
            let tmpl = env
                .get_template(&c.template)
                .map_err(|e| RenderError::new(template_path.clone(), None, describe(&e)))?;
            for (idx, item) in items.into_iter().enumerate() {
                out.push(self.render_item(
                    (i, c),
                    (&tmpl, &template_path),
                    ctx,
                    item.map(|v| (idx, v)),
                    (&info, scope(i)),
                )?);
            }
        }
        self.refuse_duplicates(&out)?;
        Ok(out)
    }

    /// The items of a `forEach`: one `None` without it; refused when the expression
    /// gives something other than a list, or more items than the limit.
    fn for_each_items(
        &self,
        for_each: Option<&Expr<'_>>,
        ctx: &BTreeMap<&'static str, Value>,
    ) -> Result<Vec<Option<Value>>, RenderError> {
        let Some(e) = for_each else {
            return Ok(vec![None]);
        };
        let v = self.eval(e, ctx)?;
        if v.is_undefined() || v.is_none() {
            return Ok(vec![]);
        }
        if !matches!(
            v.kind(),
            minijinja::value::ValueKind::Seq | minijinja::value::ValueKind::Iterable
        ) {
            return Err(RenderError::new(
                self.file.clone(),
                Some(e.line),
                // The value itself is not quoted: it may come from a Secret.
                format!(
                    "rule '{}': {}: gives a {}, not a list",
                    self.name,
                    e.key,
                    v.kind()
                ),
            ));
        }
        let len = v.len().unwrap_or(0);
        if len > self.limits.max_for_each {
            return Err(RenderError::budget(
                self.file.clone(),
                Some(e.line),
                format!(
                    "rule '{}': {}: {len} items, more than the limit of {}",
                    self.name, e.key, self.limits.max_for_each
                ),
            ));
        }
        let iter = v.try_iter().map_err(|err| {
            RenderError::new(
                self.file.clone(),
                Some(e.line),
                format!(
                    "rule '{}': {}: not a list: {}",
                    self.name,
                    e.key,
                    describe(&err)
                ),
            )
        })?;
        Ok(iter.take(self.limits.max_for_each).map(Some).collect())
    }

    /// One rendered child: the template against the context (with `item` and `index`
    /// for a `forEach` item), parsed, checked and decorated, its hash recorded.
    fn render_item(
        &self,
        (i, c): (usize, &ChildRule),
        (tmpl, template_path): (&minijinja::Template<'_, '_>, &str),
        ctx: &BTreeMap<&'static str, Value>,
        item: Option<(usize, Value)>,
        (info, scope): (&ParentInfo<'_>, Scope),
    ) -> Result<DesiredChild, RenderError> {
        let mut local = ctx.clone();
        let index = item.as_ref().map(|(idx, _)| *idx);
        if let Some((idx, item)) = item {
            local.insert("item", item);
            local.insert("index", Value::from(idx));
        }
        let text = self.render_one(tmpl, template_path, &local)?;
        let object = parse_rendered(&text)
            .map_err(|(line, message)| RenderError::new(template_path, line, message))?;
        let mut object = self
            .check_and_decorate(c, object, info, scope, index)
            .map_err(|message| RenderError::new(template_path, None, message))?;
        let hash = object_hash(&object);
        set_annotation(&mut object, labels::DESIRED_HASH, &hash);
        Ok(DesiredChild {
            child: i,
            name: c.name.value.clone(),
            index,
            object,
            hash,
        })
    }

    /// Two children rendering the same object would fight each other.
    fn refuse_duplicates(&self, out: &[DesiredChild]) -> Result<(), RenderError> {
        let mut seen = BTreeMap::new();
        for d in out {
            let key = (
                d.api_version().to_string(),
                d.kind().to_string(),
                d.object_name().to_string(),
            );
            if let Some(first) = seen.insert(key.clone(), d.label()) {
                return Err(RenderError::new(
                    self.file.clone(),
                    None,
                    format!(
                        "rule '{}': children {first} and {} both render {} {}",
                        self.name,
                        d.label(),
                        key.1,
                        key.2
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Renders one template against the active budget: refused when the budget is
    /// spent, output charged as it is written, fuel added after.
    pub(super) fn render_one(
        &self,
        tmpl: &minijinja::Template<'_, '_>,
        path: &str,
        ctx: &BTreeMap<&'static str, Value>,
    ) -> Result<String, RenderError> {
        budget::before_evaluation().map_err(|m| RenderError::budget(path, None, m))?;
        let mut w = env::CappedWriter {
            buf: Vec::new(),
            limit: self.limits.max_output_bytes,
        };
        let captured = tmpl
            .render_captured_to(ctx, &mut w)
            .map_err(|e| RenderError::from_minijinja(path, e.line().map(|l| l as u64), "", &e))?;
        let fuel = captured.state().fuel_levels().map_or(0, |(used, _)| used);
        budget::add_fuel(fuel).map_err(|m| RenderError::budget(path, None, m))?;
        Ok(String::from_utf8_lossy(&w.buf).into_owned())
    }

    fn check_and_decorate(
        &self,
        c: &ChildRule,
        mut object: Json,
        parent: &ParentInfo<'_>,
        scope: Scope,
        index: Option<usize>,
    ) -> Result<Json, String> {
        if super::role_refs::is_binding(c) {
            let allowed = self.bindable.get(c.name.as_str());
            super::role_refs::check_rendered(&object, allowed)?;
        }
        let Some(map) = object.as_object_mut() else {
            return Err("the template must render one YAML mapping (an object)".into());
        };
        check_kind(map, c)?;
        let meta = map
            .entry("metadata")
            .or_insert_with(|| Json::Object(Map::new()));
        let Some(meta) = meta.as_object_mut() else {
            return Err("metadata must be a mapping".into());
        };
        match meta.get("name").and_then(Json::as_str) {
            Some(n) if !n.is_empty() => check_object_name("metadata.name", n)?,
            _ => return Err("the rendered object has no metadata.name".into()),
        }
        if let Some(n) = meta.get("namespace").and_then(Json::as_str) {
            check_object_name("metadata.namespace", n)?;
        }
        let targets = self.rule.spec.target_namespaces.as_deref();
        place(meta, scope, parent.namespace, targets, &c.kind.value)?;
        if parent.namespace.is_none() {
            self.check_target(meta, c)?;
        }
        let labels_map = meta
            .entry("labels")
            .or_insert_with(|| Json::Object(Map::new()));
        let Some(labels_map) = labels_map.as_object_mut() else {
            return Err("metadata.labels must be a mapping".into());
        };
        labels_map.insert(labels::MANAGED_BY.into(), labels::MANAGED_BY_VALUE.into());
        labels_map.insert(labels::RULE.into(), self.name.clone().into());
        labels_map.insert(labels::OWNER.into(), parent.uid.into());
        labels_map.insert(labels::CHILD.into(), c.name.value.clone().into());
        let ann = meta
            .entry("annotations")
            .or_insert_with(|| Json::Object(Map::new()));
        let Some(ann) = ann.as_object_mut() else {
            return Err("metadata.annotations must be a mapping".into());
        };
        // The rule version is recorded on the parent (`status.ruleVersion`), so that a
        // rule edit rewrites only the children whose content changes.
        ann.remove(labels::RULE_VERSION);
        ann.remove(labels::DESIRED_HASH);
        match index {
            Some(i) => {
                ann.insert(labels::INDEX.into(), i.to_string().into());
            }
            None => {
                ann.remove(labels::INDEX);
            }
        }
        set_ownership(meta, c, parent)?;
        for forbidden in [
            "uid",
            "resourceVersion",
            "generation",
            "creationTimestamp",
            "managedFields",
        ] {
            meta.remove(forbidden);
        }
        map.remove("status");
        Ok(object)
    }
}

impl CompiledRule {
    /// A cluster-scoped parent's child: its namespace (or, for a Namespace, its name) is
    /// one of the rule's `targetNamespaces` (`targets.rs`).
    fn check_target(&self, meta: &Map<String, Json>, c: &ChildRule) -> Result<(), String> {
        let targets = self.rule.spec.target_namespaces.as_deref();
        let (ns, what) = if c.kind.as_str() == "Namespace" && c.api_version.as_str() == "v1" {
            (
                meta.get("name").and_then(Json::as_str),
                "the rendered Namespace",
            )
        } else {
            (
                meta.get("namespace").and_then(Json::as_str),
                "the child's namespace",
            )
        };
        match ns {
            Some(ns) if !super::targets::allowed(targets, ns) => {
                Err(super::targets::refusal(targets, ns, what))
            }
            _ => Ok(()),
        }
    }
}

/// The rendered `apiVersion` and `kind` are the rule's (filled in when left out).
fn check_kind(map: &mut Map<String, Json>, c: &ChildRule) -> Result<(), String> {
    for (key, want) in [
        ("apiVersion", &c.api_version.value),
        ("kind", &c.kind.value),
    ] {
        match map.get(key).and_then(Json::as_str) {
            Some(got) if got == want => {}
            Some(got) => {
                return Err(format!(
                    "rendered {key} '{got}', but the rule declares '{want}'"
                ));
            }
            None => {
                map.insert(key.to_string(), Json::String(want.clone()));
            }
        }
    }
    Ok(())
}

/// Where a child lives: a namespaced parent's children in its own namespace, or in one
/// of the rule's `targetNamespaces` when the template names it (the rule author's list:
/// a parent's author chooses within it, never outside, issue 47); a cluster-scoped
/// parent's namespaced children where the template says (else `default`); a
/// cluster-scoped child only under a cluster-scoped parent.
fn place(
    meta: &mut Map<String, Json>,
    scope: Scope,
    parent_namespace: Option<&str>,
    targets: Option<&[crate::rules::Loc<String>]>,
    kind: &str,
) -> Result<(), String> {
    match (scope, parent_namespace) {
        (Scope::Namespaced, None) => {
            // A cluster-scoped parent places its namespaced children where the template says.
            if meta.get("namespace").and_then(Json::as_str).is_none() {
                meta.insert("namespace".into(), Json::String("default".into()));
            }
        }
        (Scope::Namespaced, Some(ns)) => match meta.get("namespace").and_then(Json::as_str) {
            Some(got) if got != ns => match targets {
                Some(t) if super::targets::allowed(Some(t), got) => {}
                Some(t) => {
                    return Err(super::targets::refusal(
                        Some(t),
                        got,
                        "the child's namespace",
                    ));
                }
                None => {
                    return Err(format!(
                        "the rendered object is in namespace '{got}'; children live in the parent's namespace '{ns}' (or in the rule's spec.targetNamespaces, which it has not)"
                    ));
                }
            },
            _ => {
                meta.insert("namespace".into(), Json::String(ns.to_string()));
            }
        },
        (Scope::Cluster, Some(_)) => {
            return Err(format!(
                "{} is cluster-scoped and the parent is namespaced: a cluster-scoped child cannot be owned by a namespaced parent",
                kind
            ));
        }
        (Scope::Cluster, None) => {
            meta.remove("namespace");
        }
    }
    Ok(())
}

/// Who owns the child: a controller ownerReference, or, for an `Orphan` child, none
/// and the annotations that say whose it is.
fn set_ownership(
    meta: &mut Map<String, Json>,
    c: &ChildRule,
    parent: &ParentInfo<'_>,
) -> Result<(), String> {
    // A namespaced parent's child in another namespace (`targetNamespaces`) carries no
    // ownerReference either: a namespaced owner must be in its dependent's namespace,
    // and the garbage collector deletes a dependent whose owner it cannot find there.
    let elsewhere = parent.namespace.filter(|ns| {
        meta.get("namespace")
            .and_then(Json::as_str)
            .is_some_and(|got| got != *ns)
    });
    let Some(ann) = meta.get_mut("annotations").and_then(Json::as_object_mut) else {
        return Err("metadata.annotations must be a mapping".into());
    };
    match elsewhere {
        Some(ns) => {
            ann.insert(labels::PARENT_NAMESPACE.into(), ns.into());
        }
        None => {
            ann.remove(labels::PARENT_NAMESPACE);
        }
    }
    // An `Orphan` child carries no ownerReference: the garbage collector follows
    // every one (foreground deletion deletes each dependent, whatever its policy and
    // `blockOwnerDeletion`), so it would not outlive every kind of deletion. Its
    // owner label and recorded policy say whose it is; its parent's name, for its
    // watch events.
    match c.deletion_policy.annotation() {
        Some(policy) => {
            ann.insert(labels::DELETION_POLICY.into(), policy.into());
            ann.insert(labels::PARENT_NAME.into(), parent.name.into());
            meta.remove("ownerReferences");
        }
        None if elsewhere.is_some() => {
            ann.remove(labels::DELETION_POLICY);
            ann.insert(labels::PARENT_NAME.into(), parent.name.into());
            meta.remove("ownerReferences");
        }
        None => {
            ann.remove(labels::DELETION_POLICY);
            ann.remove(labels::PARENT_NAME);
            meta.insert(
                "ownerReferences".into(),
                serde_json::json!([{
                    "apiVersion": parent.api_version,
                    "kind": parent.kind,
                    "name": parent.name,
                    "uid": parent.uid,
                    "controller": true,
                }]),
            );
        }
    }
    Ok(())
}

/// The YAML budget for one rendered object: a Kubernetes object is at most about
/// 1.5 MiB, so these bounds are generous for real templates and stop alias bombs and
/// deep nesting written into a template fast. Set here, not left to the crate's defaults.
pub(super) fn rendered_yaml_options() -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_events = 250_000;
    budget.max_aliases = 1_000;
    budget.max_anchors = 1_000;
    budget.max_recorded_anchor_events = 100_000;
    budget.max_recorded_anchor_bytes = 4 << 20;
    budget.max_depth = 64;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options.legacy_octal_numbers = true;
    options
}

/// Parses one rendered template: a single YAML mapping.
pub(super) fn parse_rendered(text: &str) -> Result<Json, (Option<u64>, String)> {
    // The plain YAML most templates render is read without the full parser; anything else
    // (and every error) is the full parser's.
    if let Some(object) = super::fastyaml::parse(text) {
        return Ok(object);
    }
    let docs: Vec<Json> = serde_saphyr::from_multiple_with_options(text, rendered_yaml_options())
        .map_err(|e| {
        (
            e.location().map(|l| l.line()),
            format!(
                "the rendered output is not valid YAML: {}",
                crate::rules::yaml_message(&e)
            ),
        )
    })?;
    let mut docs: Vec<Json> = docs.into_iter().filter(|d| !d.is_null()).collect();
    match docs.len() {
        1 => Ok(docs.remove(0)),
        0 => Err((None, "the template rendered no object".into())),
        n => Err((
            None,
            format!("the template rendered {n} objects; a template renders exactly one"),
        )),
    }
}

fn set_annotation(object: &mut Json, key: &str, value: &str) {
    if let Some(ann) = object
        .at_mut(&["metadata", "annotations"])
        .and_then(Json::as_object_mut)
    {
        ann.insert(key.to_string(), Json::String(value.to_string()));
    }
}

/// Names go into request URLs: refuse, at render time, what is never a valid object
/// name of any kind (the API server's path-segment rules, plus characters that would
/// change the URL or cannot be in any name), so the parent gets a clear `RenderFailed`
/// instead of a request for another object. Kind-specific rules (DNS subdomain, label)
/// stay with the API server.
pub fn check_object_name(field: &str, name: &str) -> Result<(), String> {
    let bad = name
        .chars()
        .find(|c| matches!(c, '/' | '%' | '?' | '#' | '\\') || c.is_whitespace() || c.is_control());
    let why = if name.len() > 253 {
        Some(format!("is {} bytes long (at most 253)", name.len()))
    } else if name == "." || name == ".." {
        Some("may not be '.' or '..'".to_string())
    } else {
        bad.map(|c| format!("may not contain {c:?}"))
    };
    match why {
        Some(why) => Err(format!(
            "the rendered {field} {} {why}: object names are DNS subdomains (lowercase letters, digits, '-' and '.')",
            quoted_name(name)
        )),
        None => Ok(()),
    }
}

/// The name quoted whole (as JSON quotes it, one of the forms the reconcile's redaction
/// looks for), or — longer than 64 characters — not at all: a part of it could be the
/// start of a Secret's value that the redaction, which looks for whole values, would not
/// find.
fn quoted_name(name: &str) -> String {
    match name.chars().nth(64) {
        Some(_) => format!("({} bytes, not quoted)", name.len()),
        None => serde_json::Value::from(name).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_would_change_the_request_url_are_refused() {
        for bad in [
            "../../x/configmaps/v",
            "a%2Fb",
            "v/status",
            "v?dryRun=All",
            "c#f",
            ".",
            "..",
            "a b",
            "a\u{7f}",
        ] {
            assert!(check_object_name("metadata.name", bad).is_err(), "{bad:?}");
        }
        let long = "a".repeat(254);
        let err = check_object_name("metadata.name", &long).unwrap_err();
        assert!(err.contains("254 bytes"), "{err}");
        // A long name is not quoted in part (a part of a Secret's value would escape
        // redaction); a short one whole.
        let long = format!("{}/x", "s".repeat(100));
        let err = check_object_name("metadata.name", &long).unwrap_err();
        assert!(!err.contains("sss") && err.contains("102 bytes"), "{err}");
        let err = check_object_name("metadata.name", "a/b").unwrap_err();
        assert!(err.contains("\"a/b\""), "{err}");
        // A control character as JSON escapes it (Rust's `\u{1}` is no form the
        // redaction looks for).
        let err = check_object_name("metadata.name", "a\u{1}b").unwrap_err();
        assert!(err.contains("\"a\\u0001b\""), "{err}");
        for good in ["web-config", "a.b.c", "system:aggregate-to-view", "x"] {
            assert!(check_object_name("metadata.name", good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn a_mis_indented_rendered_line_is_a_yaml_error_on_its_line() {
        // Read untyped, so the parser's error is never preceded by a `missing field`
        // (rules::yaml): a line indented one space less or more than its siblings.
        for (text, line, message) in [
            (
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n labels: {}\ndata: {}\n",
                5,
                "did not find expected key",
            ),
            (
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n   labels: {}\n",
                5,
                "mapping values are not allowed",
            ),
        ] {
            let (got_line, got) = parse_rendered(text).unwrap_err();
            assert_eq!(got_line, Some(line), "{got}");
            assert!(
                got.starts_with("the rendered output is not valid YAML: ") && got.contains(message),
                "{got}"
            );
        }
    }
}
